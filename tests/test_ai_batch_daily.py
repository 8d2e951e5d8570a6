"""A batch's estimate is held in the day's spend of its tenant's (and the global) daily
budget from its submit to its fetch, as a single call's is from its check to its
answer: a second batch (or a call) meanwhile sees it and is refused past the budget;
the fetch replaces the estimate with what the batch used; a batch that failed, expired
or was cancelled at the provider gives it back; a worker killed between submit and
fetch neither holds it twice nor loses it (``tether.testing.ModelServer``'s fake batch
API, both stores)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tether
from helpers import eventually
from tether import EventType, ai
from tether._usage import CALL_KEY
from tether.ai._batch import BatchJobs
from tether.testing import ModelServer, model_reply

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).parent

#: what each item of a batch uses (the fake provider's answer)
USED = 50 + 100


def _setup(app: tether.App, server: ModelServer, **batch_kw: Any) -> tuple[Any, Any, Any]:
    server.default = lambda body: model_reply("a", input_tokens=50, output_tokens=100)
    gw = ai.Gateway(app, retry=tether.Retry(attempts=3, initial=0.05), timeout=10)
    m = gw.model("m", ai.openai_compatible("gpt-4o-mini", base_url=server.base_url, api_key="k"))

    @app.workflow
    async def nightly(keys: list[str]) -> dict[str, Any]:
        try:
            res = await ai.batch(
                m,
                {k: f"q{k}" for k in keys},
                poll=0.1,
                max_poll=0.2,
                max_tokens=100,
                **batch_kw,
            )
        except ai.BudgetExceeded as exc:
            return {"refused": f"{exc.scope} {exc.what}"}
        return dataclasses.asdict(res)

    @app.workflow
    async def one_call() -> str:
        try:
            return await ai.complete(m, "one", settings={"max_tokens": 100})
        except ai.BudgetExceeded as exc:
            return f"refused {exc.scope} {exc.what}"

    return gw, nightly, one_call


async def _submitted(app: tether.App, run_id: str) -> dict[str, Any] | None:
    for e in await app.history(run_id):
        result = e.data.get("result") if e.type is EventType.ACTIVITY_COMPLETED else None
        if isinstance(result, dict) and "batch_id" in result:
            return result
    return None


async def _spent(gw: Any, scope: str) -> int:
    (row,) = [b for b in await gw.budgets() if b["scope"] == scope]
    return int(row["spent_tokens"])


async def _used(app: tether.App, run_id: str) -> int:
    return sum(
        e.data["result"][CALL_KEY]["input_tokens"] + e.data["result"][CALL_KEY]["output_tokens"]
        for e in await app.history(run_id)
        if e.type is EventType.ACTIVITY_COMPLETED and CALL_KEY in (e.data.get("result") or {})
    )


@pytest.mark.parametrize("tenant", ["acme", None])
async def test_a_batch_in_flight_holds_its_estimate_in_the_day_so_a_second_is_refused(
    app: tether.App, tenant: str | None
) -> None:
    """A daily budget of 300 tokens fits one batch of two items (estimated at ~206) but
    not two: the second batch, submitted while the first runs, is refused, and so is a
    call (~103); once the first is fetched the day holds what it used (300), not its
    estimate, nor both."""
    scope = f"tenant:{tenant}" if tenant else "global"
    with ModelServer() as server:
        server.batches.complete_after = 2.0
        gw, nightly, one_call = _setup(app, server)
        await gw.set_budget(tenant=tenant, tokens=300)
        kw: dict[str, Any] = {"tenant": tenant} if tenant else {}
        async with app.worker(poll_interval=0.05):
            first = await app.start(nightly, ["a", "b"], **kw)
            await eventually(lambda: _submitted(app, first.run_id), 20, "the first batch")
            held = await _spent(gw, scope)
            assert 200 < held < 300  # the first batch's estimate, held while it runs
            second = await app.start(nightly, ["c", "d"], **kw)
            assert await second.result(timeout=30) == {"refused": f"{scope} tokens"}
            call = await app.start(one_call, **kw)
            assert await call.result(timeout=30) == f"refused {scope} tokens"
            out = await first.result(timeout=30)
        assert sorted(out["results"]) == ["a", "b"]
        assert server.batches.created == 1
        assert await _used(app, first.run_id) == 2 * USED
        assert await _spent(gw, scope) == 2 * USED  # the estimate replaced, not added to


@pytest.mark.parametrize("status", ["failed", "expired", "cancelled"])
async def test_a_batch_that_ends_without_answers_gives_its_estimate_back(
    app: tether.App, status: str
) -> None:
    """A batch the provider failed, expired or cancelled used nothing: the estimate it
    held in the day is given back when its (empty) results are fetched."""
    with ModelServer() as server:
        server.batches.complete_after = 0.5
        server.batches._complete = lambda b: b.update(status=status)  # type: ignore[method-assign]
        gw, nightly, _one = _setup(app, server, resubmits=0)
        await gw.set_budget(tenant="acme", tokens=300)
        async with app.worker(poll_interval=0.05):
            run = await app.start(nightly, ["a", "b"], tenant="acme")
            await eventually(lambda: _submitted(app, run.run_id), 20, "the batch")
            assert await _spent(gw, "tenant:acme") > 200  # held while it runs
            out = await run.result(timeout=30)
        assert out["results"] == {} and sorted(out["failed"]) == ["a", "b"]
        assert await _spent(gw, "tenant:acme") == 0


async def test_a_worker_killed_between_submit_and_fetch_holds_the_estimate_once(
    app: tether.App,
) -> None:
    """The worker dies after the submit was recorded: the next one replays it (reserving
    nothing again), polls the same batch and settles the estimate it held once."""
    with ModelServer() as server:
        server.batches.complete_after = 2.0
        gw, nightly, _one = _setup(app, server)
        await gw.set_budget(tenant="acme", tokens=300)
        first = app.worker(poll_interval=0.05, lease=1.0)
        await first.start()
        run = await app.start(nightly, ["a", "b"], tenant="acme")
        await eventually(lambda: _submitted(app, run.run_id), 20, "the batch")
        held = await _spent(gw, "tenant:acme")
        await first.kill()  # like SIGKILL, between submit and fetch
        assert await _spent(gw, "tenant:acme") == held
        second = app.worker(poll_interval=0.05, lease=1.0)
        await second.start()
        try:
            out = await run.result(timeout=60)
        finally:
            await second.stop()
        assert sorted(out["results"]) == ["a", "b"] and server.batches.created == 1
        assert await _spent(gw, "tenant:acme") == 2 * USED


@pytest.mark.parametrize("created", [False, True])
async def test_a_submit_attempt_that_failed_after_holding_leaves_the_estimate_held_once(
    app: tether.App, created: bool
) -> None:
    """A submit attempt that failed after it held the estimate (the create request got no
    answer: the provider made the batch or not) keeps it held, noted for the retry, which
    reuses it (for the batch it finds again, too) rather than holding it again: the day
    ends with what the batch used."""
    with ModelServer() as server:
        server.batches.complete_after = 0.3
        real_create = server.batches.create
        failed = {"n": 0}

        def create_once_failing(body: dict[str, Any]) -> dict[str, Any]:
            made = real_create(body) if created else None
            if failed["n"] == 0:
                failed["n"] += 1
                raise ConnectionResetError("no answer")
            return made if made is not None else real_create(body)

        server.batches.create = create_once_failing  # type: ignore[method-assign]
        gw, nightly, _one = _setup(app, server)
        await gw.set_budget(tenant="acme", tokens=300)
        async with app.worker(poll_interval=0.05):
            run = await app.start(nightly, ["a", "b"], tenant="acme")
            out = await run.result(timeout=60)
        assert sorted(out["results"]) == ["a", "b"] and out["batches"] == ["batch_1"]
        assert (await _submitted(app, run.run_id) or {}).get("found_again") is created
        assert await _spent(gw, "tenant:acme") == 2 * USED


async def test_a_batch_fetched_the_next_day_gives_its_estimate_back_to_the_day_it_held_it(
    app: tether.App,
) -> None:
    """Submitted one UTC day, fetched the next: the estimate goes back to the first day
    (which ends with nothing spent), what the batch used counts on the day it is fetched."""
    with ModelServer() as server:
        server.batches.complete_after = 0.5
        gw, nightly, _one = _setup(app, server, deadline=3 * 86_400)
        await gw.set_budget(tenant="acme", tokens=300)
        real_clock, shift = app.store.clock, {"s": 0.0}
        app.store.clock = lambda: real_clock() + shift["s"]  # type: ignore[misc]
        async with app.worker(poll_interval=0.05):
            run = await app.start(nightly, ["a", "b"], tenant="acme")
            submitted = await eventually(lambda: _submitted(app, run.run_id), 20, "the batch")
        held = submitted["daily_held"]
        first_day = held["day"]
        assert held["scopes"] == ["tenant:acme"] and held["tokens"] > 200
        shift["s"] = 86_400.0  # the worker that fetches runs a day later
        async with app.worker(poll_interval=0.05):
            out = await run.result(timeout=30)
        assert sorted(out["results"]) == ["a", "b"]
        spent = {
            day: dict((s, t) for s, t, _c in await app.store.spend_on(day))
            for day in (
                first_day,
                time.strftime("%Y-%m-%d", time.gmtime(app.store.clock())),
            )
        }
        assert list(spent.values()) == [{"tenant:acme": 0}, {"tenant:acme": 2 * USED}]


@pytest.mark.parametrize("moment", ["upload", "after_create"])
async def test_a_worker_sigkilled_inside_the_submit_holds_the_estimate_once(
    store_url: str, moment: str
) -> None:
    """A worker process SIGKILLed inside the submit step, after it held the estimate: while
    it uploads the file (no batch yet), or after the provider made the batch but before
    the submit was recorded. The next attempt reuses the hold its step recorded (no second
    reservation, no second check): a tenant's budget of 300 fits the batch (~218) once,
    the run completes (the second attempt finds the batch made before the kill, or makes
    it) and the day ends with what the batch used, not with a leaked estimate."""
    sys.path.insert(0, str(HERE))
    try:
        import ai_batch_hold_app
    finally:
        sys.path.remove(str(HERE))
    with ModelServer() as server:
        server.default = lambda body: model_reply("a", input_tokens=50, output_tokens=100)
        server.batches.complete_after = 0.3
        child: dict[str, subprocess.Popen[bytes]] = {}
        killed = threading.Event()

        def kill_worker() -> None:
            if not killed.is_set():
                proc = child["p"]
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                killed.set()

        real_upload, real_create = server.batches.upload, server.batches.create

        def upload(*args: Any) -> dict[str, Any]:
            if moment == "upload":
                kill_worker()  # the estimate is held, no batch made yet
            return real_upload(*args)

        def create(body: dict[str, Any]) -> dict[str, Any]:
            made = real_create(body)
            if moment == "after_create":
                kill_worker()  # the provider has the batch; the submit is not recorded
            return made

        server.batches.upload = upload  # type: ignore[method-assign]
        server.batches.create = create  # type: ignore[method-assign]
        app, gw, nightly = ai_batch_hold_app.build(store_url, server.base_url)
        try:
            await gw.set_budget(tenant="acme", tokens=300)
            env = {**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}"}
            child["p"] = subprocess.Popen(
                [sys.executable, str(HERE / "ai_batch_hold_app.py"), store_url, server.base_url],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                run = await app.start(nightly, ["a", "b"], tenant="acme")

                async def was_killed() -> bool:
                    return killed.is_set()

                await eventually(was_killed, 30, "the worker killed inside the submit")
                assert child["p"].returncode == -signal.SIGKILL
                assert 200 < await _spent(gw, "tenant:acme") < 300  # held, once
                async with app.worker(poll_interval=0.05, lease=1.0):
                    out = await run.result(timeout=60)
            finally:
                if child["p"].poll() is None:
                    child["p"].kill()
                    child["p"].wait(10)
            assert out == ["a", "b"]
            assert server.batches.created == 1
            assert await _spent(gw, "tenant:acme") == 2 * USED
        finally:
            await app.close()


@pytest.mark.parametrize("remove", ["purge", "erase"])
async def test_a_run_cancelled_while_its_batch_is_created_keeps_the_estimate_held(
    app: tether.App, remove: str
) -> None:
    """The run is cancelled while the create request is in flight (the provider made the
    batch, which it will run and bill; its answer is slow): the submit keeps the estimate
    in the day (nothing will fetch the batch), rather than giving it back and leaving the
    day at 0 for a batch that ran. The record of the hold goes with the run when it is
    purged, or its tenant erased: no row is left naming it."""
    with ModelServer() as server:
        server.batches.complete_after = 0.3
        real_create = server.batches.create

        def slow_create(body: dict[str, Any]) -> dict[str, Any]:
            made = real_create(body)  # the provider has it
            time.sleep(1.5)  # its answer is slow to come back
            return made

        server.batches.create = slow_create  # type: ignore[method-assign]
        gw, nightly, _one = _setup(app, server)
        await gw.set_budget(tenant="acme", tokens=300)
        async with app.worker(poll_interval=0.05):
            run = await app.start(nightly, ["a", "b"], tenant="acme")

            async def made() -> bool:
                return server.batches.created == 1

            await eventually(made, 20, "the batch made")
            held = await _spent(gw, "tenant:acme")
            assert 200 < held < 300
            await app.cancel(run.run_id, "changed my mind")
            with pytest.raises(tether.RunCancelledError):
                await run.result(timeout=20)
            await asyncio.sleep(2.0)  # the submit is cancelled; the create's answer comes
        assert server.batches.created == 1
        assert await _spent(gw, "tenant:acme") == held
        assert [h[0] for h in await _holds(app)] == [run.run_id]
        if remove == "purge":
            assert (await app.purge(0))["ai_holds"] == 1
        else:
            assert (await app.erase_tenant("acme"))["ai_holds"] == 1
        assert await _holds(app) == []
        assert set((await app.store.orphans()).values()) == {0}


async def test_a_batch_the_provider_refused_gives_its_estimate_back(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The create answered a refusal (400, not retried): no batch exists, the estimate
    is given back: the day ends at 0."""
    import httpx
    import openai

    with ModelServer() as server:
        gw, nightly, _one = _setup(app, server)
        await gw.set_budget(tenant="acme", tokens=300)
        jobs = gw.extensions["batch"]
        real_client = jobs._client
        refused = {"n": 0}

        async def refuse(**kw: Any) -> Any:
            refused["n"] += 1
            request = httpx.Request("POST", f"{server.base_url}/batches")
            raise openai.BadRequestError(
                "refused", response=httpx.Response(400, request=request), body=None
            )

        def client_refusing(model: str) -> Any:
            ref, client = real_client(model)
            monkeypatch.setattr(client.batches, "create", refuse)
            return ref, client

        monkeypatch.setattr(jobs, "_client", client_refusing)
        async with app.worker(poll_interval=0.05):
            run = await app.start(nightly, ["a", "b"], tenant="acme")
            with pytest.raises(tether.WorkflowFailedError, match="BadRequestError"):
                await run.result(timeout=60)
        assert refused["n"] == 1 and server.batches.created == 0
        assert await _spent(gw, "tenant:acme") == 0


