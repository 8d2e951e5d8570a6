"""Durable entities: one object per key, operations applied one at a time and recorded
with the state they leave; no update lost or doubled across worker processes, a SIGKILL
mid-operation, continue-as-new boundaries and concurrent callers."""

from __future__ import annotations

import asyncio
import importlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tether

HERE = Path(__file__).parent


@pytest.fixture
def entity_app(store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """tests/entity_app.py on this test's store (and destination table)."""
    monkeypatch.setenv("TETHER_TEST_STORE", store_url)
    monkeypatch.setenv("ENTITY_DESTINATION", str(tmp_path / "destination.db"))
    sys.path.insert(0, str(HERE))
    try:
        import entity_app

        module = importlib.reload(entity_app)
    finally:
        sys.path.remove(str(HERE))
    yield module
    if module.app._store is not None:
        module.app.store.close_sync()


async def test_operations_state_and_listing(entity_app: Any) -> None:
    app: tether.App = entity_app.app
    counter = app.entity_ref(entity_app.Counter, "c1")
    with pytest.raises(tether.UpdateRejectedError, match="known: add, get"):
        await counter.call("reset")
    assert await app.list() == []  # refused before anything was recorded
    async with app.worker(poll_interval=0.05):
        assert [await counter.call("add", 2) for _ in range(10)] == list(range(2, 22, 2))
        assert await counter.call("get") == 20
        await counter.signal("add", 1)
        for _ in range(200):
            if (await counter.state())["value"] == 21:
                break
            await asyncio.sleep(0.02)
        assert (await counter.state()) == {"value": 21}
        await app.entity_ref("Counter", "c2").call("add", 5)
    assert sorted(await app.entities(entity_app.Counter)) == ["c1", "c2"]
    # ops_per_run=7: twelve operations crossed a continue-as-new boundary
    chain = [r.run_id for r in await app.list(workflow="entity:Counter") if "c1" in r.run_id]
    assert len(chain) >= 2
    with pytest.raises(tether.ConfigurationError, match="no entity 'Nope'"):
        app.entity_ref("Nope", "x")
    with pytest.raises(tether.ConfigurationError, match="async"):

        @app.entity
        class Bad:
            async def op(self) -> None:
                return None


def _workers(store_url: str, destination: Path, n: int) -> list[subprocess.Popen[bytes]]:
    env = {
        **os.environ,
        "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}",
        "TETHER_TEST_STORE": store_url,
        "ENTITY_DESTINATION": str(destination),
    }
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tether.cli", "worker", "entity_app:app", "--lease", "2"],
            cwd=HERE,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(n)
    ]


def _stop(workers: list[subprocess.Popen[bytes]]) -> None:
    for w in workers:
        if w.poll() is None:
            w.terminate()
    for w in workers:
        try:
            w.wait(30)
        except subprocess.TimeoutExpired:
            w.kill()


def test_a_hundred_concurrent_operations_from_three_workers_one_killed(
    entity_app: Any, store_url: str, tmp_path: Path
) -> None:
    """100 concurrent adds on one key, four client connections, three worker processes,
    one SIGKILLed mid-way: the counter ends at exactly 100, each result seen once."""
    workers = _workers(store_url, tmp_path / "destination.db", 3)
    store = store_url

    async def callers() -> list[int]:
        apps = [entity_app.app] + [tether.App(store=store) for _ in range(3)]
        for a in apps[1:]:  # the same entity registered on each client App
            a.entity(entity_app.Counter, ops_per_run=7)
        try:

            async def one(i: int) -> int:
                ref = apps[i % 4].entity_ref("Counter", "hot")
                out: int = await ref.call("add", 1, timeout=120)
                return out

            calls = [asyncio.create_task(one(i)) for i in range(100)]
            await asyncio.sleep(1.5)
            workers[0].send_signal(signal.SIGKILL)  # mid-way: tasks in flight are lost
            return list(await asyncio.gather(*calls))
        finally:
            for a in apps[1:]:
                await a.close()

    try:
        results = asyncio.run(callers())
    finally:
        _stop(workers)
    assert sorted(results) == list(range(1, 101))  # none lost, none applied twice

    async def final() -> dict[str, Any]:
        app = tether.App(store=store)
        app.entity(entity_app.Counter, ops_per_run=7)
        try:
            state: dict[str, Any] = await app.entity_ref("Counter", "hot").state()
            return state
        finally:
            await app.close()

    assert asyncio.run(final()) == {"value": 100}


