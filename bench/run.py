"""tether benchmark: engine throughput, latency and replay cost against the SQLite limit.

Run from the repository root::

    .venv/bin/python bench/run.py [--quick] [--repeat N] [--json out.json] [--dir PATH]

Every figure is measured in the same invocation, on fresh SQLite files in a
temporary directory (on the same file system as ``--dir``, default the system
temp dir), so the engine figures can be read against the raw commit rate of
the same disk:

* LIMIT: raw single-row ``INSERT`` + ``COMMIT`` transactions from one
  connection on a WAL file with ``synchronous=FULL`` (the engine's setting).
* W1: many runs of 10 sequential no-op activities, all started at once, one
  in-process worker: throughput and durable commits per step.
* W3: one-step runs, one after another: start-to-result latency.
* W6: replay of a real >=10,000-event history: a cold replay, and the warm
  (sticky-cache) cost of continuing a cached instance by one workflow task.
* W2, W4, W5 (``bench/workloads.py``): a 10,000-way fan-out in one run; SIGKILL
  and restart of a worker subprocess; 10,000 runs waiting for a signal.

``--peer`` also runs DBOS Transact on W1, W2, W3 and W5 (``bench/peer.py``, in
its own virtualenv made by ``bench/setup_peer.sh``) and prints tether ÷ DBOS.

It prints a table, then the JSON document (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tether
from tether import EventType
from tether._history import INCOMING
from tether.workflow._instance import WorkflowInstance

sys.path.insert(0, str(Path(__file__).resolve().parent))
import calibrate  # bench/calibrate.py: how fast this CPU is now
import peer  # bench/peer.py: the DBOS comparison
import workloads  # bench/workloads.py: W2, W4, W5

#: Options for every in-process worker in this benchmark (the brief's W1 setting;
#: ``poll_interval`` is the default: workers are woken by commits, not by polling).
WORKER_OPTIONS: dict[str, Any] = {"concurrency": 100, "lease": 30.0, "poll_interval": 0.25}

Result = dict[str, Any]


@dataclass(frozen=True)
class Sizes:
    """How big each workload is; ``--quick`` uses ``QUICK`` (about 10x smaller)."""

    limit_seconds: float  #: LIMIT stops after this long ...
    limit_commits: int  #: ... or after this many commits, whichever comes first
    w1_runs: int
    w1_steps: int
    w3_runs: int
    w3_warmup: int  #: W3 runs done before measuring (store and worker warm-up)
    w6_steps: int  #: each step of the W6 run adds 3 events
    w6_cold_repeats: int  #: cold replays timed; the median is reported


FULL = Sizes(
    limit_seconds=3.0,
    limit_commits=5_000,
    w1_runs=500,
    w1_steps=10,
    w3_runs=200,
    w3_warmup=5,
    w6_steps=3_400,
    w6_cold_repeats=3,
)
QUICK = Sizes(
    limit_seconds=0.3,
    limit_commits=500,
    w1_runs=50,
    w1_steps=10,
    w3_runs=20,
    w3_warmup=2,
    w6_steps=340,
    w6_cold_repeats=3,
)


# -- helpers --------------------------------------------------------------------


def check(ok: bool, message: str) -> None:
    """Fail the benchmark if a result is wrong (unlike ``assert``, kept under ``-O``)."""
    if not ok:
        raise RuntimeError(message)


def _percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile (0-100) by linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    rank = (len(ordered) - 1) * pct / 100.0
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _make_app(
    db: Path, encryption: Any = None
) -> tuple[tether.App, tether.Workflow[[int, int], int]]:
    """An App on a fresh SQLite file with the benchmark's activity and workflow
    (``encryption``: a keyring of its own, as ``bench/encryption.py --alternate`` gives)."""
    app = tether.App(store=f"sqlite:///{db}", encryption=encryption)

    @app.activity
    async def noop(x: int) -> int:
        """Return the input: a step whose whole cost is engine overhead."""
        return x

    @app.workflow
    async def sequential(steps: int, base: int) -> int:
        """Run ``steps`` no-op activities one after another; return the sum of their results."""
        total = 0
        for i in range(steps):
            total += await noop(base + i)
        return total

    return app, sequential


def _expected(steps: int, base: int) -> int:
    """What ``sequential(steps, base)`` returns, to check every run really ran."""
    return sum(base + i for i in range(steps))


def _commits(app: tether.App) -> int:
    return app.store.stats()["commits"]


# -- LIMIT ------------------------------------------------------------------------


def bench_limit(workdir: Path, sizes: Sizes) -> Result:
    """Raw durable commit rate: one small INSERT per transaction, WAL, synchronous=FULL."""
    path = workdir / "limit.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, data TEXT NOT NULL)")
        row = "x" * 100  # about the size of a small history event
        n = 0
        t0 = time.perf_counter()
        deadline = t0 + sizes.limit_seconds
        while n < sizes.limit_commits:
            conn.execute("BEGIN")
            conn.execute("INSERT INTO t (data) VALUES (?)", (row,))
            conn.execute("COMMIT")
            n += 1
            if time.perf_counter() >= deadline:
                break
        elapsed = time.perf_counter() - t0
        (count,) = conn.execute("SELECT count(*) FROM t").fetchone()
        check(count == n, f"LIMIT: table has {count} rows, expected {n}")
    finally:
        conn.close()
    return {
        "commits": n,
        "seconds": elapsed,
        "commits_per_s": n / elapsed,
        "ms_per_commit": 1000 * elapsed / n,
    }


# -- W1 -------------------------------------------------------------------------


async def bench_w1(workdir: Path, sizes: Sizes, limit_cps: float) -> Result:
    """Throughput: ``w1_runs`` runs of ``w1_steps`` no-op steps, all started at once."""
    app, wf = _make_app(workdir / "w1.db")
    runs_n, steps_n = sizes.w1_runs, sizes.w1_steps
    try:
        async with app.worker(**WORKER_OPTIONS) as worker:
            c0, ops0 = _commits(app), app.store.stats()["operations"]
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            runs = await asyncio.gather(
                *(app.start(wf, steps_n, i, run_id=f"w1-{i}") for i in range(runs_n))
            )
            results = await asyncio.gather(*(r.result(timeout=600) for r in runs))
            wall = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            commits = _commits(app) - c0
            ops = app.store.stats()["operations"] - ops0
            wstats = dict(worker.stats)
    finally:
        await app.close()
    bad = [i for i, v in enumerate(results) if v != _expected(steps_n, i)]
    check(not bad, f"W1: wrong results for runs {bad[:5]}")
    steps = runs_n * steps_n
    return {
        "runs": runs_n,
        "steps_per_run": steps_n,
        "steps": steps,
        "wall_s": wall,
        "runs_per_s": runs_n / wall,
        "steps_per_s": steps / wall,
        "commits": commits,
        "commits_per_step": commits / steps,
        "store_ops_per_step": ops / steps,
        "steps_per_s_over_limit": steps / wall / limit_cps,
        # CPU of this process (all threads) per step: steadier than wall time on a
        # shared machine, and what group commit cannot hide
        "cpu_us_per_step": 1e6 * cpu / steps,
        "worker_stats": wstats,
    }


# -- W3 -------------------------------------------------------------------------


async def bench_w3(workdir: Path, sizes: Sizes) -> Result:
    """Latency: one-step runs, each started only after the previous one finished."""
    app, wf = _make_app(workdir / "w3.db")
    latencies: list[float] = []
    try:
        async with app.worker(**WORKER_OPTIONS):
            c0 = 0
            for i in range(sizes.w3_warmup + sizes.w3_runs):
                if i == sizes.w3_warmup:
                    c0 = _commits(app)
                t0 = time.perf_counter()
                run = await app.start(wf, 1, i, run_id=f"w3-{i}")
                value = await run.result(timeout=60)
                elapsed = time.perf_counter() - t0
                check(value == _expected(1, i), f"W3: run {i} returned {value}")
                if i >= sizes.w3_warmup:
                    latencies.append(elapsed * 1000)
            commits = _commits(app) - c0
    finally:
        await app.close()
    return {
        "runs": len(latencies),
        "warmup_runs": sizes.w3_warmup,
        "p50_ms": _percentile(latencies, 50),
        "p99_ms": _percentile(latencies, 99),
        "mean_ms": statistics.fmean(latencies),
        "min_ms": min(latencies),
        "max_ms": max(latencies),
        "commits_per_run": commits / len(latencies),
    }


# -- W6 -------------------------------------------------------------------------


async def _build_history(
    workdir: Path, steps: int
) -> tuple[tether.Workflow[[int, int], int], Result]:
    """Run one ``steps``-step workflow to completion; return it and facts about the run."""
    app, wf = _make_app(workdir / "w6.db")
    run_id = "w6-long"
    try:
        async with app.worker(**WORKER_OPTIONS) as worker:
            t0 = time.perf_counter()
            run = await app.start(wf, steps, 0, run_id=run_id)
            value = await run.result(timeout=3600)
            wall = time.perf_counter() - t0
            wstats = dict(worker.stats)
        check(value == _expected(steps, 0), f"W6: the run returned {value}")
        t0 = time.perf_counter()
        events = await app.store.read_history(run_id, 0)
        read_s = time.perf_counter() - t0
    finally:
        await app.close()
    facts: Result = {
        "run_id": run_id,
        "events": events,
        "build_wall_s": wall,
        "build_steps_per_s": steps / wall,
        "read_history_s": read_s,
        "worker_stats": wstats,
    }
    return wf, facts


def _timed_cold_replay(
    run_id: str, wf: tether.Workflow[[int, int], int], events: Sequence[tether.Event]
) -> tuple[float, WorkflowInstance]:
    """Seconds for a new instance to replay ``events``; the instance, for checks."""
    now = time.time()
    t0 = time.perf_counter()
    inst = WorkflowInstance(run_id, wf)
    result = inst.advance(events, now)
    elapsed = time.perf_counter() - t0
    check(not result.commands, f"W6: replay produced new commands {result.commands[:3]}")
    return elapsed, inst


def bench_w6_replay(
    run_id: str, wf: tether.Workflow[[int, int], int], events: Sequence[tether.Event], sizes: Sizes
) -> Result:
    """Cold and warm replay of one real history (CPU only: no store I/O is timed).

    Cold: a new ``WorkflowInstance`` + ``advance(all_events, now)``, exactly what
    a worker does for a run it does not hold in its cache (minus reading the
    history). Timed ``w6_cold_repeats`` times; the median is reported. The same
    is also timed on the first quarter of the history to show how cold cost
    scales with length.

    Warm: what a worker does on a sticky-cache hit. An instance is cold-replayed
    up to the marker that closes workflow task ``h = steps // 2`` (and
    ``committed`` is called, as the worker does), so it is in the state a worker
    caches. Then, for every later workflow task k (h+1 ... steps), we hand it
    exactly the events a worker would read for that task -- those with
    ``seq > inst.through`` up to the task's incoming ``ActivityCompleted`` -- and
    time only ``inst.advance(delta, now)``. The returned commands are checked
    against the recorded history (outside the timing), and ``committed`` is
    called with the recorded marker seq so the next task starts from the state
    the worker would hold. One sample per task; median and p99 are reported,
    plus the medians of the first and last tenth of the samples (a growing cost
    would show an O(history) term in the warm path).
    """
    seqs = [e.seq for e in events]
    check(seqs == list(range(1, len(events) + 1)), "W6: history seqs are not 1..n")
    markers = [e for e in events if e.type is EventType.WORKFLOW_TASK_COMPLETED]
    steps = len(markers) - 1  # task 0 handles WorkflowStarted; task k, step k's completion

    cold_times = [_timed_cold_replay(run_id, wf, events)[0] for _ in range(sizes.w6_cold_repeats)]
    cold_s = statistics.median(cold_times)
    quarter = events[: markers[steps // 4].seq]
    quarter_s = statistics.median(
        _timed_cold_replay(run_id, wf, quarter)[0] for _ in range(sizes.w6_cold_repeats)
    )

    h = steps // 2
    prefix = events[: markers[h].seq]
    _, inst = _timed_cold_replay(run_id, wf, prefix)
    inst.committed(markers[h].seq)
    samples: list[float] = []
    for k in range(h + 1, steps + 1):
        marker = markers[k]
        through = int(marker.data["through"])
        delta = events[inst.through : through]  # seqs inst.through+1 .. through
        check(bool(delta) and delta[-1].type in INCOMING, f"W6: task {k}: bad delta")
        now = time.time()
        t0 = time.perf_counter()
        result = inst.advance(delta, now)
        samples.append(time.perf_counter() - t0)
        recorded = events[through : marker.seq - 1]  # the commands task k committed
        got = [(c.type, c.step) for c in result.commands]
        want = [(e.type, e.step) for e in recorded]
        check(got == want, f"W6: task {k} produced {got}, history has {want}")
        inst.committed(marker.seq)
    check(inst.finished, "W6: warm replay did not finish the run")
    tenth = max(1, len(samples) // 10)
    warm_us = [s * 1e6 for s in samples]
    return {
        "events": len(events),
        "workflow_tasks": len(markers),
        "cold_replay_events": len(events),
        "cold_replay_s": cold_s,
        "cold_replay_s_all": cold_times,
        "cold_us_per_event": cold_s / len(events) * 1e6,
        "cold_quarter_events": len(quarter),
        "cold_quarter_s": quarter_s,
        "cold_quarter_us_per_event": quarter_s / len(quarter) * 1e6,
        "warm_prefix_events": len(prefix),
        "warm_samples": len(samples),
        "warm_p50_us": _percentile(warm_us, 50),
        "warm_p99_us": _percentile(warm_us, 99),
        "warm_first_tenth_p50_us": _percentile(warm_us[:tenth], 50),
        "warm_last_tenth_p50_us": _percentile(warm_us[-tenth:], 50),
        "cold_over_warm": cold_s / (_percentile(warm_us, 50) / 1e6),
    }


async def bench_w6(workdir: Path, sizes: Sizes) -> Result:
    """Build a long real history through the engine, then time replaying it."""
    wf, facts = await _build_history(workdir, sizes.w6_steps)
    events: list[tether.Event] = facts.pop("events")
    expected_events = 3 * sizes.w6_steps + 3
    check(len(events) == expected_events, f"W6: {len(events)} events, expected {expected_events}")
    out: Result = {"steps": sizes.w6_steps, **facts}
    out.update(bench_w6_replay(facts["run_id"], wf, events, sizes))
    return out


# -- driver ---------------------------------------------------------------------


async def run_suite(workdir: Path, sizes: Sizes, log: Callable[[str], None]) -> Result:
    """Every workload once, in order; LIMIT first so the others can be compared to it."""
    cpu_before = calibrate.cpu_calibration_ms()
    log(f"CPU calibration: {cpu_before} ms")
    log("LIMIT: raw SQLite commits ...")
    limit = bench_limit(workdir, sizes)
    log(f"  {limit['commits_per_s']:.0f} commits/s")
    log("W1: sequential runs, started at once ...")
    w1 = await bench_w1(workdir, sizes, limit["commits_per_s"])
    log(f"  {w1['steps_per_s']:.0f} steps/s")
    log("W3: one-step latency ...")
    w3 = await bench_w3(workdir, sizes)
    log(f"  p50 {w3['p50_ms']:.2f} ms")
    log("W6: building a long history, then replaying it ...")
    w6 = await bench_w6(workdir, sizes)
    log(f"  {w6['events']} events, cold {w6['cold_replay_s']:.3f} s")
    more = await workloads.run_more(workdir, sizes is QUICK, log)
    cpu = {"before_ms": cpu_before, "after_ms": calibrate.cpu_calibration_ms()}
    return {"cpu": cpu, "limit": limit, "w1": w1, "w3": w3, "w6": w6, **more}


def _median_of(results: list[Result]) -> Result:
    """Field-wise median of several suite results (non-numeric fields from the first).

    Each figure is its own median, so a ratio is the median of the per-run ratios.
    """
    out: Result = {}
    for key, first in results[0].items():
        values = [r[key] for r in results]
        if isinstance(first, dict):
            out[key] = _median_of(values)
        elif isinstance(first, int | float) and not isinstance(first, bool):
            out[key] = statistics.median(values)
        else:
            out[key] = first
    return out


def _table(res: Result) -> str:
    """The human-readable summary."""
    lim, w1, w3, w6, cpu = res["limit"], res["w1"], res["w3"], res["w6"], res["cpu"]
    rows = [
        (
            "CPU",
            "calibration: fixed Python loop, before / after",
            f"{cpu['before_ms']:.1f} / {cpu['after_ms']:.1f} ms",
        ),
        ("LIMIT", "raw INSERT+COMMIT (WAL, sync=FULL)", f"{lim['commits_per_s']:,.0f} commits/s"),
        ("", "time per durable commit", f"{lim['ms_per_commit']:.2f} ms"),
        ("W1", f"{w1['runs']} runs x {w1['steps_per_run']} steps, wall", f"{w1['wall_s']:.2f} s"),
        ("", "runs/s", f"{w1['runs_per_s']:,.1f}"),
        ("", "steps/s", f"{w1['steps_per_s']:,.0f}"),
        ("", "durable commits per step", f"{w1['commits_per_step']:.3f}"),
        ("", "steps/s / LIMIT", f"{w1['steps_per_s_over_limit']:.2f}"),
        ("", "process CPU per step", f"{w1['cpu_us_per_step']:.0f} us"),
        ("W3", f"one-step run start->result, {w3['runs']} runs", ""),
        ("", "p50", f"{w3['p50_ms']:.2f} ms"),
        ("", "p99", f"{w3['p99_ms']:.2f} ms"),
        ("", "durable commits per run", f"{w3['commits_per_run']:.2f}"),
        ("", "p50 / time per LIMIT commit", f"{w3['p50_ms'] / lim['ms_per_commit']:.1f}"),
        ("W6", f"history of one {w6['steps']}-step run", f"{w6['events']:,} events"),
        ("", "building it (sequential steps/s)", f"{w6['build_steps_per_s']:,.0f}"),
        ("", "cold replay (all events)", f"{w6['cold_replay_s'] * 1000:,.1f} ms"),
        ("", "cold replay per event", f"{w6['cold_us_per_event']:.1f} us"),
        ("", "cold per event, first quarter only", f"{w6['cold_quarter_us_per_event']:.1f} us"),
        ("", f"warm: one more task, p50 of {w6['warm_samples']}", f"{w6['warm_p50_us']:.1f} us"),
        ("", "warm p99", f"{w6['warm_p99_us']:.1f} us"),
        (
            "",
            "warm p50, first / last tenth",
            f"{w6['warm_first_tenth_p50_us']:.1f} / {w6['warm_last_tenth_p50_us']:.1f} us",
        ),
    ]
    rows.extend(workloads.table_rows(res))
    w_a = max(len(r[0]) for r in rows)
    w_b = max(len(r[1]) for r in rows)
    lines = [f"{a:<{w_a}}  {b:<{w_b}}  {c}" for a, b, c in rows]
    rule = "-" * max(len(line) for line in lines)
    return "\n".join([rule, *lines, rule])


def _environment(workdir: Path) -> Result:
    """Where the figures come from; load averages show whether the machine was busy."""
    return {
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "tether": tether.__version__,
        "workdir_parent": str(workdir.parent),
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the suite ``--repeat`` times, print the table and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="about 10x smaller workloads")
    parser.add_argument("--json", type=Path, help="also write the JSON document here")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run the suite N times and report medians"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where to make the temp dir")
    parser.add_argument("--peer", action="store_true", help="also run DBOS Transact (W1-W3, W5)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    sizes = QUICK if args.quick else FULL

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results: list[Result] = []
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="tether-bench-", dir=args.dir) as tmp:
        for i in range(args.repeat):
            workdir = Path(tmp) / f"rep{i}"
            workdir.mkdir()
            if args.repeat > 1:
                log(f"== repeat {i + 1}/{args.repeat}")
            results.append(asyncio.run(run_suite(workdir, sizes, log)))
        peer_note = peer.missing_message() if args.peer else None
        peer_res = None
        if args.peer and peer_note is None:
            peer_runs = [
                asyncio.run(peer.run_peer(Path(tmp) / f"peer{i}", args.quick, log))
                for i in range(args.repeat)
            ]
            peer_res = peer_runs[0] if len(peer_runs) == 1 else _median_of(peer_runs)
        env = _environment(Path(tmp))
    summary = results[0] if len(results) == 1 else _median_of(results)
    doc: Result = {
        "mode": "quick" if args.quick else "full",
        "repeats": args.repeat,
        "aggregation": "single run" if args.repeat == 1 else f"median of {args.repeat} runs",
        "sizes": {**asdict(sizes), **asdict(workloads.QUICK if args.quick else workloads.FULL)},
        "worker_options": WORKER_OPTIONS,
        "environment": {**env, "loadavg_before": load_before},
        "results": summary,
    }
    if args.repeat > 1:
        doc["runs"] = results
    if peer_res is not None:
        doc["peer"] = {**peer_res, "comparison": peer.compare(summary, peer_res)}
        if args.repeat > 1:
            doc["peer"]["runs"] = peer_runs
    text = json.dumps(doc, indent=2)
    print(f"tether bench ({doc['mode']}, {doc['aggregation']})")
    print(_table(summary))
    if peer_res is not None:
        print(peer.table(doc["peer"]["comparison"], peer_res["sizes"]))
    elif peer_note is not None:
        print(peer_note)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
