"""Dead letters, operator retry and fork."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from ..._codec import MARKS
from ..._errors import PayloadError, RunIdConflictError, TetherError
from ..._history import COMMANDS, OUTCOMES, DeadLetter, Event, EventType, RunStatus
from ..._redact import unavailable_text
from ...blobs import BlobError
from ._tx import _error_json, _Tx

_DL_COLS = (
    "id, run_id, step, kind, name, input, error, attempts, reason, created_at, resolved_at, "
    "resolution"
)


class RecoveryError(TetherError):
    """A retry, fork or dead-letter replay cannot be done in the run's current state."""


class _NotRetried(RecoveryError):
    """A retry of the letter's run would not run the letter's step again (raised before
    any write): the replay treats the letter as a step the run's code handled."""


#: seconds a replay's claim on a dead letter (``{"state": "replaying"}``) holds without
#: being renewed: the replaying process renews it while the step runs, so an older claim
#: is one of a process that died mid-replay, and the next replay (or resolve) takes it
CLAIM_TTL = 300.0
#: the resolution of a claim written before claims were renewed (and went stale)
_OLD_CLAIM = json.dumps({"state": "replaying"})


def _open(tx: _Tx, by_id: bool = False) -> tuple[str, tuple[Any, ...]]:
    """The condition (and its arguments) of a letter still open: not resolved, or claimed
    by a replay whose process died (its claim not renewed for ``CLAIM_TTL``).

    A claim's ``resolved_at`` is its time negated (readers see it positive): claims
    are the index's only negative range, so a stale one is found without reading the
    resolved letters (listings and counts stay on the ``dead_letters_open`` index).
    ``by_id`` (one letter, or one run's) also takes over a claim of an earlier version
    (unrenewed, its time positive) once stale."""
    cond = "resolved_at IS NULL OR (resolved_at > ? AND resolved_at < 0)"
    args: tuple[Any, ...] = (CLAIM_TTL - tx.now,)
    if by_id:
        cond += " OR (resolution = ? AND resolved_at < ?)"
        args += (_OLD_CLAIM, tx.now - CLAIM_TTL)
    return f"({cond})", args


def _dead_letters(
    tx: _Tx,
    include_resolved: bool,
    run_id: str | None,
    limit: int,
    letter_id: int | None = None,
    tenant: str | None = None,
) -> list[DeadLetter]:
    where: list[str] = []
    args: list[Any] = []
    if not include_resolved:
        cond, cargs = _open(tx, by_id=letter_id is not None or run_id is not None)
        where.append(cond)
        args.extend(cargs)
    if run_id is not None:
        where.append("run_id = ?")
        args.append(run_id)
    if letter_id is not None:
        where.append("id = ?")
        args.append(letter_id)
    if tenant is not None:
        where.append("run_id IN (SELECT run_id FROM runs WHERE tenant = ?)")
        args.append(tenant)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    rows = tx.execute(
        f"SELECT {_DL_COLS} FROM dead_letters {clause} ORDER BY id LIMIT ?", (*args, limit)
    ).fetchall()
    return [_letter(tx, r) for r in rows]


def _not_open(letter_id: int) -> RecoveryError:
    return RecoveryError(
        f"dead letter {letter_id} does not exist or was already replayed or resolved; "
        "list open ones with app.dead_letters()"
    )


def _claim(claim: str) -> str:
    return json.dumps({"state": "replaying", "claim": claim})


def _claim_dead_letter(tx: _Tx, letter_id: int, claim: str) -> DeadLetter:
    """Claim an open letter for a replay (its resolution says ``replaying`` with the
    ``claim`` token); a claim not renewed for ``CLAIM_TTL`` is taken over."""
    cond, cargs = _open(tx, by_id=True)
    row = tx.execute(
        f"UPDATE dead_letters SET resolved_at = ?, resolution = ? WHERE id = ? "
        f"AND {cond} RETURNING {_DL_COLS}",
        (-tx.now, _claim(claim), letter_id, *cargs),
    ).fetchone()
    if row is None:
        raise _not_open(letter_id)
    return _letter(tx, row)


def _renew_dead_letter_claim(tx: _Tx, letter_id: int, claim: str) -> None:
    tx.execute(
        "UPDATE dead_letters SET resolved_at = ? WHERE id = ? AND resolution = ?",
        (-tx.now, letter_id, _claim(claim)),
    )


