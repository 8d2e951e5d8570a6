"""Schedules: their rows, their one due task each, and the firing of a tick.

A schedule's task (kind ``schedule``, run id ``schedule:<id>``, name ``<id>``) is due at
its next tick plus jitter. Firing reads the schedule under a row lock, plans from the
time of the commit (``_schedules.plan``), applies the overlap policy against the
schedule's live runs (the last tick's and any triggered by hand), starts the tick's run
(its id ``<id>@<tick>`` exists at most once) and moves the task to the next tick, all in
one transaction: whichever worker fires, a tick starts at most one run, and a change
made meanwhile (pause, new spec) is what the firing sees.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..._errors import RunFinishedError, RunNotFoundError, ScheduleNotFoundError
from ..._history import RunStatus, Task
from ..._schedules import (
    BUFFER_RECHECK,
    ScheduleInfo,
    ScheduleSpec,
    jittered,
    next_tick,
    plan,
    tick_run_id,
)
from ..._serde import dumps
from ._tx import _Tx

_COLS = (
    "schedule_id, workflow, queue, spec, paused, next_at, last_tick, last_run_id, fired, "
    "skipped, note, created_at, updated_at, version, input, buffered, tenant"
)


def _task_id(schedule_id: str) -> str:
    return f"schedule:{schedule_id}"


def _info(row: Any) -> ScheduleInfo:
    return ScheduleInfo(
        schedule_id=row[0],
        workflow=row[1],
        queue=row[2],
        spec=ScheduleSpec.from_json(json.loads(row[3])),
        paused=bool(row[4]),
        next_at=None if row[5] is None else float(row[5]),
        last_tick=None if row[6] is None else float(row[6]),
        last_run_id=row[7],
        fired=int(row[8]),
        skipped=int(row[9]),
        note=row[10],
        created_at=float(row[11]),
        updated_at=float(row[12]),
        version=int(row[13]),
        input=json.loads(row[14]),
        buffered=None if row[15] is None else float(row[15]),
    )


def _row(tx: _Tx, schedule_id: str, lock: bool = False) -> Any:
    row = tx.execute(
        f"SELECT {_COLS} FROM schedules WHERE schedule_id = ?{tx.for_update if lock else ''}",
        (schedule_id,),
    ).fetchone()
    return None if row is None else _opened(tx, row)


def _opened(tx: _Tx, row: Any) -> tuple[Any, ...]:
    """A schedule's row with its input opened if sealed."""
    row = tuple(row)
    return (*row[:14], tx.open(row[14], f"schedule {row[0]!r}, input"), *row[15:])


def _set_task(tx: _Tx, schedule_id: str, queue: str, due: float | None) -> None:
    """The schedule's task, due at ``due`` (None: none). A task leased right now is
    left alone: its firing reads the schedule as this commit leaves it."""
    tid = _task_id(schedule_id)
    leased = tx.execute(
        "SELECT 1 FROM tasks WHERE run_id = ? AND kind = 'schedule' AND lease_owner IS NOT NULL",
        (tid,),
    ).fetchone()
    tx.execute(
        "DELETE FROM tasks WHERE run_id = ? AND kind = 'schedule' AND lease_owner IS NULL",
        (tid,),
    )
    if due is not None and leased is None:
        tx.execute(
            "INSERT INTO tasks (run_id, kind, queue, name, available_at, created_at) "
            "VALUES (?, 'schedule', ?, ?, ?, ?)",
            (tid, queue, schedule_id, due, tx.now),
        )
        tx.ready.add(queue)


