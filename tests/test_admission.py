"""Admission limits on ``app.start``, dependency limiters with rate-limit feedback, and
debounced starts. Limits that must hold across processes are checked with worker
PROCESSES (``limits_app.py``); everything runs on both stores (``app`` fixture)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import sqlite3
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tether
from tether._classify import classify, parse_reset, ratelimit_pause

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import limits_app  # noqa: E402
from helpers import WorkerProcesses  # noqa: E402

sys.path.remove(str(HERE))


async def _until(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool], timeout: float, what: str
) -> None:
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
    assert peak_overlap([(0, 1), (1, 2)]) == 1
    assert peak_overlap([(0, 2), (1, 3), (1.5, 4)]) == 3


# -- admission limits ---------------------------------------------------------------


async def test_admission_raise_queue_and_fifo_promotion(app: tether.App) -> None:
    """No worker: runs stay in flight, so the counts are exact."""
    app.configure_admission("acme", max_running=2)

    @app.workflow
    async def job(i: int) -> int:
        return i

    a = await app.start(job, 0, tenant="acme", run_id="a")
    b = await app.start(job, 1, tenant="acme", run_id="b")
    with pytest.raises(tether.AdmissionLimitError) as err:
        await app.start(job, 2, tenant="acme", run_id="c")
    assert (err.value.tenant, err.value.limit, err.value.running) == ("acme", 2, 2)
    assert "acme" in str(err.value) and 'on_limit="queue"' in str(err.value)
    with pytest.raises(tether.RunNotFoundError):
        await app.get("c")  # nothing was created
    # idempotent: the same start again returns the existing run, limit or not
    again = await app.start(job, 0, tenant="acme", run_id="a")
    assert again.run_id == a.run_id
    with pytest.raises(tether.RunIdConflictError):
        await app.start(job, 0, tenant="other", run_id="a")
    # another tenant (no limit configured, no default) is not affected
    await app.start(job, 9, tenant="other", run_id="o")
    queued = [
        await app.start(job, i, tenant="acme", run_id=f"q{i}", on_limit="queue") for i in range(3)
    ]
    for q in queued:
        info = await q.info()
        assert info.status is tether.RunStatus.QUEUED and info.tenant == "acme"
    assert (await a.info()).tenant == "acme" and (await a.info()).status is tether.RunStatus.PENDING
    # a queued start of an existing id is idempotent too
    assert (await app.start(job, 0, tenant="acme", run_id="q0", on_limit="queue")).run_id == "q0"

    async def statuses() -> list[str]:
        return [(await app.get(f"q{i}")).status.value for i in range(3)]

    await app.terminate(a.run_id, "make room")
    assert await statuses() == ["pending", "queued", "queued"]  # the oldest, in that commit
    await app.cancel("q2")  # a queued run is cancelled at once: it never started
    assert (await app.get("q2")).status is tether.RunStatus.CANCELLED
    assert await statuses() == ["pending", "queued", "cancelled"]
    await app.terminate(b.run_id, "make room")
    assert await statuses() == ["pending", "pending", "cancelled"]
    with pytest.raises(tether.AdmissionLimitError):
        await app.start(job, 5, tenant="acme", run_id="d")
    # raising the limit admits at once; the default applies to tenants without their own
    app.configure_admission(max_running=1)
    await app.start(job, 1, tenant="fresh", run_id="f1")
    with pytest.raises(tether.AdmissionLimitError) as err2:
        await app.start(job, 2, tenant="fresh", run_id="f2")
    assert err2.value.limit == 1


async def test_queued_run_signals_wait_and_deadline_ends_it(app: tether.App) -> None:
    app.configure_admission("solo", max_running=1)

    @app.workflow
    async def waiter(tag: str) -> str:
        got = await tether.wait_event("go")
        return f"{tag}:{got}"

    async with app.worker(poll_interval=0.05):
        first = await app.start(waiter, "first", tenant="solo")
        second = await app.start(waiter, "second", tenant="solo", on_limit="queue")
        late = await app.start(waiter, "late", tenant="solo", on_limit="queue", deadline=0.3)
        await app.signal(second.run_id, "go", 2)  # kept in its history until it starts
        await asyncio.sleep(0.3)
        assert (await second.info()).status is tether.RunStatus.QUEUED
        with pytest.raises(tether.RunTimedOutError):
            await late.result(timeout=10)  # the deadline passed while it was queued
        with pytest.raises(tether.RunFinishedError):
            await app.signal(late.run_id, "go", 3)
        with pytest.raises(tether.TetherError, match="queued"):
            await app.suspend(second.run_id)
        await app.signal(first.run_id, "go", 1)
        assert await first.result(timeout=10) == "first:1"
        assert await second.result(timeout=10) == "second:2"  # admitted, saw its signal


def test_configure_admission_validates() -> None:
    app = tether.App(store=":memory:")
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(tether.ConfigurationError, match="max_running"):
            app.configure_admission("x", max_running=bad)  # type: ignore[arg-type]
    with pytest.raises(tether.ConfigurationError, match="tenant"):
        app.configure_admission("", max_running=1)


async def test_concurrent_starts_never_overshoot_the_limit(app: tether.App, store_url: str) -> None:
    """40 starts at once from two Apps (two connection pools / writers) on one store."""
    app.configure_admission("t", max_running=5)

    @app.workflow
    async def job(i: int) -> int:
        return i

    other = tether.App(store=store_url)
    other.configure_admission("t", max_running=5)
    other.workflow(job.fn, name="job")
    try:

        async def one(a: tether.App, i: int) -> bool:
            try:
                await a.start("job", i, tenant="t")
                return True
            except tether.AdmissionLimitError:
                return False

        got = await asyncio.gather(*(one(app if i % 2 else other, i) for i in range(40)))
    finally:
        await other.close()
    print(f"admitted {sum(got)} of 40 concurrent starts (limit 5)")
    assert sum(got) == 5
    runs = await app.list(limit=100)
    assert sum(1 for r in runs if r.tenant == "t") == 5


async def test_queued_runs_start_as_others_finish_never_more_than_the_limit(
    app: tether.App,
) -> None:
    app.configure_admission("t1", max_running=3)
    spans: dict[int, tuple[float, float]] = {}

    @app.activity
    async def work(i: int) -> int:
        start = time.time()
        await asyncio.sleep(0.1)
        spans[i] = (start, time.time())
        return i * 10

    @app.workflow
    async def job(i: int) -> int:
        return await work(i)

    runs = [await app.start(job, i, tenant="t1", on_limit="queue") for i in range(12)]
    statuses = [(await r.info()).status for r in runs]
    assert statuses.count(tether.RunStatus.QUEUED) == 9
    async with app.worker(concurrency=10, poll_interval=0.05):
        results = [await r.result(timeout=60) for r in runs]
    assert results == [i * 10 for i in range(12)]
    peak = peak_overlap(list(spans.values()))
    print(f"peak running for tenant t1: {peak} (limit 3, 10 worker slots)")
    assert peak <= 3
    assert peak == 3  # the limit was used, not serialised by accident
    # FIFO: the first three started first; every queued run after all three
    first = sorted(spans, key=lambda i: spans[i][0])
    assert set(first[:3]) == {0, 1, 2}


# -- worker processes ------------------------------------------------------------------


@pytest.fixture
def side(tmp_path: Path) -> Path:
    path = tmp_path / "side.db"
    limits_app.init_side(str(path))
    return path


@pytest.fixture
def spawn(store_url: str, side: Path) -> Iterator[Callable[[int], list[subprocess.Popen[bytes]]]]:
    workers = WorkerProcesses(HERE / "limits_app.py", store_url, str(side))
    yield workers.start
    workers.stop_all()


def _execs(side: Path, kind: str) -> list[tuple[int, str, int, float, float]]:
    conn = sqlite3.connect(side, timeout=30)
    try:
        rows = conn.execute(
            "SELECT i, key, pid, started, ended FROM execs WHERE kind = ? ORDER BY started",
            (kind,),
        ).fetchall()
        return [(int(i), str(k), int(p), float(s), float(e)) for i, k, p, s, e in rows]
    finally:
        conn.close()


async def _start_workers(
    spawn: Callable[[int], list[subprocess.Popen[bytes]]], side: Path, n: int
) -> list[subprocess.Popen[bytes]]:
    procs = spawn(n)

    def ready() -> bool:
        for p in procs:
            if p.poll() is not None:
                err = p.stderr.read().decode() if p.stderr else ""
                raise AssertionError(f"worker process exited with {p.returncode}:\n{err}")
        conn = sqlite3.connect(side, timeout=30)
        try:
            return int(conn.execute("SELECT count(*) FROM ready").fetchone()[0]) >= n
        finally:
            conn.close()

    await _until(ready, 60, f"{n} worker processes to start")
    return procs


async def test_admission_limit_holds_across_two_worker_processes(
    app: tether.App, side: Path, spawn: Callable[[int], list[subprocess.Popen[bytes]]]
) -> None:
    flows = limits_app.register(app, str(side))
    app.configure_admission("t1", max_running=limits_app.ADMIT)
    runs = [await app.start(flows["admit"], i, tenant="t1", on_limit="queue") for i in range(10)]
    await _start_workers(spawn, side, 2)
    for i, r in enumerate(runs):
        assert await r.result(timeout=60) == i
    execs = _execs(side, "admit")
    assert sorted(e[0] for e in execs) == list(range(10))
    peak = peak_overlap([(s, e) for _, _, _, s, e in execs])
    pids = {e[2] for e in execs}
    print(f"peak running for tenant t1: {peak} (limit {limits_app.ADMIT}) over {len(pids)} pids")
    assert peak <= limits_app.ADMIT
    assert peak == limits_app.ADMIT


async def test_dependency_limit_is_shared_by_two_queues_and_processes(
    app: tether.App, side: Path, spawn: Callable[[int], list[subprocess.Popen[bytes]]]
) -> None:
    flows = limits_app.register(app, str(side))
    runs = [await app.start(flows["llm"], "m1", i) for i in range(12)]
    runs += [await app.start(flows["llm"], "m2", 100 + i) for i in range(6)]
    await _start_workers(spawn, side, 2)
    for r in runs:
        await r.result(timeout=60)
    execs = _execs(side, "llm")
    by_model = {m: [(s, e) for _, k, _, s, e in execs if k == m] for m in ("m1", "m2")}
    assert len(by_model["m1"]) == 12 and len(by_model["m2"]) == 6
    peaks = {m: peak_overlap(v) for m, v in by_model.items()}
    total = peak_overlap([(s, e) for _, _, _, s, e in execs])
    print(f"dependency peaks per model {peaks}, both models together {total} (cap 3 each)")
    assert peaks["m1"] <= limits_app.DEP_CAP and peaks["m2"] <= limits_app.DEP_CAP
    assert peaks["m1"] == limits_app.DEP_CAP  # the cap was reached: shared, not serial
    assert total > limits_app.DEP_CAP  # keyed: another model is not held by m1's cap
    # the activities of both queues ran under one limiter
    steps = {
        e.data["name"]
        for r in runs[:12]
        for e in await app.history(r.run_id)
        if e.type is tether.EventType.ACTIVITY_SCHEDULED
    }
    assert steps == {"llm_a", "llm_b"}


async def test_queue_cap_holds_for_dependency_work_across_processes(
    app: tether.App, side: Path, spawn: Callable[[int], list[subprocess.Popen[bytes]]]
) -> None:
    # both limits apply: the queue's cap (2) binds below the dependency's (5)
    flows = limits_app.register(app, str(side))
    run = await app.start(flows["svc"], 12)
    await _start_workers(spawn, side, 2)
    assert await run.result(timeout=60) == sum(range(12))
    execs = _execs(side, "svc")
    assert sorted(e[0] for e in execs) == list(range(12))
    peak = peak_overlap([(s, e) for _, _, _, s, e in execs])
    pids = {e[2] for e in execs}
    print(f"peak {peak} (queue cap {limits_app.QCAP}, dependency cap 5) over {len(pids)} pids")
    assert peak == limits_app.QCAP


# -- dependency feedback -------------------------------------------------------------


class RateLimited(Exception):
    """Looks like an httpx/openai error: a 429 whose response carries rate-limit headers."""

    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__("429 Too Many Requests")
        self.status_code = 429
        self.response = type("Response", (), {"status_code": 429, "headers": headers})()


def test_ratelimit_header_parsing() -> None:
    assert parse_reset("1s") == 1.0
    assert parse_reset("6m0s") == 360.0
    assert parse_reset("20ms") == pytest.approx(0.02)
    assert parse_reset("1h2m3.5s") == pytest.approx(3723.5)
    assert parse_reset("2.5") == 2.5
    assert parse_reset("soon") is None
    exc = RateLimited(
        {
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "2s",
            "x-ratelimit-remaining-tokens": "0",
            "x-ratelimit-reset-tokens": "3s",
        }
    )
    assert ratelimit_pause(exc) == 3.0
    # a wait that is not a finite number is garbage, never a pause that lasts for ever
    for garbage in ("inf", "Infinity", "nan", "1e400"):
        assert parse_reset(garbage) is None
        assert classify(RateLimited({"retry-after": garbage})).retry_after is None
        assert (
            ratelimit_pause(
                RateLimited(
                    {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": garbage}
                )
            )
            is None
        )
    assert classify(RateLimited({"retry-after": "2"})).retry_after == 2.0
    assert (
        ratelimit_pause(
            RateLimited({"x-ratelimit-remaining-requests": "5", "x-ratelimit-reset-requests": "2s"})
        )
        is None
    )
    assert ratelimit_pause(object()) is None


@pytest.mark.parametrize(
    "headers",
    [
        {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1.2s"},
        {"Retry-After": "1.2"},
    ],
    ids=["remaining-0", "retry-after"],
)
async def test_rate_limit_feedback_pauses_the_dependency_not_the_queue(
    app: tether.App, headers: dict[str, str]
) -> None:
    api = tether.Dependency("api", key=lambda i, key: key, max_concurrency=1)
    attempts: list[tuple[int, int, float]] = []
    refused: list[float] = []
    others: list[float] = []

    @app.activity(dependency=api, retry=tether.Retry(attempts=3))
    async def call_api(i: int, key: str) -> int:
        attempts.append((i, tether.activity_context().attempt, time.time()))
        if not refused:
            refused.append(time.time())
            raise RateLimited(headers)
        await asyncio.sleep(0.01)
        return i

    @app.activity
    async def local_work(i: int) -> int:
        others.append(time.time())
        return i

    @app.workflow
    async def calls(n: int) -> list[int]:
        return await tether.gather(*(call_api(i, "k1") for i in range(n)))

    @app.workflow
    async def unrelated(n: int) -> list[int]:
        out = []
        for i in range(n):
            out.append(await local_work(i))
            await tether.sleep(0.1)
        return out

    async with app.worker(concurrency=8, poll_interval=0.05):
        run = await app.start(calls, 6)
        await _until(lambda: bool(refused), 30, "the 429")
        side_run = await app.start(unrelated, 4)  # same queue, no dependency
        assert await side_run.result(timeout=30) == list(range(4))
        assert await run.result(timeout=30) == list(range(6))
    t429 = refused[0]
    later = [t for _, _, t in attempts if t > t429]
    print(
        f"{headers}: next dependency attempt {min(later) - t429:.2f}s after the 429; "
        f"{len(attempts)} attempts for 6 steps"
    )
    assert len(attempts) == 6 + 1  # only the refused attempt was spent
    assert min(later) - t429 >= 1.2 - 0.02  # every waiting step waited out the pause
    # the queue itself was not paused: unrelated work ran during the pause
    assert any(t429 < t < t429 + 1.1 for t in others)
    failure = next(
        e
        for e in await app.history(run.run_id)
        if e.type is tether.EventType.ACTIVITY_ATTEMPT_FAILED
    )
    until = failure.data["error"]["dependency_paused_until"]
    assert t429 + 1.15 <= until <= t429 + 3.0
    assert "queue_paused_until" not in failure.data["error"]


@dataclasses.dataclass
class Reply:
    """A returned object carrying the provider's response headers."""

    i: int
    headers: dict[str, str]


