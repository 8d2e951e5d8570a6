"""Operating on runs: cancel, terminate, suspend/resume, idempotent start, errors, listing."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import tether
from helpers import event_types, eventually, has_event
from tether import EventType, RunStatus

FAST = tether.Retry(attempts=1, initial=0.01, max_interval=0.05)


async def status_is(app: tether.App, run_id: str, status: RunStatus) -> bool:
    try:
        return (await app.get(run_id)).status is status
    except tether.RunNotFoundError:
        return False


# -- cancel ------------------------------------------------------------------------------------


async def test_cancel_runs_cleanup_in_finally_and_ends_cancelled(
    app: tether.App, worker: tether.Worker
) -> None:
    cleaned: list[str] = []
    after: list[str] = []

    @app.activity
    def cleanup(what: str) -> None:
        cleaned.append(what)

    @app.activity
    def never() -> None:
        after.append("ran")

    @app.workflow
    async def job() -> str:
        try:
            await tether.wait_event("never-sent")
            await never()
            return "finished"
        finally:
            await cleanup("temp files")

    run = await app.start(job)
    await eventually(
        lambda: has_event(app, run.run_id, EventType.WORKFLOW_TASK_COMPLETED), what="waiting"
    )
    await run.cancel("user asked")
    with pytest.raises(tether.RunCancelledError) as ei:
        await run.result(timeout=10)
    assert ei.value.status == "cancelled"
    assert cleaned == ["temp files"]
    assert after == []
    info = await app.get(run.run_id)
    assert info.status is RunStatus.CANCELLED
    types = await event_types(app, run.run_id)
    assert EventType.CANCEL_REQUESTED in types
    assert types[-2:] == [EventType.WORKFLOW_CANCELLED, EventType.WORKFLOW_TASK_COMPLETED]


async def test_cancel_interrupts_running_async_activity(app: tether.App) -> None:
    started = asyncio.Event()
    saw_cancel: list[str] = []
    cleaned: list[int] = []

    @app.activity(retry=FAST)
    async def long_step() -> str:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            saw_cancel.append("cancelled")
            raise
        return "finished"

    @app.activity
    def cleanup() -> None:
        cleaned.append(1)

    @app.workflow
    async def job() -> str:
        try:
            return await long_step()
        finally:
            await cleanup()

    # a lease long enough that a loaded machine does not let the cleanup's lease run out
    # (a step whose lease ran out runs again: at least once), short enough that the
    # renewal which tells the worker of the cancel comes soon
    async with app.worker(lease=2.0, poll_interval=0.05):
        run = await app.start(job)
        await asyncio.wait_for(started.wait(), 10)
        t0 = time.monotonic()
        await app.cancel(run.run_id)
        with pytest.raises(tether.RunCancelledError):
            await run.result(timeout=10)
        assert time.monotonic() - t0 < 10
        assert cleaned == [1]
        assert (await event_types(app, run.run_id)).count(EventType.ACTIVITY_SCHEDULED) == 2
        await eventually(lambda: asyncio.sleep(0, result=bool(saw_cancel)), what="activity saw it")
    assert saw_cancel == ["cancelled"]


async def test_cancel_workflow_may_handle_cancellation_and_complete(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def resilient() -> str:
        try:
            await tether.sleep(60)
        except asyncio.CancelledError:
            return "handled"
        return "slept"

    run = await app.start(resilient)
    await eventually(
        lambda: has_event(app, run.run_id, EventType.TIMER_STARTED), what="timer started"
    )
    await app.cancel(run.run_id)
    assert await run.result(timeout=10) == "handled"
    assert (await app.get(run.run_id)).status is RunStatus.COMPLETED


async def test_cancel_finished_run_raises_run_finished(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def quick() -> int:
        return 1

    run = await app.start(quick)
    assert await run.result(timeout=10) == 1
    with pytest.raises(tether.RunFinishedError) as ei:
        await app.cancel(run.run_id)
    assert ei.value.status == "completed"


# -- terminate ---------------------------------------------------------------------------------


async def test_terminate_ends_run_and_its_children_at_once(
    app: tether.App, worker: tether.Worker
) -> None:
    ran: list[str] = []

    @app.activity
    def after_child() -> None:
        ran.append("after")

    @app.workflow
    async def grandchild() -> str:
        await tether.wait_event("never")
        return "gc"

    @app.workflow
    async def child() -> str:
        return await grandchild()

    @app.workflow
    async def parent() -> str:
        try:
            r = await child()
        finally:
            await after_child()  # terminate must not run this
        return r

    run = await app.start(parent, run_id="top")
    await eventually(lambda: status_is(app, "top/1/1", RunStatus.RUNNING), what="grandchild")
    await app.terminate("top", "operator stop")
    with pytest.raises(tether.RunTerminatedError) as ei:
        await run.result(timeout=5)
    assert "operator stop" in (ei.value.error or "")
    for rid in ("top", "top/1", "top/1/1"):
        info = await app.get(rid)
        assert info.status is RunStatus.TERMINATED, rid
        with pytest.raises(tether.RunTerminatedError):
            await app.get_run(rid).result(timeout=5)
    await asyncio.sleep(0.3)
    assert ran == []
    assert EventType.WORKFLOW_TERMINATED in await event_types(app, "top")
    with pytest.raises(tether.RunFinishedError):
        await app.signal("top/1/1", "never")
    with pytest.raises(tether.RunFinishedError):
        await app.terminate("top")


async def test_terminate_does_not_touch_finished_child(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def kid() -> int:
        return 7

    @app.workflow
    async def parent() -> int:
        v = await kid()
        await tether.wait_event("never")
        return v

    run = await app.start(parent, run_id="p")
    await eventually(lambda: status_is(app, "p/1", RunStatus.COMPLETED), what="child done")
    await eventually(
        lambda: has_event(app, "p", EventType.CHILD_COMPLETED), what="parent saw child"
    )
    await app.terminate("p")
    with pytest.raises(tether.RunTerminatedError):
        await run.result(timeout=5)
    assert (await app.get("p/1")).status is RunStatus.COMPLETED
    assert await app.get_run("p/1").result(timeout=5) == 7


# -- suspend / resume --------------------------------------------------------------------------


async def test_suspend_holds_signalled_run_until_resume(
    app: tether.App, worker: tether.Worker
) -> None:
    steps: list[int] = []

    @app.activity
    def step(i: int) -> int:
        steps.append(i)
        return i

    @app.workflow
    async def staged() -> list[int]:
        a = await step(1)
        await tether.wait_event("go")
        b = await step(2)
        c = await step(3)
        return [a, b, c]

    run = await app.start(staged)
    await eventually(lambda: asyncio.sleep(0, result=steps == [1]), what="step 1")
    await eventually(
        lambda: has_event(app, run.run_id, EventType.ACTIVITY_COMPLETED), what="step 1 recorded"
    )
    await app.suspend(run.run_id)
    assert (await app.get(run.run_id)).status is RunStatus.SUSPENDED
    await app.suspend(run.run_id)  # idempotent
    await app.signal(run.run_id, "go")  # signals are accepted while suspended
    await asyncio.sleep(0.5)
    assert steps == [1]
    assert (await app.get(run.run_id)).status is RunStatus.SUSPENDED
    with pytest.raises(tether.ResultTimeoutError):
        await run.result(timeout=0.1)
    await app.resume(run.run_id)
    assert await run.result(timeout=10) == [1, 2, 3]
    assert steps == [1, 2, 3]
    types = await event_types(app, run.run_id)
    assert EventType.SUSPENDED in types and EventType.RESUMED in types


async def test_suspend_stops_dispatch_after_in_flight_activity_finishes(
    app: tether.App, worker: tether.Worker
) -> None:
    """Suspending while a step runs: that step may finish, but no *new* step is dispatched."""
    release = threading.Event()
    started: list[int] = []

    @app.activity(retry=FAST)
    def step(i: int) -> int:
        started.append(i)
        if i == 1:
            release.wait(10)
        return i

    @app.workflow
    async def chain() -> list[int]:
        return [await step(1), await step(2), await step(3)]

    run = await app.start(chain)
    await eventually(lambda: asyncio.sleep(0, result=started == [1]), what="step 1 running")
    await app.suspend(run.run_id)
    release.set()
    await eventually(
        lambda: has_event(app, run.run_id, EventType.ACTIVITY_COMPLETED), what="step 1 recorded"
    )
    await asyncio.sleep(0.5)
    assert started == [1], "a new step was dispatched while the run was suspended"
    assert (await app.get(run.run_id)).status is RunStatus.SUSPENDED
    await app.resume(run.run_id)
    assert await run.result(timeout=10) == [1, 2, 3]
    assert started == [1, 2, 3]


async def test_suspend_timer_due_while_suspended_continues_after_resume(
    app: tether.App, worker: tether.Worker
) -> None:
    after: list[str] = []

    @app.activity
    def mark() -> None:
        after.append("x")

    @app.workflow
    async def napper() -> str:
        await tether.sleep(0.2)
        await mark()
        return "awake"

    run = await app.start(napper)
    await eventually(lambda: has_event(app, run.run_id, EventType.TIMER_STARTED), what="timer")
    await app.suspend(run.run_id)
    await asyncio.sleep(0.5)
    assert after == []
    assert (await app.get(run.run_id)).status is RunStatus.SUSPENDED
    await app.resume(run.run_id)
    assert await run.result(timeout=10) == "awake"
    assert after == ["x"]


async def test_resume_running_run_is_noop_and_suspend_finished_rejected(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def gate() -> str:
        await tether.wait_event("go")
        return "ok"

    run = await app.start(gate)
    await eventually(lambda: status_is(app, run.run_id, RunStatus.RUNNING), what="running")
    await app.resume(run.run_id)
    assert (await app.get(run.run_id)).status is RunStatus.RUNNING
    assert EventType.RESUMED not in await event_types(app, run.run_id)
    await app.signal(run.run_id, "go")
    assert await run.result(timeout=10) == "ok"
    with pytest.raises(tether.RunFinishedError):
        await app.suspend(run.run_id)
    with pytest.raises(tether.RunFinishedError):
        await app.resume(run.run_id)


# -- idempotent start --------------------------------------------------------------------------


async def test_start_same_run_id_same_input_returns_same_run(
    app: tether.App, worker: tether.Worker
) -> None:
    executions: list[int] = []

    @app.activity
    def work(x: int) -> int:
        executions.append(x)
        return x + 1

    @app.workflow
    async def once(x: int) -> int:
        return await work(x)

    first = await app.start(once, 5, run_id="order-5")
    second = await app.start(once, 5, run_id="order-5")
    assert first.run_id == second.run_id == "order-5"
    assert await first.result(timeout=10) == 6
    third = await app.start(once, 5, run_id="order-5")  # also after it finished
    assert await third.result(timeout=10) == 6
    assert executions == [5]
    assert [r.run_id for r in await app.list()] == ["order-5"]
    starts = [e for e in await app.history("order-5") if e.type is EventType.WORKFLOW_STARTED]
    assert len(starts) == 1


async def test_start_same_run_id_different_input_conflicts(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def greet(name: str) -> str:
        return f"hi {name}"

    @app.workflow
    async def other(name: str) -> str:
        return name

    run = await app.start(greet, "ann", run_id="r1")
    with pytest.raises(tether.RunIdConflictError) as ei:
        await app.start(greet, "bob", run_id="r1")
    assert ei.value.run_id == "r1"
    with pytest.raises(tether.RunIdConflictError):
        await app.start(other, "ann", run_id="r1")  # same input, other workflow
    assert await run.result(timeout=10) == "hi ann"
    info = await app.get("r1")
    assert info.workflow == "greet"
    assert len(await app.list()) == 1


async def test_start_same_run_id_equal_input_in_another_form_joins_the_run(
    app: tether.App,
) -> None:
    """A client retrying a start with its object's keys in another order, or ``100.0``
    for ``100``, gets the run it started (before: RunIdConflictError "different input");
    ``true`` is still not ``1``, nor ``"1"``."""

    @app.workflow
    async def bill(order: dict[str, Any]) -> None:
        return None

    run = await app.start(bill, {"id": 7, "amount": 100, "tags": [1.5, True]}, run_id="o7")
    again = await app.start(bill, {"tags": [1.5, True], "amount": 100.0, "id": 7}, run_id="o7")
    assert again.run_id == run.run_id == "o7"
    for other in (
        {"id": 7, "amount": 100, "tags": [1.5, 1]},
        {"id": 7, "amount": "100", "tags": [1.5, True]},
        {"id": 7, "amount": 100, "tags": [1.5, True], "note": None},
        {"id": 7, "amount": 100, "tags": [True, 1.5]},
    ):
        with pytest.raises(tether.RunIdConflictError, match="different input"):
            await app.start(bill, other, run_id="o7")
    assert len(await app.list()) == 1


async def test_start_same_run_id_other_deadline_webhook_or_budget_is_a_conflict(
    app: tether.App,
) -> None:
    """A start that repeats a run id (an Idempotency-Key over HTTP) with the same input
    but another deadline, webhook or budget was answered with the existing run, the new
    settings silently dropped; it is now a conflict naming the fields that differ (not
    their values). The very same start again still joins the run."""

    @app.workflow
    async def bill(n: int) -> int:
        return n

    hook = "https://hooks.example/paid"
    first = await app.start(
        bill, 1, run_id="b1", deadline=60, webhook=hook, budget=tether.Budget(tokens=100)
    )
    again = await app.start(
        bill, 1, run_id="b1", deadline=60, webhook=hook, budget=tether.Budget(tokens=100)
    )
    assert again.run_id == first.run_id and again.created is False
    same = {"deadline": 60, "webhook": hook, "budget": tether.Budget(tokens=100)}
    for change, fields in (
        ({"webhook": None}, ("webhook",)),
        ({"webhook": "https://hooks.example/other"}, ("webhook",)),
        ({"deadline": 30}, ("deadline",)),
        ({"deadline": None}, ("deadline",)),
        ({"budget": tether.Budget(tokens=5)}, ("budget",)),
        ({"deadline": None, "webhook": None, "budget": None}, ("budget", "deadline", "webhook")),
    ):
        with pytest.raises(tether.RunIdConflictError) as ei:
            await app.start(bill, 1, run_id="b1", **{**same, **change})  # type: ignore[arg-type]
        assert ei.value.fields == fields, change
        assert f"different {', '.join(fields)}" in str(ei.value)
        assert hook not in str(ei.value)  # names the fields, not their values
    with pytest.raises(tether.RunIdConflictError) as ei:
        await app.start(bill, 2, run_id="b1")
    assert ei.value.fields == ("input", "budget", "deadline", "webhook")
    assert len(await app.list()) == 1


def _forget_deadlines(store_url: str) -> None:
    """Make the store's runs look started before the requested deadline was kept in a
    run's attrs (their start events keep ``deadline_at``, as they always did)."""
    sql = "UPDATE runs SET attrs = NULL"
    if store_url.startswith("sqlite:///"):
        import sqlite3

        with sqlite3.connect(store_url[len("sqlite:///") :]) as conn:
            conn.execute(sql)
        return
    import psycopg

    from conftest import PG_URL

    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{store_url.rsplit("schema=", 1)[1]}"')
        conn.execute(sql)


