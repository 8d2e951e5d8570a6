"""Large payloads by reference: a 50 MB document passes between activities as a Blob
(its hash and size), never through the history; a damaged or missing blob fails the
step naming it; orphans (blobs no payload refers to) are collected after a grace
period, never the blobs of runs that refer to them."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tether

SIZE = 50 * 2**20


@pytest.fixture
def blob_app(store_url: str, tmp_path: Path) -> Iterator[tether.App]:
    app = tether.App(store=store_url, blobs=str(tmp_path / "blobs"))
    yield app
    if app._store is not None:
        app.store.close_sync()  # type: ignore[attr-defined]


async def test_a_50_mb_document_passes_by_reference(blob_app: tether.App, tmp_path: Path) -> None:
    app = blob_app

    @app.activity
    def fetch() -> tether.Blob:
        return tether.put_blob(os.urandom(SIZE), media_type="application/pdf")

    @app.activity
    def measure(doc: tether.Blob) -> int:
        return len(tether.read_blob(doc))

    @app.workflow
    async def ingest() -> int:
        doc = await fetch()  # the workflow holds the reference only
        return await measure(doc)

    async with app.worker(poll_interval=0.05):
        run = await app.start(ingest)
        assert await run.result(timeout=60) == SIZE
    history = await app.history(run.run_id)
    assert max(len(json.dumps(e.data)) for e in history) < 2_000  # never the bytes
    ref = next(
        e.data["result"]
        for e in history
        if e.data.get("result", {}) and "ref" in str(e.data.get("result"))
    )
    assert ref["size"] == SIZE and ref["media_type"] == "application/pdf"
    stored = list((tmp_path / "blobs").rglob("*"))
    assert sum(p.stat().st_size for p in stored if p.is_file()) == SIZE


async def test_a_damaged_or_missing_blob_fails_the_step_naming_it(
    blob_app: tether.App, tmp_path: Path
) -> None:
    app = blob_app
    blob = app.put_blob(b"the contract, version 3")
    digest = blob.ref.removeprefix("sha256:")
    path = tmp_path / "blobs" / "sha256" / digest[:2] / digest[2:]
    path.write_bytes(b"the contract, version 4")  # changed behind our back

    @app.activity(retry=tether.Retry(attempts=1))
    def read(doc: tether.Blob) -> str:
        return tether.read_blob(doc).decode()

    @app.workflow
    async def check(doc: tether.Blob) -> str:
        return await read(doc)

    async with app.worker(poll_interval=0.05):
        with pytest.raises(tether.WorkflowFailedError, match="do not match the hash"):
            await (await app.start(check, blob)).result(timeout=20)
        path.unlink()
        with pytest.raises(tether.WorkflowFailedError, match=f"{blob.ref}: missing"):
            await (await app.start(check, blob, run_id="again")).result(timeout=20)
    with pytest.raises(tether.BlobError, match="missing"):
        app.read_blob(blob)


async def test_putting_the_bytes_again_restores_a_damaged_blob(
    blob_app: tether.App, tmp_path: Path
) -> None:
    """A put of bytes whose blob is stored but damaged kept the damaged file (it only
    touched it), so every new run with that content failed; the documented way back,
    providing the bytes again, did nothing. It is now written anew."""
    app = blob_app
    blob = app.put_blob(b"the contract, version 3")
    digest = blob.ref.removeprefix("sha256:")
    path = tmp_path / "blobs" / "sha256" / digest[:2] / digest[2:]
    path.write_bytes(b"XXe contract, version 3")  # bit rot
    with pytest.raises(tether.BlobError, match="do not match the hash"):
        app.read_blob(blob)
    assert app.put_blob(b"the contract, version 3") == blob
    assert app.read_blob(blob) == b"the contract, version 3"
    path.unlink()  # and a missing one, as before
    assert app.put_blob(b"the contract, version 3") == blob
    assert app.read_blob(blob) == b"the contract, version 3"


async def test_orphans_are_collected_after_the_grace_period(blob_app: tether.App) -> None:
    app = blob_app

    @app.workflow
    async def holds(doc: tether.Blob) -> int:
        return doc.size

    kept = app.put_blob(b"referred to by a run")
    async with app.worker(poll_interval=0.05):
        assert await (await app.start(holds, kept)).result(timeout=20) == len(
            b"referred to by a run"
        )
    orphan = app.put_blob(b"written by an attempt that crashed before its commit")
    fresh = app.put_blob(b"written by an attempt still running")
    root = Path(app.store.blobs.root)  # type: ignore[union-attr]
    old = time.time() - 7200
    for b in (kept, orphan):
        digest = b.ref.removeprefix("sha256:")
        os.utime(root / "sha256" / digest[:2] / digest[2:], (old, old))
    assert await app.gc_blobs(older_than=3600) == {"kept": 2, "removed": 1}
    assert app.read_blob(kept) and app.read_blob(fresh)
    with pytest.raises(tether.BlobError):
        app.read_blob(orphan)


async def test_putting_bytes_already_stored_restarts_their_grace_period(
    blob_app: tether.App,
) -> None:
    """An attempt that puts bytes another (since purged) run had put refers to the blob
    it finds there: the put makes it young again, so gc cannot remove it between the
    put and the commit that refers to it."""
    app = blob_app
    first = app.put_blob(b"the same document")
    digest = first.ref.removeprefix("sha256:")
    path = Path(app.store.blobs.root) / "sha256" / digest[:2] / digest[2:]  # type: ignore[union-attr]
    old = time.time() - 7200
    os.utime(path, (old, old))
    again = app.put_blob(b"the same document")  # an attempt still running, not committed
    assert again.ref == first.ref and path.stat().st_mtime > old + 3600
    assert await app.gc_blobs(older_than=3600) == {"kept": 1, "removed": 0}


async def test_a_blob_put_again_while_gc_scans_the_store_stays(blob_app: tether.App) -> None:
    """gc lists the blobs, then reads every payload (minutes on a big store): a blob an
    attempt puts again meanwhile (its reference about to be committed) is young again
    when gc comes to it, so it stays."""
    app = blob_app
    orphan = app.put_blob(b"last month's report")
    digest = orphan.ref.removeprefix("sha256:")
    path = Path(app.store.blobs.root) / "sha256" / digest[:2] / digest[2:]  # type: ignore[union-attr]
    old = time.time() - 7200
    os.utime(path, (old, old))
    scan = app.store.blob_refs

    async def slow_scan(*args: Any, **kwargs: Any) -> set[str]:
        used = await scan(*args, **kwargs)
        assert app.put_blob(b"last month's report") == orphan  # this month's run
        return used

    app.store.blob_refs = slow_scan  # type: ignore[method-assign]
    assert await app.gc_blobs(older_than=3600) == {"kept": 1, "removed": 0}
    assert app.read_blob(orphan) == b"last month's report"


async def test_gc_refuses_the_blob_folder_every_postgres_store_shares(
    tmp_path: Path, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PostgreSQL store named no blob store uses ``./tether-blobs``, which every such
    store started in that folder shares: gc (or a purge) on one would delete blobs the
    others' runs refer to. gc refuses, a purge leaves the blobs; a named one works."""
    from conftest import require_pg, with_schema

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TETHER_BLOBS", raising=False)
    url = with_schema(require_pg(), pg_schema)
    app = tether.App(store=url)

    @app.workflow
    async def keep(doc: tether.Blob) -> int:
        return doc.size

    other = app.put_blob(b"another store's document")  # no payload of this store has it
    run = await app.start(keep, app.put_blob(b"this store's document"))
    async with app.worker(poll_interval=0.05):
        assert await run.result(timeout=20) > 0
    with pytest.raises(tether.ConfigurationError, match="shared"):
        await app.gc_blobs(older_than=0)
    counts = await app.purge(0)
    assert counts["runs"] == 1 and counts.get("blobs", 0) == 0
    assert app.read_blob(other)
    await app.close()
    named = tether.App(store=url, blobs=str(tmp_path / "own"))
    assert (await named.gc_blobs(older_than=0))["removed"] == 0
    await named.close()


