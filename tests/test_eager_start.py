"""Eager start: app.start with an in-process worker runs the first workflow task before
the run is stored and records it in the creating commit (both stores)."""

from __future__ import annotations

import asyncio

import tether
from helpers import event_types, eventually
from tether import EventType, RunStatus
from tether.testing import check_history


def _register(app: tether.App, calls: list[int]) -> tether.Workflow[[int], int]:
    @app.activity
    async def double(x: int) -> int:
        calls.append(x)
        return 2 * x

    @app.workflow
    async def one_step(x: int) -> int:
        return await double(x)

    return one_step


async def test_one_step_run_costs_two_commits_and_records_the_usual_history(
    app: tether.App,
) -> None:
    calls: list[int] = []
    wf = _register(app, calls)
    # a long poll: no claim of its own falls in the measured window (on PostgreSQL
    # every claim is a transaction; a loaded machine stretches the window past 0.05 s)
    async with app.worker(lease=5.0, poll_interval=5.0) as worker:
        await app.start(wf, 0, run_id="warm-up")  # the store and worker are open
        await (await app.start(wf, 0, run_id="warm-up")).result(timeout=10)
        before = app.store.stats()["commits"]
        run = await app.start(wf, 21, run_id="eager")
        assert await run.result(timeout=10) == 42
        commits = app.store.stats()["commits"] - before
        assert worker.stats["eager_starts"] == 2
    # the creating commit carried the first task; the result carried the end
    assert commits <= 2, f"a one-step run took {commits} commits"
    assert await event_types(app, "eager") == [
        EventType.WORKFLOW_STARTED,
        EventType.ACTIVITY_SCHEDULED,
        EventType.WORKFLOW_TASK_COMPLETED,
        EventType.ACTIVITY_COMPLETED,
        EventType.WORKFLOW_COMPLETED,
        EventType.WORKFLOW_TASK_COMPLETED,
    ]
    assert calls == [0, 21]
    # the recorded history replays against the code like any other
    report = check_history(app, await app.history("eager"))
    assert report.ok, report


async def test_starting_an_existing_run_again_changes_nothing(app: tether.App) -> None:
    calls: list[int] = []

    @app.activity
    async def slow(x: int) -> int:
        calls.append(x)
        await asyncio.sleep(0.3)
        return x

    @app.workflow
    async def two_steps(x: int) -> int:
        return await slow(x) + await slow(x + 1)

    async with app.worker(lease=5.0, poll_interval=0.05) as worker:
        first = await app.start(two_steps, 1, run_id="same")

        async def running() -> bool:
            return bool(calls)

        await eventually(running, what="the first step running")
        # the same start while the run is in flight: its speculative first task is
        # dropped, nothing is scheduled twice, the cached instance is untouched
        again = await app.start(two_steps, 1, run_id="same")
        assert again.run_id == first.run_id
        assert await first.result(timeout=10) == 3
        assert worker.stats["eager_starts"] == 1
    assert calls == [1, 2]
    types = await event_types(app, "same")
    assert types.count(EventType.ACTIVITY_SCHEDULED) == 2


async def test_a_queued_start_discards_its_first_task_and_runs_when_admitted(
    app: tether.App,
) -> None:
    calls: list[int] = []
    wf = _register(app, calls)
    app.configure_admission("t", max_running=1)

    @app.workflow
    async def blocker() -> str:
        return str(await tether.wait_event("go"))

    async with app.worker(lease=5.0, poll_interval=0.05):
        block = await app.start(blocker, tenant="t", run_id="blocker")
        queued = await app.start(wf, 5, tenant="t", run_id="queued", on_limit="queue")
        assert (await queued.info()).status is RunStatus.QUEUED
        await asyncio.sleep(0.2)
        assert calls == []  # its speculative first task recorded and ran nothing
        assert await event_types(app, "queued") == [EventType.WORKFLOW_STARTED]
        await block.signal("go", "ok")
        assert await block.result(timeout=10) == "ok"
        assert await queued.result(timeout=10) == 10
    assert calls == [5]


async def test_a_first_task_that_ends_the_run_finishes_in_the_creating_commit(
    app: tether.App,
) -> None:
    @app.workflow
    async def instant(x: int) -> int:
        return x + 1

    @app.workflow
    async def broken(x: int) -> int:
        raise ValueError(f"bad input {x}")

    async with app.worker(lease=5.0, poll_interval=0.05):
        run = await app.start(instant, 1, run_id="instant")
        assert (await run.info()).status is RunStatus.COMPLETED  # done when start returns
        assert await run.result(timeout=5) == 2
        failed = await app.start(broken, 7, run_id="broken")
        info = await failed.info()
        assert info.status is RunStatus.FAILED
        assert info.error is not None and "bad input 7" in info.error["message"]