def _put_schedule(
    tx: _Tx,
    schedule_id: str,
    workflow: str,
    queue: str,
    input: str,
    spec: ScheduleSpec,
    tenant: str | None,
    paused: bool,
    note: str | None,
) -> tuple[ScheduleInfo, bool]:
    """Create or change a schedule; (the schedule, whether anything changed). The same
    declaration again (a redeploy) changes nothing, so its next tick stays. A
    declaration never resumes a paused schedule (``paused=True`` pauses it; only a
    resume un-pauses), and while it is paused its note is the pause's: an operator's
    pause and its reason survive deploys. Otherwise a new note is stored alone."""
    spec_text = dumps(spec.to_json())
    old = _row(tx, schedule_id, lock=True)
    if old is not None and old[4]:
        paused, note = True, old[10]
    if old is not None and (old[1], old[2], old[3], old[14], bool(old[4]), old[16]) == (
        workflow,
        queue,
        spec_text,
        input,
        paused,
        tenant,
    ):
        if note == old[10]:
            return _info(old), False
        tx.execute(  # the note alone: no new version, the next tick stays
            "UPDATE schedules SET note = ?, updated_at = ? WHERE schedule_id = ?",
            (note, tx.now, schedule_id),
        )
        return _info(_row(tx, schedule_id)), True
    nxt = None if paused else next_tick(spec, tx.now)
    if old is None:
        tx.execute(
            "INSERT INTO schedules (schedule_id, workflow, queue, input, spec, tenant, paused, "
            "note, next_at, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                schedule_id,
                workflow,
                queue,
                tx.seal(input),
                spec_text,
                tenant,
                int(paused),
                note,
                nxt,
                tx.now,
                tx.now,
            ),
        )
        due = None if nxt is None else jittered(schedule_id, spec, nxt)
        _set_task(tx, schedule_id, queue, due)
    else:
        if old[2] != queue:  # the task moves to the new queue
            tx.execute(
                "UPDATE tasks SET queue = ? WHERE run_id = ? AND kind = 'schedule'",
                (queue, _task_id(schedule_id)),
            )
        changes = {
            "workflow": workflow,
            "queue": queue,
            "input": tx.seal(input),
            "spec": spec_text,
            "tenant": tenant,
            "paused": int(paused),
            "note": note,
        }
        _new_version(tx, schedule_id, changes, queue, spec, nxt)
    return _info(_row(tx, schedule_id)), True


def _get_schedule(tx: _Tx, schedule_id: str) -> ScheduleInfo:
    row = _row(tx, schedule_id)
    if row is None:
        raise ScheduleNotFoundError(schedule_id)
    return _info(row)


def _list_schedules(tx: _Tx, limit: int) -> list[ScheduleInfo]:
    rows = tx.execute(
        f"SELECT {_COLS} FROM schedules ORDER BY schedule_id LIMIT ?", (limit,)
    ).fetchall()
    return [_info(_opened(tx, r)) for r in rows]


def _pause_schedule(tx: _Tx, schedule_id: str, paused: bool, note: str | None) -> bool:
    """Pause (no tick fires; ticks missed meanwhile never do) or resume (from the next
    tick after now). True if it changed."""
    row = _row(tx, schedule_id, lock=True)
    if row is None:
        raise ScheduleNotFoundError(schedule_id)
    info = _info(row)
    if info.paused == paused:
        return False
    nxt = None if paused else next_tick(info.spec, tx.now)
    # a pause's note replaces the schedule's (its reason); a resume leaves it as it is
    changes: dict[str, Any] = {"paused": int(paused)}
    if paused and note is not None:
        changes["note"] = note
    _new_version(tx, schedule_id, changes, info.queue, info.spec, nxt)
    return True


def _new_version(
    tx: _Tx,
    schedule_id: str,
    changes: dict[str, Any],
    queue: str,
    spec: Any,
    nxt: float | None,
) -> None:
    """Write ``changes`` as the schedule's next version (a buffered tick is dropped: it
    belonged to the old one) and move its one task to the next tick."""
    sets = "".join(f"{column} = ?, " for column in changes)  # column names from code only
    tx.execute(
        f"UPDATE schedules SET {sets}next_at = ?, buffered = NULL, version = version + 1, "
        "updated_at = ? WHERE schedule_id = ?",
        (*changes.values(), nxt, tx.now, schedule_id),
    )
    _set_task(tx, schedule_id, queue, None if nxt is None else jittered(schedule_id, spec, nxt))


def _delete_schedule(tx: _Tx, schedule_id: str) -> None:
    """Delete a schedule (its runs stay); a firing in flight finds nothing and stops."""
    if _row(tx, schedule_id, lock=True) is None:
        raise ScheduleNotFoundError(schedule_id)
    tx.execute("DELETE FROM schedules WHERE schedule_id = ?", (schedule_id,))
    tx.execute(
        "DELETE FROM tasks WHERE run_id = ? AND kind = 'schedule' AND lease_owner IS NULL",
        (_task_id(schedule_id),),
    )


def _trigger_schedule(tx: _Tx, schedule_id: str) -> str:
    """Start the schedule's run now, outside its ticks and its overlap policy; its id."""
    row = _row(tx, schedule_id, lock=True)
    if row is None:
        raise ScheduleNotFoundError(schedule_id)
    info = _info(row)
    run_id = tick_run_id(schedule_id, tx.now).replace("@", "@trigger-", 1)
    _start(tx, info, run_id, tx.now, row[16], row[14])
    # last_run_id stays the last tick's run: a firing finds triggered runs by their ids
    tx.execute(
        "UPDATE schedules SET fired = fired + 1, updated_at = ? WHERE schedule_id = ?",
        (tx.now, schedule_id),
    )
    return run_id


