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
    """The store keeps refusing one attempt's result though the lease renewals succeed:
    it is offered for about a lease (less a margin), then the step is given back."""
    ran: list[str] = []
    pair = _two_steps(app, ran)
    real = app.store.complete_activity
    failed: list[tuple[int, int]] = []

    async def down(task: Any, result: str, **kw: Any) -> Any:
        if not failed or failed[0] == (task.task_id, task.fence):
            failed.append((task.task_id, task.fence))
            raise tether.StoreError(LOST)
        return await real(task, result, **kw)

    monkeypatch.setattr(app.store, "complete_activity", down)
    caplog.set_level(logging.WARNING, logger="tether")
    w = app.worker(lease=3.0, poll_interval=0.05)
    await w.start()
    try:
        run = await app.start(pair, run_id="r1")
        assert await run.result(timeout=15) == ["A", "B"]
    finally:
        await w.stop(grace=2.0)
    assert len(failed) >= 4 and len(set(failed)) == 1  # offered again, then given back
    assert len(ran) == 3  # and so its step ran again
    assert "so the step is given back" in caplog.text and LOST in caplog.text
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


@pytest.mark.parametrize("failures", [1, 6])
async def test_a_workflow_task_commit_that_failed_is_offered_again_not_left_to_its_lease(
    app: tether.App, monkeypatch: pytest.MonkeyPatch, failures: int
) -> None:
    """The commit did not land (the connection dropped before it): it is offered again
    at once (1 failure), or, while the store keeps failing, the task is given back
    after a short delay (6 failures): never left to its 30 s lease."""
    ran: list[str] = []
    pair = _two_steps(app, ran)
    real = app.store.complete_workflow_task
    calls: list[int] = []

    async def flaky(task: Any, *args: Any, **kw: Any) -> Any:
        calls.append(task.task_id)
        if len(calls) <= failures:
            raise tether.StoreError(LOST)
        return await real(task, *args, **kw)

    monkeypatch.setattr(app.store, "complete_workflow_task", flaky)
    w = app.worker(lease=30.0, poll_interval=0.05)
    await w.start()
    try:
        run = await app.start(pair, run_id="r1")
        assert await run.result(timeout=10) == ["A", "B"]  # not after the 30 s lease
    finally:
        await w.stop(grace=2.0)
    assert sorted(ran) == ["a", "b"]
    assert len(calls) > failures


async def test_a_landed_commit_that_requeued_its_task_refuses_a_retry(
    app: tether.App,
) -> None:
    """A workflow task committed while a signal came in, and a failed attempt (retried
    later), leave their task rows queued: offering the same outcome again (a retry of a
    commit whose answer was lost) is refused by the fence, not recorded twice."""
    from tether.workflow._instance import WorkflowInstance

    @app.activity
    def step() -> str:
        return "x"

    @app.workflow
    async def wf() -> str:
        await tether.wait_event("go")
        return await step()

    store = app.store
    await app.start(wf, run_id="r1")

    async def commit_once(signal: bool) -> None:
        [wt] = await store.claim(worker_id="w", queues=["default"], limit=10, lease=30.0)
        inst = WorkflowInstance("r1", app.get_workflow("wf"))
        try:
            result = inst.advance(await store.read_history("r1"), store.clock())
            if signal:
                await app.signal("r1", "go", 1)  # newer than what the task read
            await store.complete_workflow_task(wt, result)
            if signal:
                with pytest.raises(tether.LeaseLostError):
                    await store.complete_workflow_task(wt, result)
        finally:
            inst.close()

    await commit_once(signal=True)
    await commit_once(signal=False)  # the requeued task: it schedules the step
    [at] = await store.claim(worker_id="w", queues=["default"], limit=10, lease=30.0)
    assert at.kind == "activity"
    error = {"type": "RuntimeError", "message": "boom"}
    await store.fail_activity(at, error, store.clock() + 100)
    with pytest.raises(tether.LeaseLostError):
        await store.fail_activity(at, error, store.clock() + 100)
    types = [e.type for e in await store.read_history("r1")]
    assert types.count(tether.EventType.WORKFLOW_TASK_COMPLETED) == 2
    assert types.count(tether.EventType.ACTIVITY_ATTEMPT_FAILED) == 1


