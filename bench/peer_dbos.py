"""The peer: DBOS Transact on tether's benchmark workloads, on SQLite or PostgreSQL.

Runs ONLY in the benchmark's own virtualenv (``bench/.peer-venv``, made by
``bench/setup_peer.sh``); tether never depends on DBOS. ``bench/run.py --peer``
runs it once per workload, each in a fresh process on a fresh database file, and
``bench/pg_scaling.py --peer`` on a fresh PostgreSQL database::

    bench/.peer-venv/bin/python bench/peer_dbos.py WORKLOAD DB_PATH [--n N] [--steps S]
    bench/.peer-venv/bin/python bench/peer_dbos.py WORKLOAD postgresql://... [--n N]

and reads the one JSON document it prints on stdout. A ``postgresql://`` URL is
DBOS's system database (DBOS creates it if it does not exist; the caller drops
it); anything else is a SQLite file. Workloads (the same shapes
as tether's, see ``bench/README.md``):

* ``w1``: N runs of S sequential no-op steps, all started at once.
* ``w2``: one workflow enqueues N child workflows (each one no-op step) on a
  queue with ``worker_concurrency=100`` and waits for all of them (DBOS's
  fan-out idiom: queues hold workflows, so each item is a workflow plus a step).
* ``w3``: N one-step runs one after another, start -> result latency.
* ``w5``: N workflows blocked in ``DBOS.recv_async("go")``: process RSS, time
  to start them all, then time to ``send`` one message to each and see all finish.

Everything except W2's polling intervals is DBOS's default (``--queue-poll``
sets the queue's ``polling_interval_sec`` and the interval at which the fan-out
workflow's ``get_result`` polls each child; both default to DBOS's 1 s). The
journal mode is set to WAL and ``synchronous`` to FULL on every connection,
tether's own durability setting. On PostgreSQL everything is DBOS's default
(LISTEN/NOTIFY on, a pool of 20 connections) and the server's own durability
(``synchronous_commit``, recorded in the output).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import logging
import statistics
import sys
import time
from typing import Any

import sqlalchemy as sa
from dbos import DBOS, DBOSConfig

Result = dict[str, Any]


@sa.event.listens_for(sa.engine.Engine, "connect")
def _pragmas(dbapi_conn: Any, _record: Any) -> None:
    """WAL and synchronous=FULL on every SQLite connection (tether's settings)."""
    if type(dbapi_conn).__module__.startswith("sqlite3"):
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = FULL")
        cur.close()


@DBOS.step()
async def noop_step(x: int) -> int:
    """Return the input: a step whose whole cost is engine overhead."""
    return x


@DBOS.workflow()
async def sequential(steps: int, base: int) -> int:
    """``steps`` no-op steps one after another; the sum of their results."""
    total = 0
    for i in range(steps):
        total += await noop_step(base + i)
    return total


@DBOS.workflow()
async def item(x: int) -> int:
    """One fan-out item: a workflow running one no-op step."""
    return await noop_step(x)


_QUEUE: Any = None
_RESULT_POLL = 1.0  #: DBOS's default for a handle's get_result (it polls the database)


@DBOS.workflow()
async def fan_out(n: int) -> list[int]:
    """Enqueue ``n`` items on the queue, then wait for each; [count, sum]."""
    handles = [await _QUEUE.enqueue_async(item, x) for x in range(n)]
    values = [await h.get_result(polling_interval_sec=_RESULT_POLL) for h in handles]
    return [len(values), sum(values)]


@DBOS.workflow()
async def waiter(i: int) -> int:
    """Block until a message on topic ``go`` arrives; return it plus ``i``."""
    payload = await DBOS.recv_async("go", timeout_seconds=3600)
    return int(payload) + i


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _rss_kb() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


_DBOS: Any = None


def _scalar(sql: str) -> Any:
    """One value from DBOS's own engine (a benchmark probe)."""
    with _DBOS._sys_db.engine.connect() as conn:
        return conn.execute(sa.text(sql)).scalar()


async def w1(n: int, steps: int) -> Result:
    t0 = time.perf_counter()
    handles = await asyncio.gather(
        *(DBOS.start_workflow_async(sequential, steps, i) for i in range(n))
    )
    values = await asyncio.gather(*(h.get_result() for h in handles))
    wall = time.perf_counter() - t0
    bad = [i for i, v in enumerate(values) if v != sum(i + k for k in range(steps))]
    _check(not bad, f"w1: wrong results for runs {bad[:5]}")
    return {
        "runs": n,
        "steps_per_run": steps,
        "wall_s": wall,
        "runs_per_s": n / wall,
        "steps_per_s": n * steps / wall,
    }


async def w2(n: int, queue_poll: float) -> Result:
    global _QUEUE, _RESULT_POLL
    _RESULT_POLL = queue_poll
    _QUEUE = await DBOS.register_queue_async(
        "fanout", worker_concurrency=100, polling_interval_sec=queue_poll
    )
    base = _rss_kb()["VmRSS"]
    t0 = time.perf_counter()
    handle = await DBOS.start_workflow_async(fan_out, n)
    value = await handle.get_result()
    wall = time.perf_counter() - t0
    _check(value == [n, sum(range(n))], f"w2: the run returned {value}")
    mem = _rss_kb()
    return {
        "items": n,
        "concurrency": 100,
        "queue_polling_interval_s": queue_poll,
        "result_polling_interval_s": _RESULT_POLL,
        "wall_s": wall,
        "steps_per_s": n / wall,
        "rss_before_kb": base,
        "peak_rss_kb": mem["VmHWM"],
        "peak_rss_growth_kb": mem["VmHWM"] - base,
    }


async def w3(n: int, warmup: int = 5) -> Result:
    latencies: list[float] = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        handle = await DBOS.start_workflow_async(sequential, 1, i)
        value = await handle.get_result()
        elapsed = time.perf_counter() - t0
        _check(value == i, f"w3: run {i} returned {value}")
        if i >= warmup:
            latencies.append(elapsed * 1000)
    return {
        "runs": n,
        "warmup_runs": warmup,
        "p50_ms": _percentile(latencies, 50),
        "p99_ms": _percentile(latencies, 99),
        "mean_ms": statistics.fmean(latencies),
    }


async def w5(n: int) -> Result:
    await asyncio.sleep(0.5)
    idle = _rss_kb()["VmRSS"]
    sleeps = "SELECT count(*) FROM operation_outputs WHERE function_name = 'DBOS.sleep'"
    t0 = time.time()
    handles = await asyncio.gather(*(DBOS.start_workflow_async(waiter, i) for i in range(n)))
    t_started = time.time()
    # blocked = the recv's durable timeout is recorded (its last write before waiting)
    deadline = time.monotonic() + 900
    while await asyncio.to_thread(_scalar, sleeps) != n:
        _check(time.monotonic() < deadline, "w5: not every workflow reached recv")
        await asyncio.sleep(0.01)
    t_blocked = time.time()
    await asyncio.sleep(0.5)
    waiting = _rss_kb()["VmRSS"]
    t1 = time.time()
    await asyncio.gather(*(DBOS.send_async(h.get_workflow_id(), 1, "go") for h in handles))
    t_sent = time.time()
    values = await asyncio.gather(*(h.get_result() for h in handles))
    t_done = time.time()
    _check(values == [i + 1 for i in range(n)], "w5: wrong results")
    return {
        "runs": n,
        "rss_idle_kb": idle,
        "rss_waiting_kb": waiting,
        "rss_growth_kb": waiting - idle,
        "kb_per_waiting_run": (waiting - idle) / n,
        "peak_rss_kb": _rss_kb()["VmHWM"],
        "start_calls_s": t_started - t0,
        "start_to_all_blocked_s": t_blocked - t0,
        "starts_per_s": n / (t_blocked - t0),
        "signal_calls_s": t_sent - t1,
        "signal_to_all_finished_s": t_done - t1,
        "signals_per_s": n / (t_done - t1),
    }


async def _main(args: argparse.Namespace) -> Result:
    postgres = "://" in args.db
    config: DBOSConfig = {
        "name": "tether-bench-peer",
        "system_database_url": args.db if postgres else f"sqlite:///{args.db}",
        "log_level": "WARNING",
    }
    global _DBOS
    _DBOS = DBOS(config=config)
    DBOS.launch()
    try:
        if postgres:
            settings = {
                "synchronous_commit": _scalar("SHOW synchronous_commit"),
                "server_version": _scalar("SHOW server_version"),
            }
        else:
            settings = {
                "journal_mode": _scalar("PRAGMA journal_mode"),
                "synchronous": _scalar("PRAGMA synchronous"),
            }
        if args.workload == "w1":
            out = await w1(args.n, args.steps)
        elif args.workload == "w2":
            out = await w2(args.n, args.queue_poll)
        elif args.workload == "w3":
            out = await w3(args.n)
        else:
            out = await w5(args.n)
    finally:
        DBOS.destroy()
    out["postgresql" if postgres else "sqlite"] = settings
    out["dbos_version"] = importlib.metadata.version("dbos")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("workload", choices=["w1", "w2", "w3", "w5"])
    parser.add_argument("db", help="a SQLite file, or a postgresql:// URL")
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--queue-poll", type=float, default=1.0, help="W2 queue polling (s)")
    args = parser.parse_args()
    logging.getLogger("dbos").setLevel(logging.WARNING)
    print(json.dumps(asyncio.run(_main(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