async def test_start_same_run_id_of_a_run_that_did_not_record_its_deadline_joins_it(
    app: tether.App, store_url: str
) -> None:
    """A run started before the requested deadline was kept in its attrs has none there:
    a client retrying that very start (same deadline) after the upgrade got a conflict
    naming ``deadline``. What a run did not record is unknown, not different: the retry
    joins the run (its start event says it had a deadline, not how many seconds were
    asked). A run that had no deadline at all still conflicts with a retry asking one."""

    @app.workflow
    async def bill(n: int) -> int:
        return n

    await app.start(bill, 1, run_id="old-dl", deadline=60)
    await app.start(bill, 1, run_id="old-none")
    _forget_deadlines(store_url)
    assert (await app.get("old-dl")).attrs is None
    again = await app.start(bill, 1, run_id="old-dl", deadline=60)
    assert again.run_id == "old-dl" and again.created is False
    assert (await app.start(bill, 1, run_id="old-dl", deadline=30)).created is False
    assert (await app.start(bill, 1, run_id="old-dl")).created is False  # as before
    with pytest.raises(tether.RunIdConflictError) as ei:
        await app.start(bill, 1, run_id="old-none", deadline=60)
    assert ei.value.fields == ("deadline",)
    assert (await app.start(bill, 1, run_id="old-none")).created is False
    assert len(await app.list()) == 2


