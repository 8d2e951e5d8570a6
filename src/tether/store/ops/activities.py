"""Activity results: completion (and the one-commit fast path), failure,
dead letters of exhausted steps.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..._history import EventType, RunStatus, Task
from ..base import WorkflowTaskResult
from ._tx import Op, _Tx


def _complete_activity(
    tx: _Tx,
    task: Task,
    result: str,
    lease_to: str | None,
    lease_queues: tuple[str, ...],
    lease: float,
) -> Task | None:
    _take_task(tx, task)
    _append_completed(tx, task, result)
    return _after_activity(tx, task, lease_to, lease_queues, lease)


def _append_completed(tx: _Tx, task: Task, result: str) -> None:
    """Record an activity attempt's result (``result`` is already-encoded JSON)."""
    _append(
        tx,
        task.run_id,
        EventType.ACTIVITY_COMPLETED,
        task.step,
        {"attempt": task.attempt},
        {"result": result},
    )


def _frees_a_slot(tx: _Tx, task: Task) -> bool:
    """Whether the end of ``task`` frees room under a limit (so claimers should wake)."""
    if task.dependency is not None and _dependency_limited(tx, task.dependency):
        return True
    return _has_limits(tx, task.queue)


def _after_activity(
    tx: _Tx, task: Task, lease_to: str | None, lease_queues: tuple[str, ...], lease: float
) -> Task | None:
    """Wake claimers of a limited queue and make sure the run gets a workflow task."""
    if _frees_a_slot(tx, task):
        tx.ready.add(task.queue)  # a slot under its concurrency cap is free: wake claimers
    _, run_queue, _p, _s, workflow, _t = _run_row(tx, task.run_id)
    return _ensure_workflow_task(
        tx, task.run_id, run_queue, workflow, lease_to, lease_queues, lease
    )


def _fail_activity(
    tx: _Tx,
    task: Task,
    error: dict[str, Any],
    retry_at: float | None,
    lease_to: str | None,
    lease_queues: tuple[str, ...],
    lease: float,
) -> Task | None:
    _check_fence(tx, task)
    if task.dependency is not None:
        # rate-limit feedback reshapes the dependency's limiter (not the queue): every
        # step waiting for it waits out the Retry-After or the x-ratelimit reset
        retry_after = error.get("retry_after") if error.get("rate_limited") else None
        until = _dependency_feedback(tx, None, task.dependency, retry_after, error)
        if until is not None:
            error = {**error, "dependency_paused_until": until}
        tx.ready.add(task.queue)
    elif error.get("rate_limited") and error.get("retry_after") is not None:
        # HTTP 429 with Retry-After: the dependency asked everyone to back off
        until = _pause_on_429(tx, task.queue, float(error["retry_after"]))
        if until is not None:
            error = {**error, "queue_paused_until": until}
    elif _has_limits(tx, task.queue):
        tx.ready.add(task.queue)  # a slot under its concurrency cap is free: wake claimers
    if retry_at is not None:
        # the fence moves on, so a retry of this commit (its answer lost with the
        # connection) is refused, not recorded as a second failed attempt
        tx.execute(
            "UPDATE tasks SET lease_owner = NULL, available_at = ?, last_error = ?, "
            "fence = fence + 1 WHERE task_id = ?",
            (retry_at, tx.seal_error(json.dumps(error), task.run_id), task.task_id),
        )
        _append(
            tx,
            task.run_id,
            EventType.ACTIVITY_ATTEMPT_FAILED,
            task.step,
            {"attempt": task.attempt, "error": error, "retry_at": retry_at},
        )
        tx.ready.add(task.queue)
        return None
    requested = tx.execute(
        "SELECT cancel_requested FROM tasks WHERE task_id = ?", (task.task_id,)
    ).fetchone()
    if not (requested and requested[0]):
        # a step the workflow (or an operator) asked to cancel did what it was asked:
        # not a failure to replay, so no dead letter
        _dead_letter(tx, task, error)
    _append(
        tx,
        task.run_id,
        EventType.ACTIVITY_FAILED,
        task.step,
        {"attempt": task.attempt, "error": error},
    )
    tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
    _, run_queue, _p, _s, workflow, _t = _run_row(tx, task.run_id)
    return _ensure_workflow_task(
        tx, task.run_id, run_queue, workflow, lease_to, lease_queues, lease
    )


