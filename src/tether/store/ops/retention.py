"""Retention and erasure: removing ended runs (and everything of theirs) in bounded
batches, leaving a tombstone per run id; and the orphan check of a store.

Each batch is one short transaction over at most ``limit`` runs, so workers are never
held up for long. A purged run's rows go from every table that names it (history,
tasks, dead letters, reviews, webhook deliveries, batch holds, audit entries); its id
stays in ``purged_runs`` with when and why, so asking for it answers "purged", not
"unknown".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._definitions import CHAIN_SEPARATOR, chain_of
from ..._history import RunStatus
from .._counters import COUNT_TABLES
from ._tx import _Tx

#: tables whose rows belong to one run (by ``run_id``): removed with it, and copied
#: after its row by ``tether store migrate``, in this order (a table added here is
#: copied too)
RUN_TABLES = (
    "events",
    "tasks",
    "dead_letters",
    "approvals",
    "webhook_outbox",
    "signal_ids",
    "ai_holds",  # what a batch's submit step holds in the day's spend (ai_spend)
)
#: statuses a run can be purged in (it has ended); a run that continued as new goes with
#: its chain, when the chain's last run is purged (a live chain's runs all stay: lookups
#: follow it from its first id, and an entity's state lives along it)
_ENDED = tuple(s.value for s in RunStatus if s.is_terminal and s is not RunStatus.CONTINUED_AS_NEW)


def _purge_batch(
    tx: _Tx,
    cutoff: float,
    workflow: str | None,
    tenant: str | None,
    limit: int,
    dry_run: bool,
    reason: str,
    spare_from: float | None = None,
) -> tuple[dict[str, int], set[str]]:
    """Remove up to ``limit`` runs that ended before ``cutoff`` (and match the filters):
    the rows removed per table, and the blobs the removed runs' payloads referred to
    (the caller deletes those no other payload refers to; with ``spare_from`` they are
    recorded as pending deletions in the same transaction, see ``_note_blob_deletions``).
    With ``dry_run`` nothing is removed: the counts are what one batch would remove."""
    ids: list[str] = []
    for status in _ENDED:  # by (status, created_at): an index, never a scan of runs
        where = "status = ? AND created_at < ? AND completed_at < ?"
        args: list[Any] = [status, cutoff, cutoff]
        if workflow is not None:
            where += " AND workflow = ?"
            args.append(workflow)
        if tenant is not None:
            where += " AND tenant = ?"
            args.append(tenant)
        # PostgreSQL: rows another purge is removing are skipped, so workers applying a
        # retention at once never wait on (or deadlock with) each other
        rows = tx.execute(
            f"SELECT run_id FROM runs WHERE {where} ORDER BY created_at LIMIT ?{tx.skip_locked}",
            (*args, limit - len(ids)),
        ).fetchall()
        ids.extend(r[0] for r in rows)
        if len(ids) >= limit:
            break
    return _remove(tx, [*ids, *_chains_before(tx, ids)], dry_run, reason, spare_from)


def _chains_before(tx: _Tx, ends: list[str]) -> list[str]:
    """The runs that continued as new into each of ``ends`` (the last runs of their
    chains), back to each chain's first: found by id (a chain's ids are its first id
    with ``~1``, ``~2``, ...), each checked to name the next as ``continued_to``. A chain
    goes whole in the batch of its last run."""
    out: list[str] = []
    for end in ends:
        first, n = chain_of(end)
        if n == 0:
            continue
        links: dict[str, str] = {}
        names = [first, *(f"{first}{CHAIN_SEPARATOR}{k}" for k in range(1, n))]
        for i in range(0, len(names), 500):
            part = names[i : i + 500]
            links.update(
                tx.execute(
                    "SELECT run_id, continued_to FROM runs WHERE status = 'continued_as_new' "
                    f"AND run_id IN ({','.join('?' * len(part))})",
                    part,
                ).fetchall()
            )
        nxt = end
        for name in reversed(names):  # back from the end while the links hold
            if links.get(name) != nxt:
                break
            out.append(name)
            nxt = name
    return out


def _erase_tenant_batch(
    tx: _Tx, tenant: str, limit: int, dry_run: bool, spare_from: float | None = None
) -> tuple[dict[str, int], set[str]]:
    """Remove up to ``limit`` runs of ``tenant`` whatever their status (the caller ended
    the live ones first), then, when none is left, the tenant's own rows. Returns the
    counts and blobs as ``_purge_batch`` does."""
    counts: dict[str, int] = {}
    refs: set[str] = set()
    while True:
        ids = [
            r[0]
            for r in tx.execute(
                "SELECT run_id FROM runs WHERE tenant = ? ORDER BY created_at LIMIT ?",
                (tenant, limit),
            ).fetchall()
        ]
        got, theirs = _remove(tx, ids, dry_run, "tenant erased", spare_from)
        refs |= theirs
        for table, n in got.items():
            counts[table] = counts.get(table, 0) + n
        # PostgreSQL: runs found but removed meanwhile by a purge count nothing here;
        # those found next are others (an empty batch must mean none is left)
        if dry_run or not ids or got["runs"]:
            break
    if not ids:
        if not dry_run:
            _fold_run_counts(tx)  # its runs are gone: its counters hold zeros only
        for table, column in (
            *((t, "tenant") for t in COUNT_TABLES),
            ("tenant_limits", "tenant"),
            ("api_keys", "tenant"),
            ("switches", "name"),
            ("ai_budgets", "scope"),
            ("ai_spend", "scope"),
        ):
            value = f"tenant:{tenant}" if column == "scope" else tenant
            extra = " AND kind = 'tenant'" if table == "switches" else ""
            sql = f"FROM {table} WHERE {column} = ?{extra}"
            if dry_run:
                n = int(tx.execute(f"SELECT COUNT(*) {sql}", (value,)).fetchone()[0])
            else:
                n = _deleted(tx, sql, (value,))
            if n:
                counts[table] = n
    return counts, refs


#: the most runs one statement of a removal names (a parameter each, two for a chain's
#: row): PostgreSQL binds at most 65,535 parameters a statement, SQLite 32,766 in its
#: default builds, and a purge batch may hold 100,000 runs
_REMOVE_CHUNK = 10_000


def _remove(
    tx: _Tx, ids: list[str], dry_run: bool, reason: str, spare_from: float | None = None
) -> tuple[dict[str, int], set[str]]:
    counts: dict[str, int] = {"runs": len(ids)}
    if not ids:
        return counts, set()
    parts = [ids[i : i + _REMOVE_CHUNK] for i in range(0, len(ids), _REMOVE_CHUNK)]
    refs: set[str] = set()
    if not dry_run:
        for part in parts:
            refs |= _blob_refs(tx, run_ids=part)

    def rows(from_where: str, column_values: Callable[[list[str]], list[str]]) -> int:
        """How many rows ``from_where`` (its ``IN`` list left as ``{}``) finds (dry_run)
        or deletes, a part of the runs at a time."""
        n = 0
        for part in parts:
            sql = from_where.format(",".join("?" * len(part)))
            values = column_values(part)
            if dry_run:
                n += int(tx.execute(f"SELECT COUNT(*) {sql}", values).fetchone()[0])
            else:
                n += _deleted(tx, sql, values)
        return n

    for table in RUN_TABLES:
        counts[table] = rows(f"FROM {table} WHERE run_id IN ({{}})", list)
    counts["audit_log"] = rows(
        "FROM audit_log WHERE target IN ({})", lambda part: [f"run:{i}" for i in part]
    )
    if dry_run:
        return counts, refs
    # what the DELETEs removed, not how many ids were found: on PostgreSQL an erasure's
    # runs may be removed by a purge (or the other way round) between the two
    counts["runs"] = 0
    for part in parts:
        marks = ",".join("?" * len(part))
        tx.execute(
            "INSERT INTO purged_runs (run_id, workflow, reason, purged_at) "
            f"SELECT run_id, workflow, ?, ? FROM runs WHERE run_id IN ({marks}) "
            "ON CONFLICT (run_id) DO NOTHING",
            (reason, tx.now, *part),
        )
        counts["runs"] += _deleted(tx, f"FROM runs WHERE run_id IN ({marks})", part)
        # a chain whose latest run went (with the rest of it: retention keeps chains
        # whole): by its id (the primary key), and its head among these runs
        chains = sorted({chain_of(i)[0] for i in part})
        tx.execute(
            f"DELETE FROM chains WHERE chain_id IN ({','.join('?' * len(chains))}) "
            f"AND head_run_id IN ({marks})",
            (*chains, *part),
        )
    if spare_from is not None:
        _note_blob_deletions(tx, refs, spare_from)
    return counts, refs


def _note_blob_deletions(tx: _Tx, refs: set[str], spare_from: float) -> None:
    """Record ``refs`` as pending deletions (``blob_deletions``), in the transaction that
    removes the rows referring to them: a process killed after its commit, before it
    deleted the blobs, leaves them listed for the next purge, erasure or gc-blobs, never
    forgotten. A blob written or put again at or after ``spare_from`` is spared then (an
    attempt may be about to commit a reference to it). A ref listed already keeps its
    row (the earlier, stricter ``spare_from``)."""
    listed = sorted(refs)
    for i in range(0, len(listed), 300):
        part = listed[i : i + 300]
        tx.execute(
            "INSERT INTO blob_deletions (ref, spare_from, noted_at) VALUES "
            f"{','.join(['(?, ?, ?)'] * len(part))} ON CONFLICT (ref) DO NOTHING",
            [v for ref in part for v in (ref, spare_from, tx.now)],
        )


def _blob_deletions(tx: _Tx) -> dict[str, float]:
    """The pending blob deletions: each ref and the time from which a write spares it."""
    rows = tx.execute("SELECT ref, spare_from FROM blob_deletions").fetchall()
    return {str(r[0]): float(r[1]) for r in rows}


def _forget_blob_deletions(tx: _Tx, refs: list[str]) -> None:
    """Remove pending deletions that were carried out (or found not to be due)."""
    for i in range(0, len(refs), 500):
        part = refs[i : i + 500]
        tx.execute(f"DELETE FROM blob_deletions WHERE ref IN ({','.join('?' * len(part))})", part)


def _deleted(tx: _Tx, from_where: str, args: Any) -> int:
    """Delete ``FROM ... WHERE ...``; how many rows (RETURNING: both backends count it)."""
    return len(tx.execute(f"DELETE {from_where} RETURNING 1", args).fetchall())


def _configure_retention(tx: _Tx, tenant: str, seconds: float | None) -> None:
    """Keep the tenant's ended runs ``seconds`` (None: for ever), in its limits row."""
    tx.execute(
        "INSERT INTO tenant_limits (tenant, max_running, updated_at, retention) "
        "VALUES (?, NULL, ?, ?) ON CONFLICT (tenant) DO UPDATE SET "
        "retention = excluded.retention, updated_at = excluded.updated_at",
        (tenant, tx.now, seconds),
    )


