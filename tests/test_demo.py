"""``tether demo`` as a user runs it: a subprocess on a fresh SQLite file.

The demo checks itself (documents accounted for, crash survived, no recorded step
executed again, each document published once); these tests check the same claims
again from outside, in the store and the side table, and drive a review at a real
terminal (a pseudo-terminal) to reject one document and edit another.
"""

from __future__ import annotations

import os
import re
import select
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
TETHER = [sys.executable, "-c", "from tether.cli import main; main()"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")

pytestmark = pytest.mark.timeout(180)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def _check_store(store: Path, published: set[str]) -> None:
    """Every run ended; what the side table says was published, once each."""
    with sqlite3.connect(store) as conn:
        statuses = dict(conn.execute("SELECT run_id, status FROM runs").fetchall())
    assert len(statuses) == 10 and set(statuses.values()) == {"completed"}, statuses
    with sqlite3.connect(f"{store}.side.db") as conn:
        rows = conn.execute("SELECT doc_id FROM published").fetchall()
    assert sorted(r[0] for r in rows) == sorted(published)


def test_the_demo_crashes_resumes_and_checks_itself(tmp_path: Path) -> None:
    store = tmp_path / "demo.db"
    out = subprocess.run(
        [*TETHER, "demo", "--auto-approve", "--fast", "--store", str(store)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "offline scripted model" in text  # labelled as such
    assert re.search(r"CRASH: killed the worker process \(pid \d+\) with SIGKILL", text)
    for line in (
        "ok   10/10 documents accounted for",
        "and the runs finished on a new worker",
        "ok   no recorded step executed again",
        "ok   10 documents published once each",
    ):
        assert line in text, text[-3000:]
    assert text.count("approved automatically (--auto-approve)") == 2
    assert "tether serve tether.demo.pipeline:app" in text  # how to open the console
    every = {
        "inv-0001", "inv-0002", "inv-0003", "ctr-0001", "ctr-0002",
        "tkt-0001", "tkt-0002", "tkt-0003", "rpt-0001", "memo-0001",
    }  # fmt: skip
    _check_store(store, every)


def test_the_demo_runs_on_a_model_pydantic_ai_names(tmp_path: Path) -> None:
    """``--model`` takes any model pydantic-ai resolves by name (here its ``test`` model,
    which answers schema-valid nonsense: everything goes to review and is approved)."""
    store = tmp_path / "demo.db"
    out = subprocess.run(
        [*TETHER, "demo", "--model", "test", "--auto-approve", "--fast", "--no-crash",
         "--store", str(store)],
        env=_env(), capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "model: test" in out.stdout and "ok   10/10 documents accounted for" in out.stdout
    assert "no crash asked for (--no-crash)" in out.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="a POSIX pseudo-terminal")
def test_a_person_at_the_terminal_rejects_one_document_and_edits_another(
    tmp_path: Path,
) -> None:
    import pty

    store = tmp_path / "demo.db"
    pid, fd = pty.fork()
    if pid == 0:  # the child: the demo on a terminal
        os.chdir(tmp_path)
        os.execve(sys.executable, [*TETHER, "demo", "--fast", "--store", str(store)], _env())
    answers = {"doc-memo-0001": ["reject"], "doc-tkt-0003": ["edit", "contract"]}
    current: list[str] = []
    screen = ""
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the demo ended: the terminal closed
                break
            if not chunk:
                break
            screen += ANSI.sub("", chunk.decode(errors="replace"))
            for run_id, replies in answers.items():
                if f"review needed ({run_id}:" in screen and replies and not current:
                    current = replies
                    screen = screen.replace(f"review needed ({run_id}:", "asked:")
            last = screen.rstrip().splitlines()[-1] if screen.strip() else ""
            if current and last.endswith(":") and ("reject]" in last or last.startswith("kind")):
                reply = current.pop(0)
                os.write(fd, f"{reply}\n".encode())
                screen += "\n"
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, screen[-3000:]
    assert "ok   no recorded step executed again" in screen, screen[-3000:]
    assert "ok   9 documents published once each" in screen
    every_but_memo = {
        "inv-0001", "inv-0002", "inv-0003", "ctr-0001", "ctr-0002",
        "tkt-0001", "tkt-0002", "tkt-0003", "rpt-0001",
    }  # fmt: skip
    _check_store(store, every_but_memo)
    with sqlite3.connect(f"{store}.side.db") as conn:
        (body,) = conn.execute("SELECT body FROM published WHERE doc_id = 'tkt-0003'").fetchone()
    assert '"kind":"contract"' in body  # the reviewer's edit is what was published


def test_the_demo_replaces_only_a_store_it_made(tmp_path: Path) -> None:
    """A second demo on the same --store starts afresh; a file the demo did not make is
    refused and left as it was (tests/test_cli_inputs.py covers a real tether store)."""
    store = tmp_path / "demo.db"
    args = [*TETHER, "demo", "--auto-approve", "--fast", "--no-crash", "--store", str(store)]
    for _ in range(2):
        out = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=150)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    other = tmp_path / "notes.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    content = other.read_bytes()
    args[-1] = str(other)
    out = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=150)
    assert out.returncode == 1 and "tether did not modify it" in out.stderr, out.stderr
    assert other.read_bytes() == content
