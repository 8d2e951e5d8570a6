"""Instructions per model step, counted by callgrind: tether's own CPU a recorded call.

``bench/ai.py`` times a ``tether.ai`` step against a bare pydantic-ai call; its
figures move with the VM's speed. This counts instructions instead, as
``bench/instructions.py`` does for W1: each mode runs in one process under valgrind,
three rounds of 10, 20 and 120 calls (a recorded mode: three runs of one workflow on
one worker), callgrind dumping its counts after each (``callgrind_control -d``); the
large round's count minus the small one's, divided by the 100 calls in between, is
the figure, so start-up, imports and a round's fixed cost cancel out. The scripted
model server (``tether.testing.ModelServer``) runs in a child process of this one,
outside valgrind: only the process making the calls (the worker and its workflow,
or the bare loop) is counted. It repeats within about 1%.

* ``bare``: ``pydantic_ai.direct.model_request`` in a loop;
* ``bare-structured``: the same with the output tool, its arguments validated;
* ``complete``: one workflow making sequential ``tether.ai.complete`` steps
  (SQLite store, an in-process worker);
* ``structured``: the same with ``tether.ai.structured``;
* ``activity``: the same workflow with a no-op activity step instead (no model, no
  HTTP): the engine's part of any step, for comparison.

``own`` is a recorded mode minus its bare one: tether's instructions per model step;
what it has over ``activity`` is the model step's own (``tether.ai`` and its bigger
arguments and result).

    .venv/bin/python bench/ai_instructions.py                  # all four, ~3 min
    .venv/bin/python bench/ai_instructions.py complete bare    # some of them

Needs ``valgrind`` (Debian package ``valgrind``).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("bare", "bare-structured", "complete", "structured", "activity")
#: the baseline of each recorded mode: the bare call doing the same work
BASELINE = {"complete": "bare", "structured": "bare-structured"}
#: calls of the warm-up, the small and the large round
WARM, SMALL, LARGE = 10, 20, 320


def _dump() -> None:
    """Have callgrind write (and reset) the counts so far: one file per round."""
    subprocess.run(["callgrind_control", "-d", str(os.getpid())], capture_output=True, check=True)


def _workload(mode: str, base_url: str) -> None:
    """Three rounds of ``mode`` (WARM, SMALL, LARGE calls) against ``base_url``, the
    counts dumped after each (called inside valgrind). A recorded mode makes each
    round one run of one workflow, on one App and worker."""
    sys.path.insert(0, str(HERE))
    import ai as bench_ai

    import tether
    from tether import ai

    async def recorded(db: Path) -> None:
        app = tether.App(store=f"sqlite:///{db}")
        gateway = ai.Gateway(app)
        model = gateway.model(
            mode, ai.openai_compatible(bench_ai.MODEL, base_url=base_url, api_key="k")
        )

        @app.activity
        async def noop(prompt: str) -> str:
            return "greeting"

        @app.workflow
        async def many(n: int) -> int:
            done = 0
            for i in range(n):
                if mode == "structured":
                    out = await ai.structured(model, f"classify: hello {i}", output=bench_ai.Label)
                    done += out.label == "greeting"
                elif mode == "activity":
                    done += (await noop(f"classify: hello {i}")) == "greeting"
                else:
                    done += (await ai.complete(model, f"classify: hello {i}")) == "greeting"
            return done

        try:
            # woken by commits: a poll, a wall-clock timer, would count more under
            # valgrind (about 50x slower) than it does in a real step
            async with app.worker(poll_interval=60.0):
                for k, n in enumerate((WARM, SMALL, LARGE)):
                    run = await app.start(many, n, run_id=f"bench-{k}")
                    got = await run.result(timeout=3600)
                    assert got == n, got
                    _dump()
        finally:
            await app.close()

    async def main() -> None:
        if mode.startswith("bare"):
            for n in (WARM, SMALL, LARGE):
                await bench_ai.bare(base_url, n - 1, structured=mode != "bare")
                _dump()
            return
        with tempfile.TemporaryDirectory() as tmp:
            await recorded(Path(tmp) / "ai.db")

    asyncio.run(main())


def _count(mode: str, base_url: str) -> float:
    """Instructions per call of ``mode``: the large round's minus the small one's,
    divided by the calls in between (each round's fixed cost cancels out)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        cmd += [sys.executable, __file__, "--inner", mode, base_url]
        # one hash seed: the layout of dicts and sets (and so their instructions) repeats
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        rounds = []
        for k in (2, 3):  # the dumps of the small and the large round
            dump = Path(f"{out}.{k}")
            text = dump.read_text() if dump.exists() else ""
            found = re.search(r"^summary:\s+(\d+)", text, re.M)
            if proc.returncode != 0 or found is None:
                raise SystemExit(f"valgrind failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
            rounds.append(int(found.group(1)))
    return (rounds[1] - rounds[0]) / (LARGE - SMALL)


def main() -> int:
    """Print instructions per call of each mode asked for, and tether's own."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("modes", nargs="*", help=f"some of {', '.join(MODES)} (default: all)")
    parser.add_argument("--inner", nargs=2, metavar=("MODE", "URL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        _workload(args.inner[0], args.inner[1])
        return 0
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}: one of {', '.join(MODES)}")
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: apt-get install valgrind", file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE))
    import ai as bench_ai

    parent, child = multiprocessing.Pipe()
    server = multiprocessing.Process(target=bench_ai._serve, args=(child,), daemon=True)
    server.start()
    per: dict[str, float] = {}
    try:
        base_url = parent.recv()
        for mode in args.modes or MODES:
            per[mode] = _count(mode, base_url)
            print(f"{mode:<16} {per[mode]:>12,.0f} instructions per call", flush=True)
    finally:
        parent.send("stop")
        server.join(10)
    for mode, base in BASELINE.items():
        if mode in per and base in per:
            own = per[mode] - per[base]
            print(f"own ({mode} - {base}): {own:,.0f} instructions per step", end="")
            print(f" ({own - per['activity']:+,.0f} over activity)" if "activity" in per else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
