"""Building pydantic-ai models with SDK retries off, and reading their responses' headers.

tether owns retries (one retry layer: ``tether.Retry`` with classification), so
every model tether builds has its SDK's own retries turned off. Response
headers (``x-ratelimit-*``) are captured per call so a successful answer that
used up a rate budget still pauses the model's limiter.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping
from typing import Any

import httpx
from pydantic_ai.models import Model

from ._errors import ModelConfigError

#: the capture of the current call (the client's hook gives it each response's headers)
_headers: contextvars.ContextVar[HeaderCapture | None] = contextvars.ContextVar(
    "tether_ai_headers", default=None
)


async def _capture(response: Any) -> None:
    holder = _headers.get()
    if holder is not None:
        # the response's own headers (case-insensitive ``get``): read only when a limit
        # is looked up, not copied on every call
        holder.headers = response.headers


def http_client(timeout: float | None = None, *, lib: Any = httpx) -> Any:
    """An HTTP client for a provider SDK that records response headers for tether.

    ``lib`` is the SDK's HTTP library (``httpx``, or ``httpx2`` for openai 3).
    """
    return lib.AsyncClient(
        timeout=lib.Timeout(timeout if timeout is not None else 600.0, connect=10.0),
        event_hooks={"response": [_capture]},
    )


class HeaderCapture:
    """Collects the response headers of the model call made inside its ``with`` block:
    ``headers`` are the last response's (looked up case-insensitively with ``get``)."""

    def __init__(self) -> None:
        self.headers: Mapping[str, str] = {}
        self._token: contextvars.Token[HeaderCapture | None] | None = None

    def __enter__(self) -> HeaderCapture:
        self._token = _headers.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _headers.reset(self._token)


def openai_compatible(
    model_name: str,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    timeout: float | None = None,
    headers: dict[str, str] | None = None,
    require_finish_reason: bool = True,
) -> Model:
    """An OpenAI chat model, or any OpenAI-compatible server's (vLLM, Ollama, LM Studio...).

    SDK retries are off. ``api_key`` defaults to ``OPENAI_API_KEY``; a local
    server that needs none gets a placeholder. ``headers`` go with every request (a
    proxy's or gateway's own key: set here, in the worker, they are never recorded).
    A streamed answer that ends without a finish reason was cut off (an attempt that
    failed, retried), never a short answer; ``require_finish_reason=False`` for a
    server that never sends one.
    """
    try:
        from openai import AsyncOpenAI
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.profiles.openai import OpenAIModelProfile
        from pydantic_ai.providers.openai import OpenAIProvider
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ModelConfigError(
            f"model {model_name!r} needs the OpenAI SDK: pip install 'tether[ai]' ({exc})"
        ) from None
    key = api_key or os.environ.get("OPENAI_API_KEY")
    if key is None:
        if base_url is None:
            raise ModelConfigError(
                f"model {model_name!r}: no API key; set OPENAI_API_KEY in the worker's "
                "environment or pass api_key="
            )
        key = "unused"  # local servers (Ollama, vLLM) accept any key
    client = AsyncOpenAI(
        api_key=key,
        base_url=base_url or os.environ.get("OPENAI_BASE_URL"),
        max_retries=0,
        default_headers=headers,
        http_client=http_client(timeout, lib=_sdk_http(AsyncOpenAI)),
    )
    return OpenAIChatModel(
        model_name,
        provider=OpenAIProvider(openai_client=client),
        profile=OpenAIModelProfile(
            openai_chat_streaming_requires_finish_reason=require_finish_reason
        ),
    )


def anthropic(
    model_name: str,
    *,
    api_key: str | None = None,
    base_url: str | None = None,
    timeout: float | None = None,
    headers: dict[str, str] | None = None,
) -> Model:
    """An Anthropic model with SDK retries off (``api_key`` defaults to ``ANTHROPIC_API_KEY``;
    ``base_url`` to ``ANTHROPIC_BASE_URL`` or Anthropic's own, e.g. for a proxy; ``headers``
    go with every request and are never recorded)."""
    try:
        from anthropic import AsyncAnthropic
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider
    except ImportError as exc:
        raise ModelConfigError(
            f"model {model_name!r} needs the Anthropic SDK: pip install "
            f"'pydantic-ai-slim[anthropic]' ({exc})"
        ) from None
    key = api_key or os.environ.get("ANTHROPIC_API_KEY")
    if key is None:
        raise ModelConfigError(
            f"model {model_name!r}: no API key; set ANTHROPIC_API_KEY in the worker's "
            "environment or pass api_key="
        )
    client = AsyncAnthropic(
        api_key=key,
        base_url=base_url or os.environ.get("ANTHROPIC_BASE_URL"),
        max_retries=0,
        default_headers=headers,
        http_client=http_client(timeout, lib=_sdk_http(AsyncAnthropic)),
    )
    return AnthropicModel(model_name, provider=AnthropicProvider(anthropic_client=client))


def _sdk_http(client_class: Any) -> Any:
    """The HTTP library a provider SDK's client takes (its module imports one of them)."""
    import importlib
    import sys

    module = sys.modules.get(client_class.__module__.split(".")[0])
    for lib in ("httpx2", "httpx"):
        if module is not None and hasattr(module, "_base_client"):
            base = module._base_client
            if getattr(base, lib, None) is not None:
                return importlib.import_module(lib)
    return httpx


def build(spec: str) -> Model:
    """A model from ``"provider:name"``, SDK retries off for the providers tether knows.

    ``openai:`` and ``anthropic:`` are built here; other providers go through
    pydantic-ai's ``infer_model`` (their SDK's retry default applies: pass a
    ``Model`` instance built with retries off to be sure).
    """
    provider, sep, name = spec.partition(":")
    if sep and provider == "openai":
        return openai_compatible(name)
    if sep and provider == "anthropic":
        return anthropic(name)
    try:
        from pydantic_ai.models import infer_model

        return infer_model(spec)
    except ModelConfigError:
        raise
    except Exception as exc:
        # the message of a provider's missing-key error names the variable, never a key
        raise ModelConfigError(
            f"cannot build model {spec!r}: {type(exc).__name__}: {exc}. {UNKNOWN_MODEL_HINT}"
        ) from None


#: what a Python caller can do about a model ``build`` cannot make (``tether demo``
#: says what its user can do instead)
UNKNOWN_MODEL_HINT = (
    "Use a 'provider:name' pydantic-ai knows (e.g. 'openai:gpt-4o-mini') or pass a Model"
)


def model_name_of(model: Model | str) -> str:
    """The provider's name of a model, for prices and records."""
    if isinstance(model, str):
        return model.partition(":")[2] or model
    return str(getattr(model, "model_name", "") or type(model).__name__)


def provider_of(model: Model | str) -> str | None:
    """The provider id of a model (``openai``, ``anthropic``...), when known."""
    if isinstance(model, str):
        provider, sep, _ = model.partition(":")
        return provider if sep else None
    system: Any = getattr(model, "system", None)
    return str(system) if system else None
