"""Bad store conditions get a clear error and lose nothing."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import tether
import tether.store
from tether.store.sqlite import _SCHEMA_VERSION, SqliteStore


async def test_sqlite_locked_file_gives_clear_error_and_keeps_runs(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    app = tether.App(store=f"sqlite:///{path}")

    @app.workflow
    async def wf(x: int) -> int:
        return x

    await app.start(wf, 1, run_id="kept")
    await app.close()

    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    try:
        blocked = tether.App(store=SqliteStore(str(path), busy_timeout=0.2))
        blocked._workflows["wf"] = wf
        with pytest.raises(tether.StoreError) as err:
            await blocked.start(wf, 2, run_id="new")
        message = str(err.value)
        assert "locked" in message and "Nothing was written" in message
        await blocked.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()

    again = tether.App(store=f"sqlite:///{path}")
    again._workflows["wf"] = wf
    assert (await again.get("kept")).input == '{"args":[1],"kwargs":{}}'
    with pytest.raises(tether.RunNotFoundError):
        await again.get("new")
    await again.close()


def test_sqlite_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(tether.StoreError, match="does not exist"):
        SqliteStore(str(tmp_path / "nope" / "t.db"))


def test_unknown_store_url_is_a_clear_error() -> None:
    with pytest.raises(tether.ConfigurationError, match="unsupported store URL"):
        tether.store.open_store("mysql://localhost/db")


def test_opening_a_new_file_while_another_process_holds_it_waits_its_turn(
    tmp_path: Path,
) -> None:
    """Workers started together on a new file race to switch it to WAL. SQLite answers
    "locked" at once to that switch (no busy handler) while another connection holds a
    lock, so the store must retry within its busy timeout instead of failing."""
    import threading
    import time

    db = tmp_path / "new.db"
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process, mid-way through its own set-up
    release = threading.Timer(0.3, lambda: other.execute("COMMIT"))
    release.start()
    t0 = time.monotonic()
    try:
        store = SqliteStore(str(db), busy_timeout=10)
    finally:
        release.join()
        other.close()
    waited = time.monotonic() - t0
    store.close_sync()
    assert waited >= 0.25  # it waited for the other connection, then went on
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("PRAGMA user_version").fetchone() == (_SCHEMA_VERSION,)
    finally:
        conn.close()


def test_a_file_system_that_refuses_wal_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite answers ``PRAGMA journal_mode = WAL`` with the mode it kept when it cannot
    switch (a file system without shared memory): that is refused, not ignored."""
    import tether.store.sqlite as sqlite_store

    real_connect = sqlite3.connect

    class NoWal:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self._conn = conn

        def execute(self, text: str, *args: Any) -> Any:
            if "journal_mode" in text.replace(" ", "").lower():
                return real_connect(":memory:").execute("SELECT 'delete'")
            return self._conn.execute(text, *args)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._conn, name)

    monkeypatch.setattr(
        sqlite_store.sqlite3, "connect", lambda *a, **k: NoWal(real_connect(*a, **k))
    )
    with pytest.raises(tether.StoreError, match=r"refused WAL mode.*'delete'"):
        SqliteStore(str(tmp_path / "t.db"))


async def test_a_number_too_large_for_the_store_is_a_configuration_error(tmp_path: Path) -> None:
    """A caller's integer past 64 bits (a limit, an id, a sequence number) is refused as
    bad input naming the store's limit, not an OverflowError from the SQLite binding;
    the store goes on serving the next operation."""
    app = tether.App(store=f"sqlite:///{tmp_path / 't.db'}")
    huge = 10**23
    for call in (
        lambda: app.store.list_runs(limit=huge),
        lambda: app.store.read_history("r", huge),
        lambda: app.dead_letters(letter_id=huge),
    ):
        with pytest.raises(tether.ConfigurationError, match="64-bit"):
            await call()
    assert await app.list(limit=10) == []
    await app.close()


async def test_listing_calls_refuse_a_bad_page_or_time_floor(tmp_path: Path) -> None:
    """A negative or fractional limit, a negative offset, a NaN cursor or floor, a naive
    datetime: one error naming the value, where before a negative limit listed every
    run (SQLite: no limit) or none, a NaN floor silently matched nothing, a float
    limit failed in the store ("datatype mismatch") and a naive datetime was read in
    this machine's time zone."""
    app = tether.App(store=f"sqlite:///{tmp_path / 't.db'}")

    @app.workflow
    async def wf(x: int) -> int:
        return x

    await app.start(wf, 1, run_id="kept")
    nan = float("nan")
    for call, named in (
        (lambda: app.list(limit=-1), "limit"),
        (lambda: app.list(limit=1.5), "limit"),
        (lambda: app.list(limit=True), "limit"),
        (lambda: app.list(limit=10**23), "limit"),
        (lambda: app.list(offset=-5), "offset"),
        (lambda: app.list(since=nan), "since"),
        (lambda: app.list(before=(nan, "kept")), "created_at"),
        (lambda: app.list(before="kept"), "before"),
        (lambda: app.usage(since=float("inf")), "since"),
        (lambda: app.usage(since=datetime(2020, 1, 1)), "time zone"),
        (lambda: app.usage(since="yesterday"), "since"),
        (lambda: app.dead_letters(limit=-1), "limit"),
        (lambda: app.approvals(limit=-1), "limit"),
        (lambda: app.schedules(limit=-1), "limit"),
        (lambda: app.audit_log(limit=-1), "limit"),
    ):
        with pytest.raises(tether.ConfigurationError, match=named):
            await call()
    assert [r.run_id for r in await app.list(limit=0)] == []
    since = datetime(2020, 1, 1, tzinfo=UTC)
    assert [r.run_id for r in await app.list(since=since)] == ["kept"]
    page = await app.list(limit=1)
    assert await app.list(before=(page[0].created_at, page[0].run_id)) == []
    await app.close()
