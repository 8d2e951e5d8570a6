"""Claiming ready work: plain, per-dependency and limited queues."""

from __future__ import annotations

from ..._history import Task
from ._tx import _claimed_cols, _task_from_row, _Tx


def _claim(
    tx: _Tx, worker_id: str, queues: tuple[str, ...], limit: int, lease: float
) -> list[Task]:
    tasks, _wake = _claim_with_wake(tx, worker_id, queues, limit, lease)
    return tasks


def _claim_with_wake(
    tx: _Tx, worker_id: str, queues: tuple[str, ...], limit: int, lease: float
) -> tuple[list[Task], float | None]:
    """Lease up to ``limit`` ready tasks; also say when a throttled queue may yield more.

    Activity tasks of queues with a ``queue_limits`` row go through
    ``_claim_limited`` (their rows locked first, in queue order, so concurrent
    claimers serialise per queue); everything else takes the plain indexed path.
    The second value is the earliest time a queue held back by its rate limit or
    a pause can let work through (None when nothing was held back that way).
    """
    limited = _lock_queue_limits(tx, queues) if queues else []
    limited_queues = tuple(r[0] for r in limited)
    tasks: list[Task] = []
    wake: float | None = None
    for row in limited:
        if len(tasks) >= limit:
            break
        if not _usable(row):
            continue  # its activity tasks wait (the plain path skips them too)
        got, gate = _claim_limited(tx, worker_id, row, limit - len(tasks), lease)
        tasks += got
        if gate is not None:
            wake = gate if wake is None else min(wake, gate)
    batched = 0  # tasks beyond the first of each batch: a batch takes one slot
    if len(tasks) < limit and queues:
        got, gate = _claim_batches(tx, worker_id, queues, limit - len(tasks), lease)
        batched = len(got) - len({t.batch_id for t in got})
        tasks += got
        if gate is not None:
            wake = gate if wake is None else min(wake, gate)
    if len(tasks) - batched < limit and queues:
        got, gate = _claim_dependencies(
            tx,
            worker_id,
            queues,
            limited_queues,
            limit - len(tasks) + batched,
            lease,
        )
        tasks += got
        if gate is not None:
            wake = gate if wake is None else min(wake, gate)
    if len(tasks) - batched < limit:
        tasks += _claim_plain(
            tx,
            worker_id,
            queues,
            limited_queues,
            limit - len(tasks) + batched,
            lease,
        )
    return tasks, wake


def _claim_dependencies(
    tx: _Tx,
    worker_id: str,
    queues: tuple[str, ...],
    limited: tuple[str, ...],
    limit: int,
    lease: float,
) -> tuple[list[Task], float | None]:
    """Activity tasks under a ``tether.Dependency``: each limiter row is locked (in
    name order) and obeyed like a queue's limits, over every served queue.

    The limits of their own queue hold too: a task of one of the ``limited`` queues
    (rows already locked by the caller) is taken only while that queue is not paused,
    is under its ``max_concurrency`` and has a token, which it spends.
    """
    wake: float | None = None
    room: dict[str, int | None] = dict.fromkeys(queues)
    for q in limited:
        room[q], gate = _queue_room(tx, q)
        if gate is not None:
            wake = gate if wake is None else min(wake, gate)
    open_queues = tuple(q for q in queues if room[q] is None or (room[q] or 0) > 0)
    if not open_queues:
        return [], wake
    marks = ",".join("?" * len(open_queues))
    deps = [
        r[0]
        for r in tx.execute(
            "SELECT DISTINCT dependency FROM tasks WHERE dependency IS NOT NULL "
            f"AND available_at <= ? AND queue IN ({marks})",
            (tx.now, *open_queues),
        ).fetchall()
    ]
    if not deps:
        return [], wake
    rows = _lock_queue_limits(tx, tuple(sorted(deps)))
    tasks: list[Task] = []
    spent: dict[str, int] = {}
    for row in rows:
        if len(tasks) >= limit or not open_queues:
            break
        if not _usable(row):
            continue
        got, gate = _claim_limited(tx, worker_id, row, limit - len(tasks), lease, open_queues, room)
        tasks += got
        if gate is not None:
            wake = gate if wake is None else min(wake, gate)
        for t in got:
            left = room.get(t.queue)
            if left is not None:
                room[t.queue] = left - 1
                spent[t.queue] = spent.get(t.queue, 0) + 1
        open_queues = tuple(q for q in open_queues if room[q] is None or (room[q] or 0) > 0)
    for q, n in spent.items():
        gate = _spend_tokens(tx, q, n)
        if gate is not None:
            wake = gate if wake is None else min(wake, gate)
    return tasks, wake


