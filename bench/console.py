"""The operator console on a big store: page times with 1,000,000 finished runs.

``python bench/console.py [--runs 1000000] [--running 10000] [--events 10000]`` fills a
fresh SQLite store directly (finished runs over 30 days across 10 workflows, running
runs, and one run with a long history), starts ``tether serve --no-auth`` on it in a
child process, and times the console's pages over real sockets (p50 of repeated
requests after one warm-up): the runs page filtered by status and workflow, the runs
page unfiltered, a run with the long history, and the overview (its first, uncached
render). It prints the query plan of the filtered runs query. The issue's targets:
runs page < 200 ms p50, a run with 10,000 events < 500 ms p50.
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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from run import _percentile, check

APP = "import os, tether\napp = tether.App(store=os.environ['BENCH_STORE'])\n"


def fill(db: Path, runs: int, running: int, events: int) -> None:
    """Write the runs and one long history straight into a fresh store's tables."""
    import tether

    app = tether.App(store=f"sqlite:///{db}")
    app.store.close_sync()  # type: ignore[attr-defined]  # the schema exists now
    conn = sqlite3.connect(db)
    now = time.time()
    rng = random.Random(7)
    rows = []
    for i in range(runs + running):
        live = i >= runs
        created = now - rng.uniform(60, 30 * 86400)
        status = "running" if live else ("failed" if rng.random() < 0.05 else "completed")
        rows.append(
            (
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
            )
        )
        if len(rows) == 50_000:
            _insert_runs(conn, rows)
            rows = []
    _insert_runs(conn, rows)
    conn.execute(
        "INSERT INTO runs (run_id, workflow, status, queue, input, created_at, updated_at, "
        "next_seq) VALUES ('long', 'wf0', 'running', 'default', '{}', ?, ?, ?)",
        (now - 3600, now, events + 1),
    )
    evs = [(1, "WorkflowStarted", None, '{"workflow": "wf0", "input": {}}')]
    step = 0
    while len(evs) < events:
        step += 1
        evs.append((len(evs) + 1, "ActivityScheduled", step, '{"name": "work", "args": {}}'))
        evs.append((len(evs) + 1, "ActivityCompleted", step, '{"attempt": 1, "result": 2}'))
    conn.executemany(
        "INSERT INTO events (run_id, seq, type, step, data, created_at) VALUES "
        "('long', ?, ?, ?, ?, ?)",
        [(s, t, st, d, now - 3600 + s * 0.1) for s, t, st, d in evs[:events]],
    )
    conn.commit()
    conn.execute("ANALYZE")
    conn.close()


def _insert_runs(conn: sqlite3.Connection, rows: list[tuple[object, ...]]) -> None:
    conn.executemany(
        "INSERT INTO runs (run_id, workflow, status, queue, input, output, error, created_at, "
        "updated_at, completed_at, next_seq) VALUES (?,?,?,?,?,?,?,?,?,?,3)",
        rows,
    )


def plan(db: Path) -> list[str]:
    """SQLite's plan for the runs page filtered by status and workflow."""
    conn = sqlite3.connect(db)
    rows = conn.execute(
        "EXPLAIN QUERY PLAN SELECT * FROM runs WHERE status = 'completed' AND workflow = 'wf3' "
        "ORDER BY created_at DESC, run_id LIMIT 51"
    ).fetchall()
    conn.close()
    return [r[-1] for r in rows]


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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tether-console-bench-") as tmp:
        work = Path(tmp)
        db = work / "tether.db"
        t0 = time.perf_counter()
        fill(db, args.runs, args.running, args.events)
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
            env={**os.environ, "BENCH_STORE": f"sqlite:///{db}"},
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
        print("plan of the filtered runs query:", "; ".join(plan(db)))
    for name, (first, p50) in res.items():
        print(f"{name:22s} first {first:8.1f} ms   p50 {p50:8.1f} ms")
    print(json.dumps({k: {"first_ms": v[0], "p50_ms": v[1]} for k, v in res.items()}))


if __name__ == "__main__":
    main()
