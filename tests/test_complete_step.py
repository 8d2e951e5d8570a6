"""``app.complete_step``: an operator records an in-doubt step's result without running
it (the in-doubt protocol, docs/failure-handling.md section 5), on both stores."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from pathlib import Path

import pytest

import tether
from helpers import eventually
from tether import EventType, RunStatus
from tether._history import Task
from tether.testing import check_history


def fast(attempts: int) -> tether.Retry:
    return tether.Retry(attempts=attempts, initial=0.01, max_interval=0.02, jitter=0)


async def test_a_failed_run_is_reopened_and_finishes_with_the_result_without_running_the_step(
    app: tether.App, worker: tether.Worker
) -> None:
    ran: collections.Counter[str] = collections.Counter()

    @app.activity(retry=fast(3))
    def reserve(order: str) -> str:
        ran["reserve"] += 1
        return f"hold-{order}"

    @app.activity(retry=fast(3))
    def charge(order: str, cents: int) -> str:
        ran["charge"] += 1
        raise TimeoutError("provider timed out")  # in doubt: it may have charged

    @app.activity(retry=fast(3))
    def ship(hold: str, charge_id: str) -> str:
        ran["ship"] += 1
        return f"shipped {hold} paid by {charge_id}"

    @app.workflow
    async def order(order_id: str) -> str:
        hold = await reserve(order_id)
        charge_id = await charge(order_id, 1800)
        return await ship(hold, charge_id)

    run = await app.start(order, "o-7")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    assert ran == {"reserve": 1, "charge": 3}

    # the operator asked the provider by the step's key: the charge went through
    reopened = await app.complete_step(
        run.run_id, 2, "ch_o-7", reason="charge found at the provider", by="ann"
    )
    assert reopened.run_id == run.run_id
    assert await reopened.result(timeout=10) == "shipped hold-o-7 paid by ch_o-7"
    assert ran == {"reserve": 1, "charge": 3, "ship": 1}  # charge did not run again

    events = await app.history(run.run_id)
    done = [e for e in events if e.type is EventType.ACTIVITY_COMPLETED and e.step == 2]
    assert len(done) == 1
    assert done[0].data["result"] == "ch_o-7"
    assert done[0].data["operator"] == "ann"
    assert done[0].data["reason"] == "charge found at the provider"
    assert [e.type for e in events].count(EventType.RUN_RETRIED) == 1
    letters = await app.dead_letters(run_id=run.run_id, include_resolved=True)
    by_kind = {d.kind: d for d in letters}
    assert by_kind["activity"].resolution == {
        "state": "completed",
        "by": "ann",
        "reason": "charge found at the provider",
    }
    assert by_kind["run"].resolution == {"state": "retried"}
    assert await app.dead_letters(run_id=run.run_id) == []
    trail = await app.audit(run.run_id)
    assert [(e["actor"], e["action"], e["detail"]) for e in trail[1:]] == [
        (
            "ann",
            "complete step",
            {
                "step": 2,
                "activity": "charge",
                "reason": "charge found at the provider",
                "reopened": True,
            },
        )
    ]
    with pytest.raises(tether.RecoveryError, match="already completed by ann"):
        await app.complete_step(run.run_id, 2, "ch_other", reason="again")
    # the history, operator's result included, replays with the code as recorded
    report = check_history(app, events)
    assert report.ok, (report.error, report.diff())


async def test_a_step_waiting_for_its_next_retry_takes_the_result_and_never_runs_again(
    app: tether.App, worker: tether.Worker
) -> None:
    ran: collections.Counter[str] = collections.Counter()

    @app.activity(retry=tether.Retry(attempts=5, initial=60, jitter=0))
    def send(to: str) -> dict[str, str]:
        ran["send"] += 1
        raise ConnectionError("reset by peer")

    @app.workflow
    async def notify(to: str) -> str:
        receipt = await send(to)
        return f"sent as {receipt['message_id']}"

    run = await app.start(notify, "bob")

    async def backing_off() -> bool:
        return any(
            e.type is EventType.ACTIVITY_ATTEMPT_FAILED for e in await app.history(run.run_id)
        )

    await eventually(backing_off)
    await app.complete_step(run.run_id, 1, {"message_id": "m-1"}, reason="in the outbox")
    assert await run.result(timeout=10) == "sent as m-1"
    assert ran == {"send": 1}
    await asyncio.sleep(0.3)
    assert ran == {"send": 1}
    types = [e.type for e in await app.history(run.run_id)]
    assert types.count(EventType.ACTIVITY_COMPLETED) == 1
    assert EventType.RUN_RETRIED not in types
    (entry,) = [e for e in await app.audit(run.run_id) if e["action"] == "complete step"]
    assert entry["actor"] == "app" and entry["detail"]["reopened"] is False
    report = check_history(app, await app.history(run.run_id))
    assert report.ok, (report.error, report.diff())


async def test_refusals_name_the_reason_and_record_nothing(
    app: tether.App, worker: tether.Worker
) -> None:
    started = threading.Event()
    release = threading.Event()

    @app.activity
    def quick(x: int) -> int:
        return x + 1

    @app.activity
    def busy(x: int) -> int:
        started.set()
        release.wait(10)
        return x * 10

    @app.workflow
    async def flow(x: int) -> int:
        a = await quick(x)
        await tether.sleep(0.01)
        return await busy(a)

    run = await app.start(flow, 1)
    await asyncio.to_thread(started.wait, 10)
    with pytest.raises(tether.RecoveryError, match="already completed on attempt 1"):
        await app.complete_step(run.run_id, 1, 5, reason="x")
    with pytest.raises(tether.RecoveryError, match="not an activity"):
        await app.complete_step(run.run_id, 2, 5, reason="x")
    with pytest.raises(tether.RecoveryError, match="is running now"):
        await app.complete_step(run.run_id, 3, 5, reason="x")
    with pytest.raises(tether.RecoveryError, match="has no step 9"):
        await app.complete_step(run.run_id, 9, 5, reason="x")
    with pytest.raises(tether.PayloadError, match="result of step 3"):
        await app.complete_step(run.run_id, 3, "not a number", reason="x")
    with pytest.raises(tether.ConfigurationError, match="reason"):
        await app.complete_step(run.run_id, 3, 5, reason=" ")
    with pytest.raises(tether.ConfigurationError, match="step"):
        await app.complete_step(run.run_id, 0, 5, reason="x")
    with pytest.raises(tether.RunNotFoundError):
        await app.complete_step("nope", 1, 5, reason="x")
    release.set()
    assert await run.result(timeout=10) == 20  # the attempt's own result stands
    with pytest.raises(tether.RecoveryError, match="already completed"):
        await app.complete_step(run.run_id, 3, 5, reason="x")
    assert [e for e in await app.audit(run.run_id) if e["action"] == "complete step"] == []


async def test_a_failure_the_code_handled_is_refused(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.activity(retry=fast(1))
    def charge(order: str) -> str:
        raise TimeoutError("provider timed out")

    @app.workflow
    async def careful(order: str) -> str:
        try:
            return await charge(order)
        except tether.ActivityError:
            await tether.wait_event("never", timeout=60)
            return "fallback"

    run = await app.start(careful, "o-1")

    async def failed() -> bool:
        return any(e.type is EventType.ACTIVITY_FAILED for e in await app.history(run.run_id))

    await eventually(failed)
    with pytest.raises(tether.RecoveryError, match="handled the failure"):
        await app.complete_step(run.run_id, 1, "ch_1", reason="x")
    await app.cancel(run.run_id)


async def test_an_operator_result_and_a_worker_result_of_one_step_never_both_land(
    app: tether.App, store_url: str, worker: tether.Worker
) -> None:
    """A worker whose lease lapsed (stuck, not dead) and an operator complete the same
    step at the same moment: exactly one result is recorded; the other side is told
    (LeaseLostError for the worker, RecoveryError for the operator)."""

    @app.activity(queue="by-hand")  # served by no worker: the test claims it
    def charge(order: str) -> str:
        return "unused"

    @app.workflow
    async def pay(order: str) -> str:
        return await charge(order)

    other = tether.App(store=store_url)  # the operator, in another process
    try:
        runs = [await app.start(pay, f"o-{i}") for i in range(8)]
        store = app.store
        tasks: list[Task] = []

        async def all_scheduled() -> bool:
            tasks.extend(
                await store.claim(worker_id="stuck", queues=["by-hand"], limit=100, lease=0.05)
            )
            return len(tasks) == len(runs)

        await eventually(all_scheduled)
        time.sleep(0.1)  # every lease has lapsed: the operator may complete the steps
        by_run = {t.run_id: t for t in tasks}
        winners = collections.Counter[str]()
        for i, run in enumerate(runs):
            sides = [
                store.complete_activity(by_run[run.run_id], '"worker"'),
                # the store's write itself (the App reads the history first, which
                # would let the worker's write in first every time)
                other.store.complete_step(run.run_id, 1, '"operator"', "op", "race"),
            ]
            if i % 2:  # either one sent first
                got = list(reversed(await asyncio.gather(*reversed(sides), return_exceptions=True)))
            else:
                got = await asyncio.gather(*sides, return_exceptions=True)
            worker_lost = isinstance(got[0], tether.LeaseLostError)
            operator_lost = isinstance(got[1], tether.RecoveryError)
            assert worker_lost != operator_lost, got
            if operator_lost:
                assert "already completed" in str(got[1])
            else:
                assert not isinstance(got[1], BaseException), got
            want = "worker" if operator_lost else "operator"
            winners[want] += 1
            assert await run.result(timeout=10) == want
            events = await app.history(run.run_id)
            assert [e.type for e in events].count(EventType.ACTIVITY_COMPLETED) == 1
            actions = [e["action"] for e in await app.audit(run.run_id)]
            assert actions.count("complete step") == (want == "operator")
        assert sum(winners.values()) == len(runs)
    finally:
        assert other._store is not None
        other._store.close_sync()  # type: ignore[attr-defined]


async def test_a_stuck_attempt_whose_lease_lapsed_is_fenced_off(
    app: tether.App, worker: tether.Worker
) -> None:
    """The operator completes a step whose attempt's lease lapsed: the attempt's late
    result is discarded, never recorded as a second result."""

    @app.activity(queue="by-hand")
    def charge(order: str) -> str:
        return "unused"

    @app.workflow
    async def pay(order: str) -> str:
        charge_id = await charge(order)
        await tether.wait_event("go", timeout=60)  # still running when the late result comes
        return charge_id

    run = await app.start(pay, "o-1")
    store = app.store
    claimed: list[Task] = []

    async def scheduled() -> bool:
        claimed.extend(
            await store.claim(worker_id="stuck", queues=["by-hand"], limit=1, lease=0.05)
        )
        return bool(claimed)

    await eventually(scheduled)
    await asyncio.sleep(0.1)
    await app.complete_step(run.run_id, 1, "ch_op", reason="found it")

    async def waiting() -> bool:
        return "go" in str((await app.get(run.run_id)).waiting_on)

    await eventually(waiting)
    with pytest.raises(tether.LeaseLostError):
        await store.complete_activity(claimed[0], '"late"')
    with pytest.raises(tether.LeaseLostError):
        await store.fail_activity(claimed[0], {"type": "X", "message": "late"}, None)
    await app.signal(run.run_id, "go")
    assert await run.result(timeout=10) == "ch_op"
    types = [e.type for e in await app.history(run.run_id)]
    assert types.count(EventType.ACTIVITY_COMPLETED) == 1
    assert (await app.get(run.run_id)).status is RunStatus.COMPLETED


async def test_the_sync_client_completes_a_step(store_url: str) -> None:
    def define(app: tether.App) -> tether.Workflow[[str], str]:
        @app.activity(retry=tether.Retry(attempts=1))
        def charge(order: str) -> str:
            raise TimeoutError("provider timed out")

        @app.workflow
        async def pay(order: str) -> str:
            return "paid " + await charge(order)

        return pay

    serving = tether.App(store=store_url)
    pay = define(serving)
    client_app = tether.App(store=store_url)
    define(client_app)
    client = tether.SyncClient(client_app)
    try:
        async with serving.worker(poll_interval=0.05):
            run = await serving.start(pay, "o-1")
            with pytest.raises(tether.WorkflowFailedError):
                await run.result(timeout=10)

            def use() -> str:
                reopened = client.complete_step(run.run_id, 1, "ch_1", reason="at the provider")
                value: str = reopened.result(timeout=10)
                return value

            assert await asyncio.to_thread(use) == "paid ch_1"
    finally:
        await asyncio.to_thread(client.close)
        await serving.close()


async def test_the_result_is_sealed_like_any_result(store_url: str, tmp_path: Path) -> None:
    from test_encryption import CANARY, _keyring, _stored_bytes

    app = tether.App(store=store_url, encryption=_keyring(tmp_path))

    @app.activity(retry=tether.Retry(attempts=1))
    def charge(order: str) -> str:
        raise TimeoutError("provider timed out")

    @app.workflow
    async def pay(order: str) -> str:
        return await charge(order)

    async with app.worker(poll_interval=0.05):
        run = await app.start(pay, "o-1")
        with pytest.raises(tether.WorkflowFailedError):
            await run.result(timeout=10)
        await app.complete_step(run.run_id, 1, f"ch {CANARY}", reason="at the provider")
        assert await run.result(timeout=10) == f"ch {CANARY}"
    (done,) = [e for e in await app.history(run.run_id) if e.type is EventType.ACTIVITY_COMPLETED]
    assert done.data["result"] == f"ch {CANARY}" and done.data["reason"] == "at the provider"
    app.store.close_sync()  # type: ignore[attr-defined]
    raw = _stored_bytes(store_url)
    assert raw and CANARY.encode() not in raw


async def test_a_suspended_run_takes_the_result_and_goes_on_only_when_resumed(
    app: tether.App, worker: tether.Worker
) -> None:
    ran: collections.Counter[str] = collections.Counter()

    @app.activity(retry=tether.Retry(attempts=5, initial=60, jitter=0))
    def send(to: str) -> str:
        ran["send"] += 1
        raise ConnectionError("reset by peer")

    @app.workflow
    async def notify(to: str) -> str:
        return "sent as " + await send(to)

    run = await app.start(notify, "bob")

    async def backing_off() -> bool:
        return any(
            e.type is EventType.ACTIVITY_ATTEMPT_FAILED for e in await app.history(run.run_id)
        )

    await eventually(backing_off)
    await app.suspend(run.run_id)
    await app.complete_step(run.run_id, 1, "m-1", reason="in the outbox")
    await asyncio.sleep(0.3)
    assert (await app.get(run.run_id)).status is RunStatus.SUSPENDED
    await app.resume(run.run_id)
    assert await run.result(timeout=10) == "sent as m-1"
    assert ran == {"send": 1}


async def test_a_failure_the_code_caught_before_failing_by_itself_is_refused(
    app: tether.App, worker: tether.Worker
) -> None:
    """The code caught the charge's failure, refunded, then failed by itself: completing
    the charge reopened the run, which then refunded AND shipped. It is refused now (the
    run's failure is the code's, not the step's); a failure re-raised after a step (a
    notice, then ``raise``) is still the step's, and is completed."""
    ran: collections.Counter[str] = collections.Counter()

    @app.activity(retry=fast(1))
    def charge(x: int) -> str:
        ran["charge"] += 1
        raise tether.NonRetryable("in doubt")

    @app.activity(retry=fast(1))
    def refund(x: int) -> str:
        ran["refund"] += 1
        return "refunded"

    @app.activity(retry=fast(1))
    def ship(x: str) -> str:
        ran["ship"] += 1
        return "shipped " + x

    @app.workflow
    async def order(x: int) -> str:
        try:
            c = await charge(x)
        except tether.ActivityError:
            await refund(x)
            raise ValueError("order abandoned after refund") from None
        return await ship(c)

    @app.workflow
    async def noisy(x: int) -> str:
        try:
            c = await charge(x)
        except tether.ActivityError:
            await refund(x)  # a notice, say: the failure is then re-raised
            raise
        return await ship(c)

    run = await app.start(order, 1, run_id="o1")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    with pytest.raises(tether.RecoveryError, match="its code failed"):
        await app.complete_step("o1", 1, "ch_1", reason="found at the provider")
    assert (await app.get("o1")).status is RunStatus.FAILED
    assert ran == {"charge": 1, "refund": 1}
    (letter,) = [d for d in await app.dead_letters(run_id="o1") if d.kind == "activity"]
    assert letter.resolved_at is None  # still open

    again = await app.start(noisy, 2, run_id="o2")
    with pytest.raises(tether.WorkflowFailedError):
        await again.result(timeout=10)
    await app.complete_step("o2", 1, "ch_2", reason="found at the provider")
    assert await again.result(timeout=10) == "shipped ch_2"
    assert ran == {"charge": 2, "refund": 2, "ship": 1}


