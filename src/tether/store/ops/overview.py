"""Aggregates for an operator's overview: runs by status, outcomes over time, spend."""

from __future__ import annotations

import json
from collections.abc import Sequence
from decimal import Decimal
from typing import Any, cast

from ..._codec import sealed_fields
from ...blobs import REF, BlobError
from ...encryption import KeyUnavailableError
from ._tx import _Tx

#: a lock every fold of the run counters takes on PostgreSQL (one at a time)
_FOLD_LOCK = 0x7E7C0C


def _fold_run_counts(tx: _Tx) -> None:
    """Fold the appended run count changes into the counters (``store/_counters.py``)."""
    if tx.paramstyle == "qmark":  # SQLite: the write lock keeps every writer out meanwhile
        tx.execute(
            "INSERT INTO run_counts (tenant, workflow, status, n) SELECT tenant, workflow, "
            "status, SUM(n) FROM run_count_deltas WHERE true GROUP BY tenant, workflow, "
            "status ON CONFLICT (tenant, workflow, status) DO UPDATE SET "
            "n = run_counts.n + excluded.n"
        )
        tx.execute(
            "INSERT INTO run_ends (tenant, hour, status, n) SELECT tenant, hour, status, "
            "SUM(n) FROM run_count_deltas WHERE hour IS NOT NULL GROUP BY tenant, hour, "
            "status ON CONFLICT (tenant, hour, status) DO UPDATE SET n = run_ends.n + excluded.n"
        )
        tx.execute("DELETE FROM run_count_deltas")
    else:  # PostgreSQL: writers append meanwhile; what one statement took is what it folds
        tx.execute("SELECT pg_advisory_xact_lock(?)", (_FOLD_LOCK,))
        tx.execute(
            "WITH moved AS (DELETE FROM run_count_deltas RETURNING tenant, workflow, status, "
            "hour, n), counted AS (INSERT INTO run_counts (tenant, workflow, status, n) "
            "SELECT tenant, workflow, status, SUM(n) FROM moved GROUP BY tenant, workflow, "
            "status ORDER BY tenant, workflow, status ON CONFLICT (tenant, workflow, status) "
            "DO UPDATE SET n = run_counts.n + EXCLUDED.n RETURNING 1) "
            "INSERT INTO run_ends (tenant, hour, status, n) SELECT tenant, hour, status, "
            "SUM(n) FROM moved WHERE hour IS NOT NULL GROUP BY tenant, hour, status "
            "ORDER BY tenant, hour, status ON CONFLICT (tenant, hour, status) DO UPDATE SET "
            "n = run_ends.n + EXCLUDED.n"
        )
    tx.execute("DELETE FROM run_counts WHERE n = 0")
    tx.execute("DELETE FROM run_ends WHERE n = 0")
    _fold_usage(tx)


def _fold_usage(tx: _Tx) -> None:
    """Fold the model usage appended by workflow tasks into ``usage_days`` (costs are
    decimal text: added here, exactly). Runs inside ``_fold_run_counts``'s lock."""
    taken = tx.execute("DELETE FROM usage_deltas RETURNING tenant, day, tokens, cost").fetchall()
    sums: dict[tuple[str, str], tuple[int, Decimal]] = {}
    for tenant, day, tokens, cost in taken:
        before = sums.get((tenant, day), (0, Decimal(0)))
        sums[(tenant, day)] = (before[0] + int(tokens), before[1] + Decimal(cost))
    for (tenant, day), (tokens, cost) in sorted(sums.items()):
        row = tx.execute(
            "SELECT tokens, cost FROM usage_days WHERE tenant = ? AND day = ?", (tenant, day)
        ).fetchone()
        if row is not None:
            tokens, cost = tokens + int(row[0]), cost + Decimal(row[1])
        tx.execute(
            "INSERT INTO usage_days (tenant, day, tokens, cost) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (tenant, day) DO UPDATE SET tokens = excluded.tokens, "
            "cost = excluded.cost",
            (tenant, day, tokens, str(cost)),
        )


def _usage_on(tx: _Tx, day: str, tenant: str | None) -> list[tuple[str, int, str]]:
    """(tenant, tokens, cost) of the model calls recorded on ``day`` (UTC), per tenant
    ('' for runs without one), or of one ``tenant``."""
    _fold_run_counts(tx)
    where, args = (
        ("day = ?", (day,)) if tenant is None else ("day = ? AND tenant = ?", (day, tenant))
    )
    rows = tx.execute(
        f"SELECT tenant, tokens, cost FROM usage_days WHERE {where} ORDER BY tenant", args
    ).fetchall()
    return [(r[0], int(r[1]), str(r[2])) for r in rows]


