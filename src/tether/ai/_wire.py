"""Model messages and request parameters as JSON, to cross into a recorded step."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelResponse
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.tools import ToolDefinition

_TOOLS: TypeAdapter[list[ToolDefinition]] = TypeAdapter(list[ToolDefinition])


def dump_messages(messages: list[ModelMessage]) -> list[Any]:
    """Messages as JSON values."""
    out: list[Any] = ModelMessagesTypeAdapter.dump_python(messages, mode="json")
    return out


def load_messages(data: list[Any]) -> list[ModelMessage]:
    """Messages back from ``dump_messages``."""
    return ModelMessagesTypeAdapter.validate_python(data)


def dump_response(response: ModelResponse) -> dict[str, Any]:
    """A response as a JSON object."""
    out: dict[str, Any] = dump_messages([response])[0]
    return out


def load_response(data: dict[str, Any]) -> ModelResponse:
    """A response back from ``dump_response``."""
    msg = load_messages([data])[0]
    assert isinstance(msg, ModelResponse)
    return msg


def dump_params(params: ModelRequestParameters) -> dict[str, Any]:
    """The parts of request parameters a plain model call uses."""
    return {
        "function_tools": _TOOLS.dump_python(params.function_tools, mode="json"),
        "output_mode": params.output_mode,
        "output_tools": _TOOLS.dump_python(params.output_tools, mode="json"),
        "allow_text_output": params.allow_text_output,
    }


def load_params(data: dict[str, Any]) -> ModelRequestParameters:
    """Request parameters back from ``dump_params``."""
    return ModelRequestParameters(
        function_tools=_TOOLS.validate_python(data.get("function_tools") or []),
        output_mode=data.get("output_mode", "text"),
        output_tools=_TOOLS.validate_python(data.get("output_tools") or []),
        allow_text_output=bool(data.get("allow_text_output", True)),
    )
