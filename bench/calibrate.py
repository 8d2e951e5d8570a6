"""A fixed pure-Python workload, timed: how fast this machine's CPU is right now.

The VMs these benchmarks run on change speed from session to session (and from
minute to minute), by up to 2x. Engine figures are CPU-bound Python, so a figure
is only comparable across machines next to this one: a run whose calibration
took 1.5x as long ran on a CPU about 1.5x slower. Both ``bench/run.py`` and
``bench/pg_scaling.py`` measure it before and after their workloads.
"""

from __future__ import annotations

import statistics
import time


def _work() -> int:
    """Dict, list, string and integer work, roughly the mix an engine step does."""
    table: dict[int, str] = {}
    total = 0
    for i in range(60_000):
        key = i % 997
        table[key] = f"k{i}"
        total += (i * i) % 7 + len(table[key])
    items = sorted(table.values())
    return total + len(items)


def cpu_calibration_ms(repeats: int = 7) -> float:
    """Median milliseconds of ``_work`` over ``repeats`` runs (lower: a faster CPU)."""
    _work()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _work()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1000, 2)


if __name__ == "__main__":
    print(f"{cpu_calibration_ms()} ms")
