"""The operator console on a big store: page times with 1,000,000 finished runs.

``python bench/console.py [--runs 1000000] [--running 10000] [--events 10000]
[--store sqlite|postgres] [--pg URL]`` fills a fresh store directly (finished runs over
30 days across 10 workflows, running runs, and one run with a long history): a SQLite
file, or a new schema of the PostgreSQL at ``--pg`` (default the local server's
``test`` database; the schema is dropped afterwards). It starts ``tether serve
--no-auth`` on it in a child process, and times the console's pages over real sockets
(p50 of repeated requests after one warm-up): the runs page filtered by status and
workflow, the runs page unfiltered, a run with the long history, and the overview (its
first, uncached render). It prints the query plan of the filtered runs query. The
issue's targets: runs page < 200 ms p50, a run with 10,000 events < 500 ms p50.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from run import _percentile, check

APP = "import os, tether\napp = tether.App(store=os.environ['BENCH_STORE'])\n"


def _rows(runs: int, running: int, now: float) -> Iterator[tuple[object, ...]]:
    """The runs table's rows: ``runs`` finished over 30 days, then ``running`` live."""
    rng = random.Random(7)
    for i in range(runs + running):
        live = i >= runs
        created = now - rng.uniform(60, 30 * 86400)
        status = "running" if live else ("failed" if rng.random() < 0.05 else "completed")
        yield (
            f"run-{i:08d}",
            f"wf{i % 10}",
            status,
            "default",
            '{"args":[1],"kwargs":{}}',
            None if live or status == "failed" else "2",
            '{"type":"RuntimeError","message":"boom"}' if status == "failed" else None,
            created,
            created + 1,
            None if live else created + 1,
            3,
        )
    yield ("long", "wf0", "running", "default", "{}", None, None, now - 3600, now, None, 0)


def _events(events: int, now: float) -> list[tuple[object, ...]]:
    """The long run's history: ``events`` events, a step being two of them."""
    evs = [(1, "WorkflowStarted", None, '{"workflow": "wf0", "input": {}}')]
    step = 0
    while len(evs) < events:
        step += 1
        evs.append((len(evs) + 1, "ActivityScheduled", step, '{"name": "work", "args": {}}'))
        evs.append((len(evs) + 1, "ActivityCompleted", step, '{"attempt": 1, "result": 2}'))
    return [("long", s, t, st, d, now - 3600 + s * 0.1) for s, t, st, d in evs[:events]]


_RUN_COLS = (
    "run_id, workflow, status, queue, input, output, error, created_at, updated_at, "
    "completed_at, next_seq"
)
_EVENT_COLS = "run_id, seq, type, step, data, created_at"
_FILTERED = (
    "SELECT * FROM runs WHERE status = 'completed' AND workflow = 'wf3' "
    "ORDER BY created_at DESC, run_id LIMIT 51"
)


def fill(store: str, runs: int, running: int, events: int) -> None:
    """Write the runs and one long history straight into a fresh store's tables, then
    fold the run counters' deltas their triggers appended (as workers do every 10 s)."""
    import asyncio

    import tether

    app = tether.App(store=store)
    app.store.close_sync()  # type: ignore[attr-defined]  # the schema exists now
    _fill(store, runs, running, events)

    async def fold() -> float:
        app = tether.App(store=store)
        t0 = time.perf_counter()
        await app.store.fold_run_counts()
        await app.close()
        return time.perf_counter() - t0

    print(f"folded the run counters' {runs + running + 1:,} deltas in {asyncio.run(fold()):.1f} s")


