"""Budgets at their edges: answers that name another model than the priced one (a
proxy), batch jobs, child runs, tool schemas in the estimate, hedges' losers, and
output schema changes on replay (both stores, no network: FunctionModel and
``tether.testing.ModelServer``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

import tether
from tether import EventType, ai
from tether._usage import CALL_KEY

pytestmark = pytest.mark.timeout(120)

ONE = tether.Retry(attempts=1)
UPSTREAM = "hosted_vllm/meta-llama/Llama-3-8B-Instruct"


class ProxiedModel(FunctionModel):
    """Answers as LiteLLM, vLLM or Azure do: the response names the upstream model,
    not the name the model was registered (and priced) under."""

    async def request(self, *args: Any, **kwargs: Any) -> ModelResponse:
        response = await super().request(*args, **kwargs)
        response.model_name = UPSTREAM
        return response


def _answer(calls: list[int]) -> Any:
    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls.append(1)
        return ModelResponse(
            parts=[TextPart("ok")], usage=RequestUsage(input_tokens=10_000, output_tokens=1000)
        )

    return answer


def _calls(history: list[tether.Event]) -> list[dict[str, Any]]:
    return [
        e.data["result"][CALL_KEY]
        for e in history
        if e.type is EventType.ACTIVITY_COMPLETED and CALL_KEY in (e.data.get("result") or {})
    ]


async def test_a_cost_budget_holds_when_answers_name_another_model_than_the_priced_one(
    app: tether.App,
) -> None:
    """A model priced under its registered name (``Gateway(prices=)``) whose answers
    name the upstream model (a proxy) is priced by the registered name: the run's cost
    budget stops it, usage shows the cost, and the tenant's daily spend grows."""
    calls: list[int] = []
    gw = ai.Gateway(app, retry=ONE, prices={"my-llama": ai.Price(1, 2)})  # $0.012 a call
    m = gw.model("m", ProxiedModel(_answer(calls), model_name="my-llama"))

    @app.workflow
    async def loop(n: int) -> int:
        done = 0
        for i in range(n):
            try:
                await ai.complete(m, f"q{i}", settings={"max_tokens": 1000})
            except ai.BudgetExceeded:
                return done
            done += 1
        return done

    async with app.worker(poll_interval=0.02):
        run = await app.start(loop, 20, budget=tether.Budget(cost="0.05"))
        done = await run.result(timeout=60)
        await gw.set_budget(tenant="acme", cost="0.05")
        daily = await app.start(loop, 20, tenant="acme")
        done_daily = await daily.result(timeout=60)
    # each call costs $0.012 and is estimated at about that: 4 fit in $0.05
    assert done == 4 and done_daily <= 5, (done, done_daily)
    usage = await app.usage(run.run_id)
    assert usage.unpriced_calls == 0 and usage.cost == Decimal("0.048")
    recorded = _calls(await app.history(run.run_id))
    assert {c["model_name"] for c in recorded} == {UPSTREAM}  # the answer's own name stays
    (budget,) = await gw.budgets()
    assert Decimal(budget["spent_cost"]) == Decimal("0.012") * done_daily
    assert len(calls) == done + done_daily


async def test_an_unpriced_answer_counts_at_its_estimate_against_a_cost_budget(
    app: tether.App,
) -> None:
    """An answer no price is found for (the estimate was priced, the answer is not: a
    price table that changed, a lookup that failed) is never counted as free: it counts
    at its estimate against the run's and the day's cost budget, and stays flagged
    unpriced in usage."""
    calls: list[int] = []
    gw = ai.Gateway(app, retry=ONE, prices={"my-llama": ai.Price(1, 2)})
    m = gw.model("m", ProxiedModel(_answer(calls), model_name="my-llama"))
    real_price_of = gw.price_of

    def price_of(ref: Any, *args: Any) -> str | None:
        model_name = args[3]
        return None if model_name == UPSTREAM else real_price_of(ref, *args)

    gw.price_of = price_of  # type: ignore[method-assign]

    @app.workflow
    async def loop(n: int) -> int:
        done = 0
        for i in range(n):
            try:
                await ai.complete(m, f"q{i}", settings={"max_tokens": 1000})
            except ai.BudgetExceeded:
                return done
            done += 1
        return done

    async with app.worker(poll_interval=0.02):
        # the estimate: 1000 output tokens, a few input ones: ~$0.002 a call
        run = await app.start(loop, 50, budget=tether.Budget(cost="0.01"))
        done = await run.result(timeout=60)
        await gw.set_budget(tenant="acme", cost="0.01")
        daily = await app.start(loop, 50, tenant="acme")
        done_daily = await daily.result(timeout=60)
    assert 0 < done < 6 and 0 < done_daily < 7, (done, done_daily)
    usage = await app.usage(run.run_id)
    assert usage.unpriced_calls == done and usage.cost == 0
    recorded = _calls(await app.history(run.run_id))
    assert all(c["cost"] is None and Decimal(c["estimated_cost"]) > 0 for c in recorded)
    (budget,) = await gw.budgets()
    assert Decimal(budget["spent_cost"]) > 0


