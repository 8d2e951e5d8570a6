"""A worker process for fault tests: ``python tests/fault_app.py DB``.

``TETHER_CRASH_AFTER_WRITES=N`` in its environment makes it exit with status 137
right after its Nth state-changing store write (``install_crash_from_env``).
"""

from __future__ import annotations

import asyncio
import sys

import tether
from tether.testing import install_crash_from_env


def make_app(db: str) -> tether.App:
    """The App: three sequential steps."""
    app = tether.App(store=f"sqlite:///{db}")

    @app.activity
    def step(i: int) -> int:
        return i * 10

    @app.workflow
    async def three() -> list[int]:
        return [await step(i) for i in range(3)]

    return app


async def serve(app: tether.App, seconds: float) -> None:
    async with app.worker(lease=1.0, poll_interval=0.05):
        await asyncio.sleep(seconds)


if __name__ == "__main__":
    the_app = make_app(sys.argv[1])
    install_crash_from_env(the_app)
    asyncio.run(serve(the_app, float(sys.argv[2]) if len(sys.argv) > 2 else 30.0))
