"""A 50 MB output through activities: by reference (``tether.put_blob``: the workflow
holds a hash), offloaded by the store (the bytes as a base64 string, above the offload
threshold: the history holds a reference, the workflow the text), the same sealed
(encryption on), and inline (offloading off: the text in the history): wall time, this
process's peak RSS growth, and the largest stored event row, each in a fresh process.

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
    keys = None
    if mode == "sealed":
        from tether.encryption import FileKeyring

        keys = FileKeyring.create(work / "keys.json")
    app = tether.App(
        store=f"sqlite:///{work / 'b.db'}",
        blobs=str(work / "blobs"),
        offload_above=None if mode == "inline" else 256 * 1024,
        encryption=keys,
    )

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
    biggest = await app.store._do(  # type: ignore[attr-defined]
        lambda tx: tx.execute("SELECT max(length(data)) FROM events").fetchone()[0], write=False
    )
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
    for mode in ("blob", "offload", "sealed", "inline"):
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
            f"{args.mb} MB {mode:7}: {r['wall_s']:.2f} s, peak RSS +{r['rss_growth_mb']:.0f} MB, "
            f"largest event row {r['largest_event_kb']:,.1f} KB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
