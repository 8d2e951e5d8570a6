"""Alert conditions reach ``on_alert`` once when they start to hold and again only after
they cleared: a stuck queue, runs over their expected duration, dead-letter growth and a
retry spike; a run needing an operator is an alert of its own kind."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import tether
import tether._app
from helpers import eventually
from tether import RunStatus
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
    await _settled(app)  # a sync hook runs in a thread
    assert [(s, d["alert"]) for s, d in got] == [("queue:nightly", "queue_age")]
    assert got[0][1]["value"] > 0.2 and got[0][1]["threshold"] == 0.2
    async with app.worker(queues=["nightly"], poll_interval=0.05):
        assert await run.result(timeout=20) == 1
    await watcher.check()  # cleared
    await app.start(batch)
    await asyncio.sleep(0.3)
    await watcher.check()  # holds again: told again
    await _settled(app)
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

        for _ in range(1000):
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
        await _settled(app)  # a hook runs as a task (a sync one in a thread)
        assert calls == ["queue:nightly"]
        failed = [r for r in caplog.records if "the on_alert hook failed" in r.getMessage()]
        assert len(failed) == 1 and "queue:nightly" in failed[0].getMessage()
        assert failed[0].exc_info is not None and "pager down" in str(failed[0].exc_info[1])
        assert "never retrieved" not in caplog.text
        down[0] = False
        await watcher.check()  # not told yet: tried again
        await _settled(app)
        assert calls == ["queue:nightly", "queue:nightly"]
        await watcher.check()  # told: not again while it holds
        await _settled(app)
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
        await _settled(app)
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
    await _settled(app)
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
        await _settled(app)  # a sync hook runs in a thread
    ((subject, details),) = got
    assert subject == run.run_id and details["alert"] == "needs_intervention"
    assert details["type"] == "CompensationFailed"


# -- a run that needs an operator: never blocks work, never lost -------------------------


def _needs_an_operator(app: tether.App) -> Any:
    """A saga whose undo fails: every run of it ends ``needs_intervention``."""

    @app.activity(retry=tether.Retry(attempts=1))
    async def refund(_: None) -> None:
        raise RuntimeError("refund refused")

    @app.activity
    async def charge() -> None:
        return None

    @app.workflow
    async def booking() -> None:
        async with tether.saga() as saga:
            await saga.step(charge(), undo=refund)
            raise ValueError("then it failed")

    return booking


async def _intervention(app: tether.App, workflow: Any) -> str:
    run = await app.start(workflow)
    with pytest.raises(tether.RunNeedsInterventionError):
        await run.result(timeout=20)
    return run.run_id


async def _settled(app: tether.App) -> None:
    """Every alert hook this App started has returned (or raised)."""
    await asyncio.wait_for(asyncio.gather(*app._alerts, return_exceptions=True), 20)


async def test_a_slow_sync_hook_holds_up_no_other_run(app: tether.App) -> None:
    # a pager call with a long timeout, made from the worker's loop, froze every run of
    # the process (lease renewals too: another worker then ran the running steps again)
    booking = _needs_an_operator(app)
    entered, gate = threading.Event(), threading.Event()
    timed_out: list[bool] = []

    def pager(subject: str, details: dict[str, Any]) -> None:
        entered.set()
        timed_out.append(not gate.wait(10))

    app.on_alert = pager

    @app.workflow
    async def other() -> int:
        return 1

    async with app.worker(poll_interval=0.05):
        run = await app.start(booking)
        assert await asyncio.to_thread(entered.wait, 20)
        # the hook is still running: the worker serves other runs meanwhile
        assert await (await app.start(other)).result(timeout=10) == 1
        gate.set()
        await _settled(app)
    assert timed_out == [False]
    assert (await app.get(run.run_id)).status is RunStatus.NEEDS_INTERVENTION


async def test_a_slow_sync_hook_does_not_hold_up_the_watchers_loop(app: tether.App) -> None:
    gate = threading.Event()
    timed_out: list[bool] = []
    app.on_alert = lambda subject, details: timed_out.append(not gate.wait(10))

    @app.workflow(queue="nightly")
    async def batch() -> int:
        return 1

    await app.start(batch)  # no worker serves "nightly"
    await asyncio.sleep(0.3)
    watcher = AlertWatcher(app, AlertRules(**{**OFF, "queue_age": 0.2}))
    fired = await watcher.check()  # returns while the hook runs in a thread
    assert [s for s, _ in fired] == ["queue:nightly"]
    assert timed_out == []
    gate.set()
    await _settled(app)
    assert timed_out == [False]


@pytest.mark.parametrize("kind", ["sync", "async", "sync-returning-a-coroutine"])
async def test_a_run_whose_hook_failed_is_told_at_a_later_check(
    app: tether.App, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    booking = _needs_an_operator(app)
    calls: list[str] = []

    def told(subject: str, details: dict[str, Any]) -> None:
        assert details["alert"] == "needs_intervention"
        assert details["type"] == "CompensationFailed"
        calls.append(subject)
        if len(calls) == 1:
            raise ConnectionError("pager down")

    async def async_hook(subject: str, details: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        told(subject, details)

    app.on_alert = {
        "sync": told,
        "async": async_hook,
        "sync-returning-a-coroutine": lambda subject, details: async_hook(subject, details),
    }[kind]
    with caplog.at_level(logging.ERROR, logger="tether"):
        async with app.worker(poll_interval=0.05):
            run_id = await _intervention(app, booking)
            await _settled(app)
    assert calls == [run_id]
    assert "the on_alert hook failed" in caplog.text and "pager down" in caplog.text
    watcher = AlertWatcher(app, AlertRules(**OFF, needs_intervention=0))
    fired = await watcher.check()
    assert [(s, d["alert"]) for s, d in fired] == [(run_id, "needs_intervention")]
    await _settled(app)
    assert calls == [run_id, run_id]
    for _ in range(3):  # told: never again, by this watcher or a new one
        assert await watcher.check() == []
        assert await AlertWatcher(app, AlertRules(**OFF, needs_intervention=0)).check() == []
    await _settled(app)
    assert calls == [run_id, run_id]
    actions = [e["action"] for e in await app.audit(run_id)]
    assert actions == ["start", "alerted"]


async def test_a_run_told_by_its_worker_is_not_told_again_and_the_watcher_waits(
    app: tether.App, store_url: str
) -> None:
    booking = _needs_an_operator(app)
    got = _hooked(app)
    async with app.worker(poll_interval=0.05):
        told = await _intervention(app, booking)
        await _settled(app)
        app.on_alert = None  # no hook: the worker logs it (and that counts as told)
        logged = await _intervention(app, booking)
        await _settled(app)
        app.on_alert = lambda subject, details: got.append((subject, details)) or 1 / 0
        failed = await _intervention(app, booking)
        await _settled(app)
    assert [s for s, _ in got] == [told, failed] and told != logged
    got.clear()
    # another process's watcher leaves a run that just ended to its worker's hook for
    # the grace (it may still be running there)
    elsewhere = tether.App(store_url)
    heard = _hooked(elsewhere)
    try:
        watcher = AlertWatcher(elsewhere, AlertRules(**OFF))
        assert await watcher.check() == []
        real = elsewhere.store.clock
        elsewhere.store.clock = lambda: real() + 61  # type: ignore[method-assign]
        try:
            fired = await watcher.check()
        finally:
            elsewhere.store.clock = real  # type: ignore[method-assign]
        await _settled(elsewhere)
    finally:
        await elsewhere.close()
    assert [s for s, _ in fired] == [failed] and [s for s, _ in heard] == [failed]
    assert got == []
    # told: not by this process's watcher either, nor when the rule is off
    app.on_alert = lambda subject, details: got.append((subject, details))
    assert await AlertWatcher(app, AlertRules(**OFF, needs_intervention=0)).check() == []
    assert await AlertWatcher(app, AlertRules(**OFF, needs_intervention=None)).check() == []


async def test_the_watcher_of_the_process_whose_hook_failed_does_not_wait(
    app: tether.App,
) -> None:
    booking = _needs_an_operator(app)
    app.on_alert = lambda subject, details: 1 / 0
    async with app.worker(poll_interval=0.05):
        failed = await _intervention(app, booking)
        await _settled(app)
    got = _hooked(app)
    fired = await AlertWatcher(app, AlertRules(**OFF)).check()  # the default grace: 60 s
    await _settled(app)
    assert [s for s, _ in fired] == [failed] and [s for s, _ in got] == [failed]


async def test_a_run_that_ends_again_after_a_retry_is_told_again(app: tether.App) -> None:
    booking = _needs_an_operator(app)
    got = _hooked(app)
    watcher = AlertWatcher(app, AlertRules(**OFF, needs_intervention=0))
    async with app.worker(poll_interval=0.05):
        run_id = await _intervention(app, booking)
        await _settled(app)
        assert await watcher.check() == []
        app.on_alert = lambda subject, details: 1 / 0  # the second ending: the hook fails
        await app.retry(run_id)

        async def ended_again() -> bool:
            return (await app.get(run_id)).status is RunStatus.NEEDS_INTERVENTION

        await eventually(ended_again, timeout=20, what="the run to end again")
        await _settled(app)
    app.on_alert = lambda subject, details: got.append((subject, details))
    fired = await watcher.check()
    await _settled(app)
    assert [s for s, _ in fired] == [run_id] and [s for s, _ in got] == [run_id, run_id]


_CRASHING_WORKER = """
import os, sys, asyncio
import tether
app = tether.App(sys.argv[1], on_alert=lambda subject, details: os._exit(3))

