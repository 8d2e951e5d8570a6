"""Replay checks what a recorded step was asked for, not only its name: a step whose
arguments differ from the recorded ones (a reordered lookup, a loop over a set) is a
divergence, never a silent pairing of one call's result with another call; recorded
random values and ids replay as recorded; a recorded result that no longer fits its type
is a divergence whenever it arrives; divergence messages name their cause."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pydantic
import pytest

import tether
from helpers import eventually
from tether import EventType, RunStatus
from tether.encryption import FileKeyring
from tether.testing import check_history


async def _until_waiting(app: tether.App, run_id: str) -> None:
    async def waiting() -> bool:
        info = await app.get(run_id)
        return any(w.get("kind") == "signal" for w in info.waiting_on or [])

    await eventually(waiting, what="the run waits for its signal")


async def _record(app: tether.App, wf: Any, *args: Any, run_id: str = "r1") -> list[tether.Event]:
    """Run ``wf`` until it waits for its signal ``go``; its history."""
    async with app.worker(poll_interval=0.02):
        await app.start(wf, *args, run_id=run_id)
        await _until_waiting(app, run_id)
    return await app.history(run_id)


def _prices(app: tether.App, swapped: bool) -> tether.Workflow[[], dict[str, float]]:
    @app.activity
    def price(item: str) -> float:
        return {"apple": 1.0, "car": 20000.0}[item]

    @app.workflow(name="order")
    async def order() -> dict[str, float]:
        if swapped:
            c = await price("car")
            a = await price("apple")
        else:
            a = await price("apple")
            c = await price("car")
        await tether.wait_event("go")
        return {"apple": a, "car": c}

    return order


async def test_swapped_lookups_are_a_divergence_naming_step_and_activity(
    store_url: str,
) -> None:
    app = tether.App(store=store_url)
    history = await _record(app, _prices(app, swapped=False))

    v2 = tether.App(store=store_url)
    _prices(v2, swapped=True)
    report = check_history(v2, history)
    assert not report.ok
    msg = report.error or ""
    assert "run 'r1'" in msg and "step 1" in msg and "'price'" in msg
    assert "argument" in msg and "item" in msg
    assert "apple" not in msg and "car" not in msg  # payloads stay out of errors

    # a worker running v2 leaves the run waiting with the error, history untouched
    async with v2.worker(poll_interval=0.02, workflow_retry_delay=0.1):
        await v2.signal("r1", "go")

        async def task_error() -> str | None:
            return (await v2.get("r1")).task_error

        err = await eventually(task_error, what="task_error set")
    assert "NonDeterminismError" in err and "'price'" in err
    assert (await v2.get("r1")).status is RunStatus.RUNNING
    assert len(await v2.history("r1")) == len(history) + 1  # the signal only

    # the code it ran with continues it
    fixed = tether.App(store=store_url)
    _prices(fixed, swapped=False)
    async with fixed.worker(poll_interval=0.02, workflow_retry_delay=0.1):
        out = await fixed.get_run("r1").result(timeout=10)
    assert out == {"apple": 1.0, "car": 20000.0}
    for a in (app, v2, fixed):
        await a.close()


class Item(pydantic.BaseModel):
    name: str
    qty: int = 1


@dataclasses.dataclass
class Box:
    size: float
    tags: list[str]


def _many_shapes(app: tether.App, v2: bool) -> tether.Workflow[[], list[Any]]:
    @app.activity
    def take(
        item: Item, box: Box, meta: dict[str, Any], at: str, ratio: float, note: str | None = None
    ) -> str:
        return "ok"

    @app.activity
    def child_step(x: int) -> int:
        return x

    @app.workflow(name="kid")
    async def kid(spec: dict[str, Any]) -> int:
        return await child_step(len(spec))

    @app.workflow(name="shapes")
    async def shapes() -> list[Any]:
        at = tether.now().isoformat()
        ratio = 1 / 3
        if v2:  # the same calls written another way
            a = await take(
                box=Box(0.1 + 0.2, ["b", "a"]),
                item=Item(name="x"),
                meta={"z": [1, {"q": None, "p": 2}], "a": math.nan},
                at=at,
                ratio=ratio,
                note=None,
            )
            b = await kid({"b": 2, "a": 1})
        else:
            a = await take(
                Item(name="x", qty=1),
                Box(0.1 + 0.2, ["b", "a"]),
                {"a": math.nan, "z": [1, {"p": 2, "q": None}]},
                at,
                ratio,
            )
            b = await kid({"a": 1, "b": 2})
        await tether.wait_event("go")
        return [a, b]

    return shapes


async def test_same_arguments_written_differently_replay(store_url: str) -> None:
    """Key order, keywords for positionals, a default written out, NaN, floats,
    models and dataclasses, the workflow clock: the same values, no divergence."""
    app = tether.App(store=store_url)
    history = await _record(app, _many_shapes(app, v2=False))
    v2 = tether.App(store=store_url)
    _many_shapes(v2, v2=True)
    report = check_history(v2, history)
    assert report.ok, report.diff()
    await app.close()
    await v2.close()


def _kids(app: tether.App, spec: dict[str, Any]) -> tether.Workflow[[], Any]:
    @app.workflow(name="kid")
    async def kid(spec: dict[str, Any]) -> int:
        return len(spec)

    @app.workflow(name="parent")
    async def parent() -> Any:
        n = await kid(spec)
        await tether.wait_event("go")
        return n

    return parent


async def test_a_child_started_with_other_input_is_a_divergence(store_url: str) -> None:
    app = tether.App(store=store_url)
    history = await _record(app, _kids(app, {"a": 1}))
    v2 = tether.App(store=store_url)
    _kids(v2, {"a": 2})
    report = check_history(v2, history)
    assert not report.ok
    assert "'kid'" in (report.error or "") and "input" in (report.error or "")
    await app.close()
    await v2.close()


def _big(app: tether.App, reordered: bool) -> tether.Workflow[[], int]:
    @app.activity
    def measure(doc: dict[str, str]) -> int:
        return sum(len(v) for v in doc.values())

    @app.workflow(name="big")
    async def big() -> int:
        doc = {"a": "x" * 3000, "b": "y" * 3000}
        if reordered:
            doc = {"b": doc["b"], "a": doc["a"]}
        n = await measure(doc)
        await tether.wait_event("go")
        return n

    return big


@pytest.mark.parametrize("encrypted", [False, True], ids=["offloaded", "offloaded+sealed"])
async def test_offloaded_and_sealed_arguments_compare_by_their_content(
    store_url: str, tmp_path: Path, encrypted: bool
) -> None:
    keys = FileKeyring.create(tmp_path / "keys.json") if encrypted else None
    opts: dict[str, Any] = {"blobs": str(tmp_path / "blobs"), "offload_above": 1024}

    app = tether.App(store=store_url, encryption=keys, **opts)
    await _record(app, _big(app, reordered=False))
    await app.close()

    # a restarted worker on the same store, with the dict built in another order
    again = tether.App(store=store_url, encryption=keys, **opts)
    wf = _big(again, reordered=True)
    assert check_history(again, await again.history("r1")).ok
    async with again.worker(poll_interval=0.02):
        await again.signal("r1", "go")
        assert await again.get_run("r1").result(timeout=10) == 6000
    del wf
    await again.close()


_SET_LOOP = """
import os, tether
app = tether.App(store=os.environ["STORE"])

