"""Tenant admission limits: live runs counted, queued runs promoted."""

from __future__ import annotations

from ._tx import _Tx

_LIVE = "('pending', 'running', 'suspended')"  #: statuses that count against admission


def _admission(tx: _Tx, tenant: str) -> tuple[int | None, int]:
    """Lock the tenant's row; return its admission limit (None: none) and live runs."""
    tx.execute(
        "INSERT INTO tenant_limits (tenant, max_running, updated_at) VALUES (?, NULL, ?) "
        "ON CONFLICT DO NOTHING",
        (tenant, tx.now),
    )
    row = tx.execute(
        f"SELECT max_running FROM tenant_limits WHERE tenant = ?{tx.for_update}", (tenant,)
    ).fetchone()
    limit = row[0] if row is not None else None
    if limit is None:
        default = tx.execute("SELECT max_running FROM tenant_limits WHERE tenant = ''").fetchone()
        limit = default[0] if default is not None else None
    if limit is None:
        return None, 0
    # top-level runs only: a child is admitted with its parent (it may not wait for a
    # slot its own parent holds)
    (running,) = tx.execute(
        f"SELECT count(*) FROM runs WHERE tenant = ? AND status IN {_LIVE} "
        "AND parent_run_id IS NULL",
        (tenant,),
    ).fetchone()
    return int(limit), int(running)


def _admit_queued(tx: _Tx, tenant: str, n: int | None) -> int:
    """Admit up to ``n`` (None: all) of the tenant's queued runs, oldest first.

    Each is admitted only if it is still queued when its row is written: a run
    cancelled by a transaction that committed while this one waited for its row
    (PostgreSQL) stays cancelled, and the next queued run takes the room instead."""
    admitted = 0
    while n is None or admitted < n:
        want = n - admitted if n is not None else 2**62
        rows = tx.execute(
            "SELECT run_id, queue, workflow FROM runs WHERE tenant = ? AND status = 'queued' "
            "ORDER BY created_at, run_id LIMIT ?",
            (tenant, want),
        ).fetchall()
        for run_id, queue, workflow in rows:
            if (
                tx.execute(
                    "UPDATE runs SET status = 'pending', updated_at = ? "
                    "WHERE run_id = ? AND status = 'queued' RETURNING run_id",
                    (tx.now, run_id),
                ).fetchone()
                is None
            ):
                continue  # it ended meanwhile: not admitted
            _ensure_workflow_task(tx, run_id, queue, workflow)
            admitted += 1
        if n is None or len(rows) < want:
            break
    return admitted


def _promote(tx: _Tx, tenant: str) -> None:
    """A run of ``tenant`` ended (or its limit changed): admit queued runs into free room."""
    if not tx.execute(
        "SELECT 1 FROM runs WHERE tenant = ? AND status = 'queued' LIMIT 1", (tenant,)
    ).fetchone():
        return
    limit, running = _admission(tx, tenant)
    if limit is None:
        _admit_queued(tx, tenant, None)
    elif running < limit:
        _admit_queued(tx, tenant, limit - running)


def _configure_admission(tx: _Tx, tenant: str, max_running: int | None) -> None:
    """Set a tenant's admission limit ('' is the default); admit what now fits."""
    tx.execute(
        "INSERT INTO tenant_limits (tenant, max_running, updated_at) VALUES (?, ?, ?) "
        "ON CONFLICT (tenant) DO UPDATE SET max_running = excluded.max_running, "
        "updated_at = excluded.updated_at",
        (tenant, max_running, tx.now),
    )
    tenants = (
        [tenant]
        if tenant
        else [
            r[0]
            for r in tx.execute(
                "SELECT DISTINCT tenant FROM runs WHERE status = 'queued' AND tenant IS NOT NULL"
            ).fetchall()
        ]
    )
    for t in sorted(tenants):
        _promote(tx, t)


# operations of other concerns (imported last: see the package docstring)
from .tasks import _ensure_workflow_task  # noqa: E402