@app.activity(retry=tether.Retry(attempts=1))
async def refund(_: None) -> None:
    raise RuntimeError("refund refused")

@app.activity
async def charge() -> None:
    return None

@app.workflow
async def booking() -> None:
    async with tether.saga() as saga:
        await saga.step(charge(), undo=refund)
        raise ValueError("then it failed")

async def main() -> None:
    async with app.worker(poll_interval=0.05):
        await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_a_worker_that_dies_before_its_hook_ran_loses_no_alert(
    app: tether.App, store_url: str
) -> None:
    booking = _needs_an_operator(app)
    got = _hooked(app)
    run = await app.start(booking)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CRASHING_WORKER, store_url, env=env
    )
    try:
        assert await asyncio.wait_for(proc.wait(), 60) == 3  # died as its hook was called
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert (await app.get(run.run_id)).status is RunStatus.NEEDS_INTERVENTION
    watcher = AlertWatcher(app, AlertRules(**OFF, needs_intervention=0))
    fired = await watcher.check()
    await _settled(app)
    assert [s for s, _ in fired] == [run.run_id] and [s for s, _ in got] == [run.run_id]
    assert got[0][1]["type"] == "CompensationFailed"


async def test_close_waits_for_a_hook_still_running(store_url: str) -> None:
    app = tether.App(store_url)
    booking = _needs_an_operator(app)
    gate = asyncio.Event()
    sent: list[str] = []

    async def pager(subject: str, details: dict[str, Any]) -> None:
        await gate.wait()
        sent.append(subject)

    app.on_alert = pager
    async with app.worker(poll_interval=0.05):
        run_id = await _intervention(app, booking)
    asyncio.get_running_loop().call_later(0.2, gate.set)
    await app.close()  # waits for the hook (and records that it was told)
    assert sent == [run_id]
    again = tether.App(store_url)
    try:
        assert await AlertWatcher(again, AlertRules(**OFF, needs_intervention=0)).check() == []
    finally:
        await again.close()


