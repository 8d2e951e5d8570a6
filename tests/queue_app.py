"""Worker processes for the queue-limit tests: ``python tests/queue_app.py STORE SIDE``.

Every process configures the same queue limits (so each writes them to the
store as its worker starts) and records each activity execution in a side
SQLite file: which step, in which process, when its body started and ended.
The tests read the side file to check limits across processes.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import threading
import time

import tether

CAP = 5  #: max_concurrency of queue "capped"
RATE, BURST = 20.0, 5.0  #: tokens per second and bucket size of queue "rated"

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
    """Create the side table (the test does it before any worker starts)."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS execs (queue TEXT, i INTEGER, pid INTEGER, "
        "started REAL, ended REAL)"
    )
    conn.execute("CREATE TABLE IF NOT EXISTS ready (pid INTEGER)")
    conn.close()


def register(app: tether.App, side: str) -> dict[str, tether.Workflow[..., int]]:
    """Configure the queues and register the activities and workflows on ``app``."""
    _side["path"] = side
    app.configure_queue("capped", max_concurrency=CAP)
    app.configure_queue("rated", rate=RATE, burst=BURST)

    @app.activity(queue="capped")
    def capped_step(i: int) -> int:
        """Hold a slot for 150 ms; the side table gets the interval the body ran."""
        started = time.time()
        time.sleep(0.15)
        _conn().execute(
            "INSERT INTO execs VALUES ('capped', ?, ?, ?, ?)",
            (i, os.getpid(), started, time.time()),
        )
        return i

    @app.activity(queue="rated")
    def rated_step(i: int) -> int:
        """Record the start at once (a rate limit counts starts)."""
        now = time.time()
        _conn().execute(
            "INSERT INTO execs VALUES ('rated', ?, ?, ?, ?)", (i, os.getpid(), now, now)
        )
        return i

    @app.workflow
    async def capped_flow(i: int) -> int:
        return await capped_step(i)

    @app.workflow
    async def rated_flow(i: int) -> int:
        return await rated_step(i)

    return {"capped": capped_flow, "rated": rated_flow}


async def main(store: str, side: str) -> None:
    """Serve every queue until killed."""
    app = tether.App(store=store)
    register(app, side)
    # 2 slots each: 3 processes offer 6 > the cap of 5, and no single process can
    # reach the cap alone, so a peak at the cap proves the processes shared it
    worker = app.worker(concurrency=2, lease=10.0, poll_interval=0.1)
    await worker.start()
    _conn().execute("INSERT INTO ready VALUES (?)", (os.getpid(),))
    await worker.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
