"""Interleaved rounds of W1 modes, each in its own process, against the raw commit rate.

Shared by the benchmarks that compare configurations of the same workload
(``observability.py``, ``encryption.py``): the machine's speed swings by tens of
percent within minutes, so modes run in turn, in a rotated order each round, and the
medians are compared, each with the raw SQLite commit rate (LIMIT) of the same run.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def raw_limit(seconds: float = 2.0) -> float:
    """LIMIT: raw SQLite INSERT+COMMIT per second on this machine, now."""
    sys.path.insert(0, str(HERE))
    import run as bench_run

    with tempfile.TemporaryDirectory() as d:
        sizes = bench_run.Sizes(
            limit_seconds=seconds,
            limit_commits=5_000,
            w1_runs=0,
            w1_steps=0,
            w3_runs=0,
            w3_warmup=0,
            w6_steps=0,
            w6_cold_repeats=0,
        )
        return float(bench_run.bench_limit(Path(d), sizes)["commits_per_s"])


def interleave(
    script: str,
    modes: tuple[str, ...],
    repeat: int,
    quick: bool,
    order: Callable[[int], tuple[str, ...]] | None = None,
) -> dict[str, list[dict[str, Any]]] | None:
    """Run ``script --child MODE`` for every mode, ``repeat`` rounds, the order rotated
    each round (or ``order(round)``); each child prints one JSON line with
    ``steps_per_s`` and ``cpu_us_per_step``. None if a child failed (its stderr printed)."""
    got: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(repeat):
        turn = order(r) if order else modes[r % len(modes) :] + modes[: r % len(modes)]
        for mode in turn:
            cmd = [sys.executable, script, "--child", mode] + (["--quick"] if quick else [])
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                print(res.stderr, file=sys.stderr)
                return None
            one = json.loads(res.stdout.strip().splitlines()[-1])
            got[mode].append(one)
            extra = f" spans={one['spans']}" if "spans" in one else ""
            print(
                f"round {r + 1} {mode:10} {one['steps_per_s']:8,.0f} steps/s "
                f"{one['cpu_us_per_step']:6.0f} us CPU/step{extra}"
            )
    return got


def medians(got: dict[str, list[dict[str, Any]]], base_mode: str, limit: float) -> None:
    """Print each mode's median steps/s and CPU per step, against ``base_mode`` and LIMIT."""
    base = statistics.median(x["steps_per_s"] for x in got[base_mode])
    base_cpu = statistics.median(x["cpu_us_per_step"] for x in got[base_mode])
    label = f"/ {base_mode}"
    print(f"{'mode':10} {'steps/s':>9} {label:>9} {'/ LIMIT':>8} {'CPU us/step':>12} {label:>9}")
    for mode, rounds in got.items():
        sps = statistics.median(x["steps_per_s"] for x in rounds)
        cpu = statistics.median(x["cpu_us_per_step"] for x in rounds)
        print(
            f"{mode:10} {sps:9,.0f} {sps / base:9.2f} {sps / limit:8.2f} {cpu:12.0f} "
            f"{cpu / base_cpu:9.2f}"
        )


def paired(got: dict[str, list[dict[str, Any]]], mode: str, base: str) -> list[float]:
    """Per round, ``mode``'s steps/s over ``base``'s of the same round (run next to
    each other: the machine's drift between rounds cancels out of each ratio)."""
    return [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(got[mode], got[base], strict=True)]