def _run_counts(tx: _Tx, tenant: str | None) -> list[tuple[str, str, int]]:
    """(workflow, status, runs) for every pair that has runs: from the counters, after
    folding what was appended to them (and adding what was appended since)."""
    _fold_run_counts(tx)
    where, args = ("WHERE tenant = ?", (tenant,)) if tenant is not None else ("", ())
    rows = tx.execute(
        "SELECT workflow, status, SUM(n) FROM (SELECT tenant, workflow, status, n FROM "
        "run_counts UNION ALL SELECT tenant, workflow, status, n FROM run_count_deltas) c "
        f"{where} GROUP BY workflow, status HAVING SUM(n) <> 0 ORDER BY workflow, status",
        args,
    ).fetchall()
    return [(r[0], r[1], int(r[2])) for r in rows]


def _run_outcomes(
    tx: _Tx, since: float, bucket: float, tenant: str | None
) -> list[tuple[int, str, int]]:
    """(bucket number, status, runs) of the runs that ended since ``since``, bucketed
    by ``bucket`` seconds of their end time. Whole hours (``since`` and ``bucket``
    multiples of an hour) are read from the counters of ended runs per hour; any other
    window reads every ended run's row (no index on the end time: it would cost every
    run's end a write)."""
    if since % 3600 == 0 and bucket % 3600 == 0:
        return _outcomes_counted(tx, since, bucket, tenant)
    where = "completed_at >= ?" + (" AND tenant = ?" if tenant is not None else "")
    args: tuple[Any, ...] = (since, bucket, since) + ((tenant,) if tenant is not None else ())
    # whole buckets: CAST truncates in SQLite (positive values), FLOOR in PostgreSQL
    num = (
        "FLOOR((completed_at - ?) / ?)"
        if tx.paramstyle != "qmark"
        else ("CAST((completed_at - ?) / ? AS INTEGER)")
    )
    rows = tx.execute(
        f"SELECT {num} AS b, status, COUNT(*) FROM runs WHERE {where} GROUP BY b, status "
        "ORDER BY b, status",
        args,
    ).fetchall()
    return [(int(r[0]), r[1], int(r[2])) for r in rows]


def _outcomes_counted(
    tx: _Tx, since: float, bucket: float, tenant: str | None
) -> list[tuple[int, str, int]]:
    """``_run_outcomes`` from the counters of ended runs per hour."""
    where = "hour >= ?" + (" AND tenant = ?" if tenant is not None else "")
    args: tuple[Any, ...] = (since, bucket, since / 3600) + (
        (tenant,) if tenant is not None else ()
    )
    num = (
        "FLOOR((hour * 3600 - ?) / ?)"
        if tx.paramstyle != "qmark"
        else ("CAST((hour * 3600 - ?) / ? AS INTEGER)")
    )
    rows = tx.execute(
        f"SELECT {num} AS b, status, SUM(n) FROM (SELECT tenant, hour, status, n FROM run_ends "
        "UNION ALL SELECT tenant, hour, status, n FROM run_count_deltas WHERE hour IS NOT "
        f"NULL) c WHERE {where} GROUP BY b, status HAVING SUM(n) <> 0 ORDER BY b, status",
        args,
    ).fetchall()
    return [(int(r[0]), r[1], int(r[2])) for r in rows]


def _spend_on(tx: _Tx, day: str) -> list[tuple[str, int, str]]:
    """(scope, tokens, cost) of the model spend recorded on ``day`` (UTC date)."""
    rows = tx.execute(
        "SELECT scope, tokens, cost FROM ai_spend WHERE day = ? ORDER BY scope", (day,)
    ).fetchall()
    return [(r[0], int(r[1]), str(r[2])) for r in rows]


