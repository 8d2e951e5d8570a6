"""tether on PostgreSQL: throughput, latency and scaling, against the raw LIMIT and DBOS.

Run from the repository root::

    .venv/bin/python bench/pg_scaling.py [--postgres URL] [--runs 500] [--procs 1,2,4]
    .venv/bin/python bench/pg_scaling.py --peer --procs 2 --repeat 3

Every figure is measured in the same invocation on the same server, each engine
workload in a fresh PostgreSQL schema (dropped afterwards):

* LIMIT: raw single-row ``INSERT`` + ``COMMIT`` transactions (autocommit, the
  server's default ``synchronous_commit``) for 3 s, from 1 connection and from 8
  connections (threads) at once: the server's durable-commit ceiling without group
  commit.
* W1-PG in-process: one process holds the client and one worker
  (``concurrency=100``), the single-machine default shape (``bench/run.py`` does
  the same on SQLite): 500 runs of 10 sequential no-op activities, all started at
  once, until every ``result()`` returned.
* W3-PG in-process: 200 one-step runs one after another (after 5 warm-up runs),
  each timed from before ``start`` until ``result()`` returned: p50 and p99.
* W1-PG(N): N worker processes (``concurrency=100``) serve the W1 runs, all
  started at once by this process after every worker reported ready; the clock
  runs until every run has completed (checked by one query per 50 ms). Each run's
  result is then checked.
* ``--peer``: DBOS Transact (``bench/peer_dbos.py`` in ``bench/.peer-venv``) runs
  W1 and W3 at the same sizes, each in a fresh process on a fresh PostgreSQL
  database of the same server (dropped afterwards). Ratios are tether ÷ DBOS.

``--repeat N`` runs everything N times and reports the median of each figure.
It prints a table and the JSON document (``--json`` also writes it to a file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

import tether

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrate import cpu_calibration_ms  # bench/calibrate.py

DEFAULT_URL = os.environ.get("TETHER_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
HERE = Path(__file__).resolve().parent
PEER_PYTHON = HERE / ".peer-venv" / "bin" / "python"
PEER_SCRIPT = HERE / "peer_dbos.py"
#: The in-process worker's options (bench/run.py's W1 setting).
WORKER_OPTIONS: dict[str, Any] = {"concurrency": 100, "lease": 30.0, "poll_interval": 0.25}
W3_WARMUP = 5

Result = dict[str, Any]


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


def _percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile (0-100), interpolating between the closest ranks."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _store_stats(app: tether.App) -> dict[str, int]:
    stats: dict[str, int] = app.store.stats()
    return stats


async def bench_inproc_w1(url: str, runs: int, steps: int) -> Result:
    """W1 in one process: the client and one worker share the process and its store."""
    schema = f"bench_pg_{uuid.uuid4().hex[:8]}"
    app = build_app(_with_schema(url, schema))
    try:
        async with app.worker(**WORKER_OPTIONS) as worker:
            s0 = _store_stats(app)
            t0 = time.perf_counter()
            handles = await asyncio.gather(
                *(app.start("sequential", steps, 1000 * i, run_id=f"r{i}") for i in range(runs))
            )
            results = await asyncio.gather(*(h.result(timeout=600) for h in handles))
            wall = time.perf_counter() - t0
            s1 = _store_stats(app)
            wstats = dict(worker.stats)
    finally:
        await app.close()
        _drop(url, schema)
    for i, got in enumerate(results):
        want = sum(1000 * i + k for k in range(steps))
        if got != want:
            raise RuntimeError(f"run r{i} returned {got}, expected {want}")
    total = runs * steps
    return {
        "runs": runs,
        "steps": total,
        "wall_s": round(wall, 3),
        "steps_per_s": round(total / wall, 1),
        "commits_per_step": round((s1["commits"] - s0["commits"]) / total, 3),
        "store_ops_per_step": round((s1["operations"] - s0["operations"]) / total, 3),
        "retries": s1["retries"] - s0["retries"],
        "worker_stats": wstats,
    }


async def bench_inproc_w3(url: str, runs: int) -> Result:
    """W3 in one process: one-step runs one after another, start -> result latency."""
    schema = f"bench_pg_{uuid.uuid4().hex[:8]}"
    app = build_app(_with_schema(url, schema))
    latencies: list[float] = []
    try:
        async with app.worker(**WORKER_OPTIONS):
            s0 = _store_stats(app)
            for i in range(W3_WARMUP + runs):
                if i == W3_WARMUP:
                    s0 = _store_stats(app)
                t0 = time.perf_counter()
                run = await app.start("sequential", 1, i, run_id=f"w3-{i}")
                value = await run.result(timeout=60)
                elapsed = time.perf_counter() - t0
                if value != i:
                    raise RuntimeError(f"W3: run {i} returned {value}, expected {i}")
                if i >= W3_WARMUP:
                    latencies.append(elapsed * 1000)
            s1 = _store_stats(app)
    finally:
        await app.close()
        _drop(url, schema)
    return {
        "runs": runs,
        "warmup_runs": W3_WARMUP,
        "p50_ms": round(_percentile(latencies, 50), 3),
        "p99_ms": round(_percentile(latencies, 99), 3),
        "mean_ms": round(statistics.fmean(latencies), 3),
        "commits_per_run": round((s1["commits"] - s0["commits"]) / runs, 2),
        "store_ops_per_run": round((s1["operations"] - s0["operations"]) / runs, 2),
    }


# -- the peer ----------------------------------------------------------------------------


def peer_missing() -> str | None:
    """Why DBOS cannot run (and how to fix it), or None when it can."""
    if PEER_PYTHON.exists():
        return None
    return (
        f"peer skipped: {PEER_PYTHON} does not exist; run `bash bench/setup_peer.sh` from the "
        "repository root (it installs DBOS Transact into bench/.peer-venv), then run again"
    )


def _with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{database}"))


def bench_peer(url: str, workload: str, n: int, steps: int) -> Result:
    """One DBOS workload in a fresh process on a fresh database of the same server."""
    database = f"dbos_bench_{uuid.uuid4().hex[:8]}"
    cmd = [str(PEER_PYTHON), str(PEER_SCRIPT), workload, _with_database(url, database)]
    cmd += ["--n", str(n), "--steps", str(steps)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
            )
    if proc.returncode != 0:
        raise RuntimeError(f"peer {workload} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"peer {workload} printed no JSON:\n{proc.stdout[-2000:]}")
    out: Result = json.loads(lines[-1])
    return out


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


def run_once(args: argparse.Namespace, log: Any) -> Result:
    """Every workload once, in the order LIMIT, tether in-process, DBOS, tether N processes."""
    url = args.postgres
    res: Result = {"load_before": os.getloadavg(), "cpu_before_ms": cpu_calibration_ms()}
    log(f"CPU calibration: {res['cpu_before_ms']} ms")
    log("LIMIT ...")
    res["limit"] = {
        "1": round(bench_limit(url, 1, args.limit_seconds), 1),
        "8": round(bench_limit(url, 8, args.limit_seconds), 1),
    }
    if not args.no_inproc:
        log(f"W1-PG in-process: {args.runs} runs x {args.steps} steps ...")
        res["w1_inproc"] = asyncio.run(bench_inproc_w1(url, args.runs, args.steps))
        log(f"  {res['w1_inproc']['steps_per_s']:,.0f} steps/s")
        log(f"W3-PG in-process: {args.w3_runs} one-step runs ...")
        res["w3_inproc"] = asyncio.run(bench_inproc_w3(url, args.w3_runs))
        log(f"  p50 {res['w3_inproc']['p50_ms']:.2f} ms")
    if args.peer:
        log(f"DBOS W1-PG: {args.runs} runs x {args.steps} steps ...")
        res["dbos_w1"] = bench_peer(url, "w1", args.runs, args.steps)
        log(f"  {res['dbos_w1']['steps_per_s']:,.0f} steps/s")
        log(f"DBOS W3-PG: {args.w3_runs} one-step runs ...")
        res["dbos_w3"] = bench_peer(url, "w3", args.w3_runs, 1)
        log(f"  p50 {res['dbos_w3']['p50_ms']:.2f} ms")
    res["engine"] = []
    for n in (int(p) for p in args.procs.split(",") if p.strip()):
        log(f"W1-PG with {n} worker process(es) ...")
        res["engine"].append(asyncio.run(bench_engine(url, n, args.runs, args.steps)))
        log(f"  {res['engine'][-1]['steps_per_s']:,.0f} steps/s")
    res["load_after"] = os.getloadavg()
    res["cpu_after_ms"] = cpu_calibration_ms()
    return res


def _median(runs: list[Result]) -> Result:
    """The median of every number across runs (same structure as one run)."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: _median([r[k] for r in runs]) for k in first}
    if isinstance(first, list) and first and isinstance(first[0], dict):
        return [_median([r[i] for r in runs]) for i in range(len(first))]  # type: ignore[return-value]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(runs)  # type: ignore[return-value]
    return first


