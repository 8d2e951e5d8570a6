"""The blocking client (``tether.SyncClient``), starts handed to a worker's loop,
``tether.info()`` and the store URLs users already have."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import tether
from helpers import eventually
from tether._history import describe_waiting

HERE = Path(__file__).parent


def test_the_sync_client_has_every_operation_of_the_async_app() -> None:
    ops = {
        name
        for name, fn in inspect.getmembers(tether.App, inspect.iscoroutinefunction)
        if not name.startswith("_")
    }
    blocking = {
        name
        for name, fn in inspect.getmembers(tether.SyncClient, callable)
        if not name.startswith("_") and name != "get_run"
    }
    assert ops == blocking
    for name in ops - {"close"}:
        ours = inspect.signature(getattr(tether.SyncClient, name))
        theirs = inspect.signature(getattr(tether.App, name))
        assert list(ours.parameters) == list(theirs.parameters), name


def _double(app: tether.App) -> tether.Workflow[[int], int]:
    @app.activity
    def times_two(n: int) -> int:
        return 2 * n

    @app.workflow
    async def double(n: int) -> int:
        return await times_two(n)

    return double


async def test_from_a_plain_thread_and_a_pool_with_the_worker_in_this_process(
    app: tether.App, worker: tether.Worker
) -> None:
    double = _double(app)
    client = tether.SyncClient(app)

    def in_thread(n: int) -> tuple[int, str]:
        run = client.start(double, n)
        return run.result(timeout=10), client.get(run.run_id).status.value

    eager = worker.stats["eager_starts"]
    assert await asyncio.to_thread(in_thread, 4) == (8, "completed")
    loop = asyncio.get_running_loop()
    got = await asyncio.gather(*(loop.run_in_executor(None, in_thread, i) for i in range(5)))
    assert got == [(2 * i, "completed") for i in range(5)]
    # handed to the worker's loop: every start took the fast path (stored with its step)
    assert worker.stats["eager_starts"] - eager == 6
    listed = await asyncio.to_thread(client.list, workflow="double")
    assert len(listed) == 6


async def test_without_a_worker_here_the_client_uses_its_own_loop(store_url: str) -> None:
    serving = tether.App(store=store_url)
    _double(serving)
    client_app = tether.App(store=store_url)
    _double(client_app)
    client = tether.SyncClient(client_app)
    try:
        async with serving.worker(poll_interval=0.05):

            def use() -> Any:
                run = client.start("double", 21, run_id="r1")
                again = client.start("double", 21, run_id="r1")  # idempotent by id
                assert again.run_id == run.run_id
                value = run.result(timeout=10)
                history = client.history("r1")
                return value, [e.type for e in history][-1]

            value, last = await asyncio.to_thread(use)
        assert value == 42 and last is tether.EventType.WORKFLOW_TASK_COMPLETED
        with pytest.raises(tether.RunNotFoundError):
            await asyncio.to_thread(client.get, "nope")
    finally:
        await asyncio.to_thread(client.close)
        await serving.close()


async def test_the_sync_client_refuses_to_block_an_event_loop_or_a_workflow(
    app: tether.App, worker: tether.Worker
) -> None:
    client = tether.SyncClient(app)
    with pytest.raises(tether.ConfigurationError, match=r"await app\.get"):
        client.get("x")

    @app.workflow
    async def bad() -> None:
        client.get("x")

    with pytest.raises(tether.WorkflowFailedError, match="workflow code must never block"):
        await (await app.start(bad)).result(timeout=10)


async def test_a_start_from_another_loop_is_handed_to_the_workers_loop(
    app: tether.App, worker: tether.Worker
) -> None:
    double = _double(app)
    eager = worker.stats["eager_starts"]

    def other_loop() -> int:
        async def main() -> int:
            run = await app.start(double, 5)
            return await run.result(timeout=10)

        return asyncio.run(main())

    assert await asyncio.to_thread(other_loop) == 10
    assert worker.stats["eager_starts"] == eager + 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


async def test_a_wsgi_app_starts_a_run_in_one_request_and_gets_it_in_another(
    tmp_path: Path,
) -> None:
    sys.path.insert(0, str(HERE))
    import wsgi_app

    store = f"sqlite:///{tmp_path / 't.db'}"
    worker_app = wsgi_app.build_app(store)
    _ = worker_app.store  # create the store before the server opens it
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}"}
    server = subprocess.Popen(
        [sys.executable, str(HERE / "wsgi_app.py"), store, str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                assert time.monotonic() < deadline, "the WSGI server did not start"
                await asyncio.sleep(0.1)
        async with worker_app.worker(poll_interval=0.05):
            started = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/start?n=7")
            got = await asyncio.to_thread(
                _get, f"http://127.0.0.1:{port}/result?id={started['id']}"
            )
        assert got == {"result": 14}
    finally:
        server.terminate()
        server.wait(10)
        await worker_app.close()


# -- tether.info() ---------------------------------------------------------------------------


async def test_info_tells_a_run_about_itself_and_replays_as_recorded(
    app: tether.App, worker: tether.Worker
) -> None:
    seen: list[dict[str, Any]] = []

    @app.activity
    def note(d: dict[str, Any]) -> None:
        seen.append(d)

    @app.workflow
    async def kid() -> dict[str, Any]:
        i = tether.info()
        return {"run_id": i.run_id, "parent": i.parent_run_id, "chain": i.chain_id}

    @app.workflow
    async def looped(n: int) -> dict[str, Any]:
        i = tether.info()
        d = {
            "run_id": i.run_id,
            "chain": i.chain_id,
            "workflow": i.workflow,
            "tenant": i.tenant,
            "started": i.started_at.timestamp(),
        }
        await note(d)
        await tether.sleep(0.01)  # a later task: the instance may be replayed
        assert tether.info() == i
        if n < 2:
            tether.continue_as_new(n + 1)
        d["kid"] = await kid.options(run_id="child-of-loop")()
        return d

    run = await app.start(looped, 0, run_id="loop", tenant="acme")
    out = await run.result(timeout=10)
    assert [s["run_id"] for s in seen] == ["loop", "loop~1", "loop~2"]
    assert {s["chain"] for s in seen} == {"loop"}
    assert {s["tenant"] for s in seen} == {"acme"} and {s["workflow"] for s in seen} == {"looped"}
    assert out["kid"] == {"run_id": "child-of-loop", "parent": "loop~2", "chain": "child-of-loop"}
    info = await app.get("loop~2", follow=False)
    assert abs(out["started"] - info.created_at) < 1e-6
    # a fresh replay of the history sees the same values (check_history runs the code)
    from tether.testing import check_history

    assert check_history(app, await app.history("loop~2", follow=False)).ok


def test_info_outside_a_workflow_is_an_error() -> None:
    with pytest.raises(tether.NotInWorkflowError, match="info"):
        tether.info()


# -- store URLs --------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["postgres", "postgresql+psycopg", "postgresql+psycopg2"])
async def test_postgres_urls_in_the_spellings_users_have(pg_schema: str, scheme: str) -> None:
    from conftest import PG_URL, with_schema

    url = with_schema(PG_URL, pg_schema).replace("postgresql://", f"{scheme}://", 1)
    app = tether.App(store=url)
    _double(app)
    async with app.worker(poll_interval=0.05):
        assert await (await app.start("double", 2)).result(timeout=10) == 4
    await app.close()


def test_an_unknown_store_url_names_the_accepted_forms() -> None:
    with pytest.raises(tether.ConfigurationError, match=r"postgresql\+psycopg://"):
        _ = tether.App(store="mysql://x/y").store


# -- waiting made visible --------------------------------------------------------------------


async def test_waiting_on_shows_what_each_live_run_waits_for(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def approval() -> Any:
        return await tether.wait_event("review", timeout=3600)

    @app.workflow
    async def napping() -> None:
        await tether.sleep(3600)

    @app.workflow
    async def parent() -> Any:
        return await napping.options(run_id="nap-kid")()

    @app.workflow
    async def limited() -> None:
        await tether.sleep(3600)

    t0 = time.time()
    await app.start(approval, run_id="a")
    await app.start(napping, run_id="n")
    await app.start(parent, run_id="p")
    app.configure_admission("acme", max_running=1)
    await app.start(limited, run_id="l1", tenant="acme")
    await app.start(limited, run_id="l2", tenant="acme", on_limit="queue")

    async def settled() -> bool:
        infos = {i.run_id: i for i in await app.list()}
        return all(infos[r].waiting_on for r in ("a", "n", "p", "nap-kid", "l2"))

    await eventually(settled, what="every run to wait")
    a = await app.get("a")
    assert a.waiting_on is not None
    (w,) = a.waiting_on
    assert w["kind"] == "signal" and w["name"] == "review"
    assert t0 + 3599 < w["until"] < time.time() + 3601
    (timer,) = (await app.get("n")).waiting_on or []
    assert timer["kind"] == "timer" and timer["until"] > t0 + 3599
    assert (await app.get("p")).waiting_on == [
        {"kind": "child", "workflow": "napping", "run_id": "nap-kid"}
    ]
    assert (await app.get("l2")).waiting_on == [{"kind": "admission", "tenant": "acme"}]
    assert describe_waiting(a.waiting_on).startswith("signal 'review' until ")

    ids = lambda infos: sorted(i.run_id for i in infos)  # noqa: E731
    assert ids(await app.list(waiting_for="signal")) == ["a"]
    assert ids(await app.list(waiting_for="signal:review")) == ["a"]
    assert ids(await app.list(waiting_for="signal:other")) == []
    assert ids(await app.list(waiting_for="timer")) == ["l1", "n", "nap-kid"]
    assert ids(await app.list(waiting_for="child")) == ["p"]
    assert ids(await app.list(waiting_for="admission")) == ["l2"]
    with pytest.raises(tether.ConfigurationError, match="waiting_for"):
        await app.list(waiting_for="nap")

    await app.signal("a", "review", {"ok": True})
    assert await app.get_run("a").result(timeout=10) == {"ok": True}
    assert (await app.get("a")).waiting_on is None  # a finished run waits for nothing


# -- the sync facade from many threads at once ------------------------------------------------


def _wait_until(check: Any, what: str, limit: float = 30.0) -> None:
    """Poll ``check()`` until true (the limit only bounds a broken run, it is not timed)."""
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_app_run_from_a_thread_pool_completes_every_call(store_url: str) -> None:
    app = tether.App(store=store_url)

    @app.activity
    def label(doc: str) -> str:
        return "label:" + doc

    @app.workflow
    async def triage(doc: str) -> str:
        return await label(doc)

    docs = [f"doc{i}" for i in range(12)]
    client = tether.SyncClient(app)
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda d: app.run(triage, d, run_id=d, timeout=60), docs))
        assert got == ["label:" + d for d in docs]
        assert {i.run_id: i.status.value for i in client.list(limit=50)} == {
            d: "completed" for d in docs
        }
    finally:
        client.close()


def _hold_a_run_in_another_thread(
    app: tether.App, pool: ThreadPoolExecutor
) -> tuple[Future[str], threading.Event, tether.Worker]:
    """``app.run`` of a run that holds its worker (on that thread's loop) until the
    returned event is set; returns its future, that event and its worker."""
    holding, gate = threading.Event(), threading.Event()

    @app.activity
    def hold() -> str:
        holding.set()
        gate.wait(60)
        return "held"

    @app.workflow
    async def holder() -> str:
        return await hold()

    ran = pool.submit(app.run, holder, run_id="holder", timeout=60)
    _wait_until(holding.is_set, "the held run to start")
    (worker,) = app._local_workers
    return ran, gate, worker


@pytest.mark.parametrize("via", ["client", "other_loop"])
def test_a_start_handed_to_a_worker_that_stops_meanwhile_completes(
    store_url: str, via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = tether.App(store=store_url)
    double = _double(app)
    client = tether.SyncClient(app)
    store = app.store
    create_run = store.create_run
    in_flight, release = threading.Event(), threading.Event()

    async def slow_create_run(**kw: Any) -> Any:
        if kw["run_id"] == "late":  # held until the worker that took the start stops
            in_flight.set()
            await asyncio.to_thread(release.wait, 60)
        return await create_run(**kw)

    monkeypatch.setattr(store, "create_run", slow_create_run)

    def start_late() -> str:
        if via == "client":
            return client.start(double, 4, run_id="late").run_id

        async def main() -> str:
            return (await app.start(double, 4, run_id="late")).run_id

        return asyncio.run(main())

    try:
        with ThreadPoolExecutor(2) as pool:
            held, gate, worker = _hold_a_run_in_another_thread(app, pool)
            late = pool.submit(start_late)
            _wait_until(in_flight.is_set, "the late start to reach the store")
            gate.set()  # the held run ends, so its app.run stops its worker
            _wait_until(lambda: worker._stopping, "the worker to stop")
            release.set()
            assert held.result() == "held"
            assert late.result() == "late"  # stored (its first step handed back on stop)
        assert client.get("late").status.value == "running"
        assert app.run(double, 4, run_id="late", timeout=60) == 8  # a worker finishes it
    finally:
        release.set()
        client.close()


@pytest.mark.parametrize("via", ["client", "other_loop"])
def test_a_handed_start_cut_short_by_its_loop_is_a_clear_error(
    store_url: str, via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a worker that stops without waiting for a start it was handed (its grace passed:
    # a store slower than that) lets the start be cancelled with its loop
    app = tether.App(store=store_url)
    double = _double(app)
    client = tether.SyncClient(app)
    store = app.store
    create_run = store.create_run
    in_flight, release = threading.Event(), threading.Event()

    async def slow_create_run(**kw: Any) -> Any:
        if kw["run_id"] == "late":
            in_flight.set()
            await asyncio.to_thread(release.wait, 60)
        return await create_run(**kw)

    async def gave_up(self: tether.App, worker: tether.Worker, grace: float) -> None:
        pass

    monkeypatch.setattr(store, "create_run", slow_create_run)
    monkeypatch.setattr(tether.App, "_loans_repaid", gave_up)

    def start_late() -> str:
        if via == "client":
            return client.start(double, 4, run_id="late").run_id
        return asyncio.run(app.start(double, 4, run_id="late")).run_id

    try:
        with ThreadPoolExecutor(2) as pool:
            held, gate, _ = _hold_a_run_in_another_thread(app, pool)
            late = pool.submit(start_late)
            _wait_until(in_flight.is_set, "the late start to reach the store")
            gate.set()
            with pytest.raises(tether.StoreError, match="start it again with the same run_id"):
                late.result()
            release.set()
            assert held.result() == "held"
    finally:
        release.set()
        client.close()


def test_a_sync_result_outlives_the_app_run_of_another_thread(store_url: str) -> None:
    app = tether.App(store=store_url)

    @app.workflow
    async def review() -> Any:
        return await tether.wait_event("ok")

    client = tether.SyncClient(app)
    try:
        with ThreadPoolExecutor(2) as pool:
            held, gate, _ = _hold_a_run_in_another_thread(app, pool)
            run = client.start(review, run_id="review")
            waiting = pool.submit(run.result, 60)
            _wait_until(lambda: "review" in app._waiters, "the result to wait")
            gate.set()
            assert held.result() == "held"  # its worker and loop are gone
            assert not waiting.done()
            client.terminate("review", "enough")
            with pytest.raises(tether.RunTerminatedError, match="enough"):
                waiting.result()
    finally:
        client.close()


def test_a_worker_whose_loop_ended_without_stop_is_not_handed_starts(store_url: str) -> None:
    app = tether.App(store=store_url)
    double = _double(app)

    async def abandon() -> None:
        await app.worker(poll_interval=0.05).start()  # never stopped: its loop just ends

    asyncio.run(abandon())

    async def start() -> str:
        return (await app.start(double, 3, run_id="after")).run_id

    try:
        assert asyncio.run(start()) == "after"  # started here, not on the closed loop
        assert app.run(double, 3, run_id="after", timeout=60) == 6
    finally:
        app._local_workers.clear()
        asyncio.run(app.close())
