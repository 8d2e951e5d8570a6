"""More tether workloads for ``bench/run.py``: W2 fan-out, W4 crash recovery, W5 waiting runs.

* W2: one run fans out ``tether.map(noop, range(n), concurrency=100)``: wall time,
  steps/s and the process's peak RSS (memory must stay bounded as it goes).
* W4: runs of sequential 20 ms steps served by a worker *subprocess*
  (``bench/tether_worker.py``), SIGKILLed mid-flight and restarted: time to first
  progress, total recovery time, and how many recorded steps ran again (must be 0).
* W5: many runs blocked in ``tether.wait_event("go")`` in a worker subprocess: its
  RSS, the time to start them all, then the time to signal each and see all finish.

Every workload checks its results (return values, side-table counts) and raises
``RuntimeError`` instead of reporting a figure when a check fails.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tether
from tether import EventType

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tether_worker  # the worker subprocess's app, shared with the client

HERE = Path(__file__).resolve().parent

Result = dict[str, Any]
Log = Callable[[str], None]

#: The in-process worker of W2 (the same options as W1 in ``run.py``).
W2_WORKER_OPTIONS: dict[str, Any] = {"concurrency": 100, "lease": 30.0, "poll_interval": 0.25}


@dataclass(frozen=True)
class MoreSizes:
    """How big W2, W4 and W5 are; ``--quick`` uses ``QUICK`` (about 10x smaller)."""

    w2_items: int
    w2_concurrency: int
    w4_runs: int
    w4_steps: int
    w4_kill_after_s: float  #: SIGKILL this long after the first step started executing
    w4_leases: tuple[float | None, ...]  #: None: the worker's default lease (15 s)
    w5_runs: int


FULL = MoreSizes(
    w2_items=10_000,
    w2_concurrency=100,
    w4_runs=200,
    w4_steps=10,
    w4_kill_after_s=1.0,
    w4_leases=(None, 2.0),
    w5_runs=10_000,
)
# quick: the default-lease variant is skipped (it only waits out a 15 s lease)
QUICK = MoreSizes(
    w2_items=1_000,
    w2_concurrency=100,
    w4_runs=20,
    w4_steps=10,
    w4_kill_after_s=0.1,
    w4_leases=(2.0,),
    w5_runs=1_000,
)


def check(ok: bool, message: str) -> None:
    """Fail the benchmark if a result is wrong (unlike ``assert``, kept under ``-O``)."""
    if not ok:
        raise RuntimeError(message)


# -- memory -----------------------------------------------------------------------


def proc_memory_kb(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS`` (resident now) and ``VmHWM`` (peak resident) of a process, in KiB."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


# -- W2 ---------------------------------------------------------------------------


async def bench_w2(workdir: Path, items: int, concurrency: int, log: Log) -> Result:
    """One run fanning out ``items`` no-op activities, at most ``concurrency`` at a time."""
    app = tether.App(store=f"sqlite:///{workdir / f'w2-{items}.db'}")

    @app.activity
    async def noop(x: int) -> int:
        """Return the input: a step whose whole cost is engine overhead."""
        return x

    @app.workflow
    async def fan_out(n: int, width: int) -> list[int]:
        """``tether.map`` over ``range(n)``; returns [count of ok items, sum of values]."""
        outcomes = await tether.map(noop, range(n), concurrency=width)
        return [sum(1 for o in outcomes if o.ok), sum(o.value or 0 for o in outcomes)]

    samples: list[tuple[int, int]] = []  # (activities done, RSS KiB)
    try:
        async with app.worker(**W2_WORKER_OPTIONS) as worker:

            async def sample() -> None:
                while True:
                    samples.append((worker.stats["activities"], proc_memory_kb()["VmRSS"]))
                    await asyncio.sleep(0.02)

            base = proc_memory_kb()["VmRSS"]
            peak_reset = reset_peak_rss()
            sampler = asyncio.create_task(sample())
            t0 = time.perf_counter()
            run = await app.start(fan_out, items, concurrency, run_id=f"w2-{items}")
            value = await run.result(timeout=3600)
            wall = time.perf_counter() - t0
            sampler.cancel()
            mem = proc_memory_kb()
            samples.append((worker.stats["activities"], mem["VmRSS"]))
            wstats = dict(worker.stats)
        history = await app.store.read_history(f"w2-{items}", 0)
    finally:
        await app.close()
    check(value == [items, sum(range(items))], f"W2: the run returned {value}")
    check(wstats.get("activities") == items, f"W2: {wstats.get('activities')} activities ran")
    peak = mem["VmHWM"] if peak_reset else max(rss for _, rss in samples)

    def rss_at(fraction: float) -> int:
        """RSS of the first sample taken once ``fraction`` of the items had completed."""
        return next(rss for done, rss in samples if done >= fraction * items)

    return {
        "items": items,
        "concurrency": concurrency,
        "wall_s": wall,
        "steps_per_s": items / wall,
        "events": len(history),
        "workflow_tasks": wstats.get("workflow_tasks", 0),
        "rss_before_kb": base,
        "peak_rss_kb": peak,
        "peak_rss_growth_kb": peak - base,
        "peak_measured_by": "VmHWM after clear_refs" if peak_reset else "max of 20 ms samples",
        "rss_at_10pct_kb": rss_at(0.1),
        "rss_at_50pct_kb": rss_at(0.5),
        "rss_at_100pct_kb": rss_at(1.0),
        "worker_stats": wstats,
    }


def bench_w2_isolated(workdir: Path, items: int, concurrency: int) -> Result:
    """``bench_w2`` in a fresh interpreter, so its RSS figures are W2's alone.

    In the benchmark's own process, memory freed by earlier workloads would be
    reused by W2 and hide its growth (the peer's W2 also runs in its own process).
    """
    cmd = [sys.executable, str(HERE / "workloads.py"), "w2", str(workdir), str(items)]
    proc = subprocess.run([*cmd, str(concurrency)], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"W2 subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    out: Result = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# -- worker subprocesses (W4, W5) ------------------------------------------------


def _spawn_worker(db: Path, effects: Path, lease: float | None) -> subprocess.Popen[str]:
    """Start ``bench/tether_worker.py``; returns once it printed ``ready``."""
    cmd = [sys.executable, str(HERE / "tether_worker.py"), str(db), str(effects)]
    if lease is not None:
        cmd += ["--lease", str(lease)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise RuntimeError(f"the worker subprocess did not start: {line!r} {err[-2000:]}")
    return proc


def _stop_worker(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _scalar(db: Path, sql: str, args: tuple[Any, ...] = ()) -> Any:
    """One value from a read-only query on a SQLite file (a benchmark probe, not the API)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return conn.execute(sql, args).fetchone()[0]
    except sqlite3.OperationalError:  # the file or table does not exist yet
        return None
    finally:
        conn.close()


async def _wait_until(
    probe: Callable[[], bool],
    what: str,
    timeout: float,
    proc: subprocess.Popen[str] | None,
    every: float = 0.01,
) -> float:
    """Poll ``probe`` every ``every`` s; return ``time.time()`` when it first held."""
    deadline = time.monotonic() + timeout
    while not probe():
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"the worker subprocess exited while waiting for {what}: {err}")
        check(time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(every)
    return time.time()


# -- W4 ---------------------------------------------------------------------------


def _executions(effects: Path) -> dict[tuple[str, int], int]:
    """How many times each (run_id, step) started executing, from the side table."""
    if not effects.exists():
        return {}
    conn = sqlite3.connect(effects, timeout=30)
    try:
        rows = conn.execute("SELECT run_id, step, count(*) FROM effects GROUP BY run_id, step")
        return {(r, s): n for r, s, n in rows.fetchall()}
    except sqlite3.OperationalError:
        return {}
    finally:
        conn.close()


async def bench_w4(workdir: Path, sizes: MoreSizes, lease: float | None, log: Log) -> Result:
    """Kill a worker subprocess mid-flight, restart it, and time the recovery."""
    tag = "default" if lease is None else f"{lease:g}"
    db, effects = workdir / f"w4-{tag}.db", workdir / f"w4-{tag}-effects.db"
    client = tether_worker.make_app(str(db))
    wf = client.get_workflow("recovery_run")
    run_ids = [f"w4-{i}" for i in range(sizes.w4_runs)]
    total = sizes.w4_runs * sizes.w4_steps
    try:
        await asyncio.gather(
            *(client.start(wf, rid, sizes.w4_steps, run_id=rid) for rid in run_ids)
        )
        first = _spawn_worker(db, effects, lease)
        try:
            t_first_exec = await _wait_until(
                lambda: bool(_executions(effects)), "the first step", 60, first
            )
            await asyncio.sleep(max(0.0, t_first_exec + sizes.w4_kill_after_s - time.time()))
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        t_kill = time.time()
        check(first.returncode == -signal.SIGKILL, f"W4: worker exit code {first.returncode}")

        # what history says had completed when the worker died
        recorded: set[tuple[str, int]] = set()
        seq_at_kill: dict[str, int] = {}
        for rid in run_ids:
            events = await client.store.read_history(rid, 0)
            seq_at_kill[rid] = events[-1].seq if events else 0
            recorded.update(
                (rid, e.step)
                for e in events
                if e.type is EventType.ACTIVITY_COMPLETED and e.step is not None
            )
        ran_before = _executions(effects)
        started_before = sum(ran_before.values())
        check(
            0 < len(recorded) < total,
            f"W4: {len(recorded)} of {total} steps were recorded at the kill; "
            "the kill must land mid-flight",
        )

        t_restart = time.time()
        second = _spawn_worker(db, effects, lease)
        t_ready = time.time()
        try:
            n = sizes.w4_runs
            await _wait_until(
                lambda: _scalar(db, "SELECT count(*) FROM runs WHERE status = 'completed'") == n,
                "every W4 run to complete",
                600,
                second,
            )
        finally:
            _stop_worker(second)

        # per unfinished run: when its first step completed after the restart
        progressed: list[float] = []
        completed_at: list[float] = []
        for rid in run_ids:
            check(await client.get_run(rid).result(timeout=5) == sum(range(sizes.w4_steps)), rid)
            info = await client.get(rid)
            assert info.completed_at is not None
            completed_at.append(info.completed_at)
            new = await client.store.read_history(rid, seq_at_kill[rid])
            done = [e.created_at for e in new if e.type is EventType.ACTIVITY_COMPLETED]
            if done:
                progressed.append(min(done))
        check(bool(progressed), "W4: no step completed after the restart")
    finally:
        await client.close()

    after = _executions(effects)
    check(len(after) == total, f"W4: {len(after)} of {total} steps ever ran")
    rerun_recorded = sorted(k for k in recorded if after[k] != ran_before[k])
    check(not rerun_recorded, f"W4: recorded steps ran again after the restart: {rerun_recorded}")
    rerun_inflight = sum(1 for k, n in ran_before.items() if k not in recorded and after[k] > n)
    return {
        "runs": sizes.w4_runs,
        "steps_per_run": sizes.w4_steps,
        "step_s": tether_worker.STEP_SECONDS,
        "lease_s": lease if lease is not None else 15.0,
        "lease_setting": "worker default" if lease is None else f"lease={lease:g}",
        "killed_after_s": t_kill - t_first_exec,
        "steps_recorded_at_kill": len(recorded),
        "steps_started_at_kill": started_before,
        "restart_to_ready_s": t_ready - t_restart,
        "first_progress_s": min(progressed) - t_restart,
        "runs_unfinished_at_kill": len(progressed),
        "all_unfinished_progressed_s": max(progressed) - t_restart,
        "recovery_s": max(completed_at) - t_restart,
        "recorded_steps_rerun": len(rerun_recorded),
        "inflight_steps_rerun": rerun_inflight,
        "executions_total": sum(after.values()),
    }


# -- W5 ---------------------------------------------------------------------------


async def bench_w5(workdir: Path, runs: int, log: Log) -> Result:
    """``runs`` runs blocked in ``wait_event`` in a worker subprocess; then signal them all."""
    db = workdir / f"w5-{runs}.db"
    client = tether_worker.make_app(str(db))
    wf = client.get_workflow("waiter")
    _ = client.store  # create the schema before the worker opens the file
    run_ids = [f"w5-{i}" for i in range(runs)]
    marker = EventType.WORKFLOW_TASK_COMPLETED.value
    proc = _spawn_worker(db, workdir / "w5-effects.db", None)
    try:
        await asyncio.sleep(0.5)  # let the idle worker settle before its baseline
        idle = proc_memory_kb(proc.pid)

        def blocked() -> bool:
            # every run was created with a workflow task; none is left once all have
            # run their first workflow task, which ends in wait_event (an index probe)
            return _scalar(db, "SELECT count(*) FROM tasks WHERE kind = 'workflow'") == 0

        t0 = time.time()
        await asyncio.gather(*(client.start(wf, i, run_id=rid) for i, rid in enumerate(run_ids)))
        t_started = time.time()
        t_blocked = await _wait_until(blocked, "every W5 run to block", 900, proc, 0.02)
        sql = "SELECT count(DISTINCT run_id) FROM events WHERE type = ?"
        check(_scalar(db, sql, (marker,)) == runs, "W5: not every run ran its first task")
        check(
            _scalar(db, "SELECT count(*) FROM runs WHERE status = 'completed'") == 0,
            "W5: a run finished before its signal",
        )
        await asyncio.sleep(0.5)  # anything still settling shows up in the RSS
        waiting = proc_memory_kb(proc.pid)

        t1 = time.time()
        await asyncio.gather(*(client.signal(rid, "go", 1) for rid in run_ids))
        t_signalled = time.time()
        t_done = await _wait_until(
            lambda: _scalar(db, "SELECT count(*) FROM runs WHERE status = 'completed'") == runs,
            "every W5 run to finish",
            900,
            proc,
            0.02,
        )
        after = proc_memory_kb(proc.pid)
    finally:
        _stop_worker(proc)
    try:
        infos = await client.list(status="completed", workflow="waiter", limit=runs + 1)
        check(len(infos) == runs, f"W5: {len(infos)} of {runs} runs completed")
        for info in infos:
            i = int(info.run_id.split("-")[1])
            value = wf.sig.decode_result(info.output)
            check(value == i + 1, f"W5: run {info.run_id} returned {value}")
    finally:
        await client.close()
    grown = waiting["VmRSS"] - idle["VmRSS"]
    return {
        "runs": runs,
        "worker_rss_idle_kb": idle["VmRSS"],
        "worker_rss_waiting_kb": waiting["VmRSS"],
        "worker_rss_growth_kb": grown,
        "worker_kb_per_waiting_run": grown / runs,
        "worker_peak_rss_kb": after["VmHWM"],
        "worker_rss_after_kb": after["VmRSS"],
        "start_calls_s": t_started - t0,
        "start_to_all_blocked_s": t_blocked - t0,
        "starts_per_s": runs / (t_blocked - t0),
        "signal_calls_s": t_signalled - t1,
        "signal_to_all_finished_s": t_done - t1,
        "signals_per_s": runs / (t_done - t1),
    }


# -- driver -----------------------------------------------------------------------


async def run_more(workdir: Path, quick: bool, log: Log) -> Result:
    """W2, W4 (one result per lease setting) and W5, in that order."""
    sizes = QUICK if quick else FULL
    log(f"W2: one run fanning out {sizes.w2_items:,} activities ...")
    w2 = await asyncio.to_thread(bench_w2_isolated, workdir, sizes.w2_items, sizes.w2_concurrency)
    log(f"  {w2['steps_per_s']:.0f} steps/s, peak RSS +{w2['peak_rss_growth_kb'] / 1024:.1f} MiB")
    w4: Result = {}
    for lease in sizes.w4_leases:
        key = "lease_default" if lease is None else f"lease_{lease:g}"
        log(f"W4: SIGKILL and restart a worker subprocess ({key}) ...")
        w4[key] = await bench_w4(workdir, sizes, lease, log)
        log(
            f"  first progress {w4[key]['first_progress_s']:.2f} s, "
            f"recovered in {w4[key]['recovery_s']:.2f} s"
        )
    log(f"W5: {sizes.w5_runs:,} runs waiting for a signal in a worker subprocess ...")
    w5 = await bench_w5(workdir, sizes.w5_runs, log)
    log(f"  {w5['worker_kb_per_waiting_run']:.1f} KiB per run, {w5['signals_per_s']:.0f} signals/s")
    return {"w2": w2, "w4": w4, "w5": w5}


def table_rows(res: Result) -> list[tuple[str, str, str]]:
    """Rows for ``run.py``'s table (empty when the suite has no W2/W4/W5 results)."""
    if "w2" not in res:
        return []
    w2, w5 = res["w2"], res["w5"]
    mib = 1024.0
    rows: list[tuple[str, str, str]] = [
        ("W2", f"one run, map over {w2['items']:,} no-ops, concurrency {w2['concurrency']}", ""),
        ("", "wall", f"{w2['wall_s']:.2f} s"),
        ("", "steps/s", f"{w2['steps_per_s']:,.0f}"),
        ("", "peak RSS of the process (growth)", _mem(w2["peak_rss_kb"], w2["peak_rss_growth_kb"])),
        (
            "",
            "RSS at 10% / 50% / 100% of items",
            f"{w2['rss_at_10pct_kb'] / mib:.1f} / {w2['rss_at_50pct_kb'] / mib:.1f} / "
            f"{w2['rss_at_100pct_kb'] / mib:.1f} MiB",
        ),
    ]
    for w4 in res["w4"].values():
        rows += [
            (
                "W4",
                f"{w4['runs']} runs x {w4['steps_per_run']} steps of 20 ms, "
                f"SIGKILL + restart, {w4['lease_setting']} ({w4['lease_s']:g} s)",
                "",
            ),
            ("", "steps recorded / started at the kill", _pair(w4)),
            ("", "restart -> worker ready", f"{w4['restart_to_ready_s']:.2f} s"),
            ("", "restart -> first new ActivityCompleted", f"{w4['first_progress_s']:.2f} s"),
            (
                "",
                f"restart -> all {w4['runs_unfinished_at_kill']} unfinished runs progressed",
                f"{w4['all_unfinished_progressed_s']:.2f} s",
            ),
            ("", "restart -> all runs complete", f"{w4['recovery_s']:.2f} s"),
            ("", "recorded steps executed again", f"{w4['recorded_steps_rerun']}"),
            ("", "in-flight (unrecorded) steps executed again", f"{w4['inflight_steps_rerun']}"),
        ]
    rows += [
        ("W5", f"{w5['runs']:,} runs blocked in wait_event, worker subprocess", ""),
        ("", "worker RSS idle -> all waiting", _mem(w5["worker_rss_waiting_kb"], None, w5)),
        ("", "worker memory per waiting run", f"{w5['worker_kb_per_waiting_run']:.1f} KiB"),
        ("", "start -> all blocked", f"{w5['start_to_all_blocked_s']:.2f} s"),
        ("", "runs started and blocked per s", f"{w5['starts_per_s']:,.0f}"),
        ("", "first signal -> all finished", f"{w5['signal_to_all_finished_s']:.2f} s"),
        ("", "signals/s (delivered and finished)", f"{w5['signals_per_s']:,.0f}"),
    ]
    return rows


def _mem(kb: float, growth_kb: float | None, w5: Result | None = None) -> str:
    if w5 is not None:
        return f"{w5['worker_rss_idle_kb'] / 1024:.1f} -> {kb / 1024:.1f} MiB"
    return f"{kb / 1024:.1f} MiB (+{(growth_kb or 0) / 1024:.1f})"


def _pair(w4: Result) -> str:
    total = w4["runs"] * w4["steps_per_run"]
    return f"{w4['steps_recorded_at_kill']:,} / {w4['steps_started_at_kill']:,} of {total:,}"


def _main(argv: list[str]) -> int:
    """``workloads.py w2 DIR ITEMS CONCURRENCY``: W2 alone, one JSON line on stdout
    (used by ``bench_w2_isolated``); ``workloads.py [--quick]``: W2, W4 and W5."""
    log: Log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if argv[:1] == ["w2"]:
        workdir, items, width = Path(argv[1]), int(argv[2]), int(argv[3])
        print(json.dumps(asyncio.run(bench_w2(workdir, items, width, log))))
        return 0
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tether-bench-more-") as tmp:
        out = asyncio.run(run_more(Path(tmp), "--quick" in argv, log))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