def _letter(tx: _Tx, row: Any) -> DeadLetter:
    """A dead letter from its row, its payloads opened if sealed. One that cannot be
    read (a missing blob, a destroyed or absent key) is null and named in
    ``unavailable`` with the reason: listings and resolve need only its ids."""
    row = tuple(row)
    if row[10] is not None and row[10] < 0:  # a replay's claim: its time, negated
        row = (*row[:10], -row[10], *row[11:])
    if tx.codec is None and not any(
        isinstance(v, str) and (v.startswith(MARKS) or '"sealed"' in v) for v in row
    ):
        return DeadLetter.from_row(row)
    where = f"dead letter {row[0]} (run {row[1]!r}, step {row[2]})"
    unavailable: dict[str, str] = {}

    def read(field: str, decode: Callable[[], Any]) -> Any:
        try:
            return decode()
        except (PayloadError, BlobError) as exc:
            unavailable[field] = unavailable_text(exc)
            return None

    error = read(
        "error",
        lambda: _error_json(
            tx.codec, row[6], row[1], f"dead letter {row[0]}, step {row[2]}, error"
        ),
    )
    if "error" in unavailable:  # its type (and its cause's) is kept outside the seal
        try:
            shown = json.loads(row[6])
        except ValueError:
            shown = None
        if isinstance(shown, dict):
            error = {k: v for k, v in shown.items() if k != "sealed"}
    letter = DeadLetter.from_row(
        (
            *row[:5],
            read("input", lambda: tx.open(row[5], f"{where}, input")),
            json.dumps(error) if error is not None else None,
            *row[7:11],
            read("resolution", lambda: tx.open(row[11], f"{where}, resolution")),
        )
    )
    return dataclasses.replace(letter, unavailable=unavailable) if unavailable else letter


def _resolve_dead_letter(
    tx: _Tx, letter_id: int, resolution: Any, claim: str | None = None
) -> None:
    """Record a replay's outcome (``None`` reopens the letter); with ``claim``, only while
    the letter is still held by that claim (one taken over is the other replay's)."""
    mine, margs = (" AND resolution = ?", (_claim(claim),)) if claim is not None else ("", ())
    if resolution is None:  # the replay failed: reopen it
        tx.execute(
            f"UPDATE dead_letters SET resolved_at = NULL, resolution = NULL WHERE id = ?{mine}",
            (letter_id, *margs),
        )
    else:
        # sealed under the run's tenant's key, like the letter itself (crypto-shredding)
        row = tx.execute("SELECT run_id FROM dead_letters WHERE id = ?", (letter_id,)).fetchone()
        sealed = tx.seal(json.dumps(resolution), row[0] if row else None)
        tx.execute(
            f"UPDATE dead_letters SET resolved_at = ?, resolution = ? WHERE id = ?{mine}",
            (tx.now, sealed, letter_id, *margs),
        )


def _close_dead_letter(
    tx: _Tx, letter_id: int, resolution: Any, actor: str, detail: dict[str, Any]
) -> DeadLetter:
    """Resolve an open letter and audit it (``resolve dead letter`` on its run) in one
    transaction: both are written or neither, and a letter no longer open is refused."""
    row = tx.execute("SELECT run_id FROM dead_letters WHERE id = ?", (letter_id,)).fetchone()
    sealed = tx.seal(json.dumps(resolution), row[0]) if row else None
    cond, cargs = _open(tx, by_id=True)
    done = tx.execute(
        f"UPDATE dead_letters SET resolved_at = ?, resolution = ? WHERE id = ? "
        f"AND {cond} RETURNING {_DL_COLS}",
        (tx.now, sealed, letter_id, *cargs),
    ).fetchone()
    if done is None:
        raise _not_open(letter_id)
    _audit(tx, actor, "resolve dead letter", f"run:{done[1]}", detail)
    return _letter(tx, done)


