"""A worker meeting a store blip (a dropped connection, a failed round trip) waits for
the store, not for a workflow failure's retry delay or a lease to run out."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import tether

#: what a store says when its connection drops (the URL is the operator's to see)
LOST = "lost the connection to PostgreSQL store postgresql://u@db:5432/prod"


async def test_a_store_blip_reading_a_runs_history_is_not_a_workflow_failure(
    app: tether.App, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    @app.workflow
    async def wf(x: int) -> int:
        return x + 1

    run = await app.start(wf, 1, run_id="r1")  # no worker yet: its task is claimed below
    real = app.store.read_history
    calls: list[int] = []

    async def flaky(run_id: str, after: int = 0) -> Any:
        calls.append(after)
        if len(calls) == 1:
            raise tether.StoreError(LOST)
        return await real(run_id, after)

    monkeypatch.setattr(app.store, "read_history", flaky)
    caplog.set_level(logging.WARNING, logger="tether")
    w = app.worker(lease=30.0, poll_interval=0.05, workflow_retry_delay=60.0)
    await w.start()
    try:
        # taken again at once: not after the 60 s a failed workflow task waits
        assert await run.result(timeout=10) == 2
    finally:
        await w.stop(grace=2.0)
    assert len(calls) >= 2
    assert w.stats["workflow_task_failures"] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert LOST in caplog.text  # the whole message, for the operator


def _two_steps(app: tether.App, ran: list[str]) -> Any:
    @app.activity
    def step(name: str) -> str:
        ran.append(name)
        return name.upper()

    @app.workflow
    async def pair() -> list[str]:
        # two steps in flight: a result takes the ordinary path (complete_activity)
        return list(await asyncio.gather(step("a"), step("b")))

    return pair


@pytest.mark.parametrize("landed", [False, True])
async def test_a_completion_lost_to_a_store_blip_is_retried_not_left_to_its_lease(
    app: tether.App,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    landed: bool,
) -> None:
    ran: list[str] = []
    pair = _two_steps(app, ran)
    real = app.store.complete_activity
    calls: list[int] = []

    async def flaky(task: Any, result: str, **kw: Any) -> Any:
        calls.append(task.task_id)
        if len(calls) == 1:
            if landed:  # committed, but the answer was lost with the connection
                await real(task, result, **kw)
            raise tether.StoreError(LOST)
        return await real(task, result, **kw)

    monkeypatch.setattr(app.store, "complete_activity", flaky)
    caplog.set_level(logging.WARNING, logger="tether")
    # landed: the workflow task the lost answer leased to this worker is given back,
    # not left to wait out its 30 s lease
    w = app.worker(lease=30.0, poll_interval=0.05)
    await w.start()
    try:
        run = await app.start(pair, run_id="r1")
        assert await run.result(timeout=10) == ["A", "B"]
    finally:
        await w.stop(grace=2.0)
    assert sorted(ran) == ["a", "b"]  # each step ran once: its result was recorded
    assert calls.count(calls[0]) == 2  # the lost completion was offered again
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert not [r for r in caplog.records if r.exc_info], caplog.text


async def test_a_completion_the_store_keeps_refusing_gives_the_step_back_with_a_warning(
    app: tether.App, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[str] = []
    pair = _two_steps(app, ran)
    real = app.store.complete_activity
    failed: list[int] = []

    async def down(task: Any, result: str, **kw: Any) -> Any:
        if not failed or (failed[0] == task.task_id and len(failed) < 4):
            failed.append(task.task_id)
            raise tether.StoreError(LOST)
        return await real(task, result, **kw)

    monkeypatch.setattr(app.store, "complete_activity", down)
    caplog.set_level(logging.WARNING, logger="tether")
    w = app.worker(lease=30.0, poll_interval=0.05)
    await w.start()
    try:
        run = await app.start(pair, run_id="r1")
        assert await run.result(timeout=15) == ["A", "B"]
    finally:
        await w.stop(grace=2.0)
    assert len(failed) == 4 and len(set(failed)) == 1  # offered four times, then given back
    assert len(ran) == 3  # and so its step ran again
    assert "4 attempts" in caplog.text and LOST in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert not [r for r in caplog.records if r.exc_info], caplog.text


async def test_a_periodic_job_logs_a_store_outage_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tether._periodic import Periodic

    calls: list[int] = []

    async def job() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise tether.StoreError(LOST)
        raise ValueError("a bug")

    log = logging.getLogger("tether.test_periodic")
    caplog.set_level(logging.WARNING, logger="tether.test_periodic")
    p = Periodic("t", job, lambda: 0.01, log, "folding counters")
    p.start()
    while len(calls) < 2:
        await asyncio.sleep(0.01)
    await p.stop()
    outage, bug = caplog.records[:2]
    assert outage.getMessage() == f"folding counters failed: {LOST}"
    assert outage.exc_info is None  # the store's message says it all: no traceback
    assert bug.exc_info is not None  # anything else keeps its traceback


@pytest.mark.parametrize("landed", [False, True])
async def test_a_one_commit_completion_lost_to_a_store_blip_is_offered_again(
    app: tether.App,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    landed: bool,
) -> None:
    ran: list[str] = []

    @app.activity
    def step(name: str) -> str:
        ran.append(name)
        return name.upper()

    @app.workflow
    async def chain() -> list[str]:
        # one step in flight at a time: results take the one-commit path
        return [await step("a"), await step("b")]

    real = app.store.complete_activity_fast  # type: ignore[attr-defined]
    calls: list[int] = []

    async def flaky(task: Any, *args: Any, **kw: Any) -> Any:
        calls.append(task.task_id)
        if len(calls) == 1:
            if landed:  # committed, but the answer was lost with the connection
                await real(task, *args, **kw)
            raise tether.StoreError(LOST)
        return await real(task, *args, **kw)

    monkeypatch.setattr(app.store, "complete_activity_fast", flaky)
    caplog.set_level(logging.WARNING, logger="tether")
    # landed: the step the lost answer leased to this worker is given back, not left
    # to wait out its 30 s lease
    w = app.worker(lease=30.0, poll_interval=0.05)
    await w.start()
    try:
        run = await app.start(chain, run_id="r1")
        assert await run.result(timeout=10) == ["A", "B"]  # not after a 30 s lease
    finally:
        await w.stop(grace=2.0)
    assert calls and ran == ["a", "b"]  # the lost result was recorded, not run again
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_the_last_completion_lost_but_recorded_does_not_wait_out_a_lease(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both results take the ordinary path; the second one's commit lands but its answer
    is lost: the workflow task it leased to this worker is given back at once."""
    ran: list[str] = []
    pair = _two_steps(app, ran)
    real = app.store.complete_activity
    calls: list[int] = []

    async def flaky(task: Any, result: str, **kw: Any) -> Any:
        calls.append(task.task_id)
        if len(set(calls)) == 2 and calls.count(task.task_id) == 1:
            await real(task, result, **kw)  # committed, but the answer is lost
            raise tether.StoreError(LOST)
        return await real(task, result, **kw)

    monkeypatch.setattr(app.store, "complete_activity", flaky)
    w = app.worker(lease=30.0, poll_interval=0.05)
    await w.start()
    try:
        run = await app.start(pair, run_id="r1")
        assert await run.result(timeout=10) == ["A", "B"]  # not after the 30 s lease
    finally:
        await w.stop(grace=2.0)
    assert sorted(ran) == ["a", "b"]


