"""``tether store migrate``: SQLite to PostgreSQL with runs in flight, verified."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import uuid
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


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)])}
    return subprocess.run(
        [sys.executable, "-m", "tether.cli", *args],
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


def _store_tables(app: tether.App) -> set[str]:
    """Every table of a store (its own schema's, on PostgreSQL)."""
    store: Any = app.store
    if hasattr(store, "path"):
        con = sqlite3.connect(store.path)
        rows = con.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name <> 'sqlite_sequence'"
        ).fetchall()
        con.close()
    else:
        url, _, query = app.store_url.partition("?schema=")  # type: ignore[attr-defined]
        with psycopg.connect(url) as con:
            rows = con.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (query,),
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
