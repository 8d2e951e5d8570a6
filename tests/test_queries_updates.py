"""Queries read a run's replayed state without recording anything; updates are
validated before anything is recorded, then recorded and applied by the run, their
result returned to the caller (a refused update leaves no trace in history)."""

from __future__ import annotations

import asyncio

import pytest

import tether


def _cart(app: tether.App) -> tether.Workflow:
    @app.activity
    async def price(item: str) -> int:
        return len(item) * 100

    @app.workflow
    async def cart(owner: str) -> dict[str, object]:
        items: list[str] = []
        state = {"stage": "open", "total": 0}

        tether.on_query("stage", lambda: state["stage"])
        tether.on_query("items", lambda: list(items))
        tether.on_query("has", lambda item: item in items)

        def no_duplicates(item: str) -> None:
            if item in items:
                raise ValueError(f"{item!r} is in the cart already")
            if state["stage"] != "open":
                raise ValueError("the cart is closed")

        @tether.on_update("add", validate=no_duplicates)
        def add(item: str) -> int:
            items.append(item)
            return len(items)

        @tether.on_update("priced")
        async def priced(item: str) -> int:  # an async handler may call activities
            cents = await price(item)
            state["total"] = int(state["total"]) + cents
            return int(state["total"])

        @tether.on_update("explode")
        def explode() -> None:
            raise RuntimeError("handler bug")

        await tether.wait_event("checkout")
        state["stage"] = "closed"
        return {"owner": owner, "items": items, "total": state["total"]}

    return cart


async def _running(app: tether.App, run_id: str) -> None:
    for _ in range(2000):
        if (await app.get(run_id)).waiting_on:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the run never waited")


async def test_queries_answer_from_replayed_state_and_record_nothing(app: tether.App) -> None:
    cart = _cart(app)
    async with app.worker(poll_interval=0.05):
        run = await app.start(cart, "ann")
        await _running(app, run.run_id)
        before = len(await app.history(run.run_id))
        assert await app.query(run.run_id, "stage") == "open"
        assert await app.query(run.run_id, "has", "pen") is False
        assert len(await app.history(run.run_id)) == before  # nothing recorded
        with pytest.raises(tether.QueryError, match="known: has, items, stage"):
            await app.query(run.run_id, "nope")
        await app.signal(run.run_id, "checkout")
        await run.result(timeout=20)
    # a finished run answers from its final state
    assert await app.query(run.run_id, "stage") == "closed"


async def test_updates_are_validated_first_recorded_then_applied(app: tether.App) -> None:
    cart = _cart(app)
    async with app.worker(poll_interval=0.05):
        run = await app.start(cart, "bo")
        await _running(app, run.run_id)
        assert await app.update(run.run_id, "add", "pen") == 1
        assert await app.update(run.run_id, "add", "ink") == 2
        assert await app.query(run.run_id, "items") == ["pen", "ink"]
        recorded = len(await app.history(run.run_id))
        with pytest.raises(tether.UpdateRejectedError, match="in the cart already"):
            await app.update(run.run_id, "add", "pen")
        with pytest.raises(tether.UpdateRejectedError, match="no such update handler"):
            await app.update(run.run_id, "remove", "pen")
        assert len(await app.history(run.run_id)) == recorded  # refused: no trace
        assert await app.update(run.run_id, "priced", "pen") == 300
        with pytest.raises(tether.UpdateFailedError, match="RuntimeError: handler bug"):
            await app.update(run.run_id, "explode")
        await app.signal(run.run_id, "checkout")
        result = await run.result(timeout=20)
    assert result == {"owner": "bo", "items": ["pen", "ink"], "total": 300}
    # each accepted update is a request and a Marker with its outcome, in history
    markers = [
        e.data["value"]
        for e in await app.history(run.run_id)
        if e.type is tether.EventType.MARKER and e.data.get("marker") == "update"
    ]
    assert [m["name"] for m in markers] == ["add", "add", "priced", "explode"]
    assert markers[-1]["error"]["type"] == "RuntimeError"


async def test_an_update_recorded_while_no_worker_runs_applies_on_the_next(
    app: tether.App,
) -> None:
    cart = _cart(app)
    async with app.worker(poll_interval=0.05):
        run = await app.start(cart, "cy")
        await _running(app, run.run_id)
    # no worker now: the update is recorded, and waits
    pending = asyncio.create_task(app.update(run.run_id, "add", "cup", timeout=30))
    await asyncio.sleep(0.3)
    assert not pending.done()
    async with app.worker(poll_interval=0.05):
        assert await pending == 1
        assert await app.query(run.run_id, "items") == ["cup"]
    with pytest.raises(tether.ResultTimeoutError, match="still applies"):
        await app.update(run.run_id, "add", "mug", timeout=0.2)  # no worker: times out


async def test_a_query_before_the_code_ran_is_refused(app: tether.App) -> None:
    cart = _cart(app)
    run = await app.start(cart, "di")  # no worker: its code has not run
    with pytest.raises(tether.QueryError, match="not run yet"):
        await app.query(run.run_id, "stage")


async def test_an_update_sent_before_the_code_ran_waits_for_the_run(app: tether.App) -> None:
    """Right after ``start``, with no worker yet: the update is recorded, not refused;
    the run checks it (validator, handler) when its code reaches the handler."""
    cart = _cart(app)
    run = await app.start(cart, "ed")  # no worker: its code has not run
    first = asyncio.create_task(app.update(run.run_id, "add", "pen", timeout=30))
    await asyncio.sleep(0.2)
    assert not first.done()
    # sent before the run's code ran too: its validator runs in the run, and refuses
    again = asyncio.create_task(app.update(run.run_id, "add", "pen", timeout=30))
    await asyncio.sleep(0.2)
    async with app.worker(poll_interval=0.05):
        assert await first == 1
        with pytest.raises(tether.UpdateRejectedError, match="in the cart already"):
            await again
        assert await app.query(run.run_id, "items") == ["pen"]
        await app.signal(run.run_id, "checkout")
        assert (await run.result(timeout=20))["items"] == ["pen"]
