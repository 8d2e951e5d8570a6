"""run.result(): a commit in this process hands the waiter the run's end, with no read;
ends made elsewhere (another App on the store, an operator's retry) are still seen."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tether
from helpers import eventually
from tether import RunEnd, RunStatus


def _count_reads(app: tether.App, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every ``get_run`` the app's store serves from now on."""
    store = app.store
    reads: list[str] = []
    original = store.get_run

    async def counted(run_id: str, **kw: Any) -> Any:
        reads.append(run_id)
        return await original(run_id, **kw)

    monkeypatch.setattr(store, "get_run", counted)
    return reads


async def test_result_of_a_run_started_and_ended_here_reads_nothing(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.activity
    async def double(x: int) -> int:
        return 2 * x

    @app.workflow
    async def one_step(x: int) -> int:
        return await double(x)

    @app.workflow
    async def fails(x: int) -> int:
        await double(x)
        raise ValueError("no")

    async with app.worker(lease=5.0, poll_interval=0.05):
        reads = _count_reads(app, monkeypatch)

        async def start_and_wait(i: int) -> int:
            return await (await app.start(one_step, i, run_id=f"r{i}")).result(timeout=10)

        # one after another, and 20 at once
        assert [await start_and_wait(i) for i in range(5)] == [0, 2, 4, 6, 8]
        got = await asyncio.gather(*(start_and_wait(i) for i in range(5, 25)))
        assert got == [2 * i for i in range(5, 25)]
        bad = await app.start(fails, 1, run_id="bad")
        with pytest.raises(tether.WorkflowFailedError, match="ValueError: no"):
            await bad.result(timeout=10)
    assert reads == [], f"result() read the run {len(reads)} times"
    # what the hand-off gave is what the store holds
    info = await app.get("r7")
    assert (info.status, info.output) == (RunStatus.COMPLETED, "14")


async def test_result_sees_an_end_made_by_another_app_on_the_store(store_url: str) -> None:
    # the run starts here and runs in this process's worker; another App (another
    # process, as far as the store knows) terminates it: no commit here announces it
    app = tether.App(store=store_url)
    other = tether.App(store=store_url)
    started = asyncio.Event()

    @app.activity
    async def block() -> None:
        started.set()
        await asyncio.sleep(30)

    @app.workflow
    async def stuck() -> None:
        await block()

    try:
        async with app.worker(lease=5.0, poll_interval=0.05):
            run = await app.start(stuck, run_id="stuck")
            assert "stuck" in app._running_here
            await asyncio.wait_for(started.wait(), 10)
            await other.terminate("stuck", "from elsewhere")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(tether.RunTerminatedError, match="from elsewhere"):
                await run.result(timeout=10)
            assert loop.time() - t0 < 3.0  # found by polling, not by the timeout
            assert "stuck" not in app._running_here
    finally:
        await app.close()
        await other.close()


async def test_listeners_get_how_a_run_ended_and_a_retry_clears_it(app: tether.App) -> None:
    attempts: list[int] = []

    @app.activity(retry=tether.Retry(attempts=1))
    async def flaky() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("first time")
        return "ok"

    @app.workflow
    async def wf() -> str:
        return await flaky()

    seen: list[dict[str, RunEnd | None]] = []
    app.store.add_listener(
        lambda ready, finished: seen.append(dict(finished)) if finished else None
    )
    async with app.worker(lease=5.0, poll_interval=0.05):
        run = await app.start(wf, run_id="flaky")
        with pytest.raises(tether.WorkflowFailedError):
            await run.result(timeout=10)
        # listeners run on the store's thread, maybe after result() returned
        await eventually(lambda: _ended(seen, "flaky", RunStatus.FAILED), what="the failure")
        end = next(f["flaky"] for f in seen if "flaky" in f)
        assert end is not None and end.status is RunStatus.FAILED and end.workflow == "wf"
        assert end.error is not None and "first time" in end.error["message"]
        seen.clear()
        # an operator's retry makes the run live again: listeners are told to look it up
        await app.retry("flaky")
        await eventually(lambda: _ended(seen, "flaky", RunStatus.COMPLETED), what="the retry")
        assert seen[0] == {"flaky": None}
        assert await run.result(timeout=10) == "ok"


async def _ended(seen: list[dict[str, RunEnd | None]], run_id: str, status: RunStatus) -> bool:
    return any((e := f.get(run_id)) is not None and e.status is status for f in seen)


async def test_result_polls_a_run_running_elsewhere_by_its_status_alone(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the run runs in another App's worker (another process, as far as the store
    # knows): this App's result() reads the run once, then polls its status (no
    # payload read, nothing opened or decoded) and reads it whole only at its end
    app = tether.App(store=store_url)
    other = tether.App(store=store_url)
    elsewhere, go = _step_held_until(other)
    try:
        async with other.worker(lease=5.0, poll_interval=0.05):
            await other.start(elsewhere, 41, run_id="far")
            reads = _count_reads(app, monkeypatch)
            polls: list[str] = []
            status_of = app.store.run_status

            async def counted_status(run_id: str) -> Any:
                polls.append(run_id)
                return await status_of(run_id)

            monkeypatch.setattr(app.store, "run_status", counted_status)
            waiting = asyncio.ensure_future(app.get_run("far").result(timeout=20))
            await eventually(_at_least(polls, 2), timeout=10)
            assert reads == ["far"]  # the first read; every poll since: the status
            go.set()
            assert await waiting == 42
            assert reads == ["far", "far"]  # and the run whole at its end
    finally:
        await app.close()
        await other.close()


def _step_held_until(other: tether.App) -> tuple[tether.Workflow[[int], int], asyncio.Event]:
    """A workflow of ``other`` (another process, as far as the store knows) whose one
    step returns ``x + 1`` once the event is set."""
    go = asyncio.Event()

    @other.activity
    async def slow(x: int) -> int:
        await go.wait()
        return x + 1

    @other.workflow(name="elsewhere")
    async def elsewhere(x: int) -> int:
        return await slow(x)

    return elsewhere, go


def _at_least(seen: list[str], n: int) -> Any:
    async def check() -> bool:
        return len(seen) >= n

    return check


async def test_a_run_purged_between_its_status_poll_and_its_read_is_said_purged(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the status poll saw the run ended; it was purged before the whole read: the old
    # status was kept, so the deadline falling then said "still completed after the
    # timeout" instead of RunPurgedError
    app = tether.App(store=store_url)
    other = tether.App(store=store_url)
    purged_soon, go = _step_held_until(other)
    try:
        async with other.worker(lease=5.0, poll_interval=0.05):
            await other.start(purged_soon, 1, run_id="gone")
            status_of = app.store.run_status
            purged: list[str] = []

            async def purging(run_id: str) -> Any:
                status = await status_of(run_id)
                if status is not None and status.is_terminal and not purged:
                    purged.append(run_id)
                    await other.purge(0)  # another process's retention, right now
                    await asyncio.sleep(1.0)  # and the deadline passes meanwhile
                return status

            monkeypatch.setattr(app.store, "run_status", purging)
            waiting = asyncio.ensure_future(app.get_run("gone").result(timeout=1.6))
            await asyncio.sleep(0.6)
            go.set()
            with pytest.raises(tether.RunPurgedError):
                await waiting
            assert purged == ["gone"]
    finally:
        await app.close()
        await other.close()
