"""Circuit breakers shared by every worker."""

from __future__ import annotations

from typing import Any

from ._tx import _Tx


def _breaker_row(tx: _Tx, name: str) -> tuple[Any, ...]:
    row = tx.execute(
        f"SELECT state, opened_at, window_start, calls, failures, trial_at FROM breakers "
        f"WHERE name = ?{tx.for_update}",
        (name,),
    ).fetchone()
    if row is None:
        tx.execute(
            "INSERT INTO breakers (name, state, window_start, calls, failures) "
            "VALUES (?, 'closed', ?, 0, 0) ON CONFLICT DO NOTHING",
            (name, tx.now),
        )
        return ("closed", None, tx.now, 0, 0, None)
    return tuple(row)


def _breaker_admit(tx: _Tx, cfg: dict[str, Any]) -> float | None:
    """None if the call may go ahead, else seconds until the breaker may let one through."""
    name, cooldown = cfg["name"], float(cfg["cooldown"])
    state, opened_at, _ws, _c, _f, trial_at = _breaker_row(tx, name)
    if state == "closed":
        return None
    if state == "open":
        wait = float(opened_at) + cooldown - tx.now
        if wait > 0:
            return wait
        tx.execute(
            "UPDATE breakers SET state = 'half_open', trial_at = ? WHERE name = ?", (tx.now, name)
        )
        return None  # this caller is the trial
    # half-open: one trial at a time; a trial that never reported is replaced after a cooldown
    if trial_at is not None and tx.now - float(trial_at) < cooldown:
        return max(0.1, float(trial_at) + cooldown - tx.now)
    tx.execute("UPDATE breakers SET trial_at = ? WHERE name = ?", (tx.now, name))
    return None


def _breaker_record(tx: _Tx, cfg: dict[str, Any], ok: bool) -> bool:
    """Record a call's outcome; True when it opened the breaker."""
    name = cfg["name"]
    state, _opened, window_start, calls, failures, _trial = _breaker_row(tx, name)
    if state == "half_open":
        if ok:
            tx.execute(
                "UPDATE breakers SET state = 'closed', window_start = ?, calls = 0, "
                "failures = 0, trial_at = NULL WHERE name = ?",
                (tx.now, name),
            )
        else:
            tx.execute(
                "UPDATE breakers SET state = 'open', opened_at = ?, trial_at = NULL WHERE name = ?",
                (tx.now, name),
            )
            return True  # the trial failed: open again
        return False
    if state == "open":
        return False  # a call admitted before it opened: its outcome changes nothing
    if tx.now - float(window_start) > float(cfg["window"]):
        window_start, calls, failures = tx.now, 0, 0
    calls += 1
    failures += 0 if ok else 1
    if calls >= int(cfg["min_calls"]) and failures / calls >= float(cfg["failure_ratio"]):
        tx.execute(
            "UPDATE breakers SET state = 'open', opened_at = ?, window_start = ?, calls = 0, "
            "failures = 0 WHERE name = ?",
            (tx.now, tx.now, name),
        )
        return True
    tx.execute(
        "UPDATE breakers SET window_start = ?, calls = ?, failures = ? WHERE name = ?",
        (window_start, calls, failures, name),
    )
    return False
