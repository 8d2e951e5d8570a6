"""``tether store migrate``: SQLite to PostgreSQL with runs in flight, verified."""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import tether
from conftest import PG_URL, drop_schema, require_pg, with_schema
from tether import EventType, RunStatus
from tether.blobs import BlobStore

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import migrate_app  # noqa: E402


def _cli(*args: str, prefix: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)])}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "tether.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def _until(check: object, what: str, timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():  # type: ignore[operator]
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_migrate_sqlite_to_postgres_runs_in_flight_finish_on_postgres(
    tmp_path: Path, pg_schema: str
) -> None:
    require_pg()
    source_url = f"sqlite:///{tmp_path / 'source.db'}"
    target_url = with_schema(PG_URL, pg_schema)
    src = migrate_app.build(source_url)
    async with src.worker(lease=5.0, poll_interval=0.05):
        quick = await src.start("quick", 21, run_id="quick")
        failing = await src.start("failing", 7, run_id="failing")
        approval = await src.start("approval", 5, run_id="approval")
        napper = await src.start("napper", 4, run_id="napper")
        assert await quick.result(timeout=10) == 42

        async def settled() -> bool:
            ap = await src.history("approval")
            nap = await src.history("napper")
            fail = await src.get("failing")
            return (
                fail.status is RunStatus.FAILED
                and any(e.type is EventType.ACTIVITY_COMPLETED for e in ap)
                and ap[-1].type is EventType.WORKFLOW_TASK_COMPLETED
                and any(e.type is EventType.TIMER_STARTED for e in nap)
            )

        await _until(settled, "runs waiting on a signal and a timer")
    source_histories = {r: await src.history(r) for r in ("quick", "failing", "approval", "napper")}
    source_letters = await src.dead_letters()
    assert len(source_letters) == 2  # the step and the run
    await src.close()

    done = _cli(
        "store", "migrate", "--from", source_url, "--to", target_url, "--app", "migrate_app:app"
    )
    assert done.returncode == 0, done.stderr
    assert "copied 4 runs (2 finished, 2 in flight)" in done.stdout
    assert "4 histories replay cleanly" in done.stdout

    dst = migrate_app.build(target_url)
    try:
        # finished runs keep their results, histories and dead letters
        assert await dst.get_run("quick").result(timeout=5) == 42
        assert (await dst.get("failing")).status is RunStatus.FAILED
        for rid, history in source_histories.items():
            assert await dst.history(rid) == history, rid
        letters = await dst.dead_letters()
        assert [(d.run_id, d.kind, d.step) for d in letters] == [
            (d.run_id, d.kind, d.step) for d in source_letters
        ]
        # runs in flight complete on a worker against PostgreSQL
        async with dst.worker(lease=5.0, poll_interval=0.05):
            await dst.signal("approval", "approve", "ada")
            assert await dst.get_run("approval").result(timeout=15) == "10 approved by ada"
            assert await dst.get_run("napper").result(timeout=15) == 9
        assert approval.run_id == "approval" and napper.run_id == "napper"
        assert failing.run_id == "failing"

        # a second migration into the same target refuses and copies nothing
        again = _cli("store", "migrate", "--from", source_url, "--to", target_url)
        assert again.returncode == 1
        assert "4 of the 4 runs already exist in the target" in again.stderr
        assert "nothing was copied" in again.stderr
        assert (await dst.get("approval")).status is RunStatus.COMPLETED
        assert len(await dst.list()) == 4
    finally:
        await dst.close()


async def test_migrate_reports_histories_that_do_not_replay(tmp_path: Path) -> None:
    require_pg()
    schema = f"t_{uuid.uuid4().hex}"
    source_url = f"sqlite:///{tmp_path / 'source.db'}"
    src = migrate_app.build(source_url)
    async with src.worker(lease=5.0, poll_interval=0.05):
        await src.start("approval", 5, run_id="approval")

        async def waiting() -> bool:
            h = await src.history("approval")
            return any(e.type is EventType.ACTIVITY_COMPLETED for e in h) and (
                h[-1].type is EventType.WORKFLOW_TASK_COMPLETED
            )

        await _until(waiting, "the run to wait for its signal")
    await src.close()
    try:
        out = _cli(
            "store",
            "migrate",
            "--from",
            source_url,
            "--to",
            with_schema(PG_URL, schema),
            "--app",
            "migrate_app:changed",
        )
        assert out.returncode == 1
        assert "does not match its source" in out.stderr
        assert "'approval' does not replay" in out.stderr
        missing = _cli("store", "migrate", "--from", str(tmp_path / "nope.db"), "--to", ":memory:")
        assert missing.returncode == 1 and "no tether store at" in missing.stderr
    finally:
        drop_schema(schema)


