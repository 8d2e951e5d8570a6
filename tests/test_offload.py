"""Payloads above a size go to the blob store by themselves (tether._codec): the history
keeps a reference; a crash between the blob write and the commit leaves an orphan that
is collected, never a reference to a missing blob; erasing a tenant removes its blobs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import tether
from tether.encryption import FileKeyring

HERE = Path(__file__).parent
BIG = 50 * 2**20


async def _lengths(app: tether.App) -> dict[str, int]:
    from tether.store.ops.overview import _PAYLOAD_COLUMNS

    def read(tx: object) -> dict[str, int]:
        out: dict[str, int] = {}
        for table, columns in _PAYLOAD_COLUMNS:
            for column in columns:
                sql = f"SELECT max(length({column})) FROM {table}"
                row = tx.execute(sql).fetchone()  # type: ignore[attr-defined]
                out[f"{table}.{column}"] = int(row[0] or 0)
        return out

    got: dict[str, int] = await app.store._do(read, write=False)  # type: ignore[attr-defined]
    return got


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
async def test_a_50_mb_output_never_enters_the_events_table(
    store_url: str, tmp_path: Path, encrypted: bool
) -> None:
    keys = FileKeyring.create(tmp_path / "keys.json") if encrypted else None
    app = tether.App(store=store_url, blobs=str(tmp_path / "blobs"), encryption=keys)
    marker = "MARKER-50MB-" + os.urandom(4).hex()

    @app.activity
    def render(n: int) -> str:
        return marker + "x" * (n - len(marker))

    @app.workflow
    async def report(n: int) -> str:
        text = await render(n)
        return text[:100] + text[-100:]  # the workflow holds the text; its output is small

    @app.workflow
    async def echo(text: str) -> str:
        return text  # a large input and output

    async with app.worker(poll_interval=0.05):
        run = await app.start(report, BIG)
        short = await run.result(timeout=120)
        assert short.startswith(marker) and len(short) == 200
        big_input = "y" * (300 * 1024)
        assert await (await app.start(echo, big_input)).result(timeout=60) == big_input
    lengths = await _lengths(app)
    assert max(lengths.values()) < 4_000, lengths  # references, never the payloads
    history = await app.history(run.run_id)
    done = [e for e in history if e.type.value == "ActivityCompleted"]
    assert len(done) == 1  # read back through the reference, whole
    blobs = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    assert blobs and max(p.stat().st_size for p in blobs) < BIG + 1_000
    stored = b"".join(p.read_bytes()[:200] for p in blobs)
    assert (marker.encode() in stored) is not encrypted  # sealed blobs when encrypted
    app.store.close_sync()  # type: ignore[attr-defined]


async def test_the_offload_threshold_counts_bytes_of_utf8(store_url: str, tmp_path: Path) -> None:
    """200,000 x "é" is 400,000 bytes, above the 256 KiB threshold, yet it stayed inline
    (the check counted characters); 262,000 x "a" (just under it, in JSON) stays."""
    app = tether.App(store=store_url, blobs=str(tmp_path / "blobs"))

    @app.workflow
    async def echo(text: str) -> int:
        return len(text)

    async with app.worker(poll_interval=0.05):
        for text in ("é" * 200_000, "a" * 262_000):
            assert await (await app.start(echo, text)).result(timeout=60) == len(text)
    lengths = await _lengths(app)
    assert 262_000 < lengths["runs.input"] <= 262_144, lengths  # the "a"s, inline
    assert lengths["events.data"] <= 262_144, lengths  # never the 400,000 bytes of "é"
    blobs = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    assert blobs and all(p.stat().st_size > 400_000 for p in blobs)  # the "é"s only
    app.store.close_sync()  # type: ignore[attr-defined]


def test_a_crash_between_blob_write_and_commit_leaves_only_an_orphan(
    store_url: str, tmp_path: Path
) -> None:
    blobs = tmp_path / "blobs"
    mark = tmp_path / "crashed"
    env = {
        **os.environ,
        "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}",
        "CRASH_MARK": str(mark),
    }
    sys.path.insert(0, str(HERE))
    try:
        import offload_app
    finally:
        sys.path.remove(str(HERE))
    client = offload_app.make_app(store_url, str(blobs))  # the same workflow, no crash
    run_id = asyncio.run(_start(client))
    cmd = [sys.executable, str(HERE / "offload_app.py"), store_url, str(blobs)]
    first = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    assert first.wait(60) == 9 and mark.exists()  # died after the write, before the commit
    orphan = mark.read_text()
    second = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        assert asyncio.run(_result(client, run_id)) == 200_000
    finally:
        second.terminate()
        second.wait(30)

    async def check() -> None:
        used = await client.store.blob_refs()
        on_disk = {ref for ref, _ in client.store.blobs.refs()}  # type: ignore[union-attr]
        assert used <= on_disk  # nothing refers to a missing blob
        assert orphan in on_disk and orphan not in used
        assert await client.gc_blobs(older_than=0) == {"kept": len(on_disk) - 1, "removed": 1}
        # what the run refers to survived the collection and still reads
        history = await client.history(run_id)
        assert any(e.type.value == "ActivityCompleted" for e in history)
        assert (await client.get(run_id)).output == "200000"

    asyncio.run(check())
    client.store.close_sync()  # type: ignore[attr-defined]


async def _start(app: tether.App) -> str:
    run = await app.start("report", 200_000, run_id="big")
    return run.run_id


async def _result(app: tether.App, run_id: str) -> int:
    out: int = await app.get_run(run_id).result(timeout=60)
    return out


async def test_erasing_a_tenant_removes_its_offloaded_blobs_and_shreds_its_keys(
    store_url: str, tmp_path: Path
) -> None:
    keys = FileKeyring.create(tmp_path / "keys.json", per_tenant=True)
    app = tether.App(
        store=store_url, blobs=str(tmp_path / "blobs"), encryption=keys, offload_above=1024
    )

    @app.workflow
    async def keep(text: str) -> int:
        return len(text)

    async with app.worker(poll_interval=0.05):
        for tenant in ("acme", "beta"):
            for i in range(3):
                run = await app.start(keep, tenant * 1000 + str(i), tenant=tenant)
                await run.result(timeout=30)
    before = {ref for ref, _ in app.store.blobs.refs()}  # type: ignore[union-attr]
    acme = await app.store.blob_refs("acme")
    beta = await app.store.blob_refs("beta")
    assert acme and beta and not acme & beta and acme | beta <= before
    counts = await app.erase_tenant("acme")
    assert counts["runs"] == 3 and counts["blobs"] == len(acme)
    assert counts["keys_destroyed"] == 2  # its key, and the first fresh one the erasure made
    after = {ref for ref, _ in app.store.blobs.refs()}  # type: ignore[union-attr]
    assert after == before - acme and beta <= after
    assert set((await app.store.orphans()).values()) == {0}
    # the other tenant reads as before
    for info in await app.list(tenant="beta"):
        assert info.input.startswith('{"args":["betabeta')
    app.store.close_sync()  # type: ignore[attr-defined]


async def test_tether_blobs_in_the_environment_is_where_every_process_looks(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TETHER_BLOBS", str(tmp_path / "shared"))
    writer = tether.App(store=store_url, offload_above=1024)

    @writer.workflow
    async def big(n: int) -> str:
        return "z" * n

    async with writer.worker(poll_interval=0.05):
        run = await writer.start(big, 5000)
        assert await run.result(timeout=30) == "z" * 5000
    writer.store.close_sync()  # type: ignore[attr-defined]
    assert [p for p in (tmp_path / "shared").rglob("*") if p.is_file()]
    reader = tether.App(store=store_url)  # another process: no blobs= of its own
    assert (await reader.get(run.run_id)).output == '"' + "z" * 5000 + '"'
    reader.store.close_sync()  # type: ignore[attr-defined]


async def test_purge_removes_the_blobs_only_its_runs_referred_to(
    store_url: str, tmp_path: Path
) -> None:
    app = tether.App(store=store_url, blobs=str(tmp_path / "blobs"), offload_above=1024)

    @app.workflow
    async def keep(text: str) -> int:
        return len(text)

    async with app.worker(poll_interval=0.05):
        for tenant, texts in (("acme", ("a", "b", "shared")), ("beta", ("shared",))):
            for text in texts:
                run = await app.start(keep, text * 2000, tenant=tenant)
                await run.result(timeout=30)
    blobs = app.store.blobs
    assert blobs is not None
    acme, beta = await app.store.blob_refs("acme"), await app.store.blob_refs("beta")
    assert acme & beta and len(acme - beta) >= 2  # "shared" is one blob for both tenants
    for ref in acme:  # written long ago, as the blobs of runs old enough to purge are
        path = blobs._path(ref.removeprefix("sha256:"))
        os.utime(path, (1_000_000, 1_000_000))
    fresh = sorted(acme - beta)[0]
    # put again 2 minutes ago by an attempt still running (its commit will refer to it):
    # spared. Before, only a put in the last minute was, so an activity that put the
    # same document and worked on for over a minute committed a reference to nothing.
    ago = time.time() - 120
    os.utime(blobs._path(fresh.removeprefix("sha256:")), (ago, ago))
    counts = await app.purge(0, tenant="acme")
    assert counts["runs"] == 3 and counts["blobs"] == len(acme - beta) - 1
    left = {ref for ref, _ in blobs.refs()}
    assert left == beta | {fresh}  # the shared blob stays: beta's run refers to it
    assert set((await app.store.orphans()).values()) == {0}
    for info in await app.list(tenant="beta"):
        assert await app.get_run(info.run_id).result() == len("shared" * 2000)
    # the spared one goes to gc once nothing refers to it
    assert (await app.gc_blobs(older_than=0))["removed"] == 1
    app.store.close_sync()  # type: ignore[attr-defined]


_ERASE_KILLED = """
import asyncio, os, sys
import tether

