"""A pydantic-ai agent with tools, made durable by tether, killed mid-loop and resumed.

The agent plans a trip: it asks for a forecast, an exchange rate, then reserves a
room, then answers. Its code is plain pydantic-ai; ``ai.durable`` makes each model
request and each tool call a recorded step. This program runs the worker in a
child process, kills it with SIGKILL once two tool calls are recorded, starts
another, and shows that the agent went on from where it was: each tool ran once,
the room was reserved once, and no recorded model request was made again.

    python examples/durable_agent.py          # store: ./agent.db (started afresh)

The model is an offline stand-in (a pydantic-ai ``FunctionModel`` that decides from
the conversation so far), so the example needs no network or key.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import tether
from tether import ai

STORE = Path(os.environ.get("TETHER_EXAMPLE_STORE", "agent.db"))
LOG = Path(f"{STORE}.log")  # what actually ran: one JSON line per execution

app = tether.App(store=f"sqlite:///{STORE}")
gateway = ai.Gateway(app, retry=tether.Retry(attempts=3, initial=0.1))


def note(kind: str, detail: str) -> None:
    """Log an execution of the current step (the proof the example prints)."""
    ctx = tether.activity_context()
    line = {"kind": kind, "detail": detail, "run": ctx.run_id, "step": ctx.step, "at": time.time()}
    with LOG.open("a") as f:
        f.write(json.dumps(line) + "\n")


# the model: an offline stand-in that calls the three tools in turn, then answers ----


PLAN = [
    ("forecast", {"city": "Lisbon"}),
    ("exchange_rate", {"currency": "EUR"}),
    ("reserve_room", {"city": "Lisbon", "nights": 3}),
]


async def decide(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    note("model", f"request {len(messages) // 2 + 1}")
    await asyncio.sleep(0.3)  # a model takes a while: the kill may land mid-request
    results = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
    if len(results) < len(PLAN):
        name, args = PLAN[len(results)]
        return ModelResponse(parts=[ToolCallPart(name, args)])
    facts = "; ".join(str(r.content) for r in results)
    return ModelResponse(parts=[TextPart(f"Your trip is planned: {facts}.")])


# the agent: plain pydantic-ai ---------------------------------------------------------

agent: Agent[str, str] = Agent(
    FunctionModel(decide, model_name="offline-planner"),
    name="travel",
    deps_type=str,
    instructions="Plan the trip with the tools, then answer in one sentence.",
)


@agent.tool_plain
async def forecast(city: str) -> str:
    """The weather for the next days."""
    note("tool", f"forecast {city}")
    await asyncio.sleep(0.2)
    return f"{city}: sunny, 24C"


@agent.tool_plain
async def exchange_rate(currency: str) -> str:
    """How many of ``currency`` one US dollar buys."""
    note("tool", f"exchange_rate {currency}")
    await asyncio.sleep(0.2)
    return f"1 USD = 0.92 {currency}"


@agent.tool
async def reserve_room(ctx: RunContext[str], city: str, nights: int) -> str:
    """Reserve a room: an effect that must happen once (keyed by the step)."""
    key = tether.activity_context().idempotency_key
    note("tool", f"reserve_room {city} {nights} key={key}")
    await asyncio.sleep(0.2)
    return f"room in {city} for {nights} nights reserved for {ctx.deps} (ref {key})"


travel = ai.durable(agent, gateway)


@app.workflow
async def plan_trip(request: str, customer: str) -> str:
    """One agent run: the loop replays from its recorded requests and tool calls."""
    result = await travel.run(request, deps=customer)
    return str(result.output)


# the driver: a worker process, killed once, then another --------------------------------


def spawn_worker() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, "--worker"], env=os.environ.copy())


async def drive() -> int:
    for path in (STORE, Path(f"{STORE}-wal"), Path(f"{STORE}-shm"), LOG):
        path.unlink(missing_ok=True)
    worker = spawn_worker()
    run = await app.start(plan_trip, "A long weekend in Lisbon", "ana", run_id="trip-1")
    while True:  # wait until two tool calls are recorded
        history = await app.history(run.run_id)
        tools = [
            e
            for e in history
            if e.type.value == "ActivityCompleted"
            and e.step is not None
            and e.step in _tool_steps(history)
        ]
        if len(tools) >= 2:
            break
        await asyncio.sleep(0.05)
    worker.send_signal(signal.SIGKILL)
    worker.wait(10)
    print(f"killed the worker (SIGKILL) after {len(tools)} recorded tool calls")
    worker = spawn_worker()
    try:
        answer = await run.result(timeout=60)
    finally:
        worker.terminate()
        worker.wait(10)
    print(f"answer: {answer}")
    lines = read_log()
    history = await app.history(run.run_id)
    recorded_at = {e.step: e.created_at for e in history if e.type.value == "ActivityCompleted"}
    again = [x for x in lines if x["step"] in recorded_at and x["at"] > recorded_at[x["step"]]]
    tool_runs = [x["detail"].split(" key=")[0] for x in lines if x["kind"] == "tool"]
    requests = [x for x in lines if x["kind"] == "model"]
    recorded_requests = sum(
        1
        for e in history
        if e.type.value == "ActivityScheduled" and e.data["name"] == "tether.ai.call"
    )
    print(f"tool executions: {tool_runs}")
    print(f"model requests: {len(requests)} made for {recorded_requests} recorded")
    print(f"recorded steps executed again: {len(again)}")
    await app.close()
    reserved = sum(1 for t in tool_runs if t.startswith("reserve_room"))
    return 0 if not again and reserved == 1 else 1


def read_log() -> list[dict[str, Any]]:
    return [json.loads(line) for line in LOG.read_text().splitlines()]


def _tool_steps(history: list[tether.Event]) -> set[int]:
    return {
        e.step
        for e in history
        if e.type.value == "ActivityScheduled"
        and e.data["name"].endswith(".tool")
        and e.step is not None
    }


if __name__ == "__main__":
    if "--worker" in sys.argv:
        asyncio.run(app.worker(lease=1.0, poll_interval=0.05).run())
    else:
        sys.exit(asyncio.run(drive()))
