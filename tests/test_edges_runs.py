"""Edges of run control: operations accepted while a run ends, continue-as-new chains,
rows changed concurrently, parents that close with children running, reserved ids.

Each race is reproduced deterministically: the competing operation is committed from a
hook placed between a workflow task's history read and its result's commit.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import tether
from helpers import event_types, eventually, has_event
from tether import EventType, RunStatus
from tether.testing import check_history

ENDINGS = {
    EventType.WORKFLOW_COMPLETED,
    EventType.WORKFLOW_FAILED,
    EventType.CONTINUED_AS_NEW,
}


def before_ending_commit(
    app: tether.App, action: Callable[[str], Awaitable[None]], *, times: int = 1
) -> list[str]:
    """Run ``action(run_id)`` just before the commit of a workflow task that would end
    its run (complete, fail, continue as new), ``times`` times; returns the run ids hit."""
    store = app.store
    original = store.complete_workflow_task
    hit: list[str] = []

    async def wrapped(task: Any, result: Any, **kw: Any) -> Any:
        if len(hit) < times and any(c.type in ENDINGS for c in result.commands):
            hit.append(task.run_id)
            await action(task.run_id)
        return await original(task, result, **kw)

    store.complete_workflow_task = wrapped  # type: ignore[method-assign]
    return hit


async def last_marker_through(app: tether.App, run_id: str) -> int:
    history = await app.history(run_id, follow=False)
    marks = [e for e in history if e.type is EventType.WORKFLOW_TASK_COMPLETED]
    return int(marks[-1].data["through"])


# -- defect 1: operations accepted during a run's final workflow task ---------------------------


async def test_a_signal_accepted_during_the_final_task_is_seen_before_the_run_ends(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def ends() -> str:
        await tether.sleep(0.01)  # the final task is woken by a timer: the ordinary path
        return "done"

    signalled: list[int] = []

    async def signal(run_id: str) -> None:
        await app.signal(run_id, "late", {"n": 1})
        signalled.append(1)

    hit = before_ending_commit(app, signal)
    run = await app.start(ends)
    assert await run.result(timeout=10) == "done"
    assert hit == [run.run_id] and signalled == [1]
    history = await app.history(run.run_id)
    seq = next(e.seq for e in history if e.type is EventType.SIGNAL_RECEIVED)
    done = next(e.seq for e in history if e.type is EventType.WORKFLOW_COMPLETED)
    assert seq < done
    # the task that ended the run saw the signal: it is inside the last marker's range
    assert await last_marker_through(app, run.run_id) >= seq
    assert worker.stats["workflow_tasks_rejected"] >= 1


async def test_a_cancel_accepted_during_the_final_task_takes_effect(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def ends() -> str:
        await tether.sleep(0.01)
        return "done"

    before_ending_commit(app, lambda rid: app.cancel(rid, "too late?"))
    run = await app.start(ends)
    with pytest.raises(tether.RunCancelledError):
        await run.result(timeout=10)
    assert (await app.get(run.run_id)).status is RunStatus.CANCELLED


async def test_a_cancel_accepted_while_a_run_continues_as_new_stops_the_chain(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def chain(n: int) -> int:
        await tether.sleep(0.01)
        tether.continue_as_new(n + 1)
        raise AssertionError("unreachable")

    before_ending_commit(app, lambda rid: app.cancel(rid, "stop the chain"))
    run = await app.start(chain, 0, run_id="ch")
    with pytest.raises(tether.RunCancelledError):
        await run.result(timeout=10)
    first = await app.get("ch", follow=False)
    assert first.status is RunStatus.CANCELLED
    assert first.continued_to is None
    with pytest.raises(tether.RunNotFoundError):
        await app.get("ch~1", follow=False)


async def test_a_suspend_accepted_while_a_run_continues_as_new_holds_the_next_run(
    app: tether.App, worker: tether.Worker
) -> None:
    ran: list[int] = []

    @app.activity
    def step(n: int) -> int:
        ran.append(n)
        return n

    @app.workflow
    async def chain(n: int) -> int:
        await step(n)
        await tether.sleep(0.01)
        if n >= 50:
            return n
        tether.continue_as_new(n + 1)
        raise AssertionError("unreachable")

    before_ending_commit(app, app.suspend)
    await app.start(chain, 0, run_id="sus")
    await eventually(lambda: _run_status_is(app, "sus~1", RunStatus.SUSPENDED), what="held")
    assert (await app.get("sus")).run_id == "sus~1"
    count = len(ran)
    await asyncio.sleep(0.5)
    assert len(ran) == count <= 2  # nothing dispatched while suspended
    await app.resume("sus")
    assert await app.get_run("sus").result(timeout=20) == 50


async def _run_status_is(app: tether.App, run_id: str, status: RunStatus) -> bool:
    try:
        return (await app.get(run_id, follow=False)).status is status
    except tether.RunNotFoundError:
        return False


async def _live_status(app: tether.App, run_id: str, status: RunStatus) -> tether.RunInfo | None:
    info = await app.get(run_id)
    return info if info.status is status else None


async def test_a_deadline_carries_over_to_the_next_run_of_a_chain(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def forever(n: int) -> int:
        await tether.sleep(0.2)
        tether.continue_as_new(n + 1)
        raise AssertionError("unreachable")

    run = await app.start(forever, 0, run_id="dl", deadline=1)
    with pytest.raises(tether.RunTimedOutError):
        await run.result(timeout=15)
    info = await app.get("dl")
    assert info.status is RunStatus.TIMED_OUT
    assert info.run_id != "dl"  # it timed out on a later run of the chain


# -- defect 2: a chain answers to its first id -------------------------------------------------


def _waiting_chain(app: tether.App) -> tether.Workflow[[int], Any]:
    @app.workflow
    async def waits(n: int) -> Any:
        if n < 2:
            tether.continue_as_new(n + 1)
        try:
            return await tether.wait_event("go")
        finally:
            tether.set_status({"n": n})

    return waits


async def test_a_signal_to_a_chains_first_id_reaches_its_live_run(
    app: tether.App, worker: tether.Worker
) -> None:
    waits = _waiting_chain(app)
    run = await app.start(waits, 0, run_id="c")
    live = await eventually(lambda: _live_status(app, "c", RunStatus.RUNNING), what="the live run")
    assert live.run_id == "c~2"
    await app.signal("c", "go", 7)
    assert await run.result(timeout=10) == 7
    assert (await app.get("c")).run_id == "c~2"
    assert (await app.get("c", follow=False)).status is RunStatus.CONTINUED_AS_NEW
    assert EventType.SIGNAL_RECEIVED in await event_types(app, "c")  # the live run's history
    assert EventType.SIGNAL_RECEIVED not in [e.type for e in await app.history("c", follow=False)]


@pytest.mark.parametrize("op", ["cancel", "terminate"])
async def test_cancel_and_terminate_by_a_chains_first_id_end_its_live_run(
    app: tether.App, worker: tether.Worker, op: str
) -> None:
    waits = _waiting_chain(app)
    await app.start(waits, 0, run_id="c")
    await eventually(lambda: _live_status(app, "c", RunStatus.RUNNING), what="the live run")
    await eventually(lambda: _has_marker(app, "c~2"), what="the live run to wait")
    await getattr(app, op)("c", "stop")
    expected = RunStatus.CANCELLED if op == "cancel" else RunStatus.TERMINATED
    info = await eventually(lambda: _live_status(app, "c", expected), what=f"{op} to land")
    assert info.run_id == "c~2"


async def _has_marker(app: tether.App, run_id: str) -> bool:
    try:
        return EventType.WORKFLOW_TASK_COMPLETED in [
            e.type for e in await app.history(run_id, follow=False)
        ]
    except tether.RunNotFoundError:
        return False


async def test_suspend_and_resume_by_a_chains_first_id(
    app: tether.App, worker: tether.Worker
) -> None:
    waits = _waiting_chain(app)
    run = await app.start(waits, 0, run_id="c")
    await eventually(lambda: _live_status(app, "c", RunStatus.RUNNING), what="the live run")
    await app.suspend("c")
    assert (await app.get("c")).status is RunStatus.SUSPENDED
    await app.resume("c")
    await app.signal("c", "go", "ok")
    assert await run.result(timeout=10) == "ok"


async def test_cancelling_a_parent_reaches_a_child_that_continued_as_new(
    app: tether.App, worker: tether.Worker
) -> None:
    waits = _waiting_chain(app)

    @app.workflow
    async def parent() -> Any:
        return await waits.options(run_id="kid")(0)

    run = await app.start(parent, run_id="p")
    await eventually(lambda: _live_status(app, "kid", RunStatus.RUNNING), what="kid's live run")
    await eventually(lambda: _has_marker(app, "kid~2"), what="kid's live run to wait")
    await app.cancel("p")
    with pytest.raises(tether.RunCancelledError):
        await run.result(timeout=10)
    kid = await eventually(
        lambda: _live_status(app, "kid", RunStatus.CANCELLED), what="the kid's chain cancelled"
    )
    assert kid.run_id == "kid~2"


async def test_a_signal_racing_a_continue_as_new_lands_on_the_next_run(
    app: tether.App, worker: tether.Worker
) -> None:
    """The signal commits between the task's read and its continue-as-new: the task runs
    again with it, and as the code did not take it, it is carried to the next run."""

    @app.workflow
    async def once(n: int) -> Any:
        if n == 0:
            await tether.sleep(0.01)
            tether.continue_as_new(1)
        return await tether.wait_event("go")

    before_ending_commit(app, lambda rid: app.signal(rid, "go", "early"))
    run = await app.start(once, 0, run_id="r")
    await eventually(lambda: _has_marker(app, "r~1"), what="the second run to wait")
    # the signal was seen by run r before it continued: it did not silently vanish
    history = await app.history("r", follow=False)
    sig = next(e.seq for e in history if e.type is EventType.SIGNAL_RECEIVED)
    assert await last_marker_through(app, "r") >= sig
    # ... and the next run got it: the first "go" answers its wait
    assert await run.result(timeout=10) == "early"
    carried = [
        e for e in await app.history("r~1", follow=False) if e.type is EventType.SIGNAL_RECEIVED
    ]
    assert [(e.data["name"], e.data["carried_from"]) for e in carried] == [("go", "r")]


async def test_signals_a_run_never_took_are_carried_across_continue_as_new(
    app: tether.App,
) -> None:
    """Five ticks reach a counter that takes one tick per run and continues as new,
    before any worker ran it: every tick is counted, in order, along the chain. Before,
    the first run received all five, took one, and the four it never took were dropped:
    the chain waited for ever."""

    @app.workflow
    async def counter(seen: list[int], remaining: int) -> list[int]:
        if remaining == 0:
            return seen
        tick = await tether.wait_event("tick")
        tether.continue_as_new([*seen, tick], remaining - 1)

    run = await app.start(counter, [], 5, run_id="c")
    for i in range(1, 6):
        await app.signal("c", "tick", i)
    async with app.worker(lease=5.0, poll_interval=0.05):
        assert await run.result(timeout=20) == [1, 2, 3, 4, 5]
    first = await app.history("c", follow=False)
    ended = next(e for e in first if e.type is EventType.CONTINUED_AS_NEW)
    assert ended.data["carried_signals"] == 4
    # each link received what was left, in order, marked with where it came from
    second = await app.history("c~1", follow=False)
    carried = [e.data for e in second if e.type is EventType.SIGNAL_RECEIVED]
    assert [(d["payload"], d["carried_from"]) for d in carried] == [(i, "c") for i in (2, 3, 4, 5)]


# -- defect 3: operators never overwrite a run that finished concurrently (PostgreSQL) ---------


@pytest.mark.parametrize("op", ["terminate", "suspend", "signal"])
async def test_an_operation_waits_for_a_concurrent_finish_and_then_refuses(
    pg_schema: str, op: str
) -> None:
    """PostgreSQL only: SQLite has one writer, so operations cannot interleave there."""
    import psycopg

    from conftest import PG_URL, with_schema

    store_url = with_schema(PG_URL, pg_schema)
    app = tether.App(store=store_url)

    @app.workflow
    async def waits() -> str:
        await tether.wait_event("never")
        return "x"

    async with app.worker(lease=5.0, poll_interval=0.05):
        await app.start(waits, run_id="w")
        await eventually(
            lambda: has_event(app, "w", EventType.WORKFLOW_TASK_COMPLETED), what="the wait"
        )
    with psycopg.connect(PG_URL) as conn:
        conn.execute(f'SET search_path TO "{pg_schema}"')
        conn.execute("UPDATE runs SET status = 'completed', output = '\"x\"' WHERE run_id = 'w'")
        # the row is locked by this open transaction; the operation runs meanwhile
        errors: list[BaseException] = []

        def operate() -> None:
            async def go() -> None:
                other = tether.App(store=store_url)
                try:
                    if op == "signal":
                        await other.signal("w", "late")
                    else:
                        await getattr(other, op)("w")
                except BaseException as exc:
                    errors.append(exc)
                finally:
                    await other.close()

            asyncio.run(go())

        t = threading.Thread(target=operate)
        t.start()
        await asyncio.sleep(0.5)
        assert t.is_alive()  # waiting for the row lock
        conn.commit()
    await asyncio.to_thread(t.join, 10)
    try:
        assert len(errors) == 1 and isinstance(errors[0], tether.RunFinishedError), errors
        info = await app.get("w")
        assert info.status is RunStatus.COMPLETED
        assert EventType.SIGNAL_RECEIVED not in await event_types(app, "w")
    finally:
        await app.close()


async def test_a_result_for_a_run_terminated_meanwhile_is_refused(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def ends() -> str:
        await tether.sleep(0.01)
        return "done"

    before_ending_commit(app, lambda rid: app.terminate(rid, "operator"))
    run = await app.start(ends)
    with pytest.raises(tether.RunTerminatedError):
        await run.result(timeout=10)
    info = await app.get(run.run_id)
    assert info.status is RunStatus.TERMINATED
    types = await event_types(app, run.run_id)
    assert EventType.WORKFLOW_COMPLETED not in types


# -- defect 5: parent close policy -------------------------------------------------------------


def _kid_and_parent(app: tether.App, policy: str | None) -> dict[str, Any]:
    cleaned: list[str] = []

    @app.activity
    def cleanup(who: str) -> None:
        cleaned.append(who)

    @app.workflow
    async def kid() -> str:
        try:
            await tether.wait_event("never")
        finally:
            await cleanup("kid")
        return "kid"

    @app.activity(retry=tether.Retry(attempts=1))
    def boom() -> None:
        raise tether.NonRetryable("boom")

    child = (
        kid.options(run_id="kid")
        if policy is None
        else kid.options(run_id="kid", parent_close=policy)
    )

    @app.workflow
    async def parent() -> str:
        pending = child()  # the child starts now; the parent fails while it runs
        await tether.sleep(0.05)
        await boom()
        await pending
        return "parent"

    return {"parent": parent, "cleaned": cleaned}


async def test_a_failing_parent_terminates_its_running_child_by_default(
    app: tether.App, worker: tether.Worker
) -> None:
    p = _kid_and_parent(app, None)
    run = await app.start(p["parent"], run_id="p")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    kid = await eventually(
        lambda: _live_status(app, "kid", RunStatus.TERMINATED), what="the kid terminated"
    )
    assert kid.error and "p" in kid.error["message"]
    assert p["cleaned"] == []  # terminate runs none of the child's code


async def test_parent_close_cancel_lets_the_child_clean_up(
    app: tether.App, worker: tether.Worker
) -> None:
    p = _kid_and_parent(app, "cancel")
    run = await app.start(p["parent"], run_id="p")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    await eventually(
        lambda: _live_status(app, "kid", RunStatus.CANCELLED), what="the kid cancelled"
    )
    assert p["cleaned"] == ["kid"]


async def test_parent_close_abandon_leaves_the_child_running(
    app: tether.App, worker: tether.Worker
) -> None:
    p = _kid_and_parent(app, "abandon")
    run = await app.start(p["parent"], run_id="p")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    await asyncio.sleep(0.3)
    assert (await app.get("kid")).status is RunStatus.RUNNING
    await app.signal("kid", "never")
    assert await app.get_run("kid").result(timeout=10) == "kid"


async def test_a_child_given_up_in_first_is_closed_with_its_chain(
    app: tether.App, worker: tether.Worker
) -> None:
    charges: list[int] = []

    @app.activity
    def charge(n: int) -> int:
        charges.append(n)
        return n

    @app.workflow
    async def billing(n: int) -> int:
        await charge(n)
        await tether.sleep(0.02)
        tether.continue_as_new(n + 1)
        raise AssertionError("unreachable")

    @app.workflow
    async def parent() -> str:
        winner = await tether.first(billing.options(run_id="bill")(0), tether.sleep(0.3))
        return "timeout" if winner is None else "billed"

    run = await app.start(parent)
    assert await run.result(timeout=10) == "timeout"
    await eventually(lambda: _chain_ended(app, "bill"), what="the given-up child chain to end")
    count = len(charges)
    await asyncio.sleep(0.4)
    assert len(charges) == count


async def _chain_ended(app: tether.App, run_id: str) -> bool:
    return (await app.get(run_id)).is_finished


async def test_a_parent_close_policy_is_checked() -> None:
    app = tether.App(store="sqlite:///:memory:")

    @app.workflow
    async def kid() -> None:
        return None

    with pytest.raises(tether.ConfigurationError, match="parent_close"):
        kid.options(parent_close="explode")


# -- defect 9: continue-as-new ids live in a reserved namespace --------------------------------


async def test_a_user_run_id_with_the_chain_separator_is_refused(app: tether.App) -> None:
    @app.workflow
    async def nightly() -> None:
        return None

    with pytest.raises(tether.ConfigurationError, match="~"):
        await app.start(nightly, run_id="nightly~1")
    with pytest.raises(tether.ConfigurationError, match="~"):
        nightly.options(run_id="kid~2")
    assert await app.list() == []


async def test_a_signal_name_no_workflow_could_wait_for_is_refused_and_nothing_is_stored(
    app: tether.App, worker: tether.Worker
) -> None:
    """Empty, non-text, overlong or control-character names were stored (and PostgreSQL
    refuses NUL in text mid-commit); each is refused before the store, the run untouched."""

    @app.workflow
    async def waits() -> Any:
        return await tether.wait_event("go", timeout=30)

    run = await app.start(waits, run_id="named")
    for bad in ("", None, 5, "x" * 201, "a\x00b", "line\nbreak"):
        with pytest.raises(tether.ConfigurationError, match="signal name"):
            await app.signal("named", bad, 1)  # type: ignore[arg-type]
    assert EventType.SIGNAL_RECEIVED not in await event_types(app, "named")
    await app.signal("named", "go", {"ok": True})
    assert await run.result(timeout=10) == {"ok": True}

    @app.workflow
    async def waits_for_nothing() -> Any:
        return await tether.wait_event("", timeout=30)  # no sender could ever match it

    bad = await app.start(waits_for_nothing)
    with pytest.raises(tether.WorkflowFailedError, match="signal name"):
        await bad.result(timeout=10)


@pytest.mark.parametrize("how", ["parent cancelled", "race lost"])
async def test_an_abandoned_child_runs_on_when_its_parent_stops_awaiting_it(
    app: tether.App, worker: tether.Worker, how: str
) -> None:
    @app.workflow
    async def report() -> str:
        await tether.wait_event("go")
        return "report"

    @app.workflow
    async def parent() -> str:
        child = report.options(run_id="kid", parent_close="abandon")()
        if how == "race lost":
            winner = await tether.first(child, tether.sleep(0.1))
            return "gave up" if winner is None else "got it"
        return await child

    run = await app.start(parent, run_id="p")
    if how == "parent cancelled":
        await eventually(lambda: _live_status(app, "kid", RunStatus.RUNNING), what="the kid")
        await app.cancel("p", "operator")
        with pytest.raises(tether.RunCancelledError):
            await run.result(timeout=10)
    else:
        assert await run.result(timeout=10) == "gave up"
    await asyncio.sleep(0.3)
    assert (await app.get("kid")).status is RunStatus.RUNNING  # neither cancelled nor ended
    history = await app.history("p")
    assert EventType.CHILD_CANCEL_REQUESTED not in [e.type for e in history]
    assert check_history(app, history).ok
    await app.signal("kid", "go")
    assert await app.get_run("kid").result(timeout=10) == "report"


async def test_an_old_history_that_cancelled_an_abandoned_child_replays_as_recorded(
    db_path: Any,
) -> None:
    app = tether.App(store=f"sqlite:///{db_path}")

    @app.workflow
    async def report() -> str:
        await tether.wait_event("go")
        return "report"

    @app.workflow
    async def parent() -> str:
        return await report.options(run_id="kid", parent_close="abandon")()

    # written by the older code, which asked an abandoned child to cancel with its parent
    recorded: list[tuple[str, int | None, dict[str, Any]]] = [
        ("WorkflowStarted", None, {"workflow": "parent", "input": {"args": [], "kwargs": {}}}),
        (
            "ChildStarted",
            1,
            {"workflow": "report", "child_run_id": "kid", "parent_close": "abandon"},
        ),
        ("WorkflowTaskCompleted", None, {"through": 1, "time": 10.0}),
        ("CancelRequested", None, {"reason": "operator"}),
        ("ChildCancelRequested", 2, {"child_step": 1, "child_run_id": "kid"}),
        ("WorkflowCancelled", 3, {"error": None}),
        ("WorkflowTaskCompleted", None, {"through": 4, "time": 10.3}),
    ]
    history = [
        tether.Event(
            run_id="p",
            seq=seq,
            type=EventType(type_),
            step=step,
            data=data,
            created_at=10.0 + seq / 10,
        )
        for seq, (type_, step, data) in enumerate(recorded, start=1)
    ]
    report_ = check_history(app, history)
    assert report_.ok, report_.diff()