def _pending_work(tx: _Tx, run_id: str, kept: list[Event], run_queue: str, fork: bool) -> None:
    """Re-create tasks for commands in ``kept`` that have no outcome and were not cancelled."""
    done = {e.step for e in kept if e.type in OUTCOMES}
    cancelled = {
        e.data.get("timer_step") or e.data.get("activity_step") or e.data.get("child_step")
        for e in kept
        if e.type
        in (
            EventType.TIMER_CANCELLED,
            EventType.ACTIVITY_CANCEL_REQUESTED,
            EventType.CHILD_CANCEL_REQUESTED,
        )
    }
    for e in kept:
        if e.step is None or e.step in done or e.step in cancelled:
            continue
        if e.type is EventType.ACTIVITY_SCHEDULED:
            hb = (e.data.get("options") or {}).get("heartbeat_timeout")
            if e.data.get("dependency") is not None:
                _ensure_dependency(tx, e.data["dependency"], e.data.get("dependency_limits") or {})
            tx.execute(
                "INSERT INTO tasks (run_id, kind, step, queue, name, payload, options, "
                "available_at, heartbeat_timeout, priority, limit_key, dependency, batch_key, "
                "batch_max, batch_wait, created_at) "
                "VALUES (?, 'activity', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    e.step,
                    e.data["queue"],
                    e.data["name"],
                    tx.seal(json.dumps(e.data.get("args", {})), run_id),
                    json.dumps(e.data.get("options", {})),
                    tx.now,
                    hb,
                    int(e.data.get("priority") or 0),
                    e.data.get("limit_key"),
                    e.data.get("dependency"),
                    *_batch_cols(e.data),
                    tx.now,
                ),
            )
            tx.ready.add(e.data["queue"])
        elif e.type is EventType.TIMER_STARTED:
            tx.execute(
                "INSERT INTO tasks (run_id, kind, step, queue, available_at, created_at) "
                "VALUES (?, 'timer', ?, ?, ?, ?)",
                (run_id, e.step, run_queue, e.data["fire_at"], tx.now),
            )
            tx.ready.add(run_queue)
        elif e.type is EventType.CHILD_STARTED:
            child = e.data["child_run_id"]
            if fork:
                # the fork's tenant (inserted in this operation), as any child takes its
                # parent's: its erasure, retention and key reach the child too
                row = tx.execute("SELECT tenant FROM runs WHERE run_id = ?", (run_id,)).fetchone()
                _insert_run(
                    tx,
                    f"{run_id}/{e.step}",
                    e.data["workflow"],
                    e.data["queue"],
                    json.dumps(e.data.get("input")),
                    run_id,
                    e.step,
                    tenant=row[0] if row else None,
                )
                continue
            # the child's outcome (its chain followed to its last run), or None while it
            # runs: its completion will reach this run
            outcome = _child_outcome(tx, child, e.step)
            if outcome is not None:
                _append(tx, run_id, *outcome)