def test_out_of_order_duplicated_revisions_never_overwrite_a_newer_one(
    entity_app: Any, store_url: str, tmp_path: Path
) -> None:
    """Revisions 1-30 of one document, each sent twice, shuffled, from concurrent
    callers: the entity keeps the highest, and the destination (with its own fence)
    never takes an older revision after a newer one."""
    destination = tmp_path / "destination.db"
    workers = _workers(store_url, destination, 2)
    offers = [r for r in range(1, 31) for _ in range(2)]
    random.Random(7).shuffle(offers)

    async def send() -> list[bool]:
        ref = entity_app.app.entity_ref(entity_app.Document, "doc-9")
        got = await asyncio.gather(
            *(ref.call("offer", "doc-9", r, f"body {r}", timeout=120) for r in offers)
        )
        return list(got)

    async def settle() -> dict[str, Any]:
        ref = entity_app.app.entity_ref(entity_app.Document, "doc-9")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            runs = await entity_app.app.list(workflow="publish", limit=100)
            if runs and all(r.is_finished for r in runs):
                break
            await asyncio.sleep(0.1)
        state: dict[str, Any] = await ref.state()
        return state

    try:
        accepted = asyncio.run(send())
        state = asyncio.run(settle())
    finally:
        _stop(workers)
    assert state == {"revision": 30, "ignored": 60 - sum(accepted)}
    with sqlite3.connect(destination) as conn:
        written = [r for (r,) in conn.execute("SELECT revision FROM writes ORDER BY rowid")]
        (final,) = conn.execute("SELECT revision FROM docs WHERE doc = 'doc-9'").fetchone()
    assert final == 30
    assert written == sorted(set(written))  # strictly increasing: never an older one


async def test_a_key_with_the_chain_separator_is_refused(entity_app: Any) -> None:
    """'x~1' would name key x's next run (continue-as-new): acting on x's chain, or
    wedging x when used first. Such keys are refused before anything is recorded."""
    app: tether.App = entity_app.app
    for key in ("x~1", "x~", "~"):
        with pytest.raises(tether.ConfigurationError, match="'~'") as caught:
            app.entity_ref(entity_app.Counter, key)
        assert "\n" not in str(caught.value)
    assert await app.list() == []


async def test_state_that_would_not_survive_continue_as_new_fails_its_operation(
    entity_app: Any,
) -> None:
    """A set (or tuple) in the state came back as a list at continue-as-new, and the
    entity broke there. The operation that leaves such a state fails, naming the
    attribute and its type; the run never continues as new with it."""
    app: tether.App = entity_app.app

    @app.entity(ops_per_run=2)
    class Tags:
        def __init__(self) -> None:
            self.tags: list[str] = []
            self.pair: list[int] = [0, 0]

        def add(self, tag: str) -> int:
            if tag not in self.tags:
                self.tags.append(tag)
            return len(self.tags)

        def as_set(self) -> None:
            self.tags = set(self.tags)  # type: ignore[assignment]

        def nested(self) -> None:
            self.pair = [0, {"at": (1, 2)}]  # type: ignore[list-item]

        def undo(self) -> None:
            self.tags = sorted(self.tags)
            self.pair = [0, 0]

    async with app.worker(poll_interval=0.05):
        ref = app.entity_ref(Tags, "t")
        assert await ref.call("add", "a") == 1
        with pytest.raises(tether.UpdateFailedError, match=r"'tags'.*\bset\b"):
            await ref.call("as_set")
        await ref.call("undo")
        with pytest.raises(tether.UpdateFailedError, match=r"'pair'.*\btuple\b"):
            await ref.call("nested")
        await ref.call("undo")
        for tag in "bcdb":  # across continue-as-new boundaries
            await ref.call("add", tag)
        assert await ref.call("add", "e") == 5
        assert await ref.call("add", "a") == 5  # the list came through as a list