# -- errors for unknown / finished runs ---------------------------------------------------------


async def test_signal_finished_run_raises_run_finished(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def done() -> int:
        return 0

    run = await app.start(done)
    await run.result(timeout=10)
    before = await app.history(run.run_id)
    with pytest.raises(tether.RunFinishedError) as ei:
        await app.signal(run.run_id, "late", {"x": 1})
    assert ei.value.run_id == run.run_id
    assert ei.value.status == "completed"
    assert len(await app.history(run.run_id)) == len(before)  # nothing appended


@pytest.mark.parametrize(
    "action",
    ["get", "signal", "cancel", "terminate", "suspend", "resume", "history", "result"],
)
async def test_unknown_run_raises_run_not_found(app: tether.App, action: str) -> None:
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "get": lambda: app.get("ghost"),
        "signal": lambda: app.signal("ghost", "x"),
        "cancel": lambda: app.cancel("ghost"),
        "terminate": lambda: app.terminate("ghost"),
        "suspend": lambda: app.suspend("ghost"),
        "resume": lambda: app.resume("ghost"),
        "history": lambda: app.history("ghost"),
        "result": lambda: app.get_run("ghost").result(timeout=2),
    }
    with pytest.raises(tether.RunNotFoundError) as ei:
        await calls[action]()
    assert ei.value.run_id == "ghost"
    assert await app.list() == []


