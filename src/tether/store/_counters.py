"""Run counters: runs per (tenant, workflow, status) and ended runs per hour, kept by
triggers on the runs table, so the console's overview and ``/metrics`` read a few
rows instead of counting a million; and the model usage ledger per tenant and day.

Every change of a run's status or end time (and every new or deleted run) appends a
row to ``run_count_deltas`` in the same transaction: +1 for the run as it is now, -1
for it as it was. Appending never waits for another transaction (a shared counter row
would make every worker's commit queue behind it on PostgreSQL). Readers fold the
deltas into ``run_counts`` and ``run_ends`` (``_fold_run_counts``), and add what was
appended since. The tenant ``''`` stands for runs without one.
"""

from __future__ import annotations

_TABLES = (
    "CREATE TABLE IF NOT EXISTS run_count_deltas (tenant TEXT NOT NULL, workflow TEXT NOT "
    "NULL, status TEXT NOT NULL, hour BIGINT, n BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS run_counts (tenant TEXT NOT NULL, workflow TEXT NOT NULL, "
    "status TEXT NOT NULL, n BIGINT NOT NULL, PRIMARY KEY (tenant, workflow, status))",
    "CREATE TABLE IF NOT EXISTS run_ends (tenant TEXT NOT NULL, hour BIGINT NOT NULL, "
    "status TEXT NOT NULL, n BIGINT NOT NULL, PRIMARY KEY (tenant, hour, status))",
    # model tokens and cost per tenant and day (UTC): a workflow task's commit appends
    # what its run's model calls used (``WorkflowTaskResult.usage``), folded like the rest
    "CREATE TABLE IF NOT EXISTS usage_deltas (tenant TEXT NOT NULL, day TEXT NOT NULL, "
    "tokens BIGINT NOT NULL, cost TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS usage_days (tenant TEXT NOT NULL, day TEXT NOT NULL, "
    "tokens BIGINT NOT NULL, cost TEXT NOT NULL, PRIMARY KEY (tenant, day))",
)


def _backfill(hour: str) -> tuple[str, ...]:
    """Count the runs a store holds when the counters are added to it."""
    return (
        "INSERT INTO run_counts (tenant, workflow, status, n) SELECT COALESCE(tenant, ''), "
        "workflow, status, COUNT(*) FROM runs GROUP BY COALESCE(tenant, ''), workflow, status",
        f"INSERT INTO run_ends (tenant, hour, status, n) SELECT COALESCE(tenant, ''), {hour}, "
        f"status, COUNT(*) FROM runs WHERE completed_at IS NOT NULL GROUP BY "
        f"COALESCE(tenant, ''), {hour}, status",
    )


def _row(side: str, n: int, hour: str) -> str:
    """The delta row of a run as ``side`` (``NEW`` or ``OLD``) counts ``n``."""
    return (
        f"(COALESCE({side}.tenant, ''), {side}.workflow, {side}.status, "
        f"{hour.replace('completed_at', f'{side}.completed_at')}, {n})"
    )


_INSERT = "INSERT INTO run_count_deltas (tenant, workflow, status, hour, n) VALUES "
_SQLITE_HOUR = "CAST(completed_at / 3600 AS INTEGER)"  # truncates: times are positive
_PG_HOUR = "FLOOR(completed_at / 3600)::BIGINT"

#: the counters of a SQLite store: tables, triggers, and the count of what it holds
SQLITE = (
    *_TABLES,
    "CREATE TRIGGER IF NOT EXISTS runs_counted_insert AFTER INSERT ON runs BEGIN "
    f"{_INSERT}{_row('NEW', 1, _SQLITE_HOUR)}; END",
    "CREATE TRIGGER IF NOT EXISTS runs_counted_update AFTER UPDATE OF status, completed_at "
    "ON runs WHEN OLD.status IS NOT NEW.status OR OLD.completed_at IS NOT NEW.completed_at "
    f"BEGIN {_INSERT}{_row('OLD', -1, _SQLITE_HOUR)}, {_row('NEW', 1, _SQLITE_HOUR)}; END",
    "CREATE TRIGGER IF NOT EXISTS runs_counted_delete AFTER DELETE ON runs BEGIN "
    f"{_INSERT}{_row('OLD', -1, _SQLITE_HOUR)}; END",
    *_backfill(_SQLITE_HOUR),
)

#: the counters of a PostgreSQL store (the function lives in the store's schema)
POSTGRES = (
    *_TABLES,
    # (its search path is the store's schema, whoever changes a run: psql included)
    "CREATE OR REPLACE FUNCTION tether_count_runs() RETURNS trigger LANGUAGE plpgsql "
    "SET search_path FROM CURRENT AS $$ "
    "BEGIN "
    f"IF TG_OP <> 'INSERT' THEN {_INSERT}{_row('OLD', -1, _PG_HOUR)}; END IF; "
    f"IF TG_OP <> 'DELETE' THEN {_INSERT}{_row('NEW', 1, _PG_HOUR)}; END IF; "
    "RETURN NULL; END $$",
    "DROP TRIGGER IF EXISTS runs_counted_insert ON runs",
    "CREATE TRIGGER runs_counted_insert AFTER INSERT ON runs FOR EACH ROW "
    "EXECUTE FUNCTION tether_count_runs()",
    "DROP TRIGGER IF EXISTS runs_counted_update ON runs",
    "CREATE TRIGGER runs_counted_update AFTER UPDATE OF status, completed_at ON runs "
    "FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.completed_at IS "
    "DISTINCT FROM NEW.completed_at) EXECUTE FUNCTION tether_count_runs()",
    "DROP TRIGGER IF EXISTS runs_counted_delete ON runs",
    "CREATE TRIGGER runs_counted_delete AFTER DELETE ON runs FOR EACH ROW "
    "EXECUTE FUNCTION tether_count_runs()",
    *_backfill(_PG_HOUR),
)

#: the tables that hold counts (``erase_tenant`` removes a tenant's rows)
COUNT_TABLES = ("run_count_deltas", "run_counts", "run_ends", "usage_deltas", "usage_days")