async def test_a_failure_caught_then_a_signal_waited_for_is_the_codes_not_the_steps(
    app: tether.App, worker: tether.Worker
) -> None:
    """The code caught the charge's failure and waited for a person's word (a signal
    without a timeout: no command recorded), then failed by itself: the run's failure is
    the code's, so the charge is neither completed nor its letter replayed."""
    ran: collections.Counter[str] = collections.Counter()

    @app.activity(retry=fast(1))
    def charge(x: int) -> str:
        ran["charge"] += 1
        raise tether.NonRetryable("in doubt")

    @app.activity(retry=fast(1))
    def ship(x: str) -> str:
        ran["ship"] += 1
        return "shipped " + x

    @app.workflow
    async def order(x: int) -> str:
        try:
            c = await charge(x)
        except tether.ActivityError:
            word = await tether.wait_event("support")  # refunded by hand, say
            raise ValueError(f"order abandoned: {word}") from None
        return await ship(c)

    run = await app.start(order, 1, run_id="s1")
    await eventually(
        lambda: _failed_step(app, "s1"),
        timeout=10,
    )
    await app.signal("s1", "support", "refunded by hand")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    with pytest.raises(tether.RecoveryError, match="its code failed"):
        await app.complete_step("s1", 1, "ch_1", reason="found at the provider")
    (letter,) = [d for d in await app.dead_letters(run_id="s1") if d.kind == "activity"]
    with pytest.raises(tether.RecoveryError, match="caught the failure and went on"):
        await app.replay_dead_letter(letter.id)
    assert (await app.get("s1")).status is RunStatus.FAILED
    assert ran == {"charge": 1}