def _dead_letter(tx: _Tx, task: Task, error: dict[str, Any]) -> None:
    """Record a step that exhausted its failure policy, for an operator to replay."""
    tx.execute(
        "INSERT INTO dead_letters (run_id, step, kind, name, input, error, attempts, reason, "
        "created_at) VALUES (?, ?, 'activity', ?, ?, ?, ?, ?, ?)",
        (
            task.run_id,
            task.step,
            task.name,
            tx.seal(task.payload, task.run_id),
            tx.seal_error(json.dumps(error), task.run_id),
            task.attempt,
            error.get("reason"),
            tx.now,
        ),
    )


def _with_history(tx: _Tx, op: Op, read_after: int | None, *args: Any) -> Task | None:
    """Run an activity-outcome op; if it leased the run's workflow task to the caller,
    attach the history after ``read_after`` so the caller's cached instance continues
    without another round trip to the store."""
    leased: Task | None = op(tx, *args)
    if leased is None or read_after is None:
        return leased
    events = _read_history(tx, leased.run_id, read_after)
    return dataclasses.replace(leased, prefetched=tuple(events), prefetched_after=read_after)


def _complete_activity_fast(
    tx: _Tx,
    task: Task,
    result: str,
    workflow_result: WorkflowTaskResult,
    expected_seq: int,
    lease_to: str,
    lease_queues: tuple[str, ...],
    lease: float,
    lease_limit: int,
) -> tuple[bool, int, list[Task], Task | None]:
    """Record an activity's result AND the next workflow task it leads to, in one commit.

    The worker holding the run in its cache computed the workflow task on the
    assumption that the result lands at ``expected_seq`` with nothing else new. If
    that holds (and no workflow task is queued), both are committed here, without
    a workflow task row ever being written; otherwise only the result is recorded,
    as ``complete_activity`` would, and the caller drops its speculative instance.
    Returns (fast, marker seq, leased tasks, workflow task leased on the slow path).
    """
    _take_task(tx, task)
    row = tx.execute(
        "SELECT next_seq, status, queue, parent_run_id, parent_step, workflow, task_error, "
        "(SELECT 1 FROM tasks WHERE tasks.run_id = runs.run_id AND kind = 'workflow'), "
        "(SELECT 1 FROM queue_limits WHERE queue_limits.queue = ?), tenant "
        f"FROM runs WHERE run_id = ?{tx.for_update}",
        (task.queue, task.run_id),
    ).fetchone()
    if row is not None and task.queue not in tx.limited:
        tx.limited[task.queue] = row[8] is not None  # read here: one statement fewer
        if row[8] is not None:
            tx.known_limited.add(task.queue)
    if (
        row is None
        or row[0] != expected_seq
        or row[1] not in (RunStatus.RUNNING.value, RunStatus.PENDING.value)
        or row[7] is not None  # a workflow task is queued: something else is new
        or row[2] not in lease_queues
    ):
        # record the result alone, as complete_activity does (the row is gone already)
        _append_completed(tx, task, result)
        slow = _after_activity(tx, task, lease_to, lease_queues, lease)
        return False, 0, [], slow
    if _frees_a_slot(tx, task):
        tx.ready.add(task.queue)  # a slot under its concurrency cap is free: wake claimers
    completed: list[_Pending] = [
        (
            EventType.ACTIVITY_COMPLETED,
            task.step,
            {},
            {"attempt": str(int(task.attempt)), "result": result},
        )
    ]
    marker, leased, _ended = _apply_workflow_result(
        tx,
        task.run_id,
        (row[1], row[2], row[3], row[4], row[5], row[9]),
        workflow_result,
        completed,
        expected_seq,
        lease_to,
        lease_queues,
        lease,
        lease_limit,
        activate=row[1] != RunStatus.RUNNING.value or row[6] is not None,
    )
    return True, marker, leased, None


# operations of other concerns (imported last: see the package docstring)
from .dependencies import _dependency_feedback, _dependency_limited  # noqa: E402
from .history import _append, _Pending, _read_history  # noqa: E402
from .queues import _has_limits, _pause_on_429  # noqa: E402
from .runs import _run_row  # noqa: E402
from .tasks import _check_fence, _ensure_workflow_task, _take_task  # noqa: E402
from .workflow_tasks import _apply_workflow_result  # noqa: E402
