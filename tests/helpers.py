"""Small helpers shared by the tests: polling instead of sleeping, history checks."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import tether
from tether import EventType


async def eventually(
    check: Callable[[], Awaitable[Any]], timeout: float = 10.0, what: str = "condition"
) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def event_types(app: tether.App, run_id: str) -> list[EventType]:
    return [e.type for e in await app.history(run_id)]


async def has_event(app: tether.App, run_id: str, type_: EventType) -> bool:
    return type_ in await event_types(app, run_id)


class WorkerProcesses:
    """Worker subprocesses started from a test's worker module; stopped with ``stop_all``."""

    def __init__(self, script: Path, *args: str) -> None:
        self.script = script
        self.args = args
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, n: int) -> list[subprocess.Popen[bytes]]:
        """Start ``n`` more workers; return every worker started so far."""
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
        for _ in range(n):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(self.script), *self.args],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        return self.procs

    def stop_all(self) -> None:
        """SIGTERM every worker, then SIGKILL any that has not exited within 10 s."""
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def open_side_db(path: str | Path, *schema: str) -> sqlite3.Connection:
    """A connection to a test's side table file (WAL), with ``schema`` statements run.

    Switching a file to WAL answers "database is locked" at once, without waiting,
    while another connection (the test reading the side table) holds it: retried here,
    for up to 30 s, so a worker never starts with a side table it could not set up.
    """
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    deadline = time.monotonic() + 30
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                conn.close()
                raise
            time.sleep(0.01)
    for statement in schema:
        conn.execute(statement)
    return conn


_side_lock = threading.Lock()
_side_conns: dict[str, sqlite3.Connection] = {}


def shared_side_db(path: str | Path, *schema: str) -> sqlite3.Connection:
    """This process's one connection to a side table file, set up once (``open_side_db``)
    even when many activity threads ask for it at the same moment."""
    with _side_lock:
        conn = _side_conns.get(str(path))
        if conn is None:
            conn = _side_conns[str(path)] = open_side_db(path, *schema)
        return conn