async def _failed_step(app: tether.App, run_id: str) -> bool:
    history = await app.history(run_id)
    return any(e.type is EventType.ACTIVITY_FAILED for e in history) and any(
        e.type is EventType.WORKFLOW_TASK_COMPLETED
        and e.seq > max(f.seq for f in history if f.type is EventType.ACTIVITY_FAILED)
        for e in history
    )


async def test_a_status_set_in_finally_does_not_make_an_uncaught_failure_look_caught(
    app: tether.App, worker: tether.Worker
) -> None:
    """A ``finally`` that sets the run's status while the charge's failure propagates
    (re-raised as another error) records a command after the failure; the run still
    failed for the step, so its completion reopens the run. A bare ``finally`` (the
    failure re-raised as is) was judged right before too."""
    ran: collections.Counter[str] = collections.Counter()

    @app.activity(retry=fast(1))
    def charge(x: int) -> str:
        ran["charge"] += 1
        raise tether.NonRetryable("in doubt")

    @app.activity(retry=fast(1))
    def ship(x: str) -> str:
        ran["ship"] += 1
        return "shipped " + x

    @app.workflow
    async def order(x: int) -> str:
        tether.set_status("charging")
        try:
            c = await charge(x)
        except tether.ActivityError as exc:
            raise ValueError(f"could not charge: {exc}") from None
        finally:
            tether.set_status("charged")
        return await ship(c)

    run = await app.start(order, 1, run_id="f1")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    await app.complete_step("f1", 2, "ch_1", reason="found at the provider")
    assert await run.result(timeout=10) == "shipped ch_1"
    assert ran == {"charge": 1, "ship": 1}


