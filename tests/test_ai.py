"""tether.ai against a real OpenAI-compatible HTTP server on 127.0.0.1 (both stores).

The server (``tether.testing.ModelServer``) answers from scripts and counts the
requests it gets, so "the model was not called again" is checked where it matters:
at the provider.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field, model_validator

import tether
from helpers import eventually, has_event
from tether import EventType, ai
from tether._usage import CALL_KEY
from tether.testing import ModelServer, model_error, model_garbage, model_reply

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).parent
FAST = tether.Retry(attempts=3, initial=0.05, backoff=1.0)


class Ticket(BaseModel):
    category: str
    priority: int
    confidence: float


def ticket(category: str = "billing", priority: int = 2, confidence: float = 0.9) -> Any:
    return model_reply(
        tool=(
            "final_result",
            {"category": category, "priority": priority, "confidence": confidence},
        ),
        input_tokens=120,
        output_tokens=30,
    )


@pytest.fixture
def server() -> Any:
    with ModelServer() as s:
        yield s


def gateway(app: tether.App, server: ModelServer, **kw: Any) -> tuple[ai.Gateway, ai.ModelRef]:
    gw = ai.Gateway(app, retry=FAST, timeout=10)
    primary = gw.model(
        "primary",
        ai.openai_compatible("gpt-4o-mini", base_url=server.base_url, api_key="sk-test-secret"),
        **kw,
    )
    return gw, primary


def markers(history: list[tether.Event], name: str) -> list[dict[str, Any]]:
    return [
        e.data["value"]
        for e in history
        if e.type is EventType.MARKER and e.data.get("marker") == name
    ]


async def test_structured_output_is_a_recorded_step_with_usage_and_cost(
    app: tether.App, server: ModelServer
) -> None:
    _gw, primary = gateway(app, server)

    @app.workflow
    async def triage(text: str) -> str:
        t = await ai.structured(primary, f"triage: {text}", output=Ticket)
        return tether.route(
            t.category,
            {"billing", "tech"},
            default="human",
            confidence=t.confidence,
            min_confidence=0.7,
        )

    server.script("gpt-4o-mini", ticket("billing", confidence=0.95), ticket("sales"))
    async with app.worker(poll_interval=0.05):
        a = await app.start(triage, "refund please", tenant="acme")
        assert await a.result(timeout=30) == "billing"
        b = await app.start(triage, "buy more", tenant="acme")
        assert await b.result(timeout=30) == "human"  # not allowed: the default, no raise
    assert server.count("gpt-4o-mini") == 2
    history = await app.history(a.run_id)
    routes = markers(history, "route")
    assert routes[0]["chosen"] == "billing" and routes[0]["reason"] == "allowed"
    assert markers(await app.history(b.run_id), "route")[0]["reason"] == "not allowed"
    # usage is exact against the server's scripted usage; cost from genai-prices
    usage = await app.usage(a.run_id)
    assert (usage.calls, usage.input_tokens, usage.output_tokens) == (1, 120, 30)
    # gpt-4o-mini: $0.15 / $0.60 per million tokens
    assert usage.cost == Decimal("0.000018") + Decimal("0.000018")
    tenant = await app.usage(tenant="acme")
    assert (tenant.calls, tenant.tokens, tenant.cost) == (2, 300, usage.cost * 2)


async def test_429_retry_after_is_honoured_and_pauses_every_call_to_that_model(
    app: tether.App, server: ModelServer
) -> None:
    _gw, primary = gateway(app, server)

    @app.workflow
    async def triage(text: str) -> str:
        t = await ai.structured(primary, text, output=Ticket)
        return t.category

    server.script("gpt-4o-mini", model_error(429, "slow down", retry_after=2), ticket(), ticket())
    async with app.worker(poll_interval=0.05):
        a = await app.start(triage, "a")
        deadline = time.monotonic() + 10
        while not await has_event(app, a.run_id, EventType.ACTIVITY_ATTEMPT_FAILED):
            assert time.monotonic() < deadline, "the 429 was never recorded"
            await asyncio.sleep(0.01)
        refused_at = server.calls()[0].at
        # a call for the same model scheduled once the 429 is recorded waits too
        b = await app.start(triage, "b")
        assert await a.result(timeout=30) == "billing"
        assert await b.result(timeout=30) == "billing"
    later = server.calls()[1:]
    assert len(later) == 2
    assert all(r.at - refused_at >= 1.9 for r in later), [r.at - refused_at for r in later]
    failed = [e for e in await app.history(a.run_id) if e.type is EventType.ACTIVITY_ATTEMPT_FAILED]
    assert failed[0].data["error"]["reason"].startswith("HTTP 429")
    assert failed[0].data["error"]["retry_after"] == 2.0


async def test_5xx_retries_then_falls_back_to_the_secondary_model(
    app: tether.App, server: ModelServer
) -> None:
    gw = ai.Gateway(app, retry=FAST, timeout=10)
    url = server.base_url
    backup = gw.model("backup", ai.openai_compatible("gpt-4o", base_url=url, api_key="k"))
    primary = gw.model(
        "primary",
        ai.openai_compatible("gpt-4o-mini", base_url=url, api_key="k"),
        fallback=[backup],
    )

    @app.workflow
    async def triage(text: str) -> str:
        t = await ai.structured(primary, text, output=Ticket)
        return t.category

    server.script("gpt-4o-mini", *[model_error(503, "overloaded")] * 3)
    server.script("gpt-4o", ticket("tech"))
    async with app.worker(poll_interval=0.05):
        run = await app.start(triage, "x")
        assert await run.result(timeout=30) == "tech"
    assert (server.count("gpt-4o-mini"), server.count("gpt-4o")) == (3, 1)
    history = await app.history(run.run_id)
    fb = markers(history, "model_fallback")
    assert fb and fb[0]["from"] == "primary" and fb[0]["to"] == "backup"
    assert "503" in fb[0]["error"]
    usage = await app.usage(run.run_id)
    assert usage.calls == 1 and usage.input_tokens == 120  # failed attempts spent nothing


async def test_malformed_json_is_repaired_once_then_output_invalid(
    app: tether.App, server: ModelServer
) -> None:
    _gw, primary = gateway(app, server)

    def sane(t: Ticket) -> str | None:
        return None if 1 <= t.priority <= 5 else f"priority must be 1..5, got {t.priority}"

    @app.workflow
    async def strict(text: str) -> str:
        t = await ai.structured(primary, text, output=Ticket, validate=sane, max_repairs=1)
        return t.category

    @app.workflow
    async def lenient(text: str) -> str:
        fallback = Ticket(category="human", priority=3, confidence=0.0)
        t = await ai.structured(primary, text, output=Ticket, max_repairs=1, default=fallback)
        return t.category

    broken = model_reply(tool=("final_result", '{"category": "billing", "prio'))
    server.script("gpt-4o-mini", broken, ticket(priority=9))  # strict: JSON, then a bad value
    async with app.worker(poll_interval=0.05):
        run = await app.start(strict, "x")
        with pytest.raises(tether.WorkflowFailedError) as info:
            await run.result(timeout=30)
        assert "OutputInvalid" in str(info.value) and "priority must be 1..5" in str(info.value)
        # the repair request carried the problems back to the model
        second = server.calls()[1].body["messages"]
        assert any("not valid JSON" in str(m.get("content")) for m in second)
        server.script("gpt-4o-mini", broken, broken)
        run2 = await app.start(lenient, "y")
        assert await run2.result(timeout=30) == "human"
    assert server.count() == 4
    bad = markers(await app.history(run.run_id), "output_invalid")
    assert [m["attempt"] for m in bad] == [1, 2]
    assert bad[0]["raw"].startswith('{"category"')
    assert markers(await app.history(run2.run_id), "output_default")


async def test_a_content_filter_refusal_is_not_retried(
    app: tether.App, server: ModelServer
) -> None:
    _gw, primary = gateway(app, server)

    @app.workflow
    async def ask(text: str) -> str:
        return await ai.complete(primary, text)

    server.script("gpt-4o-mini", model_reply("", finish_reason="content_filter"))
    async with app.worker(poll_interval=0.05):
        run = await app.start(ask, "x")
        with pytest.raises(tether.WorkflowFailedError) as info:
            await run.result(timeout=30)
    assert server.count() == 1
    assert "ContentRefused" in str(info.value) and "content policy" in str(info.value)


async def test_a_budget_stops_the_run_before_the_call_that_would_exceed_it(
    app: tether.App, server: ModelServer
) -> None:
    _gw, primary = gateway(app, server)

    @app.workflow
    async def chain(n: int) -> list[str]:
        out = []
        for i in range(n):
            try:
                out.append(await ai.complete(primary, f"step {i}", settings={"max_tokens": 100}))
            except ai.BudgetExceeded as exc:
                out.append(f"stopped: {exc.what}")
                break
        return out

    # a call is estimated at its prompt (~40 tokens) + max_tokens (100); each spends 150
    server.script("gpt-4o-mini", *[model_reply("ok", input_tokens=120, output_tokens=30)] * 5)
    async with app.worker(poll_interval=0.05):
        run = await app.start(chain, 5, budget=tether.Budget(tokens=400))
        assert await run.result(timeout=30) == ["ok", "ok", "stopped: tokens"]
    assert server.count() == 2  # the third call was never sent
    usage = await app.usage(run.run_id)
    assert usage.tokens == 300
    refused = markers(await app.history(run.run_id), "budget_exceeded")
    assert refused[0]["spent"]["tokens"] == 300 and refused[0]["limit"] == "400"
    with pytest.raises(tether.ConfigurationError):
        tether.Budget()
    for bad in (
        {"tokens": True},
        {"tokens": -1},
        {"tokens": 2**63},  # more than a store's 64-bit column holds
        {"cost": float("nan")},
        {"cost": "abc"},
    ):
        with pytest.raises(tether.ConfigurationError, match=r"Budget (tokens|cost) must be"):
            tether.Budget(**bad)
    with pytest.raises(tether.ConfigurationError, match="Budget tokens must be"):
        await ai.Gateway(app, name="other").set_budget(tenant="t", tokens=10**30)


async def test_hedged_call_takes_the_first_answer_and_records_the_winner(
    app: tether.App, server: ModelServer
) -> None:
    gw = ai.Gateway(app, retry=FAST, timeout=10)
    url = server.base_url
    fast = gw.model("fast", ai.openai_compatible("gpt-4o", base_url=url, api_key="k"))
    slow = gw.model(
        "slow",
        ai.openai_compatible("gpt-4o-mini", base_url=url, api_key="k"),
        hedge=(fast, 0.3),
    )

    @app.workflow
    async def ask(text: str) -> str:
        return await ai.complete(slow, text)

    server.script("gpt-4o-mini", model_reply("slow answer", delay=3))
    server.script("gpt-4o", model_reply("fast answer"))
    async with app.worker(poll_interval=0.05):
        run = await app.start(ask, "x")
        assert await run.result(timeout=30) == "fast answer"
    (hedge,) = markers(await app.history(run.run_id), "model_hedge")
    assert {k: hedge[k] for k in ("asked", "won")} == {"asked": ["slow", "fast"], "won": "fast"}
    # the loser was still running when it was cancelled: what it may have used is noted
    assert hedge["abandoned"]["model"] == "slow" and hedge["abandoned"]["tokens"] > 0


async def test_a_model_at_another_endpoint_has_its_own_limiter_unless_told_to_share(
    app: tether.App,
) -> None:
    """The limiter was keyed by provider and model name, so a hedge (or a fallback) to
    the same model at another endpoint (a second region) waited on the first
    deployment's limiter: with ``max_concurrency=1`` each, the hedge was asked only
    after the slow call ended, and a 429 on one paused both. Each endpoint now has its
    own limiter; ``limiter=`` names one that registrations share."""

    with ModelServer() as s1, ModelServer() as s2:

        def models(gw: ai.Gateway, shared: str | None) -> ai.ModelRef:
            eu = gw.model(
                "eu",
                ai.openai_compatible("gpt-4o", base_url=s2.base_url, api_key="k"),
                max_concurrency=1,
                limiter=shared,
            )
            return gw.model(
                "us",
                ai.openai_compatible("gpt-4o", base_url=s1.base_url, api_key="k"),
                max_concurrency=1,
                hedge=(eu, 0.3),
                limiter=shared,
            )

        gw = ai.Gateway(app, retry=tether.Retry(attempts=1), timeout=20)
        us = models(gw, None)
        shared = models(ai.Gateway(app, name="shared", timeout=20), "gpt-4o-account")

        @app.workflow
        async def ask(share: bool) -> str:
            return await ai.complete(shared if share else us, "q")

        for share, expected in ((False, "eu fast"), (True, "us slow")):
            s1.script("gpt-4o", model_reply("us slow", delay=2))
            s2.script("gpt-4o", model_reply("eu fast"))
            async with app.worker(poll_interval=0.05):
                t0 = time.monotonic()
                run = await app.start(ask, share)
                assert await run.result(timeout=30) == expected
                took = time.monotonic() - t0
            if share:  # one limiter: the hedge waited for the first call's slot
                assert took >= 1.9
            else:
                assert s2.requests[-1].at - t0 < 1.5 and took < 1.9, took


async def test_a_deploy_that_adds_or_removes_a_hedge_leaves_runs_in_flight_replaying(
    store_url: str, server: ModelServer
) -> None:
    """A deploy adding ``hedge=`` to a model (or removing it) left every run that had
    called the model stuck in NonDeterminismError: its replay started a hedge's timer
    where history recorded the plain call (or the reverse). A recorded call replays
    hedged or not as it ran; the run's new calls follow this deploy."""
    url = server.base_url

    def deploy(hedged: bool) -> tether.App:
        app = tether.App(store=store_url)
        gw = ai.Gateway(app, retry=FAST, timeout=10)
        other = gw.model("other", ai.openai_compatible("m2", base_url=url, api_key="k"))
        m = gw.model(
            "m",
            ai.openai_compatible("m1", base_url=url, api_key="k"),
            hedge=(other, 0.3) if hedged else None,
        )

        @app.workflow
        async def ask(q: str) -> str:
            a = await ai.complete(m, q)
            await tether.wait_event("go")
            return a + " / " + await ai.complete(m, q + " again")

        return app

    server.script("m1", model_reply("m1 slow", delay=1.5), *[model_reply("m1")] * 4)
    server.script("m2", *[model_reply("m2")] * 3)
    for before, run_id in ((True, "was-hedged"), (False, "was-plain")):
        old = deploy(before)
        async with old.worker(poll_interval=0.05):
            await old.start("ask", "q", run_id=run_id)
            while not await old.list(waiting_for="signal:go"):
                await asyncio.sleep(0.02)
        await old.close()
        new = deploy(not before)
        async with new.worker(poll_interval=0.05):
            await new.signal(run_id, "go")
            out = await new.get_run(run_id).result(timeout=30)
        history = await new.history(run_id)
        await new.close()
        if before:  # the hedge answered the first call; the second is plain now
            assert out == "m2 / m1"
            assert [h["won"] for h in markers(history, "model_hedge")] == ["other"]
        else:  # the first call was plain; the second is hedged (and m1 answers in time)
            assert out == "m1 / m1"
        timers = [e for e in history if e.type is EventType.TIMER_STARTED]
        assert len(timers) == 1