def test_migrate_any_to_any_sqlite_to_sqlite(tmp_path: Path) -> None:
    from tether.store.migrate import MigrationError, migrate

    async def go() -> None:
        src = migrate_app.build(f"sqlite:///{tmp_path / 'a.db'}")
        async with src.worker(lease=5.0, poll_interval=0.05):
            run = await src.start("quick", 2)
            assert await run.result(timeout=10) == 4
        await src.close()
        report = await migrate(f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}")
        assert (report.runs, report.in_flight) == (1, 0)
        dst = tether.App(store=f"sqlite:///{tmp_path / 'b.db'}")
        assert await dst.get_run(run.run_id).result(timeout=5) == 4
        await dst.close()

        # a target holding some of the source's runs (an interrupted migrate) is named so
        src = migrate_app.build(f"sqlite:///{tmp_path / 'a.db'}")
        async with src.worker(lease=5.0, poll_interval=0.05):
            assert await (await src.start("quick", 3)).result(timeout=10) == 6
        await src.close()
        with pytest.raises(MigrationError) as err:
            await migrate(f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}")
        assert "1 of the 2 runs already exist in the target" in str(err.value)
        assert "interrupted" in str(err.value) and "nothing was copied" in str(err.value)

    asyncio.run(go())


def _store_tables(app: tether.App, column: str | None = None) -> set[str]:
    """Every table of a store (its own schema's, on PostgreSQL); with ``column``: those
    that have that column."""
    store: Any = app.store
    if hasattr(store, "path"):
        con = sqlite3.connect(store.path)
        rows = con.execute(
            "SELECT name FROM sqlite_master m WHERE type = 'table' AND name <> 'sqlite_sequence'"
            " AND (? IS NULL OR EXISTS (SELECT 1 FROM pragma_table_info(m.name) WHERE name = ?))",
            (column, column),
        ).fetchall()
        con.close()
    else:
        url, _, query = app.store_url.partition("?schema=")  # type: ignore[attr-defined]
        with psycopg.connect(url) as con:
            rows = con.execute(
                "SELECT DISTINCT table_name FROM information_schema.columns "
                "WHERE table_schema = %s AND (%s::text IS NULL OR column_name = %s)",
                (query, column, column),
            ).fetchall()
    return {r[0] for r in rows}


async def test_every_table_of_a_store_is_copied_or_derived(store_url: str) -> None:
    """A table added to the schema and forgotten by ``migrate`` fails here: each table is
    copied, or named in ``NOT_COPIED`` with the reason the target needs no copy."""
    from tether.store.migrate import NOT_COPIED, copied_tables

    app = tether.App(store=store_url)
    app.store_url = store_url  # type: ignore[attr-defined]
    await app.list()  # opened: the schema exists
    tables = _store_tables(app)
    await app.close()
    assert "runs" in tables and "approvals" in tables
    assert tables - copied_tables() - set(NOT_COPIED) == set()
    assert copied_tables() & set(NOT_COPIED) == set()


async def test_every_table_is_in_exactly_one_of_migrates_lists(store_url: str) -> None:
    """Each table of a store is named once, in one of ``migrate``'s lists; its run
    tables are the run's row and retention's ``RUN_TABLES``, and they are every table
    with a ``run_id`` but two that name runs gone or to come (``purged_runs``,
    ``debounces``). So a run's table cannot be forgotten by retention or migrate."""
    from tether.store.migrate import _LOG_TABLES, _RUN_TABLES, _SHARED_TABLES, NOT_COPIED
    from tether.store.ops.retention import RUN_TABLES

    app = tether.App(store=store_url)
    app.store_url = store_url  # type: ignore[attr-defined]
    await app.list()  # opened: the schema exists
    tables, with_run_id = _store_tables(app), _store_tables(app, "run_id")
    await app.close()
    named = [*_RUN_TABLES, *_SHARED_TABLES, *_LOG_TABLES, *NOT_COPIED]
    assert len(named) == len(set(named))  # none in two lists (nor twice in one)
    assert tables <= set(named)  # (NOT_COPIED names PostgreSQL's tether_meta too)
    assert ("runs", *RUN_TABLES) == _RUN_TABLES  # (derived: one list to keep)
    assert with_run_id - {"purged_runs", "debounces"} == set(_RUN_TABLES)


