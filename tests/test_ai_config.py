"""tether.ai's configuration at its edges: prices given in the wrong shape, the answer
cache of models that share a registered name, and a daily budget set partway through
the day (both stores; real HTTP through ``tether.testing.ModelServer``)."""

from __future__ import annotations

import asyncio
import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

import tether
from tether import ai
from tether._usage import CALL_KEY
from tether.testing import ModelServer, model_reply

pytestmark = pytest.mark.timeout(120)

ONE = tether.Retry(attempts=1)


# prices ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", [{"input_per_mtok": 1, "output_per_mtok": 2}, 5, "0.15", None, (1, 2)]
)
def test_a_gateway_price_that_is_not_a_Price_is_refused_at_registration(
    tmp_path: Path, bad: Any
) -> None:
    """``Gateway(prices={"llm": {...}})`` (a price as read from a YAML file) used to be
    accepted, and every call then billed by the provider failed on ``'dict' object has
    no attribute 'cost'`` after its answer: it is refused where it is written, naming
    the model and what to pass."""
    app = tether.App(tmp_path / "t.db")
    with pytest.raises(tether.ConfigurationError) as err:
        ai.Gateway(app, prices={"llm": bad})
    assert "'llm'" in str(err.value) and "ai.Price(input_per_mtok=" in str(err.value)


def test_a_price_table_that_is_not_a_mapping_of_names_is_refused(tmp_path: Path) -> None:
    app = tether.App(tmp_path / "t.db")
    with pytest.raises(tether.ConfigurationError, match="mapping"):
        ai.Gateway(app, prices=[("llm", ai.Price(1, 2))])  # type: ignore[arg-type]
    with pytest.raises(tether.ConfigurationError, match="model name"):
        ai.Gateway(app, prices={5: ai.Price(1, 2)})  # type: ignore[dict-item]


@pytest.mark.parametrize("bad", [{"input_per_mtok": 1, "output_per_mtok": 2}, 5, Decimal(1)])
def test_a_model_price_that_is_not_a_Price_is_refused_at_registration(
    tmp_path: Path, bad: Any
) -> None:
    app = tether.App(tmp_path / "t.db")
    gw = ai.Gateway(app, retry=ONE)
    with pytest.raises(tether.ConfigurationError) as err:
        gw.model("m", "openai:gpt-4o-mini", price=bad)
    assert "model 'm'" in str(err.value) and "ai.Price(input_per_mtok=" in str(err.value)
    assert "m" not in gw._models  # nothing half-registered


class _PricedOnlyBefore(ai.Price):
    """A price that prices the estimate but fails on the answer's tokens (as a price
    table might on usage it was not written for)."""

    def cost(self, input_tokens: int, output_tokens: int, cache_read_tokens: int = 0) -> Decimal:
        if output_tokens == 500:
            raise ArithmeticError("no price for these tokens")
        return super().cost(input_tokens, output_tokens, cache_read_tokens)


async def test_a_price_that_fails_after_the_answer_keeps_the_answer(app: tether.App) -> None:
    """The provider answered (and billed): a failure to price the answer records the
    call with its cost unknown, and why, instead of throwing the answer away (and
    asking again on every retry)."""
    with ModelServer() as server:
        server.default = lambda body: model_reply("ok", input_tokens=1000, output_tokens=500)
        gw = ai.Gateway(app, retry=tether.Retry(attempts=3, initial=0.01))
        m = gw.model(
            "m",
            ai.openai_compatible("llm", base_url=server.base_url, api_key="k"),
            price=_PricedOnlyBefore(1, 2),
        )

        @app.workflow
        async def ask(text: str) -> str:
            return await ai.complete(m, text, settings={"max_tokens": 50})

        async with app.worker(poll_interval=0.02):
            run = await app.start(ask, "hi")
            assert await run.result(timeout=30) == "ok"
        assert server.count() == 1
        usage = await app.usage(run.run_id)
        assert (usage.calls, usage.input_tokens, usage.output_tokens) == (1, 1000, 500)
        assert usage.unpriced_calls == 1
        calls = [
            e.data["result"][CALL_KEY]
            for e in await app.history(run.run_id)
            if e.type is tether.EventType.ACTIVITY_COMPLETED
        ]
        assert calls[0]["cost"] is None
        assert "no price for these tokens" in calls[0]["price_error"]


# the answer cache -----------------------------------------------------------------


def _answering(who: str, seen: dict[str, int]) -> Any:
    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen[who] = seen.get(who, 0) + 1
        return ModelResponse(
            parts=[TextPart(f"answer of model {who}")],
            usage=RequestUsage(input_tokens=10, output_tokens=5),
        )

    return answer


