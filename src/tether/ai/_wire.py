"""Model messages and request parameters as JSON, to cross into a recorded step."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelResponse
from pydantic_ai.models import ModelRequestParameters

_PARAMS: TypeAdapter[ModelRequestParameters] = TypeAdapter(ModelRequestParameters)


def dump_messages(messages: list[ModelMessage]) -> list[Any]:
    """Messages as JSON values."""
    # None fields are their defaults: leaving them out halves what every step stores
    out: list[Any] = ModelMessagesTypeAdapter.dump_python(messages, mode="json", exclude_none=True)
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
    """Request parameters (tools, output mode, instructions...) as a JSON object."""
    out: dict[str, Any] = _PARAMS.dump_python(params, mode="json", exclude_defaults=True)
    return out


def load_params(data: dict[str, Any]) -> ModelRequestParameters:
    """Request parameters back from ``dump_params``."""
    return _PARAMS.validate_python(data)