async def test_a_deploy_that_changes_a_fallback_chain_leaves_runs_that_fell_back_replaying(
    store_url: str, server: ModelServer
) -> None:
    """A run that fell back to ``b1`` was stuck in NonDeterminismError after a deploy
    removed ``b1`` from the chain (its replay failed where history recorded the
    fallback), and after a deploy that replaced it by ``b2`` replayed ``b1``'s answer as
    ``b2``'s. A recorded fallback is followed to the model it went to; the run's new
    calls follow this deploy's chain; a model the run fell back to that this deploy no
    longer registers is a divergence that says so."""
    url = server.base_url

    def deploy(chain: list[str], models: tuple[str, ...] = ("b1", "b2")) -> tether.App:
        app = tether.App(store=store_url)
        gw = ai.Gateway(app, retry=tether.Retry(attempts=1), timeout=10)
        refs = {n: gw.model(n, ai.openai_compatible(n, base_url=url, api_key="k")) for n in models}
        m = gw.model(
            "m",
            ai.openai_compatible("m1", base_url=url, api_key="k"),
            fallback=[refs[c] for c in chain],
        )

        @app.workflow
        async def ask(q: str) -> str:
            a = await ai.complete(m, q)
            await tether.wait_event("go")
            try:
                b = await ai.complete(m, q + " again")
            except tether.ActivityError:
                b = "failed"
            return a + " / " + b

        return app

    server.default = lambda body: (
        model_error(503) if body["model"] == "m1" else model_reply(f"from {body['model']}")
    )
    for after, expected in (([], "from b1 / failed"), (["b2"], "from b1 / from b2")):
        run_id = f"fell-back-{len(after)}"
        old = deploy(["b1"])
        async with old.worker(poll_interval=0.05):
            await old.start("ask", "q", run_id=run_id)
            while not await old.list(waiting_for="signal:go"):
                await asyncio.sleep(0.02)
        await old.close()
        new = deploy(after)
        async with new.worker(poll_interval=0.05):
            await new.signal(run_id, "go")
            assert await new.get_run(run_id).result(timeout=30) == expected
        history = await new.history(run_id)
        assert [(f["from"], f["to"]) for f in markers(history, "model_fallback")] == [
            ("m", "b1"),
            *([("m", "b2")] if after else []),
        ]
        calls = [
            e.data["result"][CALL_KEY]["model"]
            for e in history
            if e.type is EventType.ACTIVITY_COMPLETED
        ]
        assert calls == ["b1", *after]
        await new.close()
    gone = deploy([], models=("b2",))  # b1 is not registered at all any more
    report = tether.testing.check_history(gone, await gone.history("fell-back-0"))
    assert not report.ok and "'b1'" in (report.error or "") and "register" in (report.error or "")
    await gone.close()


async def test_bad_configuration_fails_the_step_with_a_clear_message_and_no_secret(
    app: tether.App, server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    gw = ai.Gateway(app, retry=FAST, timeout=10)
    nokey = gw.model("nokey", "openai:gpt-4o-mini")
    unknown = gw.model("unknown", "nosuchprovider:model-x")
    secret = gw.model(
        "secret", ai.openai_compatible("gpt-4o", base_url=server.base_url, api_key="sk-TOPSECRET")
    )

    @app.workflow
    async def ask(which: str) -> str:
        ref = {"nokey": nokey, "unknown": unknown, "secret": secret}[which]
        return await ai.complete(ref, "x")

    server.script("gpt-4o", model_error(401, "Incorrect API key provided: sk-TOP****CRET"))
    async with app.worker(poll_interval=0.05):
        for which, expected in (
            ("nokey", "set OPENAI_API_KEY"),
            ("unknown", "nosuchprovider:model-x"),
            ("secret", "status_code: 401"),
        ):
            run = await app.start(ask, which)
            with pytest.raises(tether.WorkflowFailedError) as info:
                await run.result(timeout=30)
            assert expected in str(info.value), str(info.value)
            history = await app.history(run.run_id)
            attempts = [e for e in history if e.type is EventType.ACTIVITY_ATTEMPT_FAILED]
            assert attempts == [] or which == "secret"  # permanent: no retry
            assert "sk-TOPSECRET" not in str([e.data for e in history])
    assert server.count("gpt-4o") == 1  # 401 is permanent: not retried


async def test_outside_a_workflow_the_calls_run_directly() -> None:
    app = tether.App(store="sqlite:///:memory:")
    gw = ai.Gateway(app)
    scripted = ai.ScriptedModel([{"category": "tech", "priority": 1, "confidence": 1.0}])
    m = gw.model("scripted", scripted)
    t = await ai.structured(m, "x", output=Ticket)
    assert t.category == "tech" and scripted.calls == 1
    with pytest.raises(ai.ScriptExhausted):
        await ai.complete(m, "again")


async def test_sigkill_between_the_answer_and_its_record_calls_again_with_the_same_key(
    tmp_path: Path, server: ModelServer
) -> None:
    """The guarantee: a recorded answer is never asked for again (replay reads it); an
    answer the provider gave but the worker did not record (killed in between) is asked
    for once more, with the same Idempotency-Key header."""
    db = tmp_path / "tether.db"
    sys.path.insert(0, str(HERE))
    try:
        import ai_crash_app
    finally:
        sys.path.remove(str(HERE))
    client = tether.App(store=f"sqlite:///{db}")
    client._workflows["two_calls"] = ai_crash_app.two_calls
    server.script("m", model_reply("one"), model_reply("two (lost)"), model_reply("two"))
    procs: list[subprocess.Popen[bytes]] = []

    def kill_on_second(request: Any) -> None:
        if "second" in json.dumps(request.body) and len(procs) == 1:
            procs[0].send_signal(signal.SIGKILL)  # the provider has the request; the worker dies
            procs[0].wait(10)

    server.on_request = kill_on_second
    run = await client.start(ai_crash_app.two_calls, "doc", run_id="doc-1")
    procs.append(spawn_ai_worker(db, server))
    deadline = time.monotonic() + 30
    while procs[0].poll() is None:
        assert time.monotonic() < deadline, "the worker never asked the second question"
        await asyncio.sleep(0.05)
    assert procs[0].returncode == -signal.SIGKILL
    procs.append(spawn_ai_worker(db, server))
    try:
        assert await run.result(timeout=60) == ["one", "two"]
    finally:
        procs[1].terminate()
        procs[1].wait(10)
    prompts = [json.dumps(r.body["messages"]) for r in server.calls("m")]
    assert [("first" in p, "second" in p) for p in prompts] == [
        (True, False),  # recorded before the kill: never asked again
        (False, True),
        (False, True),  # answered but not recorded: asked again...
    ]
    keys = [r.headers.get("idempotency-key") for r in server.calls("m")]
    assert keys == ["doc-1:1", "doc-1:2", "doc-1:2"]  # ...with the same key
    usage = await client.usage("doc-1")
    assert usage.calls == 2  # the lost answer was never recorded, so it is not counted
    await client.close()


def spawn_ai_worker(
    db: Path, server: ModelServer, effects: Path | None = None
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}"}
    extra = [str(effects)] if effects is not None else []
    return subprocess.Popen(
        [sys.executable, str(HERE / "ai_crash_app.py"), str(db), server.base_url, *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def test_a_durable_agent_killed_after_its_second_tool_call_resumes_without_repeats(
    tmp_path: Path, server: ModelServer
) -> None:
    """Two tools, SIGKILL when the third model request arrives (both tool calls recorded):
    a new worker replays the recorded requests and tool calls and makes only the missing
    request again."""
    db, effects = tmp_path / "tether.db", tmp_path / "effects.txt"
    sys.path.insert(0, str(HERE))
    try:
        import ai_crash_app
    finally:
        sys.path.remove(str(HERE))
    client = tether.App(store=f"sqlite:///{db}")
    client._workflows["ask_agent"] = ai_crash_app.ask_agent
    server.script(
        "agent-model",
        model_reply(tool=("lookup", {"key": "x"})),
        model_reply(tool=("add", {"a": 40, "b": 2})),
        model_reply("42, lost"),
        model_reply("it is 42"),
    )
    procs: list[subprocess.Popen[bytes]] = []

    def kill_on_third(request: Any) -> None:
        if server.count("agent-model") == 2 and len(procs) == 1:
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait(10)

    server.on_request = kill_on_third
    run = await client.start(ai_crash_app.ask_agent, "what is x + 2?", run_id="agent-1")
    procs.append(spawn_ai_worker(db, server, effects))
    deadline = time.monotonic() + 30
    while procs[0].poll() is None:
        assert time.monotonic() < deadline, "the agent never made its third request"
        await asyncio.sleep(0.05)
    procs.append(spawn_ai_worker(db, server, effects))
    try:
        assert await run.result(timeout=60) == "it is 42"
    finally:
        procs[1].terminate()
        procs[1].wait(10)
    # each tool ran once; each recorded model request was made once; the lost one twice
    assert effects.read_text().splitlines() == ["lookup x", "add 40 2"]
    tool_results = [json.dumps(r.body["messages"]).count('"role": "tool"') for r in server.calls()]
    assert tool_results == [0, 1, 2, 2]
    history = await client.history("agent-1")
    names = [e.data["name"] for e in history if e.type is EventType.ACTIVITY_SCHEDULED]
    assert names == ["tether.ai.call", "tether.ai.agent.helper.tool"] * 2 + ["tether.ai.call"]
    assert (await client.usage("agent-1")).calls == 3
    await client.close()


async def test_the_answer_cache_serves_the_same_question_across_runs_and_counts_savings(
    app: tether.App, server: ModelServer
) -> None:
    gw = ai.Gateway(app, retry=FAST, timeout=10)
    cached = gw.model(
        "cached",
        ai.openai_compatible("gpt-4o-mini", base_url=server.base_url, api_key="k"),
        cache_ttl=60,
    )

    @app.workflow
    async def ask(text: str) -> str:
        t = await ai.structured(cached, text, output=Ticket)
        return t.category

    server.script("gpt-4o-mini", ticket("billing"), ticket("tech"))
    async with app.worker(poll_interval=0.05):
        first = await app.start(ask, "same question")
        assert await first.result(timeout=30) == "billing"
        again = await app.start(ask, "same question")  # another run, the same request
        assert await again.result(timeout=30) == "billing"
        other = await app.start(ask, "another question")
        assert await other.result(timeout=30) == "tech"
    assert server.count() == 2
    saved = await app.usage(again.run_id)
    assert (saved.calls, saved.cached_calls, saved.tokens, saved.tokens_saved) == (1, 1, 0, 150)
    assert saved.cost == 0 and saved.cost_saved == Decimal("0.000036")


async def test_a_tenant_daily_budget_is_shared_by_its_runs_and_can_be_raised(
    app: tether.App, server: ModelServer
) -> None:
    gw, primary = gateway(app, server)

    @app.workflow
    async def ask(text: str) -> str:
        try:
            return await ai.complete(primary, text, settings={"max_tokens": 100})
        except ai.BudgetExceeded as exc:
            return f"refused: {exc.scope} {exc.what}"

    await gw.set_budget(tenant="acme", tokens=400)
    server.script("gpt-4o-mini", *[model_reply("ok", input_tokens=120, output_tokens=30)] * 4)
    async with app.worker(poll_interval=0.05):
        results = []
        for i in range(3):
            run = await app.start(ask, f"q{i}", tenant="acme")
            results.append(await run.result(timeout=30))
        other = await app.start(ask, "q", tenant="globex")  # no budget: not limited
        assert await other.result(timeout=30) == "ok"
        assert results == ["ok", "ok", "refused: tenant:acme tokens"]
        await gw.set_budget(tenant="acme", tokens=1000)  # an operator raises it
        await asyncio.sleep(2.1)  # workers re-read the budgets within 2 s
        run = await app.start(ask, "q3", tenant="acme")
        assert await run.result(timeout=30) == "ok"
    assert server.count() == 4
    budgets = await gw.budgets()
    assert budgets == [
        {
            "scope": "tenant:acme",
            "tokens": 1000,
            "cost": None,
            "spent_tokens": 450,
            "spent_cost": str(Decimal("0.000036") * 3),
        },
    ]
    await gw.set_budget(tenant="acme")  # removed
    assert await gw.budgets() == []


def _scheduled_bytes(history: list[tether.Event]) -> list[int]:
    return [
        len(json.dumps(e.data))
        for e in history
        if e.type is EventType.ACTIVITY_SCHEDULED and e.data["name"].endswith(".call")
    ]


async def test_a_long_conversation_stores_flat_bytes_per_call(
    app: tether.App, server: ModelServer
) -> None:
    """With message references each step records only its new messages: the stored bytes
    per call stay flat as the conversation grows (full lists grow linearly per call)."""
    from pydantic_ai.messages import ModelMessage, ModelRequest, UserPromptPart

    gw = ai.Gateway(app, retry=FAST)
    full_gw = ai.Gateway(app, name="full", retry=FAST, message_refs=False)
    url = server.base_url
    refs = gw.model("refs", ai.openai_compatible("chat", base_url=url, api_key="k"))
    full = full_gw.model("full", ai.openai_compatible("chat", base_url=url, api_key="k"))
    server.default = lambda body: model_reply("a reply of some length " * 4)

    @app.workflow
    async def chat(which: str, turns: int) -> int:
        model = refs if which == "refs" else full
        messages: list[ModelMessage] = []
        for i in range(turns):
            messages.append(ModelRequest(parts=[UserPromptPart(f"question number {i} " * 3)]))
            response, _call = await model.gateway.request(model, messages)
            messages.append(response)
        return len(messages)

    async with app.worker(poll_interval=0.05):
        a = await app.start(chat, "refs", 40)
        b = await app.start(chat, "full", 40)
        assert await a.result(timeout=60) == await b.result(timeout=60) == 80
    flat = _scheduled_bytes(await app.history(a.run_id))
    grows = _scheduled_bytes(await app.history(b.run_id))
    first, last = sum(flat[:10]) / 10, sum(flat[-10:]) / 10
    assert abs(last - first) / first < 0.2, (first, last)
    assert sum(grows[-10:]) / 10 > 5 * sum(grows[:10]) / 10
    # the model saw the whole conversation either way
    sizes = [len(r.body["messages"]) for r in server.calls("chat")]
    assert sorted(sizes) == sorted([2 * i + 1 for i in range(40)] * 2)


def _counting_chat(app: tether.App, server: ModelServer) -> tuple[ai.Gateway, ai.ModelRef]:
    """A gateway and its model ``m`` on the test server, which answers each request with
    ``reply N`` (N: how many messages it was sent)."""
    gw = ai.Gateway(app, retry=FAST)
    model = gw.model("m", ai.openai_compatible("chat", base_url=server.base_url, api_key="k"))
    server.default = lambda body: model_reply(f"reply {len(body['messages'])}")
    return gw, model


async def test_a_worker_that_did_not_see_a_conversation_rebuilds_it_from_history(
    app: tether.App, server: ModelServer
) -> None:
    from pydantic_ai.messages import ModelMessage, ModelRequest, UserPromptPart

    gw, model = _counting_chat(app, server)

    @app.workflow
    async def chat() -> str:
        messages: list[ModelMessage] = []
        for i in range(6):
            if i == 3:
                await tether.wait_event("go")
            messages.append(ModelRequest(parts=[UserPromptPart(f"q{i}")]))
            response, _call = await gw.request(model, messages)
            messages.append(response)
        return str(response.parts[0].content)  # type: ignore[union-attr]

    async with app.worker(poll_interval=0.05):
        run = await app.start(chat)
        while not (await app.get(run.run_id)).waiting_on:
            await asyncio.sleep(0.02)
        # as if another worker (that never saw this run) took over from here
        gw._threads.clear()
        await app.signal(run.run_id, "go")
        assert await run.result(timeout=30) == "reply 11"
    texts = [json.dumps(r.body["messages"]) for r in server.calls("chat")]
    assert all(f"q{i}" in texts[-1] for i in range(6))  # the full conversation was sent
    # an exported history writes every step's conversation out in full
    exported = ai.expand_history(await app.history(run.run_id))
    steps = [
        e["data"]["args"]["args"][-1]["messages"]
        for e in exported
        if e["type"] == "ActivityScheduled"
    ]
    assert [len(m) for m in steps] == [1, 3, 5, 7, 9, 11]
    assert all(isinstance(m, list) for m in steps)
    assert "q0" in json.dumps(steps[-1]) and "reply 9" in json.dumps(steps[-1])
    recorded = [e for e in await app.history(run.run_id) if e.type is EventType.ACTIVITY_SCHEDULED]
    assert all("base" in e.data["args"]["args"][-1]["messages"] for e in recorded)  # as stored


async def test_a_conversation_replayed_after_its_prompt_changed_refers_to_what_was_sent(
    store_url: str, server: ModelServer
) -> None:
    """Steps refer to earlier messages by hash; a replay after a deploy reworded the
    first prompt must refer to what history holds, not to today's wording."""
    from pydantic_ai.messages import ModelMessage, ModelRequest, UserPromptPart

    server.default = lambda body: model_reply(f"reply {len(body['messages'])}")

    def deploy(first: str) -> tether.App:
        app = tether.App(store=store_url)
        gw = ai.Gateway(app, retry=FAST)
        model = gw.model("m", ai.openai_compatible("chat", base_url=server.base_url, api_key="k"))

        @app.workflow
        async def chat() -> str:
            messages: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart(first)])]
            response, _call = await gw.request(model, messages)
            await tether.wait_event("go")
            messages += [response, ModelRequest(parts=[UserPromptPart("and then?")])]
            response, _call = await gw.request(model, messages)
            return str(response.parts[0].content)  # type: ignore[union-attr]

        return app

    old = deploy("the first wording")
    async with old.worker(poll_interval=0.05):
        await old.start("chat", run_id="c")
        while not (await old.get("c")).waiting_on:
            await asyncio.sleep(0.02)
    await old.close()
    new = deploy("the second wording")  # replays step 1 with other text than it sent
    async with new.worker(poll_interval=0.05):
        await new.signal("c", "go")
        assert await new.get_run("c").result(timeout=30) == "reply 3"
    await new.close()
    last = json.dumps(server.calls("chat")[-1].body["messages"])
    assert "the second wording" in last and "reply 1" in last and "and then?" in last


