"""Worker process for the fencing test: ``python tests/fencing_app.py STORE DIR``.

Runs with a 2 s lease. The activity ``gated`` records its start in a side table
(``DIR/side.db``); its first attempt then blocks until the file ``DIR/release``
exists (the test SIGSTOPs the process meanwhile). The store methods that record an
activity's outcome are wrapped to log every call and whether the store accepted or
refused it, so the test can see the frozen worker's late write being refused.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import tether
from helpers import open_side_db

LEASE = 2.0


def side(directory: Path) -> sqlite3.Connection:
    return open_side_db(
        directory / "side.db",
        "CREATE TABLE IF NOT EXISTS log (kind TEXT, pid INTEGER, attempt INTEGER, "
        "fence INTEGER, detail TEXT, at REAL)",
    )


def build_app(store: str, directory: Path) -> tether.App:
    app = tether.App(store=store)

    def record(kind: str, attempt: int, fence: int, detail: str = "") -> None:
        conn = side(directory)
        try:
            conn.execute(
                "INSERT INTO log VALUES (?, ?, ?, ?, ?, ?)",
                (kind, os.getpid(), attempt, fence, detail, time.time()),
            )
        finally:
            conn.close()

    @app.activity(retry=tether.Retry(attempts=5, initial=0.05))
    def gated() -> dict[str, int]:
        ctx = tether.activity_context()
        fence = ctx.task.fence if ctx.task is not None else -1
        record("start", ctx.attempt, fence)
        if ctx.attempt == 1:
            while not (directory / "release").exists():
                time.sleep(0.02)
        record("return", ctx.attempt, fence, str(ctx.is_cancelled))
        return {"pid": os.getpid(), "attempt": ctx.attempt}

    @app.workflow
    async def fenced() -> dict[str, int]:
        return await gated()

    return app


def instrument(app: tether.App, directory: Path) -> None:
    """Log every outcome write this process issues, and the store's answer.

    The write is shielded: the worker's lease renewal, learning that the lease is
    gone, cancels the activity, and that could otherwise cancel a write before it
    reaches the store. Shielded, every write the worker issues gets a verdict.
    """
    store = app.store

    def wrap(name: str) -> None:
        original = getattr(store, name)

        @functools.wraps(original)
        async def call(task: Any, *args: Any, **kwargs: Any) -> Any:
            fut = asyncio.ensure_future(original(task, *args, **kwargs))
            fut.add_done_callback(functools.partial(_verdict, name, task))
            return await asyncio.shield(fut)

        setattr(store, name, call)

    def _verdict(name: str, task: Any, fut: asyncio.Future[Any]) -> None:
        if task.kind != "activity":
            return
        exc = None if fut.cancelled() else fut.exception()
        if fut.cancelled():
            verdict = "cancelled"
        elif isinstance(exc, tether.LeaseLostError):
            verdict = f"refused: {exc}"
        elif exc is not None:
            verdict = f"error: {exc!r}"
        else:
            verdict = "accepted"
        conn = side(directory)
        try:
            conn.execute(
                "INSERT INTO log VALUES (?, ?, ?, ?, ?, ?)",
                (name, os.getpid(), task.attempt, task.fence, verdict, time.time()),
            )
        finally:
            conn.close()

    # every store method that records an activity's outcome (the fast path, when the
    # store has one, records it together with the workflow task it unblocks)
    for name in ("complete_activity", "fail_activity", "complete_activity_fast"):
        if hasattr(store, name):
            wrap(name)


async def main(store: str, directory: Path) -> None:
    app = build_app(store, directory)
    instrument(app, directory)
    worker = app.worker(concurrency=4, lease=LEASE, poll_interval=0.1)
    await worker.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
