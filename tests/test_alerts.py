"""Alert conditions reach ``on_alert`` once when they start to hold and again only after
they cleared: a stuck queue, runs over their expected duration, dead-letter growth and a
retry spike; a run needing an operator is an alert of its own kind."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import tether
from tether._telemetry import RECORDER
from tether.alerts import AlertRules, AlertWatcher

OFF: dict[str, Any] = {
    "queue_age": None,
    "dead_letters": None,
    "retries": None,
    "rate_limited": None,
    "breaker_rejections": None,
    "validation_failures": None,
    "budget_stops": None,
    "orphans": None,
}


def _hooked(app: tether.App) -> list[tuple[str, dict[str, Any]]]:
    got: list[tuple[str, dict[str, Any]]] = []
    app.on_alert = lambda subject, details: got.append((subject, details))
    return got


async def test_a_stuck_queue_alerts_once_until_it_clears(app: tether.App) -> None:
    got = _hooked(app)

    @app.workflow(queue="nightly")
    async def batch() -> int:
        return 1

    watcher = AlertWatcher(app, AlertRules(**{**OFF, "queue_age": 0.2}))
    run = await app.start(batch)  # no worker serves "nightly"
    await asyncio.sleep(0.3)
    await watcher.check()
    await watcher.check()  # still stuck: not told again
    assert [(s, d["alert"]) for s, d in got] == [("queue:nightly", "queue_age")]
    assert got[0][1]["value"] > 0.2 and got[0][1]["threshold"] == 0.2
    async with app.worker(queues=["nightly"], poll_interval=0.05):
        assert await run.result(timeout=20) == 1
    await watcher.check()  # cleared
    await app.start(batch)
    await asyncio.sleep(0.3)
    await watcher.check()  # holds again: told again
    assert [s for s, _ in got] == ["queue:nightly", "queue:nightly"]


async def test_a_suspended_runs_task_is_not_ready_work(app: tether.App) -> None:
    # it waits for an operator, not for a worker: no ready count, no age, no alert
    got = _hooked(app)

    @app.activity(queue="work")
    async def step() -> int:
        return 1

    @app.workflow
    async def flow() -> int:
        return await step()

    run = await app.start(flow)
    async with app.worker(queues=["default"], poll_interval=0.05):

        async def scheduled() -> bool:
            return any(q.queue == "work" and q.ready == 1 for q in await app.queue_stats())

        for _ in range(200):
            if await scheduled():
                break
            await asyncio.sleep(0.02)
    await app.suspend(run.run_id)
    await asyncio.sleep(0.3)
    watcher = AlertWatcher(app, AlertRules(**{**OFF, "queue_age": 0.2}))
    assert await watcher.check() == [] and got == []
    (work,) = [q for q in await app.queue_stats() if q.queue == "work"]
    assert work.ready == 0 and work.oldest_ready_age is None
    await app.resume(run.run_id)
    (work,) = [q for q in await app.queue_stats() if q.queue == "work"]
    assert work.ready == 1 and work.oldest_ready_age is not None


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_failed_hook_is_logged_and_told_again_at_the_next_check(
    app: tether.App, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    calls: list[str] = []
    down = [True]

    def told(subject: str) -> None:
        calls.append(subject)
        if down[0]:
            raise RuntimeError("pager down")

    async def async_hook(subject: str, details: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        told(subject)

    def sync_hook(subject: str, details: dict[str, Any]) -> None:
        told(subject)

    app.on_alert = async_hook if kind == "async" else sync_hook

    @app.workflow(queue="nightly")
    async def batch() -> int:
        return 1

    watcher = AlertWatcher(app, AlertRules(**{**OFF, "queue_age": 0.2}))
    await app.start(batch)  # no worker serves "nightly"
    await asyncio.sleep(0.3)
    with caplog.at_level(logging.ERROR, logger="tether"):
        await watcher.check()
        await asyncio.sleep(0.05)  # an async hook runs as a task
        assert calls == ["queue:nightly"]
        failed = [r for r in caplog.records if "the on_alert hook failed" in r.getMessage()]
        assert len(failed) == 1 and "queue:nightly" in failed[0].getMessage()
        assert failed[0].exc_info is not None and "pager down" in str(failed[0].exc_info[1])
        assert "never retrieved" not in caplog.text
        down[0] = False
        await watcher.check()  # not told yet: tried again
        await asyncio.sleep(0.05)
        assert calls == ["queue:nightly", "queue:nightly"]
        await watcher.check()  # told: not again while it holds
        await asyncio.sleep(0.05)
        assert calls == ["queue:nightly", "queue:nightly"]


async def test_runs_over_their_expected_duration(app: tether.App) -> None:
    got = _hooked(app)

    @app.workflow
    async def slowpoke() -> None:
        await tether.wait_event("never")

    watcher = AlertWatcher(app, AlertRules(**OFF, overdue={"slowpoke": 0.2}))
    async with app.worker(poll_interval=0.05):
        run = await app.start(slowpoke)
        await asyncio.sleep(0.1)
        assert await watcher.check() == []
        await asyncio.sleep(0.2)
        (fired,) = await watcher.check()
    assert fired[0] == "workflow:slowpoke" and fired[1]["alert"] == "run_overdue"
    assert run.run_id in fired[1]["message"] and got == [fired]


async def test_dead_letter_growth_and_a_retry_spike(app: tether.App) -> None:
    got = _hooked(app)

    @app.activity(retry=tether.Retry(attempts=4, initial=0.01, backoff=1.0))
    async def flaky() -> None:
        raise ConnectionError("down")

    @app.workflow
    async def fragile() -> None:
        await flaky()

    rules = AlertRules(**{**OFF, "dead_letters": 2, "retries": 6}, window=60)
    watcher = AlertWatcher(app, rules)
    RECORDER.reset()
    await watcher.check()  # the baseline
    async with app.worker(poll_interval=0.05):
        runs = [await app.start(fragile) for _ in range(2)]
        for run in runs:
            try:
                await run.result(timeout=20)
            except tether.WorkflowFailedError:
                pass
    fired = dict(await watcher.check())
    assert fired["dead_letters"]["alert"] == "dead_letter_growth"
    assert fired["dead_letters"]["value"] >= 2  # the steps' and the runs' letters
    assert fired["process"]["alert"] == "retries" and fired["process"]["value"] == 6
    assert len(got) == 2


async def test_a_run_needing_an_operator_is_an_alert_with_its_error(app: tether.App) -> None:
    got = _hooked(app)

    @app.activity(retry=tether.Retry(attempts=1))
    async def undo(_: None) -> None:
        raise RuntimeError("refund refused")

    @app.activity
    async def step() -> None:
        return None

    @app.workflow
    async def booking() -> None:
        async with tether.saga() as saga:
            await saga.step(step(), undo=undo)
            raise ValueError("then it failed")

    async with app.worker(poll_interval=0.05):
        run = await app.start(booking)
        try:
            await run.result(timeout=20)
        except tether.RunNeedsInterventionError:
            pass
    ((subject, details),) = got
    assert subject == run.run_id and details["alert"] == "needs_intervention"
    assert details["type"] == "CompensationFailed"