def _retry_run(tx: _Tx, run_id: str, letter_id: int | None = None) -> None:
    """Retry a failed run from its failed step and mark retried the open letters whose
    work runs again: the run's own letter and its failed step's (a failed child's are
    marked by the child's retry). With ``letter_id`` (a replay of that letter), the
    letter must be open and one of those: otherwise nothing is written (``_NotRetried``)."""
    # locked: a second retry at once waits, then finds the run running and is refused
    status, run_queue, _p, _s, workflow, _t = _run_row(tx, run_id, lock=True)
    cond, cargs = _open(tx, by_id=True)
    letter = None
    if letter_id is not None:  # checked first: a second replay at once finds it marked
        letter = tx.execute(
            f"SELECT run_id, kind, step FROM dead_letters WHERE id = ? AND {cond}",
            (letter_id, *cargs),
        ).fetchone()
        if letter is None:
            raise _not_open(letter_id)
    if status not in (RunStatus.FAILED.value, RunStatus.NEEDS_INTERVENTION.value):
        raise RecoveryError(
            f"run {run_id!r} is {status}: only failed or needs_intervention runs can be "
            "retried (fork it to re-run it from a chosen step: app.fork, or "
            "POST /v1/runs/{id}/fork)"
        )
    events = _live_history(tx, run_id)
    terminal = max(
        (e.seq for e in events if e.type in COMMANDS and e.step is not None and e.type in _ENDINGS),
        default=None,
    )
    last, caught = _last_failure(events)
    # an operator's retry of the run (app.retry, or a replay of the run's own letter)
    # runs its last failed step again, caught or not; a step's letter only when the
    # code did not catch that failure (it may have handled it: refunded, say)
    whole_run = letter is None or letter[1] == "run"
    failures = [last] if last is not None and (whole_run or not caught) else []
    cut = failures[-1].seq if failures else (terminal or events[-1].seq)
    # the step whose letter this retry runs again (a child's letters are its own run's)
    again = (
        failures[-1].step if failures and failures[-1].type is EventType.ACTIVITY_FAILED else None
    )
    if letter is not None and (
        letter[0] != run_id
        or not (letter[1] == "run" or (again is not None and letter[2] == again))
    ):
        raise _NotRetried(f"a retry of run {run_id!r} does not run letter {letter_id} again")
    given_up = {
        e.data.get("child_step") for e in events if e.type is EventType.CHILD_CANCEL_REQUESTED
    }
    if (
        failures
        and failures[-1].type is EventType.CHILD_FAILED
        and failures[-1].step not in given_up  # not a child the code stopped waiting for
    ):
        _retry_child(tx, run_id, failures[-1])  # before any write: it may refuse
    voided_cmd_steps = {
        e.step for e in events if e.seq > cut and e.type in COMMANDS and e.step is not None
    }
    voided = sorted(
        e.seq
        for e in events
        if e.seq == cut
        or (
            e.seq > cut
            and (
                e.type in COMMANDS
                or e.type is EventType.WORKFLOW_TASK_COMPLETED
                or (e.type in OUTCOMES and e.step in voided_cmd_steps)
            )
        )
    )
    voided_set = set(voided)
    kept = [e for e in events if e.seq not in voided_set]
    # steps that succeeded after the failure are voided with it, but their results are
    # offered back: if the code schedules the same activity at the same step again,
    # the recorded result is reused and the step does not run twice
    scheduled = {
        e.step: (e.data.get("name"), e.data.get("args"))
        for e in events
        if e.seq in voided_set and e.type is EventType.ACTIVITY_SCHEDULED
    }
    reuse = {
        str(e.step): {
            "name": scheduled[e.step][0],
            "args": scheduled[e.step][1],
            "result": e.data.get("result"),
        }
        for e in events
        if e.seq in voided_set and e.type is EventType.ACTIVITY_COMPLETED and e.step in scheduled
    }
    tx.execute(
        "UPDATE runs SET status = 'running', output = NULL, error = NULL, completed_at = NULL "
        "WHERE run_id = ?",
        (run_id,),
    )
    _append(tx, run_id, EventType.RUN_RETRIED, None, {"voided": voided, "cut": cut, "reuse": reuse})
    tx.finished[run_id] = None  # no longer finished: waiters woken by its end read it again
    tx.execute("DELETE FROM tasks WHERE run_id = ?", (run_id,))
    _pending_work(tx, run_id, kept, run_queue, fork=False)
    tx.execute(
        f"UPDATE dead_letters SET resolved_at = ?, resolution = ? WHERE run_id = ? AND {cond} "
        "AND (kind = 'run' OR (kind = 'activity' AND step = ?))",
        (tx.now, json.dumps({"state": "retried"}), run_id, *cargs, again),
    )
    _ensure_workflow_task(tx, run_id, run_queue, workflow)


def _retried_failure(events: list[Event]) -> Event | None:
    """The failure ``_retry_run`` voids and runs again: the last step failure (an
    activity's or a child's) before the run's ending, unless the code caught it and went
    on (``_caught``); or None (the code itself failed)."""
    failed, caught = _last_failure(events)
    return None if caught else failed


def _last_failure(events: list[Event]) -> tuple[Event | None, bool]:
    """The last step failure (an activity's or a child's) before the run's ending, and
    whether the run's code caught it and went on (``_caught``)."""
    terminal = max(
        (e.seq for e in events if e.type in COMMANDS and e.step is not None and e.type in _ENDINGS),
        default=None,
    )
    failures = [
        e
        for e in events
        if e.type in (EventType.ACTIVITY_FAILED, EventType.CHILD_FAILED)
        and (terminal is None or e.seq < terminal)
    ]
    if not failures:
        return None, False
    return failures[-1], _caught(events, failures[-1], terminal)


#: commands after a step's failure that show the code went on from it: it called
#: another step or started a timer
_GOING_ON = frozenset(
    {EventType.ACTIVITY_SCHEDULED, EventType.CHILD_STARTED, EventType.TIMER_STARTED}
)
#: commands that show it only when a workflow task recorded them before the run's
#: ending: one the run ends in records them while the failure propagates (``finally``)
_NOTES = frozenset({EventType.STATUS_SET, EventType.MARKER, EventType.PATCH_MARKER})


