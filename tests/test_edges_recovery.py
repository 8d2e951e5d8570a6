"""Edges of recovery: what an operator's retry reuses, children that ended meanwhile,
work handed back by a stopping worker, and cancelled race losers."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

import tether
from helpers import eventually
from tether._history import EventType

FAST1 = tether.Retry(attempts=1, initial=0.01)


def _quote_app(app: tether.App) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """A run that survives a failed step, prices a quote, then fails: retried after a fix."""
    mode: dict[str, Any] = {"currency": "EUR", "fail": True}
    calls: list[tuple[int, str]] = []

    @app.activity(retry=FAST1)
    def flaky() -> None:
        if mode["fail"]:
            raise tether.NonRetryable("rates service down")

    @app.activity
    def price(amount: int, currency: str) -> str:
        calls.append((amount, currency))
        return f"{amount} {currency}"

    @app.workflow
    async def quote() -> str:
        try:
            await flaky()
        except tether.ActivityError:
            pass
        priced = await price(100, mode["currency"])
        if mode["fail"]:
            raise ValueError("quote rejected")
        return priced

    return mode, calls


async def test_retry_reruns_a_voided_step_called_with_other_arguments(
    app: tether.App, worker: tether.Worker
) -> None:
    mode, calls = _quote_app(app)
    run = await app.start("quote", run_id="q")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    mode.update(currency="GBP", fail=False)  # the fixed deploy prices in another currency
    await app.retry("q")
    assert await run.result(timeout=10) == "100 GBP"
    assert calls == [(100, "EUR"), (100, "GBP")]


async def test_retry_reuses_a_voided_step_called_with_the_same_arguments(
    app: tether.App, worker: tether.Worker
) -> None:
    mode, calls = _quote_app(app)
    run = await app.start("quote", run_id="q")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    mode.update(fail=False)
    await app.retry("q")
    assert await run.result(timeout=10) == "100 EUR"
    assert calls == [(100, "EUR")]  # the recorded result was reused, not re-run


async def test_retry_delivers_the_outcome_of_a_child_that_ended_meanwhile(
    app: tether.App, worker: tether.Worker
) -> None:
    state = {"fail": True}

    @app.activity(retry=FAST1)
    def boom() -> None:
        if state["fail"]:
            raise tether.NonRetryable("down")

    @app.workflow
    async def kid() -> str:
        await tether.sleep(0.2)
        return "kid done"

    @app.workflow
    async def parent() -> str:
        try:
            await boom()
        except tether.ActivityError:
            pass
        pending = kid.options(run_id="kid", parent_close="abandon")()
        if state["fail"]:
            raise ValueError("parent broke with its child running")
        return await pending

    run = await app.start(parent, run_id="p")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    assert await app.get_run("kid").result(timeout=10) == "kid done"
    state["fail"] = False
    await app.retry("p")  # the child's start is voided with the failure and issued again
    assert await run.result(timeout=10) == "kid done"


async def test_retry_delivers_a_child_outcome_when_the_failed_task_was_the_first(
    app: tether.App, worker: tether.Worker
) -> None:
    """The parent started its child and failed in its very first task: the retry voids
    that task, so the run's start and the child's outcome reach the code together, the
    outcome before the code has asked for the child again. It must wait for the ask,
    not be dropped (the run would wait for the child for ever)."""
    state = {"fail": True}

    @app.workflow
    async def kid() -> str:
        await tether.wait_event("go")
        return "kid done"

    @app.workflow
    async def parent() -> str:
        pending = kid.options(run_id="kid", parent_close="abandon")()
        if state["fail"]:
            raise ValueError("parent broke with its child running")
        return await pending

    run = await app.start(parent, run_id="p")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    await app.signal("kid", "go", 1)
    assert await app.get_run("kid").result(timeout=10) == "kid done"
    state["fail"] = False
    await app.retry("p")
    assert await run.result(timeout=10) == "kid done"


async def test_work_claimed_while_a_worker_stops_keeps_its_attempts(app: tether.App) -> None:
    ran: list[str] = []

    @app.activity(retry=tether.Retry(attempts=1), queue="side")
    def once() -> str:
        ran.append("ran")
        return "ok"

    @app.workflow
    async def job() -> str:
        return await once()

    run = await app.start(job)
    async with app.worker(queues=["default"], poll_interval=0.05):
        await eventually(lambda: _scheduled(app, run.run_id), what="the step scheduled")
    side = app.worker(queues=["side"], poll_interval=0.05)
    store = app.store
    original = store.claim_with_wake
    stopping: list[asyncio.Task[None]] = []

    async def claim_then_stop(**kw: Any) -> Any:
        tasks, until = await original(**kw)
        if tasks and not stopping:
            # the claim lands just as the worker is told to stop: the task is handed back
            stopping.append(asyncio.create_task(side.stop(grace=2.0)))
            await eventually(lambda: asyncio.sleep(0, result=side._stopping), what="stop")
        return tasks, until

    store.claim_with_wake = claim_then_stop  # type: ignore[method-assign]
    await side.start()
    await eventually(lambda: asyncio.sleep(0, result=bool(stopping)), what="the claim")
    await stopping[0]
    store.claim_with_wake = original  # type: ignore[method-assign]
    assert ran == []
    async with app.worker(poll_interval=0.05):
        assert await run.result(timeout=10) == "ok"  # attempt 1 of 1, not 2 of 1
    assert ran == ["ran"]


async def _scheduled(app: tether.App, run_id: str) -> bool:
    return tether.EventType.ACTIVITY_SCHEDULED in [e.type for e in await app.history(run_id)]


async def test_a_cancelled_race_loser_is_no_dead_letter(app: tether.App) -> None:
    @app.activity(retry=FAST1)
    async def slow() -> str:
        await asyncio.sleep(30)
        return "slow"

    @app.activity
    async def quick() -> str:
        await asyncio.sleep(0.1)
        return "quick"

    @app.workflow
    async def race() -> str:
        winner = await tether.first(slow(), quick())
        await tether.wait_event("done")  # the run goes on while the loser's cancel lands
        return str(winner)

    async with app.worker(lease=1.0, poll_interval=0.05):  # renewals tell of the cancel
        run = await app.start(race)
        await eventually(
            lambda: _has_failed_step(app, run.run_id), what="the loser's cancellation recorded"
        )
        await app.signal(run.run_id, "done")
        assert await run.result(timeout=10) == "quick"
    assert await app.dead_letters() == []


async def test_a_worker_id_whose_postgres_session_ended_is_held_again(
    pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The id's advisory lock lives in one database session: ended while the worker
    lives (``pg_terminate_backend``, a dropped connection), nothing held the id any
    more and a second process under it was admitted, taking the live worker's tasks
    over. The worker now takes the lock again on a new session within seconds; if
    another process got it first, this one claims nothing more."""
    import psycopg

    import tether._worker as worker_module
    from conftest import PG_URL, with_schema

    monkeypatch.setattr(worker_module, "ID_CHECK_EVERY", 0.1)
    url = with_schema(PG_URL, pg_schema)
    first, second = tether.App(store=url), tether.App(store=url)

    def end_session(app: tether.App) -> int:
        pid = int(app.store._id_holds["ingest-1"][0].info.backend_pid)  # type: ignore[attr-defined]
        with psycopg.connect(PG_URL, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        return pid

    try:
        a = first.worker(worker_id="ingest-1", poll_interval=0.05)
        await a.start()
        ended = end_session(first)

        async def held_again() -> bool:
            conn = first.store._id_holds["ingest-1"][0]  # type: ignore[attr-defined]
            return not conn.closed and conn.info.backend_pid != ended

        await eventually(held_again, what="the id held again on a new session")
        b = second.worker(worker_id="ingest-1")
        with pytest.raises(tether.ConfigurationError, match="in use by a live worker"):
            await b.start()
        assert not a._id_taken

        # the session ends and another process takes the id before the worker looks
        monkeypatch.setattr(worker_module, "ID_CHECK_EVERY", 3600.0)
        await asyncio.sleep(0.3)  # the watch is now asleep for an hour
        end_session(first)
        await asyncio.sleep(0.3)  # the server lets the lock go with the session
        await b.start()
        await a._check_id()
        assert a._id_taken  # it claims nothing more
        await b.stop()
    finally:
        await a.kill()
        await first.close()
        await second.close()


async def test_a_second_process_under_a_live_workers_id_leaves_its_leases_alone(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The id's advisory lock ends with its session (``pg_terminate_backend``, a dropped
    connection) while the worker lives; a second process started under the id in that
    window got the lock and took back at once every task leased to the id, trusting the
    lock to prove their holder dead: the live worker's step ran twice. Now the second
    process takes back only leases no one renews, and the live one renews its leases the
    moment it finds its id taken: the step runs once, finished by the first worker.
    (On SQLite the hold is a file lock, lost only if its file is deleted.)"""
    import psycopg

    import tether._worker as worker_module
    from conftest import PG_URL

    # the first worker's watch looks at its hold only when the test says so (below)
    monkeypatch.setattr(worker_module, "ID_CHECK_EVERY", 3600.0)
    monkeypatch.setattr(worker_module, "RECLAIM_WAIT", 1.0)
    first, second = tether.App(store=store_url), tether.App(store=store_url)
    ran: list[str] = []
    finish = asyncio.Event()
    for app in (first, second):

        @app.activity
        async def embed(doc: str) -> str:
            ran.append(doc)
            await finish.wait()
            return doc.upper()

        @app.workflow
        async def ingest(doc: str) -> str:
            return await embed(doc)

    a = b = None
    try:
        # a lease that outlasts the test: only what the first worker does now counts
        a = first.worker(worker_id="ingest-1", lease=60.0, poll_interval=0.05)
        await a.start()
        run = await first.start("ingest", "doc", run_id="r")

        async def running() -> bool:
            return ran == ["doc"]

        await eventually(running, what="the step to start in the first worker")
        hold = first.store._id_holds["ingest-1"]  # type: ignore[attr-defined]
        if store_url.startswith("sqlite"):
            os.remove(hold[1])  # the lock file
        else:
            with psycopg.connect(PG_URL, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (hold[0].info.backend_pid,))
        b = second.worker(worker_id="ingest-1", poll_interval=0.05)
        await b.start()  # the lock is free: admitted
        await a._check_id()  # the first worker's watch comes round: its id is taken
        assert a._id_taken
        await asyncio.sleep(2.0)  # past the second's wait before it takes anything back
        assert ran == ["doc"], "the live worker's step ran again in the second process"
        finish.set()
        assert await run.result(timeout=10) == "DOC"
        assert ran == ["doc"]
        types = [e.type for e in await first.history("r")]
        assert types.count(EventType.ACTIVITY_COMPLETED) == 1
    finally:
        finish.set()
        for w in (a, b):
            if w is not None:
                await w.kill()
        await first.close()
        await second.close()


async def test_a_stable_id_takes_back_a_dead_holders_leases_without_waiting_for_them(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that died holding leases (a long one here) is not there to renew them:
    restarted under its id, a worker takes them back once it saw no renewal for
    ``RECLAIM_WAIT``, far before the lease ends."""
    import tether._worker as worker_module

    monkeypatch.setattr(worker_module, "RECLAIM_WAIT", 0.3)
    app = tether.App(store=store_url)

    @app.workflow
    async def hello(name: str) -> str:
        return f"hello {name}"

    try:
        run = await app.start(hello, "ada", run_id="r")
        # the crashed holder: claimed the run's task under the id for ten minutes
        (task,) = await app.store.claim(
            worker_id="ingest-1", queues=["default"], limit=1, lease=600
        )
        assert task.run_id == "r"
        async with app.worker(worker_id="ingest-1", poll_interval=0.05):
            assert await run.result(timeout=10) == "hello ada"
    finally:
        await app.close()


def test_a_hold_taken_again_while_the_worker_releases_it_is_let_go(pg_schema: str) -> None:
    """The check of the id's hold runs in a thread: when it took the lock again on a new
    session while the worker stopped (released the hold), the new session was kept in
    the released hold, never closed, and the id stayed locked: a restart was refused."""
    import psycopg

    from conftest import PG_URL, with_schema

    app = tether.App(store=with_schema(PG_URL, pg_schema))
    store: Any = app.store
    try:
        release = store.hold_worker_id("ingest-1")
        with psycopg.connect(PG_URL, autocommit=True) as admin:
            pid = store._id_holds["ingest-1"][0].info.backend_pid
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        connect = store._connect

        def connect_while_the_worker_stops() -> Any:
            conn = connect()
            release()
            return conn

        store._connect = connect_while_the_worker_stops
        assert store.check_worker_id("ingest-1")
        store._connect = connect
        store.hold_worker_id("ingest-1")()  # not left locked
    finally:
        store.close_sync()


async def _has_failed_step(app: tether.App, run_id: str) -> bool:
    return tether.EventType.ACTIVITY_FAILED in [e.type for e in await app.history(run_id)]


async def test_a_worker_id_held_by_a_live_worker_is_refused(store_url: str) -> None:
    """Two processes with one stable id would take over each other's tasks: the second
    is refused until the first is gone (then it takes over at once)."""
    first, second = tether.App(store=store_url), tether.App(store=store_url)
    try:
        a = first.worker(worker_id="ingest-1")
        await a.start()
        b = second.worker(worker_id="ingest-1")
        with pytest.raises(tether.ConfigurationError, match="in use by a live worker"):
            await b.start()
        for blank in ("", "  "):  # not a stable id, nor silently a random one
            with pytest.raises(tether.ConfigurationError, match="worker_id needs a name"):
                second.worker(worker_id=blank)
        other = second.worker(worker_id="ingest-2")  # another id is fine
        await other.start()
        await other.stop()
        await a.kill()  # dies like a SIGKILLed process: its hold ends with it
        await b.start()
        await b.stop()
    finally:
        await first.close()
        await second.close()


async def test_a_worker_ids_watch_and_its_release_never_share_its_connection(
    pg_schema: str,
) -> None:
    # the watch (a thread asking the held session "SELECT 1") ran on while a killed
    # worker's release closed that connection: psycopg's C code crashed the process
    # (a segfault seen once in the suite)
    import threading
    import time

    from conftest import PG_URL, with_schema

    app = tether.App(store=with_schema(PG_URL, pg_schema))
    store: Any = app.store
    release = await asyncio.to_thread(store.hold_worker_id, "ingest-9")
    hold = store._id_holds["ingest-9"]
    real = hold[0]
    seen: list[str] = []

    class Slow:
        """The held connection, each statement taking a while."""

        def execute(self, *args: Any) -> Any:
            seen.append("execute")
            time.sleep(0.3)
            seen.append("executed")
            return real.execute(*args)

        def close(self) -> None:
            seen.append("close")
            real.close()

    hold[0] = Slow()
    watch = threading.Thread(target=store.check_worker_id, args=("ingest-9",))
    watch.start()
    await asyncio.sleep(0.1)  # the watch is inside its statement
    await asyncio.to_thread(release)
    watch.join(5)
    assert seen == ["execute", "executed", "close"], seen
    assert store.check_worker_id("ingest-9") is True  # released: nothing to watch
    await app.close()


def _child_app(app: tether.App) -> tuple[dict[str, bool], list[str]]:
    """``parent(doc)`` awaits ``child(doc)``, whose one step fails until it is fixed."""
    fixed = {"on": False}
    calls: list[str] = []

    @app.activity(retry=FAST1)
    def parse(doc: str) -> str:
        calls.append(doc)
        if not fixed["on"]:
            raise ValueError("parser bug")
        return doc.upper()

    @app.workflow
    async def child(doc: str) -> str:
        return await parse(doc)

    @app.workflow
    async def parent(doc: str) -> str:
        return "parent got " + await child(doc)

    return fixed, calls


async def test_retrying_a_parent_retries_its_failed_child_from_the_failed_step(
    app: tether.App, worker: tether.Worker
) -> None:
    fixed, calls = _child_app(app)
    run = await app.start(app.get_workflow("parent"), "doc", run_id="P")
    with pytest.raises(tether.WorkflowFailedError, match="parser bug"):
        await run.result(timeout=10)
    assert (await app.get("P/1")).status is tether.RunStatus.FAILED
    fixed["on"] = True  # the fix is deployed
    await app.retry("P")
    assert await run.result(timeout=10) == "parent got DOC"
    assert calls == ["doc", "doc"]  # the child's failed step ran again, once
    child = await app.get("P/1")
    assert child.status is tether.RunStatus.COMPLETED
    types = [e.type for e in await app.history("P/1")]
    assert tether.EventType.RUN_RETRIED in types  # the child resumed, it did not start over
    assert await app.dead_letters() == []  # both runs' letters are resolved


async def test_retrying_a_parent_whose_child_was_terminated_is_refused_with_a_way_out(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def child() -> str:
        await tether.wait_event("never")
        return "child"

    @app.workflow
    async def parent() -> str:
        return await child()

    run = await app.start(parent, run_id="P")

    async def child_running() -> bool:
        try:
            return (await app.get("P/1")).status is tether.RunStatus.RUNNING
        except tether.RunNotFoundError:
            return False

    await eventually(child_running, what="the child running")
    await app.terminate("P/1", "operator")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    with pytest.raises(tether.RecoveryError, match=r"terminated.*app\.fork\('P', at_step=0\)"):
        await app.retry("P")
    assert (await app.get("P")).status is tether.RunStatus.FAILED  # nothing was changed


async def test_retrying_a_parent_waits_for_a_child_that_continued_as_new(
    app: tether.App, worker: tether.Worker
) -> None:
    state = {"fail": True}

    @app.activity(retry=FAST1)
    def boom() -> None:
        if state["fail"]:
            raise tether.NonRetryable("down")

    @app.workflow
    async def looper(n: int) -> str:
        if n < 2:
            tether.continue_as_new(n + 1)
        await tether.wait_event("go")
        return f"looped {n}"

    @app.workflow
    async def parent() -> str:
        pending = looper.options(run_id="kid", parent_close="abandon")(0)
        await tether.sleep(0.3)
        await boom()
        return await pending

    run = await app.start(parent, run_id="P")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    state["fail"] = False
    await app.retry("P")  # the child's chain runs on (kid~2): no failure is made up for it
    await asyncio.sleep(0.3)
    assert not (await app.get("P")).is_finished
    await app.signal("kid", "go")
    assert await run.result(timeout=10) == "looped 2"


async def test_retrying_a_parent_ignores_a_child_it_gave_up_on(
    app: tether.App, worker: tether.Worker
) -> None:
    state = {"fail": True}

    @app.workflow
    async def slow() -> str:
        await tether.wait_event("never")
        return "slow"

    @app.workflow
    async def parent() -> str:
        winner = await tether.first(slow.options(run_id="kid")(), tether.sleep(0.05))
        await tether.sleep(0.3)  # the given-up child ends cancelled meanwhile
        if state["fail"]:
            raise ValueError("parent bug")
        return "gave up" if winner is None else "got it"

    run = await app.start(parent, run_id="P")
    with pytest.raises(tether.WorkflowFailedError, match="parent bug"):
        await run.result(timeout=10)
    assert (await app.get("kid")).status is tether.RunStatus.CANCELLED
    state["fail"] = False
    await app.retry("P")  # the cancelled child is not the failed step: no refusal
    assert await run.result(timeout=10) == "gave up"


async def test_a_child_ending_while_another_process_ends_its_parent_does_not_wake_it(
    pg_schema: str,
) -> None:
    """PostgreSQL: a child's end read its parent's status without a lock; a parent ended
    by a transaction that committed while the child's end waited for the parent's row
    got the child's outcome appended after its end and a workflow task, as if woken. The
    child's end now reads the parent under its row lock: an ended parent is not told."""
    import psycopg

    from conftest import PG_URL, with_schema

    app = tether.App(store=with_schema(PG_URL, pg_schema))

    @app.workflow
    async def kid() -> str:
        return str(await tether.wait_event("never"))

    @app.workflow
    async def parent() -> str:
        kid.options(run_id="kid", parent_close="abandon")()
        return str(await tether.wait_event("never"))

    try:
        await app.start(parent, run_id="p")
        async with app.worker(poll_interval=0.05):

            async def both_wait() -> bool:
                try:
                    runs = [await app.get(r) for r in ("p", "kid")]
                except tether.RunNotFoundError:
                    return False
                return all(r.waiting_on for r in runs)

            await eventually(both_wait, what="parent and child waiting")
        with psycopg.connect(PG_URL) as other:  # another process ending the parent
            other.execute(f'SET search_path TO "{pg_schema}"')
            other.execute(
                "UPDATE runs SET status = 'terminated', completed_at = 1 WHERE run_id = 'p'"
            )
            other.execute("DELETE FROM tasks WHERE run_id = 'p'")
            ending = asyncio.ensure_future(app.terminate("kid", reason="done with it"))
            with psycopg.connect(PG_URL, autocommit=True) as watch:
                for _ in range(400):  # until the child's end waits for the parent's row
                    (waiting,) = watch.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND application_name = %s AND query LIKE %s",  # this test's store
                        (f"tether:{pg_schema}", "%runs%"),
                    ).fetchone()  # type: ignore[misc]
                    if waiting:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the child's end never waited for the parent's row")
            other.commit()
        await asyncio.wait_for(ending, 30)
        assert (await app.get("kid")).status is tether.RunStatus.TERMINATED
        told = [e.type.name for e in await app.history("p") if e.type.name.startswith("CHILD")]
        assert told == ["CHILD_STARTED"]  # not woken with the child's end
        with psycopg.connect(PG_URL, autocommit=True) as check:
            check.execute(f'SET search_path TO "{pg_schema}"')
            assert check.execute("SELECT kind FROM tasks WHERE run_id = 'p'").fetchall() == []
    finally:
        await app.close()


async def test_a_child_ending_while_its_failed_parent_is_retried_reaches_the_parent(
    pg_schema: str,
) -> None:
    """PostgreSQL: the retry of a failed parent read its running child (no outcome yet)
    while the child's end, not yet committed, read the parent as failed (unlocked) and
    told it nothing: the retried parent waited for good. Now one waits for the other."""
    import psycopg

    from conftest import PG_URL, with_schema

    app = tether.App(store=with_schema(PG_URL, pg_schema))
    state = {"fail": True}

    @app.workflow
    async def kid() -> str:
        await tether.sleep(3600)  # a timer task: a row the test can hold the child's end on
        return "kid done"

    @app.workflow
    async def parent() -> str:
        pending = kid.options(run_id="kid", parent_close="abandon")()
        if state["fail"]:
            raise ValueError("parent broke with its child running")
        return await pending

    try:
        run = await app.start(parent, run_id="p")
        async with app.worker(poll_interval=0.05):
            with pytest.raises(tether.WorkflowFailedError):
                await run.result(timeout=10)

            async def kid_sleeps() -> bool:
                try:
                    return bool((await app.get("kid")).waiting_on)
                except tether.RunNotFoundError:
                    return False

            await eventually(kid_sleeps, what="the child waiting on its timer")
        state["fail"] = False
        with psycopg.connect(PG_URL) as other:  # holds the child's end after its row
            other.execute(f'SET search_path TO "{pg_schema}"')
            other.execute("SELECT 1 FROM tasks WHERE run_id = 'kid' FOR UPDATE")
            ending = asyncio.ensure_future(app.terminate("kid", reason="done with it"))
            with psycopg.connect(PG_URL, autocommit=True) as watch:

                async def waiters(n: int, what: str) -> None:
                    for _ in range(400):
                        # this test's store only (other tests may run alongside)
                        (waiting,) = watch.execute(
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = "
                            "'Lock' AND application_name = %s AND query LIKE %s",
                            (f"tether:{pg_schema}", "%runs%"),
                        ).fetchone()  # type: ignore[misc]
                        (on_tasks,) = watch.execute(
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = "
                            "'Lock' AND application_name = %s AND query LIKE %s",
                            (f"tether:{pg_schema}", "DELETE FROM tasks%"),
                        ).fetchone()  # type: ignore[misc]
                        if waiting + on_tasks >= n:
                            return
                        await asyncio.sleep(0.05)
                    raise AssertionError(f"never waited: {what}")

                await waiters(1, "the child's end for its task row")
                retrying = asyncio.ensure_future(app.retry("p"))
                await waiters(2, "the retry for the child's row")
            other.commit()
        await asyncio.wait_for(ending, 30)
        await asyncio.wait_for(retrying, 30)
        events = [e.type for e in await app.history("p")]
        retried = events.index(EventType.RUN_RETRIED)
        # the child's end reached the retried parent (it waits on nothing else)
        assert EventType.CHILD_FAILED in events[retried:], events
        assert (await app.get("p")).status is tether.RunStatus.RUNNING
    finally:
        await app.close()


async def test_a_fork_at_a_step_issued_with_the_next_one_runs_to_its_end(
    app: tether.App, worker: tether.Worker
) -> None:
    """Forked at the first of two steps issued in one task (``gather``): the fork's
    first task replays that step's outcome before the code asks for it again; kept, not
    dropped (the fork waited for it for ever)."""
    ran: list[int] = []

    @app.activity
    async def act(i: int) -> int:
        ran.append(i)
        await asyncio.sleep(0.02 * i)
        return i

    @app.workflow
    async def pair() -> list[int]:
        a = await act(1)
        rs = await asyncio.gather(act(2), act(3))
        return [a, *rs, await act(4)]

    run = await app.start(pair, run_id="g")
    assert await run.result(timeout=10) == [1, 2, 3, 4]
    ran.clear()
    fork = await app.fork("g", at_step=2)
    assert await fork.result(timeout=10) == [1, 2, 3, 4]
    assert sorted(ran) == [3, 4]  # the steps after the fork point, once each
