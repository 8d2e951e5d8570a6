"""tether on PostgreSQL: steps/s with 1, 2 and 4 worker processes, against the raw LIMIT.

Run from the repository root::

    .venv/bin/python bench/pg_scaling.py [--postgres URL] [--runs 500] [--procs 1,2,4]

Every figure is measured in the same invocation on the same server, each engine
workload in a fresh PostgreSQL schema (dropped afterwards):

* LIMIT: raw single-row ``INSERT`` + ``COMMIT`` transactions (autocommit, the
  server's default ``synchronous_commit``) for 3 s, from 1 connection and from 8
  connections (threads) at once: the server's durable-commit ceiling without group
  commit.
* W1-PG(N): N worker processes (``concurrency=100``) serve 500 runs of 10
  sequential no-op activities, all started at once by this process after every
  worker reported ready; the clock runs until every run has completed (checked by
  one query per 50 ms). Each run's result is then checked.

It prints a table and the JSON document (``--json`` also writes it to a file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import tether

DEFAULT_URL = os.environ.get("TETHER_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
HERE = Path(__file__).resolve().parent


def build_app(url: str) -> tether.App:
    app = tether.App(store=url)

    @app.activity
    async def noop(x: int) -> int:
        return x

    @app.workflow
    async def sequential(steps: int, base: int) -> int:
        total = 0
        for i in range(steps):
            total += await noop(base + i)
        return total

    return app


def _with_schema(url: str, schema: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}schema={schema}"


def _drop(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# -- LIMIT -------------------------------------------------------------------------------


def bench_limit(url: str, connections: int, seconds: float) -> float:
    """Single-row INSERT + COMMIT transactions per second from ``connections`` at once."""
    schema = f"bench_limit_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(
            sql.SQL("CREATE TABLE {}.t (id BIGSERIAL PRIMARY KEY, body TEXT)").format(
                sql.Identifier(schema)
            )
        )
    counts = [0] * connections
    barrier = threading.Barrier(connections + 1)
    stop_at = [0.0]
    body = "x" * 100
    insert = sql.SQL("INSERT INTO {}.t (body) VALUES (%s)").format(sql.Identifier(schema))

    def loop(i: int) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            barrier.wait()
            n = 0
            while time.perf_counter() < stop_at[0]:
                conn.execute(insert, (body,))  # autocommit: one transaction, one commit
                n += 1
            counts[i] = n

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(connections)]
    for t in threads:
        t.start()
    stop_at[0] = time.perf_counter() + 1e9
    barrier.wait()
    t0 = time.perf_counter()
    stop_at[0] = t0 + seconds
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    _drop(url, schema)
    return sum(counts) / elapsed


# -- engine ------------------------------------------------------------------------------


def _spawn(url: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--serve", url],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def bench_engine(url: str, procs: int, runs: int, steps: int) -> dict[str, Any]:
    schema = f"bench_pg_{uuid.uuid4().hex[:8]}"
    surl = _with_schema(url, schema)
    app = build_app(surl)
    _ = app.store  # create the schema before the workers race to
    workers = [_spawn(surl) for _ in range(procs)]
    try:
        for w in workers:
            assert w.stdout is not None
            line = w.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"worker failed to start: {w.stderr.read() if w.stderr else ''}")
        conn = psycopg.connect(url, autocommit=True)
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        t0 = time.perf_counter()
        handles = await asyncio.gather(
            *(app.start("sequential", steps, 1000 * i, run_id=f"r{i}") for i in range(runs))
        )
        while True:
            (done,) = conn.execute(
                "SELECT count(*) FROM runs WHERE status = 'completed'"
            ).fetchone() or (0,)
            if done == runs:
                break
            if time.perf_counter() - t0 > 600:
                raise RuntimeError(f"only {done} of {runs} runs completed in 600 s")
            await asyncio.sleep(0.05)
        wall = time.perf_counter() - t0
        for i, h in enumerate(handles):
            want = sum(1000 * i + k for k in range(steps))
            got = await h.result(timeout=5)
            if got != want:
                raise RuntimeError(f"run r{i} returned {got}, expected {want}")
        conn.close()
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            try:
                w.wait(15)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait(5)
        await app.close()
        _drop(url, schema)
    return {
        "procs": procs,
        "runs": runs,
        "steps": runs * steps,
        "wall_s": round(wall, 3),
        "steps_per_s": round(runs * steps / wall, 1),
    }


async def serve(url: str) -> None:
    """A worker process: serve until SIGTERM."""
    import signal

    app = build_app(url)
    _ = app.store
    worker = app.worker(concurrency=100, lease=30.0, poll_interval=0.25)
    await worker.start()
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await worker.stop(grace=2.0)
    await app.close()


# -- main --------------------------------------------------------------------------------


def _table(res: dict[str, Any]) -> str:
    lim1, lim8 = res["limit"]["1"], res["limit"]["8"]
    lines = [
        f"LIMIT 1 connection   {lim1:10,.0f} commits/s",
        f"LIMIT 8 connections  {lim8:10,.0f} commits/s",
    ]
    for w in res["engine"]:
        lines.append(
            f"W1-PG {w['procs']} process(es) {w['steps_per_s']:10,.0f} steps/s "
            f"({w['wall_s']:.2f} s for {w['steps']} steps)  "
            f"/LIMIT1 {w['steps_per_s'] / lim1:.2f}  /LIMIT8 {w['steps_per_s'] / lim8:.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--postgres", default=DEFAULT_URL, metavar="URL")
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--procs", default="1,2,4", help="worker process counts, e.g. 1,2,4")
    parser.add_argument("--limit-seconds", type=float, default=3.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    url = args.postgres
    print("LIMIT ...", file=sys.stderr)
    res: dict[str, Any] = {
        "limit": {
            "1": round(bench_limit(url, 1, args.limit_seconds), 1),
            "8": round(bench_limit(url, 8, args.limit_seconds), 1),
        },
        "engine": [],
        "load_before": os.getloadavg(),
    }
    for n in (int(p) for p in args.procs.split(",")):
        print(f"W1-PG with {n} worker process(es) ...", file=sys.stderr)
        res["engine"].append(asyncio.run(bench_engine(url, n, args.runs, args.steps)))
    res["load_after"] = os.getloadavg()
    res["cpus"] = os.cpu_count()
    print(_table(res))
    doc = json.dumps(res, indent=2)
    print(doc)
    if args.json:
        args.json.write_text(doc + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
