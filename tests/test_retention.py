"""Retention, tenant erasure, and backups: purged runs leave no row behind (checked over
every table that names a run) and answer as purged; other tenants are untouched; a
backup taken mid-flight, restored, resumes every run without running a recorded step
again."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import tether
from tether import EventType

HERE = Path(__file__).parent


def _define(app: tether.App) -> tuple[tether.Workflow, tether.Workflow, tether.Workflow]:
    @app.activity
    async def step(x: int) -> int:
        return x + 1

    @app.activity(retry=tether.Retry(attempts=1))
    async def broken() -> None:
        raise tether.NonRetryable("no")

    @app.workflow
    async def quick(x: int) -> int:
        return await step(x)

    @app.workflow
    async def failing() -> None:
        await broken()

    @app.workflow
    async def waiting() -> None:
        await tether.wait_event("never")

    return quick, failing, waiting


async def test_purge_removes_ended_runs_and_everything_of_theirs(app: tether.App) -> None:
    quick, failing, waiting = _define(app)
    async with app.worker(poll_interval=0.05):
        old = [await app.start(quick, i) for i in range(5)]
        for r in old:
            await r.result(timeout=20)
        bad = await app.start(failing)
        with pytest.raises(tether.WorkflowFailedError):
            await bad.result(timeout=20)
        live = await app.start(waiting)
        await app.store.audit("test", "cancel", f"run:{old[0].run_id}")
        real = app.store.clock
        app.store.clock = lambda: real() + 3600  # an hour later
        new = await app.start(quick, 100)
        assert await new.result(timeout=20) == 101
        assert len(await app.dead_letters()) == 2  # the step's and the run's
        preview = await app.purge(1800, dry_run=True)
        assert preview["runs"] == 6 and len(await app.list(limit=100)) == 8  # nothing removed
        counts = await app.purge(1800, batch=2)  # in batches of two runs
    assert counts["runs"] == 6 and counts["dead_letters"] == 2 and counts["audit_log"] == 1
    assert counts["events"] > 0
    left = {r.run_id for r in await app.list(limit=100)}
    assert left == {live.run_id, new.run_id}  # live runs and newer ones stay
    with pytest.raises(tether.RunPurgedError, match=r"purged at .* \(retention\)"):
        await app.get(old[0].run_id)
    with pytest.raises(tether.RunNotFoundError):  # a purged run is also "not found"
        await app.history(bad.run_id)
    assert await app.dead_letters() == []
    assert await app.audit_log(target=f"run:{old[0].run_id}") == []
    assert set((await app.store.orphans()).values()) == {0}
    assert len(await app.history(new.run_id)) > 0  # untouched


async def test_purge_by_workflow_and_tenant(app: tether.App) -> None:
    quick, failing, _ = _define(app)
    async with app.worker(poll_interval=0.05):
        a = await app.start(quick, 1, tenant="acme")
        b = await app.start(quick, 2, tenant="globex")
        c = await app.start(failing, tenant="acme")
        for r in (a, b):
            await r.result(timeout=20)
        with pytest.raises(tether.WorkflowFailedError):
            await c.result(timeout=20)
    assert (await app.purge(0, workflow="quick", tenant="acme"))["runs"] == 1
    assert {r.run_id for r in await app.list()} == {b.run_id, c.run_id}
    with pytest.raises(tether.ConfigurationError, match="older_than"):
        await app.purge(-1)


async def test_workers_apply_a_workflow_s_retention_in_the_background(app: tether.App) -> None:
    """``@app.workflow(retention=)``: workers purge its ended runs once older than that;
    its live runs and other workflows' runs stay. Two workers do it at once without
    getting in each other's way (PostgreSQL: a batch skips rows another one holds)."""

    @app.activity
    async def step(x: int) -> int:
        return x + 1

    @app.workflow(retention=3600)
    async def ephemeral(x: int) -> int:
        return await step(x)

    @app.workflow(retention=3600)
    async def lingering() -> None:
        await tether.wait_event("never")

    @app.workflow
    async def kept(x: int) -> int:
        return await step(x)

    with pytest.raises(tether.ConfigurationError, match="retention"):
        app.workflow(retention=0)
    async with app.worker(poll_interval=0.05):
        done = [await app.start(ephemeral, i) for i in range(30)]
        for r in done:
            await r.result(timeout=20)
        other = await app.start(kept, 1)
        await other.result(timeout=20)
        live = await app.start(lingering)
    real = app.store.clock
    app.store.clock = lambda: real() + 7200  # two hours later: past the retention
    first = app.worker(poll_interval=0.05, retention_every=0.1)
    second = app.worker(poll_interval=0.05, retention_every=0.1)
    await first.start()
    await second.start()
    try:
        deadline = time.monotonic() + 20
        while {r.run_id for r in await app.list(limit=100)} != {other.run_id, live.run_id}:
            assert time.monotonic() < deadline, "the retention was never applied"
            await asyncio.sleep(0.1)
    finally:
        await first.stop()
        await second.stop()
    with pytest.raises(tether.RunPurgedError, match="retention"):
        await app.get(done[0].run_id)
    assert set((await app.store.orphans()).values()) == {0}


async def test_erasing_a_tenant_leaves_nothing_of_it_and_spares_the_others(
    app: tether.App,
) -> None:
    quick, _, waiting = _define(app)
    from tether.server._auth import create_key

    app.configure_admission("acme", max_running=5)
    await create_key(app.store, role="operate", tenant="acme")
    await create_key(app.store, role="operate", tenant="globex")
    async with app.worker(poll_interval=0.05):
        done = await app.start(quick, 1, tenant="acme")
        await done.result(timeout=20)
        live = await app.start(waiting, tenant="acme")  # still running: terminated first
        other = await app.start(quick, 2, tenant="globex")
        await other.result(timeout=20)
        await app.disable("tenant", "acme", reason="erasing")
        counts = await app.erase_tenant("acme")
    assert counts["runs"] == 2 and counts["tenant_limits"] == 1 and counts["api_keys"] == 1
    assert counts["switches"] == 1
    assert [r.run_id for r in await app.list()] == [other.run_id]
    for rid in (done.run_id, live.run_id):
        with pytest.raises(tether.RunPurgedError, match="tenant erased"):
            await app.get(rid)
    assert set((await app.store.orphans()).values()) == {0}
    assert len(await app.store.list_api_keys()) == 1  # globex keeps its key