async def test_success_with_exhausted_budget_pauses_the_dependency(app: tether.App) -> None:
    quota = tether.Dependency("quota", max_concurrency=1)
    starts: list[float] = []

    @app.activity(dependency=quota)
    async def ask(i: int) -> Reply:
        starts.append(time.time())
        left = "0" if len(starts) == 1 else "10"
        return Reply(i, {"x-ratelimit-remaining-tokens": left, "x-ratelimit-reset-tokens": "800ms"})

    @app.workflow
    async def asks(n: int) -> list[int]:
        replies = await tether.gather(*(ask(i) for i in range(n)))
        return [r.i for r in replies]

    async with app.worker(concurrency=4, poll_interval=0.05):
        run = await app.start(asks, 4)
        assert await run.result(timeout=30) == list(range(4))
    assert len(starts) == 4
    gap = starts[1] - starts[0]
    print(f"next call {gap:.2f}s after the reply that emptied the token budget")
    assert gap >= 0.8 - 0.02  # every waiting call waited for the reset
    assert all(b - a < 0.6 for a, b in itertools.pairwise(starts[1:]))


# -- debounce ----------------------------------------------------------------------------


async def test_debounce_collapses_20_triggers_into_one_run_with_the_last_input(
    app: tether.App,
) -> None:
    seen: list[int] = []

    @app.workflow
    async def reindex(n: int) -> int:
        seen.append(n)
        return n

    async with app.worker(poll_interval=0.05):
        handles = [
            await app.start_debounced(reindex, i, key="doc-1", window=0.5) for i in range(20)
        ]
        assert len({h.run_id for h in handles}) == 1
        assert await handles[0].result(timeout=30) == 19
        other = await app.start_debounced(reindex, 7, key="doc-2", window=0.2)
        assert await other.result(timeout=30) == 7
        # a trigger after the run started opens a new burst: a new run
        later = await app.start_debounced(reindex, 42, key="doc-1", window=0.2)
        assert later.run_id != handles[0].run_id
        assert await later.result(timeout=30) == 42
    runs = await app.list(workflow="reindex", limit=100)
    assert len(runs) == 3
    assert sorted(seen) == [7, 19, 42]


