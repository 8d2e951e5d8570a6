"""Activity retries: transient failures, NonRetryable, exhaustion, timeouts, policy checks."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from datetime import timedelta
from typing import Any

import pytest

import tether


def fast(attempts: int) -> tether.Retry:
    return tether.Retry(attempts=attempts, initial=0.01, max_interval=0.05, jitter=0.0)


async def test_retry_transient_failure_then_succeeds_with_attempts_visible(
    app: tether.App, worker: tether.Worker
) -> None:
    attempts: list[int] = []

    @app.activity(retry=fast(5))
    def flaky(x: int) -> str:
        ctx = tether.activity_context()
        attempts.append(ctx.attempt)
        if ctx.attempt < 3:
            raise ConnectionError(f"transient #{ctx.attempt}")
        return f"ok {x} on attempt {ctx.attempt}"

    @app.workflow
    async def wf() -> str:
        return await flaky(9)

    run = await app.start(wf)
    assert await run.result(timeout=10) == "ok 9 on attempt 3"
    assert attempts == [1, 2, 3]
    completed = [
        e for e in await app.history(run.run_id) if e.type is tether.EventType.ACTIVITY_COMPLETED
    ]
    assert len(completed) == 1
    assert completed[0].data.get("attempt") == 3
    # failed attempts are not history events: only the final outcome is
    assert not any(
        e.type is tether.EventType.ACTIVITY_FAILED for e in await app.history(run.run_id)
    )


async def test_retry_async_activity_transient_failure(
    app: tether.App, worker: tether.Worker
) -> None:
    attempts: list[int] = []

    @app.activity(retry=fast(3))
    async def flaky() -> int:
        attempts.append(tether.activity_context().attempt)
        if len(attempts) == 1:
            raise RuntimeError("first time fails")
        return 42

    @app.workflow
    async def wf() -> int:
        return await flaky()

    run = await app.start(wf)
    assert await run.result(timeout=10) == 42
    assert attempts == [1, 2]


async def test_retry_non_retryable_fails_at_once_with_one_attempt(
    app: tether.App, worker: tether.Worker
) -> None:
    attempts: list[int] = []

    class BadInput(tether.NonRetryable):
        pass

    @app.activity(retry=fast(5))
    def validate(x: int) -> int:
        attempts.append(tether.activity_context().attempt)
        if x < 0:
            raise BadInput(f"negative input {x}")
        return x

    @app.workflow
    async def wf(x: int) -> dict[str, Any]:
        try:
            await validate(x)
        except tether.ActivityError as exc:
            return {
                "activity": exc.activity,
                "type": exc.error_type,
                "message": exc.message,
                "attempts": exc.attempts,
            }
        return {}

    run = await app.start(wf, -4)
    out = await run.result(timeout=10)
    assert out == {
        "activity": "validate",
        "type": "BadInput",
        "message": "negative input -4",
        "attempts": 1,
    }
    await asyncio.sleep(0.2)  # a retry would have happened by now
    assert attempts == [1]


async def test_retry_policy_non_retryable_types_fail_at_once(
    app: tether.App, worker: tether.Worker
) -> None:
    attempts: list[int] = []

    @app.activity(
        retry=tether.Retry(attempts=5, initial=0.01, max_interval=0.05, non_retryable=(KeyError,))
    )
    def lookup() -> int:
        attempts.append(1)
        raise KeyError("missing")

    @app.workflow
    async def wf() -> int:
        try:
            return await lookup()
        except tether.ActivityError as exc:
            return exc.attempts

    run = await app.start(wf)
    assert await run.result(timeout=10) == 1
    assert attempts == [1]


async def test_retry_exhausted_attempts_raise_activity_error_in_workflow(
    app: tether.App, worker: tether.Worker
) -> None:
    attempts: list[int] = []

    @app.activity(retry=fast(3))
    def always_fails() -> None:
        attempts.append(tether.activity_context().attempt)
        raise ValueError("still broken")

    @app.workflow
    async def wf() -> dict[str, Any]:
        try:
            await always_fails()
        except tether.ActivityError as exc:
            return {"type": exc.error_type, "message": exc.message, "attempts": exc.attempts}
        return {}

    run = await app.start(wf)
    assert await run.result(timeout=10) == {
        "type": "ValueError",
        "message": "still broken",
        "attempts": 3,
    }
    assert attempts == [1, 2, 3]
    failed = [
        e for e in await app.history(run.run_id) if e.type is tether.EventType.ACTIVITY_FAILED
    ]
    assert len(failed) == 1


async def test_retry_exhausted_uncaught_fails_run(app: tether.App, worker: tether.Worker) -> None:
    @app.activity(retry=fast(2))
    def always_fails() -> None:
        raise ValueError("nope")

    @app.workflow
    async def wf() -> None:
        await always_fails()

    run = await app.start(wf)
    with pytest.raises(tether.WorkflowFailedError) as ei:
        await run.result(timeout=10)
    assert "ActivityError" in (ei.value.error or "")
    assert "after 2 attempt(s)" in (ei.value.error or "")


async def test_retry_per_call_options_override(app: tether.App, worker: tether.Worker) -> None:
    attempts: list[int] = []

    @app.activity(retry=fast(5))
    def failing() -> None:
        attempts.append(1)
        raise ValueError("x")

    @app.workflow
    async def wf() -> int:
        try:
            await failing.options(retry=fast(2))()
        except tether.ActivityError as exc:
            return exc.attempts
        return 0

    run = await app.start(wf)
    assert await run.result(timeout=10) == 2
    assert len(attempts) == 2


async def test_retry_backoff_waits_between_attempts(app: tether.App, worker: tether.Worker) -> None:
    stamps: list[float] = []

    @app.activity(retry=tether.Retry(attempts=3, initial=0.15, backoff=2.0, jitter=0.0))
    def slow_retry() -> str:
        stamps.append(time.monotonic())
        if len(stamps) < 3:
            raise RuntimeError("again")
        return "done"

    @app.workflow
    async def wf() -> str:
        return await slow_retry()

    run = await app.start(wf)
    assert await run.result(timeout=10) == "done"
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert gaps[0] >= 0.14  # initial
    assert gaps[1] >= 0.29  # initial * backoff


# -- timeouts ----------------------------------------------------------------------------------


async def test_activity_timeout_fails_after_attempts(
    app: tether.App, worker: tether.Worker
) -> None:
    attempts: list[int] = []

    @app.activity(retry=fast(2), timeout=0.1)
    async def hangs() -> str:
        attempts.append(tether.activity_context().attempt)
        await asyncio.sleep(30)
        return "never"

    @app.workflow
    async def wf() -> dict[str, Any]:
        try:
            await hangs()
        except tether.ActivityError as exc:
            return {"type": exc.error_type, "attempts": exc.attempts}
        return {}

    t0 = time.monotonic()
    run = await app.start(wf)
    assert await run.result(timeout=20) == {"type": "TimeoutError", "attempts": 2}
    assert time.monotonic() - t0 < 20  # two 0.1 s timeouts, not a 30 s hang (loaded CI)
    assert attempts == [1, 2]


async def test_activity_timeout_then_retry_succeeds(app: tether.App, worker: tether.Worker) -> None:
    attempts: list[int] = []

    @app.activity(retry=fast(3))
    async def slow_first() -> int:
        attempt = tether.activity_context().attempt
        attempts.append(attempt)
        if attempt == 1:
            await asyncio.sleep(30)
        return attempt

    @app.workflow
    async def wf() -> int:
        return await slow_first.options(timeout=timedelta(milliseconds=100))()

    run = await app.start(wf)
    assert await run.result(timeout=10) == 2
    assert attempts == [1, 2]


def test_activity_timeout_must_be_positive(app: tether.App) -> None:
    def f() -> None:
        return None

    with pytest.raises(tether.ConfigurationError):
        app.activity(timeout=0)(f)
    with pytest.raises(tether.ConfigurationError):
        app.activity(timeout=-1)(f)
    act = app.activity(f)
    with pytest.raises(tether.ConfigurationError):
        act.options(timeout=0)
    with pytest.raises(tether.ConfigurationError):
        app.activity(retry={"attempts": 3})(f)  # type: ignore[call-overload]


# -- the Retry policy ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        pytest.param({"attempts": 0}, "attempts", id="attempts-zero"),
        pytest.param({"attempts": -3}, "attempts", id="attempts-negative"),
        pytest.param({"attempts": 2.5}, "attempts", id="attempts-fractional"),
        pytest.param({"attempts": "3"}, "attempts", id="attempts-string"),
        pytest.param({"initial": -1}, "initial", id="initial-negative"),
        pytest.param({"initial": timedelta(seconds=-1)}, "initial", id="initial-neg-timedelta"),
        pytest.param({"max_interval": -0.5}, "max_interval", id="max-interval-negative"),
        pytest.param({"initial": 10, "max_interval": 1}, "max_interval", id="max-below-initial"),
        pytest.param({"backoff": 0.5}, "backoff", id="backoff-below-one"),
        pytest.param({"backoff": math.nan}, "backoff", id="backoff-nan"),
        pytest.param({"initial": math.nan}, "initial", id="initial-nan"),
        pytest.param({"jitter": 1.5}, "jitter", id="jitter-above-one"),
        pytest.param({"jitter": -0.1}, "jitter", id="jitter-negative"),
    ],
)
def test_retry_rejects_nonsense_values_naming_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(tether.ConfigurationError) as ei:
        tether.Retry(**kwargs)
    assert field in str(ei.value)


def test_retry_accepts_sensible_values_and_computes_capped_delay() -> None:
    r = tether.Retry(attempts=1, initial=timedelta(milliseconds=10), backoff=3, jitter=0)
    assert r.attempts == 1
    p = tether.Retry(attempts=10, initial=1, backoff=2, max_interval=5, jitter=0)
    assert [p.delay(n) for n in range(1, 6)] == [1, 2, 4, 5, 5]
    j = tether.Retry(initial=1, backoff=1, max_interval=1, jitter=0.5)
    assert all(0.5 <= j.delay(1) <= 1.5 for _ in range(50))


# -- idempotency key -------------------------------------------------------------------------


async def test_activity_context_idempotency_key_stable_across_attempts(
    app: tether.App, worker: tether.Worker
) -> None:
    keys: dict[str, list[str]] = {"a": [], "b": []}
    steps: dict[str, set[int]] = {"a": set(), "b": set()}

    @app.activity(retry=fast(4))
    def charge(account: str) -> str:
        ctx = tether.activity_context()
        keys[account].append(ctx.idempotency_key)
        steps[account].add(ctx.step)
        if ctx.attempt < 3:
            raise ConnectionError("gateway hiccup")
        return ctx.idempotency_key

    @app.workflow
    async def wf() -> list[str]:
        a = await charge("a")
        b = await charge("b")
        return [a, b]

    run = await app.start(wf, run_id="pay-1")
    key_a, key_b = await run.result(timeout=10)
    assert keys["a"] == [key_a] * 3
    assert keys["b"] == [key_b] * 3
    assert key_a != key_b  # distinct per step
    assert "pay-1" in key_a
    assert steps == {"a": {1}, "b": {2}}


def test_activity_context_outside_activity_raises() -> None:
    with pytest.raises(tether.NotInActivityError):
        tether.activity_context()