def _fire_schedule(tx: _Tx, task: Task) -> None:
    """The schedule task came due: fire its tick (or not, by policy) and move it on."""
    _check_fence(tx, task)
    schedule_id = task.name or ""
    row = _row(tx, schedule_id, lock=True)
    if row is None or row[4] or row[5] is None:  # deleted, paused or ended
        tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
        return
    info = _info(row)
    tenant, input_text = row[16], row[14]
    live = _live_runs(tx, info)
    previous_live = bool(live)
    if info.buffered is not None and not previous_live:
        # the run that held the buffered tick back has ended: that tick goes first
        run_id = tick_run_id(schedule_id, info.buffered)
        started = _start(tx, info, run_id, info.buffered, tenant, input_text)
        tx.execute(
            "UPDATE schedules SET buffered = NULL, last_run_id = ?, fired = fired + ?, "
            "updated_at = ? WHERE schedule_id = ?",
            (run_id, int(started), tx.now, schedule_id),
        )
        _move(tx, task, info.next_at if info.next_at is not None else tx.now, info)
        return
    tick, skipped, after = plan(info.spec, info.next_at or tx.now, tx.now, schedule_id)
    fire = tick is not None
    buffered = info.buffered
    if tick is not None and previous_live:
        policy = info.spec.overlap
        if policy == "skip":
            fire, skipped = False, skipped + 1
        elif policy == "buffer_one":
            fire = False
            if buffered is None:
                buffered = tick
            else:
                skipped += 1  # one tick is held back already: later ones are dropped
        elif policy == "cancel_previous":
            for run_id in live:
                _cancel(tx, run_id, f"schedule {schedule_id!r} fired its next tick")
    last_run, fired = info.last_run_id, 0
    if fire and tick is not None:
        last_run = tick_run_id(schedule_id, tick)
        fired = int(_start(tx, info, last_run, tick, tenant, input_text))
    nxt = after
    tx.execute(
        "UPDATE schedules SET next_at = ?, last_tick = COALESCE(?, last_tick), "
        "last_run_id = ?, buffered = ?, fired = fired + ?, skipped = skipped + ?, "
        "updated_at = ? WHERE schedule_id = ?",
        (nxt, tick, last_run, buffered, fired, skipped, tx.now, schedule_id),
    )
    _move(tx, task, nxt, dataclasses.replace(info, buffered=buffered))


def _move(tx: _Tx, task: Task, nxt: float | None, info: ScheduleInfo) -> None:
    """Hand the task back, due at the next tick (plus jitter), sooner to look at a
    buffered tick again; or delete it when the schedule has no next tick."""
    if nxt is None and info.buffered is None:
        tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
        return
    due = jittered(info.schedule_id, info.spec, nxt) if nxt is not None else None
    if info.buffered is not None:
        recheck = tx.now + BUFFER_RECHECK
        due = recheck if due is None else min(due, recheck)
    tx.execute(
        "UPDATE tasks SET lease_owner = NULL, available_at = ? WHERE task_id = ?",
        (due, task.task_id),
    )
    tx.ready.add(task.queue)


def _live_runs(tx: _Tx, info: ScheduleInfo) -> list[str]:
    """The schedule's runs still going, which its overlap policy looks at: its last
    tick's run and any run triggered by hand (``<id>@trigger-...``; few, found by id)."""
    live = [info.last_run_id] if info.last_run_id and _is_live(tx, info.last_run_id) else []
    prefix = f"{info.schedule_id}@trigger-"
    rows = tx.execute(
        "SELECT run_id, status FROM runs WHERE run_id >= ? AND run_id < ? ORDER BY run_id",
        (prefix, prefix[:-1] + chr(ord("-") + 1)),
    ).fetchall()
    for run_id, status in rows:
        if not RunStatus(status).is_terminal and run_id not in live:
            live.append(run_id)
    return live


def _is_live(tx: _Tx, run_id: str) -> bool:
    try:
        _live_run(tx, run_id, "overlap")
    except (RunNotFoundError, RunFinishedError):
        return False
    return True


def _start(
    tx: _Tx, info: ScheduleInfo, run_id: str, tick: float, tenant: str | None, input_text: str
) -> bool:
    """Start the run of a tick unless it exists (a tick fires once); True if started."""
    if tx.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone() is not None:
        return False
    _insert_run(
        tx,
        run_id,
        info.workflow,
        info.queue,
        input_text,
        tenant=tenant,
        attrs={
            "schedule": info.schedule_id,
            "tick": tick,
            "started_by": f"schedule {info.schedule_id}",
        },
    )
    tx.ready.add(info.queue)
    return True


# operations of other concerns (imported last: see the package docstring)
from .control import _cancel, _live_run  # noqa: E402
from .runs import _insert_run  # noqa: E402
from .tasks import _check_fence  # noqa: E402
