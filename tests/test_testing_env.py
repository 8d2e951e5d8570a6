"""tether.testing.Env: virtual time that skips while every run waits."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

import tether
from helpers import eventually, has_event
from tether.testing import Env

DAY = 86_400.0


@pytest.fixture
def mem_app() -> tether.App:
    return tether.App(store=":memory:")


async def test_env_sleep_of_30_days_finishes_in_under_a_second(mem_app: tether.App) -> None:
    @mem_app.workflow
    async def month() -> float:
        start = tether.now()
        await tether.sleep(30 * DAY)
        return (tether.now() - start).total_seconds()

    t0 = time.monotonic()
    async with Env(mem_app) as env:
        run = await mem_app.start(month)
        elapsed = await run.result(timeout=30)
    # well under a second when the machine is idle; the bound only has to tell
    # "skipped" from "slept" (30 days), and CI's loaded 2-core VM can be slow
    assert time.monotonic() - t0 < 20.0
    assert elapsed >= 30 * DAY
    assert env.skipped >= 30 * DAY


async def test_env_never_jumps_past_a_lease_its_own_worker_holds(app: tether.App) -> None:
    """A task leased to the Env's worker but not started yet (a claim or a commit
    returned it a moment ago; on a slow machine that moment is long) keeps the clock
    still: jumping to the lease's expiry would shift everything after by a lease.
    (Both stores: the Env asks the store which due task is its worker's lease.)"""

    @app.activity
    def prepare() -> str:
        return "ready"

    @app.workflow
    async def later() -> str:
        await prepare()
        await tether.sleep(100)
        return "done"

    async with Env(app) as env:
        assert env.worker is not None
        spawn, loop = env.worker._spawn, asyncio.get_running_loop()
        held: list[int] = []

        def slow_spawn(task: Any) -> None:  # the worker takes 0.3 s to start the step
            if task.kind == "activity" and not held:
                held.append(task.task_id)
                loop.call_later(0.3, spawn, task)
            else:
                spawn(task)

        env.worker._spawn = slow_spawn  # type: ignore[method-assign]
        run = await app.start(later)
        assert await run.result(timeout=10) == "done"
    assert held  # the step was held back
    assert env.skipped == 100.0  # the sleep, not the sleep plus a lease


async def test_env_retry_delays_follow_the_policy_exactly(mem_app: tether.App) -> None:
    failures = {"left": 3}

    @mem_app.activity(
        retry=tether.Retry(attempts=5, initial=10.0, backoff=3.0, max_interval=60.0, jitter=0)
    )
    def flaky() -> str:
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("blip")
        return "ok"

    @mem_app.workflow
    async def wf() -> str:
        return await flaky()

    async with Env(mem_app):
        run = await mem_app.start(wf)
        assert await run.result(timeout=5) == "ok"
    attempts = [
        e for e in await mem_app.history(run.run_id) if e.type.value == "ActivityAttemptFailed"
    ]
    delays = [round(e.data["retry_at"] - e.created_at, 6) for e in attempts]
    assert delays == [10.0, 30.0, 60.0]  # 10, 10*3, min(60, 10*9)


async def test_env_wait_event_timeout_and_deadline_fire_without_waiting(
    mem_app: tether.App,
) -> None:
    @mem_app.workflow
    async def approval() -> str:
        answer = await tether.wait_event("approve", timeout=7 * DAY)
        return "rejected (no answer)" if answer is None else "approved"

    @mem_app.workflow
    async def forever() -> None:
        await tether.sleep(365 * DAY)

    async with Env(mem_app):
        run = await mem_app.start(approval)
        assert await run.result(timeout=5) == "rejected (no answer)"
        late = await mem_app.start(forever, deadline=DAY)
        with pytest.raises(tether.RunTimedOutError):
            await late.result(timeout=5)


async def test_env_advance_moves_time_explicitly(tmp_path: Path) -> None:
    app = tether.App(store=f"sqlite:///{tmp_path / 'x.db'}")

    @app.workflow
    async def nap() -> str:
        await tether.sleep(3600)
        return "woke"

    async with Env(app, skip_time=False) as env:
        run = await app.start(nap)
        with pytest.raises(tether.ResultTimeoutError):
            await run.result(timeout=0.3)
        # the hour counts from the moment the workflow started its timer: moving the
        # clock before then (a slow machine) would leave the timer an hour ahead
        await eventually(
            lambda: has_event(app, run.run_id, tether.EventType.TIMER_STARTED),
            timeout=30,
            what="the workflow's timer",
        )
        await env.advance(3600)
        assert await run.result(timeout=30) == "woke"
    await app.close()


async def test_env_advance_never_takes_work_from_its_own_live_worker(tmp_path: Path) -> None:
    """Moving the clock an hour while an activity runs must not expire the lease of the
    Env's own worker (alive, renewing as real time passes): the step runs once. Before,
    the jump expired it, the worker claimed it again, and it ran twice (an approval's
    'opened' notice was sent twice when a test advanced past a deadline too soon)."""
    app = tether.App(store=f"sqlite:///{tmp_path / 'x.db'}")
    started: list[int] = []
    gate = asyncio.Event()

    @app.activity
    async def slow(x: int) -> int:
        started.append(x)
        await gate.wait()
        return x

    @app.workflow
    async def one() -> int:
        return await slow(1)

    async with Env(app, skip_time=False) as env:
        run = await app.start(one)

        async def began() -> bool:
            return bool(started)

        await eventually(began, timeout=30, what="the activity's start")
        await env.advance(3600)  # far past the worker's 30 s lease
        await asyncio.sleep(0.5)  # the worker's claims would have taken it back by now
        gate.set()
        assert await run.result(timeout=30) == 1
    assert started == [1]
    await app.close()
