"""What the cheaper per-step work of a model step must keep: the same recorded step,
the same answer, the same references and the same rate-limit feedback."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

import tether
from tether import EventType, ai
from tether._serde import JsonDict
from tether._usage import CALL_KEY
from tether.ai._wire import dump_params
from tether.testing import ModelServer, check_history, model_reply

pytestmark = pytest.mark.timeout(120)

FAST = tether.Retry(attempts=3, initial=0.05, backoff=1.0)


@pytest.fixture
def server() -> Any:
    with ModelServer() as s:
        yield s


def test_a_step_without_parameters_records_what_the_default_parameters_dump_to() -> None:
    from pydantic_ai.models import ModelRequestParameters

    # (made without building the defaults: this pins that they still dump to nothing)
    assert dump_params(None) == dump_params(ModelRequestParameters()) == {}
    # and the worker makes the defaults of {} without validating: what validation makes
    from tether.ai._wire import _PARAMS, load_params

    assert load_params({}) == _PARAMS.validate_python({}) == ModelRequestParameters()


async def test_complete_returns_the_text_of_the_answer_and_replays_it(
    app: tether.App, server: ModelServer
) -> None:
    gw = ai.Gateway(app, retry=FAST)
    model = gw.model("m", ai.openai_compatible("m", base_url=server.base_url, api_key="k"))
    replies = iter(["first answer", "", "third, with ünïcode"])
    server.default = lambda body: model_reply(next(replies))

    @app.workflow
    async def three() -> list[str]:
        return [await ai.complete(model, f"q{i}") for i in range(3)]

    async with app.worker(poll_interval=0.05):
        run = await app.start(three)
        assert await run.result(timeout=30) == ["first answer", "", "third, with ünïcode"]
    report = check_history(app, await app.history(run.run_id))
    assert report.ok, report


def _scheduled_messages(history: list[tether.Event]) -> list[dict[str, Any]]:
    return [
        e.data["args"]["args"][-1]["messages"]
        for e in history
        if e.type is EventType.ACTIVITY_SCHEDULED and e.data["name"].endswith(".call")
    ]


@pytest.mark.parametrize("between", [3, 70])
async def test_an_answer_is_referred_to_after_steps_that_sent_no_answer(
    app: tether.App, server: ModelServer, between: int
) -> None:
    """After steps that sent no answer (a few, or many), a conversation still refers to
    an earlier answer by its node, not sent in full."""
    from pydantic_ai.messages import ModelRequest, UserPromptPart

    gw = ai.Gateway(app, retry=FAST)
    model = gw.model("m", ai.openai_compatible("m", base_url=server.base_url, api_key="k"))
    server.default = lambda body: model_reply(f"reply {len(body['messages'])}")

    @app.workflow
    async def chat(between: int) -> str:
        first = [ModelRequest(parts=[UserPromptPart("q0")])]
        response, _call = await gw.request(model, first)
        for i in range(between):
            await ai.complete(model, f"aside {i}")
        later, _call = await gw.request(
            model, [*first, response, ModelRequest(parts=[UserPromptPart("q1")])]
        )
        return str(later.parts[0].content)  # type: ignore[union-attr]

    async with app.worker(poll_interval=0.05):
        run = await app.start(chat, between)
        assert await run.result(timeout=60) == "reply 3"  # the model got all 3 messages
    history = await app.history(run.run_id)
    last = _scheduled_messages(history)[-1]
    assert last["base"] is not None and [set(e) for e in last["new"]] == [{"h", "m"}]
    report = check_history(app, history)
    assert report.ok, report


async def test_a_success_that_empties_a_rate_budget_pauses_the_model(
    app: tether.App, server: ModelServer
) -> None:
    """Headers are matched whatever case the provider writes them in."""
    gw = ai.Gateway(app, retry=FAST)
    model = gw.model("m", ai.openai_compatible("m", base_url=server.base_url, api_key="k"))
    asked: list[float] = []

    def answer(body: dict[str, Any]) -> Any:
        asked.append(time.monotonic())
        empty = {"X-RateLimit-Remaining-Requests": "0", "X-RateLimit-Reset-Requests": "800ms"}
        return model_reply("ok", headers=empty if len(asked) == 1 else {})

    server.default = answer

    @app.workflow
    async def two() -> list[str]:
        return [await ai.complete(model, "a"), await ai.complete(model, "b")]

    async with app.worker(poll_interval=0.05):
        run = await app.start(two)
        assert await run.result(timeout=30) == ["ok", "ok"]
    assert asked[1] - asked[0] >= 0.8 - 0.02


def _same_json(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (what replay reads is what the run
    read the first time)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same_json, a, b))
    return bool(a == b) or (a != a and b != b)


async def test_a_model_answer_reaches_the_workflow_as_replay_decodes_it(
    app: tether.App, server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model step's result is handed to the workflow without decoding its recorded
    text again: it must be exactly what decoding gives (priced, structured, a usage the
    server left out, a cached answer)."""
    from pydantic import BaseModel

    from tether import _worker

    class Label(BaseModel):
        label: str
        score: float

    handed: list[tuple[Any, Any]] = []
    kept: list[bool] = []  #: handed on as made (not decoded again)
    as_recorded = _worker._as_recorded

    def checked(value: Any, encoded: str) -> Any:
        out = as_recorded(value, encoded)
        kept.append(isinstance(value, JsonDict))
        handed.append((out, json.loads(encoded)))
        return out

    monkeypatch.setattr(_worker, "_as_recorded", checked)
    gw = ai.Gateway(app, retry=FAST)
    url = server.base_url
    priced = gw.model(
        "priced",
        ai.openai_compatible("priced", base_url=url, api_key="k"),
        price=ai.Price(input_per_mtok="0.5", output_per_mtok="1.5"),
        cache_ttl=60,
    )
    replies = iter(
        [
            model_reply("plain ünïcode"),
            model_reply(tool=("final_result", {"label": "a", "score": 0.25})),
            model_reply("no usage", input_tokens=0, output_tokens=0),
        ]
    )
    server.default = lambda body: next(replies)

    @app.workflow
    async def calls() -> list[str]:
        text = await ai.complete(priced, "one")
        label = await ai.structured(priced, "two", output=Label)
        estimated = await ai.complete(priced, "three")
        cached = await ai.complete(priced, "one")  # from the answer cache
        return [text, label.label, estimated, cached]

    async with app.worker(poll_interval=0.05):
        run = await app.start(calls)
        assert await run.result(timeout=30) == ["plain ünïcode", "a", "no usage", "plain ünïcode"]
    assert len(handed) == 4 and kept == [True, True, True, False]  # (the cache's is read)
    for out, decoded in handed:
        assert _same_json(out, decoded), (out, decoded)
    calls_made = [decoded[CALL_KEY] for _out, decoded in handed]
    assert calls_made[0]["cost"] is not None and calls_made[2].get("usage") == "estimated"
    assert calls_made[3].get("cache_hit") is True


def test_a_json_object_passes_a_dict_annotation_unvalidated() -> None:
    """A model step's request and result (``dict[str, Any]``) are decoded JSON objects:
    they are taken as they are, not validated; copied at the top only, as validation
    did, so code changing one in place never changes the event it came from; anything
    else is validated."""
    from tether._errors import PayloadError
    from tether._serde import convert

    value = {"a": [1, 2.5], "b": {"c": None}}
    for tp in (dict[str, Any], dict):
        got = convert(value, tp)
        assert got == value and got is not value
        got["a"] = "changed"
        assert value["a"] == [1, 2.5]
    with pytest.raises(PayloadError):
        convert({1: "x"}, dict[str, Any])  # not a JSON object's keys
    with pytest.raises(PayloadError):
        convert([1], dict[str, Any])
    assert convert({"a": "1"}, dict[str, int]) == {"a": 1}  # other types as before