def _ratios(res: Result) -> Result:
    """tether ÷ DBOS for W1 steps/s (higher is better) and W3 latency (lower is better)."""
    out: Result = {}
    if "dbos_w1" in res and "w1_inproc" in res:
        out["w1_inproc_over_dbos"] = res["w1_inproc"]["steps_per_s"] / res["dbos_w1"]["steps_per_s"]
    if "dbos_w1" in res and res["engine"]:
        best = max(w["steps_per_s"] for w in res["engine"])
        out["w1_best_procs_over_dbos"] = best / res["dbos_w1"]["steps_per_s"]
    if "dbos_w3" in res and "w3_inproc" in res:
        out["w3_p50_over_dbos"] = res["w3_inproc"]["p50_ms"] / res["dbos_w3"]["p50_ms"]
        out["w3_p99_over_dbos"] = res["w3_inproc"]["p99_ms"] / res["dbos_w3"]["p99_ms"]
    return {k: round(v, 3) for k, v in out.items()}


def _load(avg: Sequence[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in avg)


def _table(res: Result) -> str:
    lim1, lim8 = res["limit"]["1"], res["limit"]["8"]
    lines = [
        f"load average (1/5/15 min) before {_load(r['load_before'])}, "
        f"after {_load(r['load_after'])}; CPU calibration (fixed Python loop) "
        f"{r['cpu_before_ms']:.1f} / {r['cpu_after_ms']:.1f} ms"
        for r in res.get("runs", [res])
    ]
    if "runs" in res:
        lines.append(f"medians of {len(res['runs'])} repetitions:")
    lines += [
        f"LIMIT 1 connection           {lim1:10,.0f} commits/s",
        f"LIMIT 8 connections          {lim8:10,.0f} commits/s",
    ]
    if "w1_inproc" in res:
        w = res["w1_inproc"]
        lines.append(
            f"W1-PG tether in-process      {w['steps_per_s']:10,.0f} steps/s "
            f"({w['wall_s']:.2f} s, {w['commits_per_step']:.3f} commits/step, "
            f"{w['store_ops_per_step']:.2f} ops/step)  /LIMIT1 {w['steps_per_s'] / lim1:.2f}"
        )
    for w in res["engine"]:
        lines.append(
            f"W1-PG tether {w['procs']} process(es)   {w['steps_per_s']:10,.0f} steps/s "
            f"({w['wall_s']:.2f} s for {w['steps']} steps)  "
            f"/LIMIT1 {w['steps_per_s'] / lim1:.2f}  /LIMIT8 {w['steps_per_s'] / lim8:.2f}"
        )
    if "dbos_w1" in res:
        d = res["dbos_w1"]
        lines.append(
            f"W1-PG DBOS (one process)     {d['steps_per_s']:10,.0f} steps/s ({d['wall_s']:.2f} s)"
        )
    if "w3_inproc" in res:
        w = res["w3_inproc"]
        lines.append(
            f"W3-PG tether in-process      p50 {w['p50_ms']:.2f} ms  p99 {w['p99_ms']:.2f} ms  "
            f"({w['commits_per_run']:.1f} commits/run)"
        )
    if "dbos_w3" in res:
        d = res["dbos_w3"]
        lines.append(
            f"W3-PG DBOS                   p50 {d['p50_ms']:.2f} ms  p99 {d['p99_ms']:.2f} ms"
        )
    for k, v in res.get("ratios", {}).items():
        lines.append(f"tether ÷ DBOS {k:<28} {v:.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the PostgreSQL benchmark; print a table and the JSON document."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--postgres", default=DEFAULT_URL, metavar="URL")
    parser.add_argument("--runs", type=int, default=500, help="W1 runs")
    parser.add_argument("--steps", type=int, default=10, help="W1 steps per run")
    parser.add_argument("--w3-runs", type=int, default=200)
    parser.add_argument(
        "--procs", default="1,2,4", help="worker process counts, e.g. 1,2,4 ('' for none)"
    )
    parser.add_argument("--no-inproc", action="store_true", help="skip the in-process W1/W3")
    parser.add_argument("--peer", action="store_true", help="also run DBOS Transact (W1, W3)")
    parser.add_argument("--repeat", type=int, default=1, help="run N times, report medians")
    parser.add_argument("--limit-seconds", type=float, default=3.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.peer and (note := peer_missing()) is not None:
        log(note)
        args.peer = False
    runs = []
    for i in range(args.repeat):
        if args.repeat > 1:
            log(f"-- repetition {i + 1} of {args.repeat}")
        runs.append(run_once(args, log))
    res = _median(runs) if len(runs) > 1 else runs[0]
    res["ratios"] = _ratios(res)
    res["cpus"] = os.cpu_count()
    if len(runs) > 1:
        res["runs"] = runs
        for r in runs:
            r["ratios"] = _ratios(r)
    print(_table(res))
    doc = json.dumps(res, indent=2)
    print(doc)
    if args.json:
        args.json.write_text(doc + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