def _fill(app: tether.App) -> None:
    @app.workflow
    async def review(x: int) -> str:
        d = await tether.approval({"amount": x}, deadline=timedelta(days=1))
        return f"approved={d.approved}"

    @app.workflow
    async def tick() -> int:
        return 1


async def test_migrate_copies_every_table_that_holds_state(tmp_path: Path, store_url: str) -> None:
    """Reviews, schedules, API keys, switches, webhook deliveries, the audit log, purged
    run ids, model budgets and spend, retentions and pending debounces arrive in the
    target: a review opened in the source is decided there and its run finishes."""
    from tether.store.migrate import migrate

    source_url = f"sqlite:///{tmp_path / 'source.db'}"
    src = tether.App(store=source_url)
    _fill(src)
    async with src.worker(lease=5.0, poll_interval=0.05):
        done = await src.start("tick", run_id="gone")
        assert await done.result(timeout=10) == 1
        assert (await src.purge(0))["runs"] == 1
        hooked = await src.start("tick", run_id="hooked", webhook="http://127.0.0.1:9/hook")
        assert await hooked.result(timeout=10) == 1
        await src.start("review", 5, run_id="r1")
        await _until(lambda: _has_review(src), "the review to open")
        await src.schedule("hourly", "tick", every=3600)
        await src.start_debounced("tick", key="burst", window=3600)
    await src.disable("tenant", "nothing", reason="test", by="ann")
    await src.store.create_api_key("k1", "hash", "ci", None, "admin")
    await src.store.set_model_budget("tenant:acme", 1000, None)
    await src.store.add_model_spend(("tenant:acme",), "2026-01-01", 10, "0.5")
    await src.store.ai_cache_put("answer", "42", 3600)
    await src.configure_retention("acme", 3600)
    counts = {t: _rows_in(source_url, t) for t in _tables_of(source_url)}
    await src.close()

    report = await migrate(source_url, store_url)
    assert report.shared["approvals"] == 1 and report.shared["schedules"] == 1
    dst = tether.App(store=store_url)
    _fill(dst)
    try:
        for table, n in counts.items():
            if table not in ("run_count_deltas", "run_counts", "run_ends"):
                assert await _rows_in_store(dst, table) == n, table
        with pytest.raises(tether.RunPurgedError):
            await dst.get("gone")
        assert [s.schedule_id for s in await dst.schedules()] == ["hourly"]
        assert [s["name"] for s in await dst.switches()] == ["nothing"]
        assert (await dst.store.api_key("k1")) is not None
        assert await dst.retentions() == {"acme": 3600.0}
        async with dst.worker(lease=5.0, poll_interval=0.05):
            (review,) = await dst.approvals()
            await dst.decide(
                review.approval_id, approve=True, by="ann", fingerprint=review.fingerprint
            )
            assert await dst.get_run("r1").result(timeout=15) == "approved=True"
    finally:
        await dst.close()


async def _has_review(app: tether.App) -> bool:
    return bool(await app.approvals())


def _tables_of(sqlite_url: str) -> list[str]:
    con = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    rows = con.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name <> 'sqlite_sequence'"
    ).fetchall()
    con.close()
    return [r[0] for r in rows]


def _rows_in(sqlite_url: str, table: str) -> int:
    con = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    (n,) = con.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
    con.close()
    return int(n)


async def _rows_in_store(app: tether.App, table: str) -> int:
    def count(tx: Any) -> int:
        return int(tx.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])

    return int(await app.store._do(count, write=False))  # type: ignore[attr-defined]


def _blobby(store: str, blobs: str | None = None) -> tether.App:
    app = tether.App(store=store, blobs=blobs, offload_above=1024)

    @app.activity
    async def grow(s: str) -> str:
        return s + "!" * 3000  # offloaded: over 1024 bytes

    @app.activity
    def fetch() -> tether.Blob:
        return tether.put_blob(b"report " * 1000)

    @app.activity
    def size(b: tether.Blob) -> int:
        return len(tether.read_blob(b))

    @app.workflow
    async def flow(s: str) -> str:
        a = await grow(s)
        b = await fetch()
        await tether.wait_event("go")
        return f"{len(a)} {await size(b)}"

    return app


