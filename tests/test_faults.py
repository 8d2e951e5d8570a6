"""tether.testing fault injection: each fault does what it says and counts it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import tether
from tether._classify import classify
from tether.testing import (
    CRASH_ENV,
    Duplicate,
    Env,
    Fail,
    Faults,
    Hang,
    InjectedHTTPError,
    Malformed,
    RateLimit,
    SimulatedCrash,
    crash_after_writes,
    faults,
    inject,
)

HERE = Path(__file__).parent


@pytest.fixture
def mem_app() -> tether.App:
    return tether.App(store=":memory:")


async def _history(app: tether.App, run_id: str, kind: str) -> list[dict[str, Any]]:
    return [e.data for e in await app.history(run_id) if e.type.value == kind]


async def test_fail_raises_n_times_then_succeeds_and_restores(mem_app: tether.App) -> None:
    @mem_app.activity(retry=tether.Retry(attempts=5, initial=1.0, jitter=0))
    def classify_text(text: str) -> str:
        return "pos" if "good" in text else "neg"

    @mem_app.workflow
    async def wf(text: str) -> str:
        return await classify_text(text)

    original = mem_app._activities["classify_text"]
    with faults.inject(mem_app, "classify_text", Fail(times=2, exc=ConnectionError("blip"))) as f:
        assert mem_app._activities["classify_text"] is not original
        async with Env(mem_app):
            run = await mem_app.start(wf, "good day")
            assert await run.result(timeout=5) == "pos"
    assert mem_app._activities["classify_text"] is original
    assert (f.calls, f.injected, f.passed) == (3, 2, 1)
    assert f.faults[0].injected == 2
    failed = await _history(mem_app, run.run_id, "ActivityAttemptFailed")
    assert [d["error"]["type"] for d in failed] == ["ConnectionError", "ConnectionError"]
    assert failed[0]["error"]["message"] == "blip"


async def test_fail_beyond_the_retry_budget_fails_the_step(mem_app: tether.App) -> None:
    @mem_app.activity(retry=tether.Retry(attempts=2, initial=1.0, jitter=0))
    def fetch() -> str:
        return "data"

    @mem_app.workflow
    async def wf() -> str:
        try:
            return await fetch()
        except tether.ActivityError as exc:
            return f"gave up: {exc.error_type} after {exc.attempts}"

    with inject(mem_app, fetch, Fail(times=None, exc=TimeoutError("slow"))) as f:
        async with Env(mem_app):
            run = await mem_app.start(wf)
            assert await run.result(timeout=5) == "gave up: TimeoutError after 2"
    assert (f.injected, f.passed) == (2, 0)


def test_rate_limit_error_is_classified_as_http_429_with_retry_after() -> None:
    exc = RateLimit(retry_after=2)._make()
    assert isinstance(exc, InjectedHTTPError)
    assert exc.status_code == 429 and exc.response.headers == {"retry-after": "2"}
    verdict = classify(exc)
    assert verdict.retryable and verdict.retry_after == 2.0 and verdict.reason == "HTTP 429"


async def test_rate_limit_delays_the_retry_by_retry_after(mem_app: tether.App) -> None:
    @mem_app.activity(retry=tether.Retry(attempts=5, initial=30.0, jitter=0))
    async def call_model(prompt: str) -> str:
        return prompt.upper()

    @mem_app.workflow
    async def wf() -> str:
        return await call_model("hi")

    with inject(mem_app, "call_model", RateLimit(times=1, retry_after=7)) as f:
        async with Env(mem_app):
            run = await mem_app.start(wf)
            assert await run.result(timeout=5) == "HI"
    assert (f.injected, f.passed) == (1, 1)
    (attempt,) = await _history(mem_app, run.run_id, "ActivityAttemptFailed")
    assert attempt["error"]["retry_after"] == 7.0
    assert attempt["error"]["reason"] == "HTTP 429"
    # the Retry-After (7 s) replaced the policy's 30 s backoff
    events = await mem_app.history(run.run_id)
    failed_at = next(e.created_at for e in events if e.type.value == "ActivityAttemptFailed")
    assert round(attempt["retry_at"] - failed_at, 6) == 7.0


async def test_hang_is_ended_by_the_attempt_timeout_async(mem_app: tether.App) -> None:
    @mem_app.activity(timeout=0.2, retry=tether.Retry(attempts=3, initial=1.0, jitter=0))
    async def slow() -> str:
        return "done"

    @mem_app.workflow
    async def wf() -> str:
        return await slow()

    t0 = time.monotonic()
    with inject(mem_app, "slow", Hang(times=1, seconds=30)) as f:
        async with Env(mem_app):
            run = await mem_app.start(wf)
            assert await run.result(timeout=20) == "done"
    assert time.monotonic() - t0 < 20  # the 0.2 s attempt timeout, not the 30 s hang
    assert (f.injected, f.passed) == (1, 1)
    (attempt,) = await _history(mem_app, run.run_id, "ActivityAttemptFailed")
    assert attempt["error"]["type"] == "TimeoutError"


async def test_hang_in_a_sync_activity_is_bounded_and_released(mem_app: tether.App) -> None:
    @mem_app.activity(timeout=0.2, retry=tether.Retry(attempts=3, initial=1.0, jitter=0))
    def blocking() -> str:
        return "done"

    @mem_app.workflow
    async def wf() -> str:
        return await blocking()

    hang = Hang(times=1, seconds=60)
    t0 = time.monotonic()
    with inject(mem_app, "blocking", hang):
        async with Env(mem_app):
            run = await mem_app.start(wf)
            assert await run.result(timeout=30) == "done"
    # leaving the block released the stuck thread: the Env's stop did not wait 60 s
    assert hang._released.is_set()
    assert time.monotonic() - t0 < 40
    assert hang.injected == 1


async def test_malformed_replaces_the_result_n_times(mem_app: tether.App) -> None:
    ran: list[str] = []

    @mem_app.activity
    def label(text: str) -> str:
        ran.append(text)
        return "pos"

    @mem_app.workflow
    async def wf() -> list[str]:
        return [await label("a"), await label("b"), await label("c")]

    with Faults(mem_app) as fs:
        inj = fs.inject(
            "label", Malformed(times=1, value="{not json"), Malformed(times=1, value=str.upper)
        )
        async with Env(mem_app):
            run = await mem_app.start(wf)
            assert await run.result(timeout=5) == ["{not json", "POS", "pos"]
    assert ran == ["a", "b", "c"]  # the real function ran; only its output was corrupted
    assert [f.injected for f in inj.faults] == [1, 1]
    assert inj.passed == 1


async def test_duplicate_delivery_exposes_a_non_idempotent_activity(mem_app: tether.App) -> None:
    charges: list[str] = []
    applied: set[str] = set()
    effects: list[str] = []

    @mem_app.activity
    def charge_naive(amount: int) -> str:
        charges.append(f"{amount}")
        return "charged"

    @mem_app.activity
    def charge_safe(amount: int) -> str:
        key = tether.activity_context().idempotency_key
        if key not in applied:
            applied.add(key)
            effects.append(f"{amount}")
        return "charged"

    @mem_app.workflow
    async def wf() -> list[str]:
        return [await charge_naive(5), await charge_safe(5)]

    with Faults(mem_app) as fs:
        naive = fs.inject("charge_naive", Duplicate())
        safe = fs.inject(charge_safe, Duplicate())
        async with Env(mem_app):
            run = await mem_app.start(wf)
            assert await run.result(timeout=5) == ["charged", "charged"]
    assert (naive.injected, safe.injected) == (1, 1)
    assert charges == ["5", "5"]  # delivered twice: the naive activity charged twice
    assert effects == ["5"]  # the idempotent one applied its effect once


def test_inject_refuses_unknown_activities_and_empty_fault_lists(mem_app: tether.App) -> None:
    @mem_app.activity
    def known() -> None:
        return None

    with pytest.raises(tether.TetherError), inject(mem_app, "unknown", Fail()):
        pass
    with pytest.raises(tether.ConfigurationError), inject(mem_app, "known"):
        pass
    with pytest.raises(tether.ConfigurationError), Faults(mem_app) as fs:
        fs.inject("known", Fail())
        fs.inject("known", Fail())
    assert mem_app._activities["known"] is known


@pytest.mark.parametrize("times", [-1, float("nan"), 1.5, True, "2"])
def test_a_fault_refuses_times_that_is_not_a_count(times: Any) -> None:
    """``Fail(times=nan)`` passed the ``< 0`` check and then acted on every call for
    ever; ``1.5`` or ``True`` were taken as counts. Each is a ConfigurationError."""
    with pytest.raises(tether.ConfigurationError, match="times= of Fail must be a whole"):
        Fail(times=times)
    assert Fail(times=None).times is None and Fail(times=0).times == 0


@pytest.mark.parametrize("start", [float("nan"), float("inf"), "now", True])
def test_a_virtual_clock_refuses_a_start_that_is_not_a_time(start: Any) -> None:
    with pytest.raises(tether.ConfigurationError, match="start= must be epoch seconds"):
        Env(tether.App(store=":memory:"), start=start)


async def test_crash_after_writes_then_recover_in_process(mem_app: tether.App) -> None:
    ran: list[int] = []

    @mem_app.activity
    def step(i: int) -> int:
        ran.append(i)
        return i * 10

    @mem_app.workflow
    async def three() -> list[int]:
        return [await step(i) for i in range(3)]

    async with Env(mem_app, lease=5.0) as env:
        crash = crash_after_writes(mem_app, 3)
        run = await mem_app.start(three)  # write 1: the run is created
        assert await crash.wait(timeout=5)
        assert crash.writes == 3
        with pytest.raises(SimulatedCrash):  # the store is dead until the 'restart'
            await mem_app.store.get_run(run.run_id)
        await crash.recover(env)
        assert await run.result(timeout=10) == [0, 10, 20]
    # at least once: no step ran more than twice, every step ran
    assert sorted(set(ran)) == [0, 1, 2]
    assert all(ran.count(i) <= 2 for i in range(3))


def test_process_exits_with_137_after_n_writes_and_a_new_worker_finishes(tmp_path: Path) -> None:
    import fault_app

    db = tmp_path / "t.db"
    app = fault_app.make_app(str(db))

    async def start() -> str:
        run = await app.start("three")
        await app.close()
        return run.run_id

    run_id = asyncio.run(start())
    env = {**os.environ, CRASH_ENV: "2"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "fault_app.py"), str(db), "20"],
        env=env,
        timeout=60,
        capture_output=True,
    )
    assert proc.returncode == 137, proc.stderr.decode()

    async def finish() -> tuple[list[int], int]:
        done = fault_app.make_app(str(db))
        partial = [e for e in await done.history(run_id) if e.type.value == "ActivityCompleted"]
        async with done.worker(lease=1.0, poll_interval=0.05):
            result = await done.get_run(run_id).result(timeout=20)
        await done.close()
        return result, len(partial)

    result, completed_before = asyncio.run(finish())
    assert completed_before < 3  # the process died mid-run
    assert result == [0, 10, 20]