def _through(marker: Event) -> int:
    """The last incoming event's seq the workflow task closed by ``marker`` had seen."""
    try:
        return int(marker.data.get("through", 0))
    except (TypeError, ValueError):
        return 0


def _caught(events: list[Event], failed: Event, terminal: int | None) -> bool:
    """Whether the run's code caught step failure ``failed`` and went on before the run's
    ending (at seq ``terminal``), and did not end by raising that failure again (an
    ``ActivityError`` of the step's activity, a ``ChildWorkflowError`` of its child
    run): then the run failed by itself, and running the step again would repeat what
    its code had handled (refunded, say).

    It went on when, after the failure, it called another step or started a timer (an
    activity, a child run, a ``sleep``), recorded a status or marker in a workflow task
    before the one the run ended in, or was woken by a signal after a workflow task that
    saw the failure had ended with the run still going (``wait_event`` without a timeout
    records no command). What the code records in the task the run ends in, while the
    failure propagates or is re-raised as another error (a status or marker set in a
    ``finally``, the cancellations of what it was awaiting), is not going on, nor is the
    outcome of a step it had called before the failure."""
    end = terminal if terminal is not None else events[-1].seq + 1
    after = [e for e in events if failed.seq < e.seq < end]
    markers = [e.seq for e in after if e.type is EventType.WORKFLOW_TASK_COMPLETED]
    saw = next(
        (
            e.seq
            for e in after
            if e.type is EventType.WORKFLOW_TASK_COMPLETED and _through(e) >= failed.seq
        ),
        None,
    )
    went_on = any(
        e.type in _GOING_ON
        or (e.type in _NOTES and any(m > e.seq for m in markers))
        or (e.type is EventType.SIGNAL_RECEIVED and saw is not None and e.seq > saw)
        for e in after
    )
    if not went_on:
        return False
    ending = next((e for e in events if e.seq == terminal), None)
    if ending is not None and ending.type is EventType.WORKFLOW_NEEDS_INTERVENTION:
        return False  # a saga's rollback: an undo that failed is what the run waits on
    error = ending.data.get("error") if ending is not None else None
    if not isinstance(error, dict):
        return True
    if failed.type is EventType.ACTIVITY_FAILED:
        name = next(
            (
                e.data.get("name")
                for e in events
                if e.type is EventType.ACTIVITY_SCHEDULED and e.step == failed.step
            ),
            None,
        )
        cause = error.get("cause")
        return not (
            error.get("type") == "ActivityError"
            and isinstance(cause, dict)
            and cause.get("activity") == name
        )
    child = failed.data.get("child_run_id")
    return not (
        error.get("type") == "ChildWorkflowError"
        and isinstance(child, str)
        and f"child run {child!r} " in str(error.get("message") or "")
    )


