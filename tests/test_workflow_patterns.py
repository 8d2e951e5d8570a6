"""Workflow patterns end to end: sequences, fan-out, children, timers, races, events."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid as uuid_mod
from datetime import datetime
from typing import Any

import pytest

import tether
from helpers import event_types, eventually, has_event
from tether import EventType, RunStatus

FAST = tether.Retry(attempts=1, initial=0.01, max_interval=0.05)


async def waiting_for_signal(app: tether.App, run_id: str) -> bool:
    """True once the run committed at least one workflow task (it is now waiting)."""
    return await has_event(app, run_id, EventType.WORKFLOW_TASK_COMPLETED)


# -- sequential, parallel, branching --------------------------------------------------


async def test_sequential_steps_run_in_order_and_chain_results(
    app: tether.App, worker: tether.Worker
) -> None:
    order: list[str] = []

    @app.activity
    def step(name: str, acc: list[str]) -> list[str]:
        order.append(name)
        return [*acc, name]

    @app.workflow
    async def pipeline() -> list[str]:
        acc: list[str] = []
        for name in ["fetch", "parse", "store"]:
            acc = await step(name, acc)
        return acc

    run = await app.start(pipeline)
    assert await run.result(timeout=10) == ["fetch", "parse", "store"]
    assert order == ["fetch", "parse", "store"]
    scheduled = [e for e in await app.history(run.run_id) if e.type is EventType.ACTIVITY_SCHEDULED]
    assert [e.step for e in scheduled] == [1, 2, 3]
    assert (await app.get(run.run_id)).status is RunStatus.COMPLETED


async def test_gather_runs_activities_concurrently_results_in_argument_order(
    app: tether.App, worker: tether.Worker
) -> None:
    # each activity waits at the barrier until all three are running at once: if the
    # engine ran them one by one the barrier would break and the run would fail
    barrier = threading.Barrier(3, timeout=5)

    @app.activity(retry=FAST)
    def meet(tag: str) -> str:
        barrier.wait()
        return tag.upper()

    @app.workflow
    async def parallel() -> list[str]:
        return await tether.gather(meet("a"), meet("b"), meet("c"))

    run = await app.start(parallel)
    assert await run.result(timeout=15) == ["A", "B", "C"]


async def test_gather_return_exceptions_collects_failures_in_place(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.activity(retry=FAST)
    def maybe(i: int) -> int:
        if i == 1:
            raise ValueError("odd one out")
        return i * 10

    @app.workflow
    async def collect() -> list[str]:
        out = await tether.gather(maybe(0), maybe(1), maybe(2), return_exceptions=True)
        return [type(x).__name__ if isinstance(x, BaseException) else str(x) for x in out]

    run = await app.start(collect)
    assert await run.result(timeout=10) == ["0", "ActivityError", "20"]


async def test_branching_follows_activity_result(app: tether.App, worker: tether.Worker) -> None:
    ran: list[str] = []

    @app.activity
    def classify(n: int) -> str:
        return "even" if n % 2 == 0 else "odd"

    @app.activity
    def handle_even(n: int) -> str:
        ran.append(f"even:{n}")
        return f"{n} halves to {n // 2}"

    @app.activity
    def handle_odd(n: int) -> str:
        ran.append(f"odd:{n}")
        return f"{n} triples to {3 * n + 1}"

    @app.workflow
    async def collatz_step(n: int) -> str:
        kind = await classify(n)
        if kind == "even":
            return await handle_even(n)
        return await handle_odd(n)

    even = await app.start(collatz_step, 10)
    odd = await app.start(collatz_step, 7)
    assert await even.result(timeout=10) == "10 halves to 5"
    assert await odd.result(timeout=10) == "7 triples to 22"
    assert sorted(ran) == ["even:10", "odd:7"]


async def test_fan_out_fan_in_thousand_items_results_in_order(
    app: tether.App, worker: tether.Worker
) -> None:
    executed: list[int] = []

    @app.activity
    async def square(i: int) -> int:
        # scramble completion order so ordering must come from the engine
        await asyncio.sleep(((i * 7919) % 13) / 2000)
        executed.append(i)
        return i * i

    @app.activity
    def total(values: list[int]) -> int:
        return sum(values)

    @app.workflow
    async def fan(n: int) -> tuple[list[int], int]:
        squares = await tether.gather(*(square(i) for i in range(n)))
        return squares, await total(squares)

    run = await app.start(fan, 1000)
    squares, summed = await run.result(timeout=120)
    assert squares == [i * i for i in range(1000)]
    assert summed == sum(i * i for i in range(1000))
    assert sorted(executed) == list(range(1000))  # each item exactly once


# -- child workflows --------------------------------------------------------------------


async def test_child_workflow_returns_result_with_parent_step_run_id(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.activity
    def double(x: int) -> int:
        return 2 * x

    @app.workflow
    async def child(x: int) -> int:
        return await double(x)

    @app.activity
    def noop() -> None:
        return None

    @app.workflow
    async def parent(x: int) -> int:
        await noop()  # step 1
        return await child(x) + 1  # step 2

    run = await app.start(parent, 20, run_id="fam")
    assert await run.result(timeout=10) == 41
    info = await app.get("fam/2")
    assert info.workflow == "child"
    assert info.parent_run_id == "fam"
    assert info.status is RunStatus.COMPLETED


async def test_child_workflow_options_run_id_used(app: tether.App, worker: tether.Worker) -> None:
    @app.workflow
    async def kid(name: str) -> str:
        return f"hello {name}"

    @app.workflow
    async def parent() -> list[str]:
        return await tether.gather(
            kid.options(run_id="kid-a")("a"), kid.options(run_id="kid-b")("b")
        )

    run = await app.start(parent, run_id="p")
    assert await run.result(timeout=10) == ["hello a", "hello b"]
    for rid in ("kid-a", "kid-b"):
        info = await app.get(rid)
        assert info.parent_run_id == "p"
        assert info.status is RunStatus.COMPLETED


async def test_child_workflow_failure_raises_child_workflow_error(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def fragile(x: int) -> int:
        raise ValueError(f"boom {x}")

    @app.workflow
    async def guardian() -> dict[str, Any]:
        try:
            await fragile(3)
        except tether.ChildWorkflowError as exc:
            return {"run_id": exc.run_id, "status": exc.status, "error": exc.error}
        return {}

    run = await app.start(guardian, run_id="g")
    out = await run.result(timeout=10)
    assert out["run_id"] == "g/1"
    assert out["status"] == "failed"
    assert "ValueError" in out["error"] and "boom 3" in out["error"]
    assert (await app.get("g/1")).status is RunStatus.FAILED
    assert (await app.get("g")).status is RunStatus.COMPLETED


async def test_child_workflow_failure_uncaught_fails_parent(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def fragile() -> int:
        raise RuntimeError("child broke")

    @app.workflow
    async def careless() -> int:
        return await fragile()

    run = await app.start(careless)
    with pytest.raises(tether.WorkflowFailedError) as ei:
        await run.result(timeout=10)
    assert ei.value.status == "failed"
    assert "ChildWorkflowError" in (ei.value.error or "")
    info = await app.get(run.run_id)
    assert info.status is RunStatus.FAILED
    assert info.error is not None and info.error["type"] == "ChildWorkflowError"


# -- durable timers ------------------------------------------------------------------------


async def test_sleep_durable_timer_waits_and_is_recorded(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def nap() -> float:
        before = tether.now()
        await tether.sleep(0.3)
        return (tether.now() - before).total_seconds()

    t0 = time.monotonic()
    run = await app.start(nap)
    elapsed_in_workflow = await run.result(timeout=10)
    assert time.monotonic() - t0 >= 0.3
    assert elapsed_in_workflow >= 0.3
    types = await event_types(app, run.run_id)
    assert types.count(EventType.TIMER_STARTED) == 1
    assert types.count(EventType.TIMER_FIRED) == 1


async def test_sleep_timedelta_and_sequential_timers(
    app: tether.App, worker: tether.Worker
) -> None:
    from datetime import timedelta

    @app.workflow
    async def naps() -> int:
        for _ in range(3):
            await tether.sleep(timedelta(milliseconds=50))
        return 3

    run = await app.start(naps)
    assert await run.result(timeout=10) == 3
    types = await event_types(app, run.run_id)
    assert types.count(EventType.TIMER_FIRED) == 3


# -- first: racing an activity against a timer ------------------------------------------


async def test_first_activity_beats_timer_and_timer_never_fires(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.activity
    def quick() -> str:
        return "fast"

    @app.workflow
    async def race() -> list[Any]:
        # the timer is long enough that a loaded machine still finishes quick() first
        winner = await tether.first(quick(), tether.sleep(1.5))
        # stay alive past the timer's due time: a late TimerFired must change nothing
        after = await tether.wait_event("proceed")
        return [winner, after]

    run = await app.start(race)
    await eventually(
        lambda: has_event(app, run.run_id, EventType.TIMER_CANCELLED), what="timer cancelled"
    )
    await asyncio.sleep(1.7)  # past the 1.5 s deadline of the cancelled timer
    await app.signal(run.run_id, "proceed", "ok")
    assert await run.result(timeout=10) == ["fast", "ok"]
    types = await event_types(app, run.run_id)
    assert EventType.TIMER_FIRED not in types
    assert types.count(EventType.ACTIVITY_COMPLETED) == 1


async def test_first_timer_beats_activity_and_late_activity_result_ignored(
    app: tether.App, worker: tether.Worker
) -> None:
    release = threading.Event()
    finished: list[str] = []

    @app.activity(retry=FAST)
    def slow() -> str:
        release.wait(10)
        finished.append("slow")
        return "too late"

    @app.workflow
    async def race() -> list[Any]:
        winner = await tether.first(slow(), tether.sleep(0.1))
        await tether.wait_event("proceed")
        return [winner, "done"]

    run = await app.start(race)
    await eventually(
        lambda: has_event(app, run.run_id, EventType.ACTIVITY_CANCEL_REQUESTED),
        what="loser cancelled",
    )
    release.set()  # the loser now finishes with a value (sync activities cannot be stopped)
    await eventually(lambda: asyncio.sleep(0, result=bool(finished)), what="slow finished")
    await asyncio.sleep(0.2)  # let its completion (if any) reach the history
    await app.signal(run.run_id, "proceed")
    assert await run.result(timeout=10) == [None, "done"]
    types = await event_types(app, run.run_id)
    assert EventType.TIMER_FIRED in types
    assert EventType.TIMER_CANCELLED not in types


async def test_first_loser_outcome_ignored_on_replay(app: tether.App) -> None:
    """A loser's late completion sits in history; a fresh worker replays to the same winner."""
    release = threading.Event()

    @app.activity(retry=FAST)
    def slow() -> str:
        release.wait(10)
        return "late"

    @app.workflow
    async def race() -> list[Any]:
        winner = await tether.first(slow(), tether.sleep(0.1))
        signal = await tether.wait_event("proceed")
        return [winner, signal]

    w1 = app.worker(lease=5.0, poll_interval=0.05)
    await w1.start()
    try:
        run = await app.start(race)
        await eventually(
            lambda: has_event(app, run.run_id, EventType.ACTIVITY_CANCEL_REQUESTED),
            what="loser cancelled",
        )
        release.set()
        await eventually(
            lambda: has_event(app, run.run_id, EventType.ACTIVITY_COMPLETED),
            what="loser completion recorded",
        )
    finally:
        await w1.stop(grace=2.0)
    w2 = app.worker(lease=5.0, poll_interval=0.05)
    await w2.start()
    try:
        await app.signal(run.run_id, "proceed", "go")
        assert await run.result(timeout=10) == [None, "go"]
        assert w2.stats["replays"] >= 1
    finally:
        await w2.stop(grace=2.0)


