"""Dependency limiters shared by every step that calls one service."""

from __future__ import annotations

from typing import Any

from ._tx import _Tx


def _ensure_dependency(tx: _Tx, dep: str, cfg: dict[str, Any]) -> bool:
    """Create the dependency limiter row ``dep``; update it if its limits changed.

    The usual case (the row exists, unchanged) reads it without a lock, so
    scheduling never waits for claims holding the limiter. Returns whether a call
    may skip the claim (be leased in the scheduling commit): the limiter has no
    limits and no rate-limit pause, so the claim would have nothing to enforce.
    """
    row = tx.execute(
        "SELECT max_concurrency, rate, burst, paused_until FROM queue_limits WHERE queue = ?",
        (dep,),
    ).fetchone()
    want = (cfg.get("max_concurrency"), cfg.get("rate"), cfg.get("burst"))
    if row is not None and tuple(row[:3]) == want:
        paused = row[3]
        return want == (None, None, None) and (paused is None or float(paused) <= tx.now)
    _configure_queue(tx, dep, {**cfg, "fair": False, "key_concurrency": None})
    return False


def _dependency_limited(tx: _Tx, dep: str) -> bool:
    """Whether the limiter ``dep`` has a cap or a rate: a finished call frees something in it.

    A limiter with neither only carries rate-limit pauses; waking claimers when one
    of its calls ends would send every worker to claim for nothing.
    """
    row = tx.execute(
        "SELECT max_concurrency, rate FROM queue_limits WHERE queue = ?", (dep,)
    ).fetchone()
    return row is None or row[0] is not None or row[1] is not None


def _dependency_feedback(
    tx: _Tx,
    task_id: int | None,
    dep: str | None,
    retry_after: float | None,
    error: dict[str, Any] | float | None = None,
) -> float | None:
    """Pause the dependency limiter ``dep`` (or the task's) by rate-limit feedback.

    ``retry_after`` is a 429's Retry-After; ``error`` is the recorded error (its
    ``ratelimit_pause``: seconds until the reset of an exhausted x-ratelimit
    budget) or directly that pause. Returns the pause end, or None.
    """
    if dep is None and task_id is not None:
        row = tx.execute("SELECT dependency FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
        dep = row[0] if row is not None else None
    if dep is None:
        return None
    pause = error if isinstance(error, float | int) else (error or {}).get("ratelimit_pause")
    waits = [float(w) for w in (retry_after, pause) if w is not None and float(w) > 0]
    if not waits:
        return None
    until = tx.now + max(waits)
    row = tx.execute(
        f"SELECT paused_until FROM queue_limits WHERE queue = ?{tx.for_update}", (dep,)
    ).fetchone()
    if row is None:
        return None
    if row[0] is not None and float(row[0]) >= until:
        return float(row[0])
    tx.execute(
        "UPDATE queue_limits SET paused_until = ?, tokens = CASE WHEN rate IS NULL THEN tokens "
        "ELSE 0 END, refilled_at = CASE WHEN rate IS NULL THEN refilled_at ELSE ? END "
        "WHERE queue = ?",
        (until, until, dep),
    )
    return until


# operations of other concerns (imported last: see the package docstring)
from .queues import _configure_queue  # noqa: E402