async def test_a_batch_is_checked_against_the_run_and_daily_budgets_and_charged_to_them(
    app: tether.App,
) -> None:
    """``ai.batch``: the whole batch's estimate is checked against the run's budget and
    the tenant's daily one before it is submitted (``BudgetExceeded``, nothing sent),
    and what it used is charged to both, so a later call sees it."""
    from tether.testing import ModelServer, model_reply

    with ModelServer() as server:
        server.default = lambda body: model_reply("a", input_tokens=1000, output_tokens=1000)
        server.batches.complete_after = 0.1
        gw = ai.Gateway(app, retry=tether.Retry(attempts=2, initial=0.05), timeout=10)
        m = gw.model(
            "m", ai.openai_compatible("gpt-4o-mini", base_url=server.base_url, api_key="k")
        )

        @app.workflow
        async def nightly(n: int) -> dict[str, Any]:
            out: dict[str, Any] = {}
            try:
                res = await ai.batch(
                    m, {f"k{i}": f"q{i}" for i in range(n)}, poll=0.1, max_poll=0.1, max_tokens=100
                )
                out["results"] = len(res.results)
            except ai.BudgetExceeded as exc:
                out["batch"] = f"{exc.scope} {exc.what} {exc.estimate['tokens']}"
            try:
                out["after"] = await ai.complete(m, "one more", settings={"max_tokens": 100})
            except ai.BudgetExceeded as exc:
                out["after"] = f"refused {exc.scope} spent {exc.spent['tokens']}"
            return out

        async with app.worker(poll_interval=0.05):
            # 10 items of ~103 tokens' estimate: 1030 > 1000, refused before submitting
            too_big = await app.start(nightly, 10, budget=tether.Budget(tokens=1000))
            out = await too_big.result(timeout=60)
            assert out["batch"].startswith("run tokens "), out
            assert server.batches.created == 0
            # 2 items pass the estimate (~206) but use 4000: the next call is refused
            used = await app.start(nightly, 2, budget=tether.Budget(tokens=4100))
            out = await used.result(timeout=60)
            assert out == {"results": 2, "after": "refused run spent 4000"}, out
            # the tenant's day: the batch's 4000 tokens are spent there too
            await gw.set_budget(tenant="acme", tokens=4100)
            daily = await app.start(nightly, 2, tenant="acme")
            out = await daily.result(timeout=60)
            assert out == {"results": 2, "after": "refused tenant:acme spent 4000"}, out
            refused = await app.start(nightly, 2, tenant="acme")
            out = await refused.result(timeout=60)
            assert out["batch"].startswith("tenant:acme tokens "), out
            assert server.batches.created == 2
        (budget,) = await gw.budgets()
        assert budget["spent_tokens"] == 4000
        history = await app.history(too_big.run_id)
        assert [e.data["marker"] for e in history if e.type is EventType.MARKER][:1] == [
            "budget_exceeded"
        ]


def _fixed(calls: list[int]) -> Any:
    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        calls.append(1)
        return ModelResponse(
            parts=[TextPart("ok")], usage=RequestUsage(input_tokens=300, output_tokens=30)
        )

    return answer


