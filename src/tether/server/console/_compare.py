"""Two runs side by side, step by step (a run and its fork): what each step returned,
its tokens, cost and latency, with the steps whose outcome differs marked."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..._history import Event, EventType

_CALL = "tether.ai.call"


@dataclass
class Step:
    """One step of one run, as compared."""

    name: str
    outcome: str = "open"  #: ok, failed, open
    result: str = ""
    latency: float | None = None
    tokens: int | None = None
    cost: Any = None
    model: str | None = None
    prompt: str | None = None  #: the prompt version a model call rendered (name@version)
    reused: bool = False  #: copied from the run it was forked from (not run again)


def steps_of(history: list[Event]) -> dict[int, Step]:
    """The activity steps of a run by step number."""
    out: dict[int, Step] = {}
    started: dict[int, float] = {}
    forked = history[0].data.get("forked_from") if history else None
    reused_upto = int(forked.get("at_step", 0)) if isinstance(forked, dict) else 0
    for e in history:
        if e.step is None:
            continue
        if e.type is EventType.ACTIVITY_SCHEDULED:
            out[e.step] = Step(name=str(e.data.get("name", "?")), reused=e.step <= reused_upto)
            started[e.step] = e.created_at
        elif e.type in (EventType.ACTIVITY_COMPLETED, EventType.ACTIVITY_FAILED):
            step = out.get(e.step)
            if step is None:
                continue
            step.latency = e.created_at - started[e.step]
            if e.type is EventType.ACTIVITY_FAILED:
                step.outcome = "failed"
                err = e.data.get("error") or {}
                step.result = f"{err.get('type', 'error')}: {err.get('message', '')}"[:300]
                continue
            step.outcome = "ok"
            result = e.data.get("result")
            call = result.get(_CALL) if isinstance(result, dict) else None
            if isinstance(result, dict) and isinstance(call, dict):
                # a model call: its text, not the whole response
                step.model = f"{call.get('provider')}:{call.get('model_name')}"
                step.prompt = call.get("prompt_version")
                step.tokens = (call.get("input_tokens") or 0) + (call.get("output_tokens") or 0)
                step.cost = call.get("cost")
                result = _text_of(result.get("response"))
            step.result = json.dumps(result, ensure_ascii=False, default=str)[:300]
    return out


def _text_of(response: Any) -> Any:
    """The text or tool arguments of a recorded model response."""
    parts = response.get("parts") if isinstance(response, dict) else None
    if not isinstance(parts, list):
        return response
    texts = [p.get("content") or p.get("args") for p in parts if isinstance(p, dict)]
    return texts[0] if len(texts) == 1 else texts


def compare(a: list[Event], b: list[Event]) -> list[dict[str, Any]]:
    """Rows of the comparison: step, both sides, and whether their outcomes differ."""
    sa, sb = steps_of(a), steps_of(b)
    rows = []
    for step in sorted(set(sa) | set(sb)):
        left, right = sa.get(step), sb.get(step)
        differs = (left is None) != (right is None) or (
            left is not None and right is not None and left.result != right.result
        )
        rows.append({"step": step, "a": left, "b": right, "differs": differs})
    return rows
