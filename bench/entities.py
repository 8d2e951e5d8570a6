"""Entity operations per second, next to W1's steps/s and the store's raw commit rate
(LIMIT) in the same run, on SQLite (default) or PostgreSQL (``--store URL``).

* hot key: ``ops`` operations on one entity from 20 concurrent callers, each waiting
  for its result (``call``): every operation is applied one at a time, in order;
* 1,000 keys: ``ops`` operations spread over 1,000 entities, 100 callers at a time;
* sequential ``call`` latency on one key (p50/p99).

Every figure is checked: the counters end at exactly the number of operations sent.

    .venv/bin/python bench/entities.py [--quick] [--store postgresql://...]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import tether

HERE = Path(__file__).resolve().parent


def _app(url: str) -> tether.App:
    app = tether.App(store=url)

    @app.entity(ops_per_run=500)
    class Counter:
        def __init__(self) -> None:
            self.value = 0

        def add(self, n: int) -> int:
            self.value += n
            return self.value

    return app


async def _hot(url: str, ops: int) -> dict[str, Any]:
    app = _app(url)
    ref = app.entity_ref("Counter", f"hot-{uuid.uuid4().hex[:6]}")
    sem = asyncio.Semaphore(20)

    async def one() -> int:
        async with sem:
            out: int = await ref.call("add", 1, timeout=600)
            return out

    try:
        async with app.worker(concurrency=100, poll_interval=0.25):
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one() for _ in range(ops)))
            wall = time.perf_counter() - t0
            if sorted(results) != list(range(1, ops + 1)):
                raise RuntimeError("hot key: an operation was lost or applied twice")
            lat = []
            for _ in range(100):
                s = time.perf_counter()
                await ref.call("add", 1)
                lat.append(1000 * (time.perf_counter() - s))
    finally:
        await app.close()
    lat.sort()
    return {
        "ops_per_s": ops / wall,
        "call_p50_ms": statistics.median(lat),
        "call_p99_ms": lat[98],
    }


async def _spread(url: str, ops: int, keys: int) -> dict[str, Any]:
    app = _app(url)
    tag = uuid.uuid4().hex[:6]
    sem = asyncio.Semaphore(100)

    async def one(i: int) -> int:
        async with sem:
            out: int = await app.entity_ref("Counter", f"k{tag}-{i % keys}").call("add", 1)
            return out

    try:
        async with app.worker(concurrency=200, poll_interval=0.25):
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(i) for i in range(ops)))
            wall = time.perf_counter() - t0
    finally:
        await app.close()
    per_key = ops // keys
    if sorted(results) != sorted(list(range(1, per_key + 1)) * keys):
        raise RuntimeError("1,000 keys: an operation was lost or applied twice")
    return {"ops_per_s": ops / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--store", help="a PostgreSQL URL (default: a SQLite file)")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import run as bench_run

    ops = 200 if args.quick else 2_000
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        sizes = bench_run.QUICK if args.quick else bench_run.FULL
        limit = bench_run.bench_limit(work, sizes)["commits_per_s"]
        w1 = asyncio.run(bench_run.bench_w1(work, sizes, limit))
        url = args.store or f"sqlite:///{work / 'entities.db'}"
        hot = asyncio.run(_hot(url, ops))
        spread = asyncio.run(_spread(url, ops, 1000 if not args.quick else 100))
    store = "PostgreSQL" if args.store else "SQLite"
    print(f"LIMIT (raw SQLite INSERT+COMMIT)     {limit:10,.0f} commits/s")
    print(f"W1 steps/s (SQLite)                  {w1['steps_per_s']:10,.0f}")
    print(f"entity ops/s, one hot key ({store})  {hot['ops_per_s']:10,.0f}")
    print(f"entity ops/s, 1,000 keys ({store})   {spread['ops_per_s']:10,.0f}")
    p50, p99 = hot["call_p50_ms"], hot["call_p99_ms"]
    print(f"call latency one key p50 / p99       {p50:7.1f} / {p99:.1f} ms")
    print(f"hot key ops/s / W1 steps/s           {hot['ops_per_s'] / w1['steps_per_s']:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
