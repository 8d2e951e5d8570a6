"""A store made by the previous schema version is upgraded in place when opened."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

import tether
from conftest import PG_URL, with_schema
from helpers import eventually
from tether.store.sqlite import _SCHEMA_VERSION


async def _roundtrip(url: str) -> None:
    app = tether.App(store=url)

    @app.workflow
    async def waits() -> str:
        return str(await tether.wait_event("go"))

    async with app.worker(poll_interval=0.05):
        run = await app.start(waits, run_id="after-upgrade")
        old = await app.get("before-upgrade")
        assert old.status is tether.RunStatus.COMPLETED and old.waiting_on is None

        async def waiting() -> bool:
            return bool((await app.get(run.run_id)).waiting_on)

        from helpers import eventually

        await eventually(waiting, what="waiting_on recorded")
        await app.signal(run.run_id, "go", "x", signal_id="s")
        assert (
            await app.signal(run.run_id, "go", "x", signal_id="s") is False
        )  # a repeat (version 11)
        assert await run.result(timeout=10) == "x"
    await app.close()


#: the run counters' tables (version 10)
COUNTERS = ("run_count_deltas", "run_counts", "run_ends")


async def _counted(url: str) -> None:
    """The counters added by the upgrade hold the runs that were there before it."""
    app = tether.App(store=url)
    counts = await app.store.run_counts()
    await app.close()
    assert ("quick", "completed", 1) in counts and ("waits", "completed", 1) in counts


#: tables added after version 1 (a version-1 store made by an old build lacks them)
NEWER_TABLES = (
    "api_keys",
    "ai_cache",
    "ai_spend",
    "ai_budgets",
    "approvals",
    "webhook_outbox",
    "switches",
    "audit_log",
    "signal_ids",  # version 11
    "seal_keys",  # version 12
    "blob_deletions",  # version 13
    "chains",  # version 14
    "ai_holds",  # version 16
)


async def _first_run(url: str) -> None:
    app = tether.App(store=url)

    @app.workflow
    async def quick() -> int:
        return 1

    async with app.worker(poll_interval=0.05):
        assert await (await app.start(quick, run_id="before-upgrade")).result(timeout=10) == 1
    await app.close()


async def test_a_version_1_sqlite_store_is_upgraded(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    await _first_run(f"sqlite:///{db}")
    conn = sqlite3.connect(db)
    conn.execute("ALTER TABLE runs DROP COLUMN waiting_on")  # as version 1 made it
    conn.execute("ALTER TABLE runs DROP COLUMN attrs")
    conn.execute("ALTER TABLE tenant_limits DROP COLUMN retention")  # added in version 9
    for trigger in ("insert", "update", "delete"):  # the run counters came in version 10
        conn.execute(f"DROP TRIGGER runs_counted_{trigger}")
    for table in (*NEWER_TABLES, *COUNTERS):
        conn.execute(f"DROP TABLE {table}")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    await _roundtrip(f"sqlite:///{db}")
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone() == (_SCHEMA_VERSION,)
    assert conn.execute("SELECT count(*) FROM ai_spend").fetchone() == (0,)
    conn.close()
    await _counted(f"sqlite:///{db}")


async def test_a_version_1_postgres_store_is_upgraded(pg_schema: str) -> None:
    import psycopg

    url = with_schema(PG_URL, pg_schema)
    await _first_run(url)
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{pg_schema}"')
        conn.execute("ALTER TABLE runs DROP COLUMN waiting_on")
        conn.execute("ALTER TABLE runs DROP COLUMN attrs")
        conn.execute("ALTER TABLE tenant_limits DROP COLUMN retention")  # added in version 9
        for trigger in ("insert", "update", "delete"):  # the run counters came in version 10
            conn.execute(f"DROP TRIGGER runs_counted_{trigger} ON runs")
        for table in (*NEWER_TABLES, *COUNTERS):
            conn.execute(f"DROP TABLE {table}")
        conn.execute("UPDATE tether_meta SET version = 1")  # as version 1 left it
    await _roundtrip(url)
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{pg_schema}"')
        assert conn.execute("SELECT max(version) FROM tether_meta").fetchone() == (_SCHEMA_VERSION,)
        assert conn.execute("SELECT count(*) FROM ai_spend").fetchone() == (0,)
    await _counted(url)


async def test_a_version_14_sqlite_stores_history_becomes_a_rowid_table(tmp_path: Path) -> None:
    """Version 15 keeps the history in a rowid table: a version-14 file (events WITHOUT
    ROWID) is rebuilt once when opened, every event kept, in order, and runs go on."""
    db = tmp_path / "v14.db"
    url = f"sqlite:///{db}"
    app = tether.App(store=url)

    @app.activity
    async def echo(x: str) -> str:
        return x

    @app.workflow
    async def waits(x: str) -> str:
        first = await echo(x)
        return first + str(await tether.wait_event("go"))

    async with app.worker(poll_interval=0.05):
        run = await app.start(waits, "a" * 2000, run_id="mid-flight")

        async def waiting() -> bool:
            return bool((await app.get(run.run_id)).waiting_on)

        await eventually(waiting, what="waiting for its event")
    before = [(e.seq, e.type, e.data) for e in await app.history("mid-flight")]
    await app.close()
    conn = sqlite3.connect(db)
    conn.executescript(  # the history as version 14 kept it
        "BEGIN; CREATE TABLE old_events (run_id TEXT NOT NULL, seq INTEGER NOT NULL, "
        "type TEXT NOT NULL, step INTEGER, data TEXT, created_at REAL NOT NULL, "
        "PRIMARY KEY (run_id, seq)) WITHOUT ROWID; INSERT INTO old_events SELECT run_id, "
        "seq, type, step, data, created_at FROM events; DROP TABLE events; "
        "ALTER TABLE old_events RENAME TO events; PRAGMA user_version = 14; COMMIT;"
    )
    assert (
        "WITHOUT ROWID"
        in conn.execute("SELECT sql FROM sqlite_schema WHERE name = 'events'").fetchone()[0]
    )
    conn.close()

    app = tether.App(store=url)
    app.activity(echo.fn, name="echo")
    app.workflow(waits.fn, name="waits")
    async with app.worker(poll_interval=0.05):
        assert [(e.seq, e.type, e.data) for e in await app.history("mid-flight")] == before
        await app.signal("mid-flight", "go", "!")
        done = await app.start(waits, "a" * 2000, run_id="mid-flight")  # the same run
        assert await done.result(timeout=10) == "a" * 2000 + "!"
    await app.close()
    conn = sqlite3.connect(db)
    sql = conn.execute("SELECT sql FROM sqlite_schema WHERE name = 'events'").fetchone()[0]
    assert "WITHOUT ROWID" not in sql
    assert conn.execute("PRAGMA user_version").fetchone() == (_SCHEMA_VERSION,)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    with pytest.raises(sqlite3.IntegrityError):  # one event per (run, seq), as before
        conn.execute(
            "INSERT INTO events (run_id, seq, type, data, created_at) "
            "VALUES ('mid-flight', 1, 'Marker', NULL, 0)"
        )
    conn.close()


def test_a_failed_upgrade_of_the_history_changes_nothing_and_says_what_it_needs(
    tmp_path: Path,
) -> None:
    from tether.store.sqlite import SqliteStore

    db = tmp_path / "v14.db"
    SqliteStore(str(db)).close_sync()
    conn = sqlite3.connect(db)
    # as version 14 left it, with something in the way of the rebuild (a full disk
    # fails the same statements)
    conn.executescript(
        "BEGIN; DROP TABLE events; CREATE TABLE events (run_id TEXT NOT NULL, seq INTEGER "
        "NOT NULL, type TEXT NOT NULL, step INTEGER, data TEXT, created_at REAL NOT NULL, "
        "PRIMARY KEY (run_id, seq)) WITHOUT ROWID; INSERT INTO events VALUES "
        "('r', 1, 'WorkflowStarted', NULL, '{}', 0); CREATE TABLE events_v15 (x); "
        "PRAGMA user_version = 14; COMMIT;"
    )
    conn.close()
    with pytest.raises(tether.StoreError, match="rebuilds the run histories") as got:
        SqliteStore(str(db))
    assert "nothing was changed" in str(got.value) and "free disk" in str(got.value)
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone() == (14,)
    assert (
        "WITHOUT ROWID"
        in conn.execute("SELECT sql FROM sqlite_schema WHERE name = 'events'").fetchone()[0]
    )
    assert conn.execute("SELECT count(*) FROM events").fetchone() == (1,)
    conn.close()