async def test_migrate_copies_the_blobs_runs_refer_to(tmp_path: Path, store_url: str) -> None:
    """Offloaded payloads and ``put_blob`` blobs go to the target's blob store, and the
    verification reads them: a run in flight finishes on the target."""
    from tether.store.migrate import MigrationError, migrate

    source_url = f"sqlite:///{tmp_path / 'source.db'}"
    src = _blobby(source_url)
    async with src.worker(lease=5.0, poll_interval=0.05):
        await src.start("flow", "x" * 2000, run_id="inflight")

        async def waiting() -> bool:
            h = await src.history("inflight")
            done = [e for e in h if e.type is EventType.ACTIVITY_COMPLETED]
            return len(done) == 2 and h[-1].type is EventType.WORKFLOW_TASK_COMPLETED

        await _until(waiting, "the run to wait for its signal")
    await src.close()
    target_blobs = str(tmp_path / "target-blobs")
    kept = tmp_path / "source.db.blobs"
    kept.rename(tmp_path / "away")  # its blobs lost: refused before anything is written
    with pytest.raises(MigrationError, match="missing from its blob store"):
        await migrate(source_url, store_url, target_blobs=target_blobs)
    (tmp_path / "away").rename(kept)
    empty = tether.App(store=store_url)
    assert await empty.list() == []
    await empty.close()
    report = await migrate(
        source_url, store_url, app=_blobby(":memory:"), target_blobs=target_blobs
    )
    stored = {r for r, _ in BlobStore(f"{tmp_path / 'source.db'}.blobs").refs()}
    assert report.blobs == len(stored) > 2 and report.replayed == 1  # offloaded + put_blob
    assert {r for r, _ in BlobStore(target_blobs).refs()} == stored
    dst = _blobby(store_url, target_blobs)
    try:
        async with dst.worker(lease=5.0, poll_interval=0.05):
            await dst.signal("inflight", "go", 1)
            assert await dst.get_run("inflight").result(timeout=15) == "5000 7000"
    finally:
        await dst.close()


# -- the source is read as it is: never upgraded, checkpointed or otherwise written -----


async def _source_with_a_run_in_flight(db: Path) -> dict[str, list[tether.Event]]:
    """A store file (closed) with a finished run and one waiting for a signal; their
    histories."""
    src = migrate_app.build(f"sqlite:///{db}")
    async with src.worker(lease=5.0, poll_interval=0.05):
        quick = await src.start("quick", 21, run_id="quick")
        await src.start("approval", 5, run_id="approval")
        assert await quick.result(timeout=10) == 42

        async def waiting() -> bool:
            h = await src.history("approval")
            return any(e.type is EventType.ACTIVITY_COMPLETED for e in h) and (
                h[-1].type is EventType.WORKFLOW_TASK_COMPLETED
            )

        await _until(waiting, "the run to wait for its signal")
    histories = {r: await src.history(r) for r in ("quick", "approval")}
    await src.close()
    return histories


def _as_version_14(db: Path) -> None:
    """Make a closed store file as version 14 left it: its history WITHOUT ROWID, and
    no table of what a batch holds (added by 16)."""
    conn = sqlite3.connect(db)
    conn.executescript(
        "BEGIN; CREATE TABLE old_events (run_id TEXT NOT NULL, seq INTEGER NOT NULL, "
        "type TEXT NOT NULL, step INTEGER, data TEXT, created_at REAL NOT NULL, "
        "PRIMARY KEY (run_id, seq)) WITHOUT ROWID; INSERT INTO old_events SELECT run_id, "
        "seq, type, step, data, created_at FROM events; DROP TABLE events; "
        "ALTER TABLE old_events RENAME TO events; DROP TABLE ai_holds; "
        "PRAGMA user_version = 14; COMMIT;"
    )
    conn.close()
    assert not Path(f"{db}-wal").exists()  # closed cleanly


