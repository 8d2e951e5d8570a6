"""Circuit breakers (open, fail fast, half-open trial, close; shared through the store) and
failure-policy settings rejected when they are declared."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import tether
from tether import EventType


async def events_of(app: tether.App, run_id: str, type_: EventType) -> list[tether.Event]:
    return [e for e in await app.history(run_id) if e.type is type_]


# -- circuit breaker ---------------------------------------------------------------------------


async def test_breaker_opens_fails_fast_half_opens_and_closes(
    app: tether.App, worker: tether.Worker
) -> None:
    dep = {"calls": 0, "healthy": False, "slow": 0.0}
    breaker = tether.CircuitBreaker("llm", failure_ratio=0.5, min_calls=4, cooldown=0.4)
    from tether._telemetry import RECORDER

    opens_before = RECORDER.counter("tether_breaker_opens", ("llm",))

    @app.activity(retry=tether.Retry(attempts=1), breaker=breaker)
    async def call_llm(i: int) -> int:
        dep["calls"] += 1
        await asyncio.sleep(dep["slow"])
        if not dep["healthy"]:
            raise ConnectionError("upstream 5xx")
        return i

    @app.workflow
    async def calls(ids: list[int]) -> list[str]:
        outs = await tether.gather(*(call_llm(i) for i in ids), return_exceptions=True)
        return [o.error_type if isinstance(o, tether.ActivityError) else "ok" for o in outs]

    async def once(*ids: int) -> list[str]:
        return await (await app.start(calls, list(ids))).result(timeout=10)

    # closed: failures reach the dependency until min_calls at the ratio opens it
    for i in range(4):
        assert await once(i) == ["ConnectionError"]
    assert dep["calls"] == 4
    # open: fail fast without calling the dependency
    assert await once(10) == ["CircuitOpenError"]
    assert await once(11) == ["CircuitOpenError"]
    assert dep["calls"] == 4
    # half-open after the cooldown: one trial, which fails, so it reopens
    await asyncio.sleep(0.45)
    assert await once(20) == ["ConnectionError"]
    assert dep["calls"] == 5
    assert await once(21) == ["CircuitOpenError"]
    assert dep["calls"] == 5
    # half-open again: a slow trial is the only call let through; it succeeds and closes
    await asyncio.sleep(0.45)
    dep["healthy"], dep["slow"] = True, 0.2
    assert sorted(await once(30, 31)) == ["CircuitOpenError", "ok"]
    assert dep["calls"] == 6
    dep["slow"] = 0.0
    assert await once(40, 41, 42) == ["ok", "ok", "ok"]
    assert dep["calls"] == 9
    # opened twice (the ratio, then the failed trial), refused four times
    assert RECORDER.counter("tether_breaker_opens", ("llm",)) - opens_before == 2


async def test_breaker_open_rejection_is_retried_after_cooldown(
    app: tether.App, worker: tether.Worker
) -> None:
    dep = {"calls": 0, "healthy": False}
    breaker = tether.CircuitBreaker("search", failure_ratio=1.0, min_calls=2, cooldown=0.3)

    @app.activity(retry=tether.Retry(attempts=1), breaker=breaker)
    def search_failing() -> None:
        dep["calls"] += 1
        raise ConnectionError("down")

    @app.activity(retry=tether.Retry(attempts=5, initial=0.01, jitter=0), breaker=breaker)
    def search(q: str) -> str:
        dep["calls"] += 1
        return f"results for {q}"

    @app.workflow
    async def trip() -> None:
        for _ in range(2):
            try:
                await search_failing()
            except tether.ActivityError:
                pass

    @app.workflow
    async def lookup(q: str) -> str:
        return await search(q)

    await (await app.start(trip)).result(timeout=10)
    assert dep["calls"] == 2
    t0 = time.monotonic()
    run = await app.start(lookup, "tether")
    assert await run.result(timeout=10) == "results for tether"
    assert time.monotonic() - t0 >= 0.2  # it waited for the breaker, not the 0.01 s backoff
    assert dep["calls"] == 3
    rejected = await events_of(app, run.run_id, EventType.ACTIVITY_ATTEMPT_FAILED)
    assert [e.data["error"]["type"] for e in rejected] == ["CircuitOpenError"]


async def test_breaker_state_shared_across_apps_on_same_store(
    app: tether.App, worker: tether.Worker, store_url: str
) -> None:
    breaker = tether.CircuitBreaker("payments", failure_ratio=0.5, min_calls=2, cooldown=30)
    calls = {"a": 0, "b": 0}

    @app.activity(retry=tether.Retry(attempts=1), breaker=breaker)
    def pay_a() -> None:
        calls["a"] += 1
        raise ConnectionError("gateway down")

    @app.workflow
    async def wf_a() -> str:
        try:
            await pay_a()
        except tether.ActivityError as exc:
            return exc.error_type
        return "ok"

    other = tether.App(store=store_url, queue="other-host")

    @other.activity(retry=tether.Retry(attempts=1), breaker=breaker)
    def pay_b() -> str:
        calls["b"] += 1
        return "paid"

    @other.workflow
    async def wf_b() -> str:
        try:
            return await pay_b()
        except tether.ActivityError as exc:
            return exc.error_type

    for _ in range(2):
        assert await (await app.start(wf_a)).result(timeout=10) == "ConnectionError"
    w2 = other.worker(poll_interval=0.05, lease=5.0)
    await w2.start()
    try:
        assert await (await other.start(wf_b)).result(timeout=10) == "CircuitOpenError"
        assert w2.stats["breaker_rejections"] == 1  # rejected by the other App's worker
    finally:
        await w2.stop(grace=2.0)
        await other.close()
    assert calls == {"a": 2, "b": 0}


# -- settings rejected when declared -----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        pytest.param({"failure_ratio": 0}, "failure_ratio", id="ratio-zero"),
        pytest.param({"failure_ratio": 1.5}, "failure_ratio", id="ratio-above-one"),
        pytest.param({"failure_ratio": float("nan")}, "failure_ratio", id="ratio-nan"),
        pytest.param({"failure_ratio": "0.5"}, "failure_ratio", id="ratio-string"),
        pytest.param({"min_calls": 0}, "min_calls", id="min-calls-zero"),
        pytest.param({"min_calls": 2.5}, "min_calls", id="min-calls-fractional"),
        pytest.param({"window": 0}, "window", id="window-zero"),
        pytest.param({"window": -1}, "window", id="window-negative"),
        pytest.param({"cooldown": 0}, "cooldown", id="cooldown-zero"),
        pytest.param({"cooldown": "30s"}, "cooldown", id="cooldown-string"),
    ],
)
def test_breaker_rejects_bad_settings_naming_field(kwargs: dict[str, Any], field: str) -> None:
    app = tether.App(store=":memory:")  # never opened: decoration alone must reject

    def f() -> None:
        return None

    with pytest.raises(tether.ConfigurationError) as ei:
        app.activity(breaker=tether.CircuitBreaker("dep", **kwargs))(f)
    assert field in str(ei.value)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        pytest.param({"breaker": "openai"}, "breaker", id="breaker-not-a-breaker"),
        pytest.param({"schedule_timeout": 0}, "schedule_timeout", id="schedule-timeout-zero"),
        pytest.param({"heartbeat_timeout": -1}, "heartbeat_timeout", id="heartbeat-negative"),
        pytest.param({"timeout": float("inf")}, "timeout", id="timeout-infinite"),
    ],
)
def test_activity_rejects_bad_options_naming_field(options: dict[str, Any], field: str) -> None:
    app = tether.App(store=":memory:")

    def f() -> None:
        return None

    with pytest.raises(tether.ConfigurationError) as ei:
        app.activity(**options)(f)
    assert field in str(ei.value)


@pytest.mark.parametrize("value", [0, -1, float("nan")])
def test_retry_rejects_bad_max_elapsed_naming_field(value: float) -> None:
    with pytest.raises(tether.ConfigurationError) as ei:
        tether.Retry(max_elapsed=value)
    assert "max_elapsed" in str(ei.value)


async def test_start_rejects_non_positive_deadline(app: tether.App) -> None:
    @app.workflow
    async def wf() -> None:
        return None

    for bad in (0, -5):
        with pytest.raises(tether.ConfigurationError) as ei:
            await app.start(wf, deadline=bad)
        assert "deadline" in str(ei.value)