class _ByPrompt(ai.ScriptedModel):
    """Answers each case by its prompt, and a repair by the number of requests so far:
    an attempt redelivered under load gets the same answer (a plain script would
    hand it the next case's)."""

    def __init__(self, answers: dict[str, list[Any]]) -> None:
        super().__init__([a for v in answers.values() for a in v])
        self.by_prompt = answers

    def _answer(self, messages: list[Any], info: Any) -> Any:
        from pydantic_ai.messages import ModelRequest, UserPromptPart

        requests = [m for m in messages if isinstance(m, ModelRequest)]
        prompt = next(str(p.content) for p in requests[0].parts if isinstance(p, UserPromptPart))
        options = self.by_prompt[prompt]
        item = options[min(len(requests), len(options)) - 1]
        return ai.ScriptedModel([item])._answer(messages, info)


async def test_evaluate_scores_a_router_from_its_recorded_decisions(tmp_path: Path) -> None:
    """tether.testing.evaluate over a workflow that classifies with a model and routes:
    the confusion matrix is the router's (read from history), repairs and cost too."""
    from tether.testing import aevaluate

    app = tether.App(store=f"sqlite:///{tmp_path / 'eval.db'}")
    gw = ai.Gateway(app, retry=FAST)
    answers = {
        "refund my card": [{"category": "billing", "priority": 2, "confidence": 0.9}],
        "app crashes": ["not json", {"category": "tech", "priority": 1, "confidence": 0.8}],
        "hello?": [{"category": "sales", "priority": 3, "confidence": 0.9}],
        "charged twice": [{"category": "billing", "priority": 1, "confidence": 0.3}],
    }
    scripted = _ByPrompt(answers)
    model = gw.model("m", scripted, price=ai.Price(input_per_mtok=1, output_per_mtok=2))

    @app.workflow
    async def triage(text: str) -> str:
        t = await ai.structured(model, text, output=Ticket, max_repairs=1)
        return tether.route(
            t.category,
            {"billing", "tech"},
            default="human",
            confidence=t.confidence,
            min_confidence=0.5,
            name="queue",
        )

    cases = [
        ("refund my card", "billing"),
        ("app crashes", "tech"),
        ("hello?", "human"),
        ("charged twice", "billing"),  # low confidence: routed to a human
    ]
    report = await aevaluate(triage, cases, app=app, router="queue")
    errors = [r.error for r in report.results if r.error]
    assert not errors, errors  # (seen once in CI under load: name the error if it recurs)
    assert report.accuracy == 0.75
    assert report.confusion == {
        "billing": {"billing": 1, "human": 1},
        "tech": {"tech": 1},
        "human": {"human": 1},
    }
    assert report.repair_rate == 0.25
    assert [r.cost for r in report.results] == [0.00002, 0.00004, 0.00002, 0.00002]
    await app.close()


async def test_a_streamed_step_reaches_followers_and_only_the_answer_is_recorded(
    app: tether.App, server: ModelServer
) -> None:
    gw, primary = gateway(app, server)

    @app.workflow
    async def tell(topic: str) -> str:
        first = await ai.complete(primary, f"tell me about {topic}", stream=True)
        await tether.wait_event("more")
        second = await ai.complete(primary, "and then?", stream=True)
        return f"{first} | {second}"

    server.script(
        "gpt-4o-mini",
        model_reply("the quick brown fox", chunk_delay=0.01),
        model_reply("jumps over", chunk_delay=0.01),
    )
    got: list[dict[str, Any]] = []

    async def follow(run_id: str, steps: int) -> None:
        async for item in gw.follow(run_id):
            got.append(item)
            if item.get("done") and sum(1 for g in got if g.get("done")) == steps:
                return

    async with app.worker(poll_interval=0.05):
        follower = asyncio.create_task(follow("tale", 1))
        await asyncio.sleep(0.01)  # following before the run starts: no delta can be missed
        run = await app.start(tell, "foxes", run_id="tale")
        await asyncio.wait_for(follower, 30)
    deltas = [g["delta"] for g in got if "delta" in g]
    assert "".join(deltas) == "the quick brown fox" and len(deltas) == 4
    assert got[-1]["done"] is True and got[0]["step"] == 1
    # a fresh worker replays the first answer without streaming it again
    again: list[dict[str, Any]] = []

    async def follow_again() -> None:
        async for item in gw.follow("tale"):
            again.append(item)
            if item.get("done"):
                return

    async with app.worker(poll_interval=0.05):
        follower = asyncio.create_task(follow_again())
        await asyncio.sleep(0.01)
        await app.signal("tale", "more")
        assert await run.result(timeout=30) == "the quick brown fox | jumps over"
        await asyncio.wait_for(follower, 30)
    assert "".join(g["delta"] for g in again if "delta" in g) == "jumps over"
    assert server.count() == 2
    history = await app.history("tale")
    completed = [e for e in history if e.type is EventType.ACTIVITY_COMPLETED]
    assert [c.data["result"]["response"]["parts"][0]["content"] for c in completed] == [
        "the quick brown fox",
        "jumps over",
    ]


async def test_a_streamed_step_answered_from_the_cache_still_reaches_its_followers(
    app: tether.App, server: ModelServer
) -> None:
    """A streamed step answered from the answer cache sent its followers nothing, not
    even ``done``: a chat UI waited for ever. The cached text now goes as one delta at
    offset 0, then ``done``."""
    gw, primary = gateway(app, server, cache_ttl=600)

    @app.workflow
    async def tell(topic: str) -> str:
        return await ai.complete(primary, f"tell me about {topic}", stream=True)

    server.script("gpt-4o-mini", model_reply("the quick brown fox", chunk_delay=0.01))
    got: list[dict[str, Any]] = []

    async def follow(run_id: str) -> None:
        async for item in gw.follow(run_id):
            got.append(item)
            if item.get("done") or item.get("failed"):
                return

    async with app.worker(poll_interval=0.05):
        first = await app.start(tell, "foxes")
        assert await first.result(timeout=30) == "the quick brown fox"
        follower = asyncio.create_task(follow("cached-tale"))
        await asyncio.sleep(0.01)
        again = await app.start(tell, "foxes", run_id="cached-tale")
        assert await again.result(timeout=30) == "the quick brown fox"
        await asyncio.wait_for(follower, 30)
    assert server.count() == 1  # the second answer came from the cache
    assert [(g.get("offset"), g.get("delta")) for g in got[:-1]] == [(0, "the quick brown fox")]
    assert got[-1]["done"] is True and got[-1]["step"] == got[0]["step"] == 1


async def test_a_hedged_streamed_steps_cancelled_loser_ends_its_stream_as_failed(
    app: tether.App, server: ModelServer
) -> None:
    """The loser of a hedged streamed step, cancelled when the other answered, streamed
    on to its end and then sent ``done``: a follower could take it for the answer. It
    now stops soon after the hedge is decided, with ``failed``."""
    gw = ai.Gateway(app, retry=FAST, timeout=20)
    url = server.base_url
    fast = gw.model("fast", ai.openai_compatible("gpt-4o", base_url=url, api_key="k"))
    slow = gw.model(
        "slow", ai.openai_compatible("gpt-4o-mini", base_url=url, api_key="k"), hedge=(fast, 0.3)
    )

    @app.workflow
    async def ask(text: str) -> str:
        return await ai.complete(slow, text, stream=True)

    words = " ".join(f"w{i}" for i in range(12))
    server.script("gpt-4o-mini", model_reply(f"slow {words}", chunk_delay=0.4))
    server.script("gpt-4o", model_reply("fast alpha beta", chunk_delay=0.05))
    got: list[dict[str, Any]] = []
    ends: dict[str, dict[str, Any]] = {}

    async def follow() -> None:
        async for item in gw.follow("hedged-stream"):
            got.append(item)
            if item.get("done") or item.get("failed"):
                ends[item["model"]] = item
                if len(ends) == 2:
                    return

    heard: list[dict[str, Any]] = []  # what other processes hear, through the store

    def listen(run_id: str, item: dict[str, Any]) -> None:
        if "delta" not in item:
            heard.append(item)

    app.store.add_stream_listener(listen)

    async def told() -> bool:
        return any(h.get("model") == "slow" for h in heard)

    async with app.worker(poll_interval=0.05):
        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.01)
        run = await app.start(ask, "x", run_id="hedged-stream")
        assert await run.result(timeout=30) == "fast alpha beta"
        await asyncio.wait_for(follower, 4)  # the loser's own answer takes over 5 s
        await eventually(told, timeout=4)
    assert ends["fast"].get("done") is True
    # as documented: the loser ends with StepCancelled (not the task's CancelledError),
    # in this process and in others (through the store: it said nothing there)
    assert ends["slow"].get("failed") == "StepCancelled" and not ends["slow"].get("done")
    assert [h.get("failed") for h in heard if h["model"] == "slow"] == ["StepCancelled"]
    slow_text = "".join(g.get("delta", "") for g in got if g["model"] == "slow")
    assert len(slow_text) < len(f"slow {words}")


async def test_a_streamed_step_of_a_cancelled_run_ends_its_stream_as_step_cancelled(
    app: tether.App, server: ModelServer
) -> None:
    """A run cancelled while its step streamed: the step's task is cancelled at once, and
    its followers heard ``failed: CancelledError`` in this process, nothing in others.
    Both now hear ``failed: StepCancelled``, as documented."""
    gw, primary = gateway(app, server)

    @app.workflow
    async def tell() -> str:
        return await ai.complete(primary, "tell me", stream=True)

    words = " ".join(f"w{i}" for i in range(100))
    server.script("gpt-4o-mini", model_reply(words, chunk_delay=0.05))
    got: list[dict[str, Any]] = []
    heard: list[dict[str, Any]] = []

    def listen(run_id: str, item: dict[str, Any]) -> None:
        if "delta" not in item:
            heard.append(item)

    app.store.add_stream_listener(listen)

    async def follow() -> None:
        async for item in gw.follow("cancelled-stream"):
            got.append(item)
            if len(got) == 3:
                await app.cancel("cancelled-stream")
            if item.get("done") or item.get("failed"):
                return

    async def told() -> bool:
        return bool(heard)

    async with app.worker(poll_interval=0.05):
        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.01)
        run = await app.start(tell, run_id="cancelled-stream")
        with pytest.raises(tether.RunCancelledError):
            await run.result(timeout=30)
        await asyncio.wait_for(follower, 4)  # the answer takes 5 s
        await eventually(told, timeout=4)
    assert got[-1].get("failed") == "StepCancelled", got[-1]
    assert [h.get("failed") for h in heard] == ["StepCancelled"], heard
    # a cancel still reads as one (not as a timeout or a worker stopping), and says so
    error = got[-1]["error"]
    assert error.startswith("model 'primary' (gpt-4o-mini), step 1, attempt 1: "), error
    assert "cancelled while it streamed its answer" in error, error
    assert heard[0]["error"] == error