async def test_a_child_draws_from_its_parents_budget_or_gets_its_own(app: tether.App) -> None:
    """A child started by a run with a budget gets what the parent has left as its
    budget, held against the parent while it runs; when it ends, what it spent counts
    against the parent. ``wf.options(budget=)`` gives a child its own (never more than
    the parent has left), and a run without a budget can give its child one."""
    calls: list[int] = []
    gw = ai.Gateway(app, retry=ONE)
    m = gw.model("m", FunctionModel(_fixed(calls), model_name="fm"), price=ai.Price(1, 1))

    @app.workflow
    async def child(n: int) -> int:
        done = 0
        for i in range(n):
            try:
                await ai.complete(m, f"child call {i}", settings={"max_tokens": 30})
            except ai.BudgetExceeded:
                break
            done += 1
        return done

    @app.workflow
    async def parent(n: int, limit: int | None) -> list[int | str]:
        budget = tether.Budget(tokens=limit) if limit is not None else None
        first = await child.options(budget=budget)(n)
        second = await child(n)
        try:
            await ai.complete(m, "parent call", settings={"max_tokens": 30})
            third: int | str = "ok"
        except ai.BudgetExceeded as exc:
            third = f"refused spent {exc.spent['tokens']}"
        return [first, second, third]

    async with app.worker(poll_interval=0.02):
        # 330 tokens a call: the parent's 1000 cover 3 calls in all
        shared = await app.start(parent, 5, None, budget=tether.Budget(tokens=1000))
        assert await shared.result(timeout=60) == [3, 0, "refused spent 990"]
        # a child's own budget of 350: one call; then the second child has 670 left
        own = await app.start(parent, 5, 350, budget=tether.Budget(tokens=1000))
        assert await own.result(timeout=60) == [1, 2, "refused spent 990"]
        # no budget on the parent: its child's own budget still holds
        alone = await app.start(parent, 2, 350)
        assert await alone.result(timeout=60) == [1, 2, "ok"]
    assert len(calls) == 3 + 3 + 4
    kids = [e for e in await app.history(own.run_id) if e.type is EventType.CHILD_STARTED]
    assert [k.data.get("budget") for k in kids] == [
        {"tokens": 350, "cost": None},
        {"tokens": 670, "cost": None},
    ]


async def test_the_estimate_before_a_call_counts_the_tools_schemas_it_sends(
    app: tether.App,
) -> None:
    """A structured call sends its output type's JSON schema (an output tool) with the
    prompt, and providers bill it as input: the budget's estimate counts it."""
    from pydantic import BaseModel, Field, create_model

    fields: dict[str, Any] = {
        f"field_{i}": (str, Field(description=f"what field {i} of the report holds, in words"))
        for i in range(40)
    }
    Wide: type[BaseModel] = create_model("Wide", **fields)
    schema_tokens = len(json.dumps(Wide.model_json_schema())) // 4
    gw = ai.Gateway(app, retry=ONE)
    m = gw.model("m", FunctionModel(_fixed([]), model_name="fm"), price=ai.Price(1, 1))

    @app.workflow
    async def ask() -> dict[str, Any]:
        try:
            await ai.structured(m, "x", output=Wide, settings={"max_tokens": 10})
        except ai.BudgetExceeded as exc:
            return exc.estimate
        return {}

    async with app.worker(poll_interval=0.02):
        run = await app.start(ask, budget=tether.Budget(tokens=1))
        estimate = await run.result(timeout=60)
    assert estimate["tokens"] > schema_tokens + 10, (estimate, schema_tokens)


async def test_answers_from_the_cache_do_not_count_against_a_run_or_its_parent(
    app: tether.App,
) -> None:
    """A cached answer costs nothing (``app.usage`` and the daily budgets say so), yet it
    counted against the run's budget at the tokens of the call that first made it: a run
    asking a cached question four times was refused the second time. Nor does a child's
    cached answer count against its parent."""
    calls: list[int] = []
    gw = ai.Gateway(app, retry=ONE)
    m = gw.model(
        "m", FunctionModel(_fixed(calls), model_name="fm"), price=ai.Price(1, 1), cache_ttl=600
    )

    async def ask(n: int) -> list[str]:
        out = []
        for _ in range(n):
            try:
                out.append(await ai.complete(m, "the same question", settings={"max_tokens": 30}))
            except ai.BudgetExceeded as exc:
                out.append(f"refused spent {exc.spent['tokens']}")
        return out

    @app.workflow
    async def child(n: int) -> list[str]:
        return await ask(n)

    @app.workflow
    async def parent(n: int) -> list[str]:
        return [*await child(n), *await ask(n)]

    async with app.worker(poll_interval=0.02):
        warm = await app.start(parent, 1)  # 330 tokens a call, then cached
        assert await warm.result(timeout=60) == ["ok", "ok"]
        run = await app.start(parent, 3, budget=tether.Budget(tokens=400))
        assert await run.result(timeout=60) == ["ok"] * 6
    assert len(calls) == 1
    history = await app.history(run.run_id)
    (ended,) = [e for e in history if e.type is EventType.CHILD_COMPLETED]
    assert ended.data["model_spend"] == {"tokens": 0, "cost": "0"}
    assert all(c.get("cache_hit") for c in _calls(history))