async def test_gateways_of_one_app_do_not_share_cached_answers(app: tether.App) -> None:
    """Gateways ``eu`` and ``us`` each register ``fast`` as a function building a
    different model: the run on ``us`` used to get ``eu``'s cached answer (the key
    held the registered name only), model B never asked."""
    seen: dict[str, int] = {}
    eu = ai.Gateway(app, name="eu", retry=ONE)
    us = ai.Gateway(app, name="us", retry=ONE)
    free = ai.Price(0, 0)
    fa = eu.model("fast", lambda: FunctionModel(_answering("A", seen)), cache_ttl=3600, price=free)
    fb = us.model("fast", lambda: FunctionModel(_answering("B", seen)), cache_ttl=3600, price=free)

    @app.workflow
    async def ask_eu(text: str) -> str:
        return await ai.complete(fa, text)

    @app.workflow
    async def ask_us(text: str) -> str:
        return await ai.complete(fb, text)

    async with app.worker(poll_interval=0.02):
        a = await (await app.start(ask_eu, "What is 2+2?")).result(timeout=30)
        rb = await app.start(ask_us, "What is 2+2?")
        b = await rb.result(timeout=30)
        again = await (await app.start(ask_us, "What is 2+2?")).result(timeout=30)
    assert (a, b, again) == ("answer of model A", "answer of model B", "answer of model B")
    assert seen == {"A": 1, "B": 1}  # the third run was answered from us's own cache
    assert (await app.usage(rb.run_id)).cached_calls == 0


def _slow_answers(asked: list[str], fail_first: bool = False) -> FunctionModel:
    """A model taking 0.4 s an answer (its first fails, with ``fail_first``)."""

    async def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked.append("x")
        first = len(asked) == 1
        await asyncio.sleep(0.4)
        if fail_first and first:
            raise RuntimeError("the first request fails")
        return ModelResponse(
            parts=[TextPart("ok")], usage=RequestUsage(input_tokens=100, output_tokens=10)
        )

    return FunctionModel(answer, model_name="llm")


@pytest.mark.parametrize("leader_fails", [False, True])
async def test_the_same_question_asked_at_once_is_sent_once(
    app: tether.App, leader_fails: bool
) -> None:
    """Five runs ask a model with an answer cache the same question at the same moment:
    each used to send it (the cache is filled only by an answer), five paid answers for
    one. One request goes out; the others wait for its answer and take it as a cached
    one (counted as saved). When that request fails, the next of them asks instead."""
    asked: list[str] = []
    gw = ai.Gateway(app, retry=ONE)
    m = gw.model("m", _slow_answers(asked, leader_fails), cache_ttl=3600, price=ai.Price(1, 2))

    @app.workflow
    async def ask(text: str) -> str:
        try:
            return await ai.complete(m, text)
        except tether.ActivityError:
            return "failed"

    async with app.worker(poll_interval=0.02):
        runs = [await app.start(ask, "What is 2+2?") for _ in range(5)]
        outs = [await r.result(timeout=30) for r in runs]
    assert sorted(outs) == (["failed"] if leader_fails else []) + ["ok"] * (
        4 if leader_fails else 5
    ), outs
    assert len(asked) == (2 if leader_fails else 1), asked
    cached = [(await app.usage(r.run_id)).cached_calls for r in runs]
    assert sum(cached) == (3 if leader_fails else 4), cached


async def _ask_cached(store_url: str, server: ModelServer) -> tuple[str, int]:
    """One process's run of gateway ``tether.ai``'s ``fast`` pointed at ``server``:
    its answer and how many of its calls the cache answered."""
    app = tether.App(store=store_url)
    gw = ai.Gateway(app, retry=ONE)
    m = gw.model(
        "fast",
        ai.openai_compatible("llm", base_url=server.base_url, api_key="k"),
        cache_ttl=3600,
        price=ai.Price(0, 0),
    )

    @app.workflow(name="ask")
    async def ask(text: str) -> str:
        return await ai.complete(m, text)

    try:
        async with app.worker(poll_interval=0.02):
            run = await app.start(ask, "What is 2+2?")
            answer = await run.result(timeout=30)
            return answer, (await app.usage(run.run_id)).cached_calls
    finally:
        await app.close()