async def test_a_streamed_step_that_times_out_says_so_naming_model_step_and_what_to_do(
    app: tether.App, server: ModelServer
) -> None:
    """A streamed model step whose timeout ran out mid-answer told its followers (in this
    process and, through the store, in others: the SSE stream) only ``failed:
    CancelledError``, and recorded ``activity 'tether.ai.call' timed out after 0.6s``,
    naming neither the model nor what to do. Both now say it timed out, after how long,
    which model and step, and how to give it more time."""
    gw = ai.Gateway(app, retry=tether.Retry(attempts=2, initial=0.05, backoff=1.0))
    primary = gw.model(
        "primary",
        ai.openai_compatible("gpt-4o-mini", base_url=server.base_url, api_key="k"),
        timeout=0.6,
    )

    @app.workflow
    async def tell() -> str:
        return await ai.complete(primary, "tell me", stream=True)

    words = " ".join(f"w{i}" for i in range(60))  # 3 s an answer
    server.script(
        "gpt-4o-mini",
        model_reply(words, chunk_delay=0.05),
        model_reply(words, chunk_delay=0.05),
    )
    got: list[dict[str, Any]] = []
    heard: list[dict[str, Any]] = []

    def listen(run_id: str, item: dict[str, Any]) -> None:
        if "delta" not in item:
            heard.append(item)

    app.store.add_stream_listener(listen)

    async def follow() -> None:
        async for item in gw.follow("slow-stream"):
            if "delta" not in item:
                got.append(item)
            if item.get("failed") and item["attempt"] == 2:
                return

    async def told() -> bool:
        return len(heard) == 2

    async with app.worker(poll_interval=0.05):
        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.01)
        run = await app.start(tell, run_id="slow-stream")
        with pytest.raises(tether.WorkflowFailedError) as failed:
            await run.result(timeout=30)
        await asyncio.wait_for(follower, 10)
        await eventually(told, timeout=4)
    assert got == heard, (got, heard)
    for attempt, item in enumerate(got, 1):
        assert item["attempt"] == attempt and item["failed"] == "TimeoutError", item
        error = item["error"]
        assert f"model 'primary' (gpt-4o-mini), step 1, attempt {attempt}: " in error, error
        assert "timed out after 0.6 s (its timeout per attempt)" in error, error
        assert "while it streamed its answer" in error, error
        then = "it is retried" if attempt == 1 else "that was its last attempt (2 allowed)"
        assert then in error, error
        assert "gateway.model(..., timeout=)" in error, error
        assert "CancelledError" not in error
    # the history (and so the CLI and the console, which show it) says the same
    history = await app.history("slow-stream")
    recorded = [
        e.data["error"]
        for e in history
        if e.type in (EventType.ACTIVITY_ATTEMPT_FAILED, EventType.ACTIVITY_FAILED)
    ]
    assert [r["type"] for r in recorded] == ["TimeoutError", "TimeoutError"]
    assert [r["retryable"] for r in recorded] == [True, False]  # retried as before
    for r in recorded:
        assert r["message"].startswith("model 'primary' (gpt-4o-mini), step 1, attempt "), r
        assert "timed out after 0.6 s (its timeout per attempt)" in r["message"], r
        assert "gateway.model(..., timeout=)" in r["message"], r
    assert "timed out after 0.6 s (its timeout per attempt)" in str(failed.value)
    info = await app.get("slow-stream")
    assert info.error is not None and "model 'primary'" in info.error["message"], info.error


async def test_a_model_call_that_times_out_records_which_model_and_what_to_do(
    app: tether.App, server: ModelServer
) -> None:
    """Not streamed either: the timeout recorded only ``activity 'tether.ai.call' timed
    out after 0.5s``; it now names the model and step, and the option to raise."""
    gw = ai.Gateway(app, retry=tether.Retry(attempts=1))
    primary = gw.model(
        "primary",
        ai.openai_compatible("gpt-4o-mini", base_url=server.base_url, api_key="k"),
        timeout=0.5,
    )

    @app.workflow
    async def ask() -> str:
        return await ai.complete(primary, "tell me")

    server.script("gpt-4o-mini", model_reply("late", delay=3))
    async with app.worker(poll_interval=0.05):
        run = await app.start(ask, run_id="late-answer")
        with pytest.raises(tether.WorkflowFailedError):
            await run.result(timeout=30)
    (failed,) = [
        e.data["error"]
        for e in await app.history("late-answer")
        if e.type is EventType.ACTIVITY_FAILED
    ]
    assert failed["type"] == "TimeoutError" and failed["retryable"] is False, failed
    assert failed["message"].startswith(
        "model 'primary' (gpt-4o-mini), step 1, attempt 1: timed out after 0.5 s (its "
        "timeout per attempt) while it waited for the answer; that was its last attempt (1 "
        "allowed). If answers this long are expected, raise the model's timeout"
    ), failed


async def test_a_streamed_step_interrupted_by_its_worker_stopping_says_so(
    app: tether.App, server: ModelServer
) -> None:
    """A worker stopping (a deploy) cancels a step still streaming after its grace; its
    followers heard only ``failed: CancelledError``. They now hear ``WorkerStopped``,
    with what happened (the step is handed back and retried, its attempt not counted);
    nothing is recorded, and the next worker answers the step."""
    gw, primary = gateway(app, server)

    @app.workflow
    async def tell() -> str:
        return await ai.complete(primary, "tell me", stream=True)

    words = " ".join(f"w{i}" for i in range(60))
    server.script("gpt-4o-mini", model_reply(words, chunk_delay=0.05), model_reply("all of it"))
    got: list[dict[str, Any]] = []
    heard: list[dict[str, Any]] = []

    def listen(run_id: str, item: dict[str, Any]) -> None:
        if "delta" not in item:
            heard.append(item)

    app.store.add_stream_listener(listen)
    streaming = asyncio.Event()

    async def follow() -> None:
        async for item in gw.follow("stopped-stream"):
            if "delta" in item:
                streaming.set()
            else:
                got.append(item)
            if item.get("failed") or item.get("done"):
                return

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0.01)
    worker = app.worker(poll_interval=0.05)
    await worker.start()
    try:
        run = await app.start(tell, run_id="stopped-stream")
        await asyncio.wait_for(streaming.wait(), 10)
    finally:
        await worker.stop(grace=0.2)
    await asyncio.wait_for(follower, 4)
    assert heard == got and len(got) == 1, (got, heard)
    (item,) = got
    assert item["failed"] == "WorkerStopped" and item["attempt"] == 1, item
    error = item["error"]
    assert error.startswith("model 'primary' (gpt-4o-mini), step 1, attempt 1: "), error
    assert "its worker stopped (a deploy, a restart) while it streamed its answer" in error
    assert "retried" in error and "CancelledError" not in error, error
    history = await app.history("stopped-stream")
    assert not [e for e in history if "Failed" in e.type.value and "Activity" in e.type.value]
    async with app.worker(poll_interval=0.05):
        assert await run.result(timeout=30) == "all of it"


async def test_a_cut_off_stream_is_a_failed_attempt_and_followers_can_tell_attempts_apart(
    app: tether.App, server: ModelServer
) -> None:
    """A stream a proxy cut off (no finish reason, no [DONE]) was recorded as a short,
    complete answer; it is now an attempt that failed and is retried. Followers saw the
    dead attempt's text glued to the next one's: items now carry their attempt and
    offset, and a failing attempt says so."""
    gw, primary = gateway(app, server)

    @app.workflow
    async def tell() -> str:
        return await ai.complete(primary, "tell me", stream=True)

    server.script(
        "gpt-4o-mini",
        model_reply("CUT alpha beta gamma", cut_after=2, chunk_delay=0.01),
        model_reply("one two three", chunk_delay=0.01),
    )
    got: list[dict[str, Any]] = []

    async def follow() -> None:
        async for item in gw.follow("cut"):
            got.append(item)
            if item.get("done"):
                return

    async with app.worker(poll_interval=0.05):
        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.01)
        run = await app.start(tell, run_id="cut")
        assert await run.result(timeout=30) == "one two three"
        await asyncio.wait_for(follower, 30)
    assert server.count() == 2  # the cut-off answer was not taken
    first = [g for g in got if g.get("attempt") == 1]
    assert "".join(g.get("delta", "") for g in first) == "CUT alpha "
    assert first[-1]["failed"]  # the dead attempt says so
    second = [g for g in got if g.get("attempt") == 2 and "delta" in g]
    assert "".join(g["delta"] for g in second) == "one two three"
    offsets = [g["offset"] for g in second]
    assert offsets == sorted(offsets) and offsets[0] == 0  # each attempt from its start
    assert got[-1]["done"] is True and got[-1]["attempt"] == 2


async def test_a_big_streamed_piece_reaches_followers_in_other_processes(
    pg_schema: str, server: ModelServer
) -> None:
    """A provider that sends its whole answer in one chunk (9,000 characters) made a
    piece too big for a PostgreSQL notification: followers in other processes got none
    of it, silently. Pieces are now at most STREAM_PIECE characters."""
    from conftest import PG_URL, with_schema

    store_url = with_schema(PG_URL, pg_schema)
    app = tether.App(store=store_url)
    watcher = tether.App(store=store_url)  # another process following the run
    _gw, primary = gateway(app, server)

    @app.workflow
    async def tell() -> str:
        return await ai.complete(primary, "tell me", stream=True)

    text = "é" * 9000  # one word, one chunk; two bytes a character in UTF-8
    server.script("gpt-4o-mini", model_reply(text))
    heard: list[dict[str, Any]] = []
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def listen(run_id: str, item: dict[str, Any]) -> None:
        heard.append(item)
        if item.get("done"):
            loop.call_soon_threadsafe(done.set)

    try:
        await watcher.list()  # opens its store (and its listener on PostgreSQL)
        watcher.store.add_stream_listener(listen)
        async with app.worker(poll_interval=0.05):
            run = await app.start(tell, run_id="big")
            assert await run.result(timeout=30) == text
            await asyncio.wait_for(done.wait(), 30)
        assert "".join(h.get("delta", "") for h in heard) == text
        assert all(len(h.get("delta", "")) <= 1000 for h in heard)
    finally:
        await watcher.close()
        await app.close()