def _open_counts(tx: _Tx) -> dict[str, int]:
    """How many dead letters and reviews are open, and webhook deliveries pending or
    given up: counts (not lists), for metrics and alerts."""
    # a replay's claim its process left behind (stale) counts as open, as in listings
    cond, cargs = _open(tx)
    out = {
        "dead_letters": int(
            tx.execute(f"SELECT COUNT(*) FROM dead_letters WHERE {cond}", cargs).fetchone()[0]
        )
    }
    for key, sql in (
        (
            "approvals",  # undecided reviews of live runs, as list_approvals(status="open")
            "SELECT COUNT(*) FROM approvals a JOIN runs r ON r.run_id = a.run_id "
            "WHERE a.status = 'open' AND r.status NOT IN ('completed', 'failed', "
            "'cancelled', 'terminated', 'timed_out', 'needs_intervention', 'continued_as_new')",
        ),
        ("webhooks_pending", "SELECT COUNT(*) FROM webhook_outbox WHERE state = 'pending'"),
        ("webhooks_failed", "SELECT COUNT(*) FROM webhook_outbox WHERE state = 'failed'"),
    ):
        out[key] = int(tx.execute(sql).fetchone()[0])
    return out


#: every column that holds payloads (each may hold a blob reference, or be offloaded)
_PAYLOAD_COLUMNS = (
    ("events", ("data",)),
    ("runs", ("input", "output", "error", "custom_status", "task_error")),
    ("tasks", ("payload", "heartbeat", "last_error")),
    ("dead_letters", ("input", "error", "resolution")),
    ("approvals", ("proposal", "reason")),
    ("debounces", ("input",)),
    ("schedules", ("input",)),
    ("webhook_outbox", ("output", "error")),
    ("ai_cache", ("value",)),
)
#: tables whose rows belong to a run (and through it to a tenant)
_BY_RUN = {"events", "tasks", "dead_letters", "approvals", "webhook_outbox"}


def _blob_refs(
    tx: _Tx,
    tenant: str | None = None,
    run_ids: Sequence[str] | None = None,
    other_than: str | None = None,
) -> set[str]:
    """Every blob reference (``sha256:<hex>``) the store's payloads hold (only those of
    ``tenant``'s runs, or of the runs ``run_ids``, or of everything but ``other_than``'s
    runs, if given): the ones written into them, and payloads offloaded."""
    found: set[str] = set()
    if run_ids is not None and not run_ids:
        return found
    for table, columns in _PAYLOAD_COLUMNS:
        scope, args = "", cast(tuple[str, ...], ())
        if run_ids is not None:
            if table not in _BY_RUN and table != "runs":
                continue
            scope = f" AND run_id IN ({','.join('?' * len(run_ids))})"
            args = tuple(run_ids)
        elif tenant is not None:
            if table == "runs":
                scope, args = " AND tenant = ?", (tenant,)
            elif table in _BY_RUN:
                scope = " AND run_id IN (SELECT run_id FROM runs WHERE tenant = ?)"
                args = (tenant,)
            else:
                continue
        elif other_than is not None:
            if table == "runs":
                scope, args = " AND (tenant IS NULL OR tenant <> ?)", (other_than,)
            elif table in _BY_RUN:
                scope = " AND run_id NOT IN (SELECT run_id FROM runs WHERE tenant = ?)"
                args = (other_than,)
        for column in columns:
            # sealed or offloaded payloads hide what they hold: those rows are decoded
            rows = tx.execute(
                f"SELECT {column} FROM {table} WHERE ({column} LIKE ? OR {column} LIKE ?)" + scope,
                ("%sha256:%", "%~_1:%", *args),
            ).fetchall()
            for (text,) in rows:
                found.update(REF.findall(str(text)))  # an offloaded payload's own blob
                try:
                    text = _decoded(tx, str(text), f"{table}.{column}")
                except KeyUnavailableError as exc:
                    if exc.destroyed:  # crypto-shredded: its blobs are erased data too
                        continue
                    raise
                except BlobError:  # an offloaded payload whose blob is gone already
                    continue
                found.update(REF.findall(text))
    return found


def _decoded(tx: _Tx, text: str, where: str) -> str:
    """A payload column's text decoded: fetched if offloaded, its sealed parts opened
    (an error's ``sealed``, an event's sealed fields)."""
    text = tx.open(text, where) or ""
    if text.startswith("{") and ('"sealed"' in text or '"~' in text):
        value = json.loads(text)
        if isinstance(value, dict):
            parts = [value.get("sealed"), *sealed_fields(value)]
            text += "".join(tx.open(p, where) or "" for p in parts if isinstance(p, str))
    return text


# operations of other concerns (imported last: see the package docstring)
from .recovery import _open  # noqa: E402
