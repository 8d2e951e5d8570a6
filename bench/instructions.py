"""Instructions per W1 step and per W3 run, counted by callgrind: a figure that does
not move with the VM's speed.

Wall-clock figures on these VMs vary by up to 2x from minute to minute, so a change
worth 5% cannot be seen in them. Valgrind's callgrind counts the instructions the
process executes instead, which repeats within about 3% (group commit batches differ
a little from run to run). Each workload is run at two sizes and the difference is
divided by the steps (or runs) in between, so start-up and imports cancel out.

    .venv/bin/python bench/instructions.py            # W1 and W3, about 1 min
    PYTHONPATH=/path/to/other/src .venv/bin/python bench/instructions.py   # another tree

Needs ``valgrind`` (Debian package ``valgrind``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _workload(kind: str, n: int) -> None:
    """Run W1 with ``n`` runs or W3 with ``n`` runs (called inside valgrind)."""
    sys.path.insert(0, str(HERE))
    import run as bench

    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            if kind == "w1":
                sizes = dataclasses.replace(bench.FULL, w1_runs=n)
                await bench.bench_w1(Path(tmp), sizes, 1.0)
            else:
                sizes = dataclasses.replace(bench.FULL, w3_runs=n, w3_warmup=5)
                await bench.bench_w3(Path(tmp), sizes)

    asyncio.run(main())


def _count(kind: str, n: int) -> int:
    """Instructions of one whole process running the workload at size ``n``."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    cmd += [sys.executable, __file__, "--inner", kind, str(n)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    found = re.search(r"I\s+refs:\s+([\d,]+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"valgrind failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> int:
    """Print instructions per W1 step and per W3 run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--inner", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        _workload(args.inner[0], int(args.inner[1]))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: apt-get install valgrind", file=sys.stderr)
        return 2
    w1 = (_count("w1", 120) - _count("w1", 20)) / (100 * 10)
    w3 = (_count("w3", 120) - _count("w3", 20)) / 100
    print(f"W1: {w1:,.0f} instructions per step")
    print(f"W3: {w3:,.0f} instructions per run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
