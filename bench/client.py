"""W3 (one-step run, start to result) by where the start comes from, on SQLite.

``python bench/client.py [--runs N]`` measures, in one process and one run, next to
the raw commit rate of the same disk (LIMIT, as in ``bench/run.py``):

* ``worker loop``: ``await app.start`` on the in-process worker's own loop (the
  fast path: the run is stored with its first step);
* ``foreign loop``: ``await app.start`` from ``asyncio.run`` in another thread; the
  start is handed to the worker's loop, so it takes the same fast path;
* ``sync client``: ``tether.SyncClient(app).start(...).result()`` from a plain thread.

It prints a table (p50/p99 ms, commits per run, p50 x LIMIT) and the JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from run import (
    FULL,
    WORKER_OPTIONS,
    _commits,
    _expected,
    _make_app,
    _percentile,
    bench_limit,
    check,
)

import tether

WARMUP = 5


def _timed(start_and_wait: Callable[[int], int], runs: int) -> list[float]:
    out = []
    for i in range(WARMUP + runs):
        t0 = time.perf_counter()
        value = start_and_wait(i)
        elapsed = (time.perf_counter() - t0) * 1000
        check(value == _expected(1, i), f"run {i} returned {value}")
        if i >= WARMUP:
            out.append(elapsed)
    return out


def _from_foreign_loop(app: tether.App, wf: tether.Workflow[[int, int], int], i: int) -> int:
    async def go() -> int:
        run = await app.start(wf, 1, i, run_id=f"r{i}")
        return await run.result(timeout=60)

    return asyncio.run(go())


def _from_sync_client(
    client: tether.SyncClient, wf: tether.Workflow[[int, int], int], i: int
) -> int:
    return client.start(wf, 1, i, run_id=f"r{i}").result(timeout=60)


async def measure(workdir: Path, runs: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for mode in ("worker loop", "foreign loop", "sync client"):
        app, wf = _make_app(workdir / f"{mode.replace(' ', '-')}.db")
        client = tether.SyncClient(app)
        try:
            async with app.worker(**WORKER_OPTIONS) as w:
                c0 = _commits(app)
                eager0 = w.stats["eager_starts"]
                if mode == "worker loop":
                    lat: list[float] = []
                    for i in range(WARMUP + runs):
                        t0 = time.perf_counter()
                        run = await app.start(wf, 1, i, run_id=f"r{i}")
                        value = await run.result(timeout=60)
                        check(value == _expected(1, i), f"run {i} returned {value}")
                        if i >= WARMUP:
                            lat.append((time.perf_counter() - t0) * 1000)
                elif mode == "foreign loop":
                    lat = await asyncio.to_thread(
                        _timed, functools.partial(_from_foreign_loop, app, wf), runs
                    )
                else:
                    lat = await asyncio.to_thread(
                        _timed, functools.partial(_from_sync_client, client, wf), runs
                    )
                commits = _commits(app) - c0
                eager = w.stats["eager_starts"] - eager0
        finally:
            await app.close()
        results[mode] = {
            "p50_ms": _percentile(lat, 50),
            "p99_ms": _percentile(lat, 99),
            "mean_ms": statistics.fmean(lat),
            "commits_per_run": commits / (WARMUP + runs),
            "fast_path_starts": eager,
            "runs": runs,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tether-client-bench-") as tmp:
        workdir = Path(tmp)
        limit = bench_limit(workdir, FULL)
        results = asyncio.run(measure(workdir, args.runs))
    per_commit_ms = 1000 / limit["commits_per_s"]
    print(f"LIMIT: {limit['commits_per_s']:,.0f} commits/s ({per_commit_ms:.3f} ms/commit)")
    print(
        f"{'W3 started from':<14} {'p50 ms':>8} {'p99 ms':>8} {'commits':>8} "
        f"{'fast':>6} {'p50/commit':>10}"
    )
    for mode, r in results.items():
        print(
            f"{mode:<14} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['commits_per_run']:8.2f} "
            f"{r['fast_path_starts']:6d} {r['p50_ms'] / per_commit_ms:10.1f}"
        )
    print(json.dumps({"limit": limit, "w3_by_caller": results}, indent=2))


if __name__ == "__main__":
    main()