async def test_debounce_max_wait_bounds_a_steady_stream(app: tether.App) -> None:
    """On a virtual clock moved by hand (wall-clock pacing made the burst's edges
    depend on the machine's speed): a trigger every second with a 4 s window never
    leaves a quiet window, yet the run starts 8 s (``max_wait``) after the first
    trigger, with the last input before then; the next trigger opens a new burst."""
    from tether.testing import Env

    @app.workflow
    async def flush(n: int) -> int:
        return n

    async def trigger(n: int) -> tether.Run[int]:
        return await app.start_debounced(flush, n, key="k", window=4, max_wait=8)

    async with Env(app, skip_time=False) as env:
        first = await trigger(0)
        for i in range(1, 8):  # t = 1 .. 7: each trigger pushes the window on
            await env.advance(1)
            assert (await trigger(i)).run_id == first.run_id
            assert await app.list(workflow="flush") == []  # best effort: not yet due
        await env.advance(1)  # t = 8: max_wait since the first trigger
        assert await first.result(timeout=30) == 7
        second = await trigger(8)  # a trigger after the run started: a new burst
        assert second.run_id != first.run_id
        await env.advance(4)
        assert await second.result(timeout=30) == 8
    assert len(await app.list(workflow="flush")) == 2


def test_debounce_validates() -> None:
    app = tether.App(store=":memory:")

    @app.workflow
    async def wf(n: int) -> int:
        return n

    async def go(**kw: Any) -> None:
        await app.start_debounced(wf, 1, **kw)

    for kw in (
        {"key": "", "window": 1},
        {"key": "k", "window": 0},
        {"key": "k", "window": 1, "max_wait": 0},
    ):
        with pytest.raises(tether.ConfigurationError):
            asyncio.run(go(**kw))


