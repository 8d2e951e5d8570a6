"""A worker process for tether.ai crash tests: ``python tests/ai_crash_app.py DB BASE_URL``."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from pydantic_ai import Agent, RunContext

import tether
from tether import ai

DB = sys.argv[1] if len(sys.argv) > 1 else "tether.db"
BASE_URL = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:9/v1"
EFFECTS = Path(sys.argv[3] if len(sys.argv) > 3 else "effects.txt")

app = tether.App(store=f"sqlite:///{DB}")
gateway = ai.Gateway(app, retry=tether.Retry(attempts=3, initial=0.05), timeout=30)
model = gateway.model("m", lambda: ai.openai_compatible("m", base_url=BASE_URL, api_key="k"))


@app.workflow
async def two_calls(text: str) -> list[str]:
    """Two model steps in a row."""
    first = await ai.complete(model, f"first: {text}")
    second = await ai.complete(model, f"second: {text}")
    return [first, second]


agent = Agent(
    ai.openai_compatible("agent-model", base_url=BASE_URL, api_key="k"),
    name="helper",
    deps_type=str,
    instructions="Answer with the tools.",
)


@agent.tool
async def lookup(ctx: RunContext[str], key: str) -> str:
    """Look a key up for the tenant in deps."""
    with EFFECTS.open("a") as f:
        f.write(f"lookup {key}\n")
    return f"{ctx.deps}:{key}=42"


@agent.tool_plain
def add(a: int, b: int) -> int:
    """Add two numbers."""
    with EFFECTS.open("a") as f:
        f.write(f"add {a} {b}\n")
    return a + b


durable_agent = ai.durable(agent, gateway)


@app.workflow
async def ask_agent(question: str) -> str:
    """One agent run with two tool calls."""
    result = await durable_agent.run(question, deps="acme")
    return str(result.output)


async def main() -> None:
    """Serve until killed (a 1 s lease, so a restarted worker takes over quickly)."""
    await app.worker(lease=1.0, poll_interval=0.05).run()


if __name__ == "__main__":
    asyncio.run(main())