def _schema_of(db: Path) -> tuple[int, bool]:
    """(user_version, whether the history is a WITHOUT ROWID table), read-only."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        (sql,) = conn.execute("SELECT sql FROM sqlite_schema WHERE name = 'events'").fetchone()
    finally:
        conn.close()
    return int(version), "WITHOUT ROWID" in sql


async def _finishes_in(url: str, histories: dict[str, list[tether.Event]]) -> None:
    """The target holds every run with its history, and the one in flight finishes there."""
    dst = migrate_app.build(url)
    try:
        assert sorted(r.run_id for r in await dst.list()) == sorted(histories)
        for rid, history in histories.items():
            assert await dst.history(rid) == history, rid
        async with dst.worker(lease=5.0, poll_interval=0.05):
            await dst.signal("approval", "approve", "ada")
            assert await dst.get_run("approval").result(timeout=15) == "10 approved by ada"
    finally:
        await dst.close()


async def test_migrate_reads_a_version_14_source_as_it_is(tmp_path: Path, store_url: str) -> None:
    """A source at the previous schema version is copied without being upgraded in
    place (a rebuild of its whole history): its bytes are as they were afterwards."""
    db = tmp_path / "v14.db"
    histories = await _source_with_a_run_in_flight(db)
    _as_version_14(db)
    before = db.read_bytes()
    source = f"sqlite:///{db}"
    done = _cli("store", "migrate", "--from", source, "--to", store_url, "--app", "migrate_app:app")
    assert done.returncode == 0, done.stderr
    assert "copied 2 runs (1 finished, 1 in flight)" in done.stdout
    assert "2 histories replay cleanly" in done.stdout
    assert db.read_bytes() == before
    assert _schema_of(db) == (14, True)
    await _finishes_in(store_url, histories)


def _rows_of(db: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every copied table's rows, but for the ids and times a target gives them itself."""
    from tether.store.migrate import _FRESH_IDS, copied_tables

    conn = sqlite3.connect(db)
    out = {}
    for table in sorted(copied_tables()):
        cols = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
        keep = [c for c in cols if c not in (_FRESH_IDS.get(table), "available_at")]
        rows = conn.execute(f"SELECT {', '.join(keep)} FROM {table}").fetchall()
        out[table] = sorted(rows, key=repr)
    conn.close()
    return out


def test_a_version_14_source_is_copied_as_its_upgrade_would_be(tmp_path: Path) -> None:
    from tether.store import sqlite
    from tether.store.migrate import migrate

    # a new schema version must decide whether the one before it reads as it is
    assert (sqlite._READ_ONLY_FROM, sqlite._SCHEMA_VERSION) == (14, 16)
    db, upgraded = tmp_path / "v14.db", tmp_path / "upgraded.db"
    asyncio.run(_source_with_a_run_in_flight(db))
    _as_version_14(db)
    shutil.copyfile(db, upgraded)
    sqlite.SqliteStore(str(upgraded)).close_sync()  # upgraded in place
    assert _schema_of(upgraded) == (16, False)
    before = db.read_bytes()
    asyncio.run(migrate(f"sqlite:///{db}", f"sqlite:///{tmp_path / 'a.db'}"))
    asyncio.run(migrate(f"sqlite:///{upgraded}", f"sqlite:///{tmp_path / 'b.db'}"))
    assert db.read_bytes() == before and _schema_of(db) == (14, True)
    copied = _rows_of(tmp_path / "a.db")
    assert copied == _rows_of(tmp_path / "b.db")
    assert len(copied["runs"]) == 2 and len(copied["events"]) > 6

    # opened read-only, a store refuses whatever writes
    async def write() -> None:
        store = sqlite.SqliteStore(str(db), read_only=True)
        try:
            with pytest.raises(tether.StoreError, match="opened read-only"):
                await store.create_api_key("k1", "hash", "ci", None, "admin")
            assert {r.run_id for r in await store.list_runs()} == {"quick", "approval"}
        finally:
            await store.close()

    asyncio.run(write())
    assert db.read_bytes() == before


@pytest.mark.parametrize("version", [13, 17])
def test_migrate_refuses_a_source_it_cannot_read_as_it_is(tmp_path: Path, version: int) -> None:
    """Older than 14 (whose upgrade adds rows) or newer than this tether: refused, and
    the file left as it was."""
    db = tmp_path / "old.db"
    asyncio.run(_source_with_a_run_in_flight(db))
    conn = sqlite3.connect(db)
    if version == 13:
        conn.execute("DROP TABLE chains")  # added (and filled from the runs) by version 14
    conn.execute(f"PRAGMA user_version = {version}")
    conn.close()
    before = db.read_bytes()
    done = _cli("store", "migrate", "--from", str(db), "--to", str(tmp_path / "new.db"))
    assert done.returncode == 1
    assert f"schema version {version}" in done.stderr
    if version == 13:
        assert "open" in done.stderr and "once with this tether" in done.stderr
        assert "migrate it with the tether that wrote it" in done.stderr
    else:
        assert "newer than this tether" in done.stderr
    assert db.read_bytes() == before


