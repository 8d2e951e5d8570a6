"""Crypto-shredding covers put_blob documents: with per-tenant keys a document a
tenant's run puts (or one put for a tenant before its run starts) is sealed under the
tenant's key and kept apart from another tenant's copy of the same bytes, so erasing the
tenant leaves every copy of it (a backup's blobs) unreadable; old shared-key blobs still
read, and gc, reseal and erasure handle both."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tether
from helpers import eventually
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


def _count_ops(app: tether.App) -> list[str]:
    """The names of the store operations ``app`` runs from now on (one per store call)."""
    ops: list[str] = []
    store: Any = app.store
    real = store._do

    async def counted(fn: Any, *args: Any, **kw: Any) -> Any:
        ops.append(fn.__name__)
        return await real(fn, *args, **kw)

    store._do = counted
    return ops


async def test_a_claim_brings_each_runs_tenant_so_the_worker_reads_none(
    store_url: str, tmp_path: Path, keys: FileKeyring
) -> None:
    """With per-tenant keys a worker read each run's tenant from the store before an
    async activity's attempt, and a sync one's inside ``put_blob`` (inside the user's
    attempt). The claim now brings each task's run tenant with it: no store call of the
    worker reads a tenant, and a document put by a sync, an async or a batched activity
    is still sealed under its run's tenant's key."""

    def make() -> tuple[tether.App, Any]:
        a = tether.App(store=store_url, blobs=str(tmp_path / "blobs"), encryption=keys)

        @a.activity(queue="acts")
        def plain(x: int) -> int:
            return x + 1

        @a.activity(queue="acts")
        def fetch(text: str) -> tether.Blob:
            return tether.put_blob(text.encode())

        @a.activity(queue="acts")
        async def afetch(text: str) -> tether.Blob:
            return tether.put_blob(text.encode())

        @a.activity(queue="limited")  # claimed by the limited queues' path
        def lfetch(text: str) -> tether.Blob:
            return tether.put_blob(text.encode())

        @a.activity(queue="acts", batch=tether.Batch(max_items=4, max_wait=0.2))
        def many(xs: list[str]) -> list[tether.Blob]:
            return [tether.put_blob(x.encode()) for x in xs]

        def shown(doc: Any) -> Any:
            return doc if isinstance(doc, dict) else doc.model_dump()

        @a.workflow
        async def flow(how: str, text: str) -> Any:
            # each run's first step: its worker has not seen the run's tenant yet
            if how == "plain":
                return await plain(len(text))
            fn = {"sync": fetch, "async": afetch, "batch": many, "limited": lfetch}[how]
            return shown(await fn(text))

        return a, flow

    starter, flow = make()
    starter.configure_queue("limited", max_concurrency=2)
    worker, _ = make()  # the activities' worker, in another process: no tenant cached
    ops = _count_ops(worker)
    docs: dict[str, Any] = {}
    async with (
        starter.worker(poll_interval=0.02, queues=["default"]),
        worker.worker(poll_interval=0.02, queues=["acts", "limited"]),
    ):
        for i in range(3):
            run = await starter.start(flow, "plain", "x" * i, run_id=f"p{i}", tenant=f"t{i}")
            assert await run.result(timeout=30) == i + 1
        for how in ("sync", "async", "batch", "limited"):
            run = await starter.start(flow, how, DOC.decode(), run_id=how, tenant="acme")
            docs[how] = await run.result(timeout=30)
    assert "_claim_with_wake" in ops, ops
    assert not [op for op in ops if op in ("_run_tenant", "_get_run")], ops
    alone = starter.put_blob(DOC, tenant="acme")
    for how in ("sync", "async", "batch", "limited"):
        assert tether.Blob.model_validate(docs[how]).ref == alone.ref, how  # acme's document
    assert alone.ref != starter.put_blob(DOC).ref  # (not the shared key's)
    for a in (starter, worker):
        await a.close()


def _charging(store_url: str, tmp_path: Path, keys: FileKeyring, effects: list[str]) -> Any:
    """Two apps on one store: a starter (workflows) and a worker of the activities, whose
    sync activity has a side effect, then puts a blob; one attempt allowed."""

    def make() -> tuple[tether.App, Any]:
        a = tether.App(store=store_url, blobs=str(tmp_path / "blobs"), encryption=keys)

        @a.activity(retry=tether.Retry(attempts=1), queue="acts")
        def charge(order: str) -> tether.Blob:
            effects.append(order)  # e.g. charged the card
            return tether.put_blob(b"receipt " + order.encode())

        @a.workflow
        async def flow(order: str) -> dict[str, Any]:
            doc = await charge(order)
            return doc if isinstance(doc, dict) else doc.model_dump()

        return a, flow

    starter, flow = make()
    worker, _ = make()
    return starter, worker, flow


def _blipping(app: tether.App, reads: list[str], blips: int = 1) -> None:
    """``app``'s store fails its first ``blips`` tenant reads (a PostgreSQL blip)."""
    real = app.store.run_tenant
    calls = [0]

    async def flaky(run_id: str) -> str | None:
        reads.append(run_id)
        calls[0] += 1
        if calls[0] <= blips:
            raise tether.StoreError("store: connection reset (a blip)")
        return await real(run_id)

    app.store.run_tenant = flaky  # type: ignore[method-assign]


