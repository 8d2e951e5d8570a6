"""Task rows: inserting, fencing, leases (renew, release, reclaim), next due."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..._errors import LeaseLostError
from ..._history import RunStatus, Task
from ._tx import _TASK_COLS, _task_from_row, _Tx

#: an activity task's columns as ``_apply_workflow_result`` gives their values
_TASK_INSERT_NAMES = (
    "run_id",
    "step",
    "queue",
    "name",
    "payload",
    "options",
    "available_at",
    "lease_owner",
    "fence",
    "attempt",
    "heartbeat_timeout",
    "priority",
    "limit_key",
    "dependency",
    "batch_key",
    "batch_max",
    "batch_wait",
    "created_at",
)


_task_inserts: dict[tuple[tuple[bool, ...], bool, str], str] = {}


def _task_insert(values: Sequence[Any], with_id: bool, tail: str) -> tuple[str, list[Any]]:
    """An activity task's INSERT and its parameters, NULL columns left out.

    The sqlite3 module adapts a None parameter the slow way (an attribute lookup
    that fails and formats an error, per parameter): a column that stays NULL is
    simply not named. One statement per pattern of NULLs (a handful), cached.
    """
    mask = tuple(v is not None for v in values)
    key = (mask, with_id, tail)
    text = _task_inserts.get(key)
    if text is None:
        cols = [name for name, given in zip(_TASK_INSERT_NAMES, mask, strict=True) if given]
        names = (["task_id"] if with_id else []) + ["kind", *cols]
        marks = (["?"] if with_id else []) + ["'activity'"] + ["?"] * len(cols)
        text = f"INSERT INTO tasks ({', '.join(names)}) VALUES ({', '.join(marks)}){tail}"
        if len(_task_inserts) < 256:
            _task_inserts[key] = text
    return text, [v for v in values if v is not None]


def _new_activity_task(
    tx: _Tx, task_id: int, values: Sequence[Any], options: dict[str, Any]
) -> Task:
    """The Task a leased activity row inserted with ``values`` is (no RETURNING read);
    with per-tenant keys, with its run's tenant (remembered: sealing its arguments read
    it) as a claim gives it."""
    known = tx.codec is not None and tx.codec.per_tenant
    return Task(
        task_id=task_id,
        run_id=values[0],
        kind="activity",
        step=values[1],
        queue=values[2],
        name=values[3],
        payload=values[4],
        options=options,
        fence=values[8],
        attempt=values[9],
        lease_expires_at=values[6],
        heartbeat=None,
        dependency=values[13],
        tenant=tx.tenant_of(values[0]) if known else None,
        tenant_known=known,
    )


def _insert_activity_task(
    tx: _Tx, values: Sequence[Any], options: dict[str, Any], local: bool
) -> Task | None:
    """Insert an activity task row (``_TASK_INSERT_NAMES``); the Task if leased to us."""
    task_values = values
    if tx.codec is not None and values[4] is not None:  # the arguments, sealed
        values = (*values[:4], tx.seal(values[4], values[0]), *values[5:])
    if tx.optimistic and tx.new_task_id is not None:
        # nothing to wait for: the id is ours already and the row is new (a conflicting
        # row fails the batch, and the safe path sees it below)
        if not local:
            tx.execute(*_task_insert(values, False, " ON CONFLICT DO NOTHING"))
            return None
        task_id = tx.new_task_id()
        text, params = _task_insert(values, True, "")
        tx.execute(text, [task_id, *params])
        return _new_activity_task(tx, task_id, task_values, options)
    text, params = _task_insert(values, False, " ON CONFLICT DO NOTHING RETURNING task_id")
    row = tx.execute(text, params).fetchone()
    return (
        _new_activity_task(tx, row[0], task_values, options) if local and row is not None else None
    )


def _ensure_workflow_task(
    tx: _Tx,
    run_id: str,
    queue: str,
    workflow: str,
    lease_to: str | None = None,
    lease_queues: tuple[str, ...] = (),
    lease: float = 30.0,
) -> Task | None:
    """Make sure the run has a workflow task; return it if created and leased to us.

    The task is leased at once to ``lease_to`` when that worker serves the run's
    queue: it usually holds the run in its sticky cache, so it can continue it
    without another claim.
    """
    if lease_to is not None and queue in lease_queues:
        row = tx.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is not None and row[0] == RunStatus.SUSPENDED.value:
            lease_to = None  # a suspended run's work waits for resume, not for this worker
    if lease_to is None or queue not in lease_queues:
        tx.execute(
            "INSERT INTO tasks (run_id, kind, queue, name, available_at, created_at) "
            "VALUES (?, 'workflow', ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (run_id, queue, workflow, tx.now, tx.now),
        )
        tx.ready.add(queue)
        return None
    row = tx.execute(
        "INSERT INTO tasks (run_id, kind, queue, name, available_at, lease_owner, fence, "
        "created_at) VALUES (?, 'workflow', ?, ?, ?, ?, 1, ?) ON CONFLICT DO NOTHING "
        f"RETURNING {_TASK_COLS}",
        (run_id, queue, workflow, tx.now + lease, lease_to, tx.now),
    ).fetchone()
    return _task_from_row(row, tx) if row else None


def _check_fence(tx: _Tx, task: Task, *, gone_ok: bool = False) -> None:
    """Refuse (``LeaseLostError``) a write of an attempt whose task moved on (its fence
    bumped by a later attempt) or is gone (the run ended); ``gone_ok``: gone is fine."""
    row = tx.execute(
        f"SELECT fence FROM tasks WHERE task_id = ?{tx.for_update}", (task.task_id,)
    ).fetchone()
    if (row is None and not gone_ok) or (row is not None and row[0] != task.fence):
        raise LeaseLostError(
            f"lease lost on {task.kind} task {task.task_id} of run {task.run_id!r}: another "
            "worker took it over or the run ended; this worker's result was discarded"
        )


def _take_task(tx: _Tx, task: Task) -> None:
    """Delete a finished task's row, provided our lease on it still holds (its fence)."""
    if tx.optimistic:  # the lease almost always holds: no wait; the guard fails if it did not
        tx.guard(
            "WITH d AS (DELETE FROM tasks WHERE task_id = ? AND fence = ? RETURNING 1) "
            "SELECT 1 / count(*)::int FROM d",
            (task.task_id, task.fence),
        )
        return
    row = tx.execute(
        "DELETE FROM tasks WHERE task_id = ? AND fence = ? RETURNING 1",
        (task.task_id, task.fence),
    ).fetchone()
    if row is None:
        raise LeaseLostError(
            f"lease lost on {task.kind} task {task.task_id} of run {task.run_id!r}: another "
            "worker took it over or the run ended; this worker's result was discarded"
        )


