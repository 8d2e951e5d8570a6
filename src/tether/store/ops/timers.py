"""Durable timers, deadlines and debounce windows firing."""

from __future__ import annotations

from ..._history import EventType, RunStatus, Task
from ._tx import _Tx


def _fire_timer(tx: _Tx, task: Task) -> None:
    if task.kind == "schedule":
        _fire_schedule(tx, task)
        return
    _check_fence(tx, task)
    if task.kind == "debounce":
        _fire_debounce(tx, task)
        return
    if task.kind == "deadline" and _run_row(tx, task.run_id)[0] == RunStatus.QUEUED.value:
        # the deadline passed while the run waited for admission: it never started
        error = {"type": "DeadlineExceeded", "message": "deadline passed while queued"}
        _append(tx, task.run_id, EventType.DEADLINE_EXCEEDED, None, {})
        _finish(tx, task.run_id, RunStatus.TIMED_OUT, error=error)
        return
    if task.kind == "deadline":
        _append(tx, task.run_id, EventType.DEADLINE_EXCEEDED, None, {})
    else:
        _append(tx, task.run_id, EventType.TIMER_FIRED, task.step, {})
    tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
    _, run_queue, _p, _s, workflow, _t = _run_row(tx, task.run_id)
    _ensure_workflow_task(tx, task.run_id, run_queue, workflow)


def _fire_debounce(tx: _Tx, task: Task) -> None:
    """A debounce came due: start its run with the last input (or wait, if re-triggered)."""
    row = tx.execute(
        "SELECT run_id, workflow, queue, input, due_at FROM debounces "
        f"WHERE debounce_key = ?{tx.for_update}",
        (task.name,),
    ).fetchone()
    if row is None or row[0] != task.run_id:
        tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
        return
    run_id, workflow, queue, sealed, due_at = row
    input = tx.open(sealed, f"debounce {task.name!r}, input") or "null"
    if float(due_at) > tx.now:  # triggered again after this task was claimed
        tx.execute(
            "UPDATE tasks SET lease_owner = NULL, available_at = ? WHERE task_id = ?",
            (due_at, task.task_id),
        )
        tx.ready.add(queue)
        return
    tx.execute("DELETE FROM debounces WHERE debounce_key = ?", (task.name,))
    tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
    if tx.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone() is None:
        _insert_run(tx, run_id, workflow, queue, input)


# operations of other concerns (imported last: see the package docstring)
from .history import _append  # noqa: E402
from .runs import _finish, _insert_run, _run_row  # noqa: E402
from .schedules import _fire_schedule  # noqa: E402
from .tasks import _check_fence, _ensure_workflow_task  # noqa: E402
