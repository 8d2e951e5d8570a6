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


async def test_a_run_cancelled_while_its_batch_is_created_keeps_the_estimate_held(
    app: tether.App,
) -> None:
    """The run is cancelled while the create request is in flight (the provider made the
    batch, which it will run and bill; its answer is slow): the submit keeps the estimate
    in the day (nothing will fetch the batch), rather than giving it back and leaving the
    day at 0 for a batch that ran."""
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


async def test_a_worker_stopped_while_the_hold_is_noted_gives_back_nothing_twice(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The submit's note of its hold reached the store, but its answer had not come back
    when the worker stopped (the attempt cancelled and handed back): the attempt gave
    the estimate back without clearing the note (it did not know it had written one),
    and the next attempt reused a hold that no longer existed: the day ended 218 short
    (82 for 300 used)."""
    with ModelServer() as server:
        server.batches.complete_after = 0.3
        gw, nightly, _one = _setup(app, server)
        await gw.set_budget(tenant="acme", tokens=10_000)
        store = app.store
        real = type(store).heartbeat
        noted = asyncio.Event()

        async def slow_answer(self: Any, task: Any, lease: float, details: Any) -> Any:
            out = await real(self, task, lease, details)  # committed
            if details and "daily_held" in details and not noted.is_set():
                noted.set()
                await asyncio.sleep(5)  # its answer slow to come back
            return out

        monkeypatch.setattr(type(store), "heartbeat", slow_answer)
        first = app.worker(poll_interval=0.05, lease=2.0)
        await first.start()
        run = await app.start(nightly, ["a", "b"], tenant="acme")
        await asyncio.wait_for(noted.wait(), 20)
        await first.stop(grace=0.1)  # the attempt is cancelled, handed back
        second = app.worker(poll_interval=0.05, lease=2.0)
        await second.start()
        try:
            out = await run.result(timeout=60)
        finally:
            await second.stop(grace=1)
        assert sorted(out["results"]) == ["a", "b"]
        assert await _spent(gw, "tenant:acme") == 2 * USED
