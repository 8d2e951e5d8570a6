"""The ``tether`` command line, driven as real subprocesses against a temp SQLite file."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import parse_quietly

CMD_TIMEOUT = 60.0  # generous bound for one CLI invocation (each imports pydantic etc.)

FLOWS = """
import os
import time

import tether

app = tether.App(store={store!r})


@app.activity
def greet(name: str) -> str:
    return f"hello {{name}}"


@app.activity
def slow_step(marker: str, seconds: float) -> str:
    open(marker, "w").close()  # tells the test the activity is in flight
    time.sleep(seconds)
    return "slow done"


@app.workflow
async def hello(name: str) -> str:
    return await greet(name)


@app.workflow
async def waiter(label: str) -> str:
    tether.set_status({{"stage": "waiting"}})
    payload = await tether.wait_event("go")
    return f"{{label}}: {{payload['x']}}"


@app.workflow
async def review(title: str) -> str:
    d = await tether.approval({{"title": title}}, approvers=["ann"], deadline=3600, allow_edit=True)
    return f"{{d.approved}} {{d.by}} {{d.value}}"


@app.workflow
async def slow(marker: str, seconds: float) -> str:
    return await slow_step(marker, seconds)


@app.activity(retry=tether.Retry(attempts=1))
def charge(order: str) -> str:
    raise tether.NonRetryable(f"card declined for {{order}}")


@app.workflow
async def careful(order: str) -> str:
    try:
        return await charge(order)
    except tether.ActivityError:
        return "cancelled"


@app.workflow
async def pay(order: str) -> str:
    return "paid " + await charge(order)


not_an_app = 42
"""


@dataclass
class Project:
    """A temp directory holding ``flows.py`` and the SQLite store it uses."""

    root: Path
    db: Path

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("COLUMNS", None)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def cli(self, *args: str, timeout: float = CMD_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """Run ``tether ARGS`` to completion in the project directory."""
        return subprocess.run(
            [sys.executable, "-m", "tether.cli", *args],
            cwd=self.root,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def ok(self, *args: str, timeout: float = CMD_TIMEOUT) -> str:
        """Run ``tether ARGS``, assert it succeeded, return its stdout."""
        res = self.cli(*args, timeout=timeout)
        assert res.returncode == 0, (args, res.returncode, res.stdout, res.stderr)
        return res.stdout

    def run_info(self, run_id: str) -> dict[str, Any]:
        info: dict[str, Any] = json.loads(self.ok("get", run_id, "--store", str(self.db), "--json"))
        return info


@dataclass
class WorkerProc:
    """A ``tether worker`` subprocess whose stderr is collected by a reader thread."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(0.5, delay * 1.5)


