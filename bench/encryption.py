"""What encryption at rest costs: W1 (runs of sequential no-op steps on SQLite) with
payloads stored as they are, sealed under one key, and sealed per tenant (ten tenants,
a key each), each mode in its own process, interleaved and repeated, against the raw
commit rate (LIMIT) of the same machine in the same run.

* ``plain``: no keyring (the baseline);
* ``sealed``: ``TETHER_ENCRYPTION_KEYS`` (AES-256-GCM, one key): every event, input,
  output and argument sealed as it is written and opened as it is read;
* ``tenants``: no keyring, the runs spread over ten tenants (the baseline of the next);
* ``per-tenant``: a per-tenant keyring file, the runs spread over ten tenants it has
  no key for yet (each key is made, and the file written, as the tenant first writes);
* ``known-tenants``: the same with the ten tenants' keys made before the timed part
  (tenants seen before: a deployment's steady state).

Target (issue #21): ``sealed`` under 10% slower than ``plain`` (and ``per-tenant``
than ``tenants``: runs with tenants do more work of their own, admission and quotas);
``known-tenants`` against ``tenants`` is printed beside it. The machine's speed drifts by
tens of percent within minutes, so each compared pair runs side by side in every round
(the order reversed every other round) and the ratio is taken per round: the median of
those paired ratios is the figure; the ratio of the modes' medians is printed too.

    .venv/bin/python bench/encryption.py [--quick] [--repeat N]
    .venv/bin/python bench/encryption.py --alternate TURNS

``--alternate``: sealed | plain and known-tenants | tenants in one process instead, each
mode an App of its own (its keyring given to the App), taking turns of W1 (300 runs x
10 steps, ``--turn-runs``), the order swapped each turn: the two runs of a turn are
under a second apart, where the default's are seconds apart, and the median of many
turns' ratios is the figure (turns of 100 runs spread twice as wide: a turn's start and
end weigh more). (``per-tenant``, keys made in the timed part, is left to the default.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODES = ("plain", "sealed", "tenants", "per-tenant", "known-tenants")


async def _w1(
    db: Path, runs_n: int, steps_n: int, mode: str, *, count_sealed: bool = True
) -> dict[str, Any]:
    """W1 in ``mode`` (``setup`` done first); ``count_sealed``: count the sealed events
    (a scan of the history) rather than look at one run's input."""
    sys.path.insert(0, str(HERE))
    import run as bench_run  # W1's own app and workflow

    app, sequential = bench_run._make_app(db)
    tenants = mode in ("tenants", "per-tenant", "known-tenants")
    try:
        async with app.worker(**bench_run.WORKER_OPTIONS):
            t0 = time.perf_counter()
            cpu0 = time.process_time()
            results = await _run_w1(app, sequential, runs_n, steps_n, "w1", tenants)
            wall = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
        query = (
            "SELECT count(*) FROM events WHERE data LIKE '%~e1:%'"
            if count_sealed
            else "SELECT count(*) FROM runs WHERE run_id = 'w1-0' AND input LIKE '~e1:%'"
        )
        sealed = await app.store._do(  # type: ignore[attr-defined]
            lambda tx: tx.execute(query).fetchone()[0], write=False
        )
    finally:
        await app.close()
    expected = [bench_run._expected(steps_n, i) for i in range(runs_n)]
    if results != expected:
        raise RuntimeError(f"{mode}: wrong results")
    if (mode in ("sealed", "per-tenant", "known-tenants")) != (sealed > 0):
        raise RuntimeError(f"{mode}: {sealed} sealed events")
    steps = runs_n * steps_n
    return {
        "mode": mode,
        "steps_per_s": steps / wall,
        "cpu_us_per_step": 1e6 * cpu / steps,
        "sealed_events": sealed,
    }


async def _run_w1(
    app: Any, sequential: Any, runs_n: int, steps_n: int, prefix: str, tenants: bool
) -> list[int]:
    """Start W1's runs (spread over ten tenants if ``tenants``) and wait for their results."""
    runs = await asyncio.gather(
        *(
            app.start(
                sequential,
                steps_n,
                i,
                run_id=f"{prefix}-{i}",
                tenant=f"tenant-{i % 10}" if tenants else None,
            )
            for i in range(runs_n)
        )
    )
    return list(await asyncio.gather(*(r.result(timeout=600) for r in runs)))


def setup(mode: str, folder: Path) -> None:
    """Set this process up for ``mode``: the key in the environment, or a keyring file
    in ``folder`` (``bench/instructions.py --mode`` does the same)."""
    if mode == "sealed":
        from tether.encryption import new_key

        os.environ["TETHER_ENCRYPTION_KEYS"] = f"k1={new_key()}"
    elif mode in ("per-tenant", "known-tenants"):
        from tether.encryption import FileKeyring

        ring = FileKeyring.create(folder / "keys.json", per_tenant=True)
        if mode == "known-tenants":
            for i in range(10):
                ring.current(f"tenant-{i}")  # made now, outside the timed part
        os.environ["TETHER_KEYRING"] = str(folder / "keys.json")


