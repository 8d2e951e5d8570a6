"""Batched activity calls (``tether.Batch``): forming and claiming batches."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..._history import Task
from ._tx import _claimed_cols, _task_from_row, _Tx


def _batch_cols(data: dict[str, Any]) -> tuple[str | None, int | None, float | None]:
    """The ``batch_key, batch_max, batch_wait`` columns of an ActivityScheduled's task."""
    batch = data.get("batch")
    if not batch:
        return None, None, None
    return str(batch["key"]), int(batch["max_items"]), float(batch["max_wait"])


def _claim_batches(
    tx: _Tx, worker_id: str, queues: tuple[str, ...], limit: int, lease: float
) -> tuple[list[Task], float | None]:
    """Lease up to ``limit`` batches of batched activity tasks; say when the next is due.

    Ready tasks are grouped by (batch key, queue). A group yields a batch when
    ``batch_max`` of them are ready or the oldest became ready ``batch_wait``
    seconds ago; the batch is its oldest ``batch_max`` tasks. A batch is one call:
    one of the worker's slots, one running task under the queue's
    ``max_concurrency``, one rate-limit token. The candidates are locked first
    (SKIP LOCKED on PostgreSQL) and the rule is checked on what was locked, so
    concurrent claimers never share a task and never flush a partial batch early.
    Every task of a batch gets ``batch_id``, its first task's id (also stored, so
    limits count the batch once). The second value is the earliest time a waiting
    group becomes due, or a throttled queue may let a batch through.
    """
    marks = ",".join("?" * len(queues))
    groups = tx.execute(
        "SELECT t.batch_key, t.queue, count(*), min(t.available_at), min(t.batch_max), "
        "min(t.batch_wait) FROM tasks t WHERE t.batch_key IS NOT NULL AND t.available_at <= ? "
        f"AND t.queue IN ({marks}) AND {_NOT_SUSPENDED} GROUP BY t.batch_key, t.queue "
        "ORDER BY min(t.available_at)",
        (tx.now, *queues),
    ).fetchall()
    tasks: list[Task] = []
    wake: float | None = None
    batches = 0
    for key, queue, ready, oldest, size, wait in groups:
        size, wait = int(size), float(wait)
        if int(ready) < size and float(oldest) + wait > tx.now:
            due = float(oldest) + wait  # not full yet: flush it when the oldest has waited
            wake = due if wake is None else min(wake, due)
            continue
        while batches < limit:
            allowed, gate = _batch_allowed(tx, queue)
            if gate is not None:
                wake = gate if wake is None else min(wake, gate)
            if not allowed:
                break
            rows = tx.execute(
                "SELECT t.task_id, t.available_at FROM tasks t WHERE t.batch_key = ? "
                f"AND t.queue = ? AND t.available_at <= ? AND {_NOT_SUSPENDED} "
                f"ORDER BY t.available_at, t.task_id LIMIT ?{tx.skip_locked}",
                (key, queue, tx.now, size),
            ).fetchall()
            if not rows:
                break
            due = float(rows[0][1]) + wait
            if len(rows) < size and due > tx.now:
                wake = due if wake is None else min(wake, due)
                break  # what is left (or not locked by others) is not a batch yet
            ids = [r[0] for r in rows]
            leased = tx.execute(
                "UPDATE tasks SET lease_owner = ?, "
                "available_at = ? + COALESCE(heartbeat_timeout, ?), fence = fence + 1, "
                "attempt = attempt + 1, batch_id = ? WHERE task_id IN "
                f"({','.join('?' * len(ids))}) RETURNING {_claimed_cols(tx)}",
                (worker_id, tx.now, lease, ids[0], *ids),
            ).fetchall()
            rank = {tid: i for i, tid in enumerate(ids)}
            got = sorted((_task_from_row(r, tx) for r in leased), key=lambda t: rank[t.task_id])
            tasks += [dataclasses.replace(t, batch_id=ids[0]) for t in got]
            batches += 1
            _spend_tokens(tx, queue, 1)
            if len(rows) < size:
                break  # every ready task of the group was taken
    return tasks, wake


def _batch_allowed(tx: _Tx, queue: str) -> tuple[bool, float | None]:
    """Whether the limits of ``queue`` let one more batch start now; and when, if not.

    The queue's ``queue_limits`` row (if any) is already locked by this claim.
    """
    row = tx.execute(
        f"SELECT {_QL_COLS} FROM queue_limits WHERE queue = ?{tx.for_update}", (queue,)
    ).fetchone()
    if row is None:
        return True, None
    if not _usable(tuple(row)):
        return False, None
    _q, cap, rate, burst, tokens, refilled_at, _k, _f, _p, paused_until, _c = row
    if paused_until is not None and float(paused_until) > tx.now:
        return False, float(paused_until)
    if cap is not None:
        (running,) = tx.execute(
            f"SELECT {_CALLS} FROM tasks WHERE queue = ? AND kind = 'activity' AND {_RUNNING}",
            (queue, tx.now),
        ).fetchone()
        if int(running) >= int(cap):
            return False, None  # at its concurrency cap: a completion wakes the workers
    if rate is not None:
        have = _tokens_now(tx, rate, burst, tokens, refilled_at)
        if have < 1.0 - 1e-9:
            return False, tx.now + (1.0 - have) / float(rate)  # the next token
    return True, None


#: a task not under a live lease of one worker (parameters: the worker, now)
NOT_LEASED_TO = " AND (lease_owner IS NULL OR lease_owner <> ? OR available_at <= ?)"


def _batch_due(tx: _Tx, queues: tuple[str, ...], exclude_owner: str | None = None) -> float | None:
    """When a batched task on ``queues`` is next due: a waiting one when its batch is
    flushed (ready since ``available_at``, plus ``batch_wait``), others at ``available_at``;
    tasks leased to ``exclude_owner`` left out (see ``_next_due``)."""
    marks = ",".join("?" * len(queues))
    mine = "" if exclude_owner is None else NOT_LEASED_TO
    row = tx.execute(
        "SELECT min(CASE WHEN available_at > ? THEN available_at "
        "ELSE available_at + batch_wait END) FROM tasks "
        f"WHERE batch_key IS NOT NULL AND queue IN ({marks}){mine}",
        (tx.now, *queues) if exclude_owner is None else (tx.now, *queues, exclude_owner, tx.now),
    ).fetchone()
    return None if row is None or row[0] is None else float(row[0])


# operations of other concerns (imported last: see the package docstring)
from .claims import _NOT_SUSPENDED  # noqa: E402
from .queues import (  # noqa: E402
    _CALLS,
    _QL_COLS,
    _RUNNING,
    _spend_tokens,
    _tokens_now,
    _usable,
)
