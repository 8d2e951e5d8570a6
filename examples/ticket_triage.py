"""Ticket triage: prompt chaining with validation gates and a bounded repair loop.

classify (structured output, validated: an invalid answer is fed back for one repair)
-> route (an allow-list with a safe default: anything unsure goes to a person)
-> draft a reply (text) -> a gate (no promises the company cannot keep) -> file it.

Every model call is a recorded step: a crash re-runs none that answered, and the
history shows each attempt and repair. The model here is offline and scripted by the
ticket's text (clearly not a real model); pass any pydantic-ai model instead.

    python examples/ticket_triage.py     (TETHER_EXAMPLE_STORE: the store)
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile

from pydantic import BaseModel
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

import tether
from tether import ai

STORE = os.environ.get("TETHER_EXAMPLE_STORE") or f"{tempfile.mkdtemp()}/tickets.db"
app = tether.App(store=STORE)


class Triage(BaseModel):
    category: str
    priority: int
    confidence: float


def offline_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """A stand-in model: answers by the ticket's words; makes one invalid answer (a
    priority of 9) on its first try for a crash report, fixed when told."""
    text = str(messages)  # every part of the conversation, as text
    usage = RequestUsage(input_tokens=80, output_tokens=20)
    if info.output_tools:  # the classify step: a structured answer
        repaired = "Your answer was invalid" in text
        if "crash" in text:
            answer = {"category": "tech", "priority": 1 if repaired else 9, "confidence": 0.9}
        elif "refund" in text:
            answer = {"category": "billing", "priority": 2, "confidence": 0.95}
        else:
            answer = {"category": "sales", "priority": 3, "confidence": 0.4}
        return ModelResponse(parts=[ToolCallPart("final_result", json.dumps(answer))], usage=usage)
    reply = (
        "We guarantee a fix today."
        if "crash" in text and "gate" not in text
        else "Thanks for reporting this; we are on it and will update you shortly."
    )
    return ModelResponse(parts=[TextPart(reply)], usage=usage)


gateway = ai.Gateway(app, retry=tether.Retry(attempts=3, initial=0.05))
model = gateway.model("triage-model", FunctionModel(offline_model, model_name="offline"))
FILED: dict[str, dict[str, object]] = {}


def priority_in_range(t: Triage) -> list[str]:
    """The validation gate of the classify step."""
    return [] if 1 <= t.priority <= 5 else [f"priority must be 1-5, got {t.priority}"]


@app.activity
def file_ticket(ticket_id: str, queue: str, reply: str) -> None:
    """File the ticket (keyed by its id: filing twice changes nothing)."""
    FILED[ticket_id] = {"queue": queue, "reply": reply}


@app.workflow
async def triage(ticket_id: str, text: str) -> dict[str, object]:
    t = await ai.structured(
        model,
        f"Triage this ticket: {text}",
        output=Triage,
        validate=priority_in_range,
        max_repairs=1,
    )
    queue = tether.route(
        t.category,
        {"billing", "tech"},
        default="human",
        confidence=t.confidence,
        min_confidence=0.7,
    )
    reply = await ai.complete(model, f"Draft a reply to: {text}")
    if "guarantee" in reply.lower():  # the gate: no promises; one redraft, told why
        reply = await ai.complete(
            model, f"Draft a reply to: {text}. The gate refused: do not promise anything."
        )
    await file_ticket(ticket_id, queue, reply)
    return {"queue": queue, "priority": t.priority, "reply": reply}


TICKETS = {
    "T-1": "I want a refund for the double charge on my invoice",
    "T-2": "The app crashes when I upload a PDF",
    "T-3": "hello, do you sell gift cards?",
}


async def main() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    async with app.worker(poll_interval=0.05):
        for tid, text in TICKETS.items():
            out[tid] = await (await app.start(triage, tid, text, run_id=tid)).result(timeout=30)
    return out


if __name__ == "__main__":
    for tid, result in asyncio.run(main()).items():
        print(f"{tid}: {result}")
