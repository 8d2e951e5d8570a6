"""Polling that cannot storm (PostgreSQL): next to a backlog of 100,000 ready tasks on one
queue, claims on another read a few rows each, a claim takes a bounded batch, an idle
worker polls at its interval, and no connection is left ``idle in transaction`` after a
burst. Work is judged by the rows the server read (its own counters), not by times,
which a loaded machine stretches."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest

import tether
from conftest import PG_URL

psycopg = pytest.importorskip("psycopg")

from tether.store.postgres import PostgresStore  # noqa: E402

BACKLOG = 100_000


def _query(schema: str, text: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        cur = conn.execute(text, params)
        return list(cur.fetchall()) if cur.description is not None else []


@pytest.fixture
def store(pg_schema: str) -> Iterator[PostgresStore]:
    s = PostgresStore(PG_URL, schema=pg_schema, writers=2)
    yield s
    s.close_sync()


async def _claim_latencies(store: PostgresStore, queue: str, n: int) -> list[float]:
    """Seconds per claim of one task on ``queue`` (each claim must get one)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        got = await store.claim(worker_id="probe", queues=[queue], limit=1, lease=60)
        out.append(time.perf_counter() - t0)
        assert len(got) == 1
    return out


def _tuples_read(schema: str) -> int:
    """Rows of ``tasks`` read by every backend so far (sequential and index fetches)."""
    ((n,),) = _query(
        schema,
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables "
        "WHERE schemaname = %s AND relname = 'tasks'",
        schema,
    )
    return int(n)


async def _settled(schema: str) -> int:
    """``_tuples_read`` once every backend has reported: unchanged for 11 s (a backend
    reports its counters within 10 s of going idle on PostgreSQL 15+)."""
    seen, stable_since = _tuples_read(schema), time.monotonic()
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and time.monotonic() - stable_since < 11:
        await asyncio.sleep(0.5)
        now = _tuples_read(schema)
        if now != seen:
            seen, stable_since = now, time.monotonic()
    return seen


async def _rows_read_by(schema: str, work: Any) -> int:
    """Rows of ``tasks`` that ``work`` (a coroutine function) read, by the server's own
    counters: unlike times, they do not depend on how busy the machine is."""
    before = await _settled(schema)
    await work()
    return await _settled(schema) - before


