"""Schedules at scale: ``--schedules`` schedules (10,000) firing every ``--every`` seconds
(60), served by two worker processes for ``--minutes`` (3), on SQLite (default) or
PostgreSQL (``--store URL``). Reports how late each tick's run was created (p50, p99,
max: from the tick to the run's creation), and checks that every tick of every
schedule in the window fired exactly once (a run id per tick makes twice impossible;
the check is that none is missing and the schedules' counters agree).

    .venv/bin/python bench/schedules.py [--quick] [--store postgresql://...]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


async def _declare(url: str, n: int, every: float) -> float:
    os.environ["TETHER_BENCH_STORE"] = url
    sys.path.insert(0, str(HERE))
    import schedule_worker

    app = schedule_worker.app
    t0 = time.perf_counter()
    for start in range(0, n, 500):
        await asyncio.gather(
            *(
                app.schedule(f"s{i:05d}", schedule_worker.tick, every=every)
                for i in range(start, min(n, start + 500))
            )
        )
    declared = time.perf_counter() - t0
    await app.close()
    return declared


async def _read(url: str) -> tuple[list[tuple[str, float, float]], int, int]:
    import tether

    app = tether.App(store=url)
    try:
        runs = await app.list(workflow="tick", limit=10_000_000)
        rows = [(r.run_id, float((r.attrs or {})["tick"]), r.created_at) for r in runs]
        infos = await app.schedules(limit=10_000_000)
        return rows, sum(s.fired for s in infos), sum(s.skipped for s in infos)
    finally:
        await app.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--every", type=float, default=60.0)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="200 schedules every 2 s, 10 s")
    parser.add_argument("--store", help="a PostgreSQL URL (default: a SQLite file)")
    args = parser.parse_args()
    if args.quick:
        args.schedules, args.every, args.minutes = 200, 2.0, 10 / 60
    with tempfile.TemporaryDirectory() as d:
        url = args.store or f"sqlite:///{Path(d) / 'schedules.db'}"
        declared = asyncio.run(_declare(url, args.schedules, args.every))
        print(f"declared {args.schedules:,} schedules in {declared:.1f} s")
        env = {**os.environ, "TETHER_BENCH_STORE": url, "PYTHONPATH": str(HERE)}
        began = time.time()
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tether.cli",
                    "worker",
                    "schedule_worker:app",
                    "--concurrency",
                    "200",
                ],
                cwd=HERE,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for _ in range(args.workers)
        ]
        try:
            time.sleep(args.minutes * 60)
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                w.wait(60)
        ended = time.time()
        rows, fired, skipped = asyncio.run(_read(url))
    # the ticks fully inside the window (the first after the workers started, up to
    # the last that every schedule had time to fire before they stopped)
    first = math.floor(began / args.every) * args.every + args.every
    last = (
        math.floor((ended - 30) / args.every) * args.every
        if not args.quick
        else (math.floor((ended - 2) / args.every) * args.every)
    )
    ticks = [first + k * args.every for k in range(int((last - first) / args.every) + 1)]
    seen = {(rid.split("@")[0], tick) for rid, tick, _ in rows}
    missing = [
        (f"s{i:05d}", t)
        for i in range(args.schedules)
        for t in ticks
        if (f"s{i:05d}", t) not in seen
    ]
    late = sorted(created - tick for _, tick, created in rows if first <= tick <= last)
    if not late:
        print("no tick fell inside the window")
        return 1
    p50, p99 = statistics.median(late), late[min(len(late) - 1, int(len(late) * 0.99))]
    print(
        f"{len(rows):,} runs for {len(ticks)} ticks x {args.schedules:,} schedules in the "
        f"window; {args.workers} worker processes"
    )
    print(
        f"lateness (tick -> run created): p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
        f"max {late[-1] * 1000:.0f} ms"
    )
    print(f"fires/s at the tick: {args.schedules / max(late[-1], 1e-3):,.0f}")
    print(
        f"missing ticks: {len(missing)}; runs {len(rows):,} = fired {fired:,}; skipped {skipped:,}"
    )
    ok = not missing and fired == len(rows) and len(rows) == len({r[0] for r in rows})
    print("OK: every tick fired exactly once" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
