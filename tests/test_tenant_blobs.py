"""Crypto-shredding covers put_blob documents: with per-tenant keys a document a
tenant's run puts (or one put for a tenant before its run starts) is sealed under the
tenant's key and kept apart from another tenant's copy of the same bytes, so erasing the
tenant leaves every copy of it (a backup's blobs) unreadable; old shared-key blobs still
read, and gc, reseal and erasure handle both."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tether
from tether.blobs import BlobStore
from tether.encryption import FileKeyring, KeyUnavailableError, Sealer

DOC = b"the contract of acme, version 3: CANARY-9e1d"


@pytest.fixture
def keys(tmp_path: Path) -> FileKeyring:
    return FileKeyring.create(tmp_path / "keys.json", per_tenant=True)


@pytest.fixture
def app(store_url: str, tmp_path: Path, keys: FileKeyring) -> Iterator[tether.App]:
    a = tether.App(store=store_url, blobs=str(tmp_path / "blobs"), encryption=keys)
    yield a
    if a._store is not None:
        a.store.close_sync()  # type: ignore[attr-defined]


def _copy(tmp_path: Path, keys: FileKeyring) -> BlobStore:
    """A copy of the blob store as a backup keeps it, read with the keyring."""
    shutil.copytree(tmp_path / "blobs", tmp_path / "backup.blobs")
    copy = BlobStore(str(tmp_path / "backup.blobs"))
    copy.sealer = Sealer(FileKeyring(keys.path))
    return copy


def _register(app: tether.App) -> Any:
    @app.activity
    def fetch(text: str) -> tether.Blob:
        return tether.put_blob(text.encode(), media_type="text/plain")

    @app.activity
    def measure(doc: tether.Blob) -> int:
        return len(tether.read_blob(doc))

    @app.workflow
    async def ingest(text: str) -> dict[str, Any]:
        doc = await fetch(text)
        await measure(doc)
        return doc if isinstance(doc, dict) else doc.model_dump()

    return ingest


async def test_a_tenants_put_blob_document_is_shredded_with_it_but_not_anothers(
    app: tether.App, tmp_path: Path, keys: FileKeyring
) -> None:
    ingest = _register(app)
    async with app.worker(poll_interval=0.05):
        a = await app.start(ingest, DOC.decode(), run_id="a", tenant="acme")
        g = await app.start(ingest, DOC.decode(), run_id="g", tenant="globex")
        acme = tether.Blob.model_validate(await a.result(timeout=30))
        globex = tether.Blob.model_validate(await g.result(timeout=30))
    assert acme.size == globex.size == len(DOC)
    assert acme.ref != globex.ref  # the same bytes, one blob each
    stored = [p.read_bytes() for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    assert stored and not any(DOC in s for s in stored)
    assert app.read_blob(acme) == app.read_blob(globex) == DOC
    backup = _copy(tmp_path, keys)
    assert backup.get(acme) == DOC  # readable until the tenant is erased

    out = await app.erase_tenant("acme")
    assert out["blobs"] >= 1 and out["keys_destroyed"] >= 1
    with pytest.raises(tether.BlobError):
        app.read_blob(acme)  # gone from the live store
    backup.sealer = Sealer(FileKeyring(keys.path))
    with pytest.raises(KeyUnavailableError, match="destroyed"):
        backup.get(acme)  # and the copy is shredded
    assert backup.get(globex) == DOC and app.read_blob(globex) == DOC


async def test_a_document_put_for_a_tenant_before_its_run_is_shredded_with_it(
    app: tether.App, tmp_path: Path, keys: FileKeyring
) -> None:
    @app.activity
    def measure(doc: tether.Blob) -> int:
        return len(tether.read_blob(doc))

    @app.workflow
    async def review(doc: tether.Blob) -> int:
        return await measure(doc)

    mine = app.put_blob(DOC, media_type="text/plain", tenant="acme")
    shared = app.put_blob(DOC, media_type="text/plain")
    assert shared.ref == "sha256:" + hashlib.sha256(DOC).hexdigest()  # as before
    assert mine.ref != shared.ref and mine.size == len(DOC)
    assert app.put_blob(DOC, media_type="text/plain", tenant="acme") == mine  # once
    async with app.worker(poll_interval=0.05):
        run = await app.start(review, mine, run_id="r", tenant="acme")
        assert await run.result(timeout=30) == len(DOC)
        other = await app.start(review, shared, run_id="s")
        assert await other.result(timeout=30) == len(DOC)
    backup = _copy(tmp_path, keys)
    await app.erase_tenant("acme")
    backup.sealer = Sealer(FileKeyring(keys.path))
    with pytest.raises(KeyUnavailableError, match="destroyed"):
        backup.get(mine)
    assert backup.get(shared) == DOC and app.read_blob(shared) == DOC
    with pytest.raises(tether.BlobError):
        app.read_blob(mine)


async def test_tenant_blobs_are_resealed_under_the_tenants_new_key_and_kept_by_gc(
    app: tether.App, tmp_path: Path, keys: FileKeyring
) -> None:
    ingest = _register(app)
    old = app.put_blob(b"put before this change: under the shared key")
    async with app.worker(poll_interval=0.05):
        run = await app.start(ingest, DOC.decode(), run_id="a", tenant="acme")
        acme = tether.Blob.model_validate(await run.result(timeout=30))
        keep = await app.start(ingest, "kept", run_id="k")
        await keep.result(timeout=30)
    first = keys.current("acme")
    path = tmp_path / "blobs" / "sha256" / acme.ref[7:9] / acme.ref[9:]
    assert path.read_bytes().startswith(f"~e1:{first}:".encode())
    fresh = keys.rotate("acme")
    keys.rotate()
    out = await app.reseal()
    assert out["blobs_resealed"] >= 2  # acme's and the shared-key one
    assert path.read_bytes().startswith(f"~e1:{fresh}:".encode())
    assert app.read_blob(acme) == DOC and app.read_blob(old).startswith(b"put before")
    assert (await app.gc_blobs(older_than=0))["removed"] == 1  # only `old`: unreferenced
    assert app.read_blob(acme) == DOC
    keys.shred("acme", [first])  # its old key no longer needed
    assert app.read_blob(acme) == DOC


async def test_a_batched_activity_of_one_tenants_runs_puts_its_documents_for_it(
    app: tether.App, tmp_path: Path, keys: FileKeyring
) -> None:
    @app.activity(batch=tether.Batch(max_items=4, max_wait=0.3))
    def fetch_all(items: list[str]) -> list[tether.Blob]:
        return [tether.put_blob(text.encode()) for text in items]

    @app.workflow
    async def one(text: str) -> dict[str, Any]:
        doc = await fetch_all(text)
        return doc if isinstance(doc, dict) else doc.model_dump()

    async with app.worker(poll_interval=0.05):
        runs = [await app.start(one, f"doc {i}", run_id=f"b{i}", tenant="acme") for i in range(3)]
        docs = [tether.Blob.model_validate(await r.result(timeout=30)) for r in runs]
    key = keys.current("acme")
    for i, doc in enumerate(docs):
        assert doc.ref != "sha256:" + hashlib.sha256(f"doc {i}".encode()).hexdigest()
        path = tmp_path / "blobs" / "sha256" / doc.ref[7:9] / doc.ref[9:]
        assert path.read_bytes().startswith(f"~e1:{key}:".encode())
        assert app.read_blob(doc) == f"doc {i}".encode()


FLOWS = """
import tether
from tether.encryption import FileKeyring