async def test_a_cached_answer_needs_no_budget_room_and_a_miss_is_refused_unsent(
    app: tether.App,
) -> None:
    """The budget is checked in the workflow, before the call, and only the worker
    knows whether the cache has the answer: a call the cache would answer for nothing
    was refused when the run's budget had no room for its estimate. Such a call now
    goes to the worker as a cache-only call: a hit is answered (free), a miss refused
    there with the budget's ``BudgetExceeded``, the provider never asked. Both replay."""
    calls: list[int] = []
    gw = ai.Gateway(app, retry=ONE)
    m = gw.model(
        "m", FunctionModel(_fixed(calls), model_name="fm"), price=ai.Price(1, 1), cache_ttl=600
    )

    @app.workflow
    async def ask(question: str) -> str:
        try:
            return await ai.complete(m, question, settings={"max_tokens": 30})
        except ai.BudgetExceeded as exc:
            return f"refused: {exc.what} spent {exc.spent['tokens']}"

    async with app.worker(poll_interval=0.02):
        warm = await app.start(ask, "cached question")
        assert await warm.result(timeout=60) == "ok"
        tight = tether.Budget(tokens=10)  # less than any call's estimate
        hit = await app.start(ask, "cached question", budget=tight)
        assert await hit.result(timeout=60) == "ok"
        miss = await app.start(ask, "a new question", budget=tight)
        assert await miss.result(timeout=60) == "refused: tokens spent 0"
    assert len(calls) == 1  # the provider was asked only by the warm run
    assert all(c.get("cache_hit") for c in _calls(await app.history(hit.run_id)))
    (marker,) = [
        e.data["value"]
        for e in await app.history(miss.run_id)
        if e.type is EventType.MARKER and e.data.get("marker") == "budget_exceeded"
    ]
    assert marker["what"] == "tokens" and marker["limit"] == "10"
    assert await app.dead_letters() == []  # a refusal, not a failed step
    for run in (hit, miss):
        report = tether.testing.check_history(app, await app.history(run.run_id))
        assert report.ok, report.error


@pytest.mark.parametrize("cache_size", [100, 0, "offloaded"])
async def test_a_call_in_flight_holds_its_estimate_after_a_replay(
    app: tether.App, store_url: str, tmp_path: Any, cache_size: int | str
) -> None:
    """A run budget with room for one call: call A is in flight (slow) when, after a
    durable timer, the run asks call B. B is refused, A holding its estimate, also on a
    worker that replays the run on every task (``cache_size=0``: a restart, an
    eviction, another worker taking the task), and when the recorded request is in the
    blob store."""
    from tether.testing import ModelServer, model_reply

    if cache_size == "offloaded":
        app = tether.App(store=store_url, blobs=str(tmp_path / "blobs"), offload_above=16)
        cache_size = 0
    assert isinstance(cache_size, int)
    with ModelServer() as server:
        server.default = lambda body: model_reply(
            "ok", input_tokens=10, output_tokens=50, delay=1.5
        )
        gw = ai.Gateway(app, retry=ONE, prices={"llm": ai.Price(1, 1)})
        m = gw.model("m", ai.openai_compatible("llm", base_url=server.base_url, api_key="k"))

        async def call(text: str, wait: float) -> str:
            if wait:
                await tether.sleep(wait)
            try:
                return await ai.complete(m, text, settings={"max_tokens": 50})
            except ai.BudgetExceeded:
                return "refused"

        @app.workflow
        async def two() -> list[str]:
            return list(await tether.gather(call("A", 0), call("B", 0.3)))

        async with app.worker(poll_interval=0.02, cache_size=cache_size):
            run = await app.start(two, budget=tether.Budget(tokens=100))
            out = await run.result(timeout=60)
        assert out == ["ok", "refused"], out
        assert server.count() == 1
        usage = await app.usage(run.run_id)
        assert usage.input_tokens + usage.output_tokens == 60


