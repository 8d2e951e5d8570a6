"""``ScriptedModel``: a pydantic-ai model answering from a list, for tests without a network."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage


class ScriptExhausted(AssertionError):
    """A scripted model was called more times than its script has answers."""


class ScriptedModel(FunctionModel):
    """Answers with the given items in order and fails loudly when they run out.

    An item is a ``ModelResponse``, a string (a text answer), a dict (the
    structured output, sent as the ``final_result`` tool call) or an exception
    (raised). ``calls`` counts requests; ``requests`` keeps their messages.
    """

    def __init__(self, answers: Sequence[Any], *, model_name: str = "scripted") -> None:
        self.answers = list(answers)
        self.calls = 0
        self.requests: list[list[ModelMessage]] = []
        super().__init__(self._answer, model_name=model_name)

    def _answer(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests.append(list(messages))
        if self.calls >= len(self.answers):
            raise ScriptExhausted(
                f"scripted model {self.model_name!r} was called {self.calls + 1} times but its "
                f"script has {len(self.answers)} answer(s)"
            )
        item = self.answers[self.calls]
        self.calls += 1
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, ModelResponse):
            return item
        usage = RequestUsage(input_tokens=10, output_tokens=5)
        if isinstance(item, str):
            return ModelResponse(parts=[TextPart(item)], usage=usage, model_name=self.model_name)
        return ModelResponse(
            parts=[ToolCallPart("final_result", json.dumps(item))],
            usage=usage,
            model_name=self.model_name,
        )
