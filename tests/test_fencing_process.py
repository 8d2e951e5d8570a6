"""Lease fencing end to end, across processes, on SQLite and PostgreSQL.

A worker process (2 s lease) starts a step whose first attempt blocks on a file gate.
The test freezes it with SIGSTOP past its lease; a second worker process takes the
step over and completes the run. Then the gate opens and the first process is
thawed: everything it tries to record for that task must be refused by the fence,
and the history must not change.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tether
from tether import EventType

HERE = Path(__file__).parent
OUTCOME_WRITES = ("complete_activity", "fail_activity", "complete_activity_fast")
sys.path.insert(0, str(HERE))
import fencing_app  # noqa: E402


def _spawn(store_url: str, directory: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    with (directory / "workers.log").open("ab") as err:
        return subprocess.Popen(
            [sys.executable, str(HERE / "fencing_app.py"), store_url, str(directory)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def _log(directory: Path) -> list[tuple[Any, ...]]:
    """Rows ``(kind, pid, attempt, fence, detail)`` of the workers' side log."""
    if not (directory / "side.db").exists():
        return []
    conn = sqlite3.connect(directory / "side.db", timeout=30)
    try:
        return conn.execute(
            "SELECT kind, pid, attempt, fence, detail FROM log ORDER BY rowid"
        ).fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        conn.close()


def _state(pid: int) -> str:
    """The one-letter state of a process from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def _eventually(
    check: Callable[[], Any], timeout: float = 15.0, what: str = "condition"
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _holds_store_transaction(store_url: str) -> bool:
    """Whether a (frozen) worker holds an open store transaction that would block others."""
    if store_url.startswith("sqlite:///"):
        conn = sqlite3.connect(store_url[len("sqlite:///") :], timeout=0.2, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:
            return True
        finally:
            conn.close()
    import psycopg

    from tether.store.postgres import _split_url

    conninfo, schema = _split_url(store_url)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
            "AND xact_start IS NOT NULL",
            (f"tether:{schema}",),
        ).fetchone()
    return row is not None and row[0] > 0


async def _freeze(proc: subprocess.Popen[bytes], store_url: str) -> None:
    """SIGSTOP ``proc`` at a moment it holds no store transaction (row or file locks)."""
    for _ in range(100):
        proc.send_signal(signal.SIGSTOP)
        await _eventually(lambda: _state(proc.pid) == "T", what="SIGSTOP")
        if not _holds_store_transaction(store_url):
            return
        proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.03)
    raise AssertionError("could not freeze the worker outside a store transaction")


@pytest.mark.slow
async def test_frozen_worker_cannot_commit_after_its_lease_was_taken_over(
    store_url: str, tmp_path: Path
) -> None:
    client = fencing_app.build_app(store_url, tmp_path)
    run = await client.start("fenced")
    first = _spawn(store_url, tmp_path)
    second: subprocess.Popen[bytes] | None = None
    try:
        await _eventually(
            lambda: [r for r in _log(tmp_path) if r[0] == "start" and r[1] == first.pid],
            timeout=30,
            what="attempt 1 started in the first worker",
        )
        await _freeze(first, store_url)
        t_frozen = time.monotonic()
        second = _spawn(store_url, tmp_path)
        out = await run.result(timeout=30)
        took = time.monotonic() - t_frozen
        assert _state(first.pid) == "T"  # still frozen: the second worker did it alone
        assert out == {"pid": second.pid, "attempt": 2}
        assert took < 20, f"the step was taken over only after {took:.1f}s"

        history = await client.history(run.run_id)
        completed = [e for e in history if e.type is EventType.ACTIVITY_COMPLETED]
        assert len(completed) == 1 and completed[0].data["attempt"] == 2
        assert (await client.get(run.run_id)).status is tether.RunStatus.COMPLETED

        # open the gate while it is still frozen, then thaw it: its attempt returns and
        # tries to record an outcome with its stale fence
        (tmp_path / "release").touch()
        first.send_signal(signal.SIGCONT)
        refused = await _eventually(
            lambda: [r for r in _log(tmp_path) if r[1] == first.pid and r[0] in OUTCOME_WRITES],
            what="the thawed worker's late write",
        )
        await _eventually(
            lambda: [r for r in _log(tmp_path) if r[0] == "return" and r[1] == first.pid],
            what="the thawed attempt to return",
        )
        await asyncio.sleep(0.5)  # room for any further (refused) write to land
        assert first.poll() is None, (tmp_path / "workers.log").read_text()
        assert await client.history(run.run_id) == history  # nothing was written
        rows = _log(tmp_path)
        late = [r for r in rows if r[1] == first.pid and r[0] not in ("start", "return")]
        assert late and all(r[4].startswith("refused: lease lost") for r in late), late
        assert refused[0][2] == 1  # attempt 1, with the fence it was claimed with
        (ours,) = [r for r in rows if r[1] == second.pid and r[0] in OUTCOME_WRITES]
        assert ours[4] == "accepted" and ours[2] == 2 and ours[3] > refused[0][3]
        print(f"\nfenced: late {late[0][0]} refused; taken over after {took:.1f}s")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)
        await client.close()