@pytest.mark.parametrize("cache_size", [100, 0])
async def test_a_batch_in_flight_holds_its_estimate_after_a_replay(
    app: tether.App, cache_size: int
) -> None:
    """A batch running holds its whole estimate against the run's budget, also after
    the run is replayed (a batch's held estimate is made again on replay): a call the
    budget has no room for beside it is refused."""
    from tether.testing import ModelServer, model_reply

    with ModelServer() as server:
        server.default = lambda body: model_reply("a", input_tokens=10, output_tokens=10)
        server.batches.complete_after = 1.5
        gw = ai.Gateway(app, retry=ONE, timeout=10)
        m = gw.model(
            "m", ai.openai_compatible("gpt-4o-mini", base_url=server.base_url, api_key="k")
        )

        async def batch() -> str:
            res = await ai.batch(
                m, {"k0": "q0", "k1": "q1"}, poll=0.2, max_poll=0.2, max_tokens=100
            )
            return f"results {len(res.results)}"

        async def call() -> str:
            await tether.sleep(0.5)
            try:
                return await ai.complete(m, "one more", settings={"max_tokens": 100})
            except ai.BudgetExceeded:
                return "refused"

        @app.workflow
        async def both() -> list[str]:
            return list(await tether.gather(batch(), call()))

        async with app.worker(poll_interval=0.02, cache_size=cache_size):
            # the batch is estimated at ~206 tokens, the call at ~103: not both in 300
            run = await app.start(both, budget=tether.Budget(tokens=300))
            out = await run.result(timeout=60)
        assert out == ["results 2", "refused"], out


@pytest.mark.parametrize("kind", ["cost", "tokens"])
async def test_a_global_daily_budget_checks_runs_without_tenant_or_budget(
    app: tether.App, kind: str
) -> None:
    """A global daily budget (``set_budget()`` without a tenant) checks every call's
    estimate, a run's without a tenant and without a budget of its own too: it lets
    calls through while there is room and refuses those that would pass it."""
    calls: list[int] = []
    gw = ai.Gateway(app, retry=ONE, prices={"llm": ai.Price(1, 2)})  # $0.012 a call
    m = gw.model("m", FunctionModel(_answer(calls), model_name="llm"))

    @app.workflow
    async def ask(text: str) -> str:
        try:
            return await ai.complete(m, text, settings={"max_tokens": 1000})
        except ai.BudgetExceeded as exc:
            return f"refused {exc.scope} {exc.what}"

    # one call uses 11,000 tokens and $0.012 (estimated at ~1,010 tokens, ~$0.002)
    if kind == "cost":
        await gw.set_budget(cost="0.02")
    else:  # less than one call's estimate: none may go
        await gw.set_budget(tokens=1000)
    async with app.worker(poll_interval=0.02):
        outs = [await (await app.start(ask, f"q{i}")).result(timeout=30) for i in range(3)]
    if kind == "cost":  # $0.012 + $0.002 fits in $0.02; $0.024 + $0.002 does not
        assert outs == ["ok", "ok", "refused global cost"], outs
    else:
        assert outs == ["refused global tokens"] * 3, outs
    assert len(calls) == outs.count("ok")


@pytest.mark.parametrize("tenant", [None, "acme"])
async def test_a_batch_is_checked_against_the_global_daily_budget(
    app: tether.App, tenant: str | None
) -> None:
    """``ai.batch`` in a run without a tenant is checked against the global daily
    budget before it is submitted, as a tenant's run is."""
    from tether.testing import ModelServer, model_reply

    with ModelServer() as server:
        server.default = lambda body: model_reply("x", input_tokens=1000, output_tokens=1000)
        server.batches.complete_after = 0.1
        gw = ai.Gateway(app, retry=ONE, timeout=10)
        m = gw.model(
            "m", ai.openai_compatible("gpt-4o-mini", base_url=server.base_url, api_key="k")
        )

        @app.workflow
        async def nightly(n: int) -> str:
            try:
                res = await ai.batch(
                    m, {f"k{i}": f"q{i}" for i in range(n)}, poll=0.1, max_poll=0.1, max_tokens=1000
                )
            except ai.BudgetExceeded as exc:
                return f"refused {exc.scope} {exc.what}"
            return f"results {len(res.results)}"

        await gw.set_budget(tokens=3000)  # global; 10 items estimated at ~10,030 tokens
        async with app.worker(poll_interval=0.05):
            run = await app.start(nightly, 10, **({"tenant": tenant} if tenant else {}))
            out = await run.result(timeout=60)
        assert out == "refused global tokens", out
        assert server.batches.created == 0