# -- wait_event and signals ------------------------------------------------------------------


async def test_wait_event_returns_signal_payload(app: tether.App, worker: tether.Worker) -> None:
    @app.workflow
    async def approval() -> dict[str, Any]:
        return await tether.wait_event("approve")

    run = await app.start(approval)
    await eventually(lambda: waiting_for_signal(app, run.run_id), what="run waiting")
    await run.signal("approve", {"by": "alice", "ok": True})
    assert await run.result(timeout=10) == {"by": "alice", "ok": True}


async def test_wait_event_timeout_returns_none(app: tether.App, worker: tether.Worker) -> None:
    @app.workflow
    async def impatient() -> str:
        got = await tether.wait_event("never", timeout=0.2)
        return "timed out" if got is None else f"got {got}"

    t0 = time.monotonic()
    run = await app.start(impatient)
    assert await run.result(timeout=10) == "timed out"
    assert time.monotonic() - t0 >= 0.2
    assert EventType.TIMER_FIRED in await event_types(app, run.run_id)


async def test_wait_event_signal_before_timeout_wins_and_cancels_timer(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def patient() -> Any:
        return await tether.wait_event("answer", timeout=30)

    run = await app.start(patient)
    await eventually(lambda: waiting_for_signal(app, run.run_id), what="run waiting")
    t0 = time.monotonic()
    await app.signal(run.run_id, "answer", 42)
    assert await run.result(timeout=10) == 42
    assert time.monotonic() - t0 < 10
    types = await event_types(app, run.run_id)
    assert EventType.TIMER_CANCELLED in types
    assert EventType.TIMER_FIRED not in types


async def test_wait_event_signal_after_timeout_is_buffered_for_next_wait(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def twice() -> list[Any]:
        first = await tether.wait_event("late", timeout=0.1)
        second = await tether.wait_event("late")
        return [first, second]

    run = await app.start(twice)

    async def timeout_seen_by_code() -> bool:
        # a signal in the same batch as the TimerFired would win the tie (documented),
        # so wait until a workflow task has consumed the timer
        events = await app.history(run.run_id)
        fired = [e.seq for e in events if e.type is EventType.TIMER_FIRED]
        return bool(fired) and any(
            e.type is EventType.WORKFLOW_TASK_COMPLETED and e.seq > fired[0] for e in events
        )

    await eventually(timeout_seen_by_code, what="first wait timed out")
    await app.signal(run.run_id, "late", "hello")
    assert await run.result(timeout=10) == [None, "hello"]


async def test_signals_sent_before_start_of_worker_are_buffered_in_order(
    app: tether.App,
) -> None:
    @app.workflow
    async def inbox(n: int) -> list[Any]:
        return [await tether.wait_event("item") for _ in range(n)]

    run = await app.start(inbox, 3)
    # no worker yet: the signals are buffered in the store before the code ever runs
    for payload in ("one", "two", "three"):
        await app.signal(run.run_id, "item", payload)
    async with app.worker(lease=5.0, poll_interval=0.05):
        assert await run.result(timeout=10) == ["one", "two", "three"]


async def test_signals_sent_before_wait_buffered_and_delivered_in_order(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def inbox() -> dict[str, list[Any]]:
        await tether.wait_event("go")
        items = [await tether.wait_event("item") for _ in range(4)]
        other = [await tether.wait_event("other") for _ in range(2)]
        return {"items": items, "other": other}

    run = await app.start(inbox)
    await eventually(lambda: waiting_for_signal(app, run.run_id), what="run waiting for go")
    # interleave two names while the run waits for something else
    await app.signal(run.run_id, "item", 1)
    await app.signal(run.run_id, "other", "x")
    await app.signal(run.run_id, "item", 2)
    await app.signal(run.run_id, "item", {"three": 3})
    await app.signal(run.run_id, "other", "y")
    await app.signal(run.run_id, "item", [4])
    await app.signal(run.run_id, "go")
    assert await run.result(timeout=10) == {
        "items": [1, 2, {"three": 3}, [4]],
        "other": ["x", "y"],
    }


async def test_signals_several_while_waiting_each_delivered_once_in_order(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.activity
    def echo(x: int) -> int:
        return x

    @app.workflow
    async def consumer(n: int) -> list[int]:
        got: list[int] = []
        for _ in range(n):
            got.append(await echo(await tether.wait_event("n")))
        return got

    run = await app.start(consumer, 10)
    await eventually(lambda: waiting_for_signal(app, run.run_id), what="run waiting")
    for i in range(10):
        await app.signal(run.run_id, "n", i)
    assert await run.result(timeout=15) == list(range(10))


# -- continue-as-new -------------------------------------------------------------------------


async def test_continue_as_new_chain_follows_to_final_run(
    app: tether.App, worker: tether.Worker
) -> None:
    seen: list[int] = []

    @app.activity
    def record(n: int) -> None:
        seen.append(n)

    @app.workflow
    async def countdown(n: int, acc: int) -> int:
        await record(n)
        if n == 0:
            return acc
        tether.continue_as_new(n - 1, acc + n)
        raise AssertionError("continue_as_new returned")

    run = await app.start(countdown, 3, 0, run_id="cd")
    assert await run.result(timeout=15) == 6
    assert seen == [3, 2, 1, 0]
    chain = ["cd", "cd~1", "cd~2", "cd~3"]
    for rid, nxt in itertools.pairwise(chain):
        info = await app.get(rid, follow=False)
        assert info.status is RunStatus.CONTINUED_AS_NEW
        assert info.continued_to == nxt
        with pytest.raises(tether.RunFinishedError):
            await app.signal(rid, "anything")
    final = await app.get("cd")  # the chain answers to its first id with its latest run
    assert final.run_id == "cd~3" and final.status is RunStatus.COMPLETED
    # every run in the chain has a fresh history: one start, one step
    for rid in chain:
        types = [e.type for e in await app.history(rid, follow=False)]
        assert types[0] is EventType.WORKFLOW_STARTED
        assert types.count(EventType.ACTIVITY_SCHEDULED) == 1
    # a handle on a middle link also follows to the end
    assert await app.get_run("cd~1").result(timeout=5) == 6


async def test_continue_as_new_not_swallowed_by_except_exception(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def stubborn(n: int) -> int:
        if n >= 2:
            return n
        try:
            tether.continue_as_new(n + 1)
        except Exception:
            return -1
        return -2

    run = await app.start(stubborn, 0)
    assert await run.result(timeout=10) == 2


# -- set_status --------------------------------------------------------------------------------


async def test_set_status_visible_via_get_while_running_and_after(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def progress() -> str:
        tether.set_status({"phase": "waiting", "done": 0})
        await tether.wait_event("go")
        tether.set_status({"phase": "finished", "done": 1})
        return "ok"

    run = await app.start(progress)

    async def status_is_waiting() -> bool:
        return (await app.get(run.run_id)).custom_status == {"phase": "waiting", "done": 0}

    await eventually(status_is_waiting, what="first custom status")
    assert (await app.get(run.run_id)).status is RunStatus.RUNNING
    await app.signal(run.run_id, "go")
    assert await run.result(timeout=10) == "ok"
    assert (await app.get(run.run_id)).custom_status == {"phase": "finished", "done": 1}


async def test_set_status_unserialisable_fails_run(app: tether.App, worker: tether.Worker) -> None:
    @app.workflow
    async def bad_status() -> str:
        tether.set_status(object())
        return "unreachable"

    run = await app.start(bad_status)
    with pytest.raises(tether.WorkflowFailedError) as ei:
        await run.result(timeout=10)
    assert "PayloadError" in (ei.value.error or "")


# -- deterministic values --------------------------------------------------------------------


async def test_deterministic_uuid_random_now_stable_across_replay_in_fresh_worker(
    app: tether.App,
) -> None:
    recorded: list[tuple[str, float, str]] = []

    @app.activity
    def remember(u: str, r: float, n: str) -> None:
        recorded.append((u, r, n))

    @app.workflow
    async def dice() -> dict[str, Any]:
        u = tether.uuid()
        r = tether.random()
        n = tether.now()
        await remember(str(u), r, n.isoformat())
        await tether.wait_event("go")
        return {"uuid": str(u), "random": r, "now": n.isoformat(), "u2": str(tether.uuid())}

    w1 = app.worker(lease=5.0, poll_interval=0.05)
    await w1.start()
    try:
        run = await app.start(dice, run_id="dice-1")
        await eventually(lambda: asyncio.sleep(0, result=bool(recorded)), what="remember ran")
        await eventually(
            lambda: has_event(app, run.run_id, EventType.ACTIVITY_COMPLETED), what="step done"
        )
    finally:
        await w1.stop(grace=2.0)

    w2 = app.worker(lease=5.0, poll_interval=0.05)
    await w2.start()
    try:
        await app.signal(run.run_id, "go")
        out = await run.result(timeout=10)
        assert w2.stats["replays"] >= 1  # the fresh worker rebuilt the run from history
    finally:
        await w2.stop(grace=2.0)

    assert len(recorded) == 1  # the recorded step was not re-executed
    u, r, n = recorded[0]
    assert out["uuid"] == u
    assert out["random"] == r
    assert out["now"] == n
    assert uuid_mod.UUID(u).version == 4
    assert 0.0 <= r < 1.0
    assert datetime.fromisoformat(n).tzinfo is not None
    assert out["u2"] != u


async def test_deterministic_values_differ_between_runs(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def roll() -> list[Any]:
        return [str(tether.uuid()), tether.random()]

    a = await app.start(roll, run_id="roll-a")
    b = await app.start(roll, run_id="roll-b")
    ra, rb = await a.result(timeout=10), await b.result(timeout=10)
    assert ra[0] != rb[0]
    assert ra[1] != rb[1]