async def test_start_unregistered_workflow_name_raises(app: tether.App) -> None:
    with pytest.raises(tether.UnknownWorkflowError):
        await app.start("nope")
    assert await app.list() == []


async def test_start_of_a_function_not_decorated_as_a_workflow_says_so(app: tether.App) -> None:
    # @app.workflow forgotten: an AttributeError ('function' object has no attribute
    # 'name') was all a user got
    async def plain(x: int) -> int:
        return x

    for call in (
        lambda: app.start(plain, 1),  # type: ignore[arg-type]
        lambda: app.start_debounced(plain, 1, key="k", window=1.0),  # type: ignore[arg-type]
    ):
        with pytest.raises(tether.ConfigurationError, match=r"plain.*decorate it with @app"):
            await call()
    assert await app.list() == []


def test_an_error_of_app_run_is_not_chained_to_a_missing_event_loop(tmp_path: Any) -> None:
    # every exception out of app.run (the README's first example) began "RuntimeError: no
    # running event loop ... During handling of the above exception, another exception
    # occurred"
    app = tether.App(store=f"sqlite:///{tmp_path / 'r.db'}")

    @app.workflow
    async def boom() -> None:
        raise ValueError("no")

    try:
        with pytest.raises(tether.WorkflowFailedError) as caught:
            app.run(boom, timeout=30)
        assert caught.value.__context__ is None, repr(caught.value.__context__)
    finally:
        asyncio.run(app.close())


