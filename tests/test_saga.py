"""Sagas: undo exactly the completed steps, newest first; failing undos need an operator;
a crash mid-compensation still finishes the rollback."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import tether
from helpers import eventually
from tether import EventType, RunStatus
from tether._history import Event
from tether.testing import check_history

HERE = Path(__file__).parent


ONCE = tether.Retry(attempts=1)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
async def test_saga_failure_at_step_k_undoes_completed_steps_in_reverse(
    app: tether.App, worker: tether.Worker, k: int
) -> None:
    done: list[int] = []
    undone: list[int] = []

    @app.activity(retry=ONCE)
    def do(i: int, fail_at: int) -> int:
        if i == fail_at:
            raise tether.NonRetryable(f"step {i} failed")
        done.append(i)
        return i

    @app.activity
    def undo(i: int) -> None:
        undone.append(i)

    @app.workflow
    async def four(fail_at: int) -> str:
        async with tether.saga() as saga:
            for i in range(1, 5):
                await saga.step(do(i, fail_at), undo=undo)
        return "all done"

    run = await app.start(four, k)
    with pytest.raises(tether.WorkflowFailedError) as ei:
        await run.result(timeout=10)
    assert ei.value.status == "failed"
    assert f"step {k} failed" in (ei.value.error or "")
    assert done == list(range(1, k))
    assert undone == list(range(k - 1, 0, -1))
    # the undos are recorded steps too: one ActivityScheduled('undo') per completed step
    scheduled = [
        e.data["name"]
        for e in await app.history(run.run_id)
        if e.type is EventType.ACTIVITY_SCHEDULED
    ]
    assert scheduled == ["do"] * k + ["undo"] * (k - 1)


async def test_saga_success_runs_no_undo(app: tether.App, worker: tether.Worker) -> None:
    undone: list[int] = []

    @app.activity
    def do(i: int) -> int:
        return i * 10

    @app.activity
    def undo(i: int) -> None:
        undone.append(i)

    @app.workflow
    async def ok() -> list[int]:
        async with tether.saga() as saga:
            return [await saga.step(do(i), undo=undo) for i in range(3)]

    run = await app.start(ok)
    assert await run.result(timeout=10) == [0, 10, 20]
    assert undone == []


async def test_saga_failing_undo_needs_intervention_other_undos_run_alert_once(
    app: tether.App, worker: tether.Worker
) -> None:
    undone: list[str] = []
    alerts: list[tuple[str, dict[str, Any]]] = []
    app.on_alert = lambda run_id, error: alerts.append((run_id, error))

    @app.activity(retry=ONCE)
    def do(name: str) -> str:
        if name == "ship":
            raise tether.NonRetryable("warehouse on fire")
        return name

    @app.activity(retry=ONCE)
    def undo(name: str) -> None:
        if name == "charge":
            raise tether.NonRetryable("refund API rejected the refund")
        undone.append(name)

    @app.workflow
    async def order() -> str:
        async with tether.saga() as saga:
            for name in ("reserve", "charge", "invoice", "ship"):
                await saga.step(do(name), undo=undo)
        return "shipped"

    run = await app.start(order)
    with pytest.raises(tether.RunNeedsInterventionError) as ei:
        await run.result(timeout=10)
    assert ei.value.status == "needs_intervention"
    assert undone == ["invoice", "reserve"]  # the failing undo did not stop the others
    info = await app.get(run.run_id)
    assert info.status is RunStatus.NEEDS_INTERVENTION
    assert info.error is not None
    assert info.error["type"] == "CompensationFailed"
    assert "warehouse on fire" in info.error["message"]
    assert "refund API rejected the refund" in info.error["message"]
    await asyncio.gather(*app._alerts)  # the hook runs in a thread: it has returned
    await asyncio.sleep(0.2)  # a second alert would have arrived by now
    assert len(alerts) == 1
    assert alerts[0][0] == run.run_id
    assert "refund API rejected the refund" in alerts[0][1]["message"]
    letters = await app.dead_letters(run_id=run.run_id)
    assert {(d.kind, d.reason) for d in letters if d.kind == "run"} == {
        ("run", "needs_intervention")
    }


async def test_saga_undo_receives_step_result_and_add_undo_runs_without_args(
    app: tether.App, worker: tether.Worker
) -> None:
    calls: list[Any] = []

    @app.activity
    def reserve(seat: str) -> dict[str, str]:
        return {"hold": f"H-{seat}"}

    @app.activity
    def release(hold: dict[str, str]) -> None:
        calls.append(hold)

    @app.activity
    def notify() -> None:
        calls.append("notified")

    @app.activity(retry=ONCE)
    def pay() -> None:
        raise tether.NonRetryable("card declined")

    @app.workflow
    async def trip() -> None:
        async with tether.saga() as saga:
            saga.add_undo(notify)
            await saga.step(reserve("12A"), undo=release)
            await pay()

    run = await app.start(trip)
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    assert calls == [{"hold": "H-12A"}, "notified"]


# -- a crash during compensation ---------------------------------------------------------------


def spawn_worker(store_url: str, effects: Path, lease: float, log: Path) -> subprocess.Popen[bytes]:
    """A worker process running ``tests/failure_app.py`` (stderr to ``log``)."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    with log.open("ab") as err:
        return subprocess.Popen(
            [sys.executable, str(HERE / "failure_app.py"), store_url, str(effects), str(lease)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def query(effects: Path, sql: str) -> list[tuple[Any, ...]]:
    if not effects.exists():
        return []
    conn = sqlite3.connect(effects, timeout=30)
    try:
        return conn.execute(sql).fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        conn.close()


async def test_saga_worker_killed_mid_compensation_finishes_rollback_after_restart(
    app: tether.App, store_url: str, tmp_path: Path
) -> None:
    effects, log = tmp_path / "effects.db", tmp_path / "workers.log"

    @app.workflow(name="saga_flow")
    async def saga_flow() -> str:
        raise AssertionError("runs in the worker processes only")

    run = await app.start(saga_flow)
    first = spawn_worker(store_url, effects, 1.0, log)
    second: subprocess.Popen[bytes] | None = None
    try:

        async def undo_c_started() -> bool:
            return bool(query(effects, "SELECT 1 FROM effects WHERE kind = 'undo' AND name = 'c'"))

        await eventually(undo_c_started, timeout=20, what="undo of c running")
        first.kill()  # SIGKILL while the undo of c sleeps
        first.wait(10)
        assert first.returncode == -signal.SIGKILL
        assert query(effects, "SELECT name FROM applied") == []  # killed before applying it
        second = spawn_worker(store_url, effects, 1.0, log)
        with pytest.raises(tether.WorkflowFailedError) as ei:
            await run.result(timeout=20)
        assert ei.value.status == "failed"
        assert "payment declined" in (ei.value.error or "")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    # every undo applied exactly once, newest first, each under its own idempotency key
    applied = query(effects, "SELECT name, key FROM applied ORDER BY seq")
    assert [name for name, _ in applied] == ["c", "b", "a"]
    assert len({key for _, key in applied}) == 3
    # the undo of c ran twice (killed, then redone with the same key); the others once
    runs = dict(
        query(effects, "SELECT name, count(*) FROM effects WHERE kind = 'undo' GROUP BY name")
    )
    assert runs == {"a": 1, "b": 1, "c": 2}
    keys_c = query(effects, "SELECT DISTINCT key FROM effects WHERE kind = 'undo' AND name = 'c'")
    assert len(keys_c) == 1
    # the forward steps recorded before the crash never ran again
    booked = query(effects, "SELECT name, count(*) FROM effects WHERE kind = 'book' GROUP BY name")
    assert dict(booked) == {"a": 1, "b": 1, "c": 1}
    completed_undos = [
        e
        for e in await app.history(run.run_id)
        if e.type is EventType.ACTIVITY_COMPLETED and e.step is not None and e.step > 4
    ]
    assert len(completed_undos) == 3


async def test_saga_retry_after_fixing_undo_finishes_rollback_without_repeating_undos(
    app: tether.App, worker: tether.Worker
) -> None:
    undo_runs: list[str] = []
    refund_api = {"up": False}

    @app.activity(retry=ONCE)
    def do(name: str) -> str:
        if name == "ship":
            raise tether.NonRetryable("warehouse on fire")
        return name

    @app.activity(retry=ONCE)
    def undo(name: str) -> None:
        undo_runs.append(name)
        if name == "charge" and not refund_api["up"]:
            raise tether.NonRetryable("refund API down")

    @app.workflow
    async def order() -> str:
        async with tether.saga() as saga:
            for name in ("reserve", "charge", "invoice", "ship"):
                await saga.step(do(name), undo=undo)
        return "shipped"

    run = await app.start(order)
    with pytest.raises(tether.RunNeedsInterventionError):
        await run.result(timeout=10)
    assert undo_runs == ["invoice", "charge", "reserve"]

    refund_api["up"] = True  # the operator fixed the refund API
    await app.retry(run.run_id)
    with pytest.raises(tether.WorkflowFailedError) as ei:
        await run.result(timeout=10)
    # the rollback is complete, so the run ends with the original failure
    assert ei.value.status == "failed"
    assert "warehouse on fire" in (ei.value.error or "")
    # only the failed undo ran again: the successful ones are recorded outcomes
    assert undo_runs == ["invoice", "charge", "reserve", "charge"]


def _rollback_app(app: tether.App) -> tuple[list[str], list[tuple[str, bool]], asyncio.Event]:
    """``book(n)``: a saga that reserves r0..r(n-1), then sleeps; each undo waits for the
    returned gate, then reports whether it was told to stop (heartbeat)."""
    started: list[str] = []
    undone: list[tuple[str, bool]] = []
    gate = asyncio.Event()

    @app.activity
    async def reserve(x: str) -> str:
        return x

    @app.activity(retry=ONCE)
    async def undo(x: str) -> None:
        started.append(x)
        await gate.wait()
        ctx = tether.activity_context()
        ctx.heartbeat()  # a cancel request flagged on this task would answer True here
        await asyncio.sleep(0.1)
        undone.append((x, ctx.is_cancelled))

    @app.workflow
    async def book(n: int) -> str:
        async with tether.saga() as saga:
            for i in range(n):
                await saga.step(reserve(f"r{i}"), undo=undo)
            await tether.sleep(100)
        return "ok"

    return started, undone, gate


@pytest.mark.parametrize("order", ["cancel-cancel", "cancel-deadline", "deadline-cancel"])
async def test_saga_second_cancel_or_deadline_during_rollback_lets_every_undo_run(
    app: tether.App, worker: tether.Worker, order: str
) -> None:
    started, undone, gate = _rollback_app(app)
    first, second = order.split("-")
    deadline = {"cancel-deadline": 1.0, "deadline-cancel": 0.5}.get(order)
    run = await app.start(app.get_workflow("book"), 3, deadline=deadline)

    async def has(type_: EventType) -> bool:
        return any(e.type is type_ for e in await app.history(run.run_id))

    await eventually(lambda: has(EventType.TIMER_STARTED), what="the saga's sleep")
    if first == "cancel":
        await app.cancel(run.run_id, "first click")

    async def rolling_back() -> bool:
        return bool(started)

    await eventually(rolling_back, what="the first undo running")
    if second == "cancel":
        await app.cancel(run.run_id, "second click")
        await eventually(
            lambda: _count_events(
                app, run.run_id, EventType.CANCEL_REQUESTED, 2 if first == "cancel" else 1
            ),
            what="the second cancel recorded",
        )
    else:
        await eventually(lambda: has(EventType.DEADLINE_EXCEEDED), what="the deadline")
    gate.set()
    # the first interruption decides how the run ends; the second is recorded, no more
    expected = tether.RunCancelledError if first == "cancel" else tether.RunTimedOutError
    with pytest.raises(expected):
        await run.result(timeout=10)
    # every undo ran, newest first, none of them told to stop
    assert undone == [("r2", False), ("r1", False), ("r0", False)]
    history = await app.history(run.run_id)
    assert EventType.ACTIVITY_CANCEL_REQUESTED not in [e.type for e in history]
    assert check_history(app, history).ok  # the new decision replays as recorded


def _failing_trip(app: tether.App) -> tuple[list[str], list[tuple[str, bool]], asyncio.Event]:
    """``trip(n)``: a saga that holds r0..r(n-1), then fails; each undo (``release``)
    waits for the returned gate, then reports whether it was told to stop."""
    started: list[str] = []
    undone: list[tuple[str, bool]] = []
    gate = asyncio.Event()

    @app.activity
    async def hold(x: str) -> str:
        return x

    @app.activity(retry=ONCE)
    async def overbook(n: int) -> None:
        raise RuntimeError("no seats left")

    @app.activity(retry=ONCE)
    async def release(x: str) -> None:
        started.append(x)
        await gate.wait()
        ctx = tether.activity_context()
        ctx.heartbeat()
        await asyncio.sleep(0.1)
        undone.append((x, ctx.is_cancelled))

    @app.workflow
    async def trip(n: int) -> str:
        async with tether.saga() as saga:
            for i in range(n):
                await saga.step(hold(f"r{i}"), undo=release)
            await overbook(n)
        return "ok"

    return started, undone, gate


async def test_saga_a_cancel_during_a_rollback_after_a_failure_lets_every_undo_run(
    app: tether.App, worker: tether.Worker
) -> None:
    """A step fails, the rollback begins, and an operator cancels the run meanwhile:
    before, the cancel cut the undo in flight (its activity told to stop) and the older
    undos never ran; now the rollback finishes, newest first, and the run ends
    cancelled."""
    started, undone, gate = _failing_trip(app)
    run = await app.start(app.get_workflow("trip"), 3)

    async def rolling_back() -> bool:
        return bool(started)

    await eventually(rolling_back, what="the first undo running")
    await app.cancel(run.run_id, "operator gave up")
    await eventually(
        lambda: _count_events(app, run.run_id, EventType.CANCEL_REQUESTED, 1),
        what="the cancel recorded",
    )
    gate.set()
    with pytest.raises(tether.RunCancelledError):
        await run.result(timeout=10)
    # every undo ran to its end, newest first; the one in flight when the cancel came
    # was flagged by it (is_cancelled: a cancel flags every running step at once), the
    # code did not cancel it
    assert [x for x, _ in undone] == ["r2", "r1", "r0"]
    assert [told for _, told in undone] == [True, False, False]
    history = await app.history(run.run_id)
    assert EventType.ACTIVITY_CANCEL_REQUESTED not in [e.type for e in history]
    assert check_history(app, history).ok


#: a history written before a rollback went on through a cancel: the cancel stopped the
#: undo of r1 (ActivityCancelRequested) and r0 was never undone
_OLD_CUT_ROLLBACK: list[tuple[str, int | None, dict[str, Any]]] = [
    ("WorkflowStarted", None, {"workflow": "trip", "input": {"args": [2], "kwargs": {}}}),
    ("ActivityScheduled", 1, {"name": "hold", "queue": "default"}),
    ("WorkflowTaskCompleted", None, {"through": 1, "time": 10.0}),
    ("ActivityCompleted", 1, {"attempt": 1, "result": "r0"}),
    ("ActivityScheduled", 2, {"name": "hold", "queue": "default"}),
    ("WorkflowTaskCompleted", None, {"through": 4, "time": 10.1}),
    ("ActivityCompleted", 2, {"attempt": 1, "result": "r1"}),
    ("ActivityScheduled", 3, {"name": "overbook", "queue": "default"}),
    ("WorkflowTaskCompleted", None, {"through": 7, "time": 10.2}),
    (
        "ActivityFailed",
        3,
        {
            "attempt": 1,
            "error": {"type": "RuntimeError", "message": "no seats left", "retryable": False},
        },
    ),
    ("ActivityScheduled", 4, {"name": "release", "queue": "default"}),
    ("WorkflowTaskCompleted", None, {"through": 10, "time": 10.3}),
    ("CancelRequested", None, {"reason": "gave up"}),
    ("ActivityCancelRequested", 5, {"activity_step": 4}),
    ("WorkflowCancelled", 6, {"error": None}),
    ("WorkflowTaskCompleted", None, {"through": 13, "time": 10.4}),
]


async def test_saga_history_of_an_old_cut_rollback_replays_as_recorded(db_path: Path) -> None:
    app = tether.App(store=f"sqlite:///{db_path}")
    _failing_trip(app)
    history = [
        Event(run_id="old", seq=seq, type=EventType(t), step=step, data=data, created_at=10.0)
        for seq, (t, step, data) in enumerate(_OLD_CUT_ROLLBACK, start=1)
    ]
    report = check_history(app, history)
    assert report.ok, report.diff()


async def _count_events(app: tether.App, run_id: str, type_: EventType, n: int) -> bool:
    return sum(e.type is type_ for e in await app.history(run_id)) >= n


#: a history written before a repeated cancel stopped being delivered: the second
#: CancelRequested interrupted the undo of r1 and the run ended cancelled
_OLD_TWO_CANCELS: list[tuple[str, int | None, dict[str, Any]]] = [
    ("WorkflowStarted", None, {"workflow": "book", "input": {"args": [2], "kwargs": {}}}),
    ("ActivityScheduled", 1, {"name": "reserve", "queue": "default"}),
    ("WorkflowTaskCompleted", None, {"through": 1, "time": 10.0}),
    ("ActivityCompleted", 1, {"attempt": 1, "result": "r0"}),
    ("ActivityScheduled", 2, {"name": "reserve", "queue": "default"}),
    ("WorkflowTaskCompleted", None, {"through": 4, "time": 10.1}),
    ("ActivityCompleted", 2, {"attempt": 1, "result": "r1"}),
    ("TimerStarted", 3, {"fire_at": 110.2}),
    ("WorkflowTaskCompleted", None, {"through": 7, "time": 10.2}),
    ("CancelRequested", None, {"reason": "first"}),
    ("TimerCancelled", 4, {"timer_step": 3}),
    ("ActivityScheduled", 5, {"name": "undo", "queue": "default"}),
    ("WorkflowTaskCompleted", None, {"through": 10, "time": 10.3}),
    ("CancelRequested", None, {"reason": "second"}),
    ("ActivityCancelRequested", 6, {"activity_step": 5}),
    ("WorkflowCancelled", 7, {"error": None}),
    ("WorkflowTaskCompleted", None, {"through": 14, "time": 10.4}),
]


async def test_saga_history_of_an_old_second_cancel_replays_as_recorded(db_path: Path) -> None:
    app = tether.App(store=f"sqlite:///{db_path}")
    _rollback_app(app)
    history = [
        Event(
            run_id="old",
            seq=seq,
            type=EventType(type_),
            step=step,
            data=data,
            created_at=10.0 + seq / 100,
        )
        for seq, (type_, step, data) in enumerate(_OLD_TWO_CANCELS, start=1)
    ]
    report = check_history(app, history)
    assert report.ok, report.diff()


# -- a step still in flight when the block exits ----------------------------------------------


def _charging_app(app: tether.App) -> list[str]:
    """``book(x)``: a saga that reserves, then charges (a sync call of 1 s that does not
    look at ``is_cancelled``: the money moves anyway); returns the effects list."""
    effects: list[str] = []

    @app.activity(retry=ONCE)
    def reserve(x: str) -> str:
        effects.append("reserve")
        return "hold-" + x

    @app.activity(retry=ONCE)
    def release(h: str) -> None:
        effects.append("release")

    @app.activity(retry=ONCE)
    def charge(x: str) -> str:
        time.sleep(1.0)
        effects.append("charge")
        return "ch-" + x

    @app.activity(retry=ONCE)
    def refund(c: str) -> None:
        effects.append("refund")

    @app.workflow
    async def book(x: str) -> str:
        async with tether.saga() as s:
            h = await s.step(reserve(x), undo=release)
            c = await s.step(charge(x), undo=refund)
            return h + c

    return effects


@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_saga_cancel_or_deadline_during_a_step_waits_for_it_and_undoes_it(
    app: tether.App, worker: tether.Worker, how: str
) -> None:
    """Before, the step in flight was told to stop and forgotten: its charge went through
    and was never refunded (effects reserve, release, charge). Now the saga waits for it,
    then undoes it and the older steps, newest first, each once."""
    effects = _charging_app(app)
    book = app.get_workflow("book")
    run = await app.start(book, "a", deadline=0.5 if how == "deadline" else None)
    if how == "cancel":

        async def charging() -> bool:
            return any(
                e.type is EventType.ACTIVITY_SCHEDULED and e.data["name"] == "charge"
                for e in await app.history(run.run_id)
            )

        await eventually(charging, what="the charge running")
        await asyncio.sleep(0.3)
        await app.cancel(run.run_id, "gave up")
    expected = tether.RunCancelledError if how == "cancel" else tether.RunTimedOutError
    with pytest.raises(expected):
        await run.result(timeout=10)
    assert effects == ["reserve", "charge", "refund", "release"]
    history = await app.history(run.run_id)
    assert EventType.ACTIVITY_CANCEL_REQUESTED not in [e.type for e in history]
    assert check_history(app, history).ok


async def test_saga_gather_of_steps_one_failing_fast_undoes_every_completed_step_once(
    app: tether.App, worker: tether.Worker
) -> None:
    """Before, the hotel (still booking when the car failed) was booked and never undone."""
    effects: list[str] = []

    @app.activity(retry=ONCE)
    def book(what: str, secs: float, fail: bool) -> str:
        time.sleep(secs)
        if fail:
            raise tether.NonRetryable(f"{what} unavailable")
        effects.append(f"book {what}")
        return what

    @app.activity(retry=ONCE)
    def cancel_booking(what: str) -> None:
        effects.append(f"undo {what}")

    @app.workflow
    async def trip() -> list[str]:
        async with tether.saga() as s:
            return await tether.gather(
                s.step(book("flight", 0.1, False), undo=cancel_booking),
                s.step(book("hotel", 0.8, False), undo=cancel_booking),
                s.step(book("car", 0.3, True), undo=cancel_booking),
            )

    run = await app.start(trip)
    with pytest.raises(tether.WorkflowFailedError) as ei:
        await run.result(timeout=10)
    assert "car unavailable" in (ei.value.error or "")
    # undone newest first by completion: the hotel finished last
    assert sorted(effects[:2]) == ["book flight", "book hotel"]
    assert effects[2:] == ["undo hotel", "undo flight"]
    assert check_history(app, await app.history(run.run_id)).ok


async def test_saga_continue_as_new_inside_the_block_keeps_the_steps(
    app: tether.App, worker: tether.Worker
) -> None:
    """Before, continue_as_new counted as a failure: every run released what it reserved."""
    effects: list[str] = []

    @app.activity
    def reserve(i: int) -> int:
        effects.append(f"reserve{i}")
        return i

    @app.activity
    def release(i: int) -> None:
        effects.append(f"release{i}")

    @app.workflow
    async def batch(i: int) -> int:
        async with tether.saga() as s:
            await s.step(reserve(i), undo=release)
            if i < 2:
                tether.continue_as_new(i + 1)
            return i

    run = await app.start(batch, 0)
    assert await run.result(timeout=10) == 2
    assert effects == ["reserve0", "reserve1", "reserve2"]


async def test_saga_failing_undos_name_their_step(app: tether.App, worker: tether.Worker) -> None:
    """With one shared undo activity the failures read ``undo: ...`` twice: which step?"""

    @app.activity
    def do(i: int) -> int:
        return i

    @app.activity(retry=ONCE)
    def undo(i: int) -> None:
        raise tether.NonRetryable(f"cannot undo {i}")

    @app.activity(retry=ONCE)
    def boom() -> None:
        raise tether.NonRetryable("boom")

    @app.workflow
    async def two() -> None:
        async with tether.saga() as s:
            await s.step(do(1), undo=undo)
            await s.step(do(2), undo=undo)
            await boom()

    run = await app.start(two)
    with pytest.raises(tether.RunNeedsInterventionError):
        await run.result(timeout=10)
    info = await app.get(run.run_id)
    assert info.error is not None
    message = info.error["message"]
    assert "undo (step 2): ActivityError" in message
    assert "undo (step 1): ActivityError" in message


#: a history written before a saga waited for its steps in flight: the cancel told the
#: charge to stop (ActivityCancelRequested) and only the reservation was released
_OLD_FORGOTTEN_STEP: list[tuple[str, int | None, dict[str, Any]]] = [
    ("WorkflowStarted", None, {"workflow": "book", "input": {"args": ["a"], "kwargs": {}}}),
    ("ActivityScheduled", 1, {"name": "reserve", "queue": "default"}),
    ("WorkflowTaskCompleted", None, {"through": 1, "time": 10.0}),
    ("ActivityCompleted", 1, {"attempt": 1, "result": "hold-a"}),
    ("ActivityScheduled", 2, {"name": "charge", "queue": "default"}),
    ("WorkflowTaskCompleted", None, {"through": 4, "time": 10.1}),
    ("CancelRequested", None, {"reason": "gave up"}),
    ("ActivityCancelRequested", 3, {"activity_step": 2}),
    ("PatchMarker", 4, {"patch_id": "tether.saga-rollback-shielded"}),
    ("ActivityScheduled", 5, {"name": "release", "queue": "default"}),
    ("WorkflowTaskCompleted", None, {"through": 7, "time": 10.6}),
    ("ActivityCompleted", 5, {"attempt": 1, "result": None}),
    ("WorkflowCancelled", 6, {"error": None}),
    ("WorkflowTaskCompleted", None, {"through": 12, "time": 10.7}),
]


async def test_saga_history_of_an_old_forgotten_step_replays_as_recorded(db_path: Path) -> None:
    app = tether.App(store=f"sqlite:///{db_path}")
    _charging_app(app)
    history = [
        Event(run_id="old", seq=seq, type=EventType(t), step=step, data=data, created_at=10.0)
        for seq, (t, step, data) in enumerate(_OLD_FORGOTTEN_STEP, start=1)
    ]
    report = check_history(app, history)
    assert report.ok, report.diff()


def _batch_app(app: tether.App) -> None:
    """``batch(i)``: reserves ``i`` in a saga and continues as new inside the block."""

    @app.activity
    def reserve(i: int) -> int:
        return i

    @app.activity
    def release(i: int) -> None:
        return None

    @app.workflow
    async def batch(i: int) -> int:
        async with tether.saga() as s:
            await s.step(reserve(i), undo=release)
            if i < 2:
                tether.continue_as_new(i + 1)
            return i


#: a history written before continue_as_new kept a saga's steps: the undo ran first
_OLD_CONTINUE_IN_SAGA: list[tuple[str, int | None, dict[str, Any]]] = [
    ("WorkflowStarted", None, {"workflow": "batch", "input": {"args": [0], "kwargs": {}}}),
    ("ActivityScheduled", 1, {"name": "reserve", "queue": "default"}),
    ("WorkflowTaskCompleted", None, {"through": 1, "time": 10.0}),
    ("ActivityCompleted", 1, {"attempt": 1, "result": 0}),
    ("PatchMarker", 2, {"patch_id": "tether.saga-rollback-shielded"}),
    ("ActivityScheduled", 3, {"name": "release", "queue": "default"}),
    ("WorkflowTaskCompleted", None, {"through": 4, "time": 10.1}),
    ("ActivityCompleted", 3, {"attempt": 1, "result": None}),
    ("ContinuedAsNew", 4, {"next_run_id": "old-2"}),
    ("WorkflowTaskCompleted", None, {"through": 8, "time": 10.2}),
]


async def test_saga_history_of_an_old_continue_in_a_saga_replays_as_recorded(
    db_path: Path,
) -> None:
    app = tether.App(store=f"sqlite:///{db_path}")
    _batch_app(app)
    history = [
        Event(run_id="old", seq=seq, type=EventType(t), step=step, data=data, created_at=10.0)
        for seq, (t, step, data) in enumerate(_OLD_CONTINUE_IN_SAGA, start=1)
    ]
    report = check_history(app, history)
    assert report.ok, report.diff()


async def test_worker_warns_when_it_discards_a_result_because_the_run_ended(
    app: tether.App, worker: tether.Worker, caplog: pytest.LogCaptureFixture
) -> None:
    """A step outside a saga, cancelled while its sync call runs: the call finishes, its
    result is refused. Before, only the tether_lease_lost counter said so."""
    finished: list[str] = []

    @app.activity(retry=ONCE)
    def charge(x: str) -> str:
        time.sleep(0.8)
        finished.append(x)
        return x

    @app.workflow
    async def pay(x: str) -> str:
        return await charge(x)

    run = await app.start(pay, "card-1")

    async def charging() -> bool:
        return any(e.type is EventType.ACTIVITY_SCHEDULED for e in await app.history(run.run_id))

    await eventually(charging, what="the charge scheduled")
    await asyncio.sleep(0.2)
    await app.cancel(run.run_id, "gave up")
    with pytest.raises(tether.RunCancelledError):
        await run.result(timeout=10)
    await eventually(lambda: _true(bool(finished)), what="the charge finished")

    async def warned() -> bool:
        return any(
            r.levelname == "WARNING" and "was discarded" in r.getMessage() for r in caplog.records
        )

    await eventually(warned, what="the warning")
    line = next(r.getMessage() for r in caplog.records if "was discarded" in r.getMessage())
    assert "'charge'" in line and run.run_id in line and "cancelled" in line


async def _true(value: bool) -> bool:
    return value


async def test_saga_steps_settled_at_the_exit_keep_their_names() -> None:
    """A step the block's exit waited for (its own await cancelled) is undone under the
    name it was given."""
    loop = asyncio.get_running_loop()
    slow: asyncio.Future[str] = loop.create_future()
    undone: list[str] = []
    saga = tether.saga()

    async def undo(value: str) -> None:
        undone.append(value)

    async def block() -> None:
        async with saga:
            await saga.step(slow, undo=undo, name="cancel the hotel")

    task = asyncio.ensure_future(block())
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()  # the exit waits for the step in flight
    slow.set_result("hotel")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert undone == ["hotel"]
    assert saga.compensated == ["cancel the hotel (step 1)"]


@pytest.mark.parametrize("kind", ["child", "timer", "signal"])
async def test_saga_cancel_during_a_child_timer_or_signal_step_ends_the_run_at_once(
    app: tether.App, worker: tether.Worker, kind: str
) -> None:
    """Only an activity step in flight is waited for. Before, a child run, a timer or a
    signal wait with an undo was waited for too: a child is cancelled only when its
    parent ends, so a cancelled parent hung (still running 5 s after the cancel)."""
    undone: list[str] = []

    @app.activity(retry=ONCE)
    def undo_it(x: object) -> None:
        undone.append(str(x))

    @app.workflow
    async def slow_child() -> str:
        await tether.sleep(3600)
        return "done"

    @app.workflow
    async def parent() -> object:
        async with tether.saga() as s:
            if kind == "child":
                return await s.step(slow_child(), undo=undo_it)
            if kind == "timer":
                return await s.step(tether.sleep(3600), undo=undo_it)
            return await s.step(tether.wait_event("go"), undo=undo_it)

    run = await app.start(parent)

    async def waiting() -> bool:
        return bool(
            [
                e
                for e in await app.history(run.run_id)
                if e.type in (EventType.CHILD_STARTED, EventType.TIMER_STARTED)
                or (kind == "signal" and e.type is EventType.WORKFLOW_STARTED)
            ]
        )

    await eventually(waiting, what="the step waiting")
    await asyncio.sleep(0.3)
    await app.cancel(run.run_id, "stop")
    with pytest.raises(tether.RunCancelledError):
        await run.result(timeout=5)
    assert undone == []
    assert check_history(app, await app.history(run.run_id)).ok


async def test_saga_steps_raced_by_first_the_loser_is_told_to_stop(
    app: tether.App, worker: tether.Worker
) -> None:
    """A cancel aimed at the step itself reaches its activity. Before, ``first``'s loser
    ran on (it was waited for at the exit: 3 s instead of 0.2 s) and both were booked."""
    effects: list[str] = []

    @app.activity(retry=ONCE)
    async def book(what: str, secs: float) -> str:
        await asyncio.sleep(secs)
        effects.append("booked " + what)
        return what

    @app.activity(retry=ONCE)
    def unbook(what: str) -> None:
        effects.append("undo " + what)

    @app.workflow
    async def race() -> str:
        async with tether.saga() as s:
            won: str = await tether.first(
                s.step(book("fast", 0.2), undo=unbook), s.step(book("slow", 3.0), undo=unbook)
            )
            return won

    started = time.monotonic()
    run = await app.start(race)
    assert await run.result(timeout=10) == "fast"
    assert time.monotonic() - started < 2.5
    history = await app.history(run.run_id)
    assert EventType.ACTIVITY_CANCEL_REQUESTED in [e.type for e in history]
    await asyncio.sleep(3.2)  # the slow booking would have finished by now
    assert effects == ["booked fast"]
    assert check_history(app, history).ok
