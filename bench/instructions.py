"""Instructions per W1 step and per W3 run, counted by callgrind: a figure that does
not move with the VM's speed.

Wall-clock figures on these VMs vary by up to 2x from minute to minute, so a change
worth 5% cannot be seen in them. Valgrind's callgrind counts the instructions the
process executes instead, which repeats within about 3% (group commit batches differ
a little from run to run). Each workload is run at two sizes and the difference is
divided by the steps (or runs) in between, so start-up and imports cancel out.

    .venv/bin/python bench/instructions.py            # W1 and W3, about 1 min
    PYTHONPATH=/path/to/other/src .venv/bin/python bench/instructions.py   # another tree
    .venv/bin/python bench/instructions.py --mode all --repeat 2   # W1 per encryption mode

``--mode`` (repeatable, or ``all``) runs W1 in the modes of ``bench/encryption.py``
(plain, sealed, tenants, per-tenant, known-tenants: the same keys, keyring file and
tenants) and prints the ratios sealed / plain, per-tenant / tenants and known-tenants /
tenants of those measured.

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
    """Run W1 with ``n`` runs or W3 with ``n`` runs (called inside valgrind); a kind of
    ``w1:<mode>`` runs W1 in that mode of ``bench/encryption.py``."""
    sys.path.insert(0, str(HERE))
    import encryption
    import run as bench

    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            if kind.startswith("w1:"):
                mode = kind[3:]
                encryption.setup(mode, Path(tmp))
                await encryption._w1(Path(tmp) / "w1.db", n, 10, mode, count_sealed=False)
            elif kind == "w1":
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


def _w1_step(kind: str) -> float:
    """Instructions per W1 step: the slope between 20 and 120 runs of 10 steps."""
    return (_count(kind, 120) - _count(kind, 20)) / (100 * 10)


#: the encryption modes compared, each against its baseline
_PAIRS = (("sealed", "plain"), ("per-tenant", "tenants"), ("known-tenants", "tenants"))


def _modes(modes: list[str], repeat: int) -> None:
    """W1 per step in each of ``modes`` (``repeat`` times each, interleaved), then the
    ratios of each pair measured (of the medians)."""
    import statistics

    sys.path.insert(0, str(HERE))
    from encryption import MODES

    wanted = list(MODES) if "all" in modes else [m for m in MODES if m in modes]
    got: dict[str, list[float]] = {m: [] for m in wanted}
    for r in range(repeat):
        for mode in wanted:
            got[mode].append(_w1_step(f"w1:{mode}"))
            print(f"round {r + 1} {mode:14} {got[mode][-1]:12,.0f} instructions per W1 step")
    print("\nmedians:")
    mid = {m: statistics.median(v) for m, v in got.items()}
    for mode, per in mid.items():
        spread = f"  ({min(got[mode]):,.0f}..{max(got[mode]):,.0f})" if repeat > 1 else ""
        print(f"  {mode:14} {per:12,.0f}{spread}")
    for mode, base in _PAIRS:
        if mode in mid and base in mid:
            print(f"  {mode + ' / ' + base:26} {mid[mode] / mid[base]:.3f}")


def main() -> int:
    """Print instructions per W1 step and per W3 run (or per W1 step in each mode)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--inner", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--mode",
        action="append",
        choices=("all", "plain", "sealed", "tenants", "per-tenant", "known-tenants"),
        help="W1 in this mode of bench/encryption.py (repeatable; all: every mode)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each --mode")
    args = parser.parse_args()
    if args.inner:
        _workload(args.inner[0], int(args.inner[1]))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: apt-get install valgrind", file=sys.stderr)
        return 2
    for name in ("TETHER_ENCRYPTION_KEYS", "TETHER_KEYRING"):
        os.environ.pop(name, None)  # each mode sets its own
    if args.mode:
        _modes(args.mode, args.repeat)
        return 0
    w1 = _w1_step("w1")
    w3 = (_count("w3", 120) - _count("w3", 20)) / 100
    print(f"W1: {w1:,.0f} instructions per step")
    print(f"W3: {w3:,.0f} instructions per run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
