"""Kill switches live in the store and hold work back on every worker: a workflow's
tasks, an activity's attempts, a model's calls; a tenant gets no new runs. Switching
back on lets held work go; held attempts are not used up. Every flip is audited."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

import tether
from helpers import event_types, eventually
from tether import EventType, ai
from tether._redact import engine_made


def held(w: tether.Worker, n: int) -> Any:
    """A check for ``eventually``: the worker held ``n`` tasks back so far."""

    async def check() -> bool:
        return w.stats["held_by_switch"] >= n

    return check


async def test_an_activity_switched_off_is_held_until_switched_on(app: tether.App) -> None:
    calls: list[int] = []

    @app.activity(retry=tether.Retry(attempts=1))
    async def charge(cents: int) -> int:
        calls.append(cents)
        return cents

    @app.workflow
    async def bill(cents: int) -> int:
        return await charge(cents)

    assert await app.disable("activity", "charge", reason="card processor incident", by="ann")
    assert not await app.disable("activity", "charge")  # already off
    async with app.worker(poll_interval=0.05) as w:
        run = await app.start(bill, 100)
        await eventually(held(w, 2), 15, "the step held twice")
        assert calls == []  # never ran, on any attempt
        assert EventType.ACTIVITY_COMPLETED not in await event_types(app, run.run_id)
        assert (await app.get(run.run_id)).status is tether.RunStatus.RUNNING
        assert await app.switches() == [
            {
                "kind": "activity",
                "name": "charge",
                "by": "ann",
                "reason": "card processor incident",
                "since": (await app.switches())[0]["since"],
            }
        ]
        assert await app.enable("activity", "charge", by="bob")
        assert await run.result(timeout=20) == 100  # attempts=1: the holds used none
    assert calls == [100]
    log = await app.audit_log(target="activity:charge")
    assert [(e["actor"], e["action"]) for e in log] == [("bob", "switch on"), ("ann", "switch off")]
    assert log[1]["detail"] == {"reason": "card processor incident"}


async def test_a_workflow_switched_off_does_not_start_and_a_tenant_gets_no_new_runs(
    app: tether.App,
) -> None:
    @app.activity
    async def step() -> str:
        return "done"

    @app.workflow
    async def flow() -> str:
        return await step()

    await app.disable("workflow", "flow")
    await app.disable("tenant", "acme", reason="unpaid")
    async with app.worker(poll_interval=0.05) as w:
        run = await app.start(flow)  # stored, but no worker starts it
        await eventually(held(w, 1), 15, "the hold")
        assert await event_types(app, run.run_id) == [EventType.WORKFLOW_STARTED]
        with pytest.raises(tether.SwitchedOffError, match="tenant 'acme' is switched off"):
            await app.start(flow, tenant="acme")
        assert await app.list(tenant="acme") == []  # refused: nothing was created
        await app.start(flow, tenant="globex")  # other tenants go on
        await app.enable("workflow", "flow")
        assert await run.result(timeout=20) == "done"
    with pytest.raises(tether.ConfigurationError, match="a switch is one of"):
        await app.disable("queue", "default")


async def test_a_model_switched_off_holds_its_calls_not_other_models(app: tether.App) -> None:
    gw = ai.Gateway(app, retry=tether.Retry(attempts=1), timeout=10)
    cheap = gw.model("cheap", ai.ScriptedModel(["cheap answer"]))
    big = gw.model("big", ai.ScriptedModel(["big answer"]))

    @app.workflow
    async def ask(which: str) -> str:
        return await ai.complete(cheap if which == "cheap" else big, "hello")

    await app.disable("model", "big", reason="provider outage")
    async with app.worker(poll_interval=0.05) as w:
        waiting = await app.start(ask, "big")
        other = await app.start(ask, "cheap")
        assert await other.result(timeout=20) == "cheap answer"
        await eventually(held(w, 1), 15, "the hold")
        assert (await app.get(waiting.run_id)).status is tether.RunStatus.RUNNING
        await app.enable("model", "big")
        assert await waiting.result(timeout=20) == "big answer"


def _signal_then_step(app: tether.App) -> tether.Workflow[[int], int]:
    """A workflow that waits for the signal ``go``, then runs one step returning ``n``."""

    @app.activity
    async def step(n: int) -> int:
        return n

    @app.workflow
    async def two(n: int) -> int:
        await tether.wait_event("go")
        return await step(n)

    return two


async def test_a_tenant_switched_off_holds_its_live_runs_too(app: tether.App) -> None:
    two = _signal_then_step(app)
    async with app.worker(poll_interval=0.05) as w:
        acme = await app.start(two, 1, tenant="acme")
        other = await app.start(two, 2, tenant="globex")
        await eventually(
            lambda: _waiting(app, acme.run_id), 10, "the acme run waiting for its signal"
        )
        await app.disable("tenant", "acme")
        await app.signal(acme.run_id, "go")
        await app.signal(other.run_id, "go")
        assert await other.result(timeout=20) == 2  # another tenant goes on
        await eventually(held(w, 1), 15, "the acme run held")
        assert (await app.get(acme.run_id)).status is tether.RunStatus.RUNNING
        await app.enable("tenant", "acme")
        assert await acme.result(timeout=20) == 1


async def test_a_held_tenants_task_is_checked_without_reading_its_run(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    # while a tenant is switched off, every task claimed is checked against it: the
    # check read (and opened) the whole run each time, its input and output included
    two = _signal_then_step(app)
    async with app.worker(poll_interval=0.05) as w:
        acme = await app.start(two, 1, tenant="acme")
        await eventually(
            lambda: _waiting(app, acme.run_id), 10, "the acme run waiting for its signal"
        )
        await app.disable("tenant", "acme")
        reads: list[str] = []
        real = app.store.get_run

        async def counted(run_id: str, **kw: Any) -> Any:
            reads.append(run_id)
            return await real(run_id, **kw)

        monkeypatch.setattr(app.store, "get_run", counted)
        await app.signal(acme.run_id, "go")
        await eventually(held(w, 2), 15, "the acme run held twice")
        assert reads == []
        monkeypatch.undo()
        await app.enable("tenant", "acme")
        assert await acme.result(timeout=20) == 1


async def _steps_done(app: tether.App, run_id: str) -> Counter[int | None]:
    """How many times each step of the run completed."""
    return Counter(
        e.step for e in await app.history(run_id) if e.type is EventType.ACTIVITY_COMPLETED
    )


@pytest.mark.parametrize("kind", ["workflow", "tenant"])
async def test_a_live_run_switched_off_stops_after_its_current_step_and_resumes_once(
    app: tether.App, kind: str
) -> None:
    # a run moving step to step on one worker rides the one-commit path (its next
    # workflow task and step come with each result): the switch must stop it there too
    @app.activity
    async def step(i: int) -> int:
        await asyncio.sleep(0.02)
        return i

    @app.workflow
    async def many(n: int) -> int:
        total = 0
        for i in range(n):
            total += await step(i)
        return total

    name = "many" if kind == "workflow" else "acme"
    async with app.worker(poll_interval=0.05) as w:
        run = await app.start(many, 60, tenant="acme")

        async def some_done() -> bool:
            return len(await _steps_done(app, run.run_id)) >= 3

        await eventually(some_done, 15, "three steps done")
        await app.disable(kind, name, reason="incident")
        at_flip = len(await _steps_done(app, run.run_id))
        await eventually(held(w, 1), 15, "the run held")
        await asyncio.sleep(0.6)  # 30 steps' time: none may run
        held_at = len(await _steps_done(app, run.run_id))
        # the step in flight ends; on a loaded machine the step before it may have been
        # done but its result still on the way to the store when at_flip was read: no more
        assert held_at <= at_flip + 2, (at_flip, held_at)
        info = await app.get(run.run_id)
        assert info.status is tether.RunStatus.RUNNING
        assert info.task_error is not None and f"{kind} {name!r} is switched off" in (
            info.task_error
        )
        assert engine_made(info.task_error)  # names only: shown whole to monitor keys
        await app.enable(kind, name)
        assert await run.result(timeout=30) == sum(range(60))
    done = await _steps_done(app, run.run_id)
    assert len(done) == 60
    assert set(done.values()) == {1}  # every step ran to completion exactly once
    assert (await app.get(run.run_id)).task_error is None  # the note went with the hold


async def _waiting(app: tether.App, run_id: str) -> bool:
    return bool((await app.get(run_id)).waiting_on)


async def test_switching_off_a_name_the_app_lacks_is_refused(app: tether.App) -> None:
    # an App that registers nothing (a client of the store) cannot tell: any name goes
    assert await app.disable("workflow", "made-up")
    assert await app.enable("workflow", "made-up")

    @app.activity
    async def step() -> str:
        return "done"

    @app.workflow
    async def flow() -> str:
        return await step()

    for kind, name in [("workflow", "flwo"), ("activity", "stpe"), ("workflow", " ")]:
        with pytest.raises(tether.ConfigurationError, match="switch"):
            await app.disable(kind, name)
    with pytest.raises(tether.ConfigurationError, match="its workflow names: flow"):
        await app.disable("workflow", "flwo")
    assert await app.switches() == []  # nothing was written
    assert await app.disable("model", "any")  # no gateway: models are not known here
    gw = ai.Gateway(app)
    gw.model("cheap", ai.ScriptedModel(["x"]))
    with pytest.raises(tether.ConfigurationError, match=r"no model 'big'.*cheap"):
        await app.disable("model", "big")
    assert await app.disable("model", "cheap")
    assert await app.disable("tenant", "anyone")  # a tenant is any name runs start with
    assert await app.enable("model", "any")  # switching back on takes any name


async def test_a_worker_on_a_store_that_cannot_open_says_only_why(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A SQLite path in a folder that does not exist: the worker's start raises the
    store's own error, with no warning first that reading the kill switches failed."""
    app = tether.App(store=f"sqlite:///{tmp_path / 'no-such-dir' / 'x.db'}")

    @app.workflow
    async def hello() -> str:
        return "hi"

    with pytest.raises(tether.StoreError, match="does not exist; create it"):
        async with app.worker():
            pass
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