async def test_a_run_keeps_the_model_it_started_with_across_a_deploy(
    store_url: str, server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    server.default = lambda body: model_reply(f"from {body['model']}")

    def deploy(fast_spec: Any, version: str | None = None) -> tether.App:
        app = tether.App(store=store_url)
        gw = ai.Gateway(app, retry=FAST)
        fast = gw.model("fast", fast_spec, version=version)

        @app.workflow
        async def two(text: str) -> str:
            first = await ai.complete(fast, text)
            await tether.wait_event("go")
            return f"{first}, {await ai.complete(fast, text)}"

        return app

    old = deploy("openai:m-old")
    async with old.worker(poll_interval=0.05):
        await old.start("two", "x", run_id="pinned")
        while not await old.list(waiting_for="signal:go"):
            await asyncio.sleep(0.02)
    pins = (await old.get("pinned")).attrs["pins"]["tether.ai"]["models"]  # type: ignore[index]
    assert pins == {"fast": {"version": "openai:m-old", "spec": "openai:m-old"}}
    await old.start("two", "q", run_id="started-before")  # not run at all before the deploy
    await old.close()
    new = deploy("openai:m-new")  # a deploy changes the model
    async with new.worker(poll_interval=0.05):
        await new.signal("pinned", "go")
        assert await new.get_run("pinned").result(timeout=30) == "from m-old, from m-old"
        await new.signal("started-before", "go")
        assert await new.get_run("started-before").result(timeout=30) == "from m-old, from m-old"
        fresh = await new.start("two", "y")
        await new.signal(fresh.run_id, "go")
        assert await fresh.result(timeout=30) == "from m-new, from m-new"
    await new.close()
    # a model object cannot be rebuilt from its pin: the change is recorded, not silent
    url = server.base_url
    old = deploy(ai.openai_compatible("m-a", base_url=url, api_key="k"), version="a")
    async with old.worker(poll_interval=0.05):
        await old.start("two", "z", run_id="repinned")
        while not await old.list(waiting_for="signal:go"):
            await asyncio.sleep(0.02)
    await old.close()
    new = deploy(ai.openai_compatible("m-b", base_url=url, api_key="k"), version="b")
    async with new.worker(poll_interval=0.05):
        await new.signal("repinned", "go")
        assert await new.get_run("repinned").result(timeout=30) == "from m-a, from m-b"
    assert markers(await new.history("repinned"), "model_repinned") == [
        {
            "model": "fast",
            "from": "a",
            "to": "b",
            "why": "the pinned model is a Model object this deploy does not have",
        }
    ]
    await new.close()


async def test_the_answer_cache_answers_a_pinned_run_from_its_pinned_model_only(
    store_url: str, server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run pinned to the model it started with got, after a deploy changed the model,
    the new model's cached answer: the cache keyed on today's model, not on the one
    the step called."""
    monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    server.default = lambda body: model_reply(f"from {body['model']}")

    def deploy(spec: str) -> tether.App:
        app = tether.App(store=store_url)
        gw = ai.Gateway(app, retry=FAST)
        fast = gw.model("fast", spec, cache_ttl=600)

        @app.workflow
        async def ask(text: str) -> str:
            await tether.wait_event("go")
            return await ai.complete(fast, text)

        return app

    old = deploy("openai:m-old")
    await old.start("ask", "same", run_id="old-run")  # pinned to m-old
    await old.close()
    new = deploy("openai:m-new")
    async with new.worker(poll_interval=0.05):
        fresh = await new.start("ask", "same")
        await new.signal(fresh.run_id, "go")
        assert await fresh.result(timeout=30) == "from m-new"
        await new.signal("old-run", "go")
        assert await new.get_run("old-run").result(timeout=30) == "from m-old"
        again = await new.start("ask", "same")  # the new model's answer is still cached
        await new.signal(again.run_id, "go")
        assert await again.result(timeout=30) == "from m-new"
    assert (server.count("m-old"), server.count("m-new")) == (1, 1)
    await new.close()


async def test_a_run_keeps_its_prompt_version_across_deploys_and_a_fork_tries_another(
    store_url: str, server: ModelServer
) -> None:
    server.default = lambda body: model_reply("re: " + body["messages"][-1]["content"])
    v1, v2 = "Say {text}", "Please say {text}"

    def deploy(versions: dict[str, str]) -> tuple[tether.App, ai.Prompt]:
        app = tether.App(store=store_url)
        gw = ai.Gateway(app, retry=FAST)
        fast = gw.model("fast", ai.openai_compatible("m", base_url=server.base_url, api_key="k"))
        ask = gw.prompt("ask", versions)  # the last version is the current one

        @app.workflow
        async def two(text: str) -> str:
            first = await ai.complete(fast, ask.render(text=text))
            await tether.wait_event("go")
            return f"{first} | {await ai.complete(fast, ask.render(text=text))}"

        return app, ask

    async def waiting(app: tether.App, run_id: str) -> None:
        for _ in range(1000):
            if run_id in {r.run_id for r in await app.list(waiting_for="signal:go")}:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{await app.get(run_id)}")

    def prompts_called(history: list[tether.Event]) -> list[str]:
        return [
            e.data["result"][CALL_KEY]["prompt_version"]
            for e in history
            if e.type is EventType.ACTIVITY_COMPLETED
        ]

    old, ask = deploy({"v1": v1, "v2": v2})
    assert ask.versions == ("v1", "v2") and str(ask.render(text="hi")) == "Please say hi"
    with pytest.raises(tether.ConfigurationError, match="needs a value for 'text'"):
        ask.render()
    async with old.worker(poll_interval=0.05):
        for run_id in ("p", "q"):
            await old.start("two", "x", run_id=run_id)
            await waiting(old, run_id)
    pins = (await old.get("p")).attrs["pins"]["tether.ai"]  # type: ignore[index]
    assert pins["prompts"] == {"ask": "v2"}
    await old.close()

    new, _ = deploy({"v1": v1, "v2": v2, "v3": "Kindly say {text}"})  # v3 is current now
    async with new.worker(poll_interval=0.05):
        await new.signal("p", "go")
        assert await new.get_run("p").result(timeout=30) == "re: Please say x | re: Please say x"
        fresh = await new.start("two", "y")
        await new.signal(fresh.run_id, "go")
        assert await fresh.result(timeout=30) == "re: Kindly say y | re: Kindly say y"
        # a fork runs the rest of a real run with another version of the prompt
        with pytest.raises(tether.ConfigurationError, match="known: v1, v2, v3"):
            await new.fork("p", at_step=1, prompts={"ask": "v9"})
        forked = await new.fork("p", at_step=1, new_run_id="p-v1", prompts={"ask": "v1"})
        # (the signal the run got is reused too: its first step was replayed with v2's
        # text as recorded, so its conversation is the one its history holds)
        assert await forked.result(timeout=30) == "re: Please say x | re: Say x"
    assert prompts_called(await new.history("p")) == ["ask@v2", "ask@v2"]
    assert prompts_called(await new.history("p-v1")) == ["ask@v2", "ask@v1"]
    assert prompts_called(await new.history(fresh.run_id)) == ["ask@v3", "ask@v3"]
    fork_pins = (await new.get("p-v1")).attrs["pins"]["tether.ai"]  # type: ignore[index]
    assert fork_pins["prompts"] == {"ask": "v1"}
    await new.close()

    # a deploy that dropped the run's version: the current one, and the change recorded
    last, _ = deploy({"v3": "Kindly say {text}"})
    async with last.worker(poll_interval=0.05):
        await last.signal("q", "go")
        assert await last.get_run("q").result(timeout=30) == "re: Please say x | re: Kindly say x"
    (change,) = markers(await last.history("q"), "prompt_repinned")
    assert (change["prompt"], change["from"], change["to"]) == ("ask", "v2", "v3")
    await last.close()


async def test_the_usage_ledger_counts_each_model_call_once_per_tenant_and_day(
    store_url: str, server: ModelServer
) -> None:
    server.default = lambda body: model_reply("ok", input_tokens=100, output_tokens=20)

    def deploy() -> tether.App:
        app = tether.App(store=store_url)
        _gw, primary = gateway(app, server)

        @app.workflow
        async def chat(n: int) -> int:
            await ai.complete(primary, f"one {n}")
            await tether.wait_event("go")  # a new worker replays the first call
            await ai.complete(primary, f"two {n}")
            return n

        return app

    app = deploy()
    runs = {"a": "acme", "b": "globex", "c": None}
    async with app.worker(poll_interval=0.05):
        for run_id, tenant in runs.items():
            await app.start("chat", 1, run_id=run_id, tenant=tenant)
        while len(await app.list(waiting_for="signal:go")) < 3:
            await asyncio.sleep(0.02)
    await app.close()
    app = deploy()
    async with app.worker(poll_interval=0.05):
        for run_id in runs:
            await app.signal(run_id, "go")
            await app.get_run(run_id).result(timeout=30)
    assert server.count("gpt-4o-mini") == 6
    day = time.strftime("%Y-%m-%d", time.gmtime())
    ledger = await app.store.usage_on(day)
    assert [(t, n) for t, n, _cost in ledger] == [("", 240), ("acme", 240), ("globex", 240)]
    for (tenant, _n, cost), run_id in zip(ledger, ("c", "a", "b"), strict=True):
        assert Decimal(cost) == (await app.usage(run_id)).cost, tenant  # exact, once each
    assert await app.store.usage_on(day, "acme") == [ledger[1]]
    await app.close()


class TicketV2(BaseModel):
    category: str
    priority: int
    confidence: float
    team: str = "support"  # a field added by a later deploy


async def test_a_run_is_pinned_to_its_output_schema_and_a_change_is_recorded(
    store_url: str,
) -> None:
    def deploy(output: Any, version: str) -> tether.App:
        app = tether.App(store=store_url)
        gw = ai.Gateway(app, retry=FAST)
        answer = {"category": "tech", "priority": 1, "confidence": 0.9}
        fast = gw.model("fast", ai.ScriptedModel([answer] * 4))
        gw.output(output, name="Ticket", version=version)

        @app.workflow
        async def two(text: str) -> str:
            first = await ai.structured(fast, text, output=output)
            await tether.wait_event("go")
            second = await ai.structured(fast, text, output=output)
            return f"{first.category}, {type(second).__name__}"

        return app

    old = deploy(Ticket, "1")
    async with old.worker(poll_interval=0.05):
        await old.start("two", "x", run_id="schema-pinned")
        while not await old.list(waiting_for="signal:go"):
            await asyncio.sleep(0.02)
    pins = (await old.get("schema-pinned")).attrs["pins"]["tether.ai"]  # type: ignore[index]
    assert pins["outputs"]["Ticket"]["version"] == "1"
    await old.close()
    new = deploy(TicketV2, "2")  # a deploy changes the output type under the run
    async with new.worker(poll_interval=0.05):
        await new.signal("schema-pinned", "go")
        assert await new.get_run("schema-pinned").result(timeout=30) == "tech, TicketV2"
        fresh = await new.start("two", "y")
        await new.signal(fresh.run_id, "go")
        assert await fresh.result(timeout=30) == "tech, TicketV2"
    history = await new.history("schema-pinned")
    (change,) = markers(history, "output_schema_repinned")
    assert (change["output"], change["from"], change["to"]) == ("Ticket", "1", "2")
    assert markers(await new.history(fresh.run_id), "output_schema_repinned") == []
    calls = [
        e.data["result"][CALL_KEY]["output_schema"]
        for e in history
        if e.type is EventType.ACTIVITY_COMPLETED
    ]
    assert calls == ["Ticket@1", "Ticket@2"]  # each call names the schema it used
    await new.close()


async def test_a_durable_agent_streams_its_text_and_tool_events_to_followers(
    app: tether.App, server: ModelServer
) -> None:
    from pydantic_ai import Agent

    gw = ai.Gateway(app, retry=FAST)
    model = gw.model("m", ai.openai_compatible("helper", base_url=server.base_url, api_key="k"))
    agent: Agent[None, str] = Agent(name="helper")

    @agent.tool_plain
    def weather(city: str) -> str:
        return f"sunny in {city}"

    helper = ai.durable(agent, gw, model=model, stream=True)

    @app.workflow
    async def ask(question: str) -> str:
        await tether.wait_event("go")
        result = await helper.run(question)
        return str(result.output)

    server.script(
        "helper",
        model_reply(tool=("weather", {"city": "Oslo"})),
        model_reply("It is sunny in Oslo today", chunk_delay=0.01),
    )
    got: list[dict[str, Any]] = []

    async def follow(run_id: str) -> None:
        async for item in gw.follow(run_id):
            got.append(item)

    async with app.worker(poll_interval=0.05):
        run = await app.start(ask, "weather in Oslo?", run_id="helper-1")
        follower = asyncio.create_task(follow(run.run_id))
        await asyncio.sleep(0.05)
        await app.signal(run.run_id, "go")
        assert await run.result(timeout=30) == "It is sunny in Oslo today"
        await asyncio.sleep(0.1)
        follower.cancel()
    events = [g for g in got if "event" in g]
    assert [(e["event"], e["tool"]) for e in events] == [
        ("tool_call", "weather"),
        ("tool_result", "weather"),
    ]
    assert events[0]["args"] == {"city": "Oslo"} and events[0]["agent"] == "helper"
    text = "".join(g.get("delta", "") for g in got)
    assert text == "It is sunny in Oslo today"
    assert len([g for g in got if "delta" in g]) > 1  # in pieces, as they came


@pytest.mark.parametrize("verdict", ["approve", "edit", "reject"])
async def test_a_tool_that_needs_approval_waits_durably_for_a_decision(
    app: tether.App, verdict: str
) -> None:
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    refunds: list[int] = []
    gw = ai.Gateway(app, retry=FAST)
    scripted = ai.ScriptedModel(
        [
            ModelResponse(parts=[ToolCallPart("refund", {"cents": 5000}, tool_call_id="c1")]),
            "done",
        ]
    )
    model = gw.model("m", scripted)
    agent: Agent[None, str | DeferredToolRequests] = Agent(
        name="support", output_type=[str, DeferredToolRequests]
    )

    @agent.tool_plain(requires_approval=True)
    def refund(cents: int) -> str:
        refunds.append(cents)
        return f"refunded {cents}"

    support = ai.durable(agent, gw, model=model)

    @app.workflow
    async def handle(ticket: str) -> str:
        result = await support.run(
            ticket, approve_tools=ai.ToolApproval(deadline=3600, approvers=["ann"], allow_edit=True)
        )
        return str(result.output)

    async with app.worker(poll_interval=0.05):
        run = await app.start(handle, "charged twice", run_id=f"ticket-{verdict}")

        async def opened() -> list[tether.Approval]:
            return await app.approvals(run_id=run.run_id)

        (review,) = await eventually(opened, 20, "the review of the refund")
        assert review.proposal == {"tool": "refund", "args": {"cents": 5000}}
        assert review.name == "support.refund" and refunds == []  # nothing ran yet
        if verdict == "reject":
            await app.decide(
                review.approval_id,
                approve=False,
                by="ann",
                fingerprint=review.fingerprint,
                reason="not eligible",
            )
        else:
            await app.decide(
                review.approval_id,
                approve=True,
                by="ann",
                fingerprint=review.fingerprint,
                value={"tool": "refund", "args": {"cents": 2500}} if verdict == "edit" else None,
            )
        assert await run.result(timeout=30) == "done"
    assert refunds == {"approve": [5000], "edit": [2500], "reject": []}[verdict]
    # the model saw the tool's result, or the denial with who and why
    last_prompt = json.dumps([m.parts for m in scripted.requests[-1]], default=str)
    if verdict == "reject":
        assert "denied by ann: not eligible" in last_prompt
    else:
        assert "refunded" in last_prompt


async def test_an_edit_of_a_deferred_tool_call_not_shaped_tool_and_args_is_refused(
    app: tether.App,
) -> None:
    """An edit must be ``{"tool": <the same tool>, "args": {...}}``: any other shape (args
    without the wrapper, args None, another key, another tool) is refused by
    ``App.decide`` at once (``ApprovalEditError``, saying what shape it takes), nothing
    is recorded and the review stays open, so nothing runs with arguments nobody
    approved; the proposal's fingerprint is the one of the plain dict (recorded runs
    replay)."""
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    from tether.workflow._approval import fingerprint_of

    refunds: list[int] = []
    gw = ai.Gateway(app, retry=FAST)
    scripted = ai.ScriptedModel(
        [
            ModelResponse(parts=[ToolCallPart("refund", {"cents": 5000}, tool_call_id="c1")]),
            "done",
        ]
    )
    agent: Agent[None, str | DeferredToolRequests] = Agent(
        name="support", output_type=[str, DeferredToolRequests]
    )

    @agent.tool_plain(requires_approval=True)
    def refund(cents: int) -> str:
        refunds.append(cents)
        return f"refunded {cents}"

    support = ai.durable(agent, gw, model=gw.model("m", scripted))

    @app.workflow
    async def handle(ticket: str) -> str:
        result = await support.run(
            ticket, approve_tools=ai.ToolApproval(deadline=3600, approvers=["ann"], allow_edit=True)
        )
        return str(result.output)

    bad: list[Any] = [
        {"cents": 1},
        {"tool": "refund", "args": None},
        {"tool": "refund", "arguments": {"cents": 1}},
        {"tool": "delete_account", "args": {"cents": 7}},
    ]
    async with app.worker(poll_interval=0.05):
        run = await app.start(handle, "charged twice")

        async def review_open() -> list[tether.Approval]:
            return await app.approvals(run_id=run.run_id)

        (review,) = await eventually(review_open, 20, "the review of the refund")
        assert review.fingerprint == fingerprint_of({"tool": "refund", "args": {"cents": 5000}})
        for value in bad:
            with pytest.raises(tether.ApprovalEditError) as refused:
                await app.decide(
                    review.approval_id,
                    approve=True,
                    by="ann",
                    fingerprint=review.fingerprint,
                    value=value,
                )
            assert 'it must be {"tool": "refund", "args": {...}}' in str(refused.value)
            assert "nothing was recorded" in str(refused.value)
            assert (await app.get_approval(review.approval_id)).status == "open"
        assert 'tool must be "refund", not "delete_account"' in str(refused.value)
        assert refunds == []
        await app.decide(
            review.approval_id,
            approve=True,
            by="ann",
            fingerprint=review.fingerprint,
            value={"tool": "refund", "args": {"cents": 2500}},
        )
        assert await run.result(timeout=30) == "done"
    assert refunds == [2500]
    hist = await app.history(run.run_id)
    assert not [e for e in hist if e.data.get("marker") == "approval_refused"]
    decided = [e.data["value"] for e in hist if e.data.get("marker") == "approval_decided"]
    assert [d["value"] for d in decided] == [{"tool": "refund", "args": {"cents": 2500}}]


async def test_an_older_runs_malformed_tool_edit_is_denied_live_and_replays_as_recorded(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that proposed its tool call as a plain dict (before the typed proposal) and
    gets a malformed edit now denies the call (it never runs the original arguments);
    a history recorded by the old code, which ran the call, still replays."""
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    from tether.ai import _agent
    from tether.testing import check_history
    from tether.workflow._instance import WorkflowInstance

    refunds: list[int] = []
    gw = ai.Gateway(app, retry=FAST)
    scripted = ai.ScriptedModel(
        [
            ModelResponse(parts=[ToolCallPart("refund", {"cents": 5000}, tool_call_id="c1")]),
            "done",
            ModelResponse(parts=[ToolCallPart("refund", {"cents": 5000}, tool_call_id="c1")]),
            "done",
        ]
    )
    agent: Agent[None, str | DeferredToolRequests] = Agent(
        name="support", output_type=[str, DeferredToolRequests]
    )

    @agent.tool_plain(requires_approval=True)
    def refund(cents: int) -> str:
        refunds.append(cents)
        return f"refunded {cents}"

    support = ai.durable(agent, gw, model=gw.model("m", scripted))

    @app.workflow
    async def handle(ticket: str) -> str:
        result = await support.run(
            ticket, approve_tools=ai.ToolApproval(deadline=3600, approvers=["ann"], allow_edit=True)
        )
        return str(result.output)

    real = WorkflowInstance.patched
    off = {_agent.TYPED_TOOL_EDIT}

    def older(self: WorkflowInstance, patch_id: str, *, deprecated: bool = False) -> bool:
        return False if patch_id in off else real(self, patch_id, deprecated=deprecated)

    monkeypatch.setattr(WorkflowInstance, "patched", older)

    async def run_one(run_id: str) -> tether.Run:
        run = await app.start(handle, "charged twice", run_id=run_id)

        async def review_open() -> list[tether.Approval]:
            return await app.approvals(run_id=run_id)

        (review,) = await eventually(review_open, 20, "the review of the refund")
        await app.decide(
            review.approval_id,
            approve=True,
            by="ann",
            fingerprint=review.fingerprint,
            value={"tool": "delete_account", "args": {"cents": 7}},
        )
        return run

    async with app.worker(poll_interval=0.05):
        off.add(_agent.EDIT_FAILS_CLOSED)  # the code before the fix: the call runs
        assert await (await run_one("old-code")).result(timeout=30) == "done"
        assert refunds == [5000]
        off.discard(_agent.EDIT_FAILS_CLOSED)  # an older run decided after the fix
        assert await (await run_one("old-run")).result(timeout=30) == "done"
        assert refunds == [5000]  # denied, not run
    last_prompt = json.dumps([m.parts for m in scripted.requests[-1]], default=str)
    assert "denied: the edit by ann is not a call of this tool" in last_prompt
    (denied,) = markers(await app.history("old-run"), "tool_call_denied")
    assert denied["tool"] == "refund" and "'delete_account'" in denied["reason"]
    assert not markers(await app.history("old-code"), "tool_call_denied")
    monkeypatch.setattr(WorkflowInstance, "patched", real)
    assert check_history(app, await app.history("old-code")).ok
    assert check_history(app, await app.history("old-run")).ok


async def test_deferred_tool_calls_of_one_answer_are_reviewed_together(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tool calls deferred in one model answer open two reviews at once, waited for
    together (one deadline, not two in turn), decided in any order; a run recorded
    before (one review after the other) still replays."""
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    from tether.ai import _agent
    from tether.testing import check_history
    from tether.workflow._instance import WorkflowInstance

    refunds: list[int] = []
    gw = ai.Gateway(app, retry=FAST)
    both = ModelResponse(
        parts=[
            ToolCallPart("refund", {"cents": 100}, tool_call_id="c1"),
            ToolCallPart("refund", {"cents": 200}, tool_call_id="c2"),
        ]
    )
    scripted = ai.ScriptedModel([both, "done", both, "done"])
    agent: Agent[None, str | DeferredToolRequests] = Agent(
        name="support", output_type=[str, DeferredToolRequests]
    )

    @agent.tool_plain(requires_approval=True)
    def refund(cents: int) -> str:
        refunds.append(cents)
        return f"refunded {cents}"

    support = ai.durable(agent, gw, model=gw.model("m", scripted))

    @app.workflow
    async def handle(ticket: str) -> str:
        result = await support.run(
            ticket, approve_tools=ai.ToolApproval(deadline=3600, approvers=["ann"])
        )
        return str(result.output)

    async def reviews(run_id: str, n: int) -> list[tether.Approval]:
        async def opened() -> list[tether.Approval]:
            found = await app.approvals(run_id=run_id)
            return found if len(found) >= n else []

        return await eventually(opened, 20, f"{n} open reviews of {run_id}")

    real = WorkflowInstance.patched
    off: set[str] = set()

    def older(self: WorkflowInstance, patch_id: str, *, deprecated: bool = False) -> bool:
        return False if patch_id in off else real(self, patch_id, deprecated=deprecated)

    monkeypatch.setattr(WorkflowInstance, "patched", older)
    async with app.worker(poll_interval=0.05):
        run = await app.start(handle, "charged thrice", run_id="together")
        first, second = await reviews("together", 2)  # both open at once
        assert [first.proposal["args"], second.proposal["args"]] == [
            {"cents": 100},
            {"cents": 200},
        ]
        assert first.deadline_at == second.deadline_at
        # the second is decided first: the first still waits, nothing runs yet
        await app.decide(
            second.approval_id, approve=False, by="ann", fingerprint=second.fingerprint
        )
        await asyncio.sleep(0.3)
        assert refunds == [] and (await app.get(run.run_id)).status is tether.RunStatus.RUNNING
        await app.decide(first.approval_id, approve=True, by="ann", fingerprint=first.fingerprint)
        assert await run.result(timeout=30) == "done"
        assert refunds == [100]

        off.add(_agent.TOOL_REVIEWS_TOGETHER)  # the code before: one review, then the next
        old = await app.start(handle, "charged thrice", run_id="in-turn")
        (one,) = await reviews("in-turn", 1)
        await app.decide(one.approval_id, approve=True, by="ann", fingerprint=one.fingerprint)
        (two,) = [r for r in await reviews("in-turn", 1) if r.approval_id != one.approval_id]
        await app.decide(two.approval_id, approve=True, by="ann", fingerprint=two.fingerprint)
        assert await old.result(timeout=30) == "done"
        # both approved, the two refunds run side by side: in either order
        assert refunds[0] == 100 and sorted(refunds[1:]) == [100, 200]
    monkeypatch.setattr(WorkflowInstance, "patched", real)
    assert check_history(app, await app.history("together")).ok
    assert check_history(app, await app.history("in-turn")).ok


async def test_model_calls_tokens_cost_repairs_routes_and_429s_are_counted(
    app: tether.App, server: ModelServer
) -> None:
    from tether._telemetry import RECORDER

    _gw, primary = gateway(app, server)

    @app.workflow
    async def triage(text: str) -> str:
        t = await ai.structured(
            primary, text, output=Ticket, validate=lambda t: [] if t.priority < 5 else ["p<5"]
        )
        return tether.route(t.category, {"billing"}, default="human")

    server.script(
        "gpt-4o-mini",
        model_error(429, "slow down", retry_after=0.1),
        ticket(priority=9),  # invalid: repaired
        ticket(priority=1),
    )
    RECORDER.reset()
    async with app.worker(poll_interval=0.05):
        assert await (await app.start(triage, "x", tenant="acme")).result(timeout=30) == "billing"
    labels = ("triage", "primary", "acme")
    assert RECORDER.counter("tether_ai_calls", (*labels, "model")) == 2
    assert RECORDER.counter("tether_ai_tokens", (*labels, "input")) == 240
    assert RECORDER.counter("tether_ai_tokens", (*labels, "output")) == 60
    assert RECORDER.counter("tether_ai_cost", labels) == pytest.approx(0.000072)
    assert RECORDER.counter("tether_decisions", ("triage", "output_invalid")) == 1
    assert RECORDER.counter("tether_decisions", ("triage", "route")) == 1
    assert RECORDER.counter("tether_routes", ("triage", "route", "billing", "allowed")) == 1
    assert RECORDER.counter("tether_rate_limited", (primary.activity.name,)) == 1


def test_an_output_types_tool_schema_is_built_once_and_any_type_expression_works() -> None:
    """A structured step's tool schema is made once per output type (it costs more than
    the rest of the step's bookkeeping); a type expression that cannot be a cache key
    (unhashable metadata) is still served, built each time."""
    from typing import Annotated

    from tether.ai._structured import _schema

    class Verdict(BaseModel):
        ok: bool

    first, wrapped = _schema(Verdict)
    assert not wrapped and first["properties"]["ok"]["type"] == "boolean"
    assert _schema(Verdict)[0] is first  # the same object: made once
    listed, wrapped = _schema(list[Verdict])
    assert wrapped and listed["properties"]["response"]["type"] == "array"
    odd = Annotated[str, {"unhashable": "metadata"}]
    assert _schema(odd) == (
        {
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
        },
        True,
    )


def test_a_structured_steps_validator_and_parameters_are_made_once_per_output_type() -> None:
    """What a structured step sends and reads with is made once per output type and
    tool description, and records the same parameters a step built anew would."""
    from typing import Annotated

    from pydantic_ai.models import ModelRequestParameters
    from pydantic_ai.tools import ToolDefinition

    from tether.ai._structured import _asking, _schema
    from tether.ai._wire import dump_params

    class Verdict(BaseModel):
        ok: bool

    first = _asking(Verdict, None)
    assert _asking(Verdict, None) is first
    assert _asking(Verdict, "Say whether it is ok.") is not first
    fresh = ModelRequestParameters(
        output_mode="tool",
        output_tools=[
            ToolDefinition(
                name="final_result",
                parameters_json_schema=_schema(Verdict)[0],
                description="Return the final answer.",
            )
        ],
        allow_text_output=False,
    )
    assert first.params_json == dump_params(fresh)
    assert first.adapter.validate_python({"ok": True}) == Verdict(ok=True)
    odd = Annotated[str, {"unhashable": "metadata"}]
    made = _asking(odd, None)  # not cached, still served
    assert made.wrapped and made.adapter.validate_python("x") == "x"


def test_a_messages_address_is_hashed_from_the_same_text_as_before() -> None:
    """Addresses recorded in histories are SHA-256 of ``json.dumps(sort_keys=True,
    separators=(",", ":"))`` text: the encoder made once writes exactly that text."""
    from tether.ai._wire import sorted_json

    values: list[Any] = [
        {"b": 1, "a": [1.5, -0.0, 1e300, 10**30, True, False, None], "é": "ünï\u2028\U0001f600"},
        {"z": {"y": {"x": []}}, "": {}, "nan": float("nan"), "inf": [float("inf"), float("-inf")]},
        'a top-level string, with "quotes" and \\ and \n',
        [],
        3,
        {"lone surrogate": "\ud800", "control": "\x00\x1f"},
    ]
    for value in values:
        assert sorted_json(value) == json.dumps(value, sort_keys=True, separators=(",", ":"))
    with pytest.raises(TypeError, match="not JSON serializable"):
        sorted_json({"a": object()})


def test_a_messages_address_ignores_only_the_timestamps_pydantic_ai_sets() -> None:
    """Two copies of a message (made at different times, by different agent runs) have
    one address; a field named ``timestamp`` inside content is the caller's data: it
    changes the address and is never dropped from what the model is sent."""
    from pydantic_ai.messages import ModelRequest, ToolReturnPart, UserPromptPart

    from tether.ai._wire import canonical, dump_messages, pack

    def request(when: str, content: Any) -> dict[str, Any]:
        (msg,) = dump_messages(
            [
                ModelRequest(
                    parts=[
                        UserPromptPart("what time is it?"),
                        ToolReturnPart("clock", content, tool_call_id="c1"),
                    ],
                    run_id=f"agent-run-{when}",
                )
            ]
        )
        return msg

    a, b = (
        request("a", {"timestamp": "10:00", "tz": "UTC"}),
        request("b", {"timestamp": "10:00", "tz": "UTC"}),
    )
    assert a != b  # made at other times, by other agent runs
    assert canonical(a)[0] == canonical(b)[0]  # the same content: one address
    later = request("c", {"timestamp": "11:00", "tz": "UTC"})
    assert canonical(later)[0] != canonical(a)[0]  # content that differs: two addresses
    packed, _inline, _tip = pack([later], set(), set())
    assert packed["new"][0]["m"]["parts"][1]["content"] == {"timestamp": "11:00", "tz": "UTC"}


async def test_a_tool_result_with_a_timestamp_reaches_the_model_whole_by_reference(
    app: tether.App, server: ModelServer
) -> None:
    """The content of a tool's return travels to the model as it is, on the step that
    sends it in full and on later steps that refer to it by its address."""
    from pydantic_ai.messages import ModelMessage, ModelRequest, ToolReturnPart, UserPromptPart

    gw, model = _counting_chat(app, server)

    @app.workflow
    async def chat() -> int:
        messages: list[ModelMessage] = []
        for i in range(3):
            parts: list[Any] = [UserPromptPart(f"q{i}")]
            if i == 0:
                parts.append(
                    ToolReturnPart("clock", {"timestamp": "2026-12-05T10:00Z"}, tool_call_id="c1")
                )
            messages.append(ModelRequest(parts=parts))
            response, _call = await gw.request(model, messages)
            messages.append(response)
        return len(messages)

    async with app.worker(poll_interval=0.05):
        run = await app.start(chat)
        assert await run.result(timeout=30) == 6
    bodies = [json.dumps(r.body["messages"]) for r in server.calls("chat")]
    assert len(bodies) == 3
    assert all("2026-12-05T10:00Z" in body for body in bodies), bodies


def test_a_worker_finds_an_answer_by_the_address_the_previous_version_gave_it() -> None:
    """A workflow process of the previous version (which left ``timestamp`` fields out at
    any depth) refers to an answer by that address; the worker indexes both."""
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    from tether.ai._gateway import _Rebuilt
    from tether.ai._wire import canonical, dump_response, legacy_digest, link

    answer = dump_response(
        ModelResponse(parts=[ToolCallPart("book", {"timestamp": "2027-01-01"}, tool_call_id="c9")])
    )
    scheduled = tether.Event(
        run_id="r",
        seq=2,
        type=EventType.ACTIVITY_SCHEDULED,
        step=1,
        data={"name": "g.call", "args": {"args": ["m", {"messages": {"base": None, "new": []}}]}},
        created_at=0.0,
    )
    completed = tether.Event(
        run_id="r",
        seq=3,
        type=EventType.ACTIVITY_COMPLETED,
        step=1,
        data={"result": {"response": answer}},
        created_at=0.0,
    )
    rebuilt = _Rebuilt()
    rebuilt.apply([scheduled, completed], "g.call")
    new, old = canonical(answer)[0], legacy_digest(answer)
    assert new != old  # the tool's argument named timestamp: the two versions differ
    for digest in (new, old):
        full = rebuilt.full({"base": link(None, digest), "new": []})
        assert full is not None and full[0]["parts"][0]["args"] == {"timestamp": "2027-01-01"}


def test_the_answer_cache_tells_apart_requests_that_differ_in_a_timestamp_of_content() -> None:
    """Two questions that differ only in a tool result's ``timestamp`` field are two
    questions (never one cached answer for both); the same question asked again, its
    messages made anew, is one."""
    from pydantic_ai.messages import ModelRequest, ToolReturnPart, UserPromptPart

    from tether.ai._gateway import _cache_key
    from tether.ai._wire import dump_messages

    gw = ai.Gateway(tether.App(store=":memory:"))
    ref = gw.model("m", ai.openai_compatible("chat", base_url="http://127.0.0.1:9", api_key="k"))

    def key(at: str) -> str:
        messages = dump_messages(
            [
                ModelRequest(
                    parts=[
                        UserPromptPart("is it late?"),
                        ToolReturnPart("clock", {"timestamp": at}, tool_call_id="c1"),
                    ]
                )
            ]
        )
        return _cache_key(ref, {"messages": messages, "params": {}, "settings": None})

    assert key("10:00") == key("10:00")  # made twice, at two times: the same question
    assert key("10:00") != key("23:00")


async def test_a_credential_in_a_calls_settings_is_refused_and_headers_on_the_model_are_sent(
    app: tether.App, server: ModelServer
) -> None:
    """A step's settings are recorded: a header that looks like a credential is refused
    there with where to put it; headers set on the model reach the provider, are never
    recorded, and an ordinary per-call header still goes through."""
    gw = ai.Gateway(app, retry=FAST)
    keyed = gw.model(
        "keyed",
        ai.openai_compatible(
            "gpt-4o-mini",
            base_url=server.base_url,
            api_key="k",
            headers={"X-Gateway-Key": "gk-on-the-model"},
        ),
    )
    server.default = lambda body: model_reply("ok")

    @app.workflow
    async def ask(header: str) -> str:
        try:
            return await ai.complete(
                keyed, "q", settings={"extra_headers": {header: "pk-per-call-secret"}}
            )
        except tether.ConfigurationError as exc:
            return f"refused: {exc}"

    async with app.worker(poll_interval=0.05):
        refused = await app.start(ask, "X-Portkey-Api-Key")
        allowed = await app.start(ask, "X-Request-Source")
        out = await refused.result(timeout=30)
        assert await allowed.result(timeout=30) == "ok"
    assert out.startswith("refused: model 'keyed': settings extra_headers 'X-Portkey-Api-Key'")
    assert "ai.openai_compatible(..., headers={...})" in out
    (call,) = server.calls("gpt-4o-mini")
    assert call.headers["x-gateway-key"] == "gk-on-the-model"
    assert call.headers["x-request-source"] == "pk-per-call-secret"
    for run in (refused, allowed):
        text = json.dumps([e.data for e in await app.history(run.run_id)])
        assert "gk-on-the-model" not in text
    assert "pk-per-call-secret" not in json.dumps(
        [e.data for e in await app.history(refused.run_id)]
    )


async def test_a_route_never_lets_an_odd_score_through_its_bar_and_never_raises() -> None:
    """A proposer's score that is not a number in 0..1 (NaN, text, a bool, a percentage)
    fails a confidence bar closed: the default, with the reason recorded, no error; the
    recorded decision stays JSON (NaN is not)."""
    app = tether.App(store=":memory:")

    @app.workflow
    async def pick(score: Any) -> str:
        return tether.route(
            "billing", ["billing", "tech"], default="human", confidence=score, min_confidence=0.8
        )

    async with app.worker(poll_interval=0.02):
        got = {}
        for score in (0.9, 0.5, None, float("nan"), "0.95", True, 95, float("inf"), 1):
            run = await app.start(pick, score)
            got[repr(score)] = await run.result(timeout=10)
            (decision,) = markers(await app.history(run.run_id), "route")
            json.dumps(decision, allow_nan=False)  # plain JSON: an API or console reads it
            if got[repr(score)] == "human" and score not in (None, 0.5):
                assert decision["reason"] == "confidence not a score", decision
    assert got == {
        "0.9": "billing",
        "0.5": "human",
        "None": "human",
        "nan": "human",
        "'0.95'": "human",
        "True": "human",
        "95": "human",
        "inf": "human",
        "1": "billing",
    }


class Kind(Enum):  # a plain Enum: its members never equal the text a model answers
    INVOICE = "invoice"
    MEMO = "memo"


async def test_a_route_answers_with_the_allow_lists_member_and_a_replay_keeps_it() -> None:
    """The chosen branch is the allow-list's own member (an enum member for its value,
    ``1`` for ``1.0``), a bool is never taken for a number, and a replayed run follows
    the decision it recorded even after a deploy raised the bar it passed."""
    assert tether.route("invoice", [Kind.INVOICE, Kind.MEMO], default=None) is Kind.INVOICE
    assert tether.route("INVOICE", [Kind.INVOICE], default=None) is None
    assert tether.route(True, [1, 2], default=0) == 0  # a model's true is not branch 1
    assert tether.route(1, [True, False], default=None) is None
    one = tether.route(1.0, [1, 2], default=0)
    assert one == 1 and type(one) is int
    app = tether.App(store=":memory:")
    deploy: dict[str, Any] = {"bar": None}

    @app.workflow
    async def pick(label: str, score: float) -> str:
        chosen = tether.route(
            label,
            ["billing", "tech"],
            default="human",
            confidence=score,
            min_confidence=deploy["bar"],
        )
        await tether.wait_event("go", timeout=60)
        return chosen

    async with app.worker(poll_interval=0.02):
        run = await app.start(pick, "tech", 0.5)
        for _ in range(500):  # until it waits for "go", its route recorded
            info = await app.get(run.run_id)
            if info.waiting_on:
                break
            await asyncio.sleep(0.02)
        assert info.waiting_on, info
    deploy["bar"] = 0.9  # a new deploy: 0.5 no longer passes, but this run passed then
    async with app.worker(poll_interval=0.02):  # a new worker: the run is replayed
        await app.signal(run.run_id, "go", None)
        assert await run.result(timeout=10) == "tech"
        fresh = await app.start(pick, "tech", 0.5)
        await app.signal(fresh.run_id, "go", None)
        assert await fresh.result(timeout=10) == "human"  # new runs meet the new bar
    decisions = markers(await app.history(run.run_id), "route")
    assert [d["chosen"] for d in decisions] == ["tech"]


def test_a_route_recorded_by_an_older_version_replays_down_the_branch_it_took() -> None:
    """A version that took a bool for a number recorded ``chosen: true`` for the list
    ``[1, 2]``; today's code never makes that choice, but a replay follows the record
    (branch ``1``, which ``True`` equalled) instead of moving the run to the default."""
    from types import SimpleNamespace

    from tether.workflow._route import _replayed

    def history_holds(chosen: Any, name: str = "route") -> Any:
        event = SimpleNamespace(data={"marker": "route", "value": {"name": name, "chosen": chosen}})
        return SimpleNamespace(recorded_next=lambda: event)

    assert _replayed(history_holds(True), "route", [1, 2, 0])[0] == 1  # type: ignore[index]
    assert _replayed(history_holds(True), "route", [True, 1])[0] is True  # type: ignore[index]
    assert _replayed(history_holds("tech"), "other", ["tech"]) is None  # another router
    assert _replayed(history_holds("gone"), "route", ["tech", "human"]) is None  # decide again


async def test_a_cost_budget_refuses_a_model_without_a_price_before_calling_it(
    app: tether.App, server: ModelServer
) -> None:
    """A model genai-prices does not know (a local one) could spend anything: under a
    run's or a tenant's daily cost budget it is refused before the call, saying how to
    price it; priced at zero it goes through; a tokens-only budget never needed a price."""
    gw = ai.Gateway(app, retry=FAST)
    url = server.base_url
    local = gw.model("local", ai.openai_compatible("llama-local-7b", base_url=url, api_key="k"))
    free = gw.model(
        "free",
        ai.openai_compatible("llama-local-7b", base_url=url, api_key="k"),
        price=ai.Price(input_per_mtok=0, output_per_mtok=0),
    )
    server.default = lambda body: model_reply("ok")

    @app.workflow
    async def ask(which: str) -> str:
        try:
            return await ai.complete(local if which == "local" else free, "q")
        except ai.BudgetExceeded as exc:
            return f"refused ({exc.scope}): {exc}"

    async with app.worker(poll_interval=0.05):
        by_run = await app.start(ask, "local", budget=tether.Budget(cost="0.50"))
        priced = await app.start(ask, "free", budget=tether.Budget(cost="0.50"))
        tokens_only = await app.start(ask, "local", budget=tether.Budget(tokens=10_000))
        out = await by_run.result(timeout=30)
        assert await priced.result(timeout=30) == "ok"
        assert await tokens_only.result(timeout=30) == "ok"
        await gw.set_budget(tenant="acme", cost="1.00")
        daily = await app.start(ask, "local", tenant="acme")
        out_daily = await daily.result(timeout=30)
    assert out.startswith("refused (run): model 'local' has no price"), out
    assert "Price(input_per_mtok=0, output_per_mtok=0)" in out
    assert out_daily.startswith("refused (tenant:acme): model 'local' has no price"), out_daily
    assert server.count("llama-local-7b") == 2  # the priced call and the tokens-only one


@pytest.mark.parametrize("bad", ["abc", -1, float("nan"), "inf", True])
def test_a_price_that_is_not_a_number_of_zero_or_more_is_refused_where_it_is_written(
    bad: Any,
) -> None:
    """A bad price is a clear error when the price is made, not a failure of every call
    of the model in a worker later (nor, negative, spend undone)."""
    with pytest.raises(tether.ConfigurationError, match="input_per_mtok must be a number >= 0"):
        ai.Price(input_per_mtok=bad, output_per_mtok=1)
    assert ai.Price(input_per_mtok=0, output_per_mtok="0.6").cost(1_000_000, 0) == 0


async def test_a_hedges_loser_counts_against_the_run_budget_by_its_estimate(
    app: tether.App, server: ModelServer
) -> None:
    """The provider may bill a hedge's cancelled loser yet; until its step's outcome
    is recorded what it used is unknown to the run, so its estimate counts as spent. A
    run that hedges cannot go over its budget by the calls it abandoned. Once the
    loser's step ended without an answer (cancelled), it counts nothing."""
    gw = ai.Gateway(app, retry=FAST, timeout=10)
    url = server.base_url
    fast = gw.model("fast", ai.openai_compatible("gpt-4o", base_url=url, api_key="k"))
    slow = gw.model(
        "slow", ai.openai_compatible("gpt-4o-mini", base_url=url, api_key="k"), hedge=(fast, 0.3)
    )
    settings: Any = {"max_tokens": 100}

    @app.workflow
    async def probe() -> str:
        try:
            return await ai.complete(fast, "same prompt", settings=settings)
        except ai.BudgetExceeded:
            return "refused"

    @app.workflow
    async def ask(wait: bool) -> str:
        first = await ai.complete(slow, "same prompt", settings=settings)
        if wait:
            await tether.sleep(1.5)  # the loser's own step has ended (cancelled) by now
        try:
            return first + " / " + await ai.complete(fast, "same prompt", settings=settings)
        except ai.BudgetExceeded:
            return first + " / refused"

    server.script(
        "gpt-4o-mini", *[model_reply("slow", delay=1, input_tokens=10, output_tokens=5)] * 2
    )
    server.default = lambda body: model_reply("fast", input_tokens=10, output_tokens=5)
    async with app.worker(poll_interval=0.05):
        sized = await app.start(probe, budget=tether.Budget(tokens=1))
        assert await sized.result(timeout=30) == "refused"  # its marker says the estimate
        (marker,) = markers(await app.history(sized.run_id), "budget_exceeded")
        estimate = marker["estimate"]["tokens"]
        # the winner used 15; the loser's estimate counts too while its step runs, so
        # the next call at once is over; after the loser's step ended without an
        # answer it counts nothing, and the next call passes
        runs = [
            await app.start(ask, wait, budget=tether.Budget(tokens=15 + 2 * estimate - 1))
            for wait in (False, True)
        ]
        outs = [await run.result(timeout=30) for run in runs]
    assert outs == ["fast / refused", "fast / fast"], outs
    (refused,) = markers(await app.history(runs[0].run_id), "budget_exceeded")
    assert refused["spent"]["tokens"] == 15 + estimate  # counted once, never twice
    assert not markers(await app.history(runs[1].run_id), "budget_exceeded")


# pydantic-ai warns of a negative count it cannot price and reports no usage instead
@pytest.mark.filterwarnings("ignore::pydantic_ai.UsageExtractionFailedWarning")
async def test_usage_a_provider_reports_falsely_or_not_at_all_counts_at_the_estimate(
    app: tether.App, server: ModelServer
) -> None:
    """A provider's usage is the only measure of spend after the call. A negative count
    (a broken proxy) would undo spend, and no usage at all (a server that leaves it out)
    would make every call free: either way a budget would never stop the run. Such a
    call counts at its estimate, and its record says so and keeps what was reported."""
    _gw, primary = gateway(app, server)
    settings: Any = {"max_tokens": 100}

    @app.workflow
    async def chain(n: int) -> list[str]:
        out = []
        for i in range(n):
            try:
                out.append(await ai.complete(primary, f"step {i}", settings=settings))
            except ai.BudgetExceeded as exc:
                out.append(f"stopped: {exc.what}")
                break
        return out

    no_usage = json.dumps(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "gpt-4o-mini",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
        }
    )
    for answer in (
        model_reply("ok", input_tokens=-100_000, output_tokens=30),
        model_garbage(no_usage),
    ):
        before = server.count()
        server.default = lambda body, answer=answer: answer
        async with app.worker(poll_interval=0.05):
            # estimated at ~40 prompt tokens + max_tokens 100 each: two fit in 300
            run = await app.start(chain, 5, budget=tether.Budget(tokens=300))
            assert await run.result(timeout=30) == ["ok", "ok", "stopped: tokens"]
        assert server.count() - before == 2
        calls = [
            e.data["result"][CALL_KEY]
            for e in await app.history(run.run_id)
            if e.type is EventType.ACTIVITY_COMPLETED
        ]
        for call in calls:
            assert call["usage"] == "estimated", call
            assert call["output_tokens"] == 100 and call["input_tokens"] > 0
            assert call["reported_usage"]["input_tokens"] in (-100_000, 0)
            assert Decimal(call["cost"]) > 0  # priced from the estimate
        usage = await app.usage(run.run_id)
        assert usage.tokens == sum(c["input_tokens"] + c["output_tokens"] for c in calls)