def _renew(tx: _Tx, tasks: tuple[Task, ...], lease: float) -> dict[int, bool]:
    out: dict[int, bool] = {}
    for t in tasks:
        row = tx.execute(
            "UPDATE tasks SET available_at = CASE WHEN heartbeat_timeout IS NULL THEN ? "
            "ELSE available_at END WHERE task_id = ? AND fence = ? RETURNING cancel_requested",
            (tx.now + lease, t.task_id, t.fence),
        ).fetchone()
        if row is not None:
            out[t.task_id] = bool(row[0])
    return out


def _leases(tx: _Tx, worker_id: str) -> dict[int, tuple[int, float, bool]]:
    """The unexpired leases of ``worker_id``: task id -> (fence, expiry, whether only
    heartbeats extend it), for ``_reclaim`` to compare a while later."""
    rows = tx.execute(
        "SELECT task_id, fence, available_at, heartbeat_timeout FROM tasks "
        "WHERE lease_owner = ? AND available_at > ?",
        (worker_id, tx.now),
    ).fetchall()
    return {r[0]: (r[1], r[2], r[3] is not None) for r in rows}


def _reclaim(tx: _Tx, worker_id: str, seen: Mapping[int, tuple[int, float, bool]]) -> int | None:
    """Make claimable now the leases of ``worker_id`` read as ``seen`` (``_leases``) a
    while ago, if no one renewed any of them since (their process is gone): a
    restarted worker continues at once instead of waiting for them to expire.

    The hold on the id alone does not prove its previous holder dead (a PostgreSQL
    session can end while its process lives), so the renewals decide: None when any of
    them was renewed (or heartbeated) since, by a process that lives and runs them.
    Leases that only heartbeats extend are never taken back: the lease renewal skips
    them, so nothing tells on a schedule whether their holder lives (a live one may
    simply not have beaten yet); they are left to their heartbeat timeouts, and the
    decision rests on the other leases (None when there are none). Leases taken since
    (a new fence) are not the predecessor's and are left alone. Even a holder that
    renews too late commits nothing: the next claim bumps each fence.
    """
    if all(beats for _, _, beats in seen.values()):
        return None
    rows = tx.execute(
        "SELECT task_id, fence, available_at, heartbeat_timeout FROM tasks WHERE "
        f"lease_owner = ? AND available_at > ?{tx.for_update}",
        (worker_id, tx.now),
    ).fetchall()
    stale: list[int] = []
    for task_id, fence, expiry, beats in rows:
        before = seen.get(task_id)
        if before is None or before[0] != fence:
            continue  # leased since, by this process: not the predecessor's
        if expiry > before[1]:
            return None  # renewed (or heartbeated) since: the process holding it lives
        if beats is not None or before[2]:
            continue  # only heartbeats extend it: left to its heartbeat timeout
        stale.append(task_id)
    for task_id in stale:
        (queue,) = tx.execute(
            "UPDATE tasks SET available_at = ? WHERE task_id = ? RETURNING queue",
            (tx.now, task_id),
        ).fetchone()
        tx.ready.add(queue)
    return len(stale)


