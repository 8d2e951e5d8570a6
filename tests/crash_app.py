"""A worker process for crash tests: run as ``python tests/crash_app.py DB EFFECTS``.

Its activity records every execution in a separate SQLite file (the "side
table"), so a test can count how many times each step really ran.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import time

import tether
from helpers import shared_side_db

DB = sys.argv[1] if len(sys.argv) > 1 else "tether.db"
EFFECTS = sys.argv[2] if len(sys.argv) > 2 else "effects.db"

app = tether.App(store=f"sqlite:///{DB}")


def effects() -> sqlite3.Connection:
    """The side table, created on first use."""
    return shared_side_db(
        EFFECTS,
        "CREATE TABLE IF NOT EXISTS effects (run_id TEXT, step INTEGER, attempt INTEGER, at REAL)",
    )


@app.activity
def work(run_id: str, i: int) -> int:
    """A 20 ms step; each execution is recorded in the side table as it starts."""
    ctx = tether.activity_context()
    effects().execute(
        "INSERT INTO effects VALUES (?, ?, ?, ?)", (run_id, ctx.step, ctx.attempt, time.time())
    )
    time.sleep(0.02)
    return i


@app.workflow
async def ten_steps(run_id: str) -> int:
    """Ten sequential steps."""
    total = 0
    for i in range(10):
        total += await work(run_id, i)
    return total


async def main() -> None:
    """Serve until killed."""
    worker_id = sys.argv[3] if len(sys.argv) > 3 else None
    lease = float(sys.argv[4]) if len(sys.argv) > 4 else 2.0
    worker = app.worker(concurrency=20, lease=lease, poll_interval=0.05, worker_id=worker_id)
    await worker.run()


if __name__ == "__main__":
    asyncio.run(main())