async def test_a_run_whose_payload_is_lost_never_breaks_listings_actions_or_erasure(
    store_url: str, tmp_path: Path
) -> None:
    """One run whose input blob is missing made `app.list()` fail for everyone (GET
    /v1/runs answered 500), its own page and terminate 500, and `erase_tenant` fail
    leaving every run. Listings and actions work from ids and statuses: the field that
    cannot be read shows as unavailable with the reason; ``app.get`` still raises."""
    from test_http_api import Server

    blobs = tmp_path / "blobs"
    app = tether.App(store=store_url, blobs=str(blobs))

    @app.workflow
    async def approve(doc: str) -> str:
        return doc

    await app.start(approve, "x" * 300_000, run_id="lost", tenant="globex")  # offloaded
    await app.start(approve, "fine", run_id="kept", tenant="globex")
    await app.start(approve, "other", run_id="theirs", tenant="acme")
    for path in blobs.rglob("*"):
        if path.is_file():
            path.unlink()

    listed = {r.run_id: r for r in await app.list()}
    assert set(listed) == {"lost", "kept", "theirs"}
    assert listed["lost"].input == "null" and listed["lost"].unavailable is not None
    assert "missing" in listed["lost"].unavailable["input"]
    assert listed["kept"].unavailable is None and "fine" in listed["kept"].input
    with pytest.raises(tether.BlobError):
        await app.get("lost")  # a caller that reads the payload is told, never given null
    assert len(await app.list(tenant="globex")) == 2
    await app.close()

    server = Server(store_url, "--workers", "0", "--no-auth", env={"TETHER_BLOBS": str(blobs)})
    try:
        page = server.http.get("/v1/runs?limit=100")
        assert page.status_code == 200, page.text
        shown = {r["id"]: r for r in page.json()["runs"]}
        assert "missing" in shown["lost"]["unavailable"]["input"]
        one = server.http.get("/v1/runs/lost")
        assert one.status_code == 200, one.text
        assert "missing" in one.json()["unavailable"]["input"]
        ended = server.http.post("/v1/runs/lost/terminate", json={"reason": "broken"})
        assert ended.status_code == 202, ended.text
        assert ended.json()["status"] == "terminated"
        console = server.http.get("/runs/lost")
        assert console.status_code == 200, console.text
    finally:
        server.stop()

    again = tether.App(store=store_url, blobs=str(blobs))
    try:
        counts = await again.erase_tenant("globex")
        assert counts["runs"] == 2
        assert [r.run_id for r in await again.list()] == ["theirs"]
    finally:
        await again.close()