async def test_a_store_blip_reading_a_runs_tenant_never_fails_an_attempt_after_its_effects(
    store_url: str, tmp_path: Path, keys: FileKeyring
) -> None:
    """A sync activity's run tenant was read inside ``put_blob``, after the user's side
    effects: a store blip there failed the attempt (with ``attempts=1``, the run) though
    the card was charged. The claim brings the tenant now: nothing is read, the run
    completes, the side effect happened once and the receipt is acme's."""
    effects: list[str] = []
    starter, worker, flow = _charging(store_url, tmp_path, keys, effects)
    reads: list[str] = []
    _blipping(worker, reads)
    async with (
        starter.worker(poll_interval=0.02, queues=["default"]),
        worker.worker(poll_interval=0.02, queues=["acts"]),
    ):
        run = await starter.start(flow, "o-1", run_id="r1", tenant="acme")
        doc = tether.Blob.model_validate(await run.result(timeout=30))
    assert effects == ["o-1"]
    assert reads == []
    assert starter.read_blob(doc) == b"receipt o-1"
    assert doc.ref == starter.put_blob(b"receipt o-1", tenant="acme").ref
    for a in (starter, worker):
        await a.close()


async def test_a_task_claimed_without_its_tenant_reads_it_before_the_attempt(
    store_url: str, tmp_path: Path, keys: FileKeyring
) -> None:
    """A task whose claim did not bring its run's tenant (``tenant_known`` False: as a
    store's claim of an older release gave it) has the tenant read before the attempt
    begins; a store blip there gives the task back without spending its attempt (one
    allowed), so the run completes with the side effect made once, sealed for acme."""
    import dataclasses

    effects: list[str] = []
    starter, worker, flow = _charging(store_url, tmp_path, keys, effects)
    reads: list[str] = []
    _blipping(worker, reads)
    real = worker.store.claim_with_wake

    async def untold(**kw: Any) -> Any:
        tasks, wake = await real(**kw)
        out = [dataclasses.replace(t, tenant=None, tenant_known=False) for t in tasks]
        for t in out:
            worker.store.codec.tenants.pop(t.run_id, None)  # (nor remembered by it)
            reads.append(f"claimed {t.run_id} attempt {t.attempt} after {len(effects)}")
        return out, wake

    worker.store.claim_with_wake = untold  # type: ignore[method-assign]
    async with (
        starter.worker(poll_interval=0.02, queues=["default"]),
        worker.worker(poll_interval=0.02, queues=["acts"]),
    ):
        run = await starter.start(flow, "o-1", run_id="r1", tenant="acme")
        doc = tether.Blob.model_validate(await run.result(timeout=30))
    assert effects == ["o-1"]
    # the first read failed before the attempt began; the step ran again as attempt 1
    assert reads == [
        "claimed r1 attempt 1 after 0",
        "r1",
        "claimed r1 attempt 1 after 0",
        "r1",
    ], reads
    assert doc.ref == starter.put_blob(b"receipt o-1", tenant="acme").ref
    for a in (starter, worker):
        await a.close()


def _untold(app: tether.App, seen: list[str] | None = None) -> None:
    """``app``'s claims bring no run tenant (``tenant_known`` False, as a store's claim
    of an older release gave it), and its codec remembers none: each is read."""
    import dataclasses

    real = app.store.claim_with_wake

    async def untold(**kw: Any) -> Any:
        tasks, wake = await real(**kw)
        out = [dataclasses.replace(t, tenant=None, tenant_known=False) for t in tasks]
        for t in out:
            app.store.codec.tenants.pop(t.run_id, None)
            if seen is not None:
                seen.append(f"claimed {t.run_id} attempt {t.attempt}")
        return out, wake

    app.store.claim_with_wake = untold  # type: ignore[method-assign]


