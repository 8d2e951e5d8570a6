"""Worker process for the chaos test: ``python tests/chaos_app.py STORE_URL``.

``STORE_URL`` is a PostgreSQL URL with ``?schema=NAME``. Every activity execution
writes, in one transaction on its own connection to the same schema:

* a row in ``chaos_executions`` (append-only: counts raw executions, re-runs included),
  with whether the step's ``ActivityCompleted`` was already committed when it ran (read
  in the same transaction: exact, no clocks compared);
* its side effect in ``chaos_effects``, keyed by the step's idempotency key with
  ``INSERT ... ON CONFLICT DO NOTHING`` (applied once however often the step runs).

Runs have three shapes, chosen by ``n % 4`` (see ``expected_keys``): ten sequential
steps; five steps, a durable timer, five more; or three steps, a fan-out of four
(``tether.gather``) and three more. Every shape returns ``1000 * n + 45``.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
import time
from typing import Any

import psycopg
from psycopg import sql

import tether
from tether.store.postgres import _split_url

LEASE = 2.0
SIDE_CONNECTIONS = 4  #: per process: a small pool shared by the activity threads

SIDE_TABLES = (
    "CREATE TABLE IF NOT EXISTS chaos_effects (key TEXT PRIMARY KEY, run_id TEXT NOT NULL, "
    "i INTEGER NOT NULL, value BIGINT NOT NULL, pid INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS chaos_executions (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, "
    "attempt INTEGER NOT NULL, pid INTEGER NOT NULL, at DOUBLE PRECISION NOT NULL, "
    "after_recorded BOOLEAN NOT NULL)",
)


def shape(n: int) -> str:
    """The shape of run ``n``: plain, timer or fanout."""
    return {0: "plain", 1: "plain", 2: "timer", 3: "fanout"}[n % 4]


def expected_keys(run_id: str, n: int) -> dict[str, int]:
    """``{idempotency_key: i}`` for every activity step run ``n`` must apply exactly once.

    Commands are numbered from 1 in the order the code issues them; the timer of a
    ``timer`` run takes step 6, so its activities are steps 1-5 and 7-11.
    """
    steps = [1, 2, 3, 4, 5, 7, 8, 9, 10, 11] if shape(n) == "timer" else list(range(1, 11))
    return {f"{run_id}:{step}": i for i, step in enumerate(steps)}


def expected_result(n: int) -> int:
    return sum(1000 * n + i for i in range(10))


class SidePool:
    """A few connections to the test schema for the activities' side effects."""

    def __init__(self, url: str, size: int) -> None:
        self.url = url
        self.size = size
        self._pool: queue.SimpleQueue[psycopg.Connection[Any]] | None = None
        self._lock = threading.Lock()

    def _open(self) -> psycopg.Connection[Any]:
        conninfo, schema = _split_url(self.url)
        conn = psycopg.connect(conninfo, application_name="chaos-side")
        if schema:
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        # a SIGKILLed client cannot lose a commit the server acknowledged; only a server
        # crash could, which this test does not do
        conn.execute("SET synchronous_commit = off")
        conn.commit()
        return conn

    def record(self, key: str, run_id: str, i: int, value: int, attempt: int) -> None:
        with self._lock:  # the activity threads race to the first call
            if self._pool is None:
                pool: queue.SimpleQueue[psycopg.Connection[Any]] = queue.SimpleQueue()
                for _ in range(self.size):
                    pool.put(self._open())
                self._pool = pool
        conn = self._pool.get()
        try:
            with conn.transaction():
                step = int(key.rsplit(":", 1)[1])
                conn.execute(
                    "INSERT INTO chaos_executions (key, attempt, pid, at, after_recorded) "
                    "VALUES (%s, %s, %s, %s, EXISTS (SELECT 1 FROM events WHERE run_id = %s "
                    "AND step = %s AND type = 'ActivityCompleted'))",
                    (key, attempt, os.getpid(), time.time(), run_id, step),
                )
                conn.execute(
                    "INSERT INTO chaos_effects (key, run_id, i, value, pid) "
                    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (key, run_id, i, value, os.getpid()),
                )
        finally:
            self._pool.put(conn)


def build_app(url: str) -> tether.App:
    """The chaos App on ``url`` (the test uses it as a client; workers serve it)."""
    app = tether.App(store=url)
    side = SidePool(url, SIDE_CONNECTIONS)

    @app.activity(retry=tether.Retry(attempts=50, initial=0.05, max_interval=0.5))
    def effect(run_id: str, n: int, i: int) -> int:
        """One step: apply its side effect (once per idempotency key) and return a value."""
        ctx = tether.activity_context()
        value = 1000 * n + i
        side.record(ctx.idempotency_key, run_id, i, value, ctx.attempt)
        return value

    @app.workflow
    async def chaos(run_id: str, n: int) -> int:
        """Ten steps in one of three shapes (see the module docstring)."""
        kind = shape(n)
        total = 0
        if kind == "plain":
            for i in range(10):
                total += await effect(run_id, n, i)
        elif kind == "timer":
            for i in range(5):
                total += await effect(run_id, n, i)
            await tether.sleep(0.2)
            for i in range(5, 10):
                total += await effect(run_id, n, i)
        else:
            for i in range(3):
                total += await effect(run_id, n, i)
            total += sum(await tether.gather(*(effect(run_id, n, i) for i in range(3, 7))))
            for i in range(7, 10):
                total += await effect(run_id, n, i)
        return total

    return app


async def main(url: str) -> None:
    """Serve until killed."""
    app = build_app(url)
    worker = app.worker(concurrency=32, lease=LEASE, poll_interval=0.1)
    await worker.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