app = tether.App(store={store!r}, encryption=FileKeyring({keys!r}))


@app.activity
def fetch(text: str) -> tether.Blob:
    return tether.put_blob(text.encode())


@app.workflow
async def ingest(text: str) -> dict:
    doc = await fetch(text)
    return doc if isinstance(doc, dict) else doc.model_dump()
"""


def test_a_backup_taken_before_erase_tenant_keeps_the_tenants_documents_unreadable(
    tmp_path: Path, keys: FileKeyring
) -> None:
    """Through the commands: backup, erase-tenant, restore of that backup; acme's
    document in the restored blob store is shredded, globex's copy of the same bytes
    reads, and the restored store checks sound."""
    import asyncio
    import os
    import subprocess
    import sys

    db, backup, restored = tmp_path / "t.db", tmp_path / "bk.db", tmp_path / "restored.db"
    (tmp_path / "tbflows.py").write_text(FLOWS.format(store=f"sqlite:///{db}", keys=keys.path))
    sys.path.insert(0, str(tmp_path))
    try:
        import tbflows
    finally:
        sys.path.remove(str(tmp_path))
    text = DOC.decode()

    async def populate() -> tuple[tether.Blob, tether.Blob]:
        app = tbflows.app
        async with app.worker(poll_interval=0.02):
            a = await app.start("ingest", text, run_id="a", tenant="acme")
            g = await app.start("ingest", text, run_id="g", tenant="globex")
            out = (
                tether.Blob.model_validate(await a.result(30)),
                tether.Blob.model_validate(await g.result(30)),
            )
        await app.close()
        return out

    acme, globex = asyncio.run(populate())
    src = Path(tether.__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{tmp_path}"}
    env["TETHER_KEYRING"] = str(keys.path)
    env.pop("TETHER_BLOBS", None)

    def cli(*args: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "tether.cli", *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    cli("store", "backup", str(backup), "--store", str(db))
    cli("erase-tenant", "acme", "--yes", "--store", str(db))
    cli("store", "restore", str(backup), "--to", str(restored))
    cli("store", "check", "--store", str(restored))
    copy = BlobStore(f"{restored}.blobs")
    copy.sealer = Sealer(FileKeyring(keys.path))
    with pytest.raises(KeyUnavailableError, match="destroyed"):
        copy.get(acme)
    assert copy.get(globex) == DOC
    live = BlobStore(f"{db}.blobs")
    live.sealer = copy.sealer
    with pytest.raises(tether.BlobError, match="missing"):
        live.get(acme)
    assert live.get(globex) == DOC


async def test_a_worker_reads_a_runs_tenant_only_when_its_activity_puts_a_blob(
    store_url: str, tmp_path: Path, keys: FileKeyring
) -> None:
    """With per-tenant keys a worker read each run's tenant from the store before the
    first attempt of every activity (a batch's runs one after another), whether or not
    it called ``put_blob``: a store round trip added to the hot path. A sync activity's
    lookup is now made when it puts a blob, and its document is still the tenant's."""

    def make() -> tuple[tether.App, Any]:
        a = tether.App(store=store_url, blobs=str(tmp_path / "blobs"), encryption=keys)

        @a.activity(queue="acts")
        def plain(x: int) -> int:
            return x + 1

        @a.activity(queue="acts")
        def fetch(text: str) -> tether.Blob:
            return tether.put_blob(text.encode())

        @a.activity(queue="acts", batch=tether.Batch(max_items=4, max_wait=0.2))
        def many(xs: list[int]) -> list[int]:
            return [x * 2 for x in xs]

        @a.workflow
        async def flow(n: int, text: str) -> dict[str, Any]:
            doc = await fetch(text) if text else None  # first: no tenant cached yet
            await plain(n)
            await many(n)
            return {"doc": doc if isinstance(doc, dict) or doc is None else doc.model_dump()}

        return a, flow

    starter, flow = make()
    for i in range(4):
        await starter.start(flow, i, "", run_id=f"p{i}", tenant=f"t{i}")
    worker, _ = make()  # the activities' worker, in another process: no tenant cached
    reads: list[str] = []
    real = worker.store.run_tenant

    async def counted(run_id: str) -> str | None:
        reads.append(run_id)
        return await real(run_id)

    worker.store.run_tenant = counted  # type: ignore[method-assign]
    async with (
        starter.worker(poll_interval=0.02, queues=["default"]),
        worker.worker(poll_interval=0.02, queues=["acts"]),
    ):
        for i in range(4):
            assert (await starter.get_run(f"p{i}").result(timeout=30)) == {"doc": None}
        assert reads == [], reads  # no blob put: no tenant read
        run = await starter.start(flow, 9, DOC.decode(), run_id="d", tenant="acme")
        doc = tether.Blob.model_validate((await run.result(timeout=30))["doc"])
    assert reads == ["d"], reads
    alone = starter.put_blob(DOC, tenant="acme")
    assert doc.ref == alone.ref  # the tenant's document, as put for it
    for a in (starter, worker):
        await a.close()


async def test_bytes_planted_as_a_tenants_frame_never_keep_its_document_unshredded(
    app: tether.App, tmp_path: Path, keys: FileKeyring
) -> None:
    """A blob put without a tenant whose bytes were those a tenant's document is named
    by (its frame: ``~tb1:"acme"`` and the document) got the same reference as acme's
    later ``put_blob(DOC, tenant="acme")``, which found it intact and left it under the
    shared key, readable after acme's erasure; and ``reseal`` took any document so
    beginning for a tenant's. Now such bytes are refused without a tenant (with
    per-tenant keys), a tenant's put rewrites a blob not under one of its keys, and
    reseal reads a tenant only from what was sealed under its key."""
    from tether.blobs import framed

    with pytest.raises(tether.BlobError, match="tenant"):
        app.put_blob(framed("acme", DOC))
    store = app.store.blobs
    assert store is not None
    # planted by an older version (or by hand): under the shared key, named as acme's
    planted = framed("acme", DOC)
    ref = "sha256:" + hashlib.sha256(planted).hexdigest()
    store.keep(ref, store.sealer.seal_bytes(planted, None))  # type: ignore[union-attr]
    shared = keys.rotate()  # the shared key rotated: reseal moves it to the new one
    assert store.reseal(ref)
    assert shared in store.head(ref).decode("ascii", "replace")  # not taken for acme's
    mine = app.put_blob(DOC, tenant="acme")
    assert mine.ref == ref
    head = store.head(ref).decode("ascii", "replace")
    assert any(k in head for k in keys.tenant_keys("acme")), head  # rewritten under acme's
    backup = _copy(tmp_path, keys)
    await app.erase_tenant("acme")
    backup.sealer = Sealer(FileKeyring(keys.path))
    with pytest.raises(KeyUnavailableError, match="destroyed"):
        backup.get(mine)