async def _idle_poll_latencies(store: PostgresStore, queues: list[str], n: int) -> list[float]:
    """Seconds per idle poll on ``queues`` (nothing ready): an empty claim plus ``next_due``."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert await store.claim(worker_id="idle", queues=queues, limit=64, lease=60) == []
        await store.next_due(queues)
        out.append(time.perf_counter() - t0)
    return out


@pytest.mark.slow
async def test_backlog_on_one_queue_does_not_slow_claims_on_another(
    store: PostgresStore, pg_schema: str
) -> None:
    # queue B: 400 ready tasks of ordinary runs; queue C stays empty (idle pollers)
    await asyncio.gather(
        *(
            store.create_run(run_id=f"b-{i}", workflow="wf", queue="B", input="[]")
            for i in range(400)
        )
    )
    await _claim_latencies(store, "B", 20)  # warm up connections and plans
    times: dict[str, float] = {}

    async def on_b_and_c() -> None:
        times["claim"] = statistics.median(await _claim_latencies(store, "B", 100))
        times["idle"] = statistics.median(await _idle_poll_latencies(store, ["C"], 50))

    # 100,000 ready workflow tasks on queue A, with their runs, in one statement each
    now = time.time()
    t0 = time.perf_counter()
    _query(
        pg_schema,
        "INSERT INTO runs (run_id, workflow, status, queue, input, next_seq, created_at, "
        "updated_at) SELECT 'a-' || g, 'wf', 'running', 'A', '[]', 2, %s, %s "
        "FROM generate_series(1, %s) g",
        now,
        now,
        BACKLOG,
    )
    _query(
        pg_schema,
        "INSERT INTO tasks (run_id, kind, queue, name, available_at, created_at) "
        "SELECT 'a-' || g, 'workflow', 'A', 'wf', %s - g * 1e-6, %s FROM generate_series(1, %s) g",
        now,
        now,
        BACKLOG,
    )
    loaded = time.perf_counter() - t0
    assert _query(pg_schema, "SELECT count(*) FROM tasks WHERE queue = 'A'") == [(BACKLOG,)]

    # (the counters are read after ANALYZE, as autovacuum runs it within a minute of a bulk
    # load; until then the planner's stale estimates can pick a scan of the backlog)
    _query(pg_schema, "ANALYZE tasks")

    # 100 claims on B and 50 idle polls on C next to the backlog read a few rows each:
    # A's 100,000 are never touched
    read = await _rows_read_by(pg_schema, on_b_and_c)
    assert read < 150 * 20, f"{read} task rows read for 150 operations next to the backlog"

    # claims on the backlogged queue itself, alone and with another queue: before the
    # table is analyzed (the planner's estimates are stale right after a bulk load) and
    # after (what autovacuum does within a minute)
    async def claims_of_64(queues: list[str], n: int = 10) -> tuple[float, list[list[Any]]]:
        times, batches = [], []
        for _ in range(n):
            t1 = time.perf_counter()
            batches.append(await store.claim(worker_id="w", queues=queues, limit=64, lease=60))
            times.append(time.perf_counter() - t1)
        return statistics.median(times), batches

    stale_a, batches = await claims_of_64(["A"])
    stale_ac, more = await claims_of_64(["A", "C"])
    # a claim takes a bounded batch, oldest first (RETURNING order is unspecified)
    assert [len(b) for b in batches + more] == [64] * 20
    assert len({t.run_id for b in batches + more for t in b}) == 20 * 64
    assert {t.run_id for t in batches[0]} == {f"a-{BACKLOG - i}" for i in range(64)}
    _query(pg_schema, "ANALYZE tasks")

    async def on_a() -> None:
        await claims_of_64(["A"])
        await claims_of_64(["A", "C"])

    # 20 claims of 64 on the backlogged queue read about the rows they take, not 100,000
    read_a = await _rows_read_by(pg_schema, on_a)
    print(
        f"\nbacklog {BACKLOG} loaded in {loaded:.1f}s; claim of 1 on B p50 "
        f"{times['claim'] * 1e3:.2f} ms; idle poll on C p50 {times['idle'] * 1e3:.2f} ms; "
        f"task rows read: {read} for 150 claims/polls on B and C, {read_a} for 20 claims "
        f"of 64 on A (stale stats: {stale_a * 1e3:.2f} ms, A+C {stale_ac * 1e3:.2f} ms)"
    )
    assert read_a < 20 * 64 * 10, f"{read_a} task rows read for 20 claims of 64"


@pytest.mark.slow
async def test_idle_worker_polls_at_its_interval_and_leaves_no_open_transaction(
    store: PostgresStore, pg_schema: str
) -> None:
    # 100,000 sleeping runs: timers on queue A due in an hour
    now = time.time()
    _query(
        pg_schema,
        "INSERT INTO tasks (run_id, kind, step, queue, available_at, created_at) "
        "SELECT 'a-' || g, 'timer', 1, 'A', %s + 3600 + g * 1e-3, %s "
        "FROM generate_series(1, %s) g",
        now,
        now,
        BACKLOG,
    )
    _query(pg_schema, "ANALYZE tasks")  # as autovacuum does within a minute of a bulk load
    # a worker serving A and C with nothing ready polls at its interval, never spins
    app = tether.App(store=store)
    before = store.stats()["operations"]
    worker = app.worker(queues=["A", "C"], poll_interval=0.25)
    await worker.start()
    await asyncio.sleep(2.0)
    await worker.stop()
    ops = store.stats()["operations"] - before
    # one claim and one next_due per poll: about 2 x 8 in 2 s at 0.25 s (plus slack)
    assert ops <= 30, f"an idle worker made {ops} store operations in 2 s"
    # and each idle poll stays cheap next to the sleeping backlog: few rows read
    polls: list[float] = []

    async def idle_polls() -> None:
        polls.extend(await _idle_poll_latencies(store, ["A", "C"], 20))

    read = await _rows_read_by(pg_schema, idle_polls)
    assert read < 20 * 20, f"{read} task rows read by 20 idle polls next to the backlog"
    due = await store.next_due(["A", "C"])
    assert due is not None and abs(due - (now + 3600.001)) < 1e-3
    print(
        f"\nidle poll on A+C next to {BACKLOG} sleeping timers: p50 "
        f"{statistics.median(polls) * 1e3:.2f} ms; {ops} store operations in 2 s"
    )

    # a burst of concurrent claims and reads over both writer connections
    _query(
        pg_schema,
        "INSERT INTO tasks (run_id, kind, queue, name, available_at, created_at) "
        "SELECT 'r-' || g, 'workflow', 'A', 'wf', %s, %s FROM generate_series(1, 5000) g",
        now,
        now,
    )
    results = await asyncio.gather(
        *(store.claim(worker_id=f"w{i}", queues=["A"], limit=64, lease=60) for i in range(50)),
        *(store.next_due(["A", "C"]) for _ in range(50)),
    )
    claimed = [t.task_id for r in results[:50] for t in r]  # type: ignore[union-attr]
    assert len(claimed) == len(set(claimed)) == 50 * 64  # no task claimed twice
    open_tx = _query(
        pg_schema,
        "SELECT pid, state, xact_start FROM pg_stat_activity WHERE application_name = %s "
        "AND (state LIKE 'idle in transaction%%' OR xact_start IS NOT NULL)",
        f"tether:{pg_schema}",
    )
    assert open_tx == []
    conns = _query(
        pg_schema,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
        f"tether:{pg_schema}",
    )
    assert conns == [(3,)]  # 2 writers + 1 listener