async def test_a_failure_seen_only_after_another_steps_outcome_is_still_the_steps(
    app: tether.App, worker: tether.Worker
) -> None:
    """The charge fails while the run still waits for a step it called with it; the code
    sees the failure only when both are done and fails for it (another error): a workflow
    task ended with the run going after the failure, but the code had not gone on from
    it, so the charge is what the run failed for and its completion reopens the run."""
    ran: collections.Counter[str] = collections.Counter()

    @app.activity(retry=fast(1))
    def charge(x: int) -> str:
        ran["charge"] += 1
        raise tether.NonRetryable("in doubt")

    @app.activity(retry=fast(1))
    async def reserve(x: int) -> str:
        ran["reserve"] += 1
        await asyncio.sleep(0.5)  # ends after the charge failed
        return f"hold-{x}"

    @app.workflow
    async def order(x: int) -> str:
        c, hold = await tether.gather(charge(x), reserve(x), return_exceptions=True)
        if isinstance(c, BaseException):
            raise ValueError(f"could not charge: {c}")
        return f"{c} {hold}"

    run = await app.start(order, 1, run_id="g1")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    history = await app.history("g1")
    failed = next(e.seq for e in history if e.type is EventType.ACTIVITY_FAILED)
    assert any(e.type is EventType.WORKFLOW_TASK_COMPLETED and e.seq > failed for e in history)
    await app.complete_step("g1", 1, "ch_1", reason="found at the provider")
    assert await run.result(timeout=10) == "ch_1 hold-1"
    assert ran == {"charge": 1, "reserve": 1}