async def test_gc_removes_a_half_written_blob_a_killed_process_left(
    blob_app: tether.App, tmp_path: Path
) -> None:
    """A process killed inside a blob's write left ``.tmp-*`` (its plaintext, maybe)
    that no gc, purge or erasure ever removed: gc removes one older than its grace."""
    import signal
    import subprocess
    import sys

    script = (
        "import os, signal\n"
        "import tether.blobs as B\n"
        "B.os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # before the rename\n"
        f"B.BlobStore({str(tmp_path / 'blobs')!r}).put(b'TENANT-PLAINTEXT ' * 1000)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    done = subprocess.run([sys.executable, "-c", script], env=env, timeout=60)
    assert done.returncode == -signal.SIGKILL
    (left,) = [p for p in (tmp_path / "blobs").rglob(".tmp-*")]
    assert await blob_app.gc_blobs(older_than=3600) == {"kept": 0, "removed": 0}
    assert left.exists()  # young: a write may be under way
    old = time.time() - 7200
    os.utime(left, (old, old))
    assert await blob_app.gc_blobs(older_than=3600) == {"kept": 0, "removed": 1}
    assert not left.exists()


async def test_a_run_whose_blob_is_lost_backs_off_names_it_and_heals_when_it_is_back(
    store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run whose input blob went missing was retried every 5 s for ever, each time an
    ERROR reading ``BlobError: <N characters redacted>``. Its workflow task now backs off
    (the retry delay doubling), each try logs the blob's reference in full (the engine
    made the message from the run id and the hash alone), and the blob put back heals
    the run, as docs/data-lifecycle.md promises."""
    blobs = tmp_path / "blobs"
    app = tether.App(store=store_url, blobs=str(blobs))

    @app.workflow
    async def approve(doc: str) -> int:
        return len(doc)

    await app.start(approve, "x" * 300_000, run_id="lost")  # its input offloaded
    kept = {p: p.read_bytes() for p in blobs.rglob("*") if p.is_file()}
    refs = {f"sha256:{p.parent.name}{p.name}" for p in kept}
    for path in kept:
        path.unlink()
    caplog.set_level("ERROR", logger="tether")
    async with app.worker(poll_interval=0.05, workflow_retry_delay=0.2) as w:
        await asyncio.sleep(3.0)
        tries = w.stats["workflow_task_failures"]
        said = [r.getMessage() for r in caplog.records if "'lost'" in r.getMessage()]
        # every 0.2 s would be ~15 tries; doubling (0.2, 0.4, 0.8, 1.6 s) at most 5
        assert 2 <= tries <= 5, tries
        assert len(said) == tries, said
        assert all(any(r in s for r in refs) and "redacted" not in s for s in said), said
        for path, data in kept.items():  # the blobs given back: the run finishes
            path.write_bytes(data)
        assert await app.get_run("lost").result(timeout=30) == 300_000
    await app.close()


def test_a_blob_store_s_password_never_shows_in_its_errors(tmp_path: Path) -> None:
    """Blob errors are logged and shown whole (they carry no payload): a password in the
    blob store's URL must not be in them."""
    from tether.blobs import Blob, BlobError, BlobStore

    store = BlobStore(str(tmp_path / "blobs"))
    store.root = str(tmp_path / "blobs")
    assert store.shown_root == store.root  # a path: shown as it is
    store.root = "https://reader:s3cr3tpw@files.example.com/blobs"  # (as fsspec keeps it)
    assert store.shown_root == "https://reader:***@files.example.com/blobs"
    store.root = str(tmp_path / "blobs")
    missing = Blob(ref="sha256:" + "0" * 64, size=1)
    store.root, real = "https://reader:s3cr3tpw@files.example.com/blobs", store.root
    with pytest.raises(BlobError) as got:
        store.kept(missing.ref)
    assert "s3cr3tpw" not in str(got.value) and "reader:***@" in str(got.value)
    store.root = real


def test_verify_masks_credentials_in_an_unreadable_blobs_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify`` (``tether store check``) showed an unreadable blob's OS or fsspec error
    whole: for a remote root with a password in its URL, the password was printed. It is
    masked there as the blob store's root is in every other message."""
    from tether.blobs import BlobStore

    store = BlobStore(str(tmp_path / "blobs"))
    ref = store.put(b"a document").ref
    root = "s3://keyid:SECRET-PASSWORD@bucket/blobs"

    def fails(ref: str) -> bytes:
        raise OSError(f"cannot read {root}/sha256/ab/cd: 403 (https://u:OTHER-SECRET@h/x)")

    monkeypatch.setattr(store, "kept", fails)
    monkeypatch.setattr(store, "root", root)
    problem = store.verify(ref)
    assert problem is not None and problem.startswith("unreadable (OSError: "), problem
    assert "SECRET-PASSWORD" not in problem and "OTHER-SECRET" not in problem, problem
    assert "keyid:***@bucket" in problem and "403" in problem, problem


def test_copied_blobs_keep_their_modification_time(tmp_path: Path) -> None:
    """``tether store backup``/``restore`` wrote each blob with a fresh modification
    time, so a purge's pending deletions carried in a backup were "put again since" on
    the restored store and skipped for good. The copy keeps the source's time."""
    from tether.blobs import BlobStore
    from tether.cli.lifecycle import _copy_blobs

    source, target = BlobStore(str(tmp_path / "a")), BlobStore(str(tmp_path / "b"))
    ref = source.put(b"a document a purge was deleting").ref
    old = time.time() - 7200
    digest = ref.removeprefix("sha256:")
    os.utime(tmp_path / "a" / "sha256" / digest[:2] / digest[2:], (old, old))
    assert _copy_blobs(source, target) == 1
    copied = target.modified(ref)
    assert copied is not None and abs(copied - old) < 2, (copied, old)
