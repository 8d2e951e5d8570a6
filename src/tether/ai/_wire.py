"""Model messages and request parameters as JSON, to cross into a recorded step."""

from __future__ import annotations

import hashlib
import json
import json.encoder
from typing import Any

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelResponse
from pydantic_ai.models import ModelRequestParameters

_PARAMS: TypeAdapter[ModelRequestParameters] = TypeAdapter(ModelRequestParameters)
_RESPONSE: TypeAdapter[ModelResponse] = TypeAdapter(ModelResponse)


def dump_messages(messages: list[ModelMessage]) -> list[Any]:
    """Messages as JSON values."""
    # None fields are their defaults: leaving them out halves what every step stores
    out: list[Any] = ModelMessagesTypeAdapter.dump_python(messages, mode="json", exclude_none=True)
    return out


def load_messages(data: list[Any]) -> list[ModelMessage]:
    """Messages back from ``dump_messages``."""
    return ModelMessagesTypeAdapter.validate_python(data)


def dump_response(response: ModelResponse) -> dict[str, Any]:
    """A response as a JSON object (as ``dump_messages`` writes it: the response's own
    adapter skips the union of message kinds, a third of the time)."""
    out: dict[str, Any] = _RESPONSE.dump_python(response, mode="json", exclude_none=True)
    return out


def load_response(data: dict[str, Any]) -> ModelResponse:
    """A response back from ``dump_response``."""
    return _RESPONSE.validate_python(data)


def dump_params(params: ModelRequestParameters | None) -> dict[str, Any]:
    """Request parameters (tools, output mode, instructions...) as a JSON object;
    ``None``: the defaults, which dump to ``{}`` (made without building them: a plain
    text step would spend ~20 us per call on an empty object)."""
    if params is None:
        return {}
    out: dict[str, Any] = _PARAMS.dump_python(params, mode="json", exclude_defaults=True)
    return out


def load_params(data: dict[str, Any]) -> ModelRequestParameters:
    """Request parameters back from ``dump_params``; ``{}`` (a plain text step's): the
    defaults, made without validating (a third less work)."""
    if not data:
        return ModelRequestParameters()
    return _PARAMS.validate_python(data)


#: a message's own fields that differ between two copies of it: when it was made, and
#: the ids of the agent run that made it (new on every replay)
_MESSAGE_VOLATILE = frozenset({"timestamp", "run_id", "conversation_id"})


def stable(message: dict[str, Any]) -> dict[str, Any]:
    """A message (JSON) without the fields pydantic-ai sets anew for the same content:
    the message's and each part's ``timestamp``, and the agent run's ids. Only there:
    a field of that name inside content (a tool's return value, its arguments) is the
    caller's data and goes to the model as it is."""
    out = dict(message)  # (copied and popped: the same order, less work than a filter)
    for key in _MESSAGE_VOLATILE:
        out.pop(key, None)
    parts = out.get("parts")
    if isinstance(parts, list):
        out["parts"] = [_untimed(p) if isinstance(p, dict) else p for p in parts]
    return out


def _untimed(part: dict[str, Any]) -> dict[str, Any]:
    """A copy of a message part without its ``timestamp``."""
    out = dict(part)
    out.pop("timestamp", None)
    return out


def _not_json(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


#: the C encoder ``json.dumps(..., sort_keys=True, separators=(",", ":"))`` builds on
#: every call, built once (without its check for cycles: a message is JSON values)
_C_ENCODER: Any = getattr(json.encoder, "c_make_encoder", None)  # (None without the C module)
_SORTED = (
    _C_ENCODER(
        None, _not_json, json.encoder.encode_basestring_ascii, None, ":", ",", True, False, True
    )
    if _C_ENCODER is not None
    else None
)


def sorted_json(value: Any) -> str:
    """``json.dumps(value, sort_keys=True, separators=(",", ":"))``, the same text
    (addresses are hashes of it), without an encoder made per call."""
    if _SORTED is None:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return "".join(_SORTED(value, 0))


def canonical(message: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A message's content address (SHA-256 of its ``stable`` JSON) and that JSON."""
    content = stable(message)
    return hashlib.sha256(sorted_json(content).encode()).hexdigest()[:32], content


def legacy_digest(message: dict[str, Any]) -> str:
    """The address tether 0.x before 2026-12-05 gave a message: with every ``timestamp``
    field left out at any depth, content included. A worker indexes answers under it
    too, so a workflow process of that version still finds what it refers to."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "timestamp"}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    content = strip(message)
    for key in ("run_id", "conversation_id"):
        content.pop(key, None)
    return hashlib.sha256(sorted_json(content).encode()).hexdigest()[:32]


def link(parent: str | None, message: str) -> str:
    """The node of a conversation that ends with ``message`` after the node ``parent``."""
    return hashlib.sha256(f"{parent or ''}:{message}".encode()).hexdigest()[:32]


def pack(
    messages: list[dict[str, Any]], stored: set[str], nodes: set[str]
) -> tuple[dict[str, Any], list[str], str]:
    """A conversation as the longest stored prefix (one node id) plus the messages after it.

    Each message after the prefix is ``{"h": hash}`` when its content is stored
    already, else ``{"h": hash, "m": message}``. Returns the packed form, the
    hashes sent in full, and the node of the whole list. A step's arguments so stay
    the same size however long the conversation grows.
    """
    digests, stables, chain = [], [], []
    node: str | None = None
    for message in messages:
        digest, stable = canonical(message)
        node = link(node, digest)
        digests.append(digest)
        stables.append(stable)
        chain.append(node)
    start = next((k for k in range(len(chain), 0, -1) if chain[k - 1] in nodes), 0)
    entries: list[dict[str, Any]] = []
    inline: list[str] = []
    for digest, stable in zip(digests[start:], stables[start:], strict=True):
        if digest in stored or digest in inline:
            entries.append({"h": digest})
        else:
            entries.append({"h": digest, "m": stable})
            inline.append(digest)
    base = chain[start - 1] if start else None
    return {"base": base, "new": entries}, inline, chain[-1] if chain else ""


def is_packed(messages: Any) -> bool:
    """Whether a request's messages are in ``pack`` form (not a list of full messages)."""
    return isinstance(messages, dict) and "new" in messages
