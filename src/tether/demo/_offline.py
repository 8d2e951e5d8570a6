"""The demo's offline model: deterministic answers worked out from the prompt.

A pydantic-ai ``FunctionModel``, so it goes through the same gateway step as a real
provider (recorded, retried, priced, counted). It reads the document in the prompt
with a few rules. It gets one invoice total wrong on the first try, so the
validation gate and the repair loop have something to do.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

OFFLINE_MODEL_NAME = "offline-demo"


def offline_model(pace: float, log: Callable[[str], None]) -> FunctionModel:
    """The model (built on each worker); ``log`` notes each execution in the side table."""

    async def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        log("model")
        await asyncio.sleep(0.35 * pace)
        prompt = _first_prompt(messages)
        repaired = any("Your answer was invalid" in str(m) for m in messages[1:])
        if info.output_tools:
            title = str(info.output_tools[0].parameters_json_schema.get("title", ""))
            value = _structured(title, prompt, repaired)
            body = json.dumps(value)
            part: TextPart | ToolCallPart = ToolCallPart(info.output_tools[0].name, body)
        else:
            body = _text(prompt)
            part = TextPart(body)
        usage = RequestUsage(
            input_tokens=max(1, len(str(messages)) // 4), output_tokens=max(1, len(body) // 4)
        )
        return ModelResponse(parts=[part], usage=usage, model_name=OFFLINE_MODEL_NAME)

    return FunctionModel(answer, model_name=OFFLINE_MODEL_NAME)


def _first_prompt(messages: list[ModelMessage]) -> str:
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                    return part.content
    return ""


def _structured(title: str, prompt: str, repaired: bool) -> dict[str, Any]:
    if title == "Classification":
        return _classify(prompt)
    if title == "InvoiceFields":
        lines = [float(x) for x in re.findall(r"= ([\d.]+)", prompt)]
        total = float(_find(r"Total:\s*([\d.]+)", prompt) or 0)
        if "9012" in prompt and not repaired:
            total += 100  # a misread total: the validation gate catches it, one repair fixes it
        return {
            "number": _find(r"INVOICE (\w+)", prompt) or "?",
            "vendor": _find(r"From: (.+)", prompt) or "?",
            "currency": _find(r"Currency: (\w+)", prompt) or "?",
            "lines": lines,
            "total": total,
        }
    if title == "ContractTerms":
        parties = re.search(r"between (.+?) and (.+?), effective", prompt)
        notice = _find(r"(\d+) days notice", prompt)
        return {
            "parties": list(parties.groups()) if parties else [],
            "term_months": int(_find(r"term of (\d+) months", prompt) or 0),
            "notice_days": int(notice) if notice else None,
            "governing_law": _find(r"Governing law: (\w+)", prompt) or "?",
        }
    if title == "TicketTriage":
        lowered = prompt.lower()
        team = "billing" if "charged" in lowered else "access" if "login" in lowered else "general"
        return {
            "team": team,
            "priority": 2 if team == "billing" else 3,
            "customer": _find(r"from (\S+@\S+?):", prompt) or "unknown",
        }
    return {}


def _classify(prompt: str) -> dict[str, Any]:
    text = prompt.split("\n\n", 1)[-1]
    rules = [
        ("INVOICE", "invoice", 0.96, "says INVOICE, has lines and a total"),
        ("AGREEMENT", "contract", 0.91, "an agreement between named parties"),
        ("SUPPORT TICKET", "ticket", 0.89, "a customer asking for help"),
        ("# Quarterly", "report", 0.93, "a long report with headed sections"),
        ("Note from a customer", "ticket", 0.64, "maybe a ticket: no clear request"),
    ]
    for needle, kind, confidence, reason in rules:
        if needle in text:
            return {"kind": kind, "confidence": confidence, "reason": reason}
    return {"kind": "memo", "confidence": 0.42, "reason": "none of the known kinds"}


def _text(prompt: str) -> str:
    if prompt.startswith("Merge these summaries"):
        items = [line[2:].strip() for line in prompt.splitlines() if line.startswith("- ")]
        return " ".join(items)
    body = prompt.split("\n\n", 1)[-1]
    body = re.sub(r"^#+ .*\n+", "", body.strip())
    sentence = re.split(r"(?<=[.!?])\s+", body.strip())[0]
    return sentence[:160]


def _find(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text)
    return match.group(1).strip() if match else None
