"""A 50 MB output through activities, by reference (``tether.put_blob``) and, for
comparison, inline (the bytes as a base64 string in the history): wall time, this
process's peak RSS growth, and the largest history event, each in a fresh process.

    .venv/bin/python bench/blobs.py [--mb 50]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tether


async def _run(mode: str, size: int, work: Path) -> dict[str, float]:
    app = tether.App(store=f"sqlite:///{work / 'b.db'}", blobs=str(work / "blobs"))

    @app.activity
    def produce() -> tether.Blob | str:
        data = os.urandom(size)
        return tether.put_blob(data) if mode == "blob" else base64.b64encode(data).decode()

    @app.activity
    def consume(doc: tether.Blob | str) -> int:
        if isinstance(doc, str):
            return len(base64.b64decode(doc))
        return len(tether.read_blob(doc))

    @app.workflow
    async def pipeline() -> int:
        return await consume(await produce())

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    async with app.worker(poll_interval=0.05):
        run = await app.start(pipeline)
        n = await run.result(timeout=600)
    wall = time.perf_counter() - t0
    if n != size:
        raise RuntimeError("wrong size")
    biggest = max(len(json.dumps(e.data)) for e in await app.history(run.run_id))
    await app.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "wall_s": wall,
        "rss_growth_mb": (peak - base) / 1024,
        "largest_event_kb": biggest / 1024,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=50)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.mb * 2**20
    if args.child:
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps(asyncio.run(_run(args.child, size, Path(d)))))
        return 0
    for mode in ("blob", "inline"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--mb", str(args.mb)],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{args.mb} MB {mode:6}: {r['wall_s']:.2f} s, peak RSS +{r['rss_growth_mb']:.0f} MB, "
            f"largest history event {r['largest_event_kb']:,.1f} KB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