@pytest.mark.parametrize("bad", [0, -100, 1.5, "1024", True])
def test_an_output_estimate_that_is_not_a_positive_token_count_is_refused(
    app: tether.App, bad: Any
) -> None:
    """A budget estimates a call without ``max_tokens`` by the model's output_estimate:
    zero or less would let any call through, text would fail every budgeted call."""
    gw = ai.Gateway(app)
    with pytest.raises(tether.ConfigurationError, match="output_estimate of model 'm' must be"):
        gw.model("m", "openai:gpt-4o-mini", output_estimate=bad)


@pytest.mark.parametrize("bad", ["", "m\x00", "x" * 201, "two\nlines", 5])
def test_a_gateway_or_model_name_that_cannot_be_stored_or_shown_is_refused(
    app: tether.App, bad: Any
) -> None:
    """Names go into call records, metrics labels and the CLI's tables; NUL fails on
    PostgreSQL. A model or gateway name must be 1-200 printable characters."""
    with pytest.raises(tether.ConfigurationError, match="model name"):
        ai.Gateway(app).model(bad, "openai:gpt-4o-mini")
    with pytest.raises(tether.ConfigurationError, match="gateway name"):
        ai.Gateway(app, name=bad)


async def test_a_hedges_non_streamed_loser_is_cancelled_at_once(
    app: tether.App, server: ModelServer
) -> None:
    """The loser of a hedged (not streamed) call, cancelled when the other answered,
    ran on until the worker's next lease renewal (a third of the lease) before its
    HTTP request was aborted. It is now aborted as soon as the hedge is decided, and
    its step ends cancelled."""
    gw = ai.Gateway(app, retry=FAST, timeout=20)
    url = server.base_url
    fast = gw.model("fast", ai.openai_compatible("gpt-4o", base_url=url, api_key="k"))
    slow = gw.model(
        "slow", ai.openai_compatible("gpt-4o-mini", base_url=url, api_key="k"), hedge=(fast, 0.3)
    )

    @app.workflow
    async def ask(text: str) -> str:
        answer = await ai.complete(slow, text)
        await tether.sleep(1.5)  # the run goes on: the loser's end is recorded
        return answer

    server.script("gpt-4o-mini", model_reply("slow answer", delay=8))
    server.script("gpt-4o", model_reply("fast answer"))
    async with app.worker(poll_interval=0.05, lease=30):
        run = await app.start(ask, "x")
        await eventually(lambda: has_event(app, run.run_id, EventType.ACTIVITY_CANCEL_REQUESTED))
        answered = time.monotonic()

        async def aborted() -> bool:
            return bool(server.aborted)

        await eventually(aborted, timeout=5)
        ((request, at),) = server.aborted
        assert request.model == "gpt-4o-mini"
        assert at - answered < 1.0, at - answered  # not the lease's renewal (10 s)
        history = await app.history(run.run_id)
        (loser,) = [
            e.step
            for e in history
            if e.type is EventType.ACTIVITY_SCHEDULED and e.data["args"]["args"][0] == "slow"
        ]

        async def ended() -> bool:
            events = await app.history(run.run_id)
            return any(e.step == loser and e.type is EventType.ACTIVITY_FAILED for e in events)

        await eventually(ended, timeout=5)
        assert await run.result(timeout=30) == "fast answer"
    (failed,) = [
        e
        for e in await app.history(run.run_id)
        if e.step == loser and e.type is EventType.ACTIVITY_FAILED
    ]
    assert failed.data["error"]["type"] == "CancelledError", failed.data