async def test_a_run_that_completes_with_a_step_never_awaited_warns_naming_it(
    app: tether.App, worker: tether.Worker, caplog: pytest.LogCaptureFixture
) -> None:
    # classify(text) without await schedules the step; the run completed without it,
    # silently
    @app.activity
    async def classify(text: str) -> str:
        await asyncio.sleep(0.5)
        return "invoice"

    @app.workflow
    async def forgetful(text: str) -> str:
        classify(text)  # type: ignore[unused-coroutine]
        return "done"

    @app.workflow
    async def careful(text: str) -> str:
        return await classify(text)

    with caplog.at_level("WARNING", logger="tether.workflow"):
        assert await (await app.start(forgetful, "x", run_id="f")).result(timeout=10) == "done"
        assert await (await app.start(careful, "x", run_id="c")).result(timeout=10) == "invoice"
    said = [r.getMessage() for r in caplog.records if r.name == "tether.workflow"]
    assert len(said) == 1, said
    assert "'f'" in said[0] and "classify (step 1)" in said[0] and "await" in said[0]


# -- list -----------------------------------------------------------------------------------------


async def test_list_filters_by_status_and_workflow(app: tether.App, worker: tether.Worker) -> None:
    @app.workflow
    async def ok(i: int) -> int:
        return i

    @app.workflow
    async def bad(i: int) -> int:
        raise ValueError(i)

    @app.workflow
    async def waits(i: int) -> int:
        await tether.wait_event("never")
        return i

    for i in range(3):
        await (await app.start(ok, i, run_id=f"ok-{i}")).result(timeout=10)
    with pytest.raises(tether.WorkflowFailedError):
        await (await app.start(bad, 0, run_id="bad-0")).result(timeout=10)
    await app.start(waits, 0, run_id="wait-0")
    await eventually(lambda: status_is(app, "wait-0", RunStatus.RUNNING), what="running")

    def ids(infos: list[tether.RunInfo]) -> set[str]:
        return {i.run_id for i in infos}

    assert ids(await app.list()) == {"ok-0", "ok-1", "ok-2", "bad-0", "wait-0"}
    assert ids(await app.list(status=RunStatus.COMPLETED)) == {"ok-0", "ok-1", "ok-2"}
    assert ids(await app.list(status="failed")) == {"bad-0"}
    assert ids(await app.list(status=RunStatus.RUNNING)) == {"wait-0"}
    assert ids(await app.list(workflow="ok")) == {"ok-0", "ok-1", "ok-2"}
    assert ids(await app.list(workflow="waits", status="running")) == {"wait-0"}
    assert await app.list(workflow="ok", status="failed") == []
    assert await app.list(workflow="nobody") == []
    with pytest.raises(ValueError):
        await app.list(status="bogus")

    # newest first, paged by limit/offset without overlap
    everything = await app.list()
    assert [i.created_at for i in everything] == sorted(
        (i.created_at for i in everything), reverse=True
    )
    assert everything[0].run_id == "wait-0"
    page1 = await app.list(limit=2)
    page2 = await app.list(limit=2, offset=2)
    page3 = await app.list(limit=2, offset=4)
    assert len(page1) == 2 and len(page2) == 2 and len(page3) == 1
    assert [i.run_id for i in page1 + page2 + page3] == [i.run_id for i in everything]