async def test_a_queued_run_cancelled_while_admission_waits_for_its_row_stays_cancelled(
    pg_schema: str,
) -> None:
    """PostgreSQL: admission read the queued runs, then promoted each by id; a run
    cancelled by a transaction that committed while admission waited for its row came
    back as ``pending`` (and ran). It now stays cancelled; the next queued run is admitted."""
    import psycopg

    from conftest import PG_URL, with_schema

    app = tether.App(store=with_schema(PG_URL, pg_schema))

    @app.workflow
    async def job(n: int) -> int:
        return n

    try:
        app.configure_admission("acme", max_running=1)
        await app.start(job, 0, tenant="acme", run_id="a")
        for rid in ("b", "c"):
            await app.start(job, 0, tenant="acme", run_id=rid, on_limit="queue")
        with psycopg.connect(PG_URL) as other:  # another process cancelling "b"
            other.execute(f'SET search_path TO "{pg_schema}"')
            other.execute("UPDATE runs SET status = 'cancelled' WHERE run_id = 'b'")
            room = asyncio.ensure_future(app.store.configure_admission("acme", 2))
            with psycopg.connect(PG_URL, autocommit=True) as watch:
                for _ in range(400):  # until admission waits for the row "b" is locked in
                    (waiting,) = watch.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND application_name = %s AND query LIKE %s",  # this test's store
                        (f"tether:{pg_schema}", "UPDATE runs SET status = 'pending'%"),
                    ).fetchone()  # type: ignore[misc]
                    if waiting:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("admission never waited for the row of run b")
            other.commit()
        await asyncio.wait_for(room, 30)
        status = {rid: (await app.get(rid)).status.value for rid in ("a", "b", "c")}
        assert status == {"a": "pending", "b": "cancelled", "c": "pending"}
    finally:
        await app.close()