async def test_close_abandons_a_hook_that_does_not_finish_and_says_so(
    store_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tether._app, "ALERT_CLOSE_WAIT", 0.3)
    app = tether.App(store_url)
    booking = _needs_an_operator(app)
    cancelled = asyncio.Event()

    async def pager(subject: str, details: dict[str, Any]) -> None:
        try:
            await asyncio.Event().wait()  # a pager that never answers
        except asyncio.CancelledError:
            cancelled.set()
            raise

    app.on_alert = pager
    async with app.worker(poll_interval=0.05):
        run_id = await _intervention(app, booking)
    with caplog.at_level(logging.WARNING, logger="tether"):
        await asyncio.wait_for(app.close(), 10)
    assert cancelled.is_set()
    (abandoned,) = [r for r in caplog.records if "abandoned" in r.getMessage()]
    assert run_id in abandoned.getMessage()
    # not told: a watcher tells it, on the next App
    again = tether.App(store_url)
    got = _hooked(again)
    try:
        fired = await AlertWatcher(again, AlertRules(**OFF, needs_intervention=0)).check()
        await _settled(again)
    finally:
        await again.close()
    assert [s for s, _ in fired] == [run_id] and [s for s, _ in got] == [run_id]


# -- rules that make no sense are refused -------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window", 0),
        ("window", -5),
        ("window", float("nan")),
        ("window", float("inf")),
        ("window", None),
        ("retries", -1),
        ("retries", 0),
        ("retries", float("nan")),
        ("retries", True),
        ("dead_letters", 0),
        ("queue_age", float("nan")),
        ("queue_age", -1),
        ("queue_age", "300"),
        ("needs_intervention", -1),
        ("needs_intervention", float("inf")),
        ("overdue", {"flow": float("nan")}),
        ("overdue", {"flow": -1}),
        ("overdue", {"": 10}),
        ("overdue", [("flow", 10)]),
    ],
)
def test_alert_rules_refuse_nonsense(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"AlertRules\.{field}"):
        AlertRules(**{field: value})


def test_alert_rules_take_sensible_values() -> None:
    rules = AlertRules(
        window=0.5, retries=1, queue_age=0, needs_intervention=0, overdue={"flow": 2.5}
    )
    assert rules.retries == 1 and rules.overdue == {"flow": 2.5}
    assert AlertRules(**OFF, needs_intervention=None).retries is None
    with pytest.raises(ValueError, match="interval"):
        AlertWatcher(tether.App(":memory:"), interval=0)