async def test_a_hedges_loser_in_another_worker_process_stops_within_a_heartbeat(
    store_url: str, server: ModelServer
) -> None:
    """Where the loser runs in another process than the run's workflow task (here two
    Apps on one store: one runs the workflow, the other the model calls on their own
    queue), it learns of the cancel by asking (a heartbeat every 0.5 s while it
    waits), not at its worker's lease renewal."""
    url = server.base_url

    def build() -> tuple[tether.App, Any]:
        app = tether.App(store=store_url)
        gw = ai.Gateway(app, retry=FAST, timeout=20, queue="models")
        fast = gw.model("fast", ai.openai_compatible("gpt-4o", base_url=url, api_key="k"))
        slow = gw.model(
            "slow",
            ai.openai_compatible("gpt-4o-mini", base_url=url, api_key="k"),
            hedge=(fast, 0.3),
        )

        @app.workflow(name="ask")
        async def ask(text: str) -> str:
            answer = await ai.complete(slow, text)
            await tether.sleep(1.5)
            return answer

        return app, ask

    (runs, ask), (calls, _) = build(), build()
    server.script("gpt-4o-mini", model_reply("slow answer", delay=8))
    server.script("gpt-4o", model_reply("fast answer"))
    try:
        async with (
            runs.worker(poll_interval=0.05, lease=30, queues=["default"]),
            calls.worker(poll_interval=0.05, lease=30, queues=["models"]),
        ):
            run = await runs.start(ask, "x")
            await eventually(
                lambda: has_event(runs, run.run_id, EventType.ACTIVITY_CANCEL_REQUESTED)
            )
            decided = time.monotonic()

            async def aborted() -> bool:
                return bool(server.aborted)

            await eventually(aborted, timeout=5)
            ((request, at),) = server.aborted
            assert request.model == "gpt-4o-mini"
            assert at - decided < 1.5, at - decided  # a heartbeat's interval, not 10 s
            assert await run.result(timeout=30) == "fast answer"
        failed = [e for e in await runs.history(run.run_id) if e.type is EventType.ACTIVITY_FAILED]
        assert [f.data["error"]["type"] for f in failed] == ["StepCancelled"], failed
    finally:
        for a in (runs, calls):
            if a._store is not None:
                await a._store.close()


