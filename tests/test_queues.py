"""Queue limits shared by every worker: concurrency caps, rate limits, per-key caps,
fairness between limit keys, priorities, pauses on HTTP 429, and queue statistics.

Cross-process limits are checked with three worker PROCESSES (``queue_app.py``)
that record every activity execution in a side SQLite file; everything runs on
both stores (the ``app``/``store_url`` fixtures)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tether
from tether._queues import QueueLimits
from tether.store.ops import queues as ops_queues
from tether.store.ops._tx import _Tx

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import queue_app  # noqa: E402
from helpers import WorkerProcesses  # noqa: E402

sys.path.remove(str(HERE))


async def _until(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool], timeout: float, what: str
) -> None:
    """Poll ``check`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.02)


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at t comes before a start at t)."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = now = 0
    for _, delta in points:
        now += delta
        peak = max(peak, now)
    return peak


def test_peak_overlap() -> None:
    assert peak_overlap([]) == 0
    assert peak_overlap([(0, 1), (1, 2)]) == 1  # touching, not overlapping
    assert peak_overlap([(0, 3), (1, 2), (1.5, 4), (3.5, 5)]) == 3


# -- worker processes -------------------------------------------------------------


@pytest.fixture
def side(tmp_path: Path) -> Path:
    path = tmp_path / "side.db"
    queue_app.init_side(str(path))
    return path


@pytest.fixture
def spawn(store_url: str, side: Path) -> Iterator[Callable[[int], list[subprocess.Popen[bytes]]]]:
    workers = WorkerProcesses(HERE / "queue_app.py", store_url, str(side))
    yield workers.start
    workers.stop_all()


def _execs(side: Path, queue: str) -> list[tuple[int, int, float, float]]:
    conn = sqlite3.connect(side, timeout=30)
    try:
        rows = conn.execute(
            "SELECT i, pid, started, ended FROM execs WHERE queue = ? ORDER BY started", (queue,)
        ).fetchall()
        return [(int(i), int(pid), float(s), float(e)) for i, pid, s, e in rows]
    finally:
        conn.close()


def _ready(side: Path) -> int:
    conn = sqlite3.connect(side, timeout=30)
    try:
        return int(conn.execute("SELECT count(*) FROM ready").fetchone()[0])
    finally:
        conn.close()


async def _start_workers(
    spawn: Callable[[int], list[subprocess.Popen[bytes]]], side: Path, n: int
) -> list[subprocess.Popen[bytes]]:
    """Start ``n`` worker processes and wait until each serves (so all compete)."""
    procs = spawn(n)

    def ready() -> bool:
        _alive(procs)
        return _ready(side) >= n

    await _until(ready, 60, f"{n} worker processes to start")
    return procs


def _alive(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is not None:
            err = p.stderr.read().decode() if p.stderr else ""
            raise AssertionError(f"worker process exited with {p.returncode}:\n{err}")


async def test_concurrency_cap_holds_across_three_worker_processes(
    app: tether.App, side: Path, spawn: Callable[[int], list[subprocess.Popen[bytes]]]
) -> None:
    flows = queue_app.register(app, str(side))
    procs = await _start_workers(spawn, side, 3)
    await asyncio.gather(*(app.start(flows["capped"], i) for i in range(60)))

    def done() -> bool:
        _alive(procs)
        return len(_execs(side, "capped")) >= 60

    await _until(done, 90, "60 capped activities")
    execs = _execs(side, "capped")
    assert sorted(i for i, *_ in execs) == list(range(60))  # each ran once
    peak = peak_overlap([(s, e) for _, _, s, e in execs])
    pids = {pid for _, pid, _, _ in execs}
    print(f"peak concurrency {peak} (cap {queue_app.CAP}) across {len(pids)} processes")
    assert peak <= queue_app.CAP
    # each process has 2 slots (6 in all): reaching the cap took all three processes
    assert peak >= queue_app.CAP - 1
    assert len(pids) == 3


async def test_rate_limit_holds_across_three_worker_processes(
    app: tether.App, side: Path, spawn: Callable[[int], list[subprocess.Popen[bytes]]]
) -> None:
    # the figure: 20/s over 10 s lets through 200 +- the burst (5)
    window = 10.0
    backlog = 300  # more than the window can let through: the limit, not the work, binds
    flows = queue_app.register(app, str(side))
    procs = await _start_workers(spawn, side, 3)
    await asyncio.gather(*(app.start(flows["rated"], i) for i in range(backlog)))

    async def first() -> bool:
        _alive(procs)
        return bool(_execs(side, "rated"))

    await _until(first, 60, "the first rated activity")
    t0 = _execs(side, "rated")[0][2]
    # the rated queue as the store sees it, through the window: (when, ready, tokens)
    samples: list[tuple[float, int, float]] = []
    while time.time() < t0 + window + 0.3:
        _alive(procs)
        (rated,) = [q for q in await app.queue_stats() if q.queue == "rated"]
        samples.append((time.time(), rated.ready, float(rated.tokens or 0.0)))
        await asyncio.sleep(0.1)
    execs = _execs(side, "rated")
    starts = [s for _, _, s, _ in execs if s <= t0 + window]
    expected = queue_app.RATE * window
    pids = {pid for _, pid, _, _ in execs}
    # the steady rate, after the initial burst has been spent
    steady = [s for s in starts if s > t0 + 1.0]
    # a bucket seen full (tokens untaken) says a loaded machine started fewer than the
    # limiter offered: what it refilled then spilled, and the lower bound forgives it
    full = [(t, tokens >= queue_app.BURST - 1e-6) for t, _, tokens in samples if t <= t0 + window]
    spilled = sum(b - a for (a, fa), (b, fb) in itertools.pairwise(full) if fa and fb)
    print(
        f"{len(starts)} starts in {window}s (expected {expected:.0f} + burst "
        f"{queue_app.BURST:.0f}); {len(steady) / (window - 1.0):.1f}/s after the first "
        f"second; {len(pids)} processes; bucket full (tokens untaken) {spilled:.1f}s"
    )
    # the claim: never more than the rate and the burst, whichever process starts them
    assert len(starts) <= expected + queue_app.BURST + 2
    assert len(steady) <= queue_app.RATE * (window - 1.0) + 2
    # nor much fewer than it offers, less what spilled from a full bucket while a starved
    # machine left its tokens untaken. That forgiveness would also hide a claim that
    # grants only from a full bucket or loses fractional tokens (the bucket fills then
    # too): test_token_bucket_arithmetic_on_a_fake_clock guards that arithmetic exactly
    spill = queue_app.RATE * spilled
    assert len(starts) >= expected - queue_app.BURST - spill, f"bucket full {spilled:.1f}s"
    # the work outlasted the window: the limit bound it, not the backlog running dry
    assert samples[-1][1] > 0 and len(execs) < backlog
    assert len(pids) >= 2


# -- in-process: fairness, priorities, per-key caps, 429 pauses --------------------


async def test_fair_queue_starts_a_small_tenant_within_the_first_rounds(
    app: tether.App,
) -> None:
    starts: list[tuple[str, int]] = []
    lock = threading.Lock()

    def define(queue: str, fair: bool) -> tether.Workflow[[str, int], int]:
        app.configure_queue(queue, fair=fair)

        @app.activity(
            name=f"tenant_step_{queue}", queue=queue, limit_key=lambda tenant, *a, **k: tenant
        )
        async def tenant_step(tenant: str, i: int) -> int:
            with lock:
                starts.append((tenant, i))
            await asyncio.sleep(0.01)
            return i

        @app.workflow(name=f"bulk_{queue}")
        async def bulk(tenant: str, n: int) -> int:
            return len(await tether.gather(*(tenant_step(tenant, i) for i in range(n))))

        return bulk

    results = {
        f"tenants_{'fair' if f else 'fifo'}": define(f"tenants_{'fair' if f else 'fifo'}", f)
        for f in (True, False)
    }

    async with app.worker(queues=["default"], poll_interval=0.05):
        for fair in (True, False):
            queue = f"tenants_{'fair' if fair else 'fifo'}"
            await app.start(results[queue], "big", 2000)

            async def depth(n: int, q: str = queue) -> bool:
                return any(s.queue == q and s.ready == n for s in await app.queue_stats())

            await _until(lambda: depth(2000), 60, f"2000 queued tasks on {queue}")
            await app.start(results[queue], "small", 5)
            await _until(lambda: depth(2005), 30, f"2005 queued tasks on {queue}")

            starts.clear()
            async with app.worker(queues=[queue], concurrency=2, poll_interval=0.05):
                await _until(lambda: len(starts) >= 12, 30, "12 starts")
            first = [t for t, _ in starts[:10]]
            print(f"fair={fair}: first 10 starts by tenant {first}")
            if fair:
                # every claim round takes each tenant's next task: small's 5 go in 5 rounds
                assert first.count("small") == 5
                assert [i for t, i in starts if t == "small"][:5] == [0, 1, 2, 3, 4]
            else:
                assert first.count("small") == 0  # FIFO: stuck behind 2000 older tasks


@pytest.mark.parametrize("configured", [False, True], ids=["plain", "limited"])
async def test_priorities_order_work_on_a_single_slot(app: tether.App, configured: bool) -> None:
    queue = "prio_limited" if configured else "prio_plain"
    if configured:
        app.configure_queue(queue, max_concurrency=10)
    order: list[tuple[int, int]] = []
    priorities = [0, 5, 1, 9, 3, 7, 0, 2, -1, 4, 9]

    @app.activity(queue=queue)
    async def job(p: int, i: int) -> int:
        order.append((p, i))
        await asyncio.sleep(0.005)
        return p

    @app.workflow
    async def prioritised() -> list[int]:
        return await tether.gather(
            *(job.options(priority=p)(p, i) for i, p in enumerate(priorities))
        )

    async with app.worker(queues=["default"], poll_interval=0.05):
        run = await app.start(prioritised)

        async def queued() -> bool:
            return any(s.queue == queue and s.ready == 11 for s in await app.queue_stats())

        await _until(queued, 30, "11 queued jobs")
        async with app.worker(queues=[queue], concurrency=1, poll_interval=0.05):
            assert await run.result(timeout=30) == priorities
    # highest first (equal priorities: oldest first, which is the same instant here)
    assert [p for p, _ in order] == sorted(priorities, reverse=True)


async def test_key_concurrency_caps_each_limit_key(app: tether.App) -> None:
    app.configure_queue("keyed", key_concurrency=2)
    lock = threading.Lock()
    spans: dict[str, list[tuple[float, float]]] = {}

    @app.activity(queue="keyed", limit_key=lambda tenant, *a, **k: tenant)
    async def step(tenant: str, i: int) -> int:
        start = time.monotonic()
        await asyncio.sleep(0.05)
        with lock:
            spans.setdefault(tenant, []).append((start, time.monotonic()))
        return i

    @app.workflow
    async def fan() -> int:
        calls = [step(t, i) for t in ("a", "b", "c") for i in range(6)]
        return len(await tether.gather(*calls))

    async with app.worker(concurrency=20, poll_interval=0.02):
        run = await app.start(fan)
        assert await run.result(timeout=30) == 18
    peaks = {k: peak_overlap(v) for k, v in spans.items()}
    overall = peak_overlap([s for v in spans.values() for s in v])
    print(f"peak per key {peaks}, overall {overall}")
    assert all(p <= 2 for p in peaks.values()), peaks
    assert max(peaks.values()) == 2
    assert overall > 2  # other keys ran meanwhile: the cap is per key, not per queue


class Http429(Exception):
    """Looks like an httpx/requests error for status 429 with a Retry-After header."""

    def __init__(self, retry_after: str) -> None:
        super().__init__("429 Too Many Requests")
        self.status_code = 429
        self.headers = {"Retry-After": retry_after}


@pytest.mark.parametrize("pause_on_429", [True, False], ids=["pause", "no_pause"])
async def test_http_429_with_retry_after_pauses_the_whole_queue(
    app: tether.App, pause_on_429: bool
) -> None:
    app.configure_queue("api", max_concurrency=1, pause_on_429=pause_on_429)
    attempts: list[tuple[int, int, float]] = []
    failed_at: list[float] = []

    @app.activity(queue="api", retry=tether.Retry(attempts=3))
    async def call_api(i: int) -> int:
        attempts.append((i, tether.activity_context().attempt, time.time()))
        if not failed_at:
            failed_at.append(time.time())
            raise Http429("1.5")
        await asyncio.sleep(0.01)
        return i

    @app.workflow
    async def calls(n: int) -> list[int]:
        return await tether.gather(*(call_api(i) for i in range(n)))

    async with app.worker(poll_interval=0.05):
        run = await app.start(calls, 8)
        await _until(lambda: bool(failed_at), 30, "the 429")
        if pause_on_429:

            async def paused() -> bool:
                stats = {s.queue: s for s in await app.queue_stats()}
                return stats["api"].paused_until is not None

            await _until(paused, 5, "the queue to show its pause")
        assert await run.result(timeout=30) == list(range(8))
    t429 = failed_at[0]
    later = [t for _, _, t in attempts if t > t429]
    assert len(attempts) == 8 + 1  # one retry, no attempt burned during the pause
    events = await app.history(run.run_id)
    failure = next(e for e in events if e.type is tether.EventType.ACTIVITY_ATTEMPT_FAILED)
    gap = min(later) - t429
    print(f"pause_on_429={pause_on_429}: next start {gap:.2f}s after the 429")
    if pause_on_429:
        assert gap >= 1.5 - 0.01  # nothing of the queue started during the pause
        until = failure.data["error"]["queue_paused_until"]
        assert t429 + 1.5 <= until <= t429 + 3.0
    else:
        assert gap < 1.0  # other tasks went ahead; only the throttled one waited
        assert "queue_paused_until" not in failure.data["error"]
    assert failure.data["error"]["retry_after"] == 1.5


# -- pause, resume, statistics -----------------------------------------------------


async def test_pause_and_resume_queue_and_stats(app: tether.App) -> None:
    app.configure_queue("jobs", max_concurrency=3, rate=1, per=60, burst=4, key_concurrency=2)
    ran: list[int] = []

    @app.activity(queue="jobs")
    async def job(i: int) -> int:
        ran.append(i)
        return i

    @app.workflow
    async def three() -> list[int]:
        return await tether.gather(job(0), job(1), job(2))

    await app.pause_queue("jobs", 60)
    stats = {s.queue: s for s in await app.queue_stats()}
    jobs = stats["jobs"]
    assert jobs.configured and jobs.max_concurrency == 3 and jobs.key_concurrency == 2
    assert jobs.rate == pytest.approx(1 / 60) and jobs.burst == 4
    assert jobs.tokens == pytest.approx(4)
    assert jobs.paused_until is not None and jobs.paused_until > time.time() + 50
    async with app.worker(poll_interval=0.05):
        run = await app.start(three)

        async def queued() -> bool:
            return any(s.queue == "jobs" and s.ready == 3 for s in await app.queue_stats())

        await _until(queued, 10, "3 queued jobs")
        await asyncio.sleep(0.3)
        assert ran == []  # paused: nothing starts
        stats = {s.queue: s for s in await app.queue_stats()}
        assert stats["jobs"].oldest_ready_age is not None and stats["jobs"].oldest_ready_age > 0
        await app.resume_queue("jobs")
        assert sorted(await run.result(timeout=10)) == [0, 1, 2]
    jobs = {s.queue: s for s in await app.queue_stats()}["jobs"]
    assert jobs.paused_until is None and jobs.ready == 0 and jobs.running == 0
    assert jobs.tokens == pytest.approx(1, abs=0.1)  # 3 of 4 tokens spent (1 a minute back)


@pytest.mark.parametrize(
    "limits", [{}, {"max_concurrency": 5, "rate": 100}], ids=["open_dependency", "limited"]
)
async def test_a_paused_queue_holds_its_dependency_work(
    app: tether.App, limits: dict[str, Any]
) -> None:
    # every tether.ai model call carries a dependency: pausing its queue must hold it
    svc = tether.Dependency("svc", **limits)
    ran: list[str] = []

    @app.activity(queue="llm", dependency=svc)
    async def call(i: int) -> int:
        ran.append(f"call{i}")
        return i

    @app.activity(queue="llm")
    async def plain(i: int) -> int:
        ran.append(f"plain{i}")
        return i

    @app.workflow
    async def flow() -> int:
        return sum(await tether.gather(plain(0), *(call(i) for i in range(3))))

    async with app.worker(poll_interval=0.05, concurrency=8):
        await app.pause_queue("llm", 60)
        run = await app.start(flow)

        async def queued() -> bool:
            return any(s.queue == "llm" and s.ready == 4 for s in await app.queue_stats())

        await _until(queued, 10, "4 queued calls")
        await asyncio.sleep(0.5)
        assert ran == []  # paused: neither the plain call nor the dependency's start
        await app.resume_queue("llm")
        assert await run.result(timeout=10) == 3
    assert sorted(ran) == ["call0", "call1", "call2", "plain0"]


async def test_a_queue_rate_limit_holds_for_dependency_work(app: tether.App) -> None:
    # both limits apply: the queue's bucket (2 tokens, then 2 a minute) binds first
    app.configure_queue("metered", rate=2, per=60, burst=2)
    svc = tether.Dependency("svc", max_concurrency=10)
    ran: list[int] = []

    @app.activity(queue="metered", dependency=svc)
    async def call(i: int) -> int:
        ran.append(i)
        return i

    @app.workflow
    async def flow() -> int:
        return sum(await tether.gather(*(call(i) for i in range(5))))

    async with app.worker(poll_interval=0.05, concurrency=8):
        await app.start(flow)
        await _until(lambda: len(ran) >= 2, 10, "the first 2 calls")
        await asyncio.sleep(0.5)
        assert len(ran) == 2
        metered = {s.queue: s for s in await app.queue_stats()}["metered"]
        assert metered.ready == 3 and metered.tokens is not None and metered.tokens < 0.1


async def test_reconfiguring_keeps_the_live_token_bucket(store_url: str) -> None:
    a = tether.App(store=store_url)
    a.configure_queue("q", rate=1, per=60, burst=10)  # refills 1 a minute: stays put
    stats = {s.queue: s for s in await a.queue_stats()}
    assert stats["q"].tokens == pytest.approx(10)
    b = tether.App(store=store_url)  # another process with the same config
    b.configure_queue("q", rate=1, per=60, burst=10)

    @b.activity(queue="q")
    async def noop(i: int) -> int:
        return i

    @b.workflow
    async def four() -> list[int]:
        return await tether.gather(*(noop(i) for i in range(4)))

    async with b.worker(poll_interval=0.05):
        assert await (await b.start(four)).result(timeout=10) == [0, 1, 2, 3]
    tokens = {s.queue: s for s in await a.queue_stats()}["q"].tokens
    assert tokens == pytest.approx(6, abs=0.2)
    c = tether.App(store=store_url)
    c.configure_queue("q", rate=1, per=60, burst=10)
    async with c.worker():  # a worker starting writes its config: the bucket is kept
        pass
    assert {s.queue: s for s in await c.queue_stats()}["q"].tokens == pytest.approx(6, abs=0.2)
    c.configure_queue("q", rate=1, per=60, burst=3)  # a smaller bucket caps what is left
    assert {s.queue: s for s in await c.queue_stats()}["q"].tokens == pytest.approx(3)
    for x in (a, b, c):
        await x.close()


def insert_tasks(tx: _Tx, n: int) -> None:
    """``n`` ready activity tasks on the queue ``rated`` (a backlog for claims to take)."""
    for i in range(n):
        tx.execute(
            "INSERT INTO tasks (run_id, kind, step, queue, name, available_at, created_at) "
            "VALUES (?, 'activity', 1, 'rated', 'tick', 0, 0)",
            (f"r{i}",),
        )


async def test_a_claim_with_an_older_clock_cannot_mint_extra_tokens(store_url: str) -> None:
    """A claim whose ``now`` is older than the bucket's last refill (its host's clock
    lags, or it waited for the queue's row lock) must not move the refill time back:
    the next claim would be credited that interval again."""
    app = tether.App(store=store_url)
    store = app.store
    clock = [1000.0]
    store.clock = lambda: clock[0]

    await store.configure_queue("rated", {"rate": 1.0, "burst": 10.0})
    await store._do(insert_tasks, 40)  # type: ignore[attr-defined]

    async def claim(at: float, limit: int) -> int:
        clock[0] = at
        got = await store.claim(worker_id="w", queues=["rated"], limit=limit, lease=60)
        return len(got)

    assert await claim(1000.0, 10) == 10  # the full bucket
    assert await claim(1005.0, 2) == 2  # 5 s refilled 5 tokens; 3 are left
    assert await claim(1001.0, 10) == 3  # a lagging host spends what is left
    # 1 s since the last refill (at 1005) is 1 token, not the 5 s since 1001
    assert await claim(1006.0, 10) == 1
    await app.close()


async def test_token_bucket_arithmetic_on_a_fake_clock(store_url: str) -> None:
    """The claim's token bucket, exactly, without the wall clock: a burst of ``B`` at
    once, then ``floor(tokens)`` per claim as the clock moves, fractions kept across
    claims, never more than ``B`` after an idle spell, and no token lost by a claim
    that asks for fewer than the bucket holds.

    This guards the arithmetic that the process-level rate test can only bound
    loosely (a starved machine starts fewer than the limiter offers); a claim that
    grants only from a full bucket, or drops fractional tokens, fails here."""
    rate, burst = 20.0, 10.0
    app = tether.App(store=store_url)
    store = app.store
    t0 = 1000.0
    clock = [t0]
    store.clock = lambda: clock[0]

    await store.configure_queue("rated", {"rate": rate, "burst": burst})
    await store._do(insert_tasks, 300)  # type: ignore[attr-defined]  # N >> B, always ready

    async def claim(dt: float, limit: int = 100) -> int:
        """Claim at ``t0 + dt`` (the lease outlives the test: no task comes back)."""
        clock[0] = t0 + dt
        got = await store.claim(worker_id="w", queues=["rated"], limit=limit, lease=1e6)
        return len(got)

    async def tokens() -> float:
        (q,) = [s for s in await store.queue_stats() if s.queue == "rated"]
        assert q.tokens is not None
        return q.tokens

    assert await claim(0.0) == 10  # the full bucket at once: B
    assert await claim(0.0) == 0  # and nothing more at the same instant
    assert await claim(0.05) == 1  # 0.05 s at 20/s: 1 token, granted from a bucket of 1
    assert await claim(0.05) == 0
    assert await claim(0.55) == 10  # 0.5 s: 10 tokens
    # fractions accumulate across claims: 0.025 s (half a token) twice is one token
    assert await claim(0.575) == 0
    assert await tokens() == pytest.approx(0.5)
    assert await claim(0.6) == 1
    # ... and survive a grant: 1.5 tokens give 1, the half left joins the next half
    assert await claim(0.675) == 1
    assert await tokens() == pytest.approx(0.5)
    assert await claim(0.7) == 1
    # a long idle spell refills the bucket to B, not rate * idle
    assert await claim(1000.0) == 10
    # a claim asking for fewer than the bucket holds spends only what it takes
    assert await claim(2000.0, limit=3) == 3
    assert await tokens() == pytest.approx(7)
    assert await claim(2000.0) == 7
    # the same with a partly refilled bucket: 0.3 s is 6 tokens, asked for 4 then the rest
    assert await claim(2000.3, limit=4) == 4
    assert await tokens() == pytest.approx(2)
    assert await claim(2000.3) == 2
    assert await claim(2000.3) == 0
    await app.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"rate": float("inf"), "burst": float("inf"), "tokens": float("inf")},
        {"rate": 0.0, "tokens": 0.0},
    ],
    ids=["inf", "zero"],
)
async def test_a_bad_stored_limits_row_skips_only_its_queue(
    app: tether.App, caplog: pytest.LogCaptureFixture, bad: dict[str, float]
) -> None:
    # a row written by an older version (rate=1e308/1e-308 was stored as inf) or by hand:
    # the claim skips that queue, logging why, and keeps serving the others
    ops_queues._bad_logged.clear()  # logged once a minute per limits row
    app.configure_queue("fast", rate=5)

    @app.activity(queue="fast")
    async def fast() -> int:
        return 1

    @app.activity
    async def other() -> int:
        return 2

    @app.workflow
    async def wf_fast() -> int:
        return await fast()

    @app.workflow
    async def wf_other() -> int:
        return await other()

    def corrupt(tx: _Tx) -> None:
        sets = ", ".join(f"{c} = ?" for c in bad)
        tx.execute(f"UPDATE queue_limits SET {sets} WHERE queue = 'fast'", tuple(bad.values()))

    async with app.worker(poll_interval=0.05):  # writes the configured row at start
        await app.store._do(corrupt)  # type: ignore[attr-defined]
        stuck = await app.start(wf_fast)
        await asyncio.sleep(0.3)  # several claims meet the bad row first
        assert await (await app.start(wf_other)).result(timeout=10) == 2
        assert (await app.get(stuck.run_id)).status is tether.RunStatus.RUNNING
    assert "queue 'fast'" in caplog.text and "rate" in caplog.text


# -- configuration errors ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_concurrency": 2.5}, "max_concurrency"),
        ({"max_concurrency": True}, "max_concurrency"),
        ({"max_concurrency": 2**31}, "max_concurrency"),  # a 32-bit column on PostgreSQL
        ({"rate": 0}, "rate"),
        ({"rate": -1}, "rate"),
        ({"rate": float("nan")}, "rate"),
        ({"rate": "10"}, "rate"),
        ({"rate": 10, "per": 0}, "per"),
        ({"rate": 10, "per": -5}, "per"),
        ({"rate": 1e308, "per": 1e-308}, "rate"),  # inf per second
        ({"rate": 1e300}, "rate"),
        ({"rate": 5, "per": 1e300}, "rate"),  # a token every 6e291 years
        ({"burst": 5}, "burst"),  # no rate
        ({"rate": 10, "burst": 0.5}, "burst"),
        ({"key_concurrency": 0}, "key_concurrency"),
        ({"key_concurrency": 10**23}, "key_concurrency"),
        ({"fair": "yes"}, "fair"),
        ({"pause_on_429": 1}, "pause_on_429"),
    ],
)
def test_configure_queue_validates_each_field(kwargs: dict[str, Any], field: str) -> None:
    app = tether.App(store=":memory:")
    with pytest.raises(tether.ConfigurationError, match=field):
        app.configure_queue("q", **kwargs)
    assert app._queue_limits == {}  # nothing half-configured


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"rate": float("nan")}, "rate"),
        ({"rate": 1e308, "per": 1e-308}, "rate"),
        ({"rate": 1, "per": 0}, "per"),
        ({"burst": 5}, "burst"),
    ],
)
def test_dependency_errors_name_the_dependency(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(tether.ConfigurationError, match=f"{field} of dependency 'svc'") as err:
        tether.Dependency("svc", **kwargs)
    assert "dep:" not in str(err.value) and "queue" not in str(err.value)


def test_configure_queue_defaults() -> None:
    app = tether.App(store=":memory:")
    with pytest.raises(tether.ConfigurationError, match="queue name"):
        app.configure_queue("")
    limits = QueueLimits.build("q", rate=120, per=60)
    assert limits.rate == 2 and limits.burst == 2  # default burst: one second's worth
    assert QueueLimits.build("q", rate=0.1).burst == 1  # at least one token
    assert QueueLimits.build("q", rate=5, burst=50).burst == 50
    assert QueueLimits.build("q").pause_on_429 is True


def test_priority_and_limit_key_options_are_validated() -> None:
    app = tether.App(store=":memory:")
    with pytest.raises(tether.ConfigurationError, match="priority"):

        @app.activity(priority=1.5)  # type: ignore[arg-type]
        def a() -> None: ...

    with pytest.raises(tether.ConfigurationError, match="priority"):

        @app.activity(priority=2**40)
        def b() -> None: ...

    with pytest.raises(tether.ConfigurationError, match="limit_key"):

        @app.activity(limit_key="tenant")  # type: ignore[arg-type]
        def c() -> None: ...

    @app.activity(priority=3, limit_key=lambda x: x)
    def d(x: str) -> str:
        return x

    assert d.opts.priority == 3
    assert d.options(priority=-2).opts.priority == -2
    with pytest.raises(tether.ConfigurationError, match="priority"):
        d.options(priority="high")  # type: ignore[arg-type]


async def test_limit_key_and_priority_are_recorded_in_history(app: tether.App) -> None:
    @app.activity(priority=4, limit_key=lambda tenant, n: f"tenant-{tenant}")
    async def work(tenant: str, n: int) -> int:
        return n

    @app.activity(limit_key=lambda tenant: 42)  # type: ignore[arg-type,return-value]
    async def broken(tenant: str) -> int:
        return 0

    @app.workflow
    async def flow() -> int:
        return await work("acme", 3)

    @app.workflow
    async def bad() -> int:
        return await broken("acme")

    async with app.worker(poll_interval=0.05):
        assert await (await app.start(flow)).result(timeout=10) == 3
        failed = await app.start(bad)
        with pytest.raises(tether.WorkflowFailedError, match="must return a string"):
            await failed.result(timeout=10)
    events = await app.history((await app.list(workflow="flow"))[0].run_id)
    scheduled = next(e for e in events if e.type is tether.EventType.ACTIVITY_SCHEDULED)
    assert scheduled.data["priority"] == 4 and scheduled.data["limit_key"] == "tenant-acme"


# -- CLI -------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    # a wide table whatever terminal (or none) the test runner has: rich sizes it
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src"), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "tether.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_cli_queues(app: tether.App, store_url: str) -> None:
    app.configure_queue("llm", max_concurrency=4, rate=2, fair=True)
    await app.pause_queue("llm", 30)
    await app.close()
    done = await asyncio.to_thread(_cli, "queues", "--store", store_url, "--json")
    assert done.returncode == 0, done.stderr
    llm = next(q for q in json.loads(done.stdout) if q["queue"] == "llm")
    assert llm["max_concurrency"] == 4 and llm["rate"] == 2 and llm["fair"] is True
    assert llm["paused_until"] is not None and llm["tokens"] == pytest.approx(2)
    done = await asyncio.to_thread(_cli, "queues", "--store", store_url)
    assert done.returncode == 0, done.stderr
    assert "llm" in done.stdout and "max 4" in done.stdout and "fair" in done.stdout


def test_worker_options_that_would_break_claims_are_refused() -> None:
    """A NaN lease made every claim fail (NOT NULL on the lease's expiry), an infinite
    one would never let a crashed worker's tasks be taken over, and a concurrency past
    what a claim's LIMIT carries overflowed the store; each is refused when made."""
    app = tether.App(store=":memory:")
    for bad in (
        {"lease": float("nan")},
        {"lease": float("inf")},
        {"lease": 0},
        {"poll_interval": float("nan")},
        {"poll_interval": -1},
        {"retention_every": float("inf")},
        {"workflow_retry_delay": float("nan")},
        {"concurrency": 0},
        {"concurrency": 10**20},
    ):
        (name,) = bad
        with pytest.raises(tether.ConfigurationError, match=name):
            app.worker(**bad)
    assert app.worker(lease=0.5, poll_interval=0.01, concurrency=100_000).lease == 0.5


def test_names_and_queues_no_worker_could_serve_are_refused_at_registration() -> None:
    """A queue given as a number was stored as one and never matched the text a worker
    serves (its runs waited for ever); a worker given one queue name as a string served
    its letters; NUL and line breaks in names fail on PostgreSQL mid-commit. Each is
    refused where it is written, naming the field."""
    app = tether.App(store=":memory:")

    async def f(x: int) -> int:
        return x

    for register, bad, field in (
        (app.workflow, {"queue": 5}, "queue of workflow 'f'"),
        (app.activity, {"queue": 5}, "queue of activity 'f'"),
        (app.workflow, {"queue": "a\nb"}, "queue of workflow"),
        (app.workflow, {"name": "a\x00b"}, "workflow name"),
        (app.activity, {"name": "x" * 201}, "activity name"),
        (app.workflow, {"name": ""}, "workflow name"),
    ):
        with pytest.raises(tether.ConfigurationError, match=field):
            register(**bad)(f)  # type: ignore[operator]
    with pytest.raises(tether.ConfigurationError, match="queue name"):
        app.configure_queue("q\x00", max_concurrency=1)
    with pytest.raises(tether.ConfigurationError, match="list of queue names"):
        app.worker(queues="default")  # type: ignore[arg-type]
    with pytest.raises(tether.ConfigurationError, match="queue of the worker"):
        app.worker(queues=["default", 5])  # type: ignore[list-item]
    with pytest.raises(tether.ConfigurationError, match="default queue"):
        tether.App(store=":memory:", queue="")
    assert app.workflows() == [] and app.worker(queues=["default"]).queues == ("default",)