async def test_migrate_leaves_a_source_not_closed_cleanly_as_it_was(tmp_path: Path) -> None:
    """A store at the current version whose last commits are still in its -wal file (its
    process killed): read through the -wal, which is not folded into the file."""
    live, db = tmp_path / "live.db", tmp_path / "crashed.db"
    src = migrate_app.build(f"sqlite:///{live}")
    async with src.worker(lease=5.0, poll_interval=0.05):
        assert await (await src.start("quick", 21, run_id="quick")).result(timeout=10) == 42
    # a copy taken while its process is open (and idle): as a kill -9 leaves it
    shutil.copyfile(live, db)
    shutil.copyfile(f"{live}-wal", f"{db}-wal")
    await src.close()
    before = {p: Path(p).read_bytes() for p in (db, f"{db}-wal")}
    assert len(before[f"{db}-wal"]) > 0
    done = _cli("store", "migrate", "--from", str(db), "--to", str(tmp_path / "new.db"))
    assert done.returncode == 0, done.stderr
    assert "copied 1 runs" in done.stdout
    assert {p: Path(p).read_bytes() for p in before} == before


def _unprivileged(folder: Path) -> list[str]:
    """A command prefix under which file modes bind (root drops its override of them);
    skips the test where none does. ``folder`` is read-only: the probe writes there."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root, and no setpriv to give up overriding file modes")
        prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]
    probe = subprocess.run(
        [*prefix, sys.executable, "-c", f"open({str(folder / 'probe')!r}, 'w')"],
        capture_output=True,
        check=False,
    )
    if probe.returncode == 0:
        os.unlink(folder / "probe")
        pytest.skip("a read-only folder here still takes new files")
    return prefix


@pytest.mark.parametrize("left", ["closed", "wal+shm", "wal", "empty wal", "shm"])
async def test_migrate_reads_a_source_on_read_only_media(tmp_path: Path, left: str) -> None:
    """A store file (mode 0444) in a folder that takes no new files: read as it is when
    closed cleanly or with its -wal and -shm files; refused, saying what to do, when
    its -wal file holds commits and SQLite cannot create the -shm file it needs, or a
    -shm file or an empty -wal file says a process may have it open (read unlocked,
    as an immutable file, a writer's pages could tear the copy)."""
    media = tmp_path / "media"
    media.mkdir()
    db = media / "v14.db"
    live = tmp_path / "live.db"
    histories = await _source_with_a_run_in_flight(live)
    if left in ("closed", "empty wal", "shm"):
        _as_version_14(live)
        shutil.copyfile(live, db)
        if left != "closed":  # as a process with the file open leaves it (maybe writing)
            Path(f"{db}-{left.split()[-1]}").write_bytes(b"")
    else:  # copied as a process killed with a commit in the -wal file leaves it
        conn = sqlite3.connect(live)
        conn.execute(
            "INSERT INTO breakers (name, state, window_start, calls, failures) "
            "VALUES ('b', 'closed', 0, 0, 0)"
        )
        conn.commit()
        shutil.copyfile(live, db)
        shutil.copyfile(f"{live}-wal", f"{db}-wal")
        if left == "wal+shm":
            shutil.copyfile(f"{live}-shm", f"{db}-shm")
        conn.close()
        assert Path(f"{db}-wal").stat().st_size > 0
    files = sorted(media.iterdir())
    before = {p: p.read_bytes() for p in files}
    for p in files:
        p.chmod(0o444)
    media.chmod(0o555)
    try:
        prefix = _unprivileged(media)
        target = tmp_path / "new.db"
        done = _cli("store", "migrate", "--from", str(db), "--to", str(target), prefix=prefix)
    finally:
        media.chmod(0o755)
    assert sorted(media.iterdir()) == files
    assert {p: p.read_bytes() for p in files} == before
    if left == "wal":
        assert done.returncode == 1
        assert "holds commits not yet in the file" in done.stderr, done.stderr
        assert "Copy the file with its -wal file to a writable directory" in done.stderr
        assert not target.exists()
        return
    if left in ("empty wal", "shm"):  # never read unlocked while a writer may be at it
        assert done.returncode == 1
        assert "a process may have it open" in done.stderr, done.stderr
        assert not target.exists()
        return
    assert done.returncode == 0, done.stderr
    assert "copied 2 runs (1 finished, 1 in flight)" in done.stdout
    await _finishes_in(f"sqlite:///{target}", histories)
