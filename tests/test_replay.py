"""Replay: restarting on the same store continues a run; diverging code is detected."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import tether
from helpers import eventually
from tether import EventType, RunStatus


async def count_events(app: tether.App, run_id: str, type_: EventType) -> int:
    return sum(1 for e in await app.history(run_id) if e.type is type_)


@asynccontextmanager
async def serving(app: tether.App, **options: Any) -> AsyncIterator[tether.Worker]:
    opts: dict[str, Any] = {"lease": 2.0, "poll_interval": 0.05}
    opts.update(options)
    w = app.worker(**opts)
    await w.start()
    try:
        yield w
    finally:
        await w.stop(grace=2.0)


@asynccontextmanager
async def fresh_app(store_url: str) -> AsyncIterator[tether.App]:
    """A second App on the same store (SQLite file or PostgreSQL schema), as after a restart."""
    a = tether.App(store=store_url)
    try:
        yield a
    finally:
        await a.close()


def register_pipeline(app: tether.App, log: list[str]) -> tether.Workflow[[int], dict[str, Any]]:
    """The same workflow code, registered on any App (as a redeployed module would)."""

    @app.activity
    def extract(n: int) -> list[int]:
        log.append("extract")
        return list(range(n))

    @app.activity
    def transform(values: list[int]) -> list[int]:
        log.append("transform")
        return [v * v for v in values]

    @app.activity
    def load(values: list[int]) -> int:
        log.append("load")
        return sum(values)

    @app.workflow
    async def pipeline(n: int) -> dict[str, Any]:
        values = await extract(n)
        squares = await transform(values)
        await tether.sleep(0.05)
        approval = await tether.wait_event("approve")
        total = await load(squares)
        return {"total": total, "approved_by": approval}

    return pipeline


async def test_restart_new_app_and_worker_continues_without_rerunning_steps(
    app: tether.App, store_url: str
) -> None:
    log: list[str] = []
    pipeline = register_pipeline(app, log)
    async with serving(app):
        run = await app.start(pipeline, 4, run_id="etl")
        await eventually(
            lambda: count_events(app, "etl", EventType.TIMER_FIRED), what="timer fired"
        )
        await eventually(
            lambda: _markers_after_timer(app, "etl"),
            what="waiting for approval",
        )
    assert log == ["extract", "transform"]
    assert (await app.get("etl")).status is RunStatus.RUNNING
    history_before = await app.history("etl")

    async with fresh_app(store_url) as app2:
        register_pipeline(app2, log)
        async with serving(app2) as w2:
            await app2.signal("etl", "approve", "carol")
            out = await app2.get_run("etl").result(timeout=10)
            assert w2.stats["replays"] >= 1
        history_after = await app2.history("etl")
    assert out == {"total": 0 + 1 + 4 + 9, "approved_by": "carol"}
    assert log == ["extract", "transform", "load"]  # recorded steps did not run again
    # the history was only appended to
    assert [(e.seq, e.type) for e in history_after[: len(history_before)]] == [
        (e.seq, e.type) for e in history_before
    ]
    assert (await app.get("etl")).status is RunStatus.COMPLETED
    assert await run.result(timeout=5) == out


async def _markers_after_timer(app: tether.App, run_id: str) -> bool:
    events = await app.history(run_id)
    fired = [e.seq for e in events if e.type is EventType.TIMER_FIRED]
    return bool(fired) and any(
        e.type is EventType.WORKFLOW_TASK_COMPLETED and e.seq > fired[0] for e in events
    )


async def test_restart_counts_executions_in_side_file(
    app: tether.App, store_url: str, tmp_path: Path
) -> None:
    """Executions counted in a file, as a separate process would see them."""
    side = tmp_path / "executions.txt"

    def register(a: tether.App) -> tether.Workflow[[int], int]:
        @a.activity
        def step(i: int) -> int:
            with side.open("a") as fh:
                fh.write(f"{i}\n")
            return i

        @a.workflow
        async def stepper(n: int) -> int:
            total = 0
            for i in range(n):
                total += await step(i)
                if i == 2:
                    await tether.wait_event("continue")
            return total

        return stepper

    stepper = register(app)
    async with serving(app):
        await app.start(stepper, 6, run_id="s")

        async def three_done() -> bool:
            return await count_events(app, "s", EventType.ACTIVITY_COMPLETED) == 3

        await eventually(three_done, what="three steps recorded")
        await asyncio.sleep(0.1)
    assert side.read_text().split() == ["0", "1", "2"]

    async with fresh_app(store_url) as app2:
        register(app2)
        async with serving(app2):
            await app2.signal("s", "continue")
            assert await app2.get_run("s").result(timeout=10) == 15
    assert side.read_text().split() == ["0", "1", "2", "3", "4", "5"]


async def test_restart_replays_child_and_gather_without_rerunning(
    app: tether.App, store_url: str
) -> None:
    log: list[str] = []

    def register(a: tether.App) -> tether.Workflow[[], list[int]]:
        @a.activity
        def part(i: int) -> int:
            log.append(f"part{i}")
            return i * 10

        @a.workflow
        async def kid(i: int) -> int:
            return await part(i) + 1

        @a.workflow
        async def parent() -> list[int]:
            xs = await tether.gather(part(1), part(2), kid(3))
            await tether.wait_event("go")
            ys = await tether.gather(part(4), kid(5))
            return [*xs, *ys]

        return parent

    parent = register(app)
    async with serving(app):
        await app.start(parent, run_id="par")

        async def waiting() -> bool:
            events = await app.history("par")
            return (
                sum(e.type is EventType.ACTIVITY_COMPLETED for e in events) == 2
                and any(e.type is EventType.CHILD_COMPLETED for e in events)
                and events[-1].type is EventType.WORKFLOW_TASK_COMPLETED
            )

        await eventually(waiting, what="first gather done")
    assert sorted(log) == ["part1", "part2", "part3"]

    async with fresh_app(store_url) as app2:
        register(app2)
        async with serving(app2):
            await app2.signal("par", "go")
            assert await app2.get_run("par").result(timeout=10) == [10, 20, 31, 40, 51]
    assert sorted(log) == ["part1", "part2", "part3", "part4", "part5"]


# -- non-determinism ----------------------------------------------------------------------------


async def test_non_determinism_detected_run_left_running_then_fixed_code_completes(
    app: tether.App, store_url: str
) -> None:
    log: list[str] = []

    def register_original(a: tether.App) -> tether.Workflow[[str], str]:
        @a.activity
        def charge(who: str) -> str:
            log.append(f"charge:{who}")
            return f"charged {who}"

        @a.activity
        def ship(who: str) -> str:
            log.append(f"ship:{who}")
            return f"shipped {who}"

        @a.workflow
        async def order(who: str) -> str:
            c = await charge(who)
            await tether.wait_event("packed")
            s = await ship(who)
            return f"{c}; {s}"

        return order

    order = register_original(app)
    async with serving(app):
        await app.start(order, "dana", run_id="o1")
        await eventually(
            lambda: count_events(app, "o1", EventType.ACTIVITY_COMPLETED), what="charged"
        )
        await eventually(
            lambda: _last_is_marker(app, "o1"),
            what="waiting for packed",
        )
    assert log == ["charge:dana"]
    history_before = await app.history("o1")

    # a deploy that changed the first step: replay must notice
    async with fresh_app(store_url) as bad:

        @bad.activity
        def refund(who: str) -> str:
            log.append(f"refund:{who}")
            return f"refunded {who}"

        @bad.activity
        def ship(who: str) -> str:
            log.append(f"ship:{who}")
            return f"shipped {who}"

        @bad.workflow(name="order")
        async def order_v2(who: str) -> str:
            r = await refund(who)
            await tether.wait_event("packed")
            return r + "; " + await ship(who)

        async with serving(bad, workflow_retry_delay=0.1) as w2:
            await bad.signal("o1", "packed")

            async def task_error() -> str | None:
                return (await bad.get("o1")).task_error

            err = await eventually(task_error, what="task_error set")
            info = await bad.get("o1")
            assert info.status is RunStatus.RUNNING
            assert "NonDeterminismError" in err
            assert "charge" in err and "refund" in err
            # it keeps retrying (not failing the run) with the configured delay
            await eventually(
                lambda: asyncio.sleep(0, result=w2.stats["workflow_task_failures"] >= 2),
                what="retried",
            )
            assert (await bad.get("o1")).status is RunStatus.RUNNING
        # nothing was appended or executed by the bad code
        assert [(e.seq, e.type) for e in await bad.history("o1")] == [
            (e.seq, e.type) for e in history_before
        ] + [(history_before[-1].seq + 1, EventType.SIGNAL_RECEIVED)]
    assert log == ["charge:dana"]

    # the fixed deploy continues the same run to completion
    async with fresh_app(store_url) as fixed:
        register_original(fixed)
        async with serving(fixed, workflow_retry_delay=0.1):
            out = await fixed.get_run("o1").result(timeout=10)
        info = await fixed.get("o1")
    assert out == "charged dana; shipped dana"
    assert info.status is RunStatus.COMPLETED
    assert info.task_error is None
    assert log == ["charge:dana", "ship:dana"]


async def _last_is_marker(app: tether.App, run_id: str) -> bool:
    events = await app.history(run_id)
    return (
        bool(events)
        and events[-1].type is EventType.WORKFLOW_TASK_COMPLETED
        and any(e.type is EventType.ACTIVITY_COMPLETED for e in events)
    )


async def test_non_determinism_code_ending_earlier_detected(
    app: tether.App, store_url: str
) -> None:
    """Replayed code that issues *fewer* commands than recorded is also caught."""

    @app.activity
    def a1() -> int:
        return 1

    @app.activity
    def a2() -> int:
        return 2

    @app.workflow
    async def shrink() -> int:
        x, y = await tether.gather(a1(), a2())
        await tether.wait_event("go")
        return x + y

    async with serving(app):
        await app.start(shrink, run_id="sh")

        async def waiting() -> bool:
            events = await app.history("sh")
            return (
                sum(e.type is EventType.ACTIVITY_COMPLETED for e in events) == 2
                and events[-1].type is EventType.WORKFLOW_TASK_COMPLETED
            )

        await eventually(waiting, what="waiting")

    async with fresh_app(store_url) as bad:

        @bad.activity
        def a1() -> int:
            return 1

        @bad.workflow(name="shrink")
        async def shrink_v2() -> int:
            x = await a1()
            await tether.wait_event("go")
            return x

        async with serving(bad, workflow_retry_delay=0.1):
            await bad.signal("sh", "go")

            async def task_error() -> str | None:
                return (await bad.get("sh")).task_error

            err = await eventually(task_error, what="task_error set")
            assert "NonDeterminismError" in err
            assert (await bad.get("sh")).status is RunStatus.RUNNING


async def test_restart_old_worker_discarding_run_executes_no_workflow_code(
    app: tether.App, store_url: str
) -> None:
    """Stopping a worker (a deploy) must not run the cached run's ``finally`` blocks in the
    old process: the cleanup step runs exactly once, durably, where the run ends."""
    log: list[str] = []

    def register(a: tether.App) -> tether.Workflow[[], str]:
        @a.activity
        def work() -> None:
            log.append("work")

        @a.activity
        def cleanup() -> None:
            log.append("cleanup")

        @a.workflow
        async def guarded() -> str:
            try:
                await work()
                await tether.wait_event("finish")
            finally:
                await cleanup()
            return "done"

        return guarded

    guarded = register(app)
    w1 = app.worker(lease=2.0, poll_interval=0.05)
    await w1.start()
    await app.start(guarded, run_id="g")
    await eventually(lambda: _last_is_marker(app, "g"), what="waiting for finish")
    await w1.stop(grace=2.0)
    del w1
    gc.collect()  # the old worker's in-memory copy of the run goes away
    assert log == ["work"]

    async with fresh_app(store_url) as app2:
        register(app2)
        async with serving(app2):
            await app2.signal("g", "finish")
            assert await app2.get_run("g").result(timeout=10) == "done"
    assert log == ["work", "cleanup"]