_NOT_SUSPENDED = (
    "(t.kind IN ('timer', 'deadline') OR NOT EXISTS (SELECT 1 FROM runs r "
    "WHERE r.run_id = t.run_id AND r.status = 'suspended'))"
)


_LEASE_SET = (
    "UPDATE tasks SET lease_owner = ?, available_at = ? + COALESCE(heartbeat_timeout, ?), "
    "fence = fence + 1, "
    "attempt = attempt + CASE WHEN kind = 'activity' THEN 1 ELSE 0 END WHERE task_id IN "
)


def _claim_plain(
    tx: _Tx,
    worker_id: str,
    queues: tuple[str, ...],
    limited: tuple[str, ...],
    limit: int,
    lease: float,
) -> list[Task]:
    """Queues without limits (and non-activity tasks of limited ones): by priority, then age."""
    marks = ",".join("?" * len(queues))
    # claimed by _claim_dependencies and _claim_batches
    skip = "AND t.dependency IS NULL AND t.batch_key IS NULL "
    if limited:
        skip += f"AND NOT (t.kind = 'activity' AND t.queue IN ({','.join('?' * len(limited))})) "
    if tx.skip_locked:
        # PostgreSQL: one ordered, bounded index scan per queue (tasks_ready_order) and a
        # merge of at most ``limit`` rows each; ``queue IN (...)`` with this ORDER BY
        # would sort every ready row of every queue on each claim (a backlog of 100,000
        # made each claim take 50-200 ms)
        rows = tx.execute(
            f"{_LEASE_SET}(SELECT c.task_id FROM unnest(?::text[]) AS q(name) "
            "CROSS JOIN LATERAL (SELECT t.task_id, t.priority, t.available_at FROM tasks t "
            f"WHERE t.queue = q.name AND t.available_at <= ? {skip}AND {_NOT_SUSPENDED} "
            f"ORDER BY t.priority DESC, t.available_at LIMIT ?{tx.skip_locked}) c "
            f"ORDER BY c.priority DESC, c.available_at LIMIT ?) RETURNING {_claimed_cols(tx)}",
            (worker_id, tx.now, lease, list(queues), tx.now, *limited, limit, limit),
        ).fetchall()
        return [_task_from_row(r, tx) for r in rows]
    rows = tx.execute(
        f"{_LEASE_SET}("
        f"SELECT t.task_id FROM tasks t WHERE t.queue IN ({marks}) AND t.available_at <= ? "
        f"{skip}AND {_NOT_SUSPENDED} ORDER BY t.priority DESC, t.available_at "
        f"LIMIT ?{tx.skip_locked}) "
        f"RETURNING {_claimed_cols(tx)}",
        (worker_id, tx.now, lease, *queues, tx.now, *limited, limit),
    ).fetchall()
    return [_task_from_row(r, tx) for r in rows]


# operations of other concerns (imported last: see the package docstring)
from .batches import _claim_batches  # noqa: E402
from .queues import (  # noqa: E402
    _claim_limited,
    _lock_queue_limits,
    _queue_room,
    _spend_tokens,
    _usable,
)
