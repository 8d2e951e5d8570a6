"""The Anthropic path of tether.ai over real HTTP: the Anthropic SDK (its retries off)
against ``ModelServer``'s Messages API, through pydantic-ai's model layer.

The same guarantees as the OpenAI path: usage and cost exact, a 429's Retry-After
honoured by tether (one request per attempt), 529 "overloaded" retried then a
fallback to another provider, a refusal never retried, a bad key permanent and
never written down."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import tether
from tether import EventType, ai
from tether.testing import ModelServer, model_error, model_reply

pytestmark = pytest.mark.timeout(120)

FAST = tether.Retry(attempts=3, initial=0.05, backoff=1.0)
CLAUDE = "claude-3-5-haiku-latest"


class Ticket(BaseModel):
    category: str
    priority: int


@pytest.fixture
def server() -> Iterator[ModelServer]:
    with ModelServer() as s:
        yield s


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[tether.App]:
    a = tether.App(store=f"sqlite:///{tmp_path / 'tether.db'}")
    yield a
    await a.close()


def claude(server: ModelServer, key: str = "sk-ant-test") -> Any:
    return ai.anthropic(CLAUDE, base_url=server.anthropic_url, api_key=key)


async def test_structured_output_over_anthropic_records_exact_usage_and_cost(
    app: tether.App, server: ModelServer
) -> None:
    gw = ai.Gateway(app, retry=FAST, timeout=10)
    model = gw.model("claude", claude(server))

    @app.workflow
    async def triage(text: str) -> str:
        t = await ai.structured(model, f"triage: {text}", output=Ticket)
        return f"{t.category}/{t.priority}"

    server.script(
        CLAUDE,
        model_reply(
            tool=("final_result", {"category": "billing", "priority": 2}),
            input_tokens=1_000,
            output_tokens=200,
            cached_tokens=400,
        ),
    )
    async with app.worker(poll_interval=0.05):
        run = await app.start(triage, "refund", tenant="acme")
        assert await run.result(timeout=30) == "billing/2"
    (request,) = server.calls(CLAUDE)
    assert request.body["tools"][0]["name"] == "final_result"  # the Messages API's shape
    assert request.headers["authorization"] == "Bearer sk-ant-test"
    assert "anthropic-version" in request.headers
    assert request.headers.get("x-stainless-retry-count", "0") == "0"
    usage = await app.usage(run.run_id)
    assert (usage.calls, usage.input_tokens, usage.output_tokens) == (1, 1_000, 200)
    assert usage.cache_read_tokens == 400
    from genai_prices import calc_price
    from genai_prices.types import Usage as PriceUsage

    price = calc_price(
        PriceUsage(input_tokens=1_000, cache_read_tokens=400, output_tokens=200),
        model_ref=CLAUDE,
        provider_id="anthropic",
    )
    assert usage.cost == Decimal(str(price.total_price)) and usage.cost > 0
    history = await app.history(run.run_id)
    assert "sk-ant-test" not in str([e.data for e in history])


async def test_429_retry_after_is_honoured_and_529_falls_back_to_another_provider(
    app: tether.App, server: ModelServer
) -> None:
    gw = ai.Gateway(app, retry=FAST, timeout=10)
    backup = gw.model(
        "backup", ai.openai_compatible("gpt-4o-mini", base_url=server.base_url, api_key="k")
    )
    model = gw.model("claude", claude(server), fallback=[backup])

    @app.workflow
    async def ask(text: str) -> str:
        return await ai.complete(model, text)

    server.script(CLAUDE, model_error(429, "rate limited", retry_after=2), model_reply("first"))
    async with app.worker(poll_interval=0.05):
        run = await app.start(ask, "a")
        assert await run.result(timeout=30) == "first"
        refused, answered = server.calls(CLAUDE)
        assert answered.at - refused.at >= 1.9  # tether waited; the SDK did not retry
        server.script(CLAUDE, *[model_error(529, "Overloaded")] * 3)
        server.script("gpt-4o-mini", model_reply("from the backup"))
        run2 = await app.start(ask, "b")
        assert await run2.result(timeout=30) == "from the backup"
    assert server.count(CLAUDE) == 2 + 3 and server.count("gpt-4o-mini") == 1
    failed = [
        e for e in await app.history(run.run_id) if e.type is EventType.ACTIVITY_ATTEMPT_FAILED
    ]
    assert failed[0].data["error"]["reason"].startswith("HTTP 429")
    fallback = [
        e.data["value"]
        for e in await app.history(run2.run_id)
        if e.type is EventType.MARKER and e.data.get("marker") == "model_fallback"
    ]
    assert fallback and fallback[0]["to"] == "backup" and "529" in fallback[0]["error"]


async def test_a_refusal_is_not_retried_and_a_bad_key_is_permanent(
    app: tether.App, server: ModelServer
) -> None:
    gw = ai.Gateway(app, retry=FAST, timeout=10)
    model = gw.model("claude", claude(server))
    secret = gw.model("secret", claude(server, key="sk-ant-TOPSECRET"))

    @app.workflow
    async def ask(which: str) -> str:
        return await ai.complete(model if which == "refuse" else secret, "x")

    server.script(CLAUDE, model_reply("", finish_reason="content_filter"))
    async with app.worker(poll_interval=0.05):
        run = await app.start(ask, "refuse")
        with pytest.raises(tether.WorkflowFailedError) as info:
            await run.result(timeout=30)
        assert "ContentRefused" in str(info.value)
        assert server.count(CLAUDE) == 1
        server.script(CLAUDE, model_error(401, "invalid x-api-key"))
        run2 = await app.start(ask, "secret")
        with pytest.raises(tether.WorkflowFailedError) as info:
            await run2.result(timeout=30)
        assert "401" in str(info.value) and CLAUDE in str(info.value)
    assert server.count(CLAUDE) == 2  # neither was retried
    history = await app.history(run2.run_id)
    assert "sk-ant-TOPSECRET" not in str([e.data for e in history])