app = tether.App(store=sys.argv[1], blobs=sys.argv[2], offload_above=1024)
batches = 0
real = app.store.erase_tenant_batch


async def dies(*args, **kwargs):
    global batches
    batches += 1
    if batches == 3:  # two batches of its runs removed: the process is killed
        os._exit(9)
    return await real(*args, **kwargs)


app.store.erase_tenant_batch = dies
asyncio.run(app.erase_tenant("acme", batch=2))
"""


async def test_an_erasure_killed_half_way_and_run_again_leaves_none_of_its_blobs(
    store_url: str, tmp_path: Path
) -> None:
    """The blobs of a tenant go before its rows: an erasure killed after removing some
    of its runs, run again to the end, leaves none of the tenant's bytes on disk."""
    blobs = tmp_path / "blobs"
    app = tether.App(store=store_url, blobs=str(blobs), offload_above=1024)

    @app.workflow
    async def keep(text: str) -> int:
        return len(text)

    async with app.worker(poll_interval=0.05):
        for tenant in ("acme", "beta"):
            for i in range(6):
                run = await app.start(keep, f"{tenant}-secret-{i} " * 200, tenant=tenant)
                await run.result(timeout=30)
    app.store.close_sync()  # type: ignore[attr-defined]

    def holding(word: bytes) -> int:
        return sum(word in p.read_bytes() for p in blobs.rglob("*") if p.is_file())

    theirs = holding(b"beta-secret")
    assert holding(b"acme-secret") >= 6 and theirs >= 6
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    killed = subprocess.run(
        [sys.executable, "-c", _ERASE_KILLED, store_url, str(blobs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == 9, killed.stderr
    again = tether.App(store=store_url, blobs=str(blobs), offload_above=1024)

    def acme_runs(tx: Any) -> int:
        return int(tx.execute("SELECT COUNT(*) FROM runs WHERE tenant = 'acme'").fetchone()[0])

    assert 0 < await again.store._do(acme_runs, write=False) < 6  # type: ignore[attr-defined]
    await again.erase_tenant("acme", batch=2)
    assert await again.store._do(acme_runs, write=False) == 0  # type: ignore[attr-defined]
    assert holding(b"acme-secret") == 0 and holding(b"beta-secret") == theirs
    again.store.close_sync()  # type: ignore[attr-defined]