async def test_a_step_whose_tenant_cannot_be_read_waits_ever_longer_and_says_why(
    store_url: str, tmp_path: Path, keys: FileKeyring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose run tenant could not be read before its attempt was given back to
    run in a second, again and again, without a word on the run. It now waits ever
    longer (from a second, doubling) and the run says why (an engine note), until a
    read succeeds; no attempt is spent."""
    from tether import _worker
    from tether._redact import TAG, engine_made

    monkeypatch.setattr(_worker, "STORE_BLIP_DELAY", 0.1)  # (a second, in a test's time)
    effects: list[str] = []
    starter, worker, flow = _charging(store_url, tmp_path, keys, effects)
    reads: list[str] = []
    _blipping(worker, reads, blips=3)
    _untold(worker)
    real = worker.store.release
    given: list[tuple[float, str | None, str | None]] = []

    async def release(tasks: Any, delay: float = 0.0, **kw: Any) -> Any:
        out = await real(tasks, delay, **kw)
        shown = (await starter.get("r1")).task_error  # what the run says meanwhile
        given.append((delay, kw.get("note"), shown))
        return out

    worker.store.release = release  # type: ignore[method-assign]
    async with (
        starter.worker(poll_interval=0.02, queues=["default"]),
        worker.worker(poll_interval=0.02, queues=["acts"]),
    ):
        run = await starter.start(flow, "o-1", run_id="r1", tenant="acme")
        await run.result(timeout=30)
    assert effects == ["o-1"]
    assert [d for d, _, _ in given] == [0.1, 0.2, 0.4], given
    for _, note, shown in given:
        assert note is not None and note.startswith(TAG), note
        assert "tenant could not be read" in note and "no attempt spent" in note, note
        assert shown == note[len(TAG) :] and engine_made(shown)  # the run says so
    assert (await starter.get("r1")).task_error is None  # the note went with the wait
    for a in (starter, worker):
        await a.close()


async def test_a_step_past_its_deadline_ends_though_its_tenant_cannot_be_read(
    store_url: str, tmp_path: Path, keys: FileKeyring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tenant read came before the step's deadline was checked: a step whose tenant
    could never be read was given back for good, past its schedule-to-close timeout.
    The deadline is checked first now: the step fails with it, its code never run."""
    from tether import _worker

    monkeypatch.setattr(_worker, "STORE_BLIP_DELAY", 0.1)
    effects: list[str] = []

    def make() -> tuple[tether.App, Any]:
        a = tether.App(store=store_url, blobs=str(tmp_path / "blobs"), encryption=keys)

        @a.activity(retry=tether.Retry(attempts=1), queue="acts", schedule_timeout=0.5)
        def charge(order: str) -> str:
            effects.append(order)
            return order

        @a.workflow
        async def flow(order: str) -> str:
            try:
                return await charge(order)
            except tether.ActivityError as exc:
                return exc.error_type

        return a, flow

    starter, flow = make()
    worker, _ = make()
    reads: list[str] = []
    _blipping(worker, reads, blips=10**6)  # never read
    _untold(worker)
    async with (
        starter.worker(poll_interval=0.02, queues=["default"]),
        worker.worker(poll_interval=0.02, queues=["acts"]),
    ):
        run = await starter.start(flow, "o-1", run_id="r1", tenant="acme")
        assert await run.result(timeout=20) == "_StepTimeout"
    assert effects == [] and reads  # tried, then ended by the deadline
    for a in (starter, worker):
        await a.close()


async def test_a_batch_whose_tenant_read_blips_keeps_the_half_open_breakers_trial(
    store_url: str, tmp_path: Path, keys: FileKeyring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch asked its breaker before reading its runs' tenant: a half-open breaker
    let the batch through as its one trial, the read failed and the batch was given
    back, and when it came again the trial was taken (by itself): it failed fast with
    ``CircuitOpenError``. The tenant is read first now: the batch is the trial once it
    can run; it succeeds and the breaker closes."""
    from tether import _worker

    monkeypatch.setattr(_worker, "STORE_BLIP_DELAY", 0.05)
    healthy = {"on": False}
    breaker = tether.CircuitBreaker("dep", failure_ratio=1.0, min_calls=1, cooldown=1.0)

    def make() -> tuple[tether.App, Any]:
        a = tether.App(store=store_url, blobs=str(tmp_path / "blobs"), encryption=keys)

        @a.activity(
            batch=tether.Batch(max_items=4, max_wait=0.05),
            retry=tether.Retry(attempts=1),
            queue="acts",
            breaker=breaker,
        )
        def upper(items: list[str]) -> list[str]:
            if not healthy["on"]:
                raise ConnectionError("upstream 5xx")
            return [i.upper() for i in items]

        @a.workflow
        async def flow(item: str) -> str:
            try:
                return await upper(item)
            except tether.ActivityError as exc:
                return exc.error_type

        return a, flow

    starter, flow = make()
    worker, _ = make()
    _untold(worker)
    order: list[str] = []
    admit = worker.store.breaker_admit

    async def admitting(cfg: dict[str, Any]) -> float | None:
        order.append("admit")
        return await admit(cfg)

    worker.store.breaker_admit = admitting  # type: ignore[method-assign]
    async with (
        starter.worker(poll_interval=0.02, queues=["default"]),
        worker.worker(poll_interval=0.02, queues=["acts"]),
    ):
        first = await starter.start(flow, "a", run_id="r1", tenant="acme")
        assert await first.result(timeout=20) == "ConnectionError"  # the breaker opens
        await asyncio.sleep(1.1)  # half-open: the next call is its trial
        healthy["on"] = True
        reads: list[str] = []
        _blipping(worker, reads, blips=1)
        order.clear()
        second = await starter.start(flow, "b", run_id="r2", tenant="acme")
        assert await second.result(timeout=20) == "B"
    assert order == ["admit"] and reads == ["r2", "r2"], (order, reads)
    for a in (starter, worker):
        await a.close()


async def test_a_claimed_schedule_task_leaves_no_tenant_remembered_for_its_id(
    app: tether.App,
) -> None:
    """A claim remembered the run tenant of every task it returned, a schedule's too:
    its id (``schedule:<id>``) is no run's, so a None tenant was kept for an id a run
    could later be started under, with a tenant (its payloads then sealed under the
    shared key by this process). Only tasks of runs are remembered now."""

    @app.workflow
    async def job() -> str:
        return "ticked"

    await app.schedule("nightly", job, every=1)  # its task claimed in a second
    async with app.worker(poll_interval=0.02):

        async def fired() -> bool:
            return (await app.get_schedule("nightly")).fired >= 1

        await eventually(fired, 15, "the schedule's first tick")
        run = await app.start(job, run_id="r1", tenant="acme")
        assert await run.result(timeout=15) == "ticked"
    tenants = app.store.codec.tenants
    assert "schedule:nightly" not in tenants, tenants
    assert tenants.get("r1") == "acme"


SLOW_PUT = """
import asyncio, sys, threading, time
import tether
from tether.encryption import FileKeyring

store, blobs, keys = sys.argv[1:4]
ring = FileKeyring(keys)
left = threading.Event()
put = []


def make():
    a = tether.App(store=store, blobs=blobs, encryption=ring)

    @a.activity(timeout=0.3, retry=tether.Retry(attempts=1), queue="acts")
    def slow(text: str) -> tether.Blob:
        left.wait(30)  # outlives its timeout and the worker
        put.append(tether.put_blob(text.encode()))
        return put[-1]

    @a.workflow
    async def flow(text: str) -> str:
        try:
            await slow(text)
        except tether.ActivityError:
            return "timed out"
        return "done"

    return a, flow


async def main():
    starter, flow = make()
    worker, _ = make()  # no tenant cached for the activity's run
    async with starter.worker(poll_interval=0.02, queues=["default"]):
        async with worker.worker(poll_interval=0.02, queues=["acts"]):
            run = await starter.start(flow, "doc", run_id="r", tenant="acme")
            print(await run.result(timeout=30), flush=True)
    await starter.close()
    await worker.close()


loop = asyncio.new_event_loop()
loop.run_until_complete(main())
# the worker's loop has stopped (not closed): the abandoned attempt puts its blob now
left.set()
deadline = time.monotonic() + 20
while not put and time.monotonic() < deadline:
    time.sleep(0.05)
print("put" if put else "not put", flush=True)
"""


def test_a_sync_activity_left_by_its_timeout_puts_a_blob_after_its_worker_stopped(
    tmp_path: Path, keys: FileKeyring
) -> None:
    """A sync attempt abandoned at its timeout that called ``put_blob`` after its
    worker's loop stopped waited without end for a tenant read on that loop (and the
    process for its thread at exit). Its tenant is known from the claim now: the blob
    is put and the process exits."""
    import os
    import subprocess
    import sys

    script = tmp_path / "slow_put.py"
    script.write_text(SLOW_PUT)
    src = Path(tether.__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            f"sqlite:///{tmp_path / 's.db'}",
            str(tmp_path / "blobs"),
            str(keys.path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["timed", "out", "put"], done.stdout + done.stderr


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