async def test_state_right_after_continue_as_new_is_the_new_runs_input(entity_app: Any) -> None:
    """The operation that made the run continue as new returned, and the new run's code
    had not run yet: state() failed with 'its code has not run yet'. It answers with the
    state the run continued with (its input)."""
    app: tether.App = entity_app.app
    counter = app.entity_ref(entity_app.Counter, "can")
    async with app.worker(poll_interval=0.05):
        for _ in range(7):  # ops_per_run=7: the seventh continues as new
            await counter.call("add", 1)
        for _ in range(200):  # wait for the link, not for the next run's code
            if (await app.get(counter.run_id)).run_id != counter.run_id:
                break
            await asyncio.sleep(0.02)
    live = await app.get(counter.run_id)
    assert live.run_id == f"{counter.run_id}~1"
    assert await counter.state() == {"value": 7}
    fresh = await app.start(entity_app.publish, "d", 1, "b")  # no worker: never ran
    with pytest.raises(tether.QueryError) as caught:  # a query says so, once
        await app.query(fresh.run_id, "state")
    assert str(caught.value).count("query") == 1 and "not run yet" in str(caught.value)


async def test_the_limit_of_entities_counts_live_keys(entity_app: Any) -> None:
    """app.entities(limit=N) applied N to every run of the class, the finished links of
    continue-as-new chains too, and then dropped those: live keys went missing."""
    app: tether.App = entity_app.app
    async with app.worker(poll_interval=0.05):
        for key in ("k0", "k1", "k2"):
            for _ in range(8):  # ops_per_run=7: two runs per key, the first finished
                await app.entity_ref(entity_app.Counter, key).call("add", 1)
    assert sorted(await app.entities(entity_app.Counter, limit=3)) == ["k0", "k1", "k2"]
    assert len(await app.entities(entity_app.Counter, limit=2)) == 2
    assert await app.entities(entity_app.Counter, limit=0) == []


def test_a_class_that_cannot_be_made_without_arguments_is_refused(entity_app: Any) -> None:
    """Its first operation failed the key's run for good, with a message that hid why."""
    app: tether.App = entity_app.app

    class NeedsArg:
        def __init__(self, start: int) -> None:
            self.value = start

        def get(self) -> int:
            return self.value

    with pytest.raises(tether.ConfigurationError, match=r"NeedsArg.*__init__.*start"):
        app.entity(NeedsArg)
    with pytest.raises(tether.ConfigurationError, match="no entity 'NeedsArg'"):
        app.entity_ref("NeedsArg", "k")


async def test_unknown_entities_and_static_or_class_methods_are_refused(entity_app: Any) -> None:
    """app.entities('Unknown') answered [] where entity_ref raises; a @staticmethod was
    an operation that always failed and a @classmethod was silently no operation."""
    app: tether.App = entity_app.app
    with pytest.raises(tether.ConfigurationError, match="no entity 'Nope'"):
        await app.entities("Nope")

    class WithStatic:
        @staticmethod
        def helper(x: int) -> int:
            return x

        def get(self) -> int:
            return 1

    class WithClass:
        @classmethod
        def make(cls) -> str:
            return cls.__name__

        def get(self) -> int:
            return 1

    for cls in (WithStatic, WithClass):
        with pytest.raises(tether.ConfigurationError, match=r"helper|make"):
            app.entity(cls)


async def test_an_init_that_raises_is_named_by_the_operation_that_met_it(
    entity_app: Any,
) -> None:
    """An ``__init__`` that raised at run time ended the key's run; the operation waiting
    on it said only "the run ended without a handler", hiding why."""
    app: tether.App = entity_app.app

    class Broken:
        def __init__(self) -> None:
            raise RuntimeError("config missing")

        def get(self) -> int:
            return 1

    app.entity(Broken)
    async with app.worker(poll_interval=0.05):
        with pytest.raises(tether.UpdateRejectedError, match="RuntimeError: config missing"):
            await app.entity_ref(Broken, "k").call("get", timeout=20)
