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
    """A pipe's environment: the demo's output is 120 columns wide (COLUMNS narrows it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("COLUMNS", None)
    return env


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


def test_a_store_in_a_folder_that_does_not_exist_is_said_in_one_line(tmp_path: Path) -> None:
    """It was a traceback (sqlite3's "unable to open database file")."""
    store = tmp_path / "no-such-dir" / "demo.db"
    out = subprocess.run(
        [*TETHER, "demo", "--fast", "--auto-approve", "--store", str(store)],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "does not exist" in lines[0] and str(store.parent) in lines[0], lines[0]
    assert not store.parent.exists()


def _dead_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_model_without_its_api_key_is_said_up_front(tmp_path: Path) -> None:
    """No OPENAI_API_KEY: one line before anything starts, not ten failed runs whose
    reason only ``tether get`` shows."""
    store = tmp_path / "demo.db"
    env = {k: v for k, v in _env().items() if k not in {"OPENAI_API_KEY", "OPENAI_BASE_URL"}}
    env.pop("ANTHROPIC_API_KEY", None)

    def demo(model: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*TETHER, "demo", "--model", model, "--fast", "--auto-approve", "--store", str(store)],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    out = demo("openai:gpt-4o-mini")
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "no API key: set OPENAI_API_KEY" in lines[0] and "openai:gpt-4o-mini" in lines[0]
    # what a user of the command can do: no "pass api_key=" (a Python argument)
    assert "api_key=" not in lines[0] and "--base-url" in lines[0], lines[0]
    assert "worker process started" not in out.stdout and not store.exists()
    out = demo("anthropic:claude-haiku-4-5")
    assert out.returncode == 2 and "no API key: set ANTHROPIC_API_KEY" in out.stderr, out.stderr
    assert "api_key=" not in out.stderr
    out = demo("nosuchprovider:m")
    assert out.returncode == 2 and "Unknown model" in out.stderr, out.stderr
    assert "pass a Model" not in out.stderr and "--base-url" in out.stderr, out.stderr


def test_runs_that_fail_show_their_status_and_why(tmp_path: Path) -> None:
    """A --base-url nothing listens on: every run fails; the table says so and the
    distinct errors are printed once each under it (not ``-`` and ``pid None``).

    Under load the demo's crash can land on a step's last allowed attempt: that run
    ends on a second error (the lost attempt), itself said once."""
    store = tmp_path / "demo.db"
    url = f"http://127.0.0.1:{_dead_port()}/v1"
    out = subprocess.run(
        [*TETHER, "demo", "--model", "m", "--base-url", url, "--fast", "--auto-approve",
         "--store", str(store)],
        env=_env(), capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    text = out.stdout
    assert out.returncode == 1, text[-3000:] + out.stderr[-3000:]
    rows = [line.split() for line in text.splitlines() if re.match(r"\s+\w+-\d{4}\s", line)]
    assert len(rows) == 10 and all(row[2] == "failed" for row in rows), text[-3000:]
    errors = text.split("runs failed", 1)[1].split("FAIL", 1)[0]
    assert "10 runs failed" in text and "ActivityError" in errors, text[-3000:]
    # each distinct error once, with how many runs it ended ("(9: inv-0001, ...)"); the
    # lines may wrap, so read them with the whitespace made single
    said = re.findall(r"(\w+Error: .*?) \((\d+): [^)]*\)", " ".join(errors.split()))
    lines = [line for line, _ in said]
    assert len(lines) == len(set(lines)) and sum(int(n) for _, n in said) == 10, errors
    assert all(line.startswith("ActivityError: activity 'tether.ai.call' ") for line in lines)
    refused = [line for line in lines if "ModelConnectionError" in line]
    assert len(refused) == 1, errors  # the same error, said once
    # the one other error there may be: the worker was killed (the demo's crash) while a
    # run's last allowed attempt was in flight; that attempt was lost, and the run ended
    # on the retry past its budget (a loaded machine makes the crash land there)
    lost = [line for line in lines if line not in refused]
    assert len(lost) <= 1 and all("earlier attempts were lost" in ln for ln in lost), errors
    assert not lost or "CRASH: killed the worker" in text, text[-3000:]
    assert "pid None" not in text
    assert "tether get doc-" in errors  # where to read one in full


def test_the_outcome_table_fits_80_columns(tmp_path: Path) -> None:
    """COLUMNS=80: no cell or header cut short (``docu…``, ``publ…``, ``$0.…``)."""
    store = tmp_path / "demo.db"
    out = subprocess.run(
        [*TETHER, "demo", "--auto-approve", "--fast", "--store", str(store)],
        env={**_env(), "COLUMNS": "80"}, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "…" not in text, text[-3000:]
    end = text.index("model cost")
    table = text[text.rindex("document", 0, end) : end]
    assert max(len(line) for line in table.splitlines()) <= 80, table
    for word in ("kind", "outcome", "steps", "retries", "tokens", "cost"):
        assert word in table.splitlines()[0], table
    rows = [line.split() for line in table.splitlines() if re.match(r"\s*\w+-\d{4}\s", line)]
    assert len(rows) == 10 and all(row[2] == "published" for row in rows), table
    assert all(re.fullmatch(r"\$\d+\.\d+", row[-1]) for row in rows), table


def test_runs_that_end_before_the_crash_point_are_said_so() -> None:
    """Every run ended (failed, say) before the worker was due to be killed: the check
    says so, not ``worker killed (pid None)``."""
    from tether.demo.run import Options, _crash_check, _State

    ok, text = _crash_check(Options(store=Path("demo.db")), _State())
    assert not ok and "pid None" not in text, text
    assert "every run ended before the crash point" in text
    ok, text = _crash_check(Options(store=Path("demo.db"), crash=False), _State())
    assert ok and text == "no crash asked for (--no-crash)"