async def test_a_child_run_belongs_to_its_parents_tenant(app: tether.App) -> None:
    """A child run carries its parent's tenant (before: none), so a tenant sees its
    children, its erasure removes them (nothing of the tenant is left behind), and
    admission still counts top-level runs only (a child never waits for a slot its
    parent holds)."""

    @app.workflow
    async def leaf(x: int) -> int:
        return x + 1

    @app.workflow
    async def parent(x: int) -> int:
        return await leaf(x) + await leaf(x + 10)

    app.configure_admission("acme", max_running=1)
    async with app.worker(poll_interval=0.05):
        run = await app.start(parent, 1, tenant="acme", run_id="p")
        assert await run.result(timeout=20) == 14
    kids = [r for r in await app.list(tenant="acme") if r.parent_run_id == "p"]
    assert sorted(k.run_id for k in kids) == ["p/1", "p/2"]
    assert {k.tenant for k in kids} == {"acme"}
    counts = await app.erase_tenant("acme")
    assert counts["runs"] == 3
    assert await app.list() == []
    with pytest.raises(tether.RunPurgedError, match="tenant erased"):
        await app.get("p/1")
    assert set((await app.store.orphans()).values()) == {0}


def _spawn(db: Path, effects: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "crash_app.py"), str(db), str(effects)],
        env={**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _executed(effects: Path) -> int:
    if not effects.exists():
        return 0
    try:
        with sqlite3.connect(effects, timeout=30) as conn:
            return int(conn.execute("SELECT count(*) FROM effects").fetchone()[0])
    except sqlite3.OperationalError:  # the worker has not made the table yet
        return 0


def test_a_backup_taken_mid_flight_resumes_every_run_without_repeating_a_step(
    tmp_path: Path,
) -> None:
    db, backup, restored = tmp_path / "t.db", tmp_path / "backup.db", tmp_path / "restored.db"
    sys.path.insert(0, str(HERE))
    try:
        import crash_app  # the worker's App (ten 20 ms steps per run)
    finally:
        sys.path.remove(str(HERE))

    async def start_all() -> None:
        app = tether.App(store=f"sqlite:///{db}")
        app.workflow(crash_app.ten_steps.fn)
        try:
            for i in range(100):
                await app.start("ten_steps", f"r{i}", run_id=f"r{i}")
        finally:
            await app.close()

    asyncio.run(start_all())
    cli = [sys.executable, "-m", "tether.cli"]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    # `tether store backup`, its imports done before the runs start, run on a signal: so
    # a slow start of the process on a busy machine cannot let every run end first
    go = tmp_path / "go"
    waiting = (
        "import os, sys, time\n"
        "from tether.cli._main import _build\n"
        "cli = _build()  # the `tether` command, built\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.005)\n"
        "cli(args=sys.argv[1:], prog_name='tether')\n"
    )
    backup_cli = subprocess.Popen(
        [sys.executable, "-c", waiting, "store", "backup", str(backup), "--store", str(db)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker = _spawn(db, tmp_path / "effects1.db")
    try:
        deadline = time.monotonic() + 60
        while _executed(tmp_path / "effects1.db") < 200:  # mid-flight: a fifth of the steps
            assert time.monotonic() < deadline, "the worker never got going"
            time.sleep(0.02)
        go.touch()
        _, err = backup_cli.communicate(timeout=120)
        assert backup_cli.returncode == 0, err
    finally:
        backup_cli.kill()
        worker.kill()
        worker.wait(30)
    out = subprocess.run(
        [*cli, "store", "restore", str(backup), "--to", str(restored)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    check = subprocess.run(
        [*cli, "store", "check", "--store", str(restored)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr

    async def recorded(path: Path) -> tuple[dict[str, set[int]], int]:
        app = tether.App(store=f"sqlite:///{path}")
        try:
            done: dict[str, set[int]] = {}
            finished = 0
            for i in range(100):
                events = await app.history(f"r{i}")
                done[f"r{i}"] = {
                    e.step for e in events if e.type is EventType.ACTIVITY_COMPLETED and e.step
                }
                finished += any(e.type is EventType.WORKFLOW_COMPLETED for e in events)
            return done, finished
        finally:
            await app.close()

    at_backup, finished_then = asyncio.run(recorded(restored))
    assert sum(map(len, at_backup.values())) > 0 and finished_then < 100  # mid-flight
    effects2 = tmp_path / "effects2.db"
    worker = _spawn(restored, effects2)
    try:
        deadline = time.monotonic() + 120
        while True:
            _, finished = asyncio.run(recorded(restored))
            if finished == 100:
                break
            assert time.monotonic() < deadline, f"only {finished} of 100 runs completed"
            time.sleep(0.5)
    finally:
        worker.terminate()
        worker.wait(30)
    with sqlite3.connect(effects2) as conn:
        rerun = [
            (r, s)
            for r, s in conn.execute("SELECT run_id, step FROM effects").fetchall()
            if s in at_backup[r]
        ]
    assert rerun == []  # no step recorded in the backup ran again after the restore


async def test_workers_apply_a_tenant_s_retention_kept_in_the_store(app: tether.App) -> None:
    """``app.configure_retention(tenant, ...)``: kept in the store, so every worker purges
    that tenant's ended runs once older than it; other tenants' runs and its live runs
    stay; ``None`` turns it off again."""

    @app.workflow
    async def quick(x: int) -> int:
        return x

    @app.workflow
    async def waits() -> None:
        await tether.wait_event("never")

    with pytest.raises(tether.ConfigurationError, match="older_than"):
        await app.configure_retention("acme", 0)
    await app.configure_retention("acme", timedelta(hours=1))
    await app.configure_retention("beta", timedelta(days=30))
    await app.configure_retention("beta", None)  # off again
    assert await app.retentions() == {"acme": 3600.0}
    app.configure_admission("acme", max_running=50)  # its other limit stays apart
    async with app.worker(poll_interval=0.05):
        gone = [await app.start(quick, i, tenant="acme") for i in range(12)]
        kept = [await app.start(quick, i, tenant="beta") for i in range(3)]
        for r in gone + kept:
            await r.result(timeout=20)
        live = await app.start(waits, tenant="acme")
    real = app.store.clock
    app.store.clock = lambda: real() + 7200  # two hours later: past acme's retention
    async with app.worker(poll_interval=0.05, retention_every=0.1):
        deadline = time.monotonic() + 20
        want = {r.run_id for r in kept} | {live.run_id}
        while {r.run_id for r in await app.list(limit=100)} != want:
            assert time.monotonic() < deadline, "the tenant's retention was never applied"
            await asyncio.sleep(0.1)
    with pytest.raises(tether.RunPurgedError):
        await app.get(gone[0].run_id)
    assert set((await app.store.orphans()).values()) == {0}


def test_tether_retention_sets_and_lists_a_tenant_s_retention(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    tether.App(store=str(db)).store.close_sync()  # type: ignore[attr-defined]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tether.cli", "retention", *args, "--store", str(db)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert cli("set", "acme", "--older-than", "30d").returncode == 0
    assert json.loads(cli("list").stdout) == {"acme": 30 * 86400.0}
    both = cli("set", "acme", "--older-than", "1d", "--off")
    assert both.returncode == 2 and "--older-than AGE or --off" in both.stderr
    assert cli("set", "acme", "--off").returncode == 0
    assert json.loads(cli("list").stdout) == {}


async def test_purge_spares_a_live_chain_and_removes_an_ended_one_whole(app: tether.App) -> None:
    """A run that continued as new is purged with its chain, when the chain's last run
    ended long enough ago: an entity (a chain that never ends) keeps every run, so its
    first id still leads to its state, and the next operation builds on it."""

    @app.entity(ops_per_run=2)
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def add(self, k: int) -> int:
            self.n += k
            return self.n

    @app.workflow
    async def loop(n: int) -> int:
        if n < 2:
            tether.continue_as_new(n + 1)
        return n

    async with app.worker(poll_interval=0.05):
        c = app.entity_ref(Counter, "c1")
        for _ in range(3):
            await c.call("add", 1)
        ended = await app.start(loop, 0, run_id="loop-1")
        assert await ended.result(timeout=20) == 2
        counts = await app.purge(0)
        assert counts["runs"] == 3  # the ended chain: loop-1, loop-1~1, loop-1~2
        for rid in ("loop-1", "loop-1~1", "loop-1~2"):
            with pytest.raises(tether.RunPurgedError):
                await app.get(rid, follow=False)
        assert (await c.state())["n"] == 3
        assert await c.call("add", 1) == 4
    runs = [r for r in await app.list() if r.run_id.startswith("entity:")]
    live = [r for r in runs if r.status is not tether.RunStatus.CONTINUED_AS_NEW]
    assert len(live) == 1 and not live[0].status.is_terminal  # one live run, one chain
    assert live[0].run_id == f"entity:Counter:c1~{len(runs) - 1}"


async def test_a_purged_run_id_is_never_started_again(app: tether.App) -> None:
    """A run id names one run ever: once purged, starting it again (a client retrying
    its start, signal-with-start) raises ``RunPurgedError`` and runs nothing."""
    charged: list[str] = []

    @app.activity
    async def charge(order: str) -> str:
        charged.append(order)
        return f"charged {order}"

    @app.workflow
    async def pay(order: str) -> str:
        return await charge(order)

    async with app.worker(poll_interval=0.05):
        r = await app.start(pay, "o-1", run_id="pay:o-1")
        assert await r.result(timeout=20) == "charged o-1"
        assert (await app.purge(0))["runs"] == 1
        with pytest.raises(tether.RunPurgedError):
            await app.start(pay, "o-1", run_id="pay:o-1")
        with pytest.raises(tether.RunPurgedError):
            await app.start(pay, "o-1", run_id="pay:o-1", if_running="reject")
        with pytest.raises(tether.RunPurgedError):
            await app.start(pay, "o-1", run_id="pay:o-1", if_running="signal", signal=("go", 1))
        other = await app.start(pay, "o-2", run_id="pay:o-2")  # other ids start as before
        assert await other.result(timeout=20) == "charged o-2"
    assert charged == ["o-1", "o-2"]
    assert [r.run_id for r in await app.list()] == ["pay:o-2"]


async def test_an_ended_entity_s_key_stays_purged(app: tether.App) -> None:
    """An entity whose chain was ended by hand and then purged is not created afresh
    under its key: the key answers ``RunPurgedError``."""

    @app.entity(ops_per_run=2)
    class Tally:
        def __init__(self) -> None:
            self.n = 0

        def add(self, k: int) -> int:
            self.n += k
            return self.n

    async with app.worker(poll_interval=0.05):
        t = app.entity_ref(Tally, "t1")
        for _ in range(3):
            await t.call("add", 1)
        await app.terminate((await app.get("entity:Tally:t1")).run_id, "done with it")
        chain = await app.list()
        assert (await app.purge(0))["runs"] == len(chain) == 2
        with pytest.raises(tether.RunPurgedError):
            await t.call("add", 1)
    assert await app.list() == []


BLOB_FLOWS = """
import tether

app = tether.App(store={store!r}, offload_above=1024)


@app.activity
def make(n: int) -> str:
    return "D" * n  # offloaded: its result lives in the blob store


@app.activity
def put(text: str) -> tether.Blob:
    return tether.put_blob(text.encode())


@app.workflow
async def big(n: int) -> int:
    return len(await make(n))


@app.workflow
async def doc(text: str) -> str:
    blob = await put(text)
    await tether.wait_event("go")
    return blob.ref
"""


def test_a_backup_carries_the_blob_store_and_check_finds_a_missing_blob(tmp_path: Path) -> None:
    """`tether store backup` copied only the database: a restored store had lost every
    offloaded payload and put_blob document, and `tether store check` called it sound.
    The backup now takes the blob store with it (``<backup>.blobs``), restore puts it
    beside the new store, and check names every run whose blob is missing."""
    db, backup, restored = tmp_path / "t.db", tmp_path / "bk.db", tmp_path / "restored.db"
    (tmp_path / "blobflows.py").write_text(BLOB_FLOWS.format(store=f"sqlite:///{db}"))
    sys.path.insert(0, str(tmp_path))
    try:
        import blobflows
    finally:
        sys.path.remove(str(tmp_path))

    async def populate() -> None:
        app = blobflows.app
        async with app.worker(poll_interval=0.02):
            for i in range(3):
                assert (
                    await (await app.start("big", 5000 + i, run_id=f"b{i}")).result(30) == 5000 + i
                )
            for i in range(2):
                await app.start("doc", f"document {i}", run_id=f"d{i}")
            for i in range(2):
                while len(await app.history(f"d{i}")) < 4:
                    await asyncio.sleep(0.02)
        await app.close()

    asyncio.run(populate())
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{tmp_path}"}
    env.pop("TETHER_BLOBS", None)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tether.cli", *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )

    done = cli("store", "backup", str(backup), "--store", str(db))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "bk.db.blobs").is_dir() and "blob" in done.stderr
    done = cli("store", "restore", str(backup), "--to", str(restored))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "restored.db.blobs").is_dir()
    check = cli("store", "check", "--store", str(restored))
    assert check.returncode == 0, check.stdout + check.stderr

    async def read_back() -> None:
        app = tether.App(store=f"sqlite:///{restored}")
        for i in range(3):
            assert await app.get_run(f"b{i}").result(timeout=5) == 5000 + i
        for i in range(2):
            await app.history(f"d{i}")
        await app.close()

    asyncio.run(read_back())

    # a blob lost from the restored store: check names the runs that refer to it
    lost = []
    for path in (tmp_path / "restored.db.blobs").rglob("*"):
        if path.is_file():
            lost.append(path.name)
            path.unlink()
    check = cli("store", "check", "--store", str(restored))
    assert check.returncode == 1, check.stdout + check.stderr
    problems = json.loads(check.stdout)["problems"]
    for rid in ("b0", "b1", "b2", "d0", "d1"):
        assert any(rid in p and "missing" in p for p in problems), (rid, problems)
    # with --app: every live run that cannot be read is listed, not just the first
    (tmp_path / "restoredflows.py").write_text(BLOB_FLOWS.format(store=f"sqlite:///{restored}"))
    check = cli("store", "check", "--app", "restoredflows:app")
    assert check.returncode == 1, check.stdout + check.stderr
    assert "Traceback" not in check.stderr, check.stderr
    report = json.loads(check.stdout)
    assert sum(p.startswith(("d0:", "d1:")) for p in report["problems"]) == 2, report


# runs the `tether` command, dying (os._exit(9), as a kill does) right after the Nth blob
# it writes (BlobStore.keep: the copy of one blob by backup or restore)
DIES_AFTER_BLOBS = """
import os, sys
from tether.blobs import BlobStore
after, kept, keep = int(os.environ["DIE_AFTER_BLOBS"]), [0], BlobStore.keep
def dying_keep(self, ref, data, *rest):
    keep(self, ref, data, *rest)
    kept[0] += 1
    if kept[0] >= after:
        os._exit(9)
BlobStore.keep = dying_keep
from tether.cli import main
main(sys.argv[1:])
"""


def test_a_backup_or_restore_killed_while_copying_blobs_is_never_taken_for_a_whole_one(
    tmp_path: Path,
) -> None:
    """A backup killed after copying some of the blobs left BACKUP and a partial
    BACKUP.blobs: restore took it with exit 0 ("restored ... 2 blob(s)") and only
    `store check` found the runs missing their blobs. A restore killed part-way left its
    target behind, and restoring again was refused ("exists"). Both are now whole or
    absent: a killed backup is no backup (restore refuses it, and a new backup to that
    path is made), and a killed restore leaves no target, so running it again works."""
    db, backup, restored = tmp_path / "t.db", tmp_path / "bk.db", tmp_path / "restored.db"
    (tmp_path / "blobflows.py").write_text(BLOB_FLOWS.format(store=f"sqlite:///{db}"))
    sys.path.insert(0, str(tmp_path))
    sys.modules.pop("blobflows", None)  # another test's, of another store
    try:
        import blobflows
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("blobflows", None)

    async def populate() -> None:
        app = blobflows.app
        async with app.worker(poll_interval=0.02):
            for i in range(6):
                assert await (await app.start("big", 3000 + i)).result(30) == 3000 + i
        await app.close()

    asyncio.run(populate())
    assert sum(1 for p in (tmp_path / "t.db.blobs").rglob("*") if p.is_file()) == 6
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{tmp_path}"}
    env.pop("TETHER_BLOBS", None)

    def cli(*args: str, die_after: int | None = None) -> subprocess.CompletedProcess[str]:
        run = dict(env)
        if die_after is not None:
            run["DIE_AFTER_BLOBS"] = str(die_after)
        cmd = ["-c", DIES_AFTER_BLOBS] if die_after is not None else ["-m", "tether.cli"]
        return subprocess.run(
            [sys.executable, *cmd, *args],
            env=run,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )

    killed = cli("store", "backup", str(backup), "--store", str(db), die_after=2)
    assert killed.returncode == 9, killed.stderr
    done = cli("store", "restore", str(backup), "--to", str(restored))
    assert done.returncode != 0, done.stderr  # never "restored" with blobs missing
    assert "restored" not in done.stderr.replace("nothing was restored", ""), done.stderr
    assert not restored.exists()
    # the next backup to that path is not blocked by what the killed one left
    done = cli("store", "backup", str(backup), "--store", str(db))
    assert done.returncode == 0, done.stderr
    assert "6 blob(s)" in done.stderr, done.stderr

    killed = cli("store", "restore", str(backup), "--to", str(restored), die_after=2)
    assert killed.returncode == 9, killed.stderr
    assert not restored.exists()  # no store that looks whole and lacks blobs
    done = cli("store", "restore", str(backup), "--to", str(restored))
    assert done.returncode == 0, done.stderr
    check = cli("store", "check", "--store", str(restored))
    assert check.returncode == 0, check.stdout + check.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if "partial" in p.name) == []


async def test_every_call_on_a_purged_run_says_it_was_purged(
    app: tether.App, store_url: str
) -> None:
    """result(), signal() and cancel() on a purged run raise ``RunPurgedError`` as get()
    and history() do, and a result() waiting while its run is erased does too."""
    quick, _failing, waiting = _define(app)
    async with app.worker(poll_interval=0.05):
        done = await app.start(quick, 1, run_id="old")
        assert await done.result(timeout=20) == 2
        real = app.store.clock
        app.store.clock = lambda: real() + 3600
        assert (await app.purge(1800))["runs"] == 1
        app.store.clock = real
        with pytest.raises(tether.RunPurgedError, match="retention"):
            await app.get_run("old").result(timeout=1)
        with pytest.raises(tether.RunPurgedError, match="retention"):
            await app.signal("old", "go", 1)
        with pytest.raises(tether.RunPurgedError, match="retention"):
            await app.get_run("old").cancel()
        with pytest.raises(tether.RunPurgedError, match="retention"):
            await app.cancel("old")
        if not store_url.startswith("sqlite"):
            return  # PostgreSQL's notifications wake the waiter on the termination itself
        await app.start(waiting, run_id="live", tenant="gone")
        waiter = asyncio.create_task(app.get_run("live").result(timeout=20))
        await asyncio.sleep(0.3)
        # erased by another process (its commits do not wake this one's waiters)
        other = tether.App(store=store_url)
        await other.erase_tenant("gone")
        other.store.close_sync()  # type: ignore[attr-defined]
        with pytest.raises(tether.RunPurgedError, match="tenant erased"):
            await waiter


KILL_PURGE = """
import os
import sys

import tether.store.ops as ops

orig = ops.OpsStore.purge
calls = [0]


async def purge(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] > int(os.environ["PURGE_BATCHES"]):  # between two batches
        sys.stderr.write("killed\\n")
        os._exit(9)
    return await orig(self, *args, **kwargs)


ops.OpsStore.purge = purge
from tether.cli import main

main()
"""


def _blob_flows(tmp_path: Path, db: Path) -> Any:
    """``BLOB_FLOWS`` on the SQLite store ``db``, imported as a module of its own."""
    (tmp_path / "blobflows.py").write_text(BLOB_FLOWS.format(store=f"sqlite:///{db}"))
    sys.modules.pop("blobflows", None)  # another test's, on its own store
    sys.path.insert(0, str(tmp_path))
    try:
        import blobflows
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("blobflows", None)
    return blobflows


def test_a_purge_killed_between_batches_leaves_no_blob_of_a_purged_run(tmp_path: Path) -> None:
    """The blobs of purged runs were gathered over every batch and deleted only at the
    end: a purge killed part way lost the list, the next one reported success, and the
    purged runs' blobs stayed for good (`store check` called the store sound). They now
    go after a batch's commit (the first batch's at once); a live run's blob stays."""
    db = tmp_path / "t.db"
    blobflows = _blob_flows(tmp_path, db)

    async def populate() -> tuple[set[str], set[str]]:
        app = blobflows.app
        async with app.worker(poll_interval=0.02):
            for i in range(6):
                run = await app.start("big", 5000 + i, run_id=f"b{i}")
                assert await run.result(30) == 5000 + i
            await app.start("doc", "a live document", run_id="live")
            while len(await app.history("live")) < 4:
                await asyncio.sleep(0.02)
        ended = await app.store.blob_refs(run_ids=[f"b{i}" for i in range(6)])
        live = await app.store.blob_refs(run_ids=["live"])
        await app.close()
        return ended, live

    ended, live = asyncio.run(populate())
    assert len(ended) == 6 and len(live) == 1 and not ended & live
    blob_dir = tmp_path / "t.db.blobs"
    old = time.time() - 3 * 3600  # put before the purge's grace of an hour
    for path in blob_dir.rglob("*"):
        if path.is_file():
            os.utime(path, (old, old))
    (tmp_path / "killpurge.py").write_text(KILL_PURGE)
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{tmp_path}"}
    env.pop("TETHER_BLOBS", None)
    purge = ("purge", "--older-than", "0s", "--batch", "2", "--store", str(db))

    killed = subprocess.run(
        [sys.executable, str(tmp_path / "killpurge.py"), *purge],
        env={**env, "PURGE_BATCHES": "1"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == 9, killed.stdout + killed.stderr
    done = subprocess.run(
        [sys.executable, "-m", "tether.cli", *purge],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["runs"] == 4, done.stdout
    stored = {f"sha256:{p.parent.name}{p.name}" for p in blob_dir.rglob("*") if p.is_file()}
    assert not stored & ended, (stored, ended)  # no blob of a purged run is left
    assert live <= stored  # the live run's is kept


async def test_an_erasure_counts_only_the_runs_it_removed(pg_schema: str) -> None:
    """On PostgreSQL an erasure found its runs without a lock and counted them all,
    though a purge running at once removed some first (3,057 reported, 3,010 removed).
    It counts what its DELETE removed, and still removes the tenant's own rows."""
    import psycopg

    from conftest import PG_URL, with_schema

    app = tether.App(store=with_schema(PG_URL, pg_schema))
    quick, _, _ = _define(app)
    app.configure_admission("acme", max_running=5)
    async with app.worker(poll_interval=0.05):
        for i in range(3):
            await (await app.start(quick, i, tenant="acme")).result(timeout=20)
    with psycopg.connect(PG_URL) as other:  # another process's purge, not committed yet
        other.execute(f'SET search_path TO "{pg_schema}"')
        other.execute("DELETE FROM runs WHERE tenant = 'acme'")
        erasing = asyncio.create_task(app.erase_tenant("acme"))
        await asyncio.sleep(1.0)  # it found them, and waits on their rows
        assert not erasing.done()
        other.commit()
    counts = await erasing
    assert counts["runs"] == 0, counts  # the other removed them all
    assert counts["tenant_limits"] == 1, counts
    assert await app.list(tenant="acme") == []
    await app.close()


def test_a_long_purge_does_not_read_the_whole_store_after_every_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Telling which blobs are unused reads every stored payload: after each batch, a
    purge of many batches read a large store as many times. It checks again only once
    twice as long as the last check took has passed, and at the end."""
    db = tmp_path / "t.db"
    app = _blob_flows(tmp_path, db).app

    async def scenario() -> None:
        async with app.worker(poll_interval=0.02):
            for i in range(6):
                run = await app.start("big", 5000 + i, run_id=f"b{i}")
                assert await run.result(30) == 5000 + i
        ended = await app.store.blob_refs(run_ids=[f"b{i}" for i in range(6)])
        assert len(ended) == 6
        old = time.time() - 3 * 3600  # put before the purge's grace of an hour
        for path in (tmp_path / "t.db.blobs").rglob("*"):
            if path.is_file():
                os.utime(path, (old, old))
        every = app.store.blob_refs
        scans: list[float] = []

        async def slow(*a: object, **k: object) -> set[str]:
            if not a and not k:  # the whole store: as slow as a large one
                scans.append(time.monotonic())
                await asyncio.sleep(0.5)
            return await every(*a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr(app.store, "blob_refs", slow)
        counts = await app.purge(0, batch=1)
        assert counts["runs"] == 6 and counts["blobs"] == 6, counts
        assert len(scans) == 2, scans  # after the first batch, and at the end
        monkeypatch.undo()
        assert not await app.store.blob_refs() & ended
        await app.close()

    asyncio.run(scenario())


KILL_AFTER_COMMIT = """
import os
import signal
import sys

import tether.store.ops as ops

orig = ops.OpsStore.purge


async def purge(self, *args, **kwargs):
    got = await orig(self, *args, **kwargs)
    if not kwargs.get("dry_run"):  # the first batch is committed: die before its blobs go
        sys.stderr.write("killed\\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return got


ops.OpsStore.purge = purge
from tether.cli import main

main()
"""


@pytest.mark.parametrize("then", ["purge", "gc-blobs"])
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_purge_killed_after_a_batch_commit_leaves_pending_deletions_the_next_run_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, then: str, request: Any
) -> None:
    """A purge SIGKILLed after a batch's commit, before its blobs were checked, left them
    for good: the next purge found no run and deleted nothing, and `store check` called
    the store sound. The batch's transaction now records its runs' blobs as pending
    deletions: `store check` names them, and the next purge (or gc-blobs) deletes those
    nothing refers to; a live run's blob stays."""
    db = tmp_path / "t.db"
    blob_dir = tmp_path / "t.db.blobs"
    if backend == "sqlite":
        url = f"sqlite:///{db}"
        monkeypatch.delenv("TETHER_BLOBS", raising=False)
    else:
        from conftest import PG_URL, with_schema

        schema = request.getfixturevalue("pg_schema")
        url = with_schema(PG_URL, schema)
        monkeypatch.setenv("TETHER_BLOBS", str(blob_dir))
    (tmp_path / "blobflows.py").write_text(BLOB_FLOWS.format(store=url))
    sys.modules.pop("blobflows", None)
    sys.path.insert(0, str(tmp_path))
    try:
        import blobflows
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("blobflows", None)

    async def populate() -> tuple[set[str], set[str]]:
        app = blobflows.app
        async with app.worker(poll_interval=0.02):
            for i in range(4):
                run = await app.start("big", 5000 + i, run_id=f"b{i}")
                assert await run.result(30) == 5000 + i
            await app.start("doc", "a live document", run_id="live")
            while len(await app.history("live")) < 4:
                await asyncio.sleep(0.02)
        ended = await app.store.blob_refs(run_ids=[f"b{i}" for i in range(4)])
        live = await app.store.blob_refs(run_ids=["live"])
        await app.close()
        return ended, live

    ended, live = asyncio.run(populate())
    assert len(ended) == 4 and len(live) == 1 and not ended & live
    old = time.time() - 3 * 3600  # put before the purge's grace of an hour
    for path in blob_dir.rglob("*"):
        if path.is_file():
            os.utime(path, (old, old))
    (tmp_path / "killpurge.py").write_text(KILL_AFTER_COMMIT)
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{tmp_path}"}

    def cli(*args: str, script: str | None = None) -> subprocess.CompletedProcess[str]:
        head = [sys.executable, script] if script else [sys.executable, "-m", "tether.cli"]
        return subprocess.run(
            [*head, *args, "--store", url],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def stored() -> set[str]:
        return {f"sha256:{p.parent.name}{p.name}" for p in blob_dir.rglob("*") if p.is_file()}

    killed = cli(
        "purge", "--older-than", "0s", "--batch", "2", script=str(tmp_path / "killpurge.py")
    )
    assert killed.returncode == -9, killed.stdout + killed.stderr
    left = stored() & ended
    assert len(left) == 4, left  # the first batch's two are pending, the rest not purged
    check = cli("store", "check")
    assert check.returncode == 0, check.stdout + check.stderr  # garbage, not damage
    report = json.loads(check.stdout)
    assert report["blobs"]["pending_deletions"] == 2, report
    assert "2 blob deletion(s) pending" in check.stderr, check.stderr

    if then == "purge":
        done = cli("purge", "--older-than", "0s", "--batch", "2")
        assert done.returncode == 0, done.stdout + done.stderr
        assert json.loads(done.stdout)["runs"] == 2, done.stdout
    else:
        done = cli("store", "gc-blobs", "--older-than", "2h")
        assert done.returncode == 0, done.stdout + done.stderr
        done = cli("purge", "--older-than", "0s", "--batch", "2")
        assert done.returncode == 0, done.stdout + done.stderr
    assert not stored() & ended, (stored(), ended)  # no blob of a purged run is left
    assert live <= stored()  # the live run's is kept
    check = cli("store", "check")
    assert check.returncode == 0, check.stdout + check.stderr
    report = json.loads(check.stdout)
    assert report["blobs"]["pending_deletions"] == 0, report
    assert report["blobs"]["unreferenced"] == 0, report


def test_store_check_names_damaged_and_unreferenced_blobs(tmp_path: Path) -> None:
    """`tether store check` looked only for blobs payloads refer to and the store lacks:
    a blob whose bytes no longer match their hash, and blobs nothing refers to, went
    unreported. It now reads each blob once: a damaged one is a problem (named, with
    what to do), unreferenced ones are reported for gc-blobs."""
    db = tmp_path / "t.db"
    blobflows = _blob_flows(tmp_path, db)

    async def populate() -> str:
        app = blobflows.app
        async with app.worker(poll_interval=0.02):
            run = await app.start("big", 5000, run_id="b0")
            assert await run.result(30) == 5000
        app.put_blob(b"nothing refers to me")
        (ref,) = await app.store.blob_refs(run_ids=["b0"])
        await app.close()
        return str(ref)

    ref = asyncio.run(populate())
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{tmp_path}"}
    env.pop("TETHER_BLOBS", None)

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tether.cli", "store", "check", "--store", str(db)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )

    sound = check()
    assert sound.returncode == 0, sound.stdout + sound.stderr
    state = json.loads(sound.stdout)["blobs"]
    assert state["stored"] == 2 and state["unreferenced"] == 1 and state["damaged"] == 0, state
    assert "1 blob(s) no payload refers to" in sound.stderr and "gc-blobs" in sound.stderr
    digest = ref.removeprefix("sha256:")
    path = tmp_path / "t.db.blobs" / "sha256" / digest[:2] / digest[2:]
    path.write_bytes(path.read_bytes()[:-1] + b"X")  # one byte changed on disk
    damaged = check()
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    report = json.loads(damaged.stdout)
    assert report["blobs"]["damaged"] == 1, report
    (problem,) = [p for p in report["problems"] if "damaged" in p]
    assert ref in problem and "do not match the hash" in problem and "backup" in problem


def test_store_check_names_damaged_sealed_blobs_and_counts_shredded_ones(tmp_path: Path) -> None:
    """A sealed ``put_blob`` document with a byte changed, or cut short, does not open with
    its key: `store check` counted it ``unverified`` (as if the key were missing) and
    called the store sound. It is now damaged (a problem, exit 1); a document whose
    tenant was erased (its key destroyed) is counted shredded, not a problem."""
    from tether.encryption import FileKeyring

    db = tmp_path / "t.db"
    keys = FileKeyring.create(str(tmp_path / "keys.json"), per_tenant=True)

    async def populate() -> list[str]:
        app = tether.App(store=f"sqlite:///{db}", encryption=keys)
        refs = [
            app.put_blob(b"flipped document " * 40).ref,
            app.put_blob(b"truncated document " * 40).ref,
            app.put_blob(b"a document of acme " * 40, tenant="acme").ref,
            app.put_blob(b"a whole document " * 40).ref,
        ]
        await app.close()
        return refs

    flipped, cut, acme, whole = asyncio.run(populate())
    env = {
        **os.environ,
        "PYTHONPATH": str(HERE.parent / "src"),
        "TETHER_KEYRING": str(tmp_path / "keys.json"),
    }
    env.pop("TETHER_BLOBS", None)
    env.pop("TETHER_ENCRYPTION_KEYS", None)

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tether.cli", "store", "check", "--store", str(db)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )

    sound = check()
    assert sound.returncode == 0, sound.stdout + sound.stderr
    state = json.loads(sound.stdout)["blobs"]
    assert state["stored"] == 4 and state["damaged"] == 0 and state["unverified"] == 0, state

    def path(ref: str) -> Path:
        digest = ref.removeprefix("sha256:")
        return tmp_path / "t.db.blobs" / "sha256" / digest[:2] / digest[2:]

    data = bytearray(path(flipped).read_bytes())
    data[len(data) // 2] ^= 1  # one bit changed inside the ciphertext
    path(flipped).chmod(0o644)
    path(flipped).write_bytes(bytes(data))
    path(cut).chmod(0o644)
    path(cut).write_bytes(path(cut).read_bytes()[:40])
    keys.shred("acme")
    damaged = check()
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    report = json.loads(damaged.stdout)
    blobs = report["blobs"]
    assert blobs["damaged"] == 2 and blobs["unverified"] == 0 and blobs["shredded"] == 1, blobs
    assert set(blobs["damaged_examples"]) == {flipped, cut}, blobs
    assert all("do not open with their key" in p for p in blobs["damaged_examples"].values())
    assert whole not in blobs["damaged_examples"] and acme not in blobs["damaged_examples"]
    assert "shredded" in damaged.stderr, damaged.stderr


@pytest.mark.parametrize("then", ["purge", "erase"])
async def test_a_pending_deletion_whose_blob_is_referred_to_again_keeps_it(
    store_url: str, tmp_path: Path, then: str
) -> None:
    """A blob recorded as a pending deletion by a purge stopped before carrying it out,
    that another run has come to refer to since (blobs are shared by content), is kept
    by the next purge (or tenant erasure), which forgets the record; an unused one goes."""
    app = tether.App(store=store_url, blobs=str(tmp_path / "blobs"), offload_above=1024)

    @app.activity
    def make(n: int) -> str:
        return "D" * n

    @app.workflow
    async def big(n: int) -> int:
        return len(await make(n))

    async with app.worker(poll_interval=0.02):
        for run_id, n in (("a", 5000), ("b", 6000)):
            assert await (await app.start(big, n, run_id=run_id)).result(timeout=30) == n
        shared = await app.store.blob_refs(run_ids=["a"])
        alone = await app.store.blob_refs(run_ids=["b"])
        old = time.time() - 3 * 3600
        for path in (tmp_path / "blobs").rglob("*"):
            if path.is_file():
                os.utime(path, (old, old))
        # a purge's batch committed, then its process died: both recorded, none deleted
        counts, _ = await app.store.purge(
            app.store.clock() + 1, limit=10, spare_from=time.time() - 3600
        )
        assert counts["runs"] == 2
        assert set(await app.store.blob_deletions()) == shared | alone
        # another run puts the same bytes as "a" and refers to them
        assert await (await app.start(big, 5000, run_id="c")).result(timeout=30) == 5000
    assert await app.store.blob_refs(run_ids=["c"]) == shared
    for path in (tmp_path / "blobs").rglob("*"):  # (even once it is old again)
        if path.is_file():
            os.utime(path, (old, old))
    if then == "purge":
        got = await app.purge(timedelta(days=1))
    else:
        got = await app.erase_tenant("nobody")
    assert got["runs"] == 0 and got["blobs"] == 1, got
    assert await app.store.blob_deletions() == {}
    assert app.store.blobs is not None
    (kept,) = shared
    (gone,) = alone
    assert app.store.blobs.modified(kept) is not None
    assert app.store.blobs.modified(gone) is None
    await app.close()


def _execute(store_url: str, *statements: str) -> None:
    """Run SQL on a test's store (a SQLite file, or a PostgreSQL schema) directly."""
    if store_url.startswith("sqlite:///"):
        with sqlite3.connect(store_url.removeprefix("sqlite:///")) as conn:
            for sql in statements:
                conn.execute(sql)
        return
    import psycopg

    url, _, schema = store_url.partition("?schema=")
    with psycopg.connect(url) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        for sql in statements:
            conn.execute(sql)


async def test_a_purge_batch_of_tens_of_thousands_of_runs_fits_the_databases_limits(
    store_url: str,
) -> None:
    """A purge batch removed its runs' chain rows in one statement binding a parameter
    per run and one per chain: 33,000 ended runs in a batch of 40,000 bound 66,000, more
    than PostgreSQL allows (65,535), and the purge failed (``--batch`` takes up to
    100,000). Every statement of a removal now names a bounded part of the runs."""
    app = tether.App(store=store_url)
    await app.list(limit=1)  # the store's tables
    n = 33_000
    run = (
        "INSERT INTO runs (run_id, workflow, status, queue, input, created_at, updated_at, "
        "completed_at, continued_to) "
    )
    _execute(
        store_url,
        f"WITH RECURSIVE g(k) AS (SELECT 1 UNION ALL SELECT k + 1 FROM g WHERE k < {n}) "
        f"{run} SELECT 'pp' || k, 'loop', 'completed', 'default', 'null', 1, 1, 1, NULL "
        "FROM g",
        f"{run} VALUES ('cc', 'loop', 'continued_as_new', 'default', 'null', 1, 1, 1, 'cc~1')",
        f"{run} VALUES ('cc~1', 'loop', 'completed', 'default', 'null', 1, 1, 1, NULL)",
        "INSERT INTO chains (chain_id, head_run_id) VALUES ('cc', 'cc~1')",
        "INSERT INTO events (run_id, seq, type, data, created_at) "
        "VALUES ('pp1', 1, 'WorkflowStarted', '{}', 1)",
    )
    counts = await app.purge(0, workflow="loop", batch=40_000)
    assert counts["runs"] == n + 2 and counts["events"] == 1, counts
    assert await app.list(limit=1) == []
    assert set((await app.store.orphans()).values()) == {0}
    with pytest.raises(tether.RunPurgedError):
        await app.get("cc")
    await app.close()


async def test_store_check_names_chain_rows_of_a_missing_or_continued_run(store_url: str) -> None:
    """``store.orphans()`` (``tether store check``) did not look at ``chains``: a chain's
    row naming a run the store does not have, or one that continued as new since (not
    the chain's head: lookups through it go to the wrong run), was not reported. Both
    are now counted, as the other orphans are, and the check names them as problems."""
    app = tether.App(store=store_url)
    await app.list(limit=1)  # the store's tables
    assert set((await app.store.orphans()).values()) == {0}
    run = (
        "INSERT INTO runs (run_id, workflow, status, queue, input, created_at, updated_at, "
        "completed_at, continued_to) "
    )
    _execute(
        store_url,
        "INSERT INTO chains (chain_id, head_run_id) VALUES ('gone', 'gone~2')",
        f"{run} VALUES ('on', 'loop', 'continued_as_new', 'default', 'null', 1, 1, 1, 'on~1')",
        f"{run} VALUES ('on~1', 'loop', 'continued_as_new', 'default', 'null', 1, 1, 1, 'on~2')",
        f"{run} VALUES ('on~2', 'loop', 'running', 'default', 'null', 1, 1, NULL, NULL)",
        "INSERT INTO chains (chain_id, head_run_id) VALUES ('on', 'on~1')",
    )
    orphans = await app.store.orphans()
    assert orphans["chains"] == 1 and orphans["stale chains"] == 1, orphans
    assert {k for k, n in orphans.items() if n} == {"chains", "stale chains"}, orphans
    await app.close()
    res = subprocess.run(
        [sys.executable, "-m", "tether.cli", "store", "check", "--store", store_url],
        env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["orphans"]["chains"] == 1 and report["orphans"]["stale chains"] == 1
    assert "1 chains row(s) name a missing run" in report["problems"], report
    stale = "1 stale chains row(s) name a run that continued as new (not its chain's head)"
    assert stale in report["problems"], report