@app.activity
def score(doc: str) -> int:
    return len(doc)

@app.workflow
async def review(docs: list[str]) -> dict[str, int]:
    scores = {}
    for d in set(docs):                 # the order of a set of str changes with the hash seed
        scores[d] = await score(d)
    await tether.wait_event("go")
    return scores
"""

_DRIVE = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
import wf
async def main():
    app = wf.app
    async with app.worker(poll_interval=0.02, workflow_retry_delay=0.1):
        if sys.argv[2] == "start":
            await app.start(wf.review, ["a", "bb", "ccc", "dddd", "eeeee"], run_id="r")
            for _ in range(1000):
                info = await app.get("r")
                if info.waiting_on:
                    break
                await asyncio.sleep(0.02)
        else:
            if sys.argv[2] == "signal":
                await app.signal("r", "go")
            for _ in range(400):
                info = await app.get("r")
                if info.status.value != "running" or (info.task_error and sys.argv[2] == "signal"):
                    break
                await asyncio.sleep(0.05)
    info = await app.get("r")
    print(json.dumps({"status": info.status.value, "output": info.output,
                      "task_error": info.task_error}))
    await app.close()
asyncio.run(main())
"""


def test_a_loop_over_a_set_after_a_restart_with_another_hash_seed_is_caught(
    tmp_path: Path,
) -> None:
    """The same code, no deploy: a worker restart changes the hash seed, so a loop over a
    set of strings schedules its steps in another order. Each result must never be
    paired with another doc's step: the replay stops with a NonDeterminismError."""
    (tmp_path / "wf.py").write_text(textwrap.dedent(_SET_LOOP))
    docs = ["a", "bb", "ccc", "dddd", "eeeee"]

    def order(seed: int) -> list[str]:
        code = f"print(list(set({docs!r})))"
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        return list(json.loads(out.stdout.replace("'", '"')))

    seeds = iter(range(1, 50))
    first = next(seeds)
    second = next(s for s in seeds if order(s) != order(first))

    def run(seed: int, action: str) -> dict[str, Any]:
        env = {**os.environ, "STORE": f"sqlite:///{tmp_path}/t.db", "PYTHONHASHSEED": str(seed)}
        out = subprocess.run(
            [sys.executable, "-c", _DRIVE, str(tmp_path), action],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result

    run(first, "start")
    after = run(second, "signal")
    assert after["status"] == "running", after
    assert "NonDeterminismError" in (after["task_error"] or ""), after
    assert "'score'" in after["task_error"] and "argument" in after["task_error"]
    # with the hash seed it ran with, it continues with every doc's own score
    done = run(first, "finish")
    assert done["status"] == "completed", done
    assert json.loads(done["output"]) == {d: len(d) for d in docs}


async def test_asyncio_wait_done_set_loop_is_caught_and_sorted_loop_replays(
    store_url: str,
) -> None:
    """``asyncio.wait`` returns a set of tasks, whose order is not replay-safe; looping
    over it in the order of the awaitables given is."""

    def register(app: tether.App, safe: bool) -> tether.Workflow[[list[str]], dict[str, int]]:
        @app.activity
        def score(doc: str) -> int:
            return len(doc)

        @app.activity
        def store_score(doc: str, score: int) -> int:
            return score

        @app.workflow(name="review")
        async def review(docs: list[str]) -> dict[str, int]:
            futs = {asyncio.ensure_future(score(d)): d for d in docs}
            done, _ = await asyncio.wait(futs)
            out: dict[str, int] = {}
            for t in [f for f in futs if f in done] if safe else done:
                out[futs[t]] = await store_score(futs[t], t.result())
                if len(out) == 1:
                    await tether.wait_event("go")
            return out

        return review

    docs = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"]
    app = tether.App(store=store_url)
    wf = register(app, safe=True)
    async with app.worker(poll_interval=0.02):
        await app.start(wf, docs, run_id="r1")
        await _until_waiting(app, "r1")
    again = tether.App(store=store_url)  # a restarted worker replays it
    register(again, safe=True)
    async with again.worker(poll_interval=0.02):
        await again.signal("r1", "go")
        out = await again.get_run("r1").result(timeout=10)
    assert out == {d: len(d) for d in docs}
    assert check_history(again, await again.history("r1")).ok
    await app.close()
    await again.close()


def _ids(app: tether.App, extra: bool) -> tether.Workflow[[], dict[str, Any]]:
    @app.activity
    def create_order(order_id: str) -> str:
        return order_id

    @app.activity
    def charge(order_id: str) -> str:
        return order_id

    @app.workflow(name="buy")
    async def buy() -> dict[str, Any]:
        if extra:  # v2: a request id for logs, above the existing id
            str(tether.uuid())
        order_id = str(tether.uuid())
        r = tether.random()
        created = await create_order(order_id)
        await tether.wait_event("pay")
        charged = await charge(order_id)
        return {"created": created, "charged": charged, "r": r}

    return buy


async def test_a_new_uuid_call_above_a_recorded_one_is_a_divergence(store_url: str) -> None:
    app = tether.App(store=store_url)
    wf = _ids(app, extra=False)
    async with app.worker(poll_interval=0.02):
        await app.start(wf, run_id="r1")
        await eventually(
            lambda: _waiting_for(app, "r1", "pay"), what="the run waits for its payment"
        )
    history = await app.history("r1")
    assert any(e.type is EventType.MARKER for e in history)  # recorded
    v2 = tether.App(store=store_url)
    _ids(v2, extra=True)
    report = check_history(v2, history)
    assert not report.ok
    assert "uuid" in (report.error or "")
    # the same code replays the recorded values (a fresh worker, no cache)
    same = tether.App(store=store_url)
    _ids(same, extra=False)
    assert check_history(same, history).ok
    async with same.worker(poll_interval=0.02, cache_size=0):
        await same.signal("r1", "pay")
        out = await same.get_run("r1").result(timeout=10)
    assert out["created"] == out["charged"]
    for a in (app, v2, same):
        await a.close()


async def _waiting_for(app: tether.App, run_id: str, name: str) -> bool:
    info = await app.get(run_id)
    return any(w.get("name") == name for w in info.waiting_on or [])


async def test_a_fork_keeps_the_values_drawn_before_its_fork_point(store_url: str) -> None:
    app = tether.App(store=store_url)

    @app.activity
    def create_order(order_id: str, r: float) -> str:
        return order_id

    @app.activity
    def charge(order_id: str, r: float) -> str:
        return order_id

    @app.workflow
    async def buy() -> dict[str, Any]:
        oid, r = str(tether.uuid()), tether.random()
        created = await create_order(oid, r)
        await tether.wait_event("pay")
        charged = await charge(oid, r)
        later = str(tether.uuid())
        return {"same": created == charged, "id": created, "later": later}

    async with app.worker(poll_interval=0.02):
        run = await app.start(buy, run_id="r")
        await app.signal("r", "pay")
        first = await run.result(timeout=10)
        steps = [e.step for e in await app.history("r") if e.type is EventType.ACTIVITY_SCHEDULED]
        fork = await app.fork("r", at_step=steps[0], new_run_id="f")
        await app.signal("f", "pay")
        forked = await fork.result(timeout=10)
    assert first["same"] and forked["same"]
    assert forked["id"] == first["id"]
    assert forked["later"] != first["later"]  # drawn anew by the fork
    await app.close()


def _legacy_uuid(source: str) -> str:
    """The first ``tether.uuid()`` of a run recorded before values were recorded: derived
    from a seed (``source``, the run id) and the call order."""
    rng = random.Random(int.from_bytes(hashlib.sha256(source.encode()).digest()[:8]))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _old_history(run_id: str, value: str, **started: Any) -> list[tether.Event]:
    rows: list[tuple[str, int | None, dict[str, Any]]] = [
        ("WorkflowStarted", None, {"workflow": "buy", "input": {"args": [], "kwargs": {}}}),
        (
            "ActivityScheduled",
            1,
            {"name": "create_order", "queue": "default", "args": {"args": [value], "kwargs": {}}},
        ),
        ("WorkflowTaskCompleted", None, {"through": 1, "time": 10.0}),
        ("ActivityCompleted", 1, {"attempt": 1, "result": value}),
        ("WorkflowTaskCompleted", None, {"through": 4, "time": 10.1}),
    ]
    rows[0][2].update(started)
    return [
        tether.Event(
            run_id=run_id, seq=seq, type=EventType(t), step=step, data=data, created_at=10.0
        )
        for seq, (t, step, data) in enumerate(rows, start=1)
    ]


async def test_a_history_drawn_before_values_were_recorded_replays_as_it_ran(
    db_path: Path,
) -> None:
    app = tether.App(store=f"sqlite:///{db_path}")
    _ids(app, extra=False)
    # a run of the old code: its id derived from its own run id, nothing recorded
    assert check_history(app, _old_history("old", _legacy_uuid("old"))).ok
    # a fork of it made from now on: seeded by the run it was forked from
    forked = {"forked_from": {"run_id": "old", "at_step": 1}, "seed": "old"}
    assert check_history(app, _old_history("f", _legacy_uuid("old"), **forked)).ok
    # any other value: the arguments are checked
    report = check_history(app, _old_history("old", _legacy_uuid("other")))
    assert not report.ok and "order_id" in (report.error or "")
    await app.close()


class TicketV1(pydantic.BaseModel):
    title: str


class TicketV2(TicketV1):
    priority: int  # a new required field


def _tickets(app: tether.App, priority: bool) -> tether.Workflow[[str], str]:
    def extract(text: str) -> Any:
        return TicketV1(title=text.upper())

    extract.__annotations__["return"] = TicketV2 if priority else TicketV1
    extract_step = app.activity(queue="x")(extract)

    @app.activity
    def file_ticket(title: str) -> str:
        return "filed " + title

    @app.workflow(name="triage")
    async def triage(text: str) -> str:
        t = await extract_step(text)
        return str(await file_ticket(t.title))

    return triage


async def test_a_recorded_result_the_new_type_rejects_is_a_divergence_whenever_it_came(
    store_url: str,
) -> None:
    """A deploy changed an activity's return type so that a recorded result no longer
    validates: whether the result came before the deploy (replayed) or after it (new),
    the run waits for fixed code with its history intact, naming the step and the
    field; it never fails with the validation error."""
    old = tether.App(store=store_url)
    wf = _tickets(old, priority=False)
    async with old.worker(queues=["default"], poll_interval=0.02):
        await old.start(wf, "disk full", run_id="early")  # its result came before the deploy
        await eventually(lambda: _has(old, "early", "extract"), what="scheduled")
    async with old.worker(queues=["x"], poll_interval=0.02):  # the old activity worker
        await eventually(lambda: _completed(old, "early"), what="early result")
    async with old.worker(queues=["default"], poll_interval=0.02):
        await eventually(lambda: _has(old, "early", "file_ticket"), what="early went on")
        await old.start(wf, "disk full", run_id="late")  # its result comes after the deploy
        await eventually(lambda: _has(old, "late", "extract"), what="scheduled")
    async with old.worker(queues=["x"], poll_interval=0.02):  # still draining
        await eventually(lambda: _completed(old, "late"), what="late result")

    new = tether.App(store=store_url)
    _tickets(new, priority=True)
    report = check_history(new, await new.history("early"))
    assert not report.ok and "'extract'" in (report.error or "")
    assert "priority" in (report.error or "") and "DISK" not in (report.error or "")

    async with new.worker(poll_interval=0.02, workflow_retry_delay=0.1):

        async def task_error() -> str | None:
            return (await new.get("late")).task_error

        err = await eventually(task_error, what="task_error set")
    assert "NonDeterminismError" in err and "'extract'" in err and "priority" in err
    assert "DISK" not in err
    assert (await new.get("late")).status is RunStatus.RUNNING

    fixed = tether.App(store=store_url)
    _tickets(fixed, priority=False)
    async with fixed.worker(poll_interval=0.02, workflow_retry_delay=0.1):
        assert await fixed.get_run("late").result(timeout=10) == "filed DISK FULL"
    for a in (old, new, fixed):
        await a.close()


async def _has(app: tether.App, run_id: str, name: str) -> bool:
    return any(e.data.get("name") == name for e in await app.history(run_id))


async def _completed(app: tether.App, run_id: str) -> bool:
    return any(e.type is EventType.ACTIVITY_COMPLETED for e in await app.history(run_id))


def _flow(app: tether.App, version: str) -> tether.Workflow[..., list[str]]:
    @app.activity
    def a() -> str:
        return "A"

    @app.activity
    def b() -> str:
        return "B"

    if version == "needs-arg":

        @app.workflow(name="flow")
        async def flow_arg(customer: str) -> list[str]:
            out = [await a()]
            await tether.wait_event("go")
            return out

        return flow_arg

    @app.workflow(name="flow")
    async def flow() -> list[str]:
        out = [await a()]
        if version == "patched":
            if tether.patched("add-b"):
                out.append(await b())
        elif version == "unpatched":  # the patch call removed while runs hold its marker
            out.append(await b())
        await tether.wait_event("go")
        return out

    return flow


async def test_divergence_messages_name_their_cause_and_the_ways_out(db_path: Path) -> None:
    app = tether.App(store=f"sqlite:///{db_path}")
    history = await _record(app, _flow(app, "patched"))

    # a new required argument: the code fails at once; the TypeError is named
    v2 = tether.App(store=f"sqlite:///{db_path}")
    _flow(v2, "needs-arg")
    msg = check_history(v2, history).error or ""
    assert "WorkflowFailed" in msg and "TypeError" in msg and "customer" in msg, msg

    # a patch call removed too early: the patch is named, and what to keep
    v3 = tether.App(store=f"sqlite:///{db_path}")
    _flow(v3, "unpatched")
    msg = check_history(v3, history).error or ""
    assert "PatchMarker('add-b')" in msg and "tether.deprecate_patch" in msg, msg
    # and every message says how to end or fork a run that should not continue
    assert "tether terminate" in msg and "app.fork('r1', at_step=1)" in msg, msg
    for x in (app, v2, v3):
        await x.close()


async def test_a_child_started_under_another_run_id_is_a_divergence(db_path: Path) -> None:
    def register(app: tether.App, child_id: str) -> tether.Workflow[[], Any]:
        @app.workflow(name="kid")
        async def kid() -> int:
            return 1

        @app.workflow(name="parent")
        async def parent() -> Any:
            n = await kid.options(run_id=child_id)()
            await tether.wait_event("go")
            return n

        return parent

    app = tether.App(store=f"sqlite:///{db_path}")
    history = await _record(app, register(app, "k-1"))
    v2 = tether.App(store=f"sqlite:///{db_path}")
    register(v2, "k-2")
    msg = check_history(v2, history).error or ""
    assert "'k-1'" in msg and "'k-2'" in msg, msg
    same = tether.App(store=f"sqlite:///{db_path}")
    register(same, "k-1")
    assert check_history(same, history).ok
    for a in (app, v2, same):
        await a.close()


async def test_a_fork_replays_steps_whose_arguments_name_the_original_run(db_path: Path) -> None:
    """A fork's copied steps were recorded by the run it came from: arguments made from
    the run's id (an idempotency key) differ in the fork and are not a divergence."""
    app = tether.App(store=f"sqlite:///{db_path}")

    @app.activity
    def charge(key: str) -> str:
        return key

    @app.activity
    def ship(key: str) -> str:
        return key

    @app.workflow
    async def order() -> list[str]:
        charged = await charge(tether.idempotency_key("charge"))
        await tether.wait_event("go")
        return [charged, await ship(tether.idempotency_key("ship"))]

    async with app.worker(poll_interval=0.02):
        run = await app.start(order, run_id="r")
        await app.signal("r", "go")
        assert await run.result(timeout=10) == ["r:charge", "r:ship"]
        fork = await app.fork("r", at_step=1, new_run_id="f")
        assert await fork.result(timeout=10) == ["r:charge", "f:ship"]
    await app.close()


def _flags(app: tether.App, value: Any) -> tether.Workflow[[], Any]:
    @app.activity
    def mark(v: Any, meta: dict[str, Any]) -> str:
        return repr(v)

    @app.workflow(name="flags")
    async def flags() -> Any:
        out = await mark(value, {"on": value})
        await tether.wait_event("go")
        return out

    return flags


@pytest.mark.parametrize(("was", "now"), [(1, True), (True, 1), (0, False), (False, 0.0)])
async def test_a_bool_where_a_number_was_recorded_is_a_divergence(
    store_url: str, was: Any, now: Any
) -> None:
    """``True == 1`` in Python, but an activity given ``True`` is not the call recorded
    with ``1`` (JSON ``true`` vs ``1``): replay must not pair them."""
    app = tether.App(store=store_url)
    history = await _record(app, _flags(app, was))
    same = tether.App(store=store_url)
    _flags(same, was)
    assert check_history(same, history).ok
    v2 = tether.App(store=store_url)
    _flags(v2, now)
    report = check_history(v2, history)
    assert not report.ok
    msg = report.error or ""
    assert "step 1" in msg and "'mark'" in msg and "argument" in msg
    for a in (app, same, v2):
        await a.close()
