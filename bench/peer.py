"""``bench/run.py --peer``: DBOS Transact on the same workloads, side by side with tether.

The peer runs in its own virtualenv (``bench/.peer-venv``, made by
``bash bench/setup_peer.sh``), one fresh process and SQLite file per workload
(``bench/peer_dbos.py``, which prints JSON). tether is measured in the same
invocation at the same sizes: W1 and W3 come from the main suite (same sizes),
W2 and W5 are run again here at the peer's sizes. Ratios are tether ÷ DBOS.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import workloads

HERE = Path(__file__).resolve().parent
PEER_VENV = HERE / ".peer-venv"
PEER_PYTHON = PEER_VENV / "bin" / "python"
PEER_SCRIPT = HERE / "peer_dbos.py"

#: W2's queue and get_result polling interval for the tuned DBOS figure (DBOS's default is 1 s).
TUNED_POLL = 0.05

Result = dict[str, Any]
Log = Callable[[str], None]


@dataclass(frozen=True)
class PeerSizes:
    """Workload sizes of the comparison (W1/W3 equal run.py's own W1/W3 sizes)."""

    w1_runs: int
    w1_steps: int
    w2_items: int
    w3_runs: int
    w5_runs: int


FULL = PeerSizes(w1_runs=500, w1_steps=10, w2_items=1_000, w3_runs=200, w5_runs=2_000)
QUICK = PeerSizes(w1_runs=50, w1_steps=10, w2_items=100, w3_runs=20, w5_runs=200)


def missing_message() -> str | None:
    """Why the peer cannot run (and how to fix it), or None when it can."""
    if PEER_PYTHON.exists():
        return None
    return (
        f"peer skipped: {PEER_PYTHON} does not exist. Create the benchmark-only "
        "virtualenv with DBOS Transact by running `bash bench/setup_peer.sh` from the "
        "repository root, then run `bench/run.py --peer` again."
    )


def _peer(workload: str, db: Path, n: int, *extra: str) -> Result:
    """Run one DBOS workload in the peer venv; its JSON result."""
    cmd = [str(PEER_PYTHON), str(PEER_SCRIPT), workload, str(db), "--n", str(n), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"peer {workload} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"peer {workload} printed no JSON:\n{proc.stdout[-2000:]}")
    out: Result = json.loads(lines[-1])
    out["process_wall_s"] = time.perf_counter() - t0
    return out


async def run_peer(workdir: Path, quick: bool, log: Log) -> Result:
    """Every peer workload, plus tether's W2 and W5 at the peer's sizes."""
    sizes = QUICK if quick else FULL
    workdir.mkdir(parents=True, exist_ok=True)
    dbos: Result = {}
    log(f"peer W1: DBOS, {sizes.w1_runs} runs x {sizes.w1_steps} steps ...")
    dbos["w1"] = _peer("w1", workdir / "dbos-w1.db", sizes.w1_runs, "--steps", str(sizes.w1_steps))
    log(f"  {dbos['w1']['steps_per_s']:.0f} steps/s")
    log(f"peer W2: DBOS, fan-out of {sizes.w2_items:,} through a queue (1 s polling) ...")
    dbos["w2_default"] = _peer("w2", workdir / "dbos-w2a.db", sizes.w2_items)
    log(f"  {dbos['w2_default']['steps_per_s']:.0f} items/s")
    log(f"peer W2: DBOS, the same with {TUNED_POLL} s polling ...")
    dbos["w2_tuned"] = _peer(
        "w2", workdir / "dbos-w2b.db", sizes.w2_items, "--queue-poll", str(TUNED_POLL)
    )
    log(f"  {dbos['w2_tuned']['steps_per_s']:.0f} items/s")
    log(f"peer W3: DBOS, {sizes.w3_runs} one-step runs one after another ...")
    dbos["w3"] = _peer("w3", workdir / "dbos-w3.db", sizes.w3_runs)
    log(f"  p50 {dbos['w3']['p50_ms']:.2f} ms")
    log(f"peer W5: DBOS, {sizes.w5_runs:,} workflows waiting in recv ...")
    dbos["w5"] = _peer("w5", workdir / "dbos-w5.db", sizes.w5_runs)
    log(f"  {dbos['w5']['kb_per_waiting_run']:.1f} KiB per workflow")

    tether_side: Result = {}
    log(f"tether W2 at the peer's size ({sizes.w2_items:,}) ...")
    tether_side["w2"] = await asyncio.to_thread(
        workloads.bench_w2_isolated, workdir, sizes.w2_items, 100
    )
    log(f"tether W5 at the peer's size ({sizes.w5_runs:,}) ...")
    tether_side["w5"] = await workloads.bench_w5(workdir, sizes.w5_runs, log)
    return {"sizes": asdict(sizes), "dbos": dbos, "tether": tether_side}


def compare(suite: Result, peer: Result) -> list[Result]:
    """One row per compared figure: tether, DBOS, tether ÷ DBOS and which way is better."""
    d, t = peer["dbos"], peer["tether"]
    w1, w3 = suite["w1"], suite["w3"]
    check = workloads.check
    check(w1["runs"] == peer["sizes"]["w1_runs"], "peer: W1 sizes differ")
    check(w3["runs"] == peer["sizes"]["w3_runs"], "peer: W3 sizes differ")
    specs: list[tuple[str, str, float, float, str]] = [
        ("W1", "steps/s", w1["steps_per_s"], d["w1"]["steps_per_s"], "higher"),
        ("W1", "wall s", w1["wall_s"], d["w1"]["wall_s"], "lower"),
        ("W2", "items/s (DBOS: 1 s polling)", t["w2"]["steps_per_s"],
         d["w2_default"]["steps_per_s"], "higher"),
        ("W2", f"items/s (DBOS: {TUNED_POLL:g} s polling)", t["w2"]["steps_per_s"],
         d["w2_tuned"]["steps_per_s"], "higher"),
        ("W2", "peak RSS growth MiB", t["w2"]["peak_rss_growth_kb"] / 1024,
         d["w2_tuned"]["peak_rss_growth_kb"] / 1024, "lower"),
        ("W3", "p50 ms", w3["p50_ms"], d["w3"]["p50_ms"], "lower"),
        ("W3", "p99 ms", w3["p99_ms"], d["w3"]["p99_ms"], "lower"),
        ("W5", "KiB per waiting run", t["w5"]["worker_kb_per_waiting_run"],
         d["w5"]["kb_per_waiting_run"], "lower"),
        ("W5", "RSS with all waiting MiB", t["w5"]["worker_rss_waiting_kb"] / 1024,
         d["w5"]["rss_waiting_kb"] / 1024, "lower"),
        ("W5", "start -> all waiting s", t["w5"]["start_to_all_blocked_s"],
         d["w5"]["start_to_all_blocked_s"], "lower"),
        ("W5", "signal -> all finished s", t["w5"]["signal_to_all_finished_s"],
         d["w5"]["signal_to_all_finished_s"], "lower"),
        ("W5", "signals/s", t["w5"]["signals_per_s"], d["w5"]["signals_per_s"], "higher"),
    ]  # fmt: skip
    return [
        {
            "workload": w,
            "figure": f,
            "tether": tv,
            "dbos": dv,
            "ratio": tv / dv if dv else float("nan"),
            "better": b,
        }
        for w, f, tv, dv, b in specs
    ]


def table(rows: list[Result], sizes: Result) -> str:
    """The side-by-side table."""
    head = (
        f"tether vs DBOS Transact (SQLite WAL, synchronous=FULL): W1 {sizes['w1_runs']} x "
        f"{sizes['w1_steps']}, W2 {sizes['w2_items']:,}-way fan-out, W3 {sizes['w3_runs']} runs, "
        f"W5 {sizes['w5_runs']:,} waiting"
    )
    lines = [("", "figure", "tether", "DBOS", "tether ÷ DBOS", "better")]
    last = ""
    for r in rows:
        lines.append(
            (
                r["workload"] if r["workload"] != last else "",
                r["figure"],
                _num(r["tether"]),
                _num(r["dbos"]),
                f"{r['ratio']:.2f}",
                r["better"],
            )
        )
        last = r["workload"]
    widths = [max(len(row[i]) for row in lines) for i in range(6)]
    text = [
        "  ".join(
            cell.ljust(widths[i]) if i < 2 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        ).rstrip()
        for row in lines
    ]
    rule = "-" * max(len(line) for line in text)
    return "\n".join([head, rule, text[0], rule, *text[1:], rule])


def _num(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


if __name__ == "__main__":
    print(missing_message() or f"peer interpreter: {PEER_PYTHON}", file=sys.stderr)