async def test_a_workflow_task_commit_lost_but_recorded_gives_its_steps_back(
    app: tether.App, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A workflow task's commit lands but its answer is lost: the steps it leased to
    this worker are given back at once instead of waiting out their leases."""
    ran: list[str] = []

    @app.activity
    def step(name: str) -> str:
        ran.append(name)
        return name.upper()

    @app.workflow
    async def one() -> str:
        await tether.sleep(0.05)  # (the workflow task after it runs on the worker)
        return await step("a")

    real = app.store.complete_workflow_task
    lost: list[int] = []

    async def flaky(task: Any, *args: Any, **kw: Any) -> Any:
        out = await real(task, *args, **kw)
        if out[1] and not lost:  # it leased the step to this worker
            lost.append(task.task_id)
            raise tether.StoreError(LOST)  # committed, but the answer is lost
        return out

    monkeypatch.setattr(app.store, "complete_workflow_task", flaky)
    caplog.set_level(logging.INFO, logger="tether")
    w = app.worker(lease=30.0, poll_interval=0.05)
    await w.start()
    try:
        run = await app.start(one, run_id="r1")
        assert await run.result(timeout=10) == "A"  # not after the 30 s lease
    finally:
        await w.stop(grace=2.0)
    assert ran == ["a"] and lost
    assert "gave back 1 task(s) of run 'r1'" in caplog.text
