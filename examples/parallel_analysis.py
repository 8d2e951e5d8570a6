"""Parallel analysis with required and optional branches.

A document is analysed three ways at once: its summary and its risk score are
required; a sentiment score is optional, nice to have. An optional branch that fails
(its service is down after its retries) or is too slow (past its own deadline) leaves
a gap in the report, marked as such; a required branch that fails fails the run, and
nothing is published half-done. Each branch is a recorded step, so a crash re-runs
none that finished.

    python examples/parallel_analysis.py     (TETHER_EXAMPLE_STORE: the store)
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any

import tether

STORE = os.environ.get("TETHER_EXAMPLE_STORE") or f"{tempfile.mkdtemp()}/analysis.db"
app = tether.App(store=STORE)

#: what the example's "services" do (the tests switch them)
SERVICES = {"sentiment": "up", "risk": "up"}


@app.activity
async def summarise(text: str) -> str:
    return text[:40] + ("..." if len(text) > 40 else "")


@app.activity(retry=tether.Retry(attempts=2, initial=0.05))
async def risk_score(text: str) -> float:
    if SERVICES["risk"] == "down":
        raise ConnectionError("risk service unavailable")
    return 0.8 if "penalty" in text else 0.1


@app.activity(retry=tether.Retry(attempts=2, initial=0.05))
async def sentiment(text: str) -> float:
    if SERVICES["sentiment"] == "down":
        raise ConnectionError("sentiment service unavailable")
    if SERVICES["sentiment"] == "slow":
        await asyncio.sleep(5)
    return -0.3 if "penalty" in text else 0.6


@app.workflow
async def analyse(text: str) -> dict[str, Any]:
    """Required branches fail the run; the optional one degrades to a marked gap."""
    optional = tether.first(sentiment(text), tether.sleep(1.0))  # its own deadline
    summary, risk, mood = await tether.gather(
        summarise(text), risk_score(text), optional, return_exceptions=True
    )
    for name, value in (("summary", summary), ("risk", risk)):
        if isinstance(value, BaseException):
            raise RuntimeError(f"required branch {name} failed: {value}")
    report: dict[str, Any] = {"summary": summary, "risk": risk}
    if isinstance(mood, BaseException):
        report["sentiment"] = None
        report["gaps"] = [f"sentiment: {type(mood).__name__}"]
    elif mood is None:  # the timer won
        report["sentiment"] = None
        report["gaps"] = ["sentiment: no answer within 1 s"]
    else:
        report["sentiment"] = mood
    return report


async def main() -> list[Any]:
    text = "The supplier pays a penalty of 2% per day of delay after the first week."
    out: list[Any] = []
    async with app.worker(poll_interval=0.05):
        for state in ("up", "down", "slow"):
            SERVICES["sentiment"] = state
            out.append(await (await app.start(analyse, text)).result(timeout=30))
        SERVICES["risk"] = "down"
        try:
            await (await app.start(analyse, text)).result(timeout=30)
        except tether.WorkflowFailedError as exc:
            out.append(f"failed: {exc}")
    return out


if __name__ == "__main__":
    for line in asyncio.run(main()):
        print(line)
