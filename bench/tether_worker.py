"""A tether worker process for the benchmark's W4 (recovery) and W5 (waiting) workloads.

Run as ``python bench/tether_worker.py DB EFFECTS [--lease SECONDS]``. It serves
every queue of the app below with the worker's default settings (only ``--lease``
can be changed, for W4), prints ``ready`` on stdout once it is serving, and runs
until it is killed or terminated. The benchmark measures its RSS from
``/proc/PID/status``, so the figure is this process's own memory.

W4's activity records every execution, as it starts, in a separate SQLite file
(the side table), like ``tests/crash_app.py``, so the benchmark can count how
often each ``(run_id, step)`` really ran.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sqlite3
import sys
import threading
import time
from typing import Any

import tether

#: How long each W4 step takes (the brief: 20 ms).
STEP_SECONDS = 0.02

_effects_path = "effects.db"
_effects: sqlite3.Connection | None = None
_effects_lock = threading.Lock()


def make_app(db: str) -> tether.App:
    """The app the benchmark and this worker share (the bench starts and signals runs)."""
    app = tether.App(store=f"sqlite:///{db}")

    @app.activity
    def recovery_step(run_id: str, i: int) -> int:
        """A 20 ms step; each execution is recorded in the side table as it starts."""
        ctx = tether.activity_context()
        _record(run_id, ctx.step, ctx.attempt)
        time.sleep(STEP_SECONDS)
        return i

    @app.workflow
    async def recovery_run(run_id: str, steps: int) -> int:
        """W4: ``steps`` sequential 20 ms steps; returns the sum of 0..steps-1."""
        total = 0
        for i in range(steps):
            total += await recovery_step(run_id, i)
        return total

    @app.workflow
    async def waiter(i: int) -> int:
        """W5: block in ``wait_event("go")``; return the payload plus ``i``."""
        payload: Any = await tether.wait_event("go")
        return int(payload) + i

    return app


def _record(run_id: str, step: int, attempt: int) -> None:
    """Append one execution to the side table (its own file; WAL, so a kill loses no row)."""
    _side().execute("INSERT INTO effects VALUES (?, ?, ?, ?)", (run_id, step, attempt, time.time()))


def _side() -> sqlite3.Connection:
    """The side table's connection, set up once even when many step threads ask at once.

    Switching the file to WAL answers "database is locked" at once (no busy wait)
    while the benchmark is reading it: retried until it works.
    """
    global _effects
    with _effects_lock:
        if _effects is not None:
            return _effects
        conn = sqlite3.connect(_effects_path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 30000")
        deadline = time.monotonic() + 30
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        # NORMAL survives a killed process (not a power cut): all a SIGKILL test needs
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS effects (run_id TEXT, step INTEGER, attempt INTEGER, "
            "at REAL)"
        )
        _effects = conn
        return conn


async def _serve(db: str, lease: float | None) -> None:
    app = make_app(db)
    options: dict[str, Any] = {} if lease is None else {"lease": lease}
    worker = app.worker(**options)
    await worker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await worker.stop(grace=1.0)
    await app.close()


def main() -> None:
    """Parse arguments and serve until SIGTERM (or SIGKILL)."""
    global _effects_path
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("db")
    parser.add_argument("effects")
    parser.add_argument("--lease", type=float, default=None, help="default: the worker's")
    args = parser.parse_args()
    _effects_path = args.effects
    asyncio.run(_serve(args.db, args.lease))


if __name__ == "__main__":
    sys.exit(main())