def _fill(store: str, runs: int, running: int, events: int) -> None:
    now = time.time()
    rows = list(_rows(runs, running, now))
    rows[-1] = (*rows[-1][:-1], events + 1)  # the long run's counter
    if store.startswith("sqlite:///"):
        conn = sqlite3.connect(store[len("sqlite:///") :])
        conn.executemany(f"INSERT INTO runs ({_RUN_COLS}) VALUES ({','.join('?' * 11)})", rows)
        conn.executemany(
            f"INSERT INTO events ({_EVENT_COLS}) VALUES (?,?,?,?,?,?)", _events(events, now)
        )
        conn.commit()
        conn.execute("ANALYZE")
        conn.close()
        return
    import psycopg

    url, schema = store.rsplit("?schema=", 1)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"SET search_path TO {schema}")
        with conn.cursor().copy(f"COPY runs ({_RUN_COLS}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        with conn.cursor().copy(f"COPY events ({_EVENT_COLS}) FROM STDIN") as copy:
            for row in _events(events, now):
                copy.write_row(row)
        conn.execute("ANALYZE")


def plan(store: str) -> list[str]:
    """The store's plan for the runs page filtered by status and workflow."""
    if store.startswith("sqlite:///"):
        conn = sqlite3.connect(store[len("sqlite:///") :])
        rows = conn.execute(f"EXPLAIN QUERY PLAN {_FILTERED}").fetchall()
        conn.close()
        return [r[-1] for r in rows]
    import psycopg

    url, schema = store.rsplit("?schema=", 1)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"SET search_path TO {schema}")
        return [r[0].strip() for r in conn.execute(f"EXPLAIN {_FILTERED}")]


def timed(http: httpx.Client, url: str, n: int) -> tuple[float, float]:
    """(first, p50 of the next n) in ms."""
    t0 = time.perf_counter()
    r = http.get(url)
    first = (time.perf_counter() - t0) * 1000
    check(r.status_code == 200, f"{url} answered {r.status_code}: {r.text[:300]}")
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = http.get(url)
        times.append((time.perf_counter() - t0) * 1000)
        check(r.status_code == 200, f"{url} answered {r.status_code}")
    return first, _percentile(times, 50)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--running", type=int, default=10_000)
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tether-console-bench-") as tmp:
        work = Path(tmp)
        schema = f"bench_console_{os.getpid()}"
        store = (
            f"sqlite:///{work / 'tether.db'}"
            if args.store == "sqlite"
            else f"{args.pg}?schema={schema}"
        )
        try:
            res = _run(work, store, args)
        finally:
            if args.store == "postgres":
                import psycopg

                with psycopg.connect(args.pg, autocommit=True) as conn:
                    conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    print(f"store: {args.store}")
    for name, (first, p50) in res.items():
        print(f"{name:22s} first {first:8.1f} ms   p50 {p50:8.1f} ms")
    print(json.dumps({k: {"first_ms": v[0], "p50_ms": v[1]} for k, v in res.items()}))


def _run(work: Path, store: str, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Fill ``store``, serve it, and time the pages."""
    t0 = time.perf_counter()
    fill(store, args.runs, args.running, args.events)
    print(
        f"filled {args.runs:,} finished + {args.running:,} running runs and a run of "
        f"{args.events:,} events in {time.perf_counter() - t0:.1f} s"
    )
    (work / "bench_console_app.py").write_text(APP)
    port = 18000 + os.getpid() % 1000
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tether.cli",
            "serve",
            "bench_console_app:app",
            "--port",
            str(port),
            "--no-auth",
            "--log-level",
            "warning",
        ],
        cwd=work,
        env={**os.environ, "BENCH_STORE": store},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{base}/healthz", timeout=2)
                break
            except httpx.TransportError:
                check(proc.poll() is None and time.monotonic() < deadline, "no server")
                time.sleep(0.2)
        with httpx.Client(base_url=base, timeout=120) as http:
            res = {
                "runs_filtered": timed(http, "/runs?status=completed&workflow=wf3", 20),
                "runs_all": timed(http, "/runs", 20),
                "runs_failed_by_error": timed(http, "/runs?error_type=RuntimeError", 10),
                "run_10k_events": timed(http, "/runs/long", 10),
                "overview": timed(http, "/", 5),
            }
    finally:
        proc.terminate()
        proc.wait(30)
    print("plan of the filtered runs query:", "; ".join(plan(store)))
    return res


if __name__ == "__main__":
    main()
