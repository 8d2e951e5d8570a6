"""Durable agents whose tools are listed with I/O: an MCP server (a real stdio process)
and dynamic toolsets. Their listing and each call are recorded steps run on a worker;
the workflow never starts the server or evaluates the toolset's function, and a
replay on a fresh worker calls neither again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fastmcp.client.transports import PythonStdioTransport
from pydantic import BaseModel
from pydantic_ai import Agent, FunctionToolset, RunContext
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import ModelResponse, ToolCallPart

import tether
from helpers import eventually
from tether import EventType, ai

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).parent


def scheduled(history: list[tether.Event]) -> list[str]:
    return [
        e.data["name"].rsplit(".", 1)[-1] for e in history if e.type is EventType.ACTIVITY_SCHEDULED
    ]


async def test_an_mcp_server_s_tools_run_as_recorded_steps_and_replay_without_it(
    app: tether.App, tmp_path: Path
) -> None:
    log = tmp_path / "mcp.log"
    server = MCPToolset(
        PythonStdioTransport(
            HERE / "mcp_calc_server.py", args=[str(log)], python_cmd=sys.executable
        ),
        id="calc",
        include_instructions=True,
    )
    scripted = ai.ScriptedModel(
        [ModelResponse(parts=[ToolCallPart("add", {"a": 40, "b": 2})]), "it is 42"]
    )
    gw = ai.Gateway(app)
    agent: Agent[None, str] = Agent(name="calc", toolsets=[server])
    calc = ai.durable(agent, gw, model=gw.model("m", scripted))

    @app.workflow
    async def ask(question: str) -> str:
        result = await calc.run(question)
        await tether.wait_event("done")  # the run stays open: a fresh worker must replay it
        return str(result.output)

    worker = app.worker(poll_interval=0.05)
    await worker.start()
    run = await app.start(ask, "what is 40 + 2?", run_id="mcp-1")

    async def waiting() -> bool:
        info = await app.get(run.run_id)
        return any(w.get("kind") == "signal" for w in info.waiting_on or [])

    await eventually(waiting, 30, "the agent to finish and the run to wait")
    await worker.kill()  # its cache goes: the next worker replays the agent from history
    logged = log.read_text().splitlines()
    assert logged.count("add 40 2") == 1
    starts = logged.count("start")
    assert starts >= 1
    # the server's instructions reached the model: the listing carried them
    first = " ".join(str(p) for m in scripted.requests[0] for p in getattr(m, "parts", []))
    assert "Use add for sums." in first or "Use add for sums." in str(scripted.requests[0])

    async with app.worker(poll_interval=0.05):
        await app.signal(run.run_id, "done")
        assert await run.result(timeout=30) == "it is 42"
    assert log.read_text().splitlines() == logged  # no new server process, no new call
    assert scripted.calls == 2
    history = await app.history(run.run_id)
    # one listing per agent run (as an MCP server's cached tools), one call
    assert scheduled(history) == ["tools", "call", "tool", "call"]


class Person(BaseModel):
    name: str


async def test_a_dynamic_toolset_is_built_on_the_worker_each_step_and_checks_arguments(
    app: tether.App,
) -> None:
    built: list[bool] = []  # for each evaluation: was it inside workflow code?
    scripted = ai.ScriptedModel(
        [
            ModelResponse(parts=[ToolCallPart("greet", {"person": 5})]),  # invalid arguments
            ModelResponse(parts=[ToolCallPart("greet", {"person": {"name": "Ann"}})]),
            "done",
        ]
    )
    gw = ai.Gateway(app)
    agent: Agent[str, str] = Agent(name="greeter", deps_type=str)

    @agent.toolset
    def per_city(ctx: RunContext[str]) -> FunctionToolset[str]:
        built.append(tether.in_workflow())
        tools: FunctionToolset[str] = FunctionToolset()

        @tools.tool_plain
        def greet(person: Person) -> str:
            assert isinstance(person, Person)  # checked and built on the worker
            return f"hello {person.name} from {ctx.deps}"

        return tools

    greeter = ai.durable(agent, gw, model=gw.model("m", scripted))

    @app.workflow
    async def hello(city: str) -> str:
        result = await greeter.run("greet Ann", deps=city)
        return str(result.output)

    async with app.worker(poll_interval=0.05):
        run = await app.start(hello, "Oslo")
        assert await run.result(timeout=30) == "done"
    assert built and not any(built)
    second, third = (str(r) for r in scripted.requests[1:])
    assert "invalid arguments for tool 'greet'" in second
    assert "hello Ann from Oslo" in third
    # a toolset re-evaluated at every run step is listed again at each one
    history = await app.history(run.run_id)
    assert scheduled(history) == ["tools", "call", "tool", "tools", "call", "tool", "tools", "call"]


async def test_run_stream_inside_a_workflow_reads_the_recorded_answer_whole(
    app: tether.App,
) -> None:
    """Code written for ``agent.run_stream`` runs unchanged in a workflow: the text comes
    as one item (the recorded answer, the same on replay); outside it streams as ever."""
    scripted = ai.ScriptedModel(["the whole answer"])
    gw = ai.Gateway(app)
    agent: Agent[None, str] = Agent(name="streamer")
    streamer = ai.durable(agent, gw, model=gw.model("m", scripted))

    @app.workflow
    async def ask(question: str) -> list[str]:
        async with streamer.run_stream(question) as result:
            pieces = [text async for text in result.stream_text()]
            assert await result.get_output() == pieces[-1]
        return pieces

    async with app.worker(poll_interval=0.05):
        run = await app.start(ask, "q")
        assert await run.result(timeout=30) == ["the whole answer"]
    from pydantic_ai.models.test import TestModel

    with agent.override(model=TestModel(custom_output_text="streamed outside")):
        async with streamer.run_stream("q") as result:
            assert await result.get_output() == "streamed outside"