def assert_one_line_error(res: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    """A clean failure: the exit code, one ``error:`` line on stderr, no traceback."""
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def project(tmp_path: Path) -> Project:
    db = tmp_path / "tether.db"
    (tmp_path / "flows.py").write_text(FLOWS.format(store=f"sqlite:///{db}"))
    return Project(root=tmp_path, db=db)


@pytest.fixture
def start_worker(project: Project) -> Iterator[Callable[..., WorkerProc]]:
    """Start ``tether worker flows:app`` and wait for its start line; stopped at teardown."""
    procs: list[WorkerProc] = []

    def start(*extra: str) -> WorkerProc:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tether.cli", "worker", "flows:app", *extra],
            cwd=project.root,
            env=project.env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        w = WorkerProc(proc)
        procs.append(w)
        wait_until(
            lambda: "serving queues" in w.stderr or proc.poll() is not None,
            CMD_TIMEOUT,
            "the worker's start line",
        )
        assert proc.poll() is None, w.stderr
        return w

    yield start
    for w in procs:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
            try:
                w.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(timeout=5)


# -- happy paths --------------------------------------------------------------------


def test_a_run_no_worker_took_shows_it_waits_for_a_worker(project: Project) -> None:
    # it showed an empty "waiting for", as if it waited for nothing
    run_id = project.ok("start", "flows:app", "hello", '"ada"').strip().splitlines()[0]
    table = project.ok("runs", "--store", str(project.db))
    row = next(x for x in table.splitlines() if run_id in x)
    assert "pending" in row and "a worker (queue default)" in row


def test_start_wait_runs_get_and_history_export(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    w = start_worker()
    line = next(x for x in w.lines if "serving queues" in x)
    assert "default" in line and str(project.db) in line and "tether worker" in line

    out = project.ok("start", "flows:app", "hello", '"ada"', "--wait", "--timeout", "30")
    run_id, result = out.strip().splitlines()
    assert json.loads(result) == "hello ada"

    table = project.ok("runs", "--store", str(project.db))
    row = next(x for x in table.splitlines() if run_id in x)
    assert "hello" in row and "completed" in row
    # --app reads the same store
    assert run_id in project.ok("runs", "--app", "flows:app")
    assert run_id not in project.ok("runs", "--store", str(project.db), "--status", "running")

    listed = json.loads(project.ok("runs", "--store", str(project.db), "--json"))
    assert [r["run_id"] for r in listed] == [run_id]

    human = project.ok("get", run_id, "--store", str(project.db))
    assert "completed" in human and '"hello ada"' in human
    info = project.run_info(run_id)
    assert info["status"] == "completed"
    assert info["output"] == "hello ada"
    assert info["input"] == {"args": ["ada"], "kwargs": {}}

    exported = json.loads(project.ok("history", "export", run_id, "--store", str(project.db)))
    assert exported["run"]["run_id"] == run_id
    assert exported["run"]["status"] == "completed"
    types = [e["type"] for e in exported["events"]]
    assert types[0] == "WorkflowStarted"
    assert "ActivityScheduled" in types and "ActivityCompleted" in types
    assert "WorkflowCompleted" in types
    assert [e["seq"] for e in exported["events"]] == sorted(e["seq"] for e in exported["events"])


def test_start_without_worker_prints_id_and_is_idempotent(project: Project) -> None:
    out = project.ok("start", "flows:app", "hello", '"bob"', "--run-id", "r-1")
    assert out.strip() == "r-1"
    assert project.ok("start", "flows:app", "hello", '"bob"', "--run-id", "r-1").strip() == "r-1"
    assert project.run_info("r-1")["status"] == "pending"
    # same id, different input
    res = project.cli("start", "flows:app", "hello", '"eve"', "--run-id", "r-1")
    assert_one_line_error(res, 1, "r-1")


def test_start_wait_with_no_worker_says_so_and_keeps_waiting(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    """``start --wait`` with no worker running: after a few seconds one line on stderr
    asks whether a worker is running on this store; the wait goes on, and ends once a
    worker takes the run."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.cli", "start", "flows:app", "hello", '"ada"', "--wait"],
        cwd=project.root, env=project.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    waiting = WorkerProc(proc)  # its stderr, read as it comes
    try:
        wait_until(lambda: "no worker" in waiting.stderr, 30, "the line saying no worker took it")
        assert proc.poll() is None  # still waiting
        (line,) = waiting.lines
        assert "has taken run" in line and "yet" in line, line
        assert "tether worker flows:app" in line and str(project.db) in line, line
        start_worker()
        out, _ = proc.communicate(timeout=CMD_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0, waiting.stderr
    run_id, result = out.strip().splitlines()
    assert json.loads(result) == "hello ada" and run_id in line
    assert len(waiting.lines) == 1, waiting.stderr  # said once


def test_start_wait_timeout_says_how_to_keep_waiting(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    """A run a worker took (running, waiting for a signal) is not said to lack one; the
    timeout names the command that keeps waiting, which does (no second run)."""
    start_worker()
    res = project.cli("start", "flows:app", "waiter", '"w"', "--wait", "--timeout", "4")
    run_id = res.stdout.strip()
    assert_one_line_error(res, 1, run_id, "still running after 4 s")
    assert "result()" not in res.stderr and "no worker" not in res.stderr, res.stderr
    again = f"tether start flows:app waiter '\"w\"' --run-id {run_id} --wait"
    assert again in res.stderr, res.stderr
    project.ok("signal", run_id, "go", '{"x": 1}', "--store", str(project.db))
    out = project.ok(*shlex.split(again)[1:])
    assert out.strip().splitlines() == [run_id, '"w: 1"']
    listed = json.loads(project.ok("runs", "--store", str(project.db), "--json"))
    assert [r["run_id"] for r in listed] == [run_id]


def test_signal_a_waiting_run(project: Project, start_worker: Callable[..., WorkerProc]) -> None:
    start_worker()
    store = ("--store", str(project.db))
    assert project.ok("start", "flows:app", "waiter", '"w"', "--run-id", "w1").strip() == "w1"
    wait_until(
        lambda: project.run_info("w1")["custom_status"] == {"stage": "waiting"},
        CMD_TIMEOUT,
        "the run to wait for its signal",
    )
    assert project.run_info("w1")["status"] == "running"
    row = next(x for x in project.ok("runs", *store).splitlines() if "w1" in x)
    assert "running" in row and '{"stage":"waiting"}' in row

    out = project.ok("signal", "w1", "go", '{"x": 42}', *store)
    assert "w1" in out
    wait_until(lambda: project.run_info("w1")["status"] == "completed", CMD_TIMEOUT, "completion")
    assert project.run_info("w1")["output"] == "w: 42"
    events = json.loads(project.ok("history", "export", "w1", *store))["events"]
    signal_event = next(e for e in events if e["type"] == "SignalReceived")
    assert signal_event["data"] == {"name": "go", "payload": {"x": 42}}

    # a finished run takes no more signals
    res = project.cli("signal", "w1", "go", "1", *store)
    assert_one_line_error(res, 1, "w1", "already finished")


def test_a_signal_sent_again_with_its_id_is_not_sent_twice(project: Project) -> None:
    store = ("--store", str(project.db))
    project.ok("start", "flows:app", "waiter", '"w"', "--run-id", "w2")
    assert "sent to run w2" in project.ok("signal", "w2", "go", "1", "--id", "s1", *store)
    again = project.ok("signal", "w2", "go", "1", "--id", "s1", *store)
    assert "already sent" in again and "not sent again" in again
    other = project.cli("signal", "w2", "go", "2", "--id", "s1", *store)
    assert_one_line_error(other, 1, "s1", "another payload")
    events = json.loads(project.ok("history", "export", "w2", *store))["events"]
    sent = [e["data"] for e in events if e["type"] == "SignalReceived"]
    assert sent == [{"name": "go", "signal_id": "s1", "payload": 1}]


def test_approvals_list_show_and_decide(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    start_worker()
    store = ("--store", str(project.db))
    project.ok("start", "flows:app", "review", '"Q3"', "--run-id", "r1")

    def reviews() -> list[dict[str, Any]]:
        return json.loads(project.ok("approvals", "list", "--json", *store))

    wait_until(lambda: len(reviews()) == 1, CMD_TIMEOUT, "the review to open")
    listed = reviews()[0]
    assert listed["approval_id"] == "r1:1" and listed["approvers"] == ["ann"]
    assert "r1:1" in project.ok("approvals", "list", "--approver", "ann", *store)
    assert "no reviews" in project.cli("approvals", "list", "--approver", "bo", *store).stderr
    shown = json.loads(project.ok("approvals", "show", "r1:1", *store))
    assert shown["proposal"] == {"title": "Q3"}
    res = project.cli(
        "approvals", "decide", "r1:1", "--approve", "--by", "ann", "--fingerprint", "bad", *store
    )
    assert_one_line_error(res, 1, "r1:1", "fingerprint does not match")
    shaped = project.cli(
        "approvals",
        "decide",
        "r1:1",
        "--approve",
        "--by",
        "ann",
        "--fingerprint",
        shown["fingerprint"],
        "--value",
        '"Q3 final"',
        *store,
    )  # an edit not of the proposal's shape: refused at once, nothing recorded
    assert_one_line_error(shaped, 1, "r1:1", "must be an object")
    out = project.cli(
        "approvals",
        "decide",
        "r1:1",
        "--approve",
        "--by",
        "ann",
        "--fingerprint",
        shown["fingerprint"],
        "--value",
        '{"title": "Q3 final"}',
        *store,
    )
    assert out.returncode == 0, out.stderr
    wait_until(lambda: project.run_info("r1")["status"] == "completed", CMD_TIMEOUT, "completion")
    assert project.run_info("r1")["output"] == "True ann {'title': 'Q3 final'}"
    assert json.loads(project.ok("approvals", "show", "r1:1", *store))["status"] == "approved"


def test_dead_letters_list_replay_refused_and_resolve(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    start_worker()
    store = ("--store", str(project.db))
    project.ok("start", "flows:app", "careful", '"o-1"', "--run-id", "c1", "--wait")
    (letter,) = json.loads(project.ok("dead-letters", "list", "--json", *store))
    assert (letter["run_id"], letter["name"], letter["resolved_at"]) == ("c1", "charge", None)
    assert "charge" in project.ok("dead-letters", "list", *store)
    lid = str(letter["id"])
    refused = project.cli("dead-letters", "replay", lid, *store)
    assert_one_line_error(refused, 1, "caught the failure", "resolve_dead_letter", "force=True")
    note = "order cancelled, no charge"
    done = project.cli("dead-letters", "resolve", lid, "--note", note, *store)
    assert done.returncode == 0 and "resolved" in done.stderr, done.stderr
    assert json.loads(project.ok("dead-letters", "list", "--json", *store)) == []
    (closed,) = json.loads(project.ok("dead-letters", "list", "--all", "--json", *store))
    assert closed["resolution"]["state"] == "resolved"
    assert closed["resolution"]["note"] == "order cancelled, no charge"
    assert closed["resolution"]["by"].startswith("cli ")
    trail = [json.loads(line) for line in project.ok("audit", "c1", "--json", *store).splitlines()]
    assert [e["detail"]["note"] for e in trail if e["action"] == "resolve dead letter"] == [
        "order cancelled, no charge"
    ]
    again = project.cli("dead-letters", "resolve", lid, "--note", "x", *store)
    assert_one_line_error(again, 1, "already replayed or resolved")


def test_complete_step_finishes_a_failed_run_with_the_operators_result(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    start_worker()
    store = ("--store", str(project.db))
    failed = project.cli("start", "flows:app", "pay", '"o-2"', "--run-id", "p1", "--wait")
    assert failed.returncode != 0, failed.stdout
    bad = project.cli("complete-step", "p1", "1", "ch_9", "--reason", "x", *store)
    assert_one_line_error(bad, 2, "JSON_RESULT is not valid JSON")
    wrong = project.cli("complete-step", "p1", "1", "42", "--reason", "x", "--app", "flows:app")
    assert_one_line_error(wrong, 1, "result of step 1 (charge)")
    why = "charge ch_9 found at the provider"
    out = project.ok("complete-step", "p1", "1", '"ch_9"', "--reason", why, "--app", "flows:app")
    assert "step 1 of run p1 completed" in out
    wait_until(
        lambda: project.run_info("p1")["status"] == "completed", CMD_TIMEOUT, "the run to finish"
    )
    assert project.run_info("p1")["output"] == "paid ch_9"
    trail = [json.loads(line) for line in project.ok("audit", "p1", "--json", *store).splitlines()]
    (entry,) = [e for e in trail if e["action"] == "complete step"]
    assert entry["actor"].startswith("cli ") and entry["detail"]["reason"] == why
    again = project.cli("complete-step", "p1", "1", '"ch_9"', "--reason", why, *store)
    assert_one_line_error(again, 1, "already completed by cli ")


def test_suspend_resume_cancel_terminate(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    start_worker()
    store = ("--store", str(project.db))
    project.ok("start", "flows:app", "waiter", '"a"', "--run-id", "a")
    project.ok("start", "flows:app", "waiter", '"b"', "--run-id", "b")
    for rid in ("a", "b"):
        wait_until(
            lambda rid=rid: project.run_info(rid)["status"] == "running",
            CMD_TIMEOUT,
            f"run {rid} to start",
        )

    project.ok("suspend", "a", *store)
    assert project.run_info("a")["status"] == "suspended"
    assert "a" in project.ok("runs", *store, "--status", "suspended")
    project.ok("resume", "a", *store)
    assert project.run_info("a")["status"] == "running"

    project.ok("cancel", "a", "--reason", "no longer needed", *store)
    wait_until(lambda: project.run_info("a")["status"] == "cancelled", CMD_TIMEOUT, "cancellation")

    project.ok("terminate", "b", "--reason", "stuck", *store)
    info = project.run_info("b")
    assert info["status"] == "terminated"
    assert "stuck" in json.dumps(info["error"])
    res = project.cli("terminate", "b", *store)
    assert_one_line_error(res, 1, "'b'", "already finished")
    # the audit trail names the shell's user and host for each action, the start included
    import getpass
    import socket

    me = f"cli {getpass.getuser()}@{socket.gethostname()}"
    trail = [json.loads(line) for line in project.ok("audit", "a", "--json", *store).splitlines()]
    assert [(t["action"], t["actor"]) for t in trail] == [
        ("start", me),
        ("suspend", me),
        ("resume", me),
        ("cancel", me),
    ]
    assert trail[-1]["detail"] == {"reason": "no longer needed"}
    assert "terminate" in project.ok("audit", "b", *store)


def test_sigterm_lets_in_flight_work_finish_and_exits_zero(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    # short lease: see test_graceful_stop_does_not_strand_the_next_workflow_task
    w = start_worker("--grace", "20", "--lease", "2")
    marker = project.root / "in-flight"
    project.ok("start", "flows:app", "slow", json.dumps(str(marker)), "1.5", "--run-id", "s")
    wait_until(marker.exists, CMD_TIMEOUT, "the activity to start")

    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(timeout=20) == 0, w.stderr
    assert "SIGTERM" in w.stderr and "stopped" in w.stderr
    assert "Traceback" not in w.stderr

    # the in-flight activity was allowed to finish and its result was recorded
    events = json.loads(project.ok("history", "export", "s", "--store", str(project.db)))["events"]
    done = [e for e in events if e["type"] == "ActivityCompleted"]
    assert len(done) == 1 and done[0]["data"].get("result") == "slow done", events

    # a new worker picks the run up where it stopped
    start_worker()
    wait_until(lambda: project.run_info("s")["status"] == "completed", CMD_TIMEOUT, "completion")
    assert project.run_info("s")["output"] == "slow done"


def test_graceful_stop_does_not_strand_the_next_workflow_task(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    w = start_worker("--grace", "20", "--lease", "60")
    marker = project.root / "in-flight"
    project.ok("start", "flows:app", "slow", json.dumps(str(marker)), "1", "--run-id", "s")
    wait_until(marker.exists, CMD_TIMEOUT, "the activity to start")
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(timeout=20) == 0, w.stderr
    start_worker("--lease", "60")
    # far less than the 60 s lease: the new worker should continue the run at once (each
    # look is a CLI process: seconds on a loaded machine, so the budget is generous)
    wait_until(lambda: project.run_info("s")["status"] == "completed", 30.0, "completion")


def test_sigint_stops_an_idle_worker_quickly(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    w = start_worker("-q", "default", "-q", "extra", "--grace", "60")
    assert "serving queues default, extra" in w.stderr
    t0 = time.monotonic()
    w.proc.send_signal(signal.SIGINT)
    assert w.proc.wait(timeout=40) == 0, w.stderr
    assert time.monotonic() - t0 < 30  # idle: it does not wait out its 60 s grace
    assert "Traceback" not in w.stderr and "KeyboardInterrupt" not in w.stderr


# -- errors -----------------------------------------------------------------------------


def test_unknown_run_id(project: Project) -> None:
    project.ok("start", "flows:app", "hello", '"x"')  # creates the store
    store = ("--store", str(project.db))
    for args in (
        ("get", "nope"),
        ("history", "export", "nope"),
        ("signal", "nope", "go"),
        ("cancel", "nope"),
        ("terminate", "nope"),
        ("suspend", "nope"),
        ("resume", "nope"),
    ):
        res = project.cli(*args, *store)
        assert_one_line_error(res, 1, "'nope'")
        assert res.stdout == ""


def test_file_that_is_not_a_database(project: Project) -> None:
    bad = project.root / "garbage.db"
    content = bytes(range(256)) * 64
    bad.write_bytes(content)
    for args in (("runs",), ("get", "x"), ("history", "export", "x"), ("signal", "x", "go")):
        res = project.cli(*args, "--store", str(bad))
        assert_one_line_error(res, 1, "garbage.db", "not a readable tether database")
    assert bad.read_bytes() == content
    assert sorted(p.name for p in project.root.iterdir() if p.name.startswith("garbage")) == [
        "garbage.db"
    ]


def test_sqlite_file_of_another_application_is_left_alone(project: Project) -> None:
    import sqlite3

    other = project.root / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.commit()
    conn.close()
    content = other.read_bytes()
    res = project.cli("runs", "--store", str(other))
    assert_one_line_error(res, 1, "other.db", "not a tether store")
    assert other.read_bytes() == content


def test_missing_store_file_is_not_created(project: Project) -> None:
    missing = project.root / "typo.db"
    res = project.cli("runs", "--store", str(missing))
    assert_one_line_error(res, 1, "typo.db", "does not exist")
    assert not missing.exists()
    # the default store is ./tether.db in the current directory
    res = project.cli("get", "x")
    assert_one_line_error(res, 1, "tether.db")


def test_bad_app_specs_and_workflows(project: Project) -> None:
    cases: list[tuple[tuple[str, ...], int, tuple[str, ...]]] = [
        (("start", "nosuchmodule:app", "hello"), 1, ("nosuchmodule",)),
        (("start", "flows:nope", "hello"), 1, ("has no attribute 'nope'",)),
        (("start", "flows:not_an_app", "hello"), 1, ("not a tether.App",)),
        (("start", "flows", "hello"), 2, ("MODULE:ATTR",)),
        (("start", "flows:app", "nope"), 1, ("no workflow named 'nope'",)),
        (("start", "flows:app", "hello", "unquoted"), 2, ("not valid JSON",)),
        (("start", "flows:app", "hello", '"a"', '"b"'), 2, ("too many",)),
        (("start", "flows:app", "hello", "5"), 2, ("'name'",)),
        (("worker", "nosuchmodule:app"), 1, ("nosuchmodule",)),
        (("worker", "pkg/flows.py:app"), 2, ("names a file", "'pkg.flows:app'")),
        (("worker", "./flows.py:app"), 2, ("names a file", "'flows:app'")),
        (("worker", "/srv/proj/flows.py:app"), 2, ("names a file", "'flows:app'")),
        (("runs", "--app", "flows:nope"), 1, ("has no attribute",)),
        (("runs", "--app", "flows:app", "--store", "x.db"), 2, ("--store or --app",)),
        (("signal", "r", "go", "{bad", "--store", "x.db"), 2, ("not valid JSON",)),
    ]
    for args, code, needles in cases:
        assert_one_line_error(project.cli(*args), code, *needles)


def test_app_whose_store_path_is_bad(project: Project) -> None:
    (project.root / "badstore.py").write_text(
        "import tether\napp = tether.App(store='/nonexistent-dir/x/tether.db')\n"
    )
    for args in (("worker", "badstore:app"), ("runs", "--app", "badstore:app")):
        assert_one_line_error(project.cli(*args), 1, "/nonexistent-dir/x", "does not exist")


def test_broken_user_module_is_reported_in_one_line(project: Project) -> None:
    (project.root / "broken.py").write_text("import tether\nraise RuntimeError('boom')\n")
    res = project.cli("worker", "broken:app")
    assert_one_line_error(res, 1, "RuntimeError: boom", "broken.py")
    (project.root / "syntax.py").write_text("def f(:\n")
    res = project.cli("start", "syntax:app", "wf")
    assert_one_line_error(res, 1, "SyntaxError", "syntax.py")


def test_usage_errors_exit_2(project: Project) -> None:
    res = project.cli("runs", "--status", "bogus")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    res = project.cli("worker", "flows:app", "--lease", "0")
    assert_one_line_error(res, 2, "--lease")
    # tether serve's in-process workers are checked the same way, before anything starts
    res = project.cli("serve", "flows:app", "--workers", "1", "--lease", "0.5")
    assert_one_line_error(res, 2, "--lease", "at least 1")
    res = project.cli("serve", "flows:app", "--workers", "1", "--worker-id", " ")
    assert_one_line_error(res, 2, "--worker-id", "needs a name")
    res = project.cli("serve", "flows:app", "--worker-id", "api-1")
    assert_one_line_error(res, 2, "--worker-id", "--workers")


def test_missing_cli_extra(project: Project) -> None:
    code = "import sys; sys.modules['typer'] = None; from tether.cli import main; main()"
    res = subprocess.run(
        [sys.executable, "-c", code, "runs"],
        cwd=project.root,
        capture_output=True,
        text=True,
        timeout=CMD_TIMEOUT,
        check=False,
    )
    assert res.returncode == 2
    assert "tether[cli]" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_worker_says_when_work_waits_for_another_workers_lease_and_refuses_a_live_id(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    first = start_worker("--id", "w1", "--lease", "30")
    marker = project.root / "in-flight"
    project.ok("start", "flows:app", "slow", json.dumps(str(marker)), "30", "--run-id", "s")
    wait_until(marker.exists, CMD_TIMEOUT, "the activity to start")
    first.proc.send_signal(signal.SIGKILL)  # crashed: its lease stays for up to 30 s
    first.proc.wait(timeout=10)
    second = start_worker("--id", "w2")
    wait_until(lambda: "leased to other worker ids" in second.stderr, CMD_TIMEOUT, "the hint")
    assert "--id" in second.stderr
    # a second process under a live worker's id is refused, in one clear line
    res = project.cli("worker", "flows:app", "--id", "w2")
    assert res.returncode != 0
    assert "in use by a live worker" in res.stderr and "Traceback" not in res.stderr


def test_schedules_create_list_pause_trigger_delete(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    store = ("--store", str(project.db))
    bad = project.cli("schedules", "create", "s", "flows:app", "hello", '"x"', "--cron", "61 * * *")
    assert_one_line_error(bad, 1, "cron=", "five-field")
    bad = project.cli("schedules", "create", "s", "flows:app", "hello", "--every", "60")
    assert bad.returncode == 2 and "hello" in bad.stderr  # the workflow's argument is missing
    assert json.loads(project.ok("schedules", "list", "--json", *store)) == []
    project.ok("schedules", "create", "hi", "flows:app", "hello", '"sched"', "--every", "1")
    start_worker()

    def fired() -> int:
        (s,) = json.loads(project.ok("schedules", "list", "--json", *store))
        return int(s["fired"])

    wait_until(lambda: fired() >= 2, CMD_TIMEOUT, "two ticks")
    assert "every 1s" in project.ok("schedules", "list", *store)
    project.ok("schedules", "pause", "hi", *store)
    (paused,) = json.loads(project.ok("schedules", "list", "--json", *store))
    assert paused["paused"] and paused["next_at"] is None
    run_id = project.ok("schedules", "trigger", "hi", *store).strip()
    assert run_id.startswith("hi@trigger-")
    wait_until(lambda: project.run_info(run_id)["status"] == "completed", CMD_TIMEOUT, "the run")
    assert project.run_info(run_id)["output"] == "hello sched"
    project.ok("schedules", "delete", "hi", *store)
    assert json.loads(project.ok("schedules", "list", "--json", *store)) == []
    missing = project.cli("schedules", "pause", "hi", *store)
    assert_one_line_error(missing, 1, "no schedule 'hi'")


def test_numbers_out_of_range_are_refused_by_the_command_line(project: Project) -> None:
    """Numeric options out of range get a usage error naming the option, never a
    traceback (before: an OverflowError from the store or from bind(), or a worker whose
    every claim failed with a NaN lease)."""
    huge = str(10**23)
    for args in (
        ("runs", "--limit", huge),
        ("approvals", "list", "--limit", huge),
        ("purge", "--older-than", "1d", "--batch", "0"),
        ("store", "reseal", "--batch", huge),
        ("worker", "flows:app", "--concurrency", huge),
        ("worker", "flows:app", "--metrics-port", "99999"),
        ("serve", "flows:app", "--port", "99999"),
        ("serve", "flows:app", "--grace", "nan"),
    ):
        res = project.cli(*args)
        assert res.returncode == 2, (args, res.returncode, res.stderr)
        assert "Traceback" not in res.stderr and "Invalid value" in res.stderr, (args, res.stderr)
        assert args[-2] in res.stderr, (args, res.stderr)
    for lease in ("nan", "inf", "-1"):
        res = project.cli("worker", "flows:app", "--lease", lease)
        assert_one_line_error(res, 2, "--lease must be positive", "finite")
    # a usage error raised before any store is opened is one line too
    nothing = project.cli("replay", "--app", "flows:app")
    assert_one_line_error(nothing, 2, "nothing to replay")


def test_backup_restore_and_check_refuse_a_file_that_is_not_a_store(project: Project) -> None:
    """Bad input gets one clear line and writes nothing: a file that is not an SQLite
    database (or has no tether schema) is neither backed up, restored nor checked with a
    traceback, and no half-made target file is left behind."""
    garbage = project.root / "notes.db"
    garbage.write_text("this is not a database\n" * 100)
    empty = project.root / "empty.db"
    empty.touch()  # a valid (empty) SQLite file without tether's schema
    target = project.root / "restored.db"
    for source in (garbage, empty):
        res = project.cli("store", "restore", str(source), "--to", str(target))
        assert_one_line_error(res, 1, "not a tether backup", "nothing was restored")
        assert not target.exists()
    backup = project.root / "copy.db"
    res = project.cli("store", "backup", str(backup), "--store", str(garbage))
    assert_one_line_error(res, 1, "not a database", "nothing was written")
    assert not backup.exists()
    res = project.cli("store", "check", "--store", str(garbage))
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "not an SQLite database" in json.loads(res.stdout)["problems"][0]
    missing = project.cli("store", "check", "--store", str(project.root / "nowhere.db"))
    assert_one_line_error(missing, 2, "no tether store")
    assert not (project.root / "nowhere.db").exists()  # checking never creates a store
    # a backup into a folder that is not there: said so (it was "unable to open database file")
    res = project.cli("store", "backup", str(project.root / "no" / "such" / "copy.db"))
    assert_one_line_error(res, 2, "/no/such", "does not exist", "create it first")


def test_purge_erase_tenant_backup_restore_and_check(
    project: Project, start_worker: Callable[..., WorkerProc]
) -> None:
    store = ("--store", str(project.db))
    start_worker()
    for rid in ("p1", "p2"):
        project.ok("start", "flows:app", "hello", '"x"', "--run-id", rid, "--wait")
    bad = project.cli("purge", "--older-than", "a while", *store)
    assert_one_line_error(bad, 2, "30d")
    preview = json.loads(project.ok("purge", "--older-than", "0s", "--dry-run", *store))
    assert preview["runs"] == 2 and project.run_info("p1")["status"] == "completed"
    backup = project.root / "backup.db"
    project.ok("store", "backup", str(backup), *store)
    again = project.cli("store", "backup", str(backup), *store)
    assert_one_line_error(again, 2, "exists")
    assert json.loads(project.ok("purge", "--older-than", "0s", *store))["runs"] == 2
    gone = project.cli("get", "p1", *store)
    assert_one_line_error(gone, 1, "purged")
    assert_one_line_error(project.cli("audit", "p1", *store), 1, "purged")  # its trail too
    restored = project.root / "restored.db"
    project.ok("store", "restore", str(backup), "--to", str(restored))
    assert json.loads(project.ok("get", "p1", "--store", str(restored), "--json"))["status"]
    check = json.loads(project.ok("store", "check", "--store", str(restored)))
    assert check["problems"] == []
    # with --app, every unfinished run's history is replayed against that code
    project.ok("start", "flows:app", "waiter", '"w"', "--run-id", "w1")
    wait_until(lambda: project.run_info("w1")["status"] == "running", CMD_TIMEOUT, "w1")
    replayed = json.loads(project.ok("store", "check", "--app", "flows:app"))
    assert replayed["problems"] == [] and replayed["replayed"] == 1
    assert json.loads(project.ok("store", "gc-blobs", *store)) == {"kept": 0, "removed": 0}
    refused = project.cli("erase-tenant", "acme", *store)
    assert_one_line_error(refused, 2, "--yes")
    assert json.loads(project.ok("erase-tenant", "acme", "--yes", *store))["runs"] == 0


def test_purge_and_erase_tenant_name_a_tenant_the_store_does_not_have(project: Project) -> None:
    """`tether erase-tenant nosuch --yes` and `tether purge --tenant nosuch` printed zero
    counts and nothing else: a typo in a tenant's name went unnoticed. Both now say on
    stderr that the store has no runs of it; both still succeed (nothing to remove is
    not an error, and an erasure run again after it finished finds nothing either)."""
    import asyncio

    import tether

    async def seed() -> None:
        app = tether.App(store=f"sqlite:///{project.db}")

        @app.workflow
        async def idle() -> None:
            await tether.wait_event("never")

        await app.start(idle, tenant="acme")  # live: nothing of it is purged
        await app.close()

    asyncio.run(seed())
    store = ("--store", str(project.db))
    known = project.cli("purge", "--older-than", "0s", "--tenant", "acme", *store)
    assert known.returncode == 0 and "no runs of tenant" not in known.stderr, known.stderr
    typo = project.cli("purge", "--older-than", "0s", "--tenant", "acmee", *store)
    assert typo.returncode == 0, typo.stderr
    assert json.loads(typo.stdout)["runs"] == 0
    assert "no runs of tenant 'acmee' in this store" in typo.stderr, typo.stderr
    for args in (("--yes",), ("--dry-run",)):
        typo = project.cli("erase-tenant", "acmee", *args, *store)
        assert typo.returncode == 0, typo.stderr
        assert json.loads(typo.stdout)["runs"] == 0
        assert "nothing of tenant 'acmee' in this store" in typo.stderr, typo.stderr
    known = project.cli("erase-tenant", "acme", "--dry-run", *store)
    assert known.returncode == 0 and "nothing of tenant" not in known.stderr, known.stderr


def test_time_formatting_never_crashes_on_a_stored_value() -> None:
    """A schedule stored with an absurd time (every=1e300) crashed every `tether
    schedules list` with an OverflowError from the time formatting."""
    from tether.cli._common import _ts

    assert _ts(None) == "-" and _ts(0.0).startswith("19")
    for value in (1e300, -1e300, float("nan"), float("inf")):
        assert isinstance(_ts(value), str)


def test_runs_marks_a_stuck_run_and_stuck_lists_only_those(project: Project) -> None:
    """`tether runs` says which live runs cannot move on (their task error's type) and
    `--stuck` lists only them: the runs a deploy broke."""
    import asyncio

    import tether

    def build(first: bool) -> tether.App:
        app = tether.App(store=f"sqlite:///{project.db}")

        @app.activity
        def a() -> str:
            return "a"

        @app.workflow
        async def flow() -> str:
            if first:
                await a()
            await tether.wait_event("go")
            return "done"

        @app.workflow
        async def ping() -> str:
            return "pong"

        return app

    async def go() -> None:
        old, new = build(True), build(False)
        async with old.worker(poll_interval=0.05):
            await old.start(old.get_workflow("flow"), run_id="stuck-1")
            await old.start(old.get_workflow("ping"), run_id="fine-1")
            assert await old.get_run("fine-1").result(timeout=10) == "pong"
            for _ in range(1000):
                if (await old.get("stuck-1")).waiting_on:
                    break
                await asyncio.sleep(0.02)
        await old.signal("stuck-1", "go", None)
        async with new.worker(poll_interval=0.05):
            for _ in range(1000):
                if (await new.get("stuck-1")).task_error:
                    break
                await asyncio.sleep(0.02)
        for app in (old, new):
            await app.close()

    asyncio.run(go())
    table = project.ok("runs", "--store", str(project.db))
    row = next(line for line in table.splitlines() if "stuck-1" in line)
    assert "NonDeterminismError" in row, table
    assert "NonDeterminism" not in next(line for line in table.splitlines() if "fine-1" in line)
    stuck = project.ok("runs", "--store", str(project.db), "--stuck")
    assert "stuck-1" in stuck and "fine-1" not in stuck, stuck
    listed = json.loads(project.ok("runs", "--store", str(project.db), "--stuck", "--json"))
    assert [r["run_id"] for r in listed] == ["stuck-1"]
    assert listed[0]["task_error"].startswith("NonDeterminismError: ")


def _command_mentions(text: str) -> list[tuple[bool, str]]:
    """``tether X [Y]`` in ``text``: (quoted, "X Y"), quoted when in backticks or after
    "run" (surely a command, not prose like "no tether store at")."""
    pattern = r"(\w+\s+)?(`|\brun\s+)?\btether\s+([a-z][a-z-]*)(?:\s+([a-z][a-z-]*))?"
    return [
        (bool(m.group(2)), " ".join(w for w in m.groups()[2:] if w))
        for m in re.finditer(pattern, text)
        # "a tether backup", "no tether store": prose
        if (m.group(1) or "").strip().lower() not in {"a", "an", "the", "no", "any"}
    ]


def test_every_tether_command_named_in_messages_and_docs_exists() -> None:
    """`tether keyring retire` said "run tether reseal first" (the command is `tether
    store reseal`), and tether.encryption's docs named `tether keys shred` (it is
    `tether keyring shred`). Every `tether X [Y]` the code's strings (messages,
    docstrings) and the docs name in backticks or after "run" is a command, and no
    mention anywhere names a subcommand without its group (`tether reseal`)."""
    import ast

    from typer.main import get_command

    import tether
    from tether.cli._main import _build

    root = get_command(_build())
    groups = {
        name: set(getattr(cmd, "commands", {})) or None for name, cmd in root.commands.items()
    }
    # a group's command named without its group ("tether on" is prose)
    subcommands = set().union(*(g for g in groups.values() if g)) - set(groups) - {"on", "off"}
    src = Path(tether.__file__).parent
    texts: list[tuple[str, str]] = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(parse_quietly(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append((f"{path.relative_to(src)}:{node.lineno}", node.value))
    for path in sorted((src.parent.parent / "docs").glob("*.md")):
        texts.append((path.name, path.read_text()))
    wrong = []
    for where, text in texts:
        for quoted, mention in _command_mentions(text):
            first, _, second = mention.partition(" ")
            known = first in groups and (
                not (second and groups[first]) or second in (groups[first] or ())
            )
            if first in subcommands or (quoted and not known):
                wrong.append((where, mention))
    assert not wrong, "\n".join(map(str, wrong))


def test_serve_on_port_0_prints_the_port_it_listens_on(project: Project) -> None:
    """``--port 0`` lets the OS choose: the start line names the bound port (it said
    ``:0``), and the API answers there."""
    import urllib.request

    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.cli", "serve", "flows:app", "--port", "0", "--no-auth"],
        cwd=project.root,
        env=project.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = WorkerProc(proc)
    try:
        wait_until(
            lambda: "API docs at" in server.stderr or proc.poll() is not None,
            CMD_TIMEOUT,
            "the server's start line",
        )
        found = re.search(r"on http://127\.0\.0\.1:(\d+) ", server.stderr)
        assert found is not None, server.stderr
        port = int(found.group(1))
        assert port != 0, server.stderr
        assert "127.0.0.1:0" not in server.stderr, server.stderr  # the --no-auth warning too
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/workflows", timeout=30) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()
    assert code == 0, server.stderr


async def test_start_wait_polls_the_run_status_not_the_whole_run(
    app: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """While a worker is busy on the run's queue (so no notice is due), ``start --wait``'s
    notice check read the whole run (its input decoded) every 3 s; it polls the run's
    status, and reads the run once more only to say why nothing took it."""
    import asyncio

    from tether.cli import runs as cli_runs

    @app.workflow
    async def echo(text: str) -> str:
        return text

    await app.start(echo, "busy", run_id="busy")
    waiting = await app.start(echo, "x" * 10_000, run_id="waiting")
    held = await app.store.claim(worker_id="elsewhere", queues=["default"], limit=1, lease=60)
    assert [t.run_id for t in held] == ["busy"]  # the queue has work running

    reads: list[str] = []
    get_run = app.store.get_run

    async def counted(run_id: str, **kw: Any) -> Any:
        if not kw.get("lenient"):  # a lenient read is a status read's (payloads skipped)
            reads.append(run_id)
        return await get_run(run_id, **kw)

    monkeypatch.setattr(app.store, "get_run", counted)
    monkeypatch.setattr(cli_runs, "UNCLAIMED_NOTICE_AFTER", 0.02)
    monkeypatch.setattr(cli_runs, "UNCLAIMED_REREAD", 1000)
    noticing = asyncio.create_task(cli_runs._say_if_unclaimed(app, waiting.run_id, "flows:app"))
    await asyncio.sleep(0.6)  # many checks
    assert not noticing.done() and "no worker" not in capsys.readouterr().err
    assert reads.count("waiting") <= 1, reads
    noticing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await noticing


async def test_start_wait_says_a_worker_fails_the_run_while_its_queue_stays_busy(
    app: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker that takes the run and keeps failing it, while other runs keep the queue
    busy: the run is read whole again every few status polls, so the notice comes."""
    import asyncio

    from tether.cli import runs as cli_runs

    @app.workflow
    async def echo(text: str) -> str:
        return text

    await app.start(echo, "busy", run_id="busy")
    waiting = await app.start(echo, "x", run_id="waiting")
    held = await app.store.claim(worker_id="elsewhere", queues=["default"], limit=1, lease=60)
    assert [t.run_id for t in held] == ["busy"]  # the queue has work running
    monkeypatch.setattr(cli_runs, "UNCLAIMED_NOTICE_AFTER", 0.02)
    monkeypatch.setattr(cli_runs, "UNCLAIMED_REREAD", 5)
    noticing = asyncio.create_task(cli_runs._say_if_unclaimed(app, waiting.run_id, "flows:app"))
    await asyncio.sleep(0.1)  # its first whole read saw no error
    # then a worker takes the run's task and gives it back, saying why it cannot run it
    (task,) = await app.store.claim(worker_id="stale", queues=["default"], limit=1, lease=60)
    assert task.run_id == "waiting"
    await app.store.release([task], note="ModuleNotFoundError: no module named 'flows'")
    await asyncio.wait_for(noticing, 5)
    err = capsys.readouterr().err
    assert "has not started yet: ModuleNotFoundError" in err, err
