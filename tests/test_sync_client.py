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
import time
import urllib.request
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
