"""A worker process for tether.ai crash tests: ``python tests/ai_crash_app.py DB BASE_URL``."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, RunContext

import tether
from tether import ai

DB = sys.argv[1] if len(sys.argv) > 1 else "tether.db"
BASE_URL = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:9/v1"
EFFECTS = Path(sys.argv[3] if len(sys.argv) > 3 else "effects.txt")

#: TETHER_TEST_KILL_AFTER_FETCH=<marker file>: SIGKILL once, when a batch's fetch has
#: done its work but before its result is recorded (patched before the gateway
#: registers its activities)
_KILL_AFTER_FETCH = os.environ.get("TETHER_TEST_KILL_AFTER_FETCH")
if _KILL_AFTER_FETCH:
    from tether.ai import _batch

    _real_fetch = _batch.BatchJobs._fetch

    async def _fetch_then_die(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = await _real_fetch(self, *args, **kwargs)
        marker = Path(str(_KILL_AFTER_FETCH))
        if not marker.exists():
            marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    _batch.BatchJobs._fetch = _fetch_then_die  # type: ignore[method-assign]

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


@app.workflow
async def nightly_batch(keys: list[str]) -> dict[str, str]:
    """One provider batch job."""
    res = await ai.batch(model, {k: f"q {k}" for k in keys}, poll=0.2, max_poll=0.2)
    return res.results


async def main() -> None:
    """Serve until killed (a 1 s lease, so a restarted worker takes over quickly)."""
    await app.worker(lease=1.0, poll_interval=0.05).run()


if __name__ == "__main__":
    asyncio.run(main())
