"""Worker process whose wall clock is off: ``TETHER_TEST_SKEW=S python tests/clock_app.py
STORE DIR``.

Before tether is imported, ``time.time`` is shifted by S seconds (a host whose clock
is ahead, or behind). Activity ``hold`` logs each execution to ``DIR/runs``
(one line per execution) and then works for 3 s; workflow ``napper`` sleeps
durably for 4 s. Both tests compare what a skewed worker does against the
database's time.
"""

from __future__ import annotations

import os
import time

_real = time.time
SKEW = float(os.environ.get("TETHER_TEST_SKEW", "0"))
if SKEW:
    time.time = lambda: _real() + SKEW  # the host's clock is off by SKEW seconds

import asyncio  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import tether  # noqa: E402

LEASE = 4.0


def build_app(store: str, directory: Path) -> tether.App:
    app = tether.App(store=store)

    @app.activity(retry=tether.Retry(attempts=5, initial=0.05))
    def hold(tag: str) -> str:
        with (directory / "runs").open("a") as f:
            f.write(f"{tag} {os.getpid()}\n")
        time.sleep(3.0)
        return tag

    @app.workflow
    async def holder(tag: str) -> str:
        return await hold(tag)

    @app.workflow
    async def napper() -> float:
        await tether.sleep(4.0)
        return tether.now().timestamp()

    return app


async def main(store: str, directory: Path) -> None:
    app = build_app(store, directory)
    worker = app.worker(lease=LEASE, poll_interval=0.05)
    await worker.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
