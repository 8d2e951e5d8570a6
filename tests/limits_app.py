"""Worker processes for the admission and dependency tests:
``python tests/limits_app.py STORE SIDE``.

Each process registers the same activities and workflows and records every
activity execution in a side SQLite file (kind, index, key, process, start, end);
the tests read it to check limits that must hold across processes.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import threading
import time

import tether

DEP_CAP = 3  #: max_concurrency of the "llm" dependency, per model
ADMIT = 2  #: admission limit of tenant "t1" (configured by the test)
QCAP = 2  #: max_concurrency of queue "qcap", below its dependency's cap

_side: dict[str, str] = {}
_local = threading.local()

#: one limiter per model, shared by activities in two different queues
LLM = tether.Dependency("llm", key=lambda model, i: model, max_concurrency=DEP_CAP)


#: a looser limiter on calls that also go through the capped queue "qcap"
SVC = tether.Dependency("svc", max_concurrency=5)


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
        "CREATE TABLE IF NOT EXISTS execs (kind TEXT, i INTEGER, key TEXT, pid INTEGER, "
        "started REAL, ended REAL)"
    )
    conn.execute("CREATE TABLE IF NOT EXISTS ready (pid INTEGER)")
    conn.close()


def _record(kind: str, i: int, key: str, hold: float) -> None:
    started = time.time()
    time.sleep(hold)
    _conn().execute(
        "INSERT INTO execs VALUES (?, ?, ?, ?, ?, ?)",
        (kind, i, key, os.getpid(), started, time.time()),
    )


def register(app: tether.App, side: str) -> dict[str, tether.Workflow[..., int]]:
    """Register the activities and workflows on ``app``."""
    _side["path"] = side
    app.configure_queue("qcap", max_concurrency=QCAP)

    @app.activity(queue="qa", dependency=LLM)
    def llm_a(model: str, i: int) -> int:
        _record("llm", i, model, 0.15)
        return i

    @app.activity(queue="qb", dependency=LLM)
    def llm_b(model: str, i: int) -> int:
        _record("llm", i, model, 0.15)
        return i

    @app.activity(queue="qcap", dependency=SVC)
    def svc_call(i: int) -> int:
        _record("svc", i, "", 0.15)
        return i

    @app.activity
    def admitted_step(i: int) -> int:
        _record("admit", i, "", 0.1)
        return i

    @app.workflow
    async def llm_flow(model: str, i: int) -> int:
        step = llm_a if i % 2 == 0 else llm_b
        return await step(model, i)

    @app.workflow
    async def svc_flow(n: int) -> int:
        return sum(await tether.gather(*(svc_call(i) for i in range(n))))

    @app.workflow
    async def admit_flow(i: int) -> int:
        return await admitted_step(i)

    return {"llm": llm_flow, "admit": admit_flow, "svc": svc_flow}


async def main(store: str, side: str) -> None:
    """Serve every queue until killed."""
    app = tether.App(store=store)
    register(app, side)
    # 4 slots each: 2 processes offer 8, more than any limit under test
    worker = app.worker(concurrency=4, lease=10.0, poll_interval=0.1)
    await worker.start()
    _conn().execute("INSERT INTO ready VALUES (?)", (os.getpid(),))
    await worker.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
