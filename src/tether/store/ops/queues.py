"""Queue limits: concurrency caps, token buckets, 429 pauses, queue stats."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from ..._history import Task
from ..._queues import DEPENDENCY_PREFIX, QueueStats
from ._tx import _claimed_cols, _task_from_row, _Tx


def _spend_tokens(tx: _Tx, queue: str, n: int) -> float | None:
    """Take ``n`` tokens from the bucket of ``queue``, if it has a rate limit.

    Returns when the bucket next holds a whole token, if it is short of one now.
    """
    row = tx.execute(
        "SELECT rate, burst, tokens, refilled_at FROM queue_limits WHERE queue = ?", (queue,)
    ).fetchone()
    if row is None or row[0] is None or n <= 0:
        return None
    left = _tokens_now(tx, row[0], row[1], row[2], row[3]) - n
    tx.execute(
        "UPDATE queue_limits SET tokens = ?, refilled_at = ? WHERE queue = ?",
        (left, _refill_mark(tx, row[3]), queue),
    )
    if left < 1.0 - 1e-9:
        return tx.now + (1.0 - left) / float(row[0])
    return None


def _queue_room(tx: _Tx, queue: str) -> tuple[int, float | None]:
    """How many more activity calls the limited ``queue`` may start now (its row is
    locked by this claim): 0 while paused, else what its cap and bucket leave; and
    when a pause or an empty bucket lifts."""
    row = tx.execute(f"SELECT {_QL_COLS} FROM queue_limits WHERE queue = ?", (queue,)).fetchone()
    if row is None or not _usable(tuple(row)):
        return 0, None
    room, gate, _have = _room(tx, tuple(row), "queue", 2**31)
    return max(0, room), gate


def _room(tx: _Tx, row: tuple[Any, ...], col: str, most: int) -> tuple[int, float | None, float]:
    """What a limits row (``_QL_COLS``) lets start now, at most ``most``: (that many,
    which is <= 0 while paused or full; when a pause or an empty bucket lifts, if that
    is what holds it; the tokens in its bucket). ``col``: the tasks' column the row
    limits (``queue``, or ``dependency`` for a limiter)."""
    q, cap, rate, burst, tokens, refilled_at, _k, _f, _p, paused_until, _c = row
    if paused_until is not None and float(paused_until) > tx.now:
        return 0, float(paused_until), 0.0
    budget = most
    if cap is not None:
        (running,) = tx.execute(
            f"SELECT {_CALLS} FROM tasks WHERE {col} = ? AND kind = 'activity' AND {_RUNNING}",
            (q, tx.now),
        ).fetchone()
        budget = min(budget, int(cap) - int(running))
    have = 0.0
    if rate is not None:
        have = _tokens_now(tx, rate, burst, tokens, refilled_at)
        budget = min(budget, int(have + 1e-9))
        if have < 1.0 - 1e-9:
            return min(budget, 0), tx.now + (1.0 - have) / float(rate), have  # the next token
    return budget, None, have


_QL_COLS = (
    "queue, max_concurrency, rate, burst, tokens, refilled_at, key_concurrency, fair, "
    "pause_on_429, paused_until, fair_cursor"
)


_RUNNING = "lease_owner IS NOT NULL AND available_at > ?"  #: a live lease


#: running activity calls among the selected tasks: a batch (tether.Batch) is one call
_CALLS = "count(DISTINCT COALESCE(batch_id, task_id))"


log = logging.getLogger("tether.store")

#: limits row -> when its problem was last logged (monotonic): once a minute, not per claim
_bad_logged: dict[str, float] = {}


def _bad_limits(row: tuple[Any, ...]) -> str | None:
    """What makes a ``queue_limits`` row (``_QL_COLS``) unusable by a claim, or None.

    ``configure_queue`` refuses such values; a row written by an older version (a
    rate of 1e308 per 1e-308 s was stored as inf) or by hand could still hold one,
    and its arithmetic would fail every claim of every queue the worker serves.
    """
    _q, cap, rate, burst, tokens, refilled_at, key_cap, _fair, _p429, paused_until, _c = row
    try:
        for name, value in (("max_concurrency", cap), ("key_concurrency", key_cap)):
            if value is not None and not 1 <= int(value) < 2**63:
                return f"{name}={value!r}"
        if rate is not None:
            if not (math.isfinite(float(rate)) and float(rate) > 0):
                return f"rate={rate!r}"
            if burst is None or not (math.isfinite(float(burst)) and float(burst) > 0):
                return f"rate={rate!r} with burst={burst!r}"
        for name, value in (
            ("tokens", tokens),
            ("refilled_at", refilled_at),
            ("paused_until", paused_until),
        ):
            if value is not None and math.isnan(float(value)):
                return f"{name}={value!r}"
        if tokens is not None and not math.isfinite(float(tokens)):
            return f"tokens={tokens!r}"
    except (TypeError, ValueError, OverflowError):
        return "a value that is not a number"
    return None


def _usable(row: tuple[Any, ...]) -> bool:
    """Whether a claim may use this limits row; if not, log why (at most once a minute)."""
    problem = _bad_limits(row)
    if problem is None:
        return True
    name = str(row[0])
    now = time.monotonic()
    if now - _bad_logged.get(name, -math.inf) >= 60.0:
        _bad_logged[name] = now
        what = (
            f"dependency limiter {name!r}"
            if name.startswith(DEPENDENCY_PREFIX)
            else f"queue {name!r}"
        )
        log.error(
            "the limits of %s are unusable (%s): its activity tasks are not claimed until "
            "it is configured again (app.configure_queue, or the Dependency's limits)",
            what,
            problem,
        )
    return False


def _lock_queue_limits(tx: _Tx, queues: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """The limits rows of ``queues``, locked in queue order (PostgreSQL) for this claim."""
    marks = ",".join("?" * len(queues))
    rows = tx.execute(
        f"SELECT {_QL_COLS} FROM queue_limits WHERE queue IN ({marks}) "
        f"ORDER BY queue{tx.for_update}",
        queues,
    ).fetchall()
    return [tuple(r) for r in rows]


def _tokens_now(tx: _Tx, rate: float, burst: float, tokens: Any, refilled_at: Any) -> float:
    """The token bucket refilled up to now: ``rate`` per second, at most ``burst``."""
    have = float(burst) if tokens is None else float(tokens)
    if refilled_at is not None:
        have += max(0.0, tx.now - float(refilled_at)) * float(rate)
    return min(float(burst), have)


def _refill_mark(tx: _Tx, refilled_at: Any) -> float:
    """The bucket's new refill time: never earlier than the one stored.

    A claim's ``now`` is read when its batch starts, so one that waited for the
    queue's row lock (or runs on a host whose clock is behind) can be older than the
    last refill; moving the mark back would credit that interval twice.
    """
    return tx.now if refilled_at is None else max(tx.now, float(refilled_at))


def _claim_limited(
    tx: _Tx,
    worker_id: str,
    row: tuple[Any, ...],
    limit: int,
    lease: float,
    served: tuple[str, ...] | None = None,
    room: dict[str, int | None] | None = None,
) -> tuple[list[Task], float | None]:
    """Activity tasks of one limited queue, within its caps; and when a gate lifts.

    With ``served``, ``row`` is a dependency limiter: its tasks are those with that
    ``dependency``, from the ``served`` queues, at most ``room[queue]`` from a queue
    with limits of its own (None: no limit).
    """
    q, _cap, rate, _burst, _tokens, refilled_at, key_cap, fair, _p429, _paused, cursor = row
    col = "queue" if served is None else "dependency"
    budget, gate, have = _room(tx, row, col, limit)
    if budget <= 0:
        # paused, out of tokens, or at its concurrency cap (a completion wakes the workers)
        return [], gate
    ready = f"t.{col} = ? AND t.kind = 'activity' AND t.available_at <= ? AND " + _NOT_SUSPENDED
    if served is None:
        # claimed under their dependency's limiter, or as batches (_claim_batches)
        ready += " AND t.dependency IS NULL AND t.batch_key IS NULL"
    if served is not None:
        # the queues without limits together; each limited queue up to its room; the
        # best ``budget`` of those in claim order
        free = room or {}
        plain = tuple(s for s in served if free.get(s) is None)
        groups = [(plain, budget)] if plain else []
        groups += [((s,), min(budget, n)) for s in served if (n := free.get(s)) is not None]
        found: list[tuple[Any, ...]] = []
        for qs, n in groups:
            if n <= 0:
                continue
            found += tx.execute(
                "SELECT t.task_id, t.priority, t.available_at FROM tasks t WHERE "
                f"{ready} AND t.queue IN ({','.join('?' * len(qs))}) "
                "ORDER BY t.priority DESC, t.available_at, t.task_id LIMIT ?",
                (q, tx.now, *qs, n),
            ).fetchall()
        found.sort(key=lambda r: (-int(r[1]), float(r[2]), r[0]))
        ids = [r[0] for r in found[:budget]]
    elif key_cap is None and not fair:
        ids = [
            r[0]
            for r in tx.execute(
                f"SELECT t.task_id FROM tasks t WHERE {ready} "
                "ORDER BY t.priority DESC, t.available_at, t.task_id LIMIT ?",
                (q, tx.now, budget),
            ).fetchall()
        ]
    else:
        # rank each limit key's ready tasks after what the key already runs; a key may
        # start at most key_concurrency minus what it runs. A fair queue takes tasks by
        # that rank (each key's next task before any key's task after it) and breaks
        # ties round robin from the key after the last one served, so a tenant's
        # backlog cannot starve another tenant's few tasks, even one claim at a time.
        per_key = ""
        args: tuple[Any, ...] = ()
        if key_cap is not None:
            per_key = "WHERE k.limit_key IS NULL OR k.rn + COALESCE(b.n, 0) <= ? "
            args = (int(key_cap),)
        order = ""
        if fair:
            order = "k.rn + COALESCE(b.n, 0), CASE WHEN k.key > ? THEN 0 ELSE 1 END, k.key, "
            args += (cursor or "",)
        picked = tx.execute(
            "SELECT k.task_id, k.key FROM (SELECT t.task_id, t.limit_key, "
            "COALESCE(t.limit_key, '') AS key, t.priority, t.available_at, "
            "ROW_NUMBER() OVER (PARTITION BY COALESCE(t.limit_key, '') "
            "ORDER BY t.priority DESC, t.available_at, t.task_id) AS rn "
            f"FROM tasks t WHERE {ready}) k "
            "LEFT JOIN (SELECT COALESCE(limit_key, '') AS key, count(*) AS n FROM tasks "
            f"WHERE queue = ? AND kind = 'activity' AND {_RUNNING} "
            f"GROUP BY COALESCE(limit_key, '')) b ON b.key = k.key {per_key}"
            f"ORDER BY {order}k.priority DESC, k.available_at, k.task_id LIMIT ?",
            (q, tx.now, q, tx.now, *args, budget),
        ).fetchall()
        ids = [r[0] for r in picked]
        if fair and picked:
            tx.execute(
                "UPDATE queue_limits SET fair_cursor = ? WHERE queue = ?", (picked[-1][1], q)
            )
    tasks: list[Task] = []
    if ids:
        marks = ",".join("?" * len(ids))
        rows = tx.execute(
            f"{_LEASE_SET}(SELECT task_id FROM tasks WHERE task_id IN ({marks}) "
            f"AND available_at <= ?{tx.skip_locked}) RETURNING {_claimed_cols(tx)}",
            (worker_id, tx.now, lease, *ids, tx.now),
        ).fetchall()
        rank = {tid: i for i, tid in enumerate(ids)}
        tasks = sorted((_task_from_row(r, tx) for r in rows), key=lambda t: rank[t.task_id])
    if rate is not None:
        left = have - len(tasks)
        if tasks:
            tx.execute(
                "UPDATE queue_limits SET tokens = ?, refilled_at = ? WHERE queue = ?",
                (left, _refill_mark(tx, refilled_at), q),
            )
        if left < 1.0 - 1e-9:
            return tasks, tx.now + (1.0 - left) / float(rate)
    return tasks, None


def _has_limits(tx: _Tx, queue: str) -> bool:
    known = tx.limited.get(queue)
    if known is None:
        if queue in tx.known_limited:
            known = True
        elif tx.optimistic:  # almost always: no limits; the guard fails the batch if there are
            tx.guard("SELECT 1 / (1 - count(*))::int FROM queue_limits WHERE queue = ?", (queue,))
            known = False
        else:
            row = tx.execute("SELECT 1 FROM queue_limits WHERE queue = ?", (queue,)).fetchone()
            known = row is not None
            if known:
                tx.known_limited.add(queue)
        tx.limited[queue] = known
    return known


def _pause_on_429(tx: _Tx, queue: str, seconds: float) -> float | None:
    """Pause ``queue`` for ``seconds`` if it asks for that; return the pause end."""
    row = tx.execute(
        f"SELECT pause_on_429, paused_until FROM queue_limits WHERE queue = ?{tx.for_update}",
        (queue,),
    ).fetchone()
    if row is None or not row[0]:
        return None
    until = tx.now + max(0.0, seconds)
    if row[1] is not None and float(row[1]) > until:
        return float(row[1])
    tx.execute("UPDATE queue_limits SET paused_until = ? WHERE queue = ?", (until, queue))
    return until


def _configure_queue(tx: _Tx, queue: str, cfg: dict[str, Any]) -> None:
    """Create or update a queue's limits, keeping its live bucket and pause."""
    tx.limited.clear()  # queues cached as unlimited in this batch may not be now
    cols = ("max_concurrency", "rate", "burst", "key_concurrency", "fair", "pause_on_429")
    values = (
        cfg.get("max_concurrency"),
        cfg.get("rate"),
        cfg.get("burst"),
        cfg.get("key_concurrency"),
        1 if cfg.get("fair") else 0,
        1 if cfg.get("pause_on_429", True) else 0,
    )
    row = tx.execute(
        f"SELECT {', '.join(cols)}, tokens, refilled_at FROM queue_limits "
        f"WHERE queue = ?{tx.for_update}",
        (queue,),
    ).fetchone()
    if row is None:
        tx.execute(
            f"INSERT INTO queue_limits (queue, {', '.join(cols)}, tokens, refilled_at, "
            "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (queue, *values, values[2], tx.now, tx.now),
        )
        tx.ready.add(queue)
        return
    if tuple(row[: len(cols)]) == values:
        return  # every worker writes its config at start: most writes change nothing
    rate, burst = values[1], values[2]
    tokens: float | None = None
    if rate is not None and burst is not None:
        tokens = (
            float(burst)
            if row[1] is None  # the queue had no rate: start with a full bucket
            else min(float(burst), _tokens_now(tx, row[1], row[2], row[6], row[7]))
        )
    tx.execute(
        f"UPDATE queue_limits SET {', '.join(f'{c} = ?' for c in cols)}, tokens = ?, "
        "refilled_at = ?, updated_at = ? WHERE queue = ?",
        (*values, tokens, tx.now, tx.now, queue),
    )
    tx.ready.add(queue)