async def test_terminate_runs_no_workflow_code_even_when_worker_discards_it(
    app: tether.App,
) -> None:
    """Terminate runs none of the run's code: not even its ``finally`` when the worker
    that cached the run is stopped and its in-memory copy is garbage collected."""
    ran: list[str] = []

    @app.activity
    def cleanup() -> None:
        ran.append("cleanup")

    @app.workflow
    async def guarded() -> str:
        try:
            await tether.wait_event("never")
        finally:
            await cleanup()
        return "done"

    w = app.worker(lease=2.0, poll_interval=0.05)
    await w.start()
    run = await app.start(guarded)
    await eventually(lambda: status_is(app, run.run_id, RunStatus.RUNNING), what="running")
    await app.terminate(run.run_id)
    with pytest.raises(tether.RunTerminatedError):
        await run.result(timeout=5)
    await w.stop(grace=2.0)
    del w
    gc.collect()
    assert ran == []


async def test_cancel_parent_cancels_waiting_child(app: tether.App, worker: tether.Worker) -> None:
    child_cleanup: list[str] = []

    @app.activity
    def note(what: str) -> None:
        child_cleanup.append(what)

    @app.workflow
    async def kid() -> str:
        try:
            await tether.wait_event("never")
        finally:
            await note("kid cleaned up")
        return "kid"

    @app.workflow
    async def parent() -> str:
        return await kid()

    run = await app.start(parent, run_id="cp")
    await eventually(lambda: status_is(app, "cp/1", RunStatus.RUNNING), what="child running")
    await app.cancel("cp")
    with pytest.raises(tether.RunCancelledError):
        await run.result(timeout=10)
    await eventually(lambda: status_is(app, "cp/1", RunStatus.CANCELLED), what="child cancelled")
    assert child_cleanup == ["kid cleaned up"]
