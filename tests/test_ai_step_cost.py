"""What the cheaper per-step work of a model step must keep: the same recorded step,
the same answer, the same references and the same rate-limit feedback."""

from __future__ import annotations

from typing import Any

import pytest

import tether
from tether import ai
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