def _tenant_retentions(tx: _Tx) -> dict[str, float]:
    """Every tenant with a retention: how many seconds its ended runs are kept."""
    rows = tx.execute(
        "SELECT tenant, retention FROM tenant_limits WHERE retention IS NOT NULL AND tenant <> ''"
    ).fetchall()
    return {r[0]: float(r[1]) for r in rows}


def _workflow_names(tx: _Tx, limit: int) -> list[str]:
    """The workflows the store has runs of, sorted (a mistyped ``--workflow`` is told
    from one with nothing old enough)."""
    rows = tx.execute(
        "SELECT DISTINCT workflow FROM runs ORDER BY workflow LIMIT ?", (limit,)
    ).fetchall()
    return [str(r[0]) for r in rows]


def _purged_run(tx: _Tx, run_id: str) -> tuple[str, float] | None:
    """(why, when) if the run was purged."""
    row = tx.execute(
        "SELECT reason, purged_at FROM purged_runs WHERE run_id = ?", (run_id,)
    ).fetchone()
    return None if row is None else (str(row[0]), float(row[1]))


def _orphans(tx: _Tx) -> dict[str, int]:
    """Rows that name a run the store does not have, per table (all zero in a sound
    store). A schedule's task names its schedule, not a run; a chain's row names its
    head (``stale chains``: a head that continued as new since)."""
    out: dict[str, int] = {}
    for table in RUN_TABLES:
        extra = " AND t.kind <> 'schedule'" if table == "tasks" else ""
        (n,) = tx.execute(
            f"SELECT COUNT(*) FROM {table} t WHERE NOT EXISTS "
            f"(SELECT 1 FROM runs r WHERE r.run_id = t.run_id){extra}"
        ).fetchone()
        out[table] = int(n)
    (n,) = tx.execute(
        "SELECT COUNT(*) FROM tasks t WHERE t.kind = 'schedule' AND NOT EXISTS "
        "(SELECT 1 FROM schedules s WHERE s.schedule_id = t.name)"
    ).fetchone()
    out["schedule tasks"] = int(n)
    # a chain's row names its latest run: one that is gone, or that continued as new
    # since (stale: lookups through the chain stop short of its head)
    (n,) = tx.execute(
        "SELECT COUNT(*) FROM chains c WHERE NOT EXISTS "
        "(SELECT 1 FROM runs r WHERE r.run_id = c.head_run_id)"
    ).fetchone()
    out["chains"] = int(n)
    (n,) = tx.execute(
        "SELECT COUNT(*) FROM chains c JOIN runs r ON r.run_id = c.head_run_id "
        "WHERE r.continued_to IS NOT NULL"
    ).fetchone()
    out["stale chains"] = int(n)
    return out


# operations of other concerns (imported last: see the package docstring)
from .overview import _blob_refs, _fold_run_counts  # noqa: E402