def _complete_step(
    tx: _Tx, run_id: str, step: int, result: str, actor: str, reason: str
) -> dict[str, Any]:
    """Record ``result`` (encoded JSON) as the outcome of activity step ``step``, set by
    an operator, with its audit entry, in one transaction.

    Taken by a step that has no outcome and no attempt running now (waiting for its
    next retry, or queued), and by the failed step of a failed (or needs_intervention)
    run, which is reopened as ``_retry_run`` would, its step completed instead of run
    again. Refused (``RecoveryError``): a completed step, a running attempt, a step the
    code stopped waiting for or whose failure it handled, a step that is not an
    activity, a run that ended otherwise. Returns what was done (for the caller)."""
    # the step's task first, then the run: the lock order of a worker's completion,
    # which deletes its task (by its fence) before it appends to the run
    task = tx.execute(
        "SELECT task_id, lease_owner, available_at, queue, attempt FROM tasks "
        f"WHERE run_id = ? AND step = ? AND kind = 'activity'{tx.for_update}",
        (run_id, step),
    ).fetchone()
    status, run_queue, _p, _s, workflow, _t = _run_row(tx, run_id, lock=True)
    events = _live_history(tx, run_id)
    where = f"step {step} of run {run_id!r}"
    command = next((e for e in events if e.step == step and e.type in COMMANDS), None)
    if command is None:
        raise RecoveryError(f"run {run_id!r} has no step {step} (yet); see its history")
    if command.type is not EventType.ACTIVITY_SCHEDULED:
        raise RecoveryError(
            f"{where} is a {command.type.value}, not an activity: only an activity's "
            "result can be recorded by an operator"
        )
    name = command.data.get("name")
    outcome = next((e for e in events if e.step == step and e.type in OUTCOMES), None)
    if outcome is not None and outcome.type is EventType.ACTIVITY_COMPLETED:
        by = outcome.data.get("operator")
        how = f"by {by} (an operator)" if by else f"on attempt {outcome.data.get('attempt')}"
        raise RecoveryError(
            f"{where} ({name}) already completed {how}; its recorded result stands "
            "(to run the rest again from before it, fork the run)"
        )
    if any(
        e.type is EventType.ACTIVITY_CANCEL_REQUESTED and e.data.get("activity_step") == step
        for e in events
    ):
        raise RecoveryError(
            f"{where} ({name}) was cancelled by the run's code, which no longer waits for "
            "its result"
        )
    status = RunStatus(status)
    attempts: Any = None
    if status in (RunStatus.FAILED, RunStatus.NEEDS_INTERVENTION):
        failed = _retried_failure(events)
        if failed is None or failed.step != step or failed.type is not EventType.ACTIVITY_FAILED:
            if failed is not None:
                raise RecoveryError(
                    f"run {run_id!r} is {status.value} and its failed step is {failed.step}: "
                    "only that step can be completed to reopen it (or app.retry / app.fork it)"
                )
            caught = (
                f" (it caught step {step}'s failure ({name}) and went on)"
                if outcome is not None and outcome.type is EventType.ACTIVITY_FAILED
                else ""
            )
            raise RecoveryError(
                f"run {run_id!r} is {status.value} and its code failed, not a step{caught}: "
                "no step can be completed to reopen it (app.retry runs its last failed step "
                "again; or app.fork it)"
            )
        attempts = failed.data.get("attempt")
        # its letter is closed by this, not by the retry below (which marks the others)
        resolution = {"state": "completed", "by": actor, "reason": reason}
        tx.execute(
            "UPDATE dead_letters SET resolved_at = ?, resolution = ? WHERE run_id = ? "
            "AND step = ? AND resolved_at IS NULL",
            (tx.now, tx.seal(json.dumps(resolution), run_id), run_id, step),
        )
        _retry_run(tx, run_id)  # reopened from the failed step, as a retry would...
        # ...whose task is not run: the operator's result is its outcome
        tx.execute(
            "DELETE FROM tasks WHERE run_id = ? AND step = ? AND kind = 'activity'",
            (run_id, step),
        )
        reopened = True
    elif status.is_terminal:
        raise RecoveryError(
            f"run {run_id!r} is {status.value}: its steps can no longer be completed "
            f"(fork it to run again from a chosen step: app.fork({run_id!r}, at_step=...))"
        )
    else:
        if outcome is not None:  # a failure its code caught and went on from
            raise RecoveryError(
                f"{where} ({name}) failed and the run's code handled the failure and went "
                "on; a result now would reach no one. If it did its work after all, close "
                "its dead letter with app.resolve_dead_letter(id, note=...)"
            )
        if task is None:
            raise RecoveryError(
                f"{where} ({name}) has no attempt waiting (was the run retried just now?); "
                "see its history and try again"
            )
        task_id, owner, available_at, queue, attempts = task
        if owner is not None and available_at is not None and available_at > tx.now:
            raise RecoveryError(
                f"{where} ({name}) is running now (attempt {attempts} on worker {owner!r}); "
                "wait for the attempt to end: if it fails and waits for a retry, complete "
                "it then; if it succeeds, its result stands"
            )
        # the row goes: a worker whose lease lapsed (stuck, not dead) finds its fence
        # gone and its late result is discarded (LeaseLostError), never recorded twice
        tx.execute("DELETE FROM tasks WHERE task_id = ?", (task_id,))
        tx.ready.add(queue)  # a slot it held under a limit is free
        reopened = False
    # who and why, on the event: the history shows the step completed by an operator
    # (``reason`` is sealed with encryption on, as every event's free text)
    _append(
        tx,
        run_id,
        EventType.ACTIVITY_COMPLETED,
        step,
        {"attempt": attempts if attempts is not None else 0, "operator": actor, "reason": reason},
        {"result": result},
    )
    if not reopened:
        _ensure_workflow_task(tx, run_id, run_queue, workflow)
    detail = {"step": step, "activity": name, "reason": reason, "reopened": reopened}
    _audit(tx, actor, "complete step", f"run:{run_id}", detail)
    return detail


