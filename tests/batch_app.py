"""Worker processes for the batching tests: ``python tests/batch_app.py STORE SIDE MODE``.

The batched activity records every execution of every item in a side SQLite file
(which process, which batch, which ``run_id:step`` from the context's
``idempotency_keys``) before it does its "work" (a sleep), so a test can count how
many times each item really ran and which items shared a batch.

MODE ``crash``: slow batches (1 s after the effects are written), so a SIGKILL lands
mid-batch; a stable worker id lets the restarted worker take the tasks back at once.
MODE ``share``: small worker concurrency and short batches, so two processes compete.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import threading
import time
import uuid
from datetime import timedelta

import tether

MAX_ITEMS = 5
_side: dict[str, str] = {}
_local = threading.local()


def _conn() -> sqlite3.Connection:
    conn: sqlite3.Connection | None = getattr(_local, "conn", None)
    if conn is None:
        conn = sqlite3.connect(_side["path"], isolation_level=None, timeout=30)
        conn.execute("PRAGMA busy_timeout = 30000")
        _local.conn = conn
    return conn


def init_side(path: str) -> None:
    """Create the side tables (the test does it before any worker starts)."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS effects (run_id TEXT, step INTEGER, batch TEXT, "
        "size INTEGER, pid INTEGER, at REAL)"
    )
    conn.execute("CREATE TABLE IF NOT EXISTS ready (pid INTEGER)")
    conn.close()


def register(app: tether.App, side: str, mode: str) -> tether.Workflow[[int], int]:
    """Register the batched activity and the workflow calling it on ``app``."""
    _side["path"] = side
    pause = 1.0 if mode == "crash" else 0.2

    @app.activity(
        batch=tether.Batch(max_items=MAX_ITEMS, max_wait=timedelta(milliseconds=200)),
        retry=tether.Retry(attempts=10, initial=0.05, max_interval=0.2),
    )
    def double(items: list[int]) -> list[int]:
        """Record each item's execution, then take a while (the crash window)."""
        ctx = tether.activity_context()
        batch = uuid.uuid4().hex
        now = time.time()
        rows = []
        for key in ctx.idempotency_keys:
            run_id, step = key.rsplit(":", 1)
            rows.append((run_id, int(step), batch, len(items), os.getpid(), now))
        _conn().executemany("INSERT INTO effects VALUES (?, ?, ?, ?, ?, ?)", rows)
        time.sleep(pause)
        return [2 * i for i in items]

    @app.workflow
    async def three_steps(n: int) -> int:
        """Three batched steps in sequence: n -> 2n -> 4n -> 8n."""
        for _ in range(3):
            n = await double(n)
        return n

    return three_steps


async def main(store: str, side: str, mode: str) -> None:
    """Serve until killed."""
    app = tether.App(store=store)
    register(app, side, mode)
    if mode == "crash":
        worker = app.worker(concurrency=64, lease=30.0, poll_interval=0.1, worker_id="batcher")
    else:
        # two slots: one process alone cannot take every batch (each holds a slot for
        # its 0.2 s), so the other one is sure to claim some even on a loaded machine
        worker = app.worker(concurrency=2, lease=30.0, poll_interval=0.1)
    await worker.start()
    _conn().execute("INSERT INTO ready VALUES (?)", (os.getpid(),))
    await worker.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