def _give_back(
    tx: _Tx, worker_id: str, run_id: str, keep: tuple[int, ...] = (), since: float = 0.0
) -> int:
    """Make claimable now the tasks of ``run_id`` that a commit lost at or after
    ``since`` (store clock) may have leased to ``worker_id``, but ``keep`` (those it
    runs): that commit's answer was lost, so the worker does not know them, and they
    are not left to wait out their leases. Only tasks created leased (fence 1, never
    claimed since) at or after ``since`` qualify: a task the id holds from a claim (one
    claimed and not started yet, another process sharing the id) is left alone. The
    next claim bumps each fence, so the worker can commit nothing of them after."""
    params: tuple[Any, ...] = (tx.now, worker_id, tx.now, run_id, since)
    where = ""
    if keep:
        where = f" AND task_id NOT IN ({','.join('?' * len(keep))})"
        params += keep
    rows = tx.execute(
        "UPDATE tasks SET available_at = ? WHERE lease_owner = ? AND available_at > ? "
        f"AND run_id = ? AND fence = 1 AND created_at >= ?{where} RETURNING queue",
        params,
    ).fetchall()
    for (queue,) in rows:
        tx.ready.add(queue)
    return len(rows)


def _foreign_leases(tx: _Tx, queues: tuple[str, ...], worker_id: str) -> tuple[int, float | None]:
    marks = ",".join("?" * len(queues))
    row = tx.execute(
        f"SELECT count(*), max(available_at) FROM tasks WHERE queue IN ({marks}) "
        "AND lease_owner IS NOT NULL AND lease_owner <> ? AND available_at > ?",
        (*queues, worker_id, tx.now),
    ).fetchone()
    return (int(row[0]), row[1]) if row else (0, None)


def _release(
    tx: _Tx,
    tasks: tuple[Task, ...],
    delay: float = 0.0,
    unstarted: bool = False,
    note: str | None = None,
) -> int:
    """Give leased tasks back; ``unstarted`` ones never ran, or a stopping worker
    interrupted them, so their claim's attempt is taken back too (a graceful stop must
    not use up a step's retries). A ``note`` says on each live run without a
    ``task_error`` why its step waits. Returns how many were still held (their fence
    unmoved): the others were taken over, or a commit of them landed."""
    undo = (
        ", attempt = CASE WHEN kind = 'activity' AND attempt > 0 THEN attempt - 1 ELSE attempt END"
        if unstarted
        else ""
    )
    held = 0
    for t in tasks:
        row = tx.execute(
            f"UPDATE tasks SET lease_owner = NULL, available_at = ?{undo} "
            "WHERE task_id = ? AND fence = ? RETURNING 1",
            (tx.now + delay, t.task_id, t.fence),
        ).fetchone()
        held += row is not None
        tx.ready.add(t.queue)
        if note is not None:
            tx.execute(
                "UPDATE runs SET task_error = ? WHERE run_id = ? AND task_error IS NULL "
                "AND status IN ('pending', 'running')",
                (note, t.run_id),  # names only, never a payload: kept as it is
            )
    return held


def _heartbeat(tx: _Tx, task: Task, lease: float, details: str | None) -> bool:
    row = tx.execute(
        "UPDATE tasks SET available_at = ? + COALESCE(heartbeat_timeout, ?), "
        "heartbeat = coalesce(?, heartbeat) WHERE task_id = ? AND fence = ? "
        "RETURNING cancel_requested",
        (tx.now, lease, tx.seal(details, task.run_id), task.task_id, task.fence),
    ).fetchone()
    if row is None:
        raise LeaseLostError(
            f"activity task {task.task_id} of run {task.run_id!r} is no longer held by this "
            "worker (lease expired, run ended or cancelled); stop work and clean up"
        )
    return bool(row[0])


def _next_due(tx: _Tx, queues: tuple[str, ...], exclude_owner: str | None = None) -> float | None:
    # batched tasks are due when their batch is (_batch_due), not when they became ready
    if tx.skip_locked and exclude_owner is None:
        # PostgreSQL: one index endpoint lookup per queue (tasks_ready); min() over
        # ``queue IN (...)`` read every task of those queues on each idle poll
        row = tx.execute(
            "SELECT min(m.due) FROM unnest(?::text[]) AS q(name) CROSS JOIN LATERAL "
            "(SELECT t.available_at AS due FROM tasks t WHERE t.queue = q.name "
            "AND t.batch_key IS NULL ORDER BY t.available_at LIMIT 1) m",
            (list(queues),),
        ).fetchone()
    else:  # SQLite; or the test clock's question (exclude_owner), which needs no index
        marks = ",".join("?" * len(queues))
        mine, owner = (
            ("", ()) if exclude_owner is None else (NOT_LEASED_TO, (exclude_owner, tx.now))
        )
        row = tx.execute(
            f"SELECT min(available_at) FROM tasks WHERE queue IN ({marks}) "
            f"AND batch_key IS NULL{mine}",
            (*queues, *owner),
        ).fetchone()
    due: float | None = row[0] if row else None
    batched = _batch_due(tx, queues, exclude_owner) if queues else None
    if batched is not None and (due is None or batched < due):
        return batched
    return due


# operations of other concerns (imported last: see the package docstring)
from .batches import NOT_LEASED_TO, _batch_due  # noqa: E402