async def test_a_result_is_offered_through_an_outage_while_the_lease_lasts(
    app: tether.App, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The store is down for 3 s when the step returns (its commits and the lease
    renewals fail): the result is offered until the store is back, well within the
    worker's lease, so the step (a paid call) does not run again."""
    ran: list[str] = []
    pair = _two_steps(app, ran)
    loop = asyncio.get_running_loop()
    outage: list[float] = []  # when it ends

    def down() -> bool:
        return bool(outage) and loop.time() < outage[0]

    real_complete = app.store.complete_activity
    real_renew = app.store.renew

    async def complete(task: Any, result: str, **kw: Any) -> Any:
        if not outage:
            outage.append(loop.time() + 3.0)
        if down():
            raise tether.StoreError(LOST)
        return await real_complete(task, result, **kw)

    async def renew(*args: Any, **kw: Any) -> Any:
        if down():
            raise tether.StoreError(LOST)
        return await real_renew(*args, **kw)

    monkeypatch.setattr(app.store, "complete_activity", complete)
    monkeypatch.setattr(app.store, "renew", renew)
    caplog.set_level(logging.WARNING, logger="tether")
    w = app.worker(lease=15.0, poll_interval=0.05)
    await w.start()
    try:
        run = await app.start(pair, run_id="r1")
        assert await run.result(timeout=12) == ["A", "B"]
    finally:
        await w.stop(grace=2.0)
    assert sorted(ran) == ["a", "b"]  # neither ran again
    assert "given back" not in caplog.text


async def test_a_result_the_store_never_takes_is_given_back_before_the_lease_ends(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store keeps failing: the result is offered until shortly before this
    worker's lease on the step would end, then the step is given back."""
    ran: list[str] = []
    pair = _two_steps(app, ran)
    loop = asyncio.get_running_loop()
    offers: list[float] = []
    released: list[float] = []
    real_release = app.store.release

    async def complete(task: Any, result: str, **kw: Any) -> Any:
        offers.append(loop.time())
        raise tether.StoreError(LOST)

    async def renew(*args: Any, **kw: Any) -> Any:
        raise tether.StoreError(LOST)

    async def release(tasks: Any, *args: Any, **kw: Any) -> Any:
        if offers and not released:
            released.append(loop.time())
        return await real_release(tasks, *args, **kw)

    monkeypatch.setattr(app.store, "complete_activity", complete)
    monkeypatch.setattr(app.store, "renew", renew)
    monkeypatch.setattr(app.store, "release", release)
    w = app.worker(lease=6.0, poll_interval=0.05)
    await w.start()
    try:
        await app.start(pair, run_id="r1")
        for _ in range(200):
            if released:
                break
            await asyncio.sleep(0.05)
    finally:
        await w.stop(grace=0.5)
    assert released, "never given back"
    # offered past the old 1.7 s window, and given back before the 6 s lease ran out
    assert 2.5 < released[0] - offers[0] < 6.0, (offers, released)
    assert len(offers) >= 5


async def test_a_failure_lost_to_a_store_blip_is_offered_again(
    app: tether.App, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The commit of a failed attempt is lost (it did not land): it is offered again,
    like a result, instead of the task failing 'unexpectedly' and running an extra time."""
    ran: list[int] = []

    @app.activity(retry=tether.Retry(attempts=3, initial=0.01, jitter=0.0))
    def flop() -> str:
        ran.append(1)
        if len(ran) == 1:
            raise RuntimeError("first attempt fails")
        return "ok"

    @app.workflow
    async def wf() -> str:
        return await flop()

    real = app.store.fail_activity
    calls: list[int] = []

    async def flaky(task: Any, *args: Any, **kw: Any) -> Any:
        calls.append(task.task_id)
        if len(calls) <= 2:
            raise tether.StoreError(LOST)
        return await real(task, *args, **kw)

    monkeypatch.setattr(app.store, "fail_activity", flaky)
    caplog.set_level(logging.WARNING, logger="tether")
    w = app.worker(lease=30.0, poll_interval=0.05)
    await w.start()
    try:
        run = await app.start(wf, run_id="r1")
        assert await run.result(timeout=10) == "ok"
    finally:
        await w.stop(grace=2.0)
    assert len(ran) == 2 and len(calls) == 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_result_rides_out_store_errors_while_it_polls(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.workflow
    async def wf() -> int:
        return 7

    w = app.worker(lease=30.0, poll_interval=0.05)
    await w.start()
    try:
        run = await app.start(wf, run_id="r1")
        assert await run.result(timeout=10) == 7
    finally:
        await w.stop(grace=2.0)
    real = app.store.get_run
    calls: list[int] = []

    async def flaky(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) <= 3:
            raise tether.StoreError(LOST)
        return await real(*args, **kw)

    monkeypatch.setattr(app.store, "get_run", flaky)
    assert await run.result(timeout=10) == 7  # read again: the first reads fail
    assert len(calls) == 4


async def test_result_times_out_naming_the_store_problem(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.workflow
    async def wf() -> int:
        return 7

    run = await app.start(wf, run_id="r1")

    async def down(*args: Any, **kw: Any) -> Any:
        raise tether.StoreError(LOST)

    monkeypatch.setattr(app.store, "get_run", down)
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(tether.ResultTimeoutError, match="lost the connection"):
        await run.result(timeout=0.6)
    assert loop.time() - began < 3.0


async def test_the_sync_result_rides_out_store_errors_too(
    app: tether.App, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.workflow
    async def wf() -> int:
        return 7

    async with app.worker(lease=30.0, poll_interval=0.05):
        assert await (await app.start(wf, run_id="r1")).result(timeout=10) == 7
    client_app = tether.App(store=store_url)
    client = tether.SyncClient(client_app)
    try:
        real = client_app.store.get_run
        calls: list[int] = []

        async def flaky(*args: Any, **kw: Any) -> Any:
            calls.append(1)
            if len(calls) <= 3:
                raise tether.StoreError(LOST)
            return await real(*args, **kw)

        monkeypatch.setattr(client_app.store, "get_run", flaky)
        got = await asyncio.to_thread(lambda: client.get_run("r1").result(timeout=10))
        assert got == 7 and len(calls) == 4
    finally:
        await asyncio.to_thread(client.close)
        await client_app.close()


async def test_a_worker_whose_id_is_taken_gives_nothing_back(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds this worker's id (both run on): after a lost commit this
    one gives nothing back, since what the id holds on the run may be the other's."""

    @app.workflow
    async def wf() -> int:
        return 1

    await app.start(wf, run_id="r1")
    (task,) = await app.store.claim(worker_id="X", queues=["default"], limit=1, lease=30)
    calls: list[Any] = []

    async def give_back(*args: Any, **kw: Any) -> int:
        calls.append((args, kw))
        return 0

    monkeypatch.setattr(app.store, "give_back", give_back)
    w = app.worker(worker_id="X", lease=30.0)
    w._id_taken = True
    await w._give_back_unknown(task, app.store.clock())
    assert calls == []
    w._id_taken = False
    await w._give_back_unknown(task, app.store.clock())
    assert len(calls) == 1 and calls[0][0][:3] == ("X", "r1", [task.task_id])


async def test_a_workflow_task_whose_last_offer_landed_unheard_gives_its_steps_back(
    app: tether.App, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every offer of a workflow task's commit fails, but the last one landed (its
    answer lost): the release that follows finds the task gone, so the steps that
    commit leased to this worker are given back at once, not left to their lease."""
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
    calls: list[int] = []

    async def flaky(task: Any, *args: Any, **kw: Any) -> Any:
        history = await app.store.read_history(task.run_id)
        if not any(e.type is tether.EventType.TIMER_FIRED for e in history) or len(calls) >= 4:
            return await real(task, *args, **kw)
        calls.append(task.task_id)  # the task that leases the step to this worker
        if len(calls) == 4:
            await real(task, *args, **kw)  # the last offer commits, but its answer is lost
        raise tether.StoreError(LOST)

    monkeypatch.setattr(app.store, "complete_workflow_task", flaky)
    caplog.set_level(logging.INFO, logger="tether")
    w = app.worker(lease=30.0, poll_interval=0.05)
    await w.start()
    try:
        run = await app.start(one, run_id="r1")
        assert await run.result(timeout=10) == "A"  # not after the 30 s lease
    finally:
        await w.stop(grace=2.0)
    assert ran == ["a"] and len(calls) == 4
    assert "gave back 1 task(s) of run 'r1'" in caplog.text


async def test_a_heartbeat_steps_result_is_offered_while_its_heartbeat_lease_lasts(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with a heartbeat timeout is leased for that long from its last heartbeat
    (lease renewals do not extend it): a result the store keeps refusing is offered
    until shortly before that runs out, not for the worker's much longer lease."""
    loop = asyncio.get_running_loop()
    offers: list[float] = []
    released: list[float] = []
    real_release = app.store.release

    @app.activity(heartbeat_timeout=3)
    async def beat() -> str:
        tether.activity_context().heartbeat("x")
        await asyncio.sleep(0.3)
        return "done"

    @app.workflow
    async def wf() -> str:
        return await beat()

    async def complete(task: Any, result: str, **kw: Any) -> Any:
        offers.append(loop.time())
        raise tether.StoreError(LOST)

    async def release(tasks: Any, *args: Any, **kw: Any) -> Any:
        if offers and not released:
            released.append(loop.time())
        return await real_release(tasks, *args, **kw)

    async def fast(task: Any, *args: Any, **kw: Any) -> Any:
        offers.append(loop.time())
        raise tether.StoreError(LOST)

    monkeypatch.setattr(app.store, "complete_activity", complete)
    monkeypatch.setattr(app.store, "complete_activity_fast", fast, raising=False)
    monkeypatch.setattr(app.store, "release", release)
    w = app.worker(lease=30.0, poll_interval=0.05)
    await w.start()
    try:
        await app.start(wf, run_id="r1")
        for _ in range(160):
            if released:
                break
            await asyncio.sleep(0.05)
    finally:
        await w.stop(grace=0.5)
    assert released, ("not given back within 8 s", offers)
    # the heartbeat lease (3 s from the beat, less a 1 s margin) bounds the offers
    assert released[0] - offers[0] < 2.5, (offers, released)
