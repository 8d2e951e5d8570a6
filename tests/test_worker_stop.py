"""A worker that stops, gracefully or on an error, never turns work in flight into failures.

In-flight work is either finished, or handed back for the next worker (SIGKILL-like
losses aside, which count an attempt because nothing can tell them apart from a crash
of the activity itself).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import tether
from tether._errors import StoreError
from tether._history import EventType

CMD_TIMEOUT = 60.0

FLOWS = """
import asyncio
import os
import time

import tether

app = tether.App(store={store!r})
HERE = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("SLOW_METRICS"):  # the worker claims and starts work before it fails
    import tether.metrics

    _update = tether.metrics.Metrics.update

    async def _slow_update(self):
        await asyncio.sleep(float(os.environ["SLOW_METRICS"]))
        await _update(self)

    tether.metrics.Metrics.update = _slow_update


def note(what: str) -> None:
    with open(os.path.join(HERE, "log.txt"), "a") as f:
        f.write(f"{{os.getpid()}} {{what}}\\n")


@app.activity
async def nap(i: int) -> int:
    note(f"nap {{i}} start")
    await asyncio.sleep(float(os.environ.get("NAP", "0.1")))
    note(f"nap {{i}} end")
    return i


@app.activity
def block(seconds: float) -> str:
    note("block start")
    time.sleep(seconds)
    note("block end")
    return "blocked"


@app.workflow
async def napper(i: int) -> int:
    return await nap(i)


@app.workflow
async def blocker(seconds: float) -> str:
    return await block(seconds)
