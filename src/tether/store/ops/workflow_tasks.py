"""Workflow-task results: commands recorded and acted on, the run's end."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from typing import Any

from ..._errors import LeaseLostError, RunFinishedError, RunNotFoundError
from ..._history import INCOMING, EventType, RunStatus, Task
from ..._serde import dumps
from ..base import TASK_REJECTED, Command, WorkflowTaskResult
from ._tx import _compact, _Tx


def _complete_workflow_task(
    tx: _Tx,
    task: Task,
    result: WorkflowTaskResult,
    lease_to: str | None,
    lease_queues: tuple[str, ...],
    lease: float,
    lease_limit: int,
) -> tuple[int, list[Task]]:
    _check_fence(tx, task)
    row = tx.execute(
        "SELECT status, queue, parent_run_id, parent_step, workflow, tenant, next_seq "
        f"FROM runs WHERE run_id = ?{tx.for_update}",
        (task.run_id,),
    ).fetchone()
    if row is None:
        raise RunNotFoundError(task.run_id)
    if RunStatus(row[0]).is_terminal:
        # ended meanwhile (terminated, cancelled while queued...): the result has no run
        tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
        raise LeaseLostError(
            f"run {task.run_id!r} ended ({row[0]}) while its workflow task ran; "
            "the task's result was discarded"
        )
    run = tuple(row[:6])
    if any(c.type in _ENDINGS for c in result.commands) and _newer_incoming(
        tx, task.run_id, result.through
    ):
        # a signal, cancel or result arrived after the task read the history: ending the
        # run now would drop it; the task runs again with it instead
        # (its fence moves on: a retry of this commit, its answer lost, is refused)
        tx.execute(
            "UPDATE tasks SET lease_owner = NULL, available_at = ?, fence = fence + 1 "
            "WHERE task_id = ?",
            (tx.now, task.task_id),
        )
        tx.ready.add(run[1])
        return TASK_REJECTED, []
    marker, leased, ended = _apply_workflow_result(
        tx,
        task.run_id,
        run,
        result,
        [],
        row[6],
        lease_to,
        lease_queues,
        lease,
        lease_limit,
        activate=True,
    )
    if ended:
        return marker, []
    if _newer_incoming(tx, task.run_id, result.through):
        # the task runs again for what came in; its fence moves on, so a retry of this
        # commit (its answer lost with the connection) is refused, not applied twice
        tx.execute(
            "UPDATE tasks SET lease_owner = NULL, available_at = ?, fence = fence + 1 "
            "WHERE task_id = ?",
            (tx.now, task.task_id),
        )
        tx.ready.add(run[1])
    else:
        tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
    return marker, leased


#: commands that end a run (or hand it to the next run of its chain)
_ENDINGS = frozenset(
    {
        EventType.WORKFLOW_COMPLETED,
        EventType.WORKFLOW_FAILED,
        EventType.WORKFLOW_CANCELLED,
        EventType.WORKFLOW_TIMED_OUT,
        EventType.WORKFLOW_NEEDS_INTERVENTION,
        EventType.CONTINUED_AS_NEW,
    }
)


#: events a workflow task consumes, as stored (the start is never "newer")
_INCOMING = (
    "("
    + ",".join(sorted(f"'{t.value}'" for t in INCOMING if t is not EventType.WORKFLOW_STARTED))
    + ")"
)


def _newer_incoming(tx: _Tx, run_id: str, through: int) -> bool:
    """Whether events a workflow task has not seen (after ``through``) wait for it."""
    row = tx.execute(
        f"SELECT 1 FROM events WHERE run_id = ? AND seq > ? AND type IN {_INCOMING} LIMIT 1",
        (run_id, through),
    ).fetchone()
    return row is not None


def _marker(result: WorkflowTaskResult) -> _Pending:
    """The ``WorkflowTaskCompleted`` event closing a workflow task.

    Its JSON is written here (an int and a finite float need no encoder): every step
    writes one.
    """
    raw = {"through": str(int(result.through)), "time": repr(float(result.time))}
    if result.version is not None:
        return (EventType.WORKFLOW_TASK_COMPLETED, None, {"version": result.version}, raw)
    return (EventType.WORKFLOW_TASK_COMPLETED, None, {}, raw)


def _day(at: float) -> str:
    """The UTC date of ``at`` (YYYY-MM-DD)."""
    return time.strftime("%Y-%m-%d", time.gmtime(at))


def _apply_workflow_result(
    tx: _Tx,
    run_id: str,
    run: tuple[Any, ...],
    result: WorkflowTaskResult,
    events: list[_Pending],
    next_seq: int,
    lease_to: str | None,
    lease_queues: tuple[str, ...],
    lease: float,
    lease_limit: int,
    *,
    activate: bool = False,
) -> tuple[int, list[Task], bool]:
    """Record a workflow task's commands and act on them (tasks, children, the end).

    ``run`` is the run's ``_run_row``; ``events`` are appended before the
    commands (the fast path's activity result), all in one history write.
    ``next_seq`` is the run's counter, read under the write lock; the new value is
    written in one update with the end or, with ``activate``, with a run that goes on
    leaving ``pending`` and its ``task_error`` cleared.
    Returns (marker seq, activity tasks leased to ``lease_to``, run ended).
    """
    status, run_queue, parent_run_id, parent_step, workflow, tenant = run
    if result.usage is not None:  # the model calls this task met first: exactly once
        tx.execute(
            "INSERT INTO usage_deltas (tenant, day, tokens, cost) VALUES (?, ?, ?, ?)",
            (tenant or "", _day(result.time), result.usage[0], result.usage[1]),
        )
    if result.holds:  # batch holds replaced by what their batches used (in ``spend``)
        _settle_holds(tx, run_id, result.holds)  # first: holds lock before spend rows
    for scopes, tokens, cost, day in result.spend or ():  # daily budgets': exactly once
        _add_spend(tx, tuple(scopes), day or _day(result.time), tokens, cost)
    if status == RunStatus.SUSPENDED.value:
        lease_to = None  # suspended while this task ran: dispatch nothing locally
    leased: list[Task] = []
    ending: Command | None = None
    for cmd in result.commands:
        events.append((cmd.type, cmd.step, cmd.data, cmd.raw))
        t = cmd.type
        if t is EventType.ACTIVITY_SCHEDULED and cmd.data.get("reused"):
            # a result kept from before an operator's retry: record it, run nothing
            events.append(
                (
                    EventType.ACTIVITY_COMPLETED,
                    cmd.step,
                    {"attempt": 0, "reused": True},
                    {"result": cmd.raw.get("result", "null")},
                )
            )
        elif t is EventType.ACTIVITY_SCHEDULED:
            q = cmd.data["queue"]
            hb_timeout = (cmd.data.get("options") or {}).get("heartbeat_timeout")
            dep = cmd.data.get("dependency")
            # a dependency's work goes through the claim, unless its limiter has nothing
            # to enforce (no limits, not paused by a 429)
            dep_open = dep is None or _ensure_dependency(
                tx, dep, cmd.data.get("dependency_limits") or {}
            )
            batch = _batch_cols(cmd.data)
            local = (
                lease_to is not None
                and q in lease_queues
                and len(leased) < lease_limit
                and dep_open
                and batch[0] is None  # so does a batched call: the claim forms batches
            )
            if local:
                local = not _has_limits(tx, q)  # a limited queue's work goes through the claim
            options = cmd.data.get("options", {})
            values = (
                run_id,
                cmd.step,
                q,
                cmd.data["name"],
                cmd.raw.get("args", "{}"),
                dumps(options),
                tx.now + (hb_timeout or lease) if local else tx.now,
                lease_to if local else None,
                1 if local else 0,
                1 if local else 0,
                hb_timeout,
                int(cmd.data.get("priority") or 0),
                cmd.data.get("limit_key"),
                dep,
                *batch,
                tx.now,
            )
            task = _insert_activity_task(tx, values, options, local)
            if task is not None:
                leased.append(task)
            else:
                tx.ready.add(q)
        elif t is EventType.TIMER_STARTED:
            tx.execute(
                "INSERT INTO tasks (run_id, kind, step, queue, available_at, created_at) "
                "VALUES (?, 'timer', ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (run_id, cmd.step, run_queue, cmd.data["fire_at"], tx.now),
            )
            tx.ready.add(run_queue)
        elif t is EventType.TIMER_CANCELLED:
            tx.execute(
                "DELETE FROM tasks WHERE run_id = ? AND step = ? AND kind = 'timer'",
                (run_id, cmd.data["timer_step"]),
            )
        elif t is EventType.ACTIVITY_CANCEL_REQUESTED:
            target = cmd.data["activity_step"]
            tx.execute(
                "DELETE FROM tasks WHERE run_id = ? AND step = ? AND kind = 'activity' "
                "AND lease_owner IS NULL",
                (run_id, target),
            )
            tx.execute(
                "UPDATE tasks SET cancel_requested = 1 WHERE run_id = ? AND step = ? "
                "AND kind = 'activity'",
                (run_id, target),
            )
        elif t is EventType.CHILD_STARTED:
            child = cmd.data["child_run_id"]
            exists = tx.execute(
                "SELECT parent_run_id FROM runs WHERE run_id = ?", (child,)
            ).fetchone()
            if exists is None:
                _insert_run(
                    tx,
                    child,
                    cmd.data["workflow"],
                    cmd.data["queue"],
                    cmd.raw["input"],
                    run_id,
                    cmd.step,
                    # the parent's tenant: its keys see the child, its key seals it, its
                    # retention and erasure reach it (admission counts top-level runs)
                    tenant=tenant,
                    # a traced parent's context: the child's spans join its trace; and
                    # its model budget (its own, or its share of the parent's)
                    attrs={k: cmd.data[k] for k in ("trace", "budget") if k in cmd.data} or None,
                )
            elif exists[0] == run_id:
                # started again after an operator's retry voided its start: it may have
                # ended meanwhile (its end found this run failed and was not delivered)
                outcome = _child_outcome(tx, child, cmd.step)
                if outcome is not None:
                    events.append(outcome)
            else:
                events.append(
                    (
                        EventType.CHILD_FAILED,
                        cmd.step,
                        {
                            "child_run_id": child,
                            "status": "failed",
                            "error": {
                                "type": "RunIdConflictError",
                                "message": f"run id {child!r} is already used by another run",
                            },
                        },
                        None,
                    )
                )
        elif t is EventType.CHILD_CANCEL_REQUESTED:
            # a child that continued as new is cancelled in its live run
            why = f"parent run {run_id!r} stopped waiting for it"
            with contextlib.suppress(RunNotFoundError, RunFinishedError):
                _cancel(tx, cmd.data["child_run_id"], why)
        elif t is EventType.STATUS_SET:
            tx.execute(
                "UPDATE runs SET custom_status = ? WHERE run_id = ?",
                (tx.seal(cmd.raw.get("value", "null"), run_id), run_id),
            )
        elif t is EventType.MARKER and cmd.data.get("marker") in APPROVAL_MARKERS:
            _apply_approval_marker(tx, run_id, cmd.data["marker"], cmd.raw["value"])
        elif t in _ENDINGS:
            ending = cmd
    events.append(_marker(result))
    marker = _insert_events(tx, run_id, events, next_seq)
    if ending is None:  # the counter, with the status when the run leaves pending
        waiting = None if result.waiting_on is None else _compact(result.waiting_on)
        tx.execute(
            "UPDATE runs SET next_seq = ?, updated_at = ?, waiting_on = ?"
            f"{_ACTIVATE if activate else ''} WHERE run_id = ?",
            (marker + 1, tx.now, waiting, run_id),
        )
        return marker, leased, False
    known = (parent_run_id, parent_step, workflow, tenant)
    # the counter is written by the end's update
    end = functools.partial(
        _finish,
        tx,
        run_id,
        known=known,
        next_seq=marker + 1,
        children=result.children,
        ran=True,
        # what it spent on models, for a parent whose budget it had a share of
        spend=ending.data.get("model_spend"),
    )
    if ending.type is EventType.WORKFLOW_COMPLETED:
        end(RunStatus.COMPLETED, output=ending.raw.get("result", "null"))
    elif ending.type is EventType.WORKFLOW_FAILED:
        end(RunStatus.FAILED, error=ending.data["error"])
    elif ending.type is EventType.WORKFLOW_TIMED_OUT:
        end(RunStatus.TIMED_OUT, error=ending.data.get("error"))
    elif ending.type is EventType.WORKFLOW_NEEDS_INTERVENTION:
        end(RunStatus.NEEDS_INTERVENTION, error=ending.data["error"])
    elif ending.type is EventType.WORKFLOW_CANCELLED:
        end(RunStatus.CANCELLED, error=ending.data.get("error"))
    else:
        nxt = ending.data["next_run_id"]
        # the chain keeps the run's deadline (a task, deleted by the end) and suspension
        deadline = tx.execute(
            "SELECT available_at FROM tasks WHERE run_id = ? AND kind = 'deadline'", (run_id,)
        ).fetchone()
        # ... and what it was started with (a budget, model pins)
        attrs = tx.execute("SELECT attrs FROM runs WHERE run_id = ?", (run_id,)).fetchone()[0]
        end(RunStatus.CONTINUED_AS_NEW, continued_to=nxt)
        _note_chain_head(tx, run_id, nxt)  # operations on the chain's ids go straight there
        _insert_run(
            tx,
            nxt,
            workflow,
            run_queue,
            ending.raw["input"],
            parent_run_id,
            parent_step,
            deadline_at=deadline[0] if deadline else None,
            tenant=tenant,
            attrs=json.loads(attrs) if attrs else None,
        )
        if status == RunStatus.SUSPENDED.value:
            _append(tx, nxt, EventType.SUSPENDED, None, {"carried_from": run_id})
            tx.execute("UPDATE runs SET status = 'suspended' WHERE run_id = ?", (nxt,))
        # signals the run received and its code never took go on to the next run, in
        # the order they came: a signal sent to a chain is never dropped at a link; one
        # sent with an id keeps it (its row in signal_ids still names where it arrived)
        for signal in json.loads(ending.raw.get("signals") or "[]"):
            data = {"name": signal["name"], "carried_from": run_id}
            if signal.get("signal_id") is not None:
                data["signal_id"] = signal["signal_id"]
            _append(
                tx,
                nxt,
                EventType.SIGNAL_RECEIVED,
                None,
                data,
                {"payload": dumps(signal["payload"])},
            )
    return marker, [], True


#: leaving pending for running, a failed workflow task's error cleared (a suspended
#: run stays suspended)
_ACTIVATE = (
    ", status = CASE status WHEN 'pending' THEN 'running' ELSE status END, task_error = NULL"
)


def _fail_workflow_task(tx: _Tx, task: Task, error: str, retry_at: float) -> None:
    _check_fence(tx, task)
    tx.execute(
        "UPDATE runs SET task_error = ? WHERE run_id = ?",
        (tx.seal(error, task.run_id, plain_ok=True), task.run_id),
    )
    tx.execute(
        "UPDATE tasks SET lease_owner = NULL, available_at = ? WHERE task_id = ?",
        (retry_at, task.task_id),
    )


# operations of other concerns (imported last: see the package docstring)
from .ai import _add_spend, _settle_holds  # noqa: E402
from .approvals import APPROVAL_MARKERS, _apply_approval_marker  # noqa: E402
from .batches import _batch_cols  # noqa: E402
from .control import _cancel, _note_chain_head  # noqa: E402
from .dependencies import _ensure_dependency  # noqa: E402
from .history import _append, _insert_events, _Pending  # noqa: E402
from .queues import _has_limits  # noqa: E402
from .runs import _child_outcome, _finish, _insert_run  # noqa: E402
from .tasks import _check_fence, _insert_activity_task  # noqa: E402
