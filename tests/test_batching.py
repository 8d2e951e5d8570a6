"""Keyed batching of activity calls (``tether.Batch``): calls from many runs share one
execution of the function, each run gets its own result, and each call stays an
ordinary recorded step (its own retries, failures, idempotency key, crash recovery).

Everything runs on both stores (``app``/``store_url``); the crash and the
two-process tests use worker PROCESSES (``batch_app.py``) that record every item
execution in a side SQLite file."""

from __future__ import annotations

import asyncio
import itertools
import re
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import tether
from tether import EventType
from tether._batch import BatchResultError
from tether._history import Task

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import batch_app  # noqa: E402
from helpers import WorkerProcesses, eventually  # noqa: E402

sys.path.remove(str(HERE))

QUICK = tether.Retry(attempts=3, initial=0.05, max_interval=0.1, jitter=0)


class Calls:
    """The batches a batched activity was called with (thread-safe)."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.started: list[float] = []
        self._lock = threading.Lock()

    def add(self, items: list[Any]) -> int:
        with self._lock:
            self.batches.append(list(items))
            self.started.append(time.time())
            return len(self.batches)

    @property
    def sizes(self) -> list[int]:
        return [len(b) for b in self.batches]


async def _events(app: tether.App, run_id: str, type_: EventType) -> list[tether.Event]:
    return [e for e in await app.history(run_id) if e.type is type_]


# -- options and the calling convention (no store) ---------------------------------


def test_batch_options_are_validated_at_decoration_time() -> None:
    app = tether.App(store="sqlite:///:memory:")
    for bad, match in [
        (dict(max_items=0, max_wait=1), "max_items of tether.Batch must be at least 1"),
        (dict(max_items=2.5, max_wait=1), "max_items of tether.Batch must be an integer"),
        (dict(max_items=True, max_wait=1), "max_items of tether.Batch must be an integer"),
        (dict(max_items=4, max_wait=0), "max_wait of tether.Batch must be a positive"),
        (dict(max_items=4, max_wait=timedelta(0)), "max_wait of tether.Batch must be a positive"),
        (dict(max_items=4, max_wait=-1), "must not be negative"),
        (dict(max_items=4, max_wait="1s"), "number of seconds or a timedelta"),
        (dict(max_items=4, max_wait=1, key="model"), "key of tether.Batch takes a function"),
    ]:
        with pytest.raises(tether.ConfigurationError, match=match):
            tether.Batch(**bad)  # type: ignore[arg-type]
    batch = tether.Batch(max_items=4, max_wait=timedelta(milliseconds=250))
    assert batch.max_wait == 0.25

    with pytest.raises(tether.ConfigurationError, match=r"takes a tether\.Batch"):
        app.activity(batch={"max_items": 4})  # type: ignore[call-overload]

    def two_args(items: list[str], model: str) -> list[str]:
        return items

    def not_a_list(item: str) -> list[str]:
        return [item]

    def returns_dict(items: list[str]) -> dict[str, str]:
        return {}

    for fn, match in [
        (two_args, "must take exactly one argument, the list of items"),
        (not_a_list, "parameter 'item' of batched activity 'not_a_list' must be annotated"),
        (returns_dict, "return type of batched activity 'returns_dict' must be annotated"),
    ]:
        with pytest.raises(tether.ConfigurationError, match=match):
            app.activity(batch=batch)(fn)  # type: ignore[arg-type]

    def fine(items: list[str]) -> list[str]:
        return items

    for opts, match in [
        (dict(dependency=tether.Dependency("llm")), "cannot have a dependency"),
        (dict(limit_key=lambda x: x), "cannot have a limit_key"),
        (dict(priority=3), "cannot have a priority"),
    ]:
        with pytest.raises(tether.ConfigurationError, match=match):
            app.activity(batch=batch, name=f"fine_{len(match)}", **opts)(fine)  # type: ignore[call-overload]
    act = app.activity(batch=batch)(fine)
    with pytest.raises(tether.ConfigurationError, match="cannot have a priority"):
        act.options(priority=1)
    assert isinstance(act.options(queue="other"), tether.BatchActivity)
    assert act.options(queue="other").opts.queue == "other"


async def test_outside_a_workflow_a_batched_activity_runs_with_one_item() -> None:
    app = tether.App(store="sqlite:///:memory:")
    batch = tether.Batch(max_items=8, max_wait=0.1)

    @app.activity(batch=batch)
    def upper(items: list[str]) -> list[str | Exception]:
        return [ValueError(f"bad {s}") if s == "bad" else s.upper() for s in items]

    @app.activity(batch=batch)
    async def lengths(items: list[str]) -> list[int]:
        return [len(s) for s in items]

    @app.activity(batch=batch)
    def broken(items: list[str]) -> list[str]:
        return []

    assert upper("abc") == "ABC"
    with pytest.raises(ValueError, match="bad bad"):
        upper("bad")
    assert await lengths("abcd") == 4
    with pytest.raises(BatchResultError, match=r"'broken' returned 0 result\(s\) for 1 item"):
        broken("x")
    assert upper.sig.param_types == [str]
    assert upper.sig.return_type is str  # the Exception alternative is split off
    assert lengths.sig.return_type is int


# -- batching across runs ------------------------------------------------------------


async def test_twenty_runs_share_a_few_batches_and_each_gets_its_own_result(
    app: tether.App,
) -> None:
    calls = Calls()

    @app.activity(batch=tether.Batch(max_items=5, max_wait=timedelta(seconds=1)))
    async def embed(texts: list[str]) -> list[list[float]]:
        calls.add(texts)
        keys = tether.activity_context().idempotency_keys
        assert len(keys) == len(texts) and len(set(keys)) == len(keys)
        await asyncio.sleep(0.01)
        return [[float(len(t)), float(ord(t[-1]))] for t in texts]

    @app.workflow
    async def index(text: str) -> list[float]:
        return await embed(text)

    texts = [f"doc-{i}" + "x" * i for i in range(20)]
    async with app.worker(poll_interval=0.05):
        runs = await asyncio.gather(*(app.start(index, t) for t in texts))
        results = [await r.result(timeout=30) for r in runs]
    assert results == [[float(len(t)), float(ord(t[-1]))] for t in texts]
    print(f"batch sizes: {calls.sizes}")
    assert sum(calls.sizes) == 20  # every call ran exactly once
    assert all(1 <= n <= 5 for n in calls.sizes)
    assert len(calls.sizes) <= 8  # ceil(20/5) = 4 when everything is quick
    for run in runs:  # each call is an ordinary step of its own run
        scheduled = await _events(app, run.run_id, EventType.ACTIVITY_SCHEDULED)
        completed = await _events(app, run.run_id, EventType.ACTIVITY_COMPLETED)
        assert len(scheduled) == len(completed) == 1
        assert scheduled[0].data["batch"]["key"] == '["embed"]'
        assert completed[0].data["attempt"] == 1


async def test_several_calls_from_one_run_can_share_a_batch(app: tether.App) -> None:
    calls = Calls()

    @app.activity(batch=tether.Batch(max_items=10, max_wait=0.3))
    def square(xs: list[int]) -> list[int]:
        calls.add(xs)
        return [x * x for x in xs]

    @app.workflow
    async def squares(n: int) -> list[int]:
        return await tether.gather(*(square(i) for i in range(n)))

    async with app.worker(poll_interval=0.05):
        run = await app.start(squares, 6)
        assert await run.result(timeout=20) == [0, 1, 4, 9, 16, 25]
    assert calls.sizes == [6]


async def test_a_lone_item_is_flushed_after_max_wait_without_polling(app: tether.App) -> None:
    calls = Calls()
    wait = 0.8

    @app.activity(batch=tether.Batch(max_items=50, max_wait=wait))
    def echo(items: list[str]) -> list[str]:
        calls.add(items)
        return items

    @app.workflow
    async def one(s: str) -> str:
        return await echo(s)

    # a 30 s poll interval: only the worker's wake-up at oldest + max_wait flushes it
    async with app.worker(poll_interval=30.0):
        run = await app.start(one, "alone")
        assert await run.result(timeout=20) == "alone"
    (scheduled,) = await _events(app, run.run_id, EventType.ACTIVITY_SCHEDULED)
    waited = calls.started[0] - scheduled.created_at
    print(f"flushed {waited:.3f}s after it was scheduled (max_wait {wait}s)")
    assert calls.sizes == [1]
    assert waited >= wait - 0.05  # not before max_wait
    assert waited < wait + 2.0  # and not a poll interval later


async def test_time_skipping_env_jumps_to_a_batch_flush() -> None:
    from tether.testing import Env

    app = tether.App(store=":memory:")
    calls = Calls()

    @app.activity(batch=tether.Batch(max_items=10, max_wait=timedelta(hours=1)))
    def upper(xs: list[str]) -> list[str]:
        calls.add(xs)
        return [x.upper() for x in xs]

    @app.workflow
    async def shout(x: str) -> str:
        return await upper(x)

    async with Env(app) as env:
        runs = [await app.start(shout, c) for c in "abc"]
        assert [await r.result(timeout=10) for r in runs] == ["A", "B", "C"]
    assert calls.sizes == [3]
    assert 3600 <= env.skipped < 3700  # the virtual clock went to oldest + max_wait
    await app.close()


async def test_calls_with_different_keys_never_share_a_batch(app: tether.App) -> None:
    calls = Calls()

    @app.activity(
        batch=tether.Batch(max_items=4, max_wait=0.5, key=lambda req: req["model"]),
    )
    def complete(reqs: list[dict[str, str]]) -> list[str]:
        calls.add([r["model"] for r in reqs])
        return [f"{r['model']}:{r['prompt']}" for r in reqs]

    @app.workflow
    async def ask(model: str, prompt: str) -> str:
        return await complete({"model": model, "prompt": prompt})

    jobs = [(m, f"p{i}") for i in range(4) for m in ("small", "large", "vision")]
    async with app.worker(poll_interval=0.05):
        runs = await asyncio.gather(*(app.start(ask, m, p) for m, p in jobs))
        results = [await r.result(timeout=30) for r in runs]
    assert results == [f"{m}:{p}" for m, p in jobs]
    print(f"batches: {calls.batches}")
    assert sum(calls.sizes) == 12
    assert all(len(set(b)) == 1 for b in calls.batches)  # one key per batch
    assert all(len(b) <= 4 for b in calls.batches)
    assert len(calls.batches) <= 6  # 3 keys x 4 calls: 3 batches when quick
    (scheduled,) = await _events(app, runs[1].run_id, EventType.ACTIVITY_SCHEDULED)
    assert scheduled.data["batch"]["key"] == '["complete","large"]'


async def test_a_batch_that_raises_fails_every_item_by_its_own_retry_policy(
    app: tether.App,
) -> None:
    calls = Calls()

    @app.activity(batch=tether.Batch(max_items=6, max_wait=1.0))
    def flaky(items: list[int]) -> list[int]:
        if calls.add(items) == 1:
            raise ConnectionError("embedding service unavailable")
        return [i * 10 for i in items]

    @app.workflow
    async def call(i: int, attempts: int) -> str:
        step = flaky.options(retry=tether.Retry(attempts=attempts, initial=0.05, jitter=0))
        try:
            return str(await step(i))
        except tether.ActivityError as exc:
            return f"failed: {exc}"

    async with app.worker(poll_interval=0.05):
        runs = await asyncio.gather(*(app.start(call, i, 1 if i % 2 else 3) for i in range(6)))
        results = [await r.result(timeout=30) for r in runs]
    first = set(calls.batches[0])
    print(f"batches: {calls.batches}; results: {results}")
    for i, (run, result) in enumerate(zip(runs, results, strict=True)):
        retries = await _events(app, run.run_id, EventType.ACTIVITY_ATTEMPT_FAILED)
        if i not in first:
            assert result == str(i * 10) and not retries
        elif i % 2:  # attempts=1: its own policy allows no retry
            assert result.startswith("failed:") and "unavailable" in result
            assert not retries
            (failed,) = await _events(app, run.run_id, EventType.ACTIVITY_FAILED)
            assert failed.data["attempt"] == 1
        else:  # attempts=3: retried in a later batch, then done
            assert result == str(i * 10)
            assert [e.data["attempt"] for e in retries] == [1]
            assert retries[0].data["error"]["type"] == "ConnectionError"
            (done,) = await _events(app, run.run_id, EventType.ACTIVITY_COMPLETED)
            assert done.data["attempt"] == 2
    assert first & {1, 3, 5} and first & {0, 2, 4}, "the first batch should mix both kinds"
    letters = await app.dead_letters()
    assert {dl.run_id for dl in letters} == {runs[i].run_id for i in first if i % 2}


async def test_an_exception_in_the_results_fails_only_that_item(app: tether.App) -> None:
    calls = Calls()

    @app.activity(batch=tether.Batch(max_items=4, max_wait=0.5), retry=QUICK)
    async def parse(docs: list[str]) -> list[int | Exception]:
        calls.add(docs)
        return [ValueError(f"cannot parse {d!r}") if d == "bad" else len(d) for d in docs]

    @app.workflow
    async def parse_one(doc: str) -> str:
        try:
            return str(await parse(doc))
        except tether.ActivityError as exc:
            return f"failed: {exc}"

    docs = ["a", "bb", "bad", "dddd"]
    async with app.worker(poll_interval=0.05):
        runs = await asyncio.gather(*(app.start(parse_one, d) for d in docs))
        results = [await r.result(timeout=30) for r in runs]
    print(f"batches: {calls.batches}")
    assert results[:2] == ["1", "2"] and results[3] == "4"
    assert results[2].startswith("failed:") and "cannot parse 'bad'" in results[2]
    bad = runs[2].run_id
    retries = await _events(app, bad, EventType.ACTIVITY_ATTEMPT_FAILED)
    (failed,) = await _events(app, bad, EventType.ACTIVITY_FAILED)
    assert [e.data["attempt"] for e in retries] == [1, 2]  # its own policy: 3 attempts
    assert failed.data["attempt"] == 3 and failed.data["error"]["type"] == "ValueError"
    for run in (runs[0], runs[1], runs[3]):
        assert not await _events(app, run.run_id, EventType.ACTIVITY_ATTEMPT_FAILED)
    assert sum(b.count("bad") for b in calls.batches) == 3
    assert sum(calls.sizes) == 6  # 3 good items once, the bad one 3 times


async def test_a_result_of_the_wrong_length_fails_every_item_at_once(app: tether.App) -> None:
    @app.activity(batch=tether.Batch(max_items=3, max_wait=0.5), retry=QUICK)
    def lossy(items: list[str]) -> list[str]:
        return items[:-1]

    @app.workflow
    async def call(s: str) -> str:
        try:
            return await lossy(s)
        except tether.ActivityError as exc:
            return str(exc)

    async with app.worker(poll_interval=0.05):
        runs = await asyncio.gather(*(app.start(call, s) for s in "xyz"))
        results = [await r.result(timeout=30) for r in runs]
    for run, message in zip(runs, results, strict=True):
        assert "batched activity 'lossy' returned" in message
        got = re.search(r"returned (\d+) result\(s\) for (\d+) item\(s\); expected (\d+)", message)
        assert got is not None, message
        assert int(got[1]) + 1 == int(got[2]) == int(got[3])
        (failed,) = await _events(app, run.run_id, EventType.ACTIVITY_FAILED)
        assert failed.data["attempt"] == 1  # a programming error: never retried
        assert failed.data["error"]["type"] == "BatchResultError"
        assert not failed.data["error"]["retryable"]


async def test_a_batch_is_one_call_for_worker_slots_and_queue_limits(app: tether.App) -> None:
    calls = Calls()
    spans: list[tuple[float, float]] = []
    app.configure_queue("one_at_a_time", max_concurrency=1)

    @app.activity(batch=tether.Batch(max_items=6, max_wait=0.5), queue="one_at_a_time")
    def work(items: list[int]) -> list[int]:
        calls.add(items)
        started = time.monotonic()
        time.sleep(0.2)
        spans.append((started, time.monotonic()))
        return items

    @app.workflow
    async def one(i: int) -> int:
        return await work(i)

    # 3 slots, a cap of 1 running task on the queue: batches of up to 6 still run,
    # one at a time
    async with app.worker(concurrency=3, poll_interval=0.05):
        runs = await asyncio.gather(*(app.start(one, i) for i in range(12)))
        assert [await r.result(timeout=30) for r in runs] == list(range(12))
    print(f"batch sizes with 3 worker slots and max_concurrency=1: {calls.sizes}")
    assert sum(calls.sizes) == 12
    assert max(calls.sizes) > 3  # more items than slots, more than the cap: one call
    assert all(n <= 6 for n in calls.sizes)
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # never two at once


async def test_concurrent_claims_never_put_a_task_in_two_batches(store_url: str) -> None:
    """Two Apps (separate connection pools) claim the same batch key concurrently."""
    apps = [tether.App(store=store_url) for _ in range(2)]
    for a in apps:

        @a.activity(name="racing", queue="racing", batch=tether.Batch(max_items=4, max_wait=0.01))
        def racing(items: list[int]) -> list[int]:
            return items

        @a.workflow(name="race")
        async def race(i: int) -> int:
            return await racing(i)

    app = apps[0]
    # only the workflow queue is served: the activity tasks pile up unclaimed
    async with app.worker(queues=["default"], poll_interval=0.05):
        await asyncio.gather(*(app.start(race, i) for i in range(60)))

        async def piled() -> bool:
            stats = {s.queue: s for s in await app.queue_stats()}
            return "racing" in stats and stats["racing"].ready == 60

        await eventually(piled, timeout=30, what="60 ready batched tasks")
    await asyncio.sleep(0.05)  # past max_wait: every group is due

    async def claimer(a: tether.App, name: str) -> list[Task]:
        got: list[Task] = []
        for _ in range(20):
            tasks, _ = await a.store.claim_with_wake(
                worker_id=name, queues=["racing"], limit=6, lease=60.0
            )
            got += tasks
            await asyncio.sleep(0)
        return got

    claims = await asyncio.gather(
        *(claimer(a, f"w{i}-{j}") for i, a in enumerate(apps) for j in range(3))
    )
    tasks = [t for c in claims for t in c]
    ids = [t.task_id for t in tasks]
    assert len(ids) == len(set(ids)) == 60  # every task leased once, none twice
    by_batch: dict[int, list[int]] = {}
    for t in tasks:
        assert t.batch_id is not None
        by_batch.setdefault(t.batch_id, []).append(t.task_id)
    assert all(1 <= len(b) <= 4 for b in by_batch.values())
    for a in apps:
        await a.close()


# -- worker processes: crash recovery and competition -----------------------------------


@pytest.fixture
def side(tmp_path: Path) -> Path:
    path = tmp_path / "side.db"
    batch_app.init_side(str(path))
    return path


def _effects(side: Path) -> list[tuple[str, int, str, int, int]]:
    conn = sqlite3.connect(side, timeout=30)
    try:
        rows = conn.execute("SELECT run_id, step, batch, size, pid FROM effects").fetchall()
        return [(r, int(s), b, int(n), int(p)) for r, s, b, n, p in rows]
    finally:
        conn.close()


def _ready(side: Path) -> int:
    conn = sqlite3.connect(side, timeout=30)
    try:
        return int(conn.execute("SELECT count(*) FROM ready").fetchone()[0])
    finally:
        conn.close()


def _alive(workers: WorkerProcesses) -> None:
    for p in workers.procs:
        if p.poll() is not None and p.returncode != -signal.SIGKILL:
            err = p.stderr.read().decode() if p.stderr else ""
            raise AssertionError(f"worker process exited with {p.returncode}:\n{err}")


@pytest.fixture
def processes(store_url: str, side: Path) -> Iterator[dict[str, WorkerProcesses]]:
    made = {
        mode: WorkerProcesses(HERE / "batch_app.py", store_url, str(side), mode)
        for mode in ("crash", "share")
    }
    yield made
    for w in made.values():
        w.stop_all()


async def test_sigkill_mid_batch_reruns_only_the_unrecorded_items(
    app: tether.App, side: Path, processes: dict[str, WorkerProcesses]
) -> None:
    flow = batch_app.register(app, str(side), "crash")
    runs = [await app.start(flow, i, run_id=f"b{i}") for i in range(30)]
    workers = processes["crash"]
    first = workers.start(1)[0]
    try:
        # the second step's batches have written their effects and sleep for 1 s:
        # kill the worker in the middle of them
        async def mid_second_step() -> bool:
            _alive(workers)
            return sum(1 for _, step, *_ in _effects(side) if step == 2) >= 10

        await eventually(mid_second_step, timeout=60, what="second-step batches to start")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    recorded: set[tuple[str, int]] = set()
    for run in runs:
        for ev in await _events(app, run.run_id, EventType.ACTIVITY_COMPLETED):
            assert ev.step is not None
            recorded.add((run.run_id, ev.step))
    before: dict[tuple[str, int], int] = {}
    for run_id, step, *_ in _effects(side):
        before[(run_id, step)] = before.get((run_id, step), 0) + 1
    unrecorded = set(before) - recorded
    assert recorded and unrecorded, (len(recorded), len(unrecorded))

    workers.start(1)  # the same worker id: it takes the dead one's tasks back at once
    for i, run in enumerate(runs):
        try:
            assert await run.result(timeout=60) == 8 * i
        except tether.ResultTimeoutError:
            _alive(workers)
            raise
    after: dict[tuple[str, int], int] = {}
    for run_id, step, *_ in _effects(side):
        after[(run_id, step)] = after.get((run_id, step), 0) + 1
    print(
        f"recorded before the kill: {len(recorded)}, ran but unrecorded: {len(unrecorded)}, "
        f"items in all: {len(after)}"
    )
    assert len(after) == 90  # every step of every run ran
    for key in recorded:
        assert after[key] == before[key] == 1, key  # recorded: never again
    for key in unrecorded:
        assert after[key] >= 2, key  # ran, lost with the process, ran again
    assert all(size <= batch_app.MAX_ITEMS for *_, size, _ in _effects(side))


async def test_two_worker_processes_never_run_an_item_twice(
    app: tether.App, side: Path, processes: dict[str, WorkerProcesses]
) -> None:
    flow = batch_app.register(app, str(side), "share")
    workers = processes["share"]
    workers.start(2)

    async def both_ready() -> bool:
        _alive(workers)
        return _ready(side) >= 2

    await eventually(both_ready, timeout=60, what="2 worker processes")
    runs = await asyncio.gather(*(app.start(flow, i) for i in range(40)))
    for i, run in enumerate(runs):
        assert await run.result(timeout=120) == 8 * i
    effects = _effects(side)
    items = [(r, s) for r, s, *_ in effects]
    pids = {p for *_, p in effects}
    sizes: dict[str, int] = {}
    for _, _, batch, size, _ in effects:
        sizes[batch] = size
    print(f"{len(sizes)} batches over {len(pids)} processes; sizes {sorted(sizes.values())}")
    assert len(items) == len(set(items)) == 120  # each item ran exactly once
    assert all(n <= batch_app.MAX_ITEMS for n in sizes.values())
    assert len(pids) == 2