@pytest.mark.parametrize("end", ["stop", "kill"])
async def test_a_worker_ended_while_the_hold_is_written_leaves_it_held_once(
    app: tether.App, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """The submit's hold reached the store, but its answer had not come back (3 s) when
    the worker ended (nothing sent): the attempt gives the hold back once it is written.
    The step goes on meanwhile (stopped: handed back; killed: its lease ran out): the
    next attempt takes the hold over, and the late give-back leaves it (it once took the
    hold from under the running batch: the day ended 218 short, 82 for 300 used). The
    day ends with what the batch used, and no hold is left."""
    with ModelServer() as server:
        server.batches.complete_after = 4.0
        gw, nightly, _one = _setup(app, server)
        await gw.set_budget(tenant="acme", tokens=10_000)
        store = app.store
        real = type(store).hold_model_spend
        written = asyncio.Event()

        async def slow_answer(self: Any, *args: Any, **kw: Any) -> Any:
            out = await real(self, *args, **kw)  # committed
            if not written.is_set():
                written.set()
                await asyncio.sleep(3)  # its answer slow to come back
            return out

        monkeypatch.setattr(type(store), "hold_model_spend", slow_answer)
        first = app.worker(poll_interval=0.05, lease=1.0)
        await first.start()
        run = await app.start(nightly, ["a", "b"], tenant="acme")
        await asyncio.wait_for(written.wait(), 20)
        if end == "stop":
            await first.stop(grace=0.1)  # the attempt is cancelled, handed back
            ending: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            ending.set_result(None)
        else:  # like SIGKILL, but the attempt's give-back still runs: a late one
            ending = asyncio.ensure_future(first.kill())
        second = app.worker(poll_interval=0.05, lease=1.0)
        await second.start()
        try:
            out = await run.result(timeout=60)
        finally:
            await second.stop(grace=1)
            await ending
        assert sorted(out["results"]) == ["a", "b"]
        assert server.batches.created == 1
        assert await _spent(gw, "tenant:acme") == 2 * USED
        assert await _holds(app) == []


async def test_a_run_ended_between_the_hold_and_the_create_gives_the_estimate_back(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run is terminated after the submit's hold is written but before its answer
    comes back (3 s), so the create is never sent: the run's tasks are gone, the attempt
    is cancelled and gives the estimate back (its hold's record names it, and no later
    attempt took it over). It was once refused for the task gone, and the estimate stayed
    in the day's spend until the day rolled over."""
    with ModelServer() as server:
        gw, nightly, _one = _setup(app, server)
        await gw.set_budget(tenant="acme", tokens=10_000)
        before = await _spent(gw, "tenant:acme")
        store = app.store
        real = type(store).hold_model_spend
        written = asyncio.Event()

        async def slow_answer(self: Any, *args: Any, **kw: Any) -> Any:
            out = await real(self, *args, **kw)  # committed
            if not written.is_set():
                written.set()
                await asyncio.sleep(3)  # its answer slow to come back
            return out

        monkeypatch.setattr(type(store), "hold_model_spend", slow_answer)
        async with app.worker(poll_interval=0.05, lease=1.0):
            run = await app.start(nightly, ["a", "b"], tenant="acme")
            await asyncio.wait_for(written.wait(), 20)
            assert await _spent(gw, "tenant:acme") > before  # held
            await app.terminate(run.run_id, "changed my mind")
            with pytest.raises(tether.RunTerminatedError):
                await run.result(timeout=20)

            async def given_back() -> bool:
                return await _spent(gw, "tenant:acme") == before and await _holds(app) == []

            await eventually(given_back, 10, "the estimate given back")
        assert server.batches.created == 0  # the create was never sent
        assert await _spent(gw, "tenant:acme") == before
        assert await _holds(app) == []


async def test_a_hold_that_reaches_the_store_late_takes_nothing_from_the_next_attempt(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The submit's hold is slow to reach the store (3 s: a slow read before it, lock
    waits) and the worker is stopped meanwhile: the next attempt holds the estimate and
    submits the batch before the stopped attempt's hold lands. That late hold is refused
    (its attempt lost the task), as is its give-back: it once took the hold over and
    gave it back from under the running batch (the day ended at 82 for 300 used)."""
    with ModelServer() as server:
        server.batches.complete_after = 6.0
        gw, nightly, _one = _setup(app, server)
        await gw.set_budget(tenant="acme", tokens=10_000)
        store = app.store
        real = type(store).hold_model_spend
        sent = asyncio.Event()

        async def slow_to_land(self: Any, *args: Any, **kw: Any) -> Any:
            if not sent.is_set():
                sent.set()
                await asyncio.sleep(3)  # reaches the store late
            return await real(self, *args, **kw)

        monkeypatch.setattr(type(store), "hold_model_spend", slow_to_land)
        first = app.worker(poll_interval=0.05, lease=1.0)
        await first.start()
        run = await app.start(nightly, ["a", "b"], tenant="acme")
        await asyncio.wait_for(sent.wait(), 20)
        await first.stop(grace=0.1)  # the attempt is cancelled, handed back
        second = app.worker(poll_interval=0.05, lease=1.0)
        await second.start()
        try:
            await eventually(lambda: _submitted(app, run.run_id), 20, "the batch")
            out = await run.result(timeout=60)
        finally:
            await second.stop(grace=1)
        assert sorted(out["results"]) == ["a", "b"]
        assert server.batches.created == 1
        assert await _spent(gw, "tenant:acme") == 2 * USED
        assert await _holds(app) == []


@pytest.mark.parametrize("case", ["given_back", "older_build"])
async def test_the_fetch_gives_back_what_the_hold_still_holds(
    app: tether.App, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The fetch's commit replaces the batch's estimate with what it used by giving back
    what the store's record of the hold still holds: a hold given back already (here by
    hand, while the batch runs) is not subtracted a second time (the commit once took
    the estimate its submit recorded: the day ended at 82 for 300 used). A submit
    recorded by an older build (no record, unmarked) has the estimate it recorded
    given back."""
    with ModelServer() as server:
        server.batches.complete_after = 2.0
        gw, nightly, _one = _setup(app, server)
        await gw.set_budget(tenant="acme", tokens=10_000)
        if case == "older_build":
            real = BatchJobs._hold_daily

            async def as_older(self: Any, ctx: Any, *args: Any, **kw: Any) -> Any:
                out = await real(self, ctx, *args, **kw)
                out.pop("held_by_step", None)  # unmarked, kept nowhere but in the result

                def drop(tx: Any) -> None:
                    tx.execute("DELETE FROM ai_holds WHERE run_id = ?", (ctx.run_id,))

                await app.store._do(drop)  # type: ignore[attr-defined]
                return out

            monkeypatch.setattr(BatchJobs, "_hold_daily", as_older)
        async with app.worker(poll_interval=0.05):
            run = await app.start(nightly, ["a", "b"], tenant="acme")
            await eventually(lambda: _submitted(app, run.run_id), 20, "the batch")
            assert 200 < await _spent(gw, "tenant:acme") < 300
            if case == "given_back":

                def holder(tx: Any) -> tuple[Any, ...]:
                    return tuple(tx.execute("SELECT step, holder FROM ai_holds").fetchone())

                step, who = await app.store._do(holder, write=False)  # type: ignore[attr-defined]
                assert await app.store.release_model_hold(run.run_id, step, who)
                assert await _spent(gw, "tenant:acme") == 0
            out = await run.result(timeout=30)
        assert sorted(out["results"]) == ["a", "b"]
        assert await _spent(gw, "tenant:acme") == 2 * USED
        assert await _holds(app) == []


async def test_a_hold_for_a_run_that_is_gone_is_refused(app: tether.App) -> None:
    """A submit's hold that reaches the store after a purge (or a tenant erasure)
    removed its run holds nothing and records nothing: no row of the removed run comes
    back (the orphan check stays at zero), the day's spend is left as it was."""

    @app.workflow
    async def quick() -> int:
        return 1

    with ModelServer() as server:
        gw, _nightly, _one = _setup(app, server)
        await gw.set_budget(tenant="acme", tokens=10_000)
        async with app.worker(poll_interval=0.05):
            run = await app.start(quick, tenant="acme")
            assert await run.result(timeout=20) == 1
        assert (await app.purge(0))["runs"] == 1
        day = time.strftime("%Y-%m-%d", time.gmtime())
        refused: BaseException | None = None
        try:
            await app.store.hold_model_spend(
                run.run_id, 1, "late", ("tenant:acme",), day, 200, "0", "add"
            )
        except tether.RunNotFoundError as exc:
            refused = exc
        assert await _holds(app) == []
        assert set((await app.store.orphans()).values()) == {0}
        assert await _spent(gw, "tenant:acme") == 0
        assert refused is not None


async def _holds(app: tether.App) -> list[tuple[Any, ...]]:
    """The store's rows of batch holds kept by step (run, step, tokens)."""

    def read(tx: Any) -> list[tuple[Any, ...]]:
        rows = tx.execute("SELECT run_id, step, tokens FROM ai_holds ORDER BY run_id, step")
        return [tuple(r) for r in rows.fetchall()]

    got: list[tuple[Any, ...]] = await app.store._do(read, write=False)  # type: ignore[attr-defined]
    return got


async def test_a_worker_sigkilled_right_after_the_hold_holds_the_estimate_once(
    store_url: str,
) -> None:
    """A worker process SIGKILLed right after the store committed the hold of the batch's
    estimate, before the submit noted it anywhere else (the note once went to the step's
    heartbeat, in a later commit: lost, the next attempt held the estimate again and, at
    ~218 twice for a budget of 300, refused its own batch). The hold is kept by step, in
    the reservation's own transaction: the next attempt reuses it; the day holds the
    estimate once while the batch runs, then what it used, and no hold row is left."""
    sys.path.insert(0, str(HERE))
    try:
        import ai_batch_hold_app
    finally:
        sys.path.remove(str(HERE))
    with ModelServer() as server:
        server.default = lambda body: model_reply("a", input_tokens=50, output_tokens=100)
        server.batches.complete_after = 2.0
        app, gw, nightly = ai_batch_hold_app.build(store_url, server.base_url)
        try:
            await gw.set_budget(tenant="acme", tokens=300)
            env = {**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}"}
            child = subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "ai_batch_hold_app.py"),
                    store_url,
                    server.base_url,
                    "held",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                run = await app.start(nightly, ["a", "b"], tenant="acme")
                await asyncio.to_thread(child.wait, 60)
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait(10)
            assert child.returncode == -signal.SIGKILL
            held = await _spent(gw, "tenant:acme")
            assert 200 < held < 300 and server.batches.created == 0  # held, nothing sent

            async def submitted_or_ended() -> Any:
                got = await _submitted(app, run.run_id)
                ended = (await app.get(run.run_id)).status.is_terminal
                return got or (ended and {"ended": await run.result(timeout=5)})

            async with app.worker(poll_interval=0.05, lease=1.0):
                got = await eventually(submitted_or_ended, 30, "the batch")
                assert "batch_id" in got, got
                assert await _spent(gw, "tenant:acme") == held  # still once
                out = await run.result(timeout=60)
            assert out == ["a", "b"] and server.batches.created == 1
            assert await _spent(gw, "tenant:acme") == 2 * USED
            assert await _holds(app) == []
        finally:
            await app.close()


@pytest.mark.parametrize("created", [False, True])
async def test_a_replayed_dead_letter_of_a_batch_submit_holds_the_estimate_once(
    app: tether.App, monkeypatch: pytest.MonkeyPatch, created: bool
) -> None:
    """Every attempt of the submit lost the create's answer (the provider made the batch,
    or not): the estimate stays held (the batch may run), the step is dead-lettered and
    the run fails. The operator replays the letter: the replayed step reuses the hold its
    failed attempts left rather than taking a second one (which, at ~218 twice for a
    budget of 300, refused the batch; or, for a batch found again, left the day 218 over
    what was used for ever)."""
    with ModelServer() as server:
        server.batches.complete_after = 0.3
        real_create = server.batches.create
        calls = {"n": 0, "broken": True}

        def create(body: dict[str, Any]) -> dict[str, Any]:
            calls["n"] += 1
            if not calls["broken"]:
                return real_create(body)
            if created and calls["n"] == 2:  # the last attempt's batch (found on replay)
                real_create(body)
            raise ConnectionResetError("no answer")

        server.batches.create = create  # type: ignore[method-assign]
        gw, nightly, _one = _setup(app, server)
        jobs = gw.extensions["batch"]
        quick = {**jobs.submit.options_json, "retry": tether.Retry(attempts=2, initial=0.05)}
        quick["retry"] = quick["retry"].to_json()
        monkeypatch.setattr(jobs.submit, "options_json", quick)
        await gw.set_budget(tenant="acme", tokens=300)
        async with app.worker(poll_interval=0.05):
            run = await app.start(nightly, ["a", "b"], tenant="acme")
            with pytest.raises(tether.WorkflowFailedError, match="APIConnectionError"):
                await run.result(timeout=60)
            held = await _spent(gw, "tenant:acme")
            assert 200 < held < 300  # kept: the batch may exist
            (letter,) = [d for d in await app.dead_letters() if d.kind == "activity"]
            calls["broken"] = False
            await app.replay_dead_letter(letter.id)
            out = await run.result(timeout=60)
        assert sorted(out.get("results") or {}) == ["a", "b"], out
        assert server.batches.created == 1
        assert await _spent(gw, "tenant:acme") == 2 * USED
        assert await _holds(app) == []


async def test_a_hold_noted_by_a_version_15_worker_is_held_once_after_the_upgrade(
    store_url: str,
) -> None:
    """A version-15 store (no ``ai_holds``) whose batch submit attempt held the estimate
    and noted it in its heartbeat, as builds of that version did, then died. Opened by
    this build (upgraded to 16), the next attempt takes the noted hold into the store
    rather than holding it again (which, at ~218 twice for a budget of 300, refused its
    own batch): the day ends with what the batch used, and no hold is left."""
    sys.path.insert(0, str(HERE))
    try:
        import ai_batch_hold_app
    finally:
        sys.path.remove(str(HERE))
    with ModelServer() as server:
        server.default = lambda body: model_reply("a", input_tokens=50, output_tokens=100)
        server.batches.complete_after = 0.3
        app, gw, nightly = ai_batch_hold_app.build(store_url, server.base_url)
        await gw.set_budget(tenant="acme", tokens=300)
        env = {**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}"}
        argv = [sys.executable, str(HERE / "ai_batch_hold_app.py"), store_url, server.base_url]
        child = subprocess.Popen(
            [*argv, "held"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            run = await app.start(nightly, ["a", "b"], tenant="acme")
            await asyncio.to_thread(child.wait, 60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
        assert child.returncode == -signal.SIGKILL
        held = await _spent(gw, "tenant:acme")
        assert 200 < held < 300

        def as_version_15(tx: Any, run_id: str, sqlite: bool) -> None:
            """The hold as a version-15 worker kept it: in its step's heartbeat."""
            scopes, day, tokens, cost = tx.execute(
                "SELECT scopes, day, tokens, cost FROM ai_holds WHERE run_id = ?", (run_id,)
            ).fetchone()
            note = {"scopes": json.loads(scopes), "day": day, "tokens": tokens, "cost": cost}
            tx.execute(
                "UPDATE tasks SET heartbeat = ? WHERE run_id = ? AND kind = 'activity'",
                (json.dumps({"daily_held": note}), run_id),
            )
            tx.execute("DROP TABLE ai_holds")
            if sqlite:
                tx.execute("PRAGMA user_version = 15")
            else:
                tx.execute("UPDATE tether_meta SET version = 15")

        sqlite = store_url.startswith("sqlite")
        await app.store._do(as_version_15, run.run_id, sqlite)  # type: ignore[attr-defined]
        await app.close()
        app, gw, nightly = ai_batch_hold_app.build(store_url, server.base_url)
        try:
            assert await _holds(app) == []  # the table is back, empty
            assert await _spent(gw, "tenant:acme") == held
            async with app.worker(poll_interval=0.05, lease=1.0):
                out = await app.get_run(run.run_id).result(timeout=60)
            assert out == ["a", "b"] and server.batches.created == 1
            assert await _spent(gw, "tenant:acme") == 2 * USED
            assert await _holds(app) == []
        finally:
            await app.close()