def _retry_child(tx: _Tx, run_id: str, failed: Event) -> None:
    """The step a retry runs again is a child run: retry that child (its own failed step
    runs again, recursively down to a failed grandchild), so its new outcome reaches
    this run. A child that ended otherwise cannot run again: the retry is refused."""
    child = str(failed.data.get("child_run_id") or "")
    info = _get_run(tx, child, True) if child else None
    if info is None or not info.status.is_terminal or info.status is RunStatus.COMPLETED:
        return  # its outcome (a retry of the child by hand, say) reaches this run as it is
    if info.status in (RunStatus.FAILED, RunStatus.NEEDS_INTERVENTION):
        _retry_run(tx, info.run_id)
        return
    at_step = (failed.step or 1) - 1
    raise RecoveryError(
        f"run {run_id!r} failed because its child run {info.run_id!r} ended "
        f"{info.status.value}, and a {info.status.value} run cannot run again; to start "
        f"the child anew, fork the parent before it: app.fork({run_id!r}, at_step={at_step})"
    )


def _fork_run(
    tx: _Tx, run_id: str, new_run_id: str, at_step: int, attrs: dict[str, Any] | None = None
) -> None:
    """Copy ``run_id``'s history up to its outcome of step ``at_step`` into a new run of
    the same tenant; ``attrs`` replace what the run was started with (model pins)."""
    _status, run_queue, _p, _s, workflow, _t = _run_row(tx, run_id)
    if tx.execute("SELECT 1 FROM runs WHERE run_id = ?", (new_run_id,)).fetchone():
        raise RunIdConflictError(new_run_id, "an existing run")
    events = _live_history(tx, run_id)
    cut = next(
        (
            e.seq
            for e in events
            # the first command or outcome of a later step: today's code issues the
            # later steps again (with today's arguments and model pins)
            if (e.type in OUTCOMES and e.step is not None and e.step > at_step)
            or (e.type in COMMANDS and e.step is not None and e.step > at_step)
            or e.type in _ENDINGS
        ),
        None,
    )
    informational = (
        EventType.WORKFLOW_TERMINATED,
        EventType.SUSPENDED,
        EventType.RESUMED,
        EventType.ACTIVITY_ATTEMPT_FAILED,
    )
    # keep everything before the cut, plus later outcomes of steps up to ``at_step``:
    # with no marker after the cut, they are applied in the fork's first new task
    kept = [
        e
        for e in events
        if e.type not in informational
        and (
            cut is None
            or e.seq < cut
            or (e.type in OUTCOMES and e.step is not None and e.step <= at_step)
        )
    ]
    row = tx.execute("SELECT input, tenant, attrs FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    new_attrs = attrs if attrs is not None else (json.loads(row[2]) if row[2] else None)
    tx.execute(
        "INSERT INTO runs (run_id, workflow, status, queue, input, created_at, updated_at, "
        "tenant, attrs) VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?)",
        (
            new_run_id,
            workflow,
            run_queue,
            row[0],
            tx.now,
            tx.now,
            row[1],
            json.dumps(new_attrs) if new_attrs else None,
        ),
    )
    for e in kept:
        data = dict(e.data)
        if e.type is EventType.WORKFLOW_STARTED:
            data["forked_from"] = {"run_id": run_id, "at_step": at_step}
            # what seeds the values its code derives (tether.uuid/random, unless recorded)
            data["seed"] = e.data.get("seed") or run_id
            if new_attrs:
                data["attrs"] = new_attrs
            else:
                data.pop("attrs", None)
        _append(tx, new_run_id, e.type, e.step, data)
    _pending_work(tx, new_run_id, kept, run_queue, fork=True)
    _ensure_workflow_task(tx, new_run_id, run_queue, workflow)


# operations of other concerns (imported last: see the package docstring)
from .batches import _batch_cols  # noqa: E402
from .dependencies import _ensure_dependency  # noqa: E402
from .history import _append, _live_history  # noqa: E402
from .runs import _child_outcome, _get_run, _insert_run, _run_row  # noqa: E402
from .switches import _audit  # noqa: E402
from .tasks import _ensure_workflow_task  # noqa: E402
from .workflow_tasks import _ENDINGS  # noqa: E402