@pytest.mark.parametrize("workers", [1, 2])
async def test_calls_at_the_same_moment_do_not_pass_a_daily_budget_together(
    app: tether.App, store_url: str, workers: int
) -> None:
    """Runs of one tenant calling at the same moment, in one worker or two (two Apps on
    one store, each with its own connection): each call reserves its estimate in the
    day's spend as it is checked (one transaction), so together they stop at the
    budget instead of all passing its check before any has spent; what an answer used
    replaces its estimate, and a failed call gives its estimate back."""
    from tether.testing import ModelServer, model_error, model_reply

    with ModelServer() as server:
        # what an answer uses is about its estimate (prompt characters / 4 + max_tokens)
        server.default = lambda body: model_reply(
            "ok", input_tokens=40, output_tokens=50, delay=0.5
        )

        def build(on: tether.App) -> tuple[ai.Gateway, Any]:
            gw = ai.Gateway(on, retry=ONE, timeout=30)
            m = gw.model(
                "m",
                ai.openai_compatible("m", base_url=server.base_url, api_key="k"),
                price=ai.Price(1, 2),
            )

            @on.workflow(name="ask")
            async def ask(text: str) -> str:
                try:
                    return await ai.complete(m, text, settings={"max_tokens": 50})
                except ai.BudgetExceeded as exc:
                    return f"refused {exc.scope}"

            return gw, ask

        gw, ask = build(app)
        other = tether.App(store=store_url) if workers == 2 else None
        if other is not None:
            build(other)
        await gw.set_budget(tenant="acme", tokens=500)
        try:
            async with contextlib.AsyncExitStack() as stack:
                for a in (app, other):
                    if a is not None:
                        await stack.enter_async_context(a.worker(poll_interval=0.02))
                runs = [await app.start(ask, f"question {i}", tenant="acme") for i in range(12)]
                outs = [await r.result(timeout=60) for r in runs]
        finally:
            if other is not None and other._store is not None:
                await other._store.close()
        ok = outs.count("ok")
        (budget,) = await gw.budgets()
        # ~90 tokens an estimate: 5 fit in 500; all 12 passed a check-then-add
        assert 0 < ok <= 6 and outs.count("refused tenant:acme") == 12 - ok, outs
        assert server.count() == ok
        assert budget["spent_tokens"] == 90 * ok  # estimates replaced by what was used
        # a call that fails gives back what it reserved (the budget raised to let it try)
        server.default = lambda body: model_error(500, "down")
        await gw.set_budget(tenant="acme", tokens=10_000)
        async with app.worker(poll_interval=0.02):
            failed = await app.start(ask, "one more", tenant="acme")
            with pytest.raises(tether.WorkflowFailedError):
                await failed.result(timeout=60)
        (budget,) = await gw.budgets()
        assert budget["spent_tokens"] == 90 * ok


async def test_daily_spend_writes_of_many_tenants_at_once_close_no_lock_cycle(
    pg_schema: str,
) -> None:
    """PostgreSQL: reservations and corrections of eight tenants' calls with a global
    budget, 600 at once on four writer threads. Batched together they locked a tenant's
    row, the global one, then another tenant's, and two batches deadlocked (3 of 4 runs:
    the whole batch retried after a second); each now runs in a transaction of its own."""
    from conftest import require_pg, with_schema
    from tether.store.postgres import PostgresStore

    store = PostgresStore(with_schema(require_pg(), pg_schema), writers=4)
    day = "2026-12-06"
    try:
        await store.set_model_budget("global", 10**12, None)
        tenants = [f"tenant:t{i}" for i in range(8)]
        for scope in tenants:
            await store.set_model_budget(scope, 10**12, None)

        pick = random.Random(7)

        async def one(scope: str) -> None:
            scopes = (scope, "global")
            assert await store.reserve_model_spend(scopes, day, 10, "0.01") is None
            await store.add_model_spend(scopes, day, -5, "-0.005")

        await asyncio.gather(*(one(pick.choice(tenants)) for _ in range(600)))
        assert store._retries == 0  # no deadlock detected, no batch run again
        rows = {r[0]: r for r in await store.model_budgets(day)}
        assert rows["global"][3] == 600 * 5
    finally:
        await store.close()


