"""Kill switches and the audit log: operator decisions kept in the store.

A switch disables a workflow, an activity, a model or a tenant for every worker on
the store until it is removed; workers read the table every second or two and hold
the matching tasks back (``_worker.py``), each looked at again every few seconds, so
a switch turned back on takes effect within that time. The audit log records who did what to which
run or switch, from the API, the console or the CLI, and when an operator was told that a
run needs intervention (``alerted``: the App's ``on_alert`` hook returned, or it was
logged), which is how the alert watcher finds the runs nobody was told about.
"""

from __future__ import annotations

import json
from typing import Any

from ._tx import _Tx

SWITCH_KINDS = ("workflow", "activity", "model", "tenant")


def _set_switch(
    tx: _Tx, kind: str, name: str, off: bool, by: str | None, reason: str | None
) -> bool:
    """Disable (``off``) or enable ``kind``/``name``; True when that changed anything."""
    if off:
        row = tx.execute(
            "INSERT INTO switches (kind, name, by_whom, reason, created_at) VALUES (?,?,?,?,?) "
            "ON CONFLICT (kind, name) DO NOTHING RETURNING kind",
            (kind, name, by, reason, tx.now),
        ).fetchone()
        return row is not None
    row = tx.execute(
        "DELETE FROM switches WHERE kind = ? AND name = ? RETURNING kind", (kind, name)
    ).fetchone()
    return row is not None


def _switches(tx: _Tx) -> list[tuple[Any, ...]]:
    rows = tx.execute(
        "SELECT kind, name, by_whom, reason, created_at FROM switches ORDER BY kind, name"
    ).fetchall()
    return [tuple(r) for r in rows]


def _audit(tx: _Tx, actor: str, action: str, target: str, detail: dict[str, Any] | None) -> None:
    tx.execute(
        "INSERT INTO audit_log (at, actor, action, target, detail) VALUES (?,?,?,?,?)",
        (tx.now, actor, action, target, json.dumps(detail) if detail else None),
    )


def _audit_log(tx: _Tx, target: str | None, limit: int) -> list[tuple[Any, ...]]:
    where, args = ("WHERE target = ?", (target,)) if target is not None else ("", ())
    rows = tx.execute(
        f"SELECT id, at, actor, action, target, detail FROM audit_log {where} "
        "ORDER BY id DESC LIMIT ?",
        (*args, limit),
    ).fetchall()
    return [tuple(r) for r in rows]


def _untold_interventions(tx: _Tx, ended_before: float, limit: int) -> list[tuple[str, float]]:
    """(run id, completed_at) of up to ``limit`` runs that ended ``needs_intervention``
    before ``ended_before`` and were not told since (no ``alerted`` entry at or after
    that end: a run retried that ends again is untold again), oldest end first."""
    rows = tx.execute(
        "SELECT r.run_id, r.completed_at FROM runs r WHERE r.status = 'needs_intervention' "
        "AND r.completed_at < ? AND NOT EXISTS (SELECT 1 FROM audit_log a WHERE "
        "a.target = 'run:' || r.run_id AND a.action = 'alerted' AND a.at >= r.completed_at) "
        "ORDER BY r.completed_at, r.run_id LIMIT ?",
        (ended_before, limit),
    ).fetchall()
    return [(r[0], r[1]) for r in rows]