def _pause_queue(tx: _Tx, queue: str, until: float | None) -> None:
    """Set (or with None, clear) a queue's pause; an unconfigured queue gets a row."""
    tx.limited.clear()  # queues cached as unlimited in this batch may not be now
    tx.execute(
        "INSERT INTO queue_limits (queue, fair, pause_on_429, updated_at) VALUES (?, 0, 0, ?) "
        "ON CONFLICT DO NOTHING",
        (queue, tx.now),
    )
    tx.execute(
        "UPDATE queue_limits SET paused_until = ?, updated_at = ? WHERE queue = ?",
        (until, tx.now, queue),
    )
    if until is None:
        tx.ready.add(queue)


def _queue_stats(tx: _Tx) -> list[QueueStats]:
    now = tx.now
    counts: dict[str, list[Any]] = {}
    # ready: what a claim could take now (not a suspended run's task: it waits for an
    # operator, and an alert on its age would send one to idle workers)
    due = f"t.available_at <= ? AND {_NOT_SUSPENDED}"
    for q, ready, oldest, running, later in tx.execute(
        "SELECT t.queue, "
        f"sum(CASE WHEN {due} THEN 1 ELSE 0 END), "
        f"min(CASE WHEN {due} THEN t.available_at END), "
        f"sum(CASE WHEN {_RUNNING} THEN 1 ELSE 0 END), "
        "sum(CASE WHEN t.lease_owner IS NULL AND t.available_at > ? THEN 1 ELSE 0 END) "
        "FROM tasks t GROUP BY t.queue",
        (now, now, now, now),
    ).fetchall():
        counts[q] = [int(ready or 0), oldest, int(running or 0), int(later or 0), {}]
    for q, key, n in tx.execute(
        "SELECT queue, limit_key, count(*) FROM tasks WHERE kind = 'activity' "
        f"AND limit_key IS NOT NULL AND {_RUNNING} GROUP BY queue, limit_key",
        (now,),
    ).fetchall():
        counts[q][4][key] = int(n)
    limits = {
        r[0]: tuple(r)
        for r in tx.execute(f"SELECT {_QL_COLS} FROM queue_limits").fetchall()
        if not str(r[0]).startswith(DEPENDENCY_PREFIX)  # dependency limiters: not queues
    }
    out: list[QueueStats] = []
    for q in sorted(set(counts) | set(limits)):
        ready, oldest, running, later, by_key = counts.get(q, [0, None, 0, 0, {}])
        row = limits.get(q)
        if row is None:
            out.append(
                QueueStats(
                    queue=q,
                    ready=ready,
                    oldest_ready_age=None if oldest is None else max(0.0, now - oldest),
                    running=running,
                    running_by_key=by_key,
                    scheduled=later,
                )
            )
            continue
        _q, cap, rate, burst, tokens, refilled_at, key_cap, fair, p429, paused, _c = row
        out.append(
            QueueStats(
                queue=q,
                ready=ready,
                oldest_ready_age=None if oldest is None else max(0.0, now - oldest),
                running=running,
                running_by_key=by_key,
                scheduled=later,
                paused_until=paused if paused is not None and paused > now else None,
                tokens=(
                    None if rate is None else _tokens_now(tx, rate, burst, tokens, refilled_at)
                ),
                max_concurrency=cap,
                rate=rate,
                burst=burst,
                key_concurrency=key_cap,
                fair=bool(fair),
                pause_on_429=bool(p429),
                configured=True,
            )
        )
    return out


# operations of other concerns (imported last: see the package docstring)
from .claims import _LEASE_SET, _NOT_SUSPENDED  # noqa: E402