def _child(mode: str, runs_n: int, steps_n: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        setup(mode, Path(d))
        out = asyncio.run(_w1(Path(d) / "w1.db", runs_n, steps_n, mode))
    print(json.dumps(out))


def _alternating_app(folder: Path, mode: str) -> tuple[Any, Any]:
    """W1's app (``bench/run.py``) on its own file, ``mode``'s keyring given to the App
    itself, so modes with different keyrings live in one process."""
    from tether.encryption import FileKeyring, Keyring, StaticKeyring, new_key

    keyring: Keyring | None = None
    if mode == "sealed":
        keyring = StaticKeyring.parse(f"k1={new_key()}")
    elif mode == "known-tenants":
        ring = FileKeyring.create(folder / "keys.json", per_tenant=True)
        for i in range(10):
            ring.current(f"tenant-{i}")  # made now, outside the timed part
        keyring = ring
    sys.path.insert(0, str(HERE))
    import run as bench_run

    return bench_run._make_app(folder / f"{mode}.db", encryption=keyring)


async def _alternating(folder: Path, turns: int, runs_n: int, steps_n: int) -> dict[str, Any]:
    """sealed | plain and known-tenants | tenants in this one process, each mode an App of
    its own, kept open: every turn runs a short W1 on each of a pair, the order swapped
    each turn, so the two runs of a turn are a fraction of a second apart and the VM's
    drift, which moves a run by tens of percent within seconds, touches both alike."""
    sys.path.insert(0, str(HERE))
    import run as bench_run

    modes = ("plain", "sealed", "tenants", "known-tenants")
    apps = {m: _alternating_app(folder, m) for m in modes}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for turn in range(turns):
            for pair in (("plain", "sealed"), ("tenants", "known-tenants")):
                for mode in pair if turn % 2 == 0 else pair[::-1]:
                    app, sequential = apps[mode]
                    tenants = mode != "plain" and mode != "sealed"
                    async with app.worker(**bench_run.WORKER_OPTIONS):
                        t0 = time.perf_counter()
                        got = await _run_w1(app, sequential, runs_n, steps_n, f"w1-{turn}", tenants)
                        rates[mode].append(runs_n * steps_n / (time.perf_counter() - t0))
                    if got != [bench_run._expected(steps_n, i) for i in range(runs_n)]:
                        raise RuntimeError(f"{mode}: wrong results")
        for mode in ("sealed", "known-tenants"):  # sealed indeed: no plaintext input
            app = apps[mode][0]
            row = await app.store._do(
                lambda tx: tx.execute("SELECT input FROM runs LIMIT 1").fetchone(), write=False
            )
            if not str(row[0]).startswith("~e1:"):
                raise RuntimeError(f"{mode}: a run's input is not sealed: {row[0]!r}")
    finally:
        for app, _ in apps.values():
            await app.close()
    return rates


def _report_alternating(rates: dict[str, Any], runs_n: int, steps_n: int) -> None:
    turns = len(rates["plain"])
    print(f"\nW1 {runs_n} runs x {steps_n} steps a turn, {turns} turns, one process:")
    for mode, values in rates.items():
        print(f"  {mode:<14} median {statistics.median(values):8,.0f} steps/s")
    print("each turn's ratio of the pair's two runs (median, quartiles, range):")
    for mode, base in (("sealed", "plain"), ("known-tenants", "tenants")):
        ratios = sorted(a / b for a, b in zip(rates[mode], rates[base], strict=True))
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        print(
            f"  {mode + ' / ' + base:26} {statistics.median(ratios):.3f}   "
            f"({q1:.3f}..{q3:.3f}; {ratios[0]:.2f}..{ratios[-1]:.2f})   target >= 0.90"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="50 runs instead of 500")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the modes")
    parser.add_argument(
        "--alternate",
        type=int,
        metavar="TURNS",
        help="instead: the pairs in one process, taking TURNS short turns each",
    )
    parser.add_argument(
        "--turn-runs", type=int, default=300, help="with --alternate: W1 runs a turn"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    runs_n, steps_n = (50 if args.quick else 500), 10
    if args.child:
        _child(args.child, runs_n, steps_n)
        return 0
    for name in ("TETHER_ENCRYPTION_KEYS", "TETHER_KEYRING"):
        os.environ.pop(name, None)  # the children set their own
    if args.alternate is not None:
        if args.alternate < 2:
            parser.error("--alternate needs 2 turns or more (a ratio's quartiles)")
        with tempfile.TemporaryDirectory() as d:
            rates = asyncio.run(_alternating(Path(d), args.alternate, args.turn_runs, steps_n))
        _report_alternating(rates, args.turn_runs, steps_n)
        return 0
    sys.path.insert(0, str(HERE))
    import rounds

    limit = rounds.raw_limit(0.3 if args.quick else 2.0)
    print(f"LIMIT (raw SQLite INSERT+COMMIT): {limit:,.0f} commits/s")
    got = rounds.interleave(__file__, MODES, args.repeat, args.quick, _order)
    if got is None:
        return 1
    print(f"\nW1 {runs_n} runs x {steps_n} steps, medians of {args.repeat}:")
    rounds.medians(got, "plain", limit)
    mid = {m: statistics.median(x["steps_per_s"] for x in got[m]) for m in MODES}
    print(
        f"ratios of the medians: sealed / plain {mid['sealed'] / mid['plain']:.2f}   "
        f"per-tenant / tenants {mid['per-tenant'] / mid['tenants']:.2f}   "
        f"known-tenants / tenants {mid['known-tenants'] / mid['tenants']:.2f}"
    )
    print("paired (each round's ratio of the two runs side by side; median, range):")
    pairs = (("sealed", "plain"), ("per-tenant", "tenants"), ("known-tenants", "tenants"))
    for mode, base in pairs:
        ratios = rounds.paired(got, mode, base)
        print(
            f"  {mode + ' / ' + base:26} {statistics.median(ratios):.2f}   "
            f"({min(ratios):.2f}..{max(ratios):.2f})   target >= 0.90"
        )
    return 0


def _order(r: int) -> tuple[str, ...]:
    """Each compared pair side by side (plain|sealed, per-tenant|tenants|known-tenants),
    the order reversed every other round so neither of a pair always runs first."""
    turn = ("plain", "sealed", "per-tenant", "tenants", "known-tenants")
    return turn if r % 2 == 0 else turn[::-1]


if __name__ == "__main__":
    sys.exit(main())