async def test_one_name_at_another_endpoint_is_not_answered_from_the_cache(
    store_url: str,
) -> None:
    """The same gateway and model name pointed at another endpoint (another region's
    server) asks that endpoint; the same endpoint, after a restart, is still answered
    from the cache."""
    with ModelServer() as one, ModelServer() as two:
        one.default = lambda body: model_reply("from one", input_tokens=10, output_tokens=5)
        two.default = lambda body: model_reply("from two", input_tokens=10, output_tokens=5)
        answers = [await _ask_cached(store_url, server) for server in (one, one, two)]
        assert answers == [("from one", 0), ("from one", 1), ("from two", 0)]
        assert (one.count(), two.count()) == (1, 1)


# daily budgets set partway through the day ---------------------------------------


async def test_a_daily_budget_set_midday_counts_what_was_spent_that_day(
    app: tether.App,
) -> None:
    """Tenant acme spent 600 tokens today, then gets a 400-token daily budget: it is
    already spent (``budgets()`` used to say 0 and let the next call through)."""
    with ModelServer() as server:
        server.default = lambda body: model_reply("ok", input_tokens=100, output_tokens=50)
        gw = ai.Gateway(app, retry=ONE, prices={"llm": ai.Price(1, 2)})
        m = gw.model("m", ai.openai_compatible("llm", base_url=server.base_url, api_key="k"))

        @app.workflow
        async def ask(text: str) -> str:
            try:
                return await ai.complete(m, text, settings={"max_tokens": 50})
            except ai.BudgetExceeded as e:
                return f"refused {e.scope}"

        async with app.worker(poll_interval=0.02):
            for i in range(4):
                await (await app.start(ask, f"q{i}", tenant="acme")).result(timeout=30)
            await (await app.start(ask, "other", tenant="zeta")).result(timeout=30)
            await (await app.start(ask, "nobody's")).result(timeout=30)
            day = datetime.datetime.now(datetime.UTC).date().isoformat()
            assert [(t, n, Decimal(c)) for t, n, c in await app.store.usage_on(day, "acme")] == [
                ("acme", 600, Decimal("0.0008"))
            ]
            await gw.set_budget(tenant="acme", tokens=400)
            await gw.set_budget(cost="100")
            spent = {
                b["scope"]: (b["spent_tokens"], Decimal(b["spent_cost"]))
                for b in await gw.budgets()
            }
            assert spent["tenant:acme"] == (600, Decimal("0.0008"))
            assert spent["global"] == (
                900,
                Decimal("0.0012"),
            )  # every tenant's, and runs without one
            refused = await (await app.start(ask, "q-after", tenant="acme")).result(timeout=30)
            assert refused == "refused tenant:acme"
            assert server.count() == 6
            # raising the limit later neither forgets nor counts the day twice
            await gw.set_budget(tenant="acme", tokens=10_000)
            assert await (await app.start(ask, "q-raised", tenant="acme")).result(timeout=30)
            spent = {
                b["scope"]: (b["spent_tokens"], Decimal(b["spent_cost"]))
                for b in await gw.budgets()
            }
        assert spent["tenant:acme"] == (750, Decimal("0.0010"))


async def test_an_answer_paid_for_reaches_the_waiting_askers_if_its_step_is_cancelled(
    tmp_path: Path,
) -> None:
    """The first asker's answer has come (paid); its step is cancelled while the day's
    spend is corrected, before the answer is cached. The waiting asker got nothing
    from it and sent the question again: bought twice. It now gets that answer."""
    from pydantic_ai.messages import ModelRequest

    from tether.ai._wire import dump_messages, dump_params

    app = tether.App(store=f"sqlite:///{tmp_path / 't.db'}")
    asked: list[str] = []
    gw = ai.Gateway(app)
    gw.model("m", _slow_answers(asked), cache_ttl=60, price=ai.Price(1, 2))
    body = {
        "messages": dump_messages([ModelRequest.user_text_prompt("q")]),
        "params": dump_params(None),
        "settings": None,
    }
    try:
        await app.store.set_model_budget("global", 1_000_000, None)
        real = gw.add_daily_spend
        correcting = asyncio.Event()

        async def slow(*a: Any, **k: Any) -> None:
            correcting.set()
            await asyncio.sleep(0.3)
            await real(*a, **k)

        gw.add_daily_spend = slow  # type: ignore[method-assign]
        first = asyncio.ensure_future(gw._call("m", dict(body)))
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(gw._call("m", dict(body)))
        await correcting.wait()
        first.cancel()
        out = await asyncio.wait_for(waiting, 5)
        assert out[CALL_KEY]["cache_hit"] is True
        assert asked == ["x"], "the paid answer was bought again"
        assert not gw._asking
    finally:
        await app.close()  # type: ignore[attr-defined]
