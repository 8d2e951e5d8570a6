"""Durable entities: one object per key, operations applied one at a time and recorded
with the state they leave; no update lost or doubled across worker processes, a SIGKILL
mid-operation, continue-as-new boundaries and concurrent callers."""

from __future__ import annotations

import asyncio
import contextlib
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
        for _ in range(1000):
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


async def test_keys_and_schedule_ids_making_run_ids_with_dot_parts_are_refused(
    entity_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entity key or a schedule id names runs (``entity:<Class>:<key>``,
    ``<id>@<tick>``): one with an empty, '.' or '..' part between slashes made a run id
    that a start refuses (URLs resolve such parts away: ``/runs/a/../b`` is
    ``/runs/b``). A new entity or schedule with one is refused, naming the value and
    what is allowed, before anything is recorded; one made by an older version (its
    run or schedule is stored) is still used as itself."""
    app: tether.App = entity_app.app

    @app.workflow
    async def tick() -> str:
        return "ok"

    bad_keys = ("a/../b", "a/./b", "a//b", "a/", "x/..")
    for key in bad_keys:
        with pytest.raises(tether.ConfigurationError) as caught:
            await app.entity_ref(entity_app.Counter, key).call("add", 1, timeout=1)
        text = str(caught.value)
        assert repr(key) in text and "'..'" in text and "\n" not in text, text
    for sid in ("nightly/../x", "./nightly", "/nightly", "a//b", "a/./b"):
        with pytest.raises(tether.ConfigurationError) as caught:
            await app.schedule(sid, tick, every=3600)
        text = str(caught.value)
        assert repr(sid) in text and "'..'" in text, text
    assert await app.list() == [] and await app.schedules() == []
    # fine: dots inside a part, a key's slashes between plain parts, a leading '.' or '/'
    # in a key (its run id starts with the class's name), a schedule id ending in '/'
    await app.schedule("v1.2/nightly/", tick, every=3600, paused=True)
    # made by an older version: still used as itself
    monkeypatch.setattr(importlib.import_module("tether._entities"), "dot_parts", lambda _: False)
    monkeypatch.setattr(importlib.import_module("tether._app"), "dot_parts", lambda _: False)
    await app.schedule("old/../x", tick, every=3600, paused=True)
    old = app.entity_ref(entity_app.Counter, "old/../x")
    async with app.worker(poll_interval=0.05):
        assert await old.call("add", 1) == 1
        monkeypatch.undo()
        assert await old.call("add", 1) == 2
        assert await app.entity_ref(entity_app.Counter, "./a").call("add", 3) == 3
    again = await app.schedule("old/../x", tick, every=1800, paused=True)
    assert again.spec.every == 1800
    assert {s.schedule_id for s in await app.schedules()} == {"old/../x", "v1.2/nightly/"}


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
        for _ in range(1000):  # wait for the link, not for the next run's code
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


def _ledger(app: tether.App, ops_per_run: int) -> type:
    """An entity whose state nests lists and dicts, with operations that change them in
    place and then raise (``fail``), or leave a value JSON would not give back."""

    @app.entity(ops_per_run=ops_per_run)
    class Ledger:
        def __init__(self) -> None:
            self.entries: list[dict[str, Any]] = []
            self.totals: dict[str, Any] = {"sum": 0, "by": {}}

        def add(self, who: str, n: int, fail: bool = False) -> int:
            self.entries.append({"who": who, "n": n})
            self.totals["sum"] += n
            self.totals["by"].setdefault(who, []).append(n)
            if fail:
                self.entries[0]["n"] = -1  # deeper still: an entry that was there before
                self.note = "half done"  # a new attribute
                raise ValueError(f"refused {who} after changing the state")
            return int(self.totals["sum"])

        def leave_a_set(self) -> None:
            self.entries.append({"who": "x", "n": 0})
            self.totals["by"] = {"x": {1, 2}}

        def get(self) -> dict[str, Any]:
            return {"entries": self.entries, "totals": self.totals}

    return Ledger


def _ledger_state(*adds: tuple[str, int]) -> dict[str, Any]:
    by: dict[str, list[int]] = {}
    for who, n in adds:
        by.setdefault(who, []).append(n)
    return {
        "entries": [{"who": who, "n": n} for who, n in adds],
        "totals": {"sum": sum(n for _, n in adds), "by": by},
    }


async def _update_errors(app: tether.App, run_id: str) -> list[str]:
    """The errors recorded for the operations of one run (its ``update`` Markers)."""
    return [
        f"{ev.data['value']['error']['type']}: {ev.data['value']['error']['message']}"
        for ev in await app.history(run_id, follow=False)
        if ev.type is tether.EventType.MARKER
        and ev.data.get("marker") == "update"
        and "error" in ev.data["value"]
    ]


async def test_an_operation_that_raises_changes_nothing(entity_app: Any) -> None:
    """An operation that raised kept every change it made before raising (nested lists and
    dicts changed in place, a new attribute): the caller got the error, and the entity
    went on from a state no operation had left. Now the state is exactly as it was before
    the operation, for call() and signal(), and for an operation that leaves a value JSON
    would not give back (later ones no longer fail until one undoes it)."""
    app: tether.App = entity_app.app
    ledger = _ledger(app, ops_per_run=500)
    ref = app.entity_ref(ledger, "l1")
    async with app.worker(poll_interval=0.05):
        assert await ref.call("add", "ann", 2) == 2
        with pytest.raises(tether.UpdateFailedError, match=r"ValueError.*refused bob"):
            await ref.call("add", "bob", 5, True)
        assert await ref.state() == _ledger_state(("ann", 2))
        assert await ref.call("add", "ann", 1) == 3  # from the state before the failure
        await ref.signal("add", "cid", 7, True)
        # applied in order: this call sees what the signalled operation left
        assert await ref.call("get") == _ledger_state(("ann", 2), ("ann", 1))
        with pytest.raises(tether.UpdateFailedError, match=r"'totals'.*\bset\b"):
            await ref.call("leave_a_set")
        assert await ref.call("add", "dan", 4) == 7  # no operation needed to undo it
        assert await ref.state() == _ledger_state(("ann", 2), ("ann", 1), ("dan", 4))
    # the signalled operation's error is not lost: its run's history records it
    errors = await _update_errors(app, ref.run_id)
    assert len(errors) == 3
    assert errors[1] == "ValueError: refused cid after changing the state"
    # the run says once that it undoes failed operations (a patch marker, for replays)
    patches = [
        ev.data["patch_id"]
        for ev in await app.history(ref.run_id, follow=False)
        if ev.type is tether.EventType.PATCH_MARKER
    ]
    assert patches == ["tether.entity-rollback"]
    from tether.testing import check_history

    report = check_history(app, await app.history(ref.run_id, follow=False))
    assert report.ok, report.diff()  # and it replays as it ran


async def test_operations_that_raise_across_continue_as_new_keep_the_right_state(
    entity_app: Any,
) -> None:
    """Failed operations around continue-as-new boundaries: each run continues with the
    state the successful operations left, also when a failing one came in the same batch
    as the operation that filled the run (applied before it continued as new)."""
    app: tether.App = entity_app.app
    ledger = _ledger(app, ops_per_run=3)
    ref = app.entity_ref(ledger, "l2")
    # recorded before any worker runs: applied in one batch by the first workflow task
    ops = [("a", 1, False), ("b", 2, False), ("c", 3, True), ("d", 4, False), ("e", 5, True)]
    ops += [("f", 6, False), ("g", 7, True)]
    for who, n, fail in ops:
        await ref.signal("add", who, n, fail)
    done = [(who, n) for who, n, fail in ops if not fail]
    async with app.worker(poll_interval=0.05):
        for _ in range(1000):
            with contextlib.suppress(tether.QueryError):
                if await ref.state() == _ledger_state(*done):
                    break
            await asyncio.sleep(0.02)
        assert await ref.state() == _ledger_state(*done)
        for i in range(8):  # one at a time: every other one fails
            fail = i % 2 == 1
            if fail:
                with pytest.raises(tether.UpdateFailedError, match="ValueError"):
                    await ref.call("add", f"x{i}", i, True)
            else:
                await ref.call("add", f"x{i}", i)
                done.append((f"x{i}", i))
            assert await ref.call("get") == _ledger_state(*done)
    chain = [r.run_id for r in await app.list(workflow="entity:Ledger")]
    assert len(chain) >= 3  # crossed continue-as-new boundaries
    assert await ref.state() == _ledger_state(*done)


async def test_an_entity_history_from_before_rollback_replays_as_it_ran(
    entity_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run recorded by the older code (a failed operation kept its changes, and later
    results were computed from them) replays the same with the new code, and keeps that
    behaviour until it continues as new; its next run rolls failed operations back."""
    from tether._entities import _rolls_back
    from tether.testing import check_history

    app: tether.App = entity_app.app
    ledger = _ledger(app, ops_per_run=3)  # successful operations fill a run
    ref = app.entity_ref(ledger, "old")
    monkeypatch.setattr("tether._entities._rolls_back", lambda inst: False)  # the old code
    async with app.worker(poll_interval=0.05):
        assert await ref.call("add", "a", 1) == 1
        with pytest.raises(tether.UpdateFailedError, match="ValueError"):
            await ref.call("add", "b", 2, True)
        assert await ref.call("add", "c", 4) == 7  # computed from b's partial changes
    old = _ledger_state(("a", 1), ("b", 2), ("c", 4))
    old["entries"][0]["n"] = -1
    old["note"] = "half done"
    monkeypatch.setattr("tether._entities._rolls_back", _rolls_back)  # the new code
    assert await ref.state() == old  # replayed by this caller with the new code
    report = check_history(app, await app.history(ref.run_id, follow=False))
    assert report.ok, report.diff()
    async with app.worker(poll_interval=0.05):  # a new worker: replays the run first
        with pytest.raises(tether.UpdateFailedError, match="ValueError"):
            await ref.call("add", "d", 8, True)  # the same run: kept, as it ran before
        assert await ref.call("add", "e", 16) == 31  # fills the run: continues as new
        with pytest.raises(tether.UpdateFailedError, match="ValueError"):
            await ref.call("add", "f", 32, True)  # the next run: rolled back
        assert await ref.call("add", "g", 64) == 95
    assert (await app.get(ref.run_id)).run_id == f"{ref.run_id}~1"
    state = await ref.state()
    assert [e["who"] for e in state["entries"]] == ["a", "b", "c", "d", "e", "g"]
    assert state["totals"]["sum"] == 95


def _register(app: tether.App, ops_per_run: int) -> type:
    @app.entity(ops_per_run=ops_per_run)
    class Register:
        def __init__(self) -> None:
            self.log: list[str] = []

        def put(self, v: str) -> int:  # named to sort after "add"
            self.log = [v]
            return len(self.log)

        def add(self, v: str) -> int:
            self.log.append(v)
            return len(self.log)

    return Register


async def test_operations_recorded_before_the_run_starts_apply_in_arrival_order(
    entity_app: Any,
) -> None:
    """Operations recorded before a run's code first ran (a key's first ones, sent while
    no worker ran, and those carried into each continued run) were applied grouped by
    operation name, alphabetically: put("a"), add("b") left ["a"] where the order the
    store received them leaves ["a", "b"]."""
    app: tether.App = entity_app.app
    reg = _register(app, ops_per_run=3)
    ref = app.entity_ref(reg, "r")
    sent = [("put", "a"), ("add", "b"), ("put", "c"), ("add", "d"), ("add", "e")]
    sent += [("put", "f"), ("add", "g")]
    for op, v in sent:
        await ref.signal(op, v)
    want: list[str] = []
    for op, v in sent:
        want = [v] if op == "put" else [*want, v]
    async with app.worker(poll_interval=0.05):
        for _ in range(1000):
            with contextlib.suppress(tether.QueryError):
                if await ref.state() == {"log": want}:
                    break
            await asyncio.sleep(0.02)
    assert await ref.state() == {"log": want}
    assert (await app.get(ref.run_id)).run_id != ref.run_id  # it continued as new


async def test_an_entity_history_from_before_arrival_order_replays_as_it_ran(
    entity_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose first operations were applied grouped by name (the older code)
    replays the same, and later runs apply in arrival order."""
    from tether.testing import check_history
    from tether.workflow._instance import WorkflowInstance

    app: tether.App = entity_app.app
    reg = _register(app, ops_per_run=4)
    ref = app.entity_ref(reg, "old")

    def one_by_one(self: WorkflowInstance, handlers: dict[str, Any]) -> None:
        for name, handler in handlers.items():  # what the older code did
            self.register_update(name, handler, None)

    register_updates = WorkflowInstance.register_updates
    monkeypatch.setattr(WorkflowInstance, "register_updates", one_by_one)
    for op, v in (("put", "a"), ("add", "b"), ("add", "c")):
        await ref.signal(op, v)  # recorded before the run's code first runs
    async with app.worker(poll_interval=0.05):
        for _ in range(1000):  # applied add b, add c, then put a
            with contextlib.suppress(tether.QueryError):
                if await ref.state() == {"log": ["a"]}:
                    break
            await asyncio.sleep(0.02)
    monkeypatch.setattr(WorkflowInstance, "register_updates", register_updates)
    assert await ref.state() == {"log": ["a"]}  # replayed with the new code, as it ran
    report = check_history(app, await app.history(ref.run_id, follow=False))
    assert report.ok, report.diff()
    async with app.worker(poll_interval=0.05):
        assert await ref.call("add", "d") == 2  # fills the run: continues as new
    assert (await app.get(ref.run_id)).run_id == f"{ref.run_id}~1"
    assert await ref.state() == {"log": ["a", "d"]}