async def test_a_reservation_cancelled_while_the_store_writes_it_is_given_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call cancelled (a timeout, a hedge lost, the run cancelled) while the store was
    writing its daily-budget reservation: the write commits, the caller never learns
    what it reserved, and the estimate stayed in the day's spend for good (100 of a
    1,000-token budget). It is given back once the write lands."""
    import time

    import tether.store.ops as ops

    real = ops._reserve_spend

    def slow(tx: Any, *args: Any) -> Any:
        time.sleep(0.3)  # a busy writer: the op runs on after its caller is cancelled
        return real(tx, *args)

    monkeypatch.setattr(ops, "_reserve_spend", slow)
    app = tether.App(store=f"sqlite:///{tmp_path / 't.db'}")
    gw = ai.Gateway(app)
    try:
        await app.store.set_model_budget("global", 1000, None)
        call = asyncio.ensure_future(gw.reserve_daily(None, {"tokens": 100, "cost": None}))
        await asyncio.sleep(0.1)  # the writer is running the reservation now
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(100):
            await asyncio.sleep(0.05)
            if [b["spent_tokens"] for b in await gw.budgets()] == [0]:
                break
        assert [b["spent_tokens"] for b in await gw.budgets()] == [0]
    finally:
        await app.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("fails", ["spend", "cache"])
async def test_a_paid_answer_outlives_a_failed_write_of_its_spend_or_its_cache_entry(
    app: tether.App, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """Once the model has answered, the step still writes the day's spend (the answer's
    usage in place of its estimate) and the cache entry. A store error on either failed
    the step, and its retry bought the same answer again. The answer is kept (one
    request); a spend that could not be corrected keeps the call's estimate."""
    import tether.store.ops as ops

    name = "_add_spend" if fails == "spend" else "_cache_put"
    failed: list[int] = []

    def broken(tx: Any, *args: Any) -> Any:
        failed.append(1)
        raise tether.StoreError("disk I/O error (injected)")

    monkeypatch.setattr(ops, name, broken)
    calls: list[int] = []
    gw = ai.Gateway(app, retry=tether.Retry(attempts=3, initial=0.05))
    m = gw.model("m", FunctionModel(_answer(calls), model_name="llm"), cache_ttl=60)

    @app.workflow
    async def ask(text: str) -> str:
        return await ai.complete(m, text, settings={"max_tokens": 1000})

    await gw.set_budget(tokens=1_000_000)
    async with app.worker(poll_interval=0.02):
        out = await (await app.start(ask, "q")).result(timeout=30)
    assert out == "ok" and failed
    assert len(calls) == 1, "the answer was bought twice"
    (spent,) = [b["spent_tokens"] for b in await gw.budgets()]
    if fails == "spend":  # the estimate (about 1,010 tokens) stays in the day's spend
        assert 0 < spent < 11_000, spent
    else:
        assert spent == 11_000, spent


async def test_a_correction_cancelled_while_it_waits_for_the_store_still_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answered call whose step is cancelled (the run cancelled, a hedge lost, its
    timeout) while the day's spend correction waits for a busy store: the answer was
    paid for, so what it used replaces its estimate even so. The write was dropped with
    the step, and the estimate (100 tokens here, not 11,000) stayed in the day's spend."""
    import time

    import tether.store.ops as ops

    real = ops._cache_put

    def slow(tx: Any, *args: Any) -> Any:
        time.sleep(0.3)  # keeps the writer busy: the correction queues behind it
        return real(tx, *args)

    monkeypatch.setattr(ops, "_cache_put", slow)
    app = tether.App(store=f"sqlite:///{tmp_path / 't.db'}")
    gw = ai.Gateway(app)
    m = gw.model("m", FunctionModel(_answer([]), model_name="llm"))
    try:
        await app.store.set_model_budget("global", 1_000_000, None)
        scopes, reserved = await gw.reserve_daily(None, {"tokens": 100, "cost": None})
        assert reserved["tokens"] == 100
        busy = asyncio.ensure_future(app.store.ai_cache_put("other", "{}", 60))
        await asyncio.sleep(0.05)  # the writer is in the slow operation
        fix = asyncio.ensure_future(gw._correct_daily(m, scopes, reserved, 11_000, {"cost": None}))
        await asyncio.sleep(0.05)  # the correction is queued behind it
        fix.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fix
        await busy
        for _ in range(100):
            await asyncio.sleep(0.05)
            if [b["spent_tokens"] for b in await gw.budgets()] == [11_000]:
                break
        assert [b["spent_tokens"] for b in await gw.budgets()] == [11_000]
    finally:
        await app.close()  # type: ignore[attr-defined]
