"""Worker process for failure tests: ``python tests/failure_app.py STORE EFFECTS LEASE POLL``.

Every activity records what it does in a separate SQLite file (the side table), so
a test can see which process ran which attempt, and count effects by idempotency key.

* ``frozen_flow``: one heartbeating step whose first attempt, after a heartbeat
  committed, records "freeze" and sleeps: the test SIGSTOPs the process then (a self
  SIGSTOP proved unreliable in the sandbox: it sometimes returned at once) and SIGCONTs
  it later; a second worker process must reclaim the step via the heartbeat timeout.
* ``saga_flow``: books a, b, c, then fails; the undo of c takes 2 s the first time it
  runs so the test can SIGKILL the worker mid-compensation.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import time
from typing import Any

import tether
from helpers import shared_side_db

STORE = sys.argv[1] if len(sys.argv) > 1 else "sqlite:///tether.db"
EFFECTS = sys.argv[2] if len(sys.argv) > 2 else "effects.db"
LEASE = float(sys.argv[3]) if len(sys.argv) > 3 else 15.0
POLL = float(sys.argv[4]) if len(sys.argv) > 4 else 0.05

app = tether.App(store=STORE)


def effects() -> sqlite3.Connection:
    """The side table, created on first use."""
    return shared_side_db(
        EFFECTS,
        "CREATE TABLE IF NOT EXISTS effects (kind TEXT, name TEXT, key TEXT, "
        "attempt INTEGER, pid INTEGER, detail TEXT, at REAL)",
        "CREATE TABLE IF NOT EXISTS applied (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
        "key TEXT UNIQUE, name TEXT)",
    )


def record(kind: str, name: str, detail: Any = None) -> None:
    ctx = tether.activity_context()
    effects().execute(
        "INSERT INTO effects VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            kind,
            name,
            ctx.idempotency_key,
            ctx.attempt,
            os.getpid(),
            None if detail is None else str(detail),
            time.time(),
        ),
    )


# -- heartbeat timeout vs a frozen process --------------------------------------------------


@app.activity(heartbeat_timeout=1, retry=tether.Retry(attempts=5, initial=0.01, jitter=0))
def chunked(chunks: int) -> dict[str, int]:
    """Process ``chunks`` chunks, heartbeating each; resume after the last heartbeat."""
    ctx = tether.activity_context()
    start = 0 if ctx.heartbeat_details is None else ctx.heartbeat_details["chunk"] + 1
    record("start", "chunked", start)
    for i in range(start, chunks):
        ctx.heartbeat({"chunk": i})
        if ctx.attempt == 1 and i == 2:
            record("freeze", "chunked")
            time.sleep(3.0)  # the test sends SIGSTOP now, and SIGCONT much later
            record("resumed", "chunked")
        time.sleep(0.05)
    record("return", "chunked", ctx.is_cancelled)
    return {"attempt": ctx.attempt, "pid": os.getpid(), "start": start}


@app.workflow
async def frozen_flow() -> dict[str, int]:
    return await chunked(8)


# -- a crash during compensation --------------------------------------------------------------


@app.activity
def book(name: str) -> str:
    record("book", name)
    return name


@app.activity(retry=tether.Retry(attempts=1))
def explode() -> None:
    raise tether.NonRetryable("payment declined")


@app.activity
def undo(name: str) -> None:
    """Compensate ``name``, applied once per idempotency key however often it runs."""
    ctx = tether.activity_context()
    earlier = (
        effects()
        .execute(
            "SELECT count(*) FROM effects WHERE kind = 'undo' AND key = ?", (ctx.idempotency_key,)
        )
        .fetchone()[0]
    )
    record("undo", name)
    if name == "c" and earlier == 0:
        time.sleep(2.0)  # the test kills the process here
    effects().execute(
        "INSERT INTO applied (key, name) VALUES (?, ?) ON CONFLICT DO NOTHING",
        (ctx.idempotency_key, name),
    )


@app.workflow
async def saga_flow() -> str:
    async with tether.saga() as saga:
        for name in ("a", "b", "c"):
            await saga.step(book(name), undo=undo)
        await explode()
    return "unreachable"


async def main() -> None:
    """Serve until killed."""
    worker = app.worker(concurrency=20, lease=LEASE, poll_interval=POLL)
    await worker.run()


if __name__ == "__main__":
    asyncio.run(main())