@pytest.mark.parametrize("loser", ["answered", "cancelled"])
async def test_a_hedges_loser_counts_once_everywhere_as_what_it_used(
    store_url: str, server: ModelServer, loser: str
) -> None:
    """A hedge's loser whose answer still came (billed) was counted three ways:
    ``app.usage`` and the daily budgets at its real usage, the run's budget at its
    estimate, the day's ledger (``usage_on``) not at all. Now an answered loser counts
    once, at what the provider reported, in all four (and ``app.usage`` says it was
    abandoned); a loser cancelled before an answer counts nothing in any of them."""
    url = server.base_url

    def build() -> tuple[tether.App, ai.Gateway, Any]:
        app = tether.App(store=store_url)
        # the calls run in another App (as in another process): the loser is told of
        # its cancel by its heartbeat, so an answer that comes first is recorded
        gw = ai.Gateway(app, retry=FAST, timeout=20, queue="models")
        fast = gw.model("fast", ai.openai_compatible("gpt-4o", base_url=url, api_key="k"))
        slow = gw.model(
            "slow",
            ai.openai_compatible("gpt-4o-mini", base_url=url, api_key="k"),
            hedge=(fast, 0.3),
        )

        @app.workflow(name="ask")
        async def ask(text: str) -> str:
            answer = await ai.complete(slow, text)
            await tether.sleep(2.5)  # the loser's end comes while the run goes on
            return answer

        return app, gw, ask

    (runs, gw, ask), (calls, _, _) = build(), build()
    await gw.set_budget(tenant="acme", tokens=100_000)
    delay = 0.9 if loser == "answered" else 8.0
    server.script(
        "gpt-4o-mini", model_reply("slow", delay=delay, input_tokens=100, output_tokens=50)
    )
    server.script("gpt-4o", model_reply("fast", input_tokens=10, output_tokens=5))
    try:
        async with (
            runs.worker(poll_interval=0.05, lease=30, queues=["default"]),
            calls.worker(poll_interval=0.05, lease=30, queues=["models"]),
        ):
            run = await runs.start(ask, "x", tenant="acme", budget=tether.Budget(tokens=10_000))
            assert await run.result(timeout=30) == "fast"
        history = await runs.history(run.run_id)
        (cancelled,) = [e for e in history if e.type is EventType.ACTIVITY_CANCEL_REQUESTED]
        ended = [
            e
            for e in history
            if e.step == cancelled.data["activity_step"]
            and e.type in (EventType.ACTIVITY_COMPLETED, EventType.ACTIVITY_FAILED)
        ]
        answered = loser == "answered"
        assert [e.type for e in ended] == [
            EventType.ACTIVITY_COMPLETED if answered else EventType.ACTIVITY_FAILED
        ]
        tokens = 15 + (150 if answered else 0)
        usage = await runs.usage(run.run_id)
        assert (usage.calls, usage.tokens, usage.abandoned_calls) == (
            2 if answered else 1,
            tokens,
            1 if answered else 0,
        )
        assert (await runs.usage(tenant="acme")).tokens == tokens
        (daily,) = await gw.budgets()
        assert daily["spent_tokens"] == tokens
        day = time.strftime("%Y-%m-%d", time.gmtime())
        assert [n for _t, n, _c in await runs.store.usage_on(day, "acme")] == [tokens]
        (done,) = [e for e in history if e.type is EventType.WORKFLOW_COMPLETED]
        assert done.data["model_spend"]["tokens"] == tokens  # the run's budget's count
        assert Decimal(done.data["model_spend"]["cost"]) == usage.cost
    finally:
        for a in (runs, calls):
            if a._store is not None:
                await a._store.close()


class TicketRenamed(BaseModel):
    category: str
    urgency: int = 0  # was ``priority``: a rename, with a default
    confidence: float


@pytest.mark.parametrize("registered", [True, False])
async def test_a_recorded_answer_the_new_output_type_reads_lossily_stops_the_replay(
    store_url: str, registered: bool
) -> None:
    """A deploy that renamed a field of a structured step's output type (with a
    default) replayed the recorded answer silently: the old field's value was dropped
    and the new one took its default. A recorded step whose schema differs from the
    type's now is replayed only when the new type reads every field of the answer
    (adding fields with defaults keeps runs replaying); otherwise the replay stops with
    a NonDeterminismError naming the step, both schemas and the fields dropped."""

    def deploy(output: Any, version: str) -> tether.App:
        app = tether.App(store=store_url)
        gw = ai.Gateway(app, retry=FAST)
        answer = {"category": "tech", "priority": 1, "confidence": 0.9}
        fast = gw.model("fast", ai.ScriptedModel([answer] * 2))
        if registered:
            gw.output(output, name="Ticket", version=version)

        @app.workflow
        async def one(text: str) -> str:
            first = await ai.structured(fast, text, output=output)
            await tether.wait_event("go")
            return first.category

        return app

    old = deploy(Ticket, "1")
    run_id = f"renamed-{registered}"
    async with old.worker(poll_interval=0.05):
        await old.start("one", "x", run_id=run_id)
        while not await old.list(waiting_for="signal:go"):
            await asyncio.sleep(0.02)
    history = await old.history(run_id)
    await old.close()
    (call,) = [
        e.data["result"][CALL_KEY] for e in history if e.type is EventType.ACTIVITY_COMPLETED
    ]
    was = call["output_schema"]
    from tether.ai._gateway import schema_fingerprint

    renamed = deploy(TicketRenamed, "2")
    report = tether.testing.check_history(renamed, history)
    now = "Ticket@2" if registered else f"TicketRenamed@{schema_fingerprint(TicketRenamed)}"
    assert not report.ok
    error = report.error or ""
    assert was in error and now in error and "'priority'" in error, error
    await renamed.close()
    added = deploy(TicketV2, "2")  # a field added with a default reads every field
    assert tether.testing.check_history(added, history).ok
    await added.close()


class TicketHidden(BaseModel):
    category: str
    priority: int = Field(exclude=True)  # read, kept out of dumps
    confidence: float = Field(serialization_alias="certainty")  # read, dumped as another name


class TicketHiddenV2(TicketHidden):
    team: str = "support"  # a field added with a default


class TicketMigrated(BaseModel):
    category: str
    urgency: int = 0  # was ``priority``: moved by the validator below
    confidence: float

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "priority" in data:
            data = {k: v for k, v in data.items() if k != "priority"} | {
                "urgency": data["priority"]
            }
        return data


async def test_fields_the_new_output_type_reads_but_dumps_otherwise_replay(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The replay check took a field missing from the new type's dump for a field the
    type dropped: a field with ``exclude=True`` or a ``serialization_alias`` (read, but
    dumped otherwise or not at all) stopped the replay of a safe deploy (a field added
    with a default) with a NonDeterminismError. What the type reads is what its
    validation depends on: those replay, with a warning only; so does an answer a
    ``model_validator`` migrates (an old name moved to a new one)."""

    def deploy(output: Any) -> tether.App:
        app = tether.App(store=store_url)
        gw = ai.Gateway(app, retry=FAST)
        answer = {"category": "tech", "priority": 1, "confidence": 0.9}
        fast = gw.model("fast", ai.ScriptedModel([answer] * 2))

        @app.workflow
        async def one(text: str) -> str:
            first = await ai.structured(fast, text, output=output)
            await tether.wait_event("go")
            return first.category

        return app

    old = deploy(TicketHidden)
    async with old.worker(poll_interval=0.05):
        await old.start("one", "x", run_id="hidden")
        while not await old.list(waiting_for="signal:go"):
            await asyncio.sleep(0.02)
    hidden = await old.history("hidden")
    await old.close()
    added = deploy(TicketHiddenV2)
    with caplog.at_level(logging.WARNING, logger="tether.ai"):
        report = tether.testing.check_history(added, hidden)
    assert report.ok, report.error
    assert "is read with" in caplog.text
    await added.close()

    old = deploy(Ticket)
    async with old.worker(poll_interval=0.05):
        await old.start("one", "x", run_id="plain")
        while len(await old.list(waiting_for="signal:go")) < 2:  # and "hidden"
            await asyncio.sleep(0.02)
    plain = await old.history("plain")
    await old.close()
    renamed = deploy(TicketRenamed)  # still a divergence: ``priority`` is ignored
    report = tether.testing.check_history(renamed, plain)
    assert not report.ok and "'priority'" in (report.error or "")
    await renamed.close()
    migrated = deploy(TicketMigrated)
    assert tether.testing.check_history(migrated, plain).ok
    await migrated.close()


async def test_a_model_call_inside_an_activity_past_its_timeout_names_that_activity(
    app: tether.App, server: ModelServer
) -> None:
    """An activity of the user's that calls the gateway inside, and whose own timeout ran
    out while the model answered, recorded ``... (its timeout per attempt) ... raise the
    model's timeout``: the model's timeout (30 s here) does not apply inside another
    activity, so that advice changed nothing. It now names the activity, its step, the
    model, the seconds and how to give it more time, still a retried timeout."""
    gw = ai.Gateway(app, retry=tether.Retry(attempts=1))
    slow = gw.model(
        "slow",
        ai.openai_compatible("gpt-4o-mini", base_url=server.base_url, api_key="k"),
        timeout=30,
    )

    @app.activity(timeout=0.5, retry=tether.Retry(attempts=2, initial=0.05, backoff=1.0))
    async def summarise(text: str) -> str:
        return await ai.complete(slow, text)

    @app.workflow
    async def digest() -> str:
        return await summarise("a long text")

    server.script("gpt-4o-mini", *[model_reply("late", delay=3)] * 2)
    async with app.worker(poll_interval=0.05):
        run = await app.start(digest, run_id="inside")
        with pytest.raises(tether.WorkflowFailedError):
            await run.result(timeout=30)
    recorded = [
        e.data["error"]
        for e in await app.history("inside")
        if e.type in (EventType.ACTIVITY_ATTEMPT_FAILED, EventType.ACTIVITY_FAILED)
    ]
    assert [r["type"] for r in recorded] == ["TimeoutError", "TimeoutError"]
    assert [r["retryable"] for r in recorded] == [True, False]  # a timeout to Retry
    for attempt, r in enumerate(recorded, 1):
        message = r["message"]
        assert message.startswith(
            f"model 'slow' (gpt-4o-mini), called in activity 'summarise', step 1, "
            f"attempt {attempt}: timed out after 0.5 s (the timeout per attempt of "
            "activity 'summarise') while it waited for the answer"
        ), message
        assert "raise the timeout of activity 'summarise'" in message, message
        assert "gateway.model(..., timeout=)" not in message and "cancel" not in message


class _Dose(BaseModel):
    drug: str


class _Chart(BaseModel):
    doses: list[_Dose]
    by_patient: dict[str, _Dose]
    note: Any = None

    @model_validator(mode="after")
    def _no_notes(self) -> _Chart:
        self.note = None  # a field the type has, and ignores
        return self


class _Patient(BaseModel):
    name: str
    drug: str


class _ByName(BaseModel):
    """The model answers ``{"<patient's name>": {...}}``; a validator makes the list."""

    patients: list[_Patient]

    @model_validator(mode="before")
    @classmethod
    def _by_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "patients" not in data:
            return {"patients": [{"name": k, **v} for k, v in data.items()]}
        return data


def test_the_fields_dropped_name_the_types_fields_never_the_answers_keys() -> None:
    """The replay check named a dropped field by its path into the recorded answer, a
    dict's keys included (the model's output: a person's name here), and the message was
    trusted as the engine's. A dict's keys and a list's indices are now ``[key]`` and
    ``[i]``; the type's field names stay; a name the type does not have (an older type's
    field, or one the model volunteered) makes the message not the engine's."""
    from pydantic import TypeAdapter

    from tether.ai._structured import _dropped

    adapter = TypeAdapter(_Chart)
    secret = "Alice Smith, SSN 078-05-1120"
    answer = {
        "doses": [{"drug": "a", "mg": 5}, {"drug": "b", "mg": 10}],
        "by_patient": {secret: {"drug": "c", "mg": 1}},
        "note": "x",
    }
    dropped, names_only = _dropped(adapter, answer, adapter.validate_python(answer))
    assert dropped == {"doses[i].mg", "by_patient.[key].mg", "note"}
    assert not names_only  # ``mg`` is no field of this type
    answer = {"doses": [{"drug": "a"}], "by_patient": {secret: {"drug": "c"}}, "note": "x"}
    assert _dropped(adapter, answer, adapter.validate_python(answer)) == ({"note"}, True)
    volunteered = {**answer, secret: 1}  # a key the model made up where fields are
    dropped, names_only = _dropped(adapter, volunteered, adapter.validate_python(volunteered))
    assert dropped == {"note", secret} and not names_only
    # a key the type has no field for but reads (a validator makes a list of the keys):
    # the names below it are not the type's either, though no field of it is there to
    # say so: the message is not the engine's (it named the patient, as its own)
    by_name = TypeAdapter(_ByName)
    answer = {secret: {"drug": "a", "mg": 5}}
    dropped, names_only = _dropped(by_name, answer, by_name.validate_python(answer))
    assert dropped == {f"{secret}.mg"} and not names_only
    answer = {secret: {"drug": "a"}}
    assert _dropped(by_name, answer, by_name.validate_python(answer)) == (set(), True)


@pytest.mark.parametrize("missing", ["pydantic_ai", "genai_prices"])
def test_tether_ai_without_the_ai_extra_says_which_extra_to_install(missing: str) -> None:
    """`from tether import ai` without the ai extra ended in a bare
    ModuleNotFoundError traceback from deep inside tether.ai. It is now an ImportError
    naming the extra to install, chained from the original (which names the package)."""
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "try:\n"
        "    from tether import ai\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, '|', exc, '|', type(exc.__cause__).__name__)\n"
    )
    src = str(Path(tether.__file__).parent.parent)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": src},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    kind, message, cause = (part.strip() for part in done.stdout.split("|"))
    assert kind == "ImportError" and cause == "ModuleNotFoundError", done.stdout
    assert message.startswith("tether.ai needs the ai extra: pip install 'tether[ai]'"), message
    assert missing in message, message