"""


class Project:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.db = root / "tether.db"
        (root / "flows.py").write_text(FLOWS.format(store=f"sqlite:///{self.db}"))

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tether.cli", *args],
            cwd=self.root,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=CMD_TIMEOUT,
            check=False,
        )

    def ok(self, *args: str) -> str:
        res = self.cli(*args)
        assert res.returncode == 0, (args, res.stdout, res.stderr)
        return res.stdout

    def worker(self, *args: str, **env: str) -> tuple[subprocess.Popen[str], list[str]]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tether.cli", "worker", "flows:app", *args],
            cwd=self.root,
            env=self.env(**env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append(line.rstrip("\n"))

        threading.Thread(target=read, daemon=True).start()
        return proc, lines

    def status(self, run_id: str) -> dict[str, object]:
        info: dict[str, object] = json.loads(
            self.ok("get", run_id, "--store", str(self.db), "--json")
        )
        return info

    def log(self) -> list[str]:
        path = self.root / "log.txt"
        return path.read_text().splitlines() if path.exists() else []


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return Project(tmp_path)


# -- 1. a worker torn down by an error releases its work -------------------------------


def test_worker_failing_after_start_hands_its_runs_to_the_next_worker(project: Project) -> None:
    """``tether worker --metrics-port`` on a busy port fails after the worker started and
    claimed work: one error line, and the runs it held carry on under the next worker
    (before: asyncio.run cancelled them and each was recorded as failed for good)."""
    runs = [f"r{i}" for i in range(3)]
    for i, run_id in enumerate(runs):
        project.ok("start", "flows:app", "napper", str(i), "--run-id", run_id)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        res = project.cli(
            "worker",
            "flows:app",
            "--metrics-port",
            str(port),
            "--grace",
            "0",
            NAP="30",
            SLOW_METRICS="2",
        )
    finally:
        busy.close()
    assert res.returncode == 1, res.stderr
    errors = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "--metrics-port" in errors[0], res.stderr
    assert "Traceback" not in res.stderr
    started = [x for x in project.log() if "start" in x]
    assert len(started) == 3, "the worker should have claimed and started the work"
    for run_id in runs:
        assert project.status(run_id)["status"] == "running", project.status(run_id)
    proc, _lines = project.worker("--lease", "5", NAP="0.1")
    try:
        for i, run_id in enumerate(runs):
            wait_until(lambda r=run_id: project.status(r)["status"] != "running", 30, run_id)
            info = project.status(run_id)
            assert info["status"] == "completed" and info["output"] == i, info
    finally:
        stop(proc)


def test_loop_teardown_never_records_the_activity_as_failed(store_url: str) -> None:
    """A service embedding a worker dies without ``Worker.stop()``: asyncio.run cancels
    the worker's tasks. That cancel is not the run's: the step is handed back, not failed."""
    app = tether.App(store=store_url)
    pause = [30.0]
    began: list[int] = []

    @app.activity
    async def slow(n: float) -> float:
        began.append(tether.activity_context().attempt)
        await asyncio.sleep(pause[0])
        return n

    @app.workflow
    async def pipeline(n: float) -> float:
        return await slow(n)

    async def service() -> None:
        w = app.worker(lease=30.0, poll_interval=0.05)
        task = asyncio.create_task(w.run())
        await app.start(pipeline, 3.0, run_id="job-1")
        for _ in range(200):
            if began:
                break
            await asyncio.sleep(0.05)
        assert began and not task.done()
        raise RuntimeError("the service died")

    with pytest.raises(RuntimeError, match="service died"):
        asyncio.run(service())

    async def check() -> None:
        info = await app.get("job-1")
        assert info.status.value == "running", info.error
        types = [e.type for e in await app.history("job-1")]
        assert EventType.ACTIVITY_FAILED not in types, types
        pause[0] = 0.0
        # handed back at once (no wait for the 30 s lease), its attempt not spent
        async with app.worker(lease=30.0, poll_interval=0.05):
            assert await app.get_run("job-1").result(timeout=10) == 3.0
        assert began == [1, 1]
        await app.close()

    asyncio.run(check())


# -- 2. a worker that takes its own expired task back --------------------------------


async def test_a_worker_retaking_its_own_expired_task_runs_one_attempt_at_a_time(
    app: tether.App,
) -> None:
    """Lease renewals fail for a while, so the lease of an activity still running expires
    and the same worker claims its task again. The stale attempt is stopped (nothing it
    does can be recorded) and the new one is renewed and recorded (before: the in-flight
    table was keyed by task id only, so the old attempt's end dropped the new one's entry,
    the attempts piled up concurrently and the step failed 'attempt 6 exceeds the 5
    allowed')."""
    lease = 1.0
    running = [0]
    most = [0]
    attempts: list[int] = []

    @app.activity
    async def embed(doc: str) -> str:
        attempts.append(tether.activity_context().attempt)
        running[0] += 1
        most[0] = max(most[0], running[0])
        try:
            await asyncio.sleep(4)
        finally:
            running[0] -= 1
        return "vector"

    @app.workflow
    async def pipeline(doc: str) -> str:
        return await embed(doc)

    store = app.store
    real_renew = store.renew
    t0 = time.monotonic()

    async def flaky_renew(tasks: object, lease: float) -> object:
        if time.monotonic() - t0 < 2.5 * lease:
            raise StoreError("simulated: connection reset during lease renewal")
        return await real_renew(tasks, lease)  # type: ignore[arg-type]

    store.renew = flaky_renew  # type: ignore[method-assign]
    async with app.worker(lease=lease, poll_interval=0.05):
        run = await app.start(pipeline, "doc")
        assert await run.result(timeout=30) == "vector"
    assert most[0] == 1, attempts
    assert len(attempts) <= 3, attempts


def test_a_lease_shorter_than_a_second_is_refused(project: Project) -> None:
    """``--lease 0.01`` expired between renewals: each activity ran twice at once and its
    step then failed with a CancelledError. Such a lease is a usage error now."""
    for lease in ("0.01", "0.5"):
        res = project.cli("worker", "flows:app", "--lease", lease)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --lease must be at least 1"), lines


# -- 3. a graceful stop does not spend an attempt ------------------------------------


async def test_graceful_stops_during_an_activity_do_not_use_up_its_retries(
    app: tether.App,
) -> None:
    """Each rolling restart interrupts a long activity: the attempt it interrupted is
    given back with the task (the worker stopped it; the activity did not fail), so
    ``Retry(attempts=2)`` survives any number of deploys (before: the third start failed
    'attempt 3 exceeds the 2 allowed ... (worker crash or heartbeat timeout)')."""
    seen: list[int] = []

    @app.activity(retry=tether.Retry(attempts=2, initial=0.1))
    async def long_job() -> str:
        seen.append(tether.activity_context().attempt)
        await asyncio.sleep(1.5 if len(seen) < 4 else 0.01)
        return "done"

    @app.workflow
    async def wf() -> str:
        return await long_job()

    run = await app.start(wf, run_id="r")
    for restart in range(3):
        w = app.worker(worker_id="w1", poll_interval=0.05)
        await w.start()
        for _ in range(400):
            if len(seen) > restart:
                break
            await asyncio.sleep(0.05)
        await w.stop(grace=0.1)  # a deploy's SIGTERM
    async with app.worker(worker_id="w1", poll_interval=0.05):
        assert await run.result(timeout=10) == "done"
    assert seen == [1, 1, 1, 1]
    types = [e.type for e in await app.history("r")]
    assert EventType.ACTIVITY_FAILED not in types and EventType.ACTIVITY_COMPLETED in types


# -- 4. a graceful stop waits for a sync activity's thread ---------------------------


def test_sigterm_with_a_sync_activity_running_waits_for_its_thread(project: Project) -> None:
    """A sync activity's thread cannot be interrupted: the stopping worker keeps its task
    (renewing the lease) until the thread returns, says so, and records the result; the
    other worker never runs the same step at the same time (before: the task was released
    after ``--grace`` while the thread ran on, and a second worker ran it again)."""
    project.ok("start", "flows:app", "blocker", "5", "--run-id", "b")
    first, first_err = project.worker("--grace", "1", "--lease", "2")
    second = None
    try:
        wait_until(lambda: "block start" in " ".join(project.log()), CMD_TIMEOUT, "the thread")
        second, second_err = project.worker("--lease", "2")
        wait_until(
            lambda: any("serving queues" in x for x in second_err), CMD_TIMEOUT, "second worker"
        )
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0, "\n".join(first_err)
        err = "\n".join(first_err)
        assert "waiting for 1 sync activity thread(s) (block)" in err, err
        assert "block end" in " ".join(project.log())  # it did not exit before the thread
        wait_until(lambda: project.status("b")["status"] != "running", 30, "the run")
        info = project.status("b")
        assert info["status"] == "completed" and info["output"] == "blocked", info
        starts = [x for x in project.log() if "block start" in x]
        assert len(starts) == 1, project.log()
    finally:
        stop(first)
        if second is not None:
            stop(second)


def test_sigterm_with_a_stuck_sync_activity_exits_after_thread_grace(project: Project) -> None:
    """A sync activity that does not return held ``tether worker`` after SIGTERM for as
    long as it ran (forever for a stuck one). After ``--thread-grace`` the worker exits
    (0) without it, naming the activity and run; another worker retries the step once
    the lease the first one no longer renews has expired."""
    project.ok("start", "flows:app", "blocker", "3600", "--run-id", "stuck")
    first, first_err = project.worker("--grace", "0.2", "--thread-grace", "1", "--lease", "2")
    second = None
    try:
        wait_until(lambda: "block start" in " ".join(project.log()), CMD_TIMEOUT, "the thread")
        began = time.monotonic()
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0, "\n".join(first_err)
        assert time.monotonic() - began < 15
        err = "\n".join(first_err)
        assert "sync activity 'block' of run 'stuck'" in err, err
        assert "exiting with 1 sync activity thread(s) still running (block of run stuck)" in err
        assert project.status("stuck")["status"] == "running"
        second, second_err = project.worker("--grace", "0.2", "--thread-grace", "0", "--lease", "2")
        wait_until(
            lambda: len([x for x in project.log() if "block start" in x]) == 2,
            CMD_TIMEOUT,
            "the retry",
        )
        pids = {x.split()[0] for x in project.log() if "block start" in x}
        assert pids == {str(first.pid), str(second.pid)}, project.log()
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0, "\n".join(second_err)
    finally:
        stop(first)
        if second is not None:
            stop(second)


def test_loop_teardown_hands_a_batch_back_too(store_url: str) -> None:
    """The same for a batched activity: every item is handed back, none failed."""
    app = tether.App(store=store_url)
    pause = [30.0]
    calls: list[list[int]] = []

    @app.activity(batch=tether.Batch(max_items=3, max_wait=0.2))
    async def double(xs: list[int]) -> list[int]:
        calls.append(xs)
        await asyncio.sleep(pause[0])
        return [2 * x for x in xs]

    @app.workflow
    async def doubles(n: int) -> list[int]:
        return list(await tether.gather(*(double(i) for i in range(n))))

    async def service() -> None:
        w = app.worker(lease=30.0, poll_interval=0.05)
        task = asyncio.create_task(w.run())
        await app.start(doubles, 3, run_id="b-1")
        for _ in range(200):
            if calls:
                break
            await asyncio.sleep(0.05)
        assert calls and not task.done()
        raise RuntimeError("the service died")

    with pytest.raises(RuntimeError, match="service died"):
        asyncio.run(service())

    async def check() -> None:
        types = [e.type for e in await app.history("b-1")]
        assert EventType.ACTIVITY_FAILED not in types, types
        pause[0] = 0.0
        async with app.worker(lease=30.0, poll_interval=0.05):
            assert await app.get_run("b-1").result(timeout=10) == [0, 2, 4]
        await app.close()

    asyncio.run(check())


async def test_a_graceful_stop_waits_for_a_sync_batch_thread(app: tether.App) -> None:
    """A sync batch function runs in a thread too: the stop waits for it and records
    its results instead of releasing its items under it."""
    gate = threading.Event()
    calls: list[list[int]] = []

    @app.activity(batch=tether.Batch(max_items=3, max_wait=0.2))
    def triple(xs: list[int]) -> list[int]:
        calls.append(xs)
        gate.wait(10)
        return [3 * x for x in xs]

    @app.workflow
    async def triples(n: int) -> list[int]:
        return list(await tether.gather(*(triple(i) for i in range(n))))

    w = app.worker(lease=2.0, poll_interval=0.05)
    await w.start()
    run = await app.start(triples, 3)
    for _ in range(200):
        if calls:
            break
        await asyncio.sleep(0.05)
    assert calls
    asyncio.get_running_loop().call_later(1.5, gate.set)
    await w.stop(grace=0.2)
    completed = [e for e in await app.history(run.run_id) if e.type is EventType.ACTIVITY_COMPLETED]
    assert len(completed) == 3  # recorded by the stopping worker, after its thread
    async with app.worker(poll_interval=0.05):
        assert await run.result(timeout=10) == [0, 3, 6]
    assert len(calls) == 1


async def test_a_stop_waits_for_a_stuck_sync_thread_only_for_its_thread_grace(
    app: tether.App, caplog: pytest.LogCaptureFixture
) -> None:
    """A sync activity that never returns held ``stop()`` forever (its thread cannot be
    killed). The wait for it is now bounded by ``thread_grace``: then the stop returns,
    says which activity of which run it left, and leaves the attempt to its lease, so
    another worker retries the step once the lease (no longer renewed) expires. What
    the stuck thread returns at last is not recorded (the fence refuses it)."""
    import logging

    gate = threading.Event()
    attempts: list[int] = []

    @app.activity
    def stuck() -> str:
        attempts.append(tether.activity_context().attempt)
        if len(attempts) == 1:
            gate.wait(60)  # "never" returns while the test runs
            return "late"
        return "retried"

    @app.workflow
    async def wf() -> str:
        return await stuck()

    w = app.worker(lease=1.0, poll_interval=0.05)
    await w.start()
    run = await app.start(wf, run_id="s")
    try:
        for _ in range(200):
            if attempts:
                break
            await asyncio.sleep(0.05)
        assert attempts == [1]
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="tether"):
            await asyncio.wait_for(w.stop(grace=0.2, thread_grace=0.5), 10)
        took = time.monotonic() - began
        assert 0.6 < took < 5, took
        said = [r.getMessage() for r in caplog.records if "still runs after" in r.getMessage()]
        assert len(said) == 1 and "'stuck'" in said[0] and "'s'" in said[0], said
        async with app.worker(lease=1.0, poll_interval=0.05):
            assert await run.result(timeout=20) == "retried"
        assert attempts == [1, 2]
    finally:
        gate.set()
    await asyncio.sleep(0.2)  # the stuck thread returns: nothing more is recorded
    completed = [e for e in await app.history("s") if e.type is EventType.ACTIVITY_COMPLETED]
    assert len(completed) == 1
    assert (await app.get("s")).status is tether.RunStatus.COMPLETED
