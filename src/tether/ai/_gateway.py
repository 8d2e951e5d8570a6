"""The gateway every model call goes through: a recorded step with limits, fallbacks and costs.

``Gateway(app)`` registers one activity, ``tether.ai.call``, that runs a model
request on the worker. Each registered model (``gateway.model("fast", ...)``)
calls it with its own retry policy, timeout, queue and a shared limiter keyed by
provider, model and endpoint, so a 429's ``Retry-After`` (or an exhausted
``x-ratelimit-*`` budget) pauses every waiting call for that deployment, in every
worker. The step's result records the response and what it cost; replay reads
it back and never calls the model again.

The workflow side adds what must be decided deterministically: the budget check
before a call, the fallback chain after the primary gave up, and hedging.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import re
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from collections.abc import Set as AbstractSet
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import urlsplit

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.models import Model, ModelRequestParameters
from pydantic_ai.settings import ModelSettings

from .._activity_context import ActivityContext, NotInActivityError, activity_context
from .._errors import ActivityError, ConfigurationError, NonRetryable
from .._history import Event, EventType
from .._policy import Retry, seconds
from .._queues import MAX_NAME, Dependency, check_name
from .._serde import JsonDict
from .._usage import CALL_KEY, Budget, Spend, amount
from .._usage import budget_cost as _budget_cost
from ..workflow._api import sleep
from ..workflow._instance import WorkflowInstance, current_instance
from ._errors import BudgetExceeded, ContentRefused, ModelConfigError
from ._models import HeaderCapture, build, model_name_of, provider_of
from ._pricing import ModelPricing, lookup_pricing
from ._prompts import Prompt, Template
from ._wire import (
    canonical,
    dump_messages,
    dump_params,
    dump_response,
    is_packed,
    legacy_digest,
    link,
    load_messages,
    load_params,
    load_response,
    pack,
    stable,
)

if TYPE_CHECKING:
    from .._app import App
    from .._definitions import Activity
    from ..store.base import Store

#: model calls retry transient failures (429, 5xx, timeouts) a few times, then fall back
OutT = TypeVar("OutT")
_T = TypeVar("_T")


def schema_fingerprint(output: Any) -> str:
    """A short hash of an output type's JSON schema: equal schemas, equal fingerprints."""
    try:
        return _fingerprint_of(output)
    except TypeError:  # an unhashable type expression: not cached
        return _fingerprint_of.__wrapped__(output)


@functools.lru_cache(maxsize=256)
def _fingerprint_of(output: Any) -> str:
    schema = TypeAdapter(output).json_schema()
    canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


DEFAULT_MODEL_RETRY = Retry(
    attempts=4, initial=timedelta(seconds=1), backoff=2.0, max_interval=timedelta(seconds=30)
)
#: output tokens assumed for a call that sets no max_tokens, for the budget's estimate
DEFAULT_OUTPUT_ESTIMATE = 1024


@dataclasses.dataclass(frozen=True)
class Price:
    """A price per million tokens, for a model genai-prices does not know (or overriding it)."""

    input_per_mtok: Decimal | float | str
    output_per_mtok: Decimal | float | str
    cache_read_per_mtok: Decimal | float | str | None = None

    def __post_init__(self) -> None:
        # checked where it is written: a bad price found by a worker mid-call would
        # fail every call of the model, and a negative one would undo spend
        for name in ("input_per_mtok", "output_per_mtok", "cache_read_per_mtok"):
            value = getattr(self, name)
            if value is not None or name != "cache_read_per_mtok":
                amount(value, f"Price {name}")

    def cost(self, input_tokens: int, output_tokens: int, cache_read_tokens: int = 0) -> Decimal:
        """The exact cost of one call's tokens."""
        million = Decimal(1_000_000)
        cached = min(cache_read_tokens, input_tokens)
        read = self.cache_read_per_mtok
        read_price = Decimal(str(read if read is not None else self.input_per_mtok))
        return (
            Decimal(str(self.input_per_mtok)) * (input_tokens - cached)
            + read_price * cached
            + Decimal(str(self.output_per_mtok)) * output_tokens
        ) / million


def _checked_price(price: Any, model: str, where: str) -> Price:
    """``price`` if it is a ``Price``; else a ``ConfigurationError`` naming the model: a
    dict or a number (a price as read from a config file) would be found only after a
    call's answer, which the provider has billed, failing every call of the model."""
    if isinstance(price, Price):
        return price
    raise ConfigurationError(
        f"the price of model {model!r} in {where} must be a tether.ai.Price, got "
        f"{type(price).__name__} {price!r}: pass ai.Price(input_per_mtok=..., "
        "output_per_mtok=...) (prices per million tokens; a dict read from a file: "
        "ai.Price(**entry))"
    )


def _checked_prices(prices: Any) -> dict[str, Price]:
    """A gateway's ``prices`` table, each entry checked where it is written."""
    if prices is None:
        return {}
    if not isinstance(prices, Mapping):
        raise ConfigurationError(
            "Gateway(prices=) must be a mapping of the provider's model name to "
            f"ai.Price(input_per_mtok=..., output_per_mtok=...), got {type(prices).__name__}"
        )
    out: dict[str, Price] = {}
    for name, price in prices.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(
                f"Gateway(prices=) is keyed by the provider's model name (a string), got {name!r}"
            )
        out[name] = _checked_price(price, name, "Gateway(prices=)")
    return out


class _CallResult(JsonDict):
    """A recorded call; ``headers`` (not stored) lets the worker read x-ratelimit-*.

    Its contents are JSON values (the response dumped in JSON mode, the call record's
    numbers and strings), so the worker hands them to the workflow as they are."""

    headers: Mapping[str, str]


#: a run's model spend as its workflow code has seen it: ``WorkflowInstance.spend``
_Tally = Spend


@dataclasses.dataclass
class _Rebuilt:
    """Conversations rebuilt from a run's history: message contents and node links."""

    messages: dict[str, Any] = dataclasses.field(default_factory=dict)
    parents: dict[str, tuple[str | None, str]] = dataclasses.field(default_factory=dict)
    after: int = 0  #: the last history seq applied
    #: model steps scheduled, not yet completed: step -> node of the request
    tips: dict[int, str] = dataclasses.field(default_factory=dict)

    def apply(self, events: list[Event], activity: str) -> None:
        """Take in the model steps' arguments and answers among ``events``."""
        for ev in events:
            self.after = max(self.after, ev.seq)
            if ev.type is EventType.ACTIVITY_SCHEDULED and ev.data.get("name") == activity:
                packed = _packed_of(ev)
                if packed is not None and ev.step is not None:
                    node = packed.get("base")
                    for e in packed["new"]:
                        child = link(node, e["h"])
                        self.parents[child] = (node, e["h"])
                        if "m" in e:
                            self.messages[e["h"]] = e["m"]
                        node = child
                    self.tips[ev.step] = node or ""
            elif ev.type is EventType.ACTIVITY_COMPLETED and ev.step in self.tips:
                tip = self.tips.pop(ev.step)
                result = ev.data.get("result")
                if isinstance(result, dict) and isinstance(result.get("response"), dict):
                    digest, content = canonical(result["response"])
                    self.messages[digest] = content
                    self.parents[link(tip, digest)] = (tip or None, digest)
                    # a workflow process of the previous version refers to it by the
                    # address it gave it (the same, unless its content has a timestamp)
                    legacy = legacy_digest(result["response"])
                    if legacy != digest:
                        self.messages.setdefault(legacy, content)
                        self.parents.setdefault(link(tip, legacy), (tip or None, legacy))

    def full(self, packed: dict[str, Any]) -> list[Any] | None:
        """The full messages of a step's packed conversation (None: not all known)."""
        base: str | None = packed.get("base")
        prefix = self.thread(base) if base else []
        if prefix is None:
            return None
        inline = {e["h"]: e["m"] for e in packed["new"] if "m" in e}
        order = [*prefix, *(e["h"] for e in packed["new"])]
        if any(h not in inline and h not in self.messages for h in order):
            return None
        return [inline.get(h) or self.messages[h] for h in order]

    def thread(self, node: str) -> list[str] | None:
        """The message hashes of the conversation ending at ``node`` (None: unknown)."""
        out: list[str] = []
        current: str | None = node
        while current:
            if current not in self.parents:
                return None
            current, digest = self.parents[current]
            out.append(digest)
        return out[::-1]


@dataclasses.dataclass
class _Seen:
    """Per run: the messages and conversation nodes its steps have stored (rebuilt on
    replay, as the steps replay)."""

    messages: set[str] = dataclasses.field(default_factory=set)
    nodes: set[str] = dataclasses.field(default_factory=set)
    repinned: set[str] = dataclasses.field(default_factory=set)


_known: weakref.WeakKeyDictionary[WorkflowInstance, _Seen] = weakref.WeakKeyDictionary()


class ModelRef:
    """A model registered on a gateway; pass it to ``tether.ai.structured`` and friends."""

    def __init__(
        self,
        gateway: Gateway,
        name: str,
        spec: Model | str | Callable[[], Model],
        *,
        fallback: Sequence[ModelRef],
        activity: Activity[..., Any],
        price: Price | None,
        hedge: tuple[ModelRef, float] | None,
        output_estimate: int,
        cache_ttl: float | None = None,
        version: str | None = None,
    ) -> None:
        self.gateway = gateway
        self.cache_ttl = cache_ttl
        self.name = name
        self.spec = spec
        self.fallback = tuple(fallback)
        self.activity = activity
        self.price = price
        self.hedge = hedge
        self.output_estimate = output_estimate
        probe: Model | str | None = spec if isinstance(spec, Model | str) else None
        self.model_name = model_name_of(probe) if probe is not None else name
        self.provider = provider_of(probe) if probe is not None else None
        #: what runs started now are pinned to (a deploy that changes it does not change
        #: them): the given version, else the "provider:name" string, else the model name
        self.version = version or (spec if isinstance(spec, str) else self.model_name)

    def __repr__(self) -> str:
        return f"<tether.ai model {self.name} ({self.model_name})>"

    def estimate(
        self,
        messages_json: list[Any],
        settings: ModelSettings | None,
        params_json: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Tokens and cost this call may use: prompt and tool schemas' size / 4 plus its
        output cap."""
        tokens_in, tokens_out = self.estimated_tokens(messages_json, settings, params_json)
        cost = self.gateway.price_of(self, tokens_in, tokens_out, 0, None, None)
        return {"tokens": tokens_in + tokens_out, "cost": cost}

    def estimated_tokens(
        self,
        messages_json: list[Any],
        settings: ModelSettings | None,
        params_json: dict[str, Any] | None = None,
    ) -> tuple[int, int]:
        """(input, output) tokens a call may use: the size / 4 of its prompt and of the
        tools it sends (their JSON schemas, which providers bill as input: an output
        type's tool, an agent's tools), and its ``max_tokens`` if that is a whole number
        > 0 (else the model's ``output_estimate``)."""
        cap = (settings or {}).get("max_tokens")
        if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
            cap = self.output_estimate
        tools = [
            t
            for key in ("function_tools", "output_tools", "builtin_tools")
            for t in (params_json or {}).get(key) or ()
        ]
        size = len(json.dumps(messages_json)) + (len(json.dumps(tools)) if tools else 0)
        return math.ceil(size / 4), cap


log = logging.getLogger("tether.ai")

#: called with every new gateway, to register the activities of other modules on it
#: (they import this one, so it cannot import them)
EXTENSIONS: list[Callable[[Gateway], None]] = []

#: the longest a streamed delta waits before it is published to other processes
STREAM_FLUSH = 0.05
#: how often a streamed step asks (with a heartbeat) whether it was cancelled, in seconds
STREAM_CANCEL_CHECK = 0.5
#: publishes of a cancelled streamed step's ``failed`` under way (a strong reference)
_SENDING: set[asyncio.Future[None]] = set()


class StepCancelled(Exception):
    """A streamed step stopped because it was cancelled (its run was, or a hedge took
    the other answer): its followers get ``{"failed": "StepCancelled"}``."""


#: the most characters of streamed text in one published piece (a PostgreSQL
#: notification holds under 8,000 bytes; UTF-8 writes a character in at most four)
STREAM_PIECE = 1000


class Gateway:
    """Registers the model-call step on ``app`` and the models it may call.

    ``retry`` and ``timeout`` are the defaults of every model (per attempt);
    ``prices`` maps a provider's model name to a ``Price`` that overrides
    genai-prices. A run is pinned at its start to each model's ``version``
    (``app.get(run).attrs["pins"]``): after a deploy that changes a model, runs in
    flight keep calling the one they started with when it is a ``"provider:name"``
    string, and otherwise record the change (a ``model_repinned`` marker). With
    ``message_refs`` (the default) a step records only the
    conversation messages new to its run and refers to earlier ones by content
    hash, so a long conversation's history grows linearly, not quadratically.
    Every worker that runs model steps must build the same gateway (it does when
    it imports the module that defines it, as for any activity).
    """

    def __init__(
        self,
        app: App,
        *,
        name: str = "tether.ai",
        retry: Retry = DEFAULT_MODEL_RETRY,
        timeout: float | timedelta = 120.0,
        queue: str | None = None,
        prices: Mapping[str, Price] | None = None,
        message_refs: bool = True,
    ) -> None:
        self.app = app
        #: steps record only the messages new to their run (the rest by content hash)
        self.message_refs = message_refs
        self.name = check_name(name, "gateway name")
        self.prices = _checked_prices(prices)
        self._models: dict[str, ModelRef] = {}
        #: models whose calls may be a hedge's: each with a hedge, and each a hedge asks
        self._hedging: set[str] = set()
        #: output types registered with ``output``: type -> (name, version, fingerprint)
        self._outputs: dict[Any, tuple[str, str, str]] = {}
        self._built: dict[str, Model] = {}
        #: calls of a cached model being sent, by (event loop, cache key): a call asking
        #: the same question meanwhile waits for that answer instead of sending it again
        #: (the future's result: the answer as the cache keeps it, None if there was none)
        self._asking: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Future[str | None]] = {}
        #: prompts registered with ``prompt``, by name
        self._prompts: dict[str, Prompt] = {}
        #: followers of streamed output, per run: (their loop, their queue)
        self._followers: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]]] = {}
        self._followers_lock = threading.Lock()
        #: per run, its conversations as rebuilt from history (most recently used last)
        self._threads: dict[str, _Rebuilt] = {}
        #: the scopes that have a daily budget, re-read every few seconds
        self._budget_scopes: set[str] = set()
        self._budgets_read_at = 0.0
        #: genai-prices' price of (model, provider), looked up once an hour (None:
        #: unknown): a price the library dates (a price change announced ahead) is
        #: taken up within the hour of its start in a long-lived worker
        self._price_table: dict[tuple[str, str | None], ModelPricing | None] = {}
        self._price_hour = _hour()
        app._pin_sources[name] = self._pins
        self._activity = app.activity(
            name=f"{name}.call", retry=retry, timeout=timeout, queue=queue
        )(self._call)
        # a model step replays what its history recorded, not what today's code would
        # send (a reworded prompt): its request is not compared with the recorded one
        self._activity.replay_unchecked = frozenset(self._activity.sig.sig.parameters)
        #: what other modules registered on this gateway (``EXTENSIONS``), by name
        self.extensions: dict[str, Any] = {}
        for extend in EXTENSIONS:  # e.g. the batch activities (``_batch.py``)
            extend(self)

    # registration -----------------------------------------------------------

    def model(
        self,
        name: str,
        model: Model | str | Callable[[], Model],
        *,
        fallback: Sequence[ModelRef] = (),
        retry: Retry | None = None,
        timeout: float | timedelta | None = None,
        queue: str | None = None,
        max_concurrency: int | None = None,
        rate: float | None = None,
        per: float | timedelta = 60.0,
        price: Price | None = None,
        hedge: tuple[ModelRef, float | timedelta] | None = None,
        output_estimate: int = DEFAULT_OUTPUT_ESTIMATE,
        cache_ttl: float | timedelta | None = None,
        version: str | None = None,
        limiter: str | None = None,
    ) -> ModelRef:
        """Register ``model`` as ``name``: a pydantic-ai ``Model``, ``"provider:name"``, or a
        function building one on the worker (so API keys are read there, never recorded).

        ``fallback`` models are tried in order once this one's retries are spent;
        ``max_concurrency`` and ``rate`` per ``per`` seconds bound calls across all
        workers (429s pause the same limiter). There is one limiter per deployment:
        provider, model and endpoint (a ``Model``'s ``base_url``), so the same model in
        another region is not paused by this one's 429; ``limiter`` names one that the
        registrations giving the same name share instead. ``hedge=(other, seconds)`` also asks
        ``other`` when this one has not answered within ``seconds``, taking the
        first answer. ``cache_ttl`` keeps answers in the store for that long and
        answers the same request (model, messages, tools, parameters, output type)
        from there, in any run: for deterministic prompts (temperature 0) only.
        ``version`` names what runs are pinned to (see ``Gateway``).
        """
        check_name(name, "model name")  # it names the model in records, metrics and the CLI
        if name in self._models:
            raise ConfigurationError(f"model {name!r} is already registered on this gateway")
        if price is not None:
            price = _checked_price(price, name, "model(price=)")
        if not (isinstance(model, Model | str) or callable(model)):
            raise ConfigurationError(
                f"model {name!r}: pass a pydantic-ai Model, a 'provider:name' string or a "
                f"function returning a Model (got {type(model).__name__})"
            )
        for other in (*fallback, *(hedge[:1] if hedge else ())):
            if not isinstance(other, ModelRef) or other.gateway is not self:
                raise ConfigurationError(
                    f"fallback and hedge models of {name!r} must be models of this gateway "
                    f"(gateway.model(...)), got {other!r}"
                )
        if limiter is not None:
            key = check_name(limiter, f"limiter of model {name!r}")
        else:
            key = _deployment_key(model, name)
        dependency = Dependency(
            "model", key=key, max_concurrency=max_concurrency, rate=rate, per=per
        )
        activity = self._activity.options(
            retry=retry, timeout=timeout, queue=queue, dependency=dependency
        )
        hedge_pair = None
        if hedge is not None:
            after = seconds(hedge[1], f"hedge delay of model {name!r}")
            if not after:
                raise ConfigurationError(f"hedge delay of model {name!r} must be positive")
            hedge_pair = (hedge[0], after)
        if (
            isinstance(output_estimate, bool)
            or not isinstance(output_estimate, int)
            or output_estimate <= 0
        ):
            # a budget's estimate of a call without max_tokens: zero would let any call in
            raise ConfigurationError(
                f"output_estimate of model {name!r} must be a whole number of tokens > 0 "
                f"(got {output_estimate!r})"
            )
        ttl = seconds(cache_ttl, f"cache_ttl of model {name!r}")
        if ttl is not None and not ttl:
            raise ConfigurationError(f"cache_ttl of model {name!r} must be positive")
        ref = ModelRef(
            self,
            name,
            model,
            fallback=fallback,
            activity=activity,
            price=price,
            hedge=hedge_pair,
            output_estimate=output_estimate,
            cache_ttl=ttl,
            version=version,
        )
        self._models[name] = ref
        if hedge_pair is not None:  # calls of either may be a hedge's (see _hedged_model)
            self._hedging.update((name, hedge_pair[0].name))
        return ref

    def prompt(
        self, name: str, versions: Mapping[str, Template], *, current: str | None = None
    ) -> Prompt:
        """Register a prompt's versions (``str.format`` templates or functions returning
        the text); ``current`` (default: the last) is what runs started now are pinned
        to. In a workflow, ``prompt.render(**values)`` gives the run's own version, and
        ``ai.complete``/``ai.structured`` record ``name@version`` on the call."""
        if name in self._prompts:
            raise ConfigurationError(f"prompt {name!r} is already registered on this gateway")
        made = Prompt(name, versions, current, lambda inst: _run_pins(inst, self.name), _note_repin)
        self._prompts[name] = made
        self.app._prompt_versions[name] = made.versions
        return made

    def output(self, output: OutT, *, name: str | None = None, version: str | None = None) -> OutT:
        """Register an output type of ``ai.structured`` so runs are pinned to its schema.

        A run started now records the type's ``version`` (default: a fingerprint of its
        JSON schema) in its pins; when a later deploy changes the schema under a run in
        flight, the run's next structured step records ``output_schema_repinned`` (the
        change is visible, not silent). Every call record names the schema it used
        (``output_schema``: ``name@version``). Returns ``output`` unchanged."""
        fingerprint = schema_fingerprint(output)
        label = name or getattr(output, "__qualname__", None) or repr(output)
        taken = {n for n, _v, _f in self._outputs.values()}
        if label in taken and self._outputs.get(output, ("",))[0] != label:
            raise ConfigurationError(
                f"output schema name {label!r} is registered twice on gateway {self.name!r}: "
                "give one of them name="
            )
        self._outputs[output] = (label, version or fingerprint, fingerprint)
        return output

    def output_pin(self, output: Any) -> tuple[str, str, str]:
        """(name, version, fingerprint) of an output type: as registered, or by its schema."""
        known = self._outputs.get(output)
        if known is not None:
            return known
        fingerprint = schema_fingerprint(output)
        label = getattr(output, "__qualname__", None) or repr(output)
        return label, fingerprint, fingerprint

    def _pins(self) -> dict[str, Any]:
        """What a run started now is pinned to: each model's version (and its
        ``"provider:name"`` when it has one, so a later deploy can still build it), each
        prompt's current version, and each registered output type's schema version."""
        pins: dict[str, Any] = {
            "models": {
                name: {
                    "version": ref.version,
                    "spec": ref.spec if isinstance(ref.spec, str) else None,
                }
                for name, ref in self._models.items()
            }
        }
        if self._prompts:
            pins["prompts"] = {name: p.current for name, p in self._prompts.items()}
        if self._outputs:
            pins["outputs"] = {
                label: {"version": version, "fingerprint": fingerprint}
                for label, version, fingerprint in self._outputs.values()
            }
        return pins

    def price_of(
        self,
        ref: ModelRef,
        tokens_in: int,
        tokens_out: int,
        cache_read: int,
        model_name: str | None,
        provider: str | None,
    ) -> str | None:
        """The cost of tokens on ``ref`` as a decimal string (None: no price known).

        ``model_name`` and ``provider`` are what the answer names, which a proxy
        (LiteLLM, vLLM, Azure) sets to the upstream model: the model's own ``price=``
        comes first, then the gateway's ``prices`` by the answer's name and by the
        registered name, then genai-prices by the answer's name and by the registered
        name. The estimate before the call is priced by the registered name, so an
        answer found under another name is priced as its estimate was."""
        name = model_name or ref.model_name
        price = ref.price or self.prices.get(name) or self.prices.get(ref.model_name)
        if price is not None:
            return str(price.cost(tokens_in, tokens_out, cache_read))
        hour = _hour()
        if hour != self._price_hour:
            self._price_table = {}
            self._price_hour = hour
        table = self._price_table  # one table throughout, even if the hour turns meanwhile
        pricing = None
        for key in dict.fromkeys(
            ((name, provider or ref.provider), (ref.model_name, ref.provider))
        ):
            if key not in table:
                table[key] = lookup_pricing(*key)
            pricing = table[key]
            if pricing is not None:
                break
        if pricing is None:  # unknown model or provider: the call is recorded unpriced
            return None
        return str(pricing.cost(tokens_in, tokens_out, cache_read))

    def answer_cost(
        self,
        ref: ModelRef,
        tokens_in: int,
        tokens_out: int,
        cache_read: int,
        model_name: str | None,
        provider: str | None,
    ) -> tuple[str | None, str | None]:
        """``price_of`` an answer the provider has given (and billed), and why it has no
        cost when pricing it failed: the answer is recorded unpriced, never thrown away
        (a retry would be billed again and fail the same way)."""
        try:
            return self.price_of(ref, tokens_in, tokens_out, cache_read, model_name, provider), None
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"[:500]
            log.warning(
                "model %r: the answer could not be priced (%s); recorded unpriced", ref.name, why
            )
            return None, why

    # the step (worker side) -----------------------------------------------------

    def _resolve(self, ref: ModelRef) -> Model:
        built = self._built.get(ref.name)
        if built is None:
            spec = ref.spec
            if isinstance(spec, Model):
                built = spec
            elif isinstance(spec, str):
                built = build(spec)
            else:
                try:
                    built = spec()
                except NonRetryable:
                    raise
                except Exception as exc:
                    raise ModelConfigError(
                        f"the factory of model {ref.name!r} failed: {type(exc).__name__}: {exc}"
                    ) from None
            self._built[ref.name] = built
        return built

    def _resolve_spec(self, spec: str) -> Model:
        """A model a run was pinned to by its ``"provider:name"`` (built once per worker)."""
        key = f"spec:{spec}"
        if key not in self._built:
            self._built[key] = build(spec)
        return self._built[key]

    async def _call(self, model: str, request: dict[str, Any]) -> dict[str, Any]:
        """Run one model request; its result is recorded (the response and its cost)."""
        ref = self._models.get(model)
        if ref is None:
            raise ModelConfigError(
                f"model {model!r} is not registered on gateway {self.name!r} in this worker "
                f"(known: {', '.join(sorted(self._models)) or 'none'}); register it with "
                "gateway.model(...) in the module the worker imports"
            )
        if is_packed(request["messages"]):
            request = {**request, "messages": await self._unpack(request["messages"])}
        cache_key = _cache_key(ref, request) if ref.cache_ttl else None
        if cache_key is None:
            return await self._ask(ref, request, None)
        loop = asyncio.get_running_loop()
        while True:
            hit = await self._step_store().ai_cache_get(cache_key)
            if hit is not None:
                return await self._cached(ref, request, hit)
            asking = self._asking.get((loop, cache_key))
            if asking is None:
                break
            # the same question is being asked in this process: its answer, once it
            # comes, is this call's too (a cached one); if it fails, ask again
            answer = await asyncio.shield(asking)
            if answer is not None:
                return await self._cached(ref, request, answer)
        asking = loop.create_future()
        self._asking[(loop, cache_key)] = asking
        answered: list[str] = []
        try:
            return await self._ask(ref, request, cache_key, answered)
        finally:
            del self._asking[(loop, cache_key)]
            asking.set_result(answered[0] if answered else None)

    async def _cached(self, ref: ModelRef, request: dict[str, Any], hit: str) -> dict[str, Any]:
        """A call answered by ``hit`` (an answer as the cache keeps it)."""
        cached: dict[str, Any] = json.loads(hit)
        cached[CALL_KEY] = {**cached[CALL_KEY], "cache_hit": True}
        if request.get("stream"):
            await self._stream_cached(ref, cached["response"])
        return cached

    async def _ask(
        self,
        ref: ModelRef,
        request: dict[str, Any],
        cache_key: str | None,
        answered: list[str] | None = None,
    ) -> dict[str, Any]:
        """Send a call the cache did not answer, within the daily budgets."""
        if request.get("cache_only") is not None:
            # over the run's budget unless the cache had it: refused, nothing sent (an
            # answer, not a failure: a budget's refusal is no dead letter)
            return {CACHE_MISS_KEY: request["cache_only"]}
        scopes, request, reserved = await self._check_daily_budgets(ref, request)
        try:
            return await self._send(ref, request, cache_key, scopes, reserved, answered)
        except BaseException:
            await self.give_back_daily(scopes, reserved)  # no answer: the estimate held
            raise

    async def _send(
        self,
        ref: ModelRef,
        request: dict[str, Any],
        cache_key: str | None,
        scopes: tuple[str, ...],
        reserved: dict[str, Any],
        answered: list[str] | None = None,
    ) -> dict[str, Any]:
        """Send a call the daily budgets let through; its answer's usage replaces the
        estimate it ``reserved`` in the day's spend of ``scopes``."""
        from pydantic_ai.direct import model_request

        pinned: str | None = request.get("spec")
        built = self._resolve_spec(pinned) if pinned else self._resolve(ref)
        messages = load_messages(request["messages"])
        params = load_params(request["params"])
        settings: ModelSettings | None = request.get("settings")
        try:
            ctx: ActivityContext | None = activity_context()
        except NotInActivityError:
            ctx = None
        attempt, key = (ctx.attempt, ctx.idempotency_key) if ctx is not None else (1, None)
        if key is not None:
            # the same on every attempt and redelivery of this step: a provider (or a proxy)
            # that honours it can answer a repeat after a crash without doing the work twice
            headers = {**(settings or {}).get("extra_headers", {}), "Idempotency-Key": key}
            settings = cast(ModelSettings, {**(settings or {}), "extra_headers": headers})
        started = time.perf_counter()
        with HeaderCapture() as cap:
            try:
                if request.get("stream"):
                    response = await self._streamed(ref, built, messages, settings, params)
                else:
                    asked = model_request(
                        built,
                        messages,
                        model_settings=settings,
                        model_request_parameters=params,
                        instrument=False,
                    )
                    response = await (_watched(ref, asked) if self._hedged_model(ref) else asked)
            except asyncio.CancelledError as exc:
                if ctx is not None and ctx._timeout_note is None:
                    # what is recorded of a timeout names the model and what to do
                    kind, why = _interrupted(ref, ctx, exc, "it waited for the answer")
                    if kind == "TimeoutError":
                        ctx._timeout_note = why
                raise
            except Exception as exc:
                mapped = _classified(ref, exc)
                if mapped is exc:
                    raise
                raise mapped from exc
        latency = time.perf_counter() - started
        # a filtered answer is refused even when some text came before the filter cut it
        # (Anthropic's "refusal" stop reason may carry a partial reply)
        if response.finish_reason == "content_filter":
            raise ContentRefused(
                f"model {ref.name!r} ({ref.model_name}) refused the request on content policy; "
                "retrying would get the same answer: change the input or route it to a human"
            )
        tokens_in, tokens_out, cache_read, reported = _usage(ref, request, settings, response)
        call = {
            "model": ref.name,
            "model_name": response.model_name or ref.model_name,
            "provider": response.provider_name or ref.provider,
            "input_tokens": tokens_in,
            "output_tokens": tokens_out,
            "cache_read_tokens": cache_read,
            "cost": None,
            "latency_ms": round(latency * 1000, 3),
            "finish_reason": response.finish_reason,
            "attempt": attempt,
            "prompt_version": request.get("prompt_version"),
        }
        call["cost"], price_error = self.answer_cost(
            ref, tokens_in, tokens_out, cache_read, response.model_name, response.provider_name
        )
        if price_error is not None:
            call["price_error"] = price_error
        if reported is not None:
            call["usage"] = "estimated"
            call["reported_usage"] = reported
        estimate = request.get("estimate") or {}
        if call["cost"] is None and estimate.get("cost") is not None:
            # no price for the answer, though its estimate had one: it is not free. It
            # counts at its estimate against the run's and the day's cost budgets (and
            # stays unpriced in usage, whose cost is what prices say)
            call["estimated_cost"] = str(estimate["cost"])
        if request.get("output_schema"):
            call["output_schema"] = request["output_schema"]
        if pinned and pinned != ref.spec:
            call["pinned"] = pinned
        out = _CallResult({"response": dump_response(response), CALL_KEY: call})
        out.headers = cap.headers
        # as the cache keeps it; paid: waiters get it even if this step is cancelled now
        kept = json.dumps(out) if cache_key is not None else None
        if answered is not None and kept is not None:
            answered.append(kept)
        # the answer is paid for: what is written about it from here on must not fail
        # the step, whose retry would buy it again
        if scopes:
            await self._correct_daily(ref, scopes, reserved, tokens_in + tokens_out, call)
        reserved.clear()
        if cache_key is not None and kept is not None:
            try:
                await self._step_store().ai_cache_put(cache_key, kept, ref.cache_ttl or 0.0)
            except Exception as exc:
                log.warning(
                    "model %r: its answer was not kept in the answer cache (%s: %s); the "
                    "step goes on with it, a later identical call asks the model again",
                    ref.name,
                    type(exc).__name__,
                    exc,
                )
        return out

    async def _correct_daily(
        self,
        ref: ModelRef,
        scopes: tuple[str, ...],
        reserved: dict[str, Any],
        tokens: int,
        call: dict[str, Any],
    ) -> None:
        """Put what an answered call used in place of the estimate it ``reserved`` in
        today's spend of ``scopes``. It is written even when the step is cancelled
        meanwhile; when the write fails the estimate stays there (said in the log) and
        the step keeps its answer."""
        held_tokens, held_cost = reserved.pop("tokens", 0), reserved.pop("cost", Decimal(0))
        correcting = asyncio.ensure_future(
            self.add_daily_spend(
                scopes, tokens - held_tokens, _budget_cost(call) - held_cost, dict(reserved)
            )
        )
        _SENDING.add(correcting)
        correcting.add_done_callback(_SENDING.discard)

        def said(done: asyncio.Future[None]) -> None:
            # here, not at the await: a step cancelled meanwhile no longer awaits it
            exc = None if done.cancelled() else done.exception()
            if exc is not None:
                log.warning(
                    "model %r: today's spend of %s keeps this call's estimate (%s tokens) "
                    "in place of what it used (%s tokens): writing it failed (%s: %s)",
                    ref.name,
                    ", ".join(scopes),
                    held_tokens,
                    tokens,
                    type(exc).__name__,
                    exc,
                )

        correcting.add_done_callback(said)
        with contextlib.suppress(Exception):  # said above; the answer stands
            await asyncio.shield(correcting)

    def _hedged_model(self, ref: ModelRef) -> bool:
        """Whether calls of ``ref`` may be a hedge's (its own hedge's, or another
        model's hedge asking it): a loser must stop soon after the other answered."""
        return ref.name in self._hedging

    async def _streamed(
        self,
        ref: ModelRef,
        built: Model,
        messages: list[ModelMessage],
        settings: ModelSettings | None,
        params: ModelRequestParameters,
    ) -> ModelResponse:
        """A streamed request: text deltas go to the run's followers as they arrive;
        only the final answer is returned (and recorded)."""
        from pydantic_ai.direct import model_request_stream
        from pydantic_ai.messages import PartDeltaEvent, PartStartEvent, TextPart, TextPartDelta

        where = _stream_where(ref)
        run_id = where["run_id"]
        # other processes (an SSE stream of tether serve) hear through the store, in
        # pieces of at most STREAM_FLUSH seconds' text (and STREAM_PIECE characters, to
        # fit a notification): one notification per piece. ``offset`` is where a delta
        # starts in this attempt's text, so a follower can tell a gap from a restart
        store = self._step_store()
        clock = asyncio.get_running_loop().time
        pending, flushed, sent, heard = "", clock(), 0, 0
        try:
            ctx: ActivityContext | None = activity_context()
        except NotInActivityError:
            ctx = None
        checked = clock()

        async def flush() -> None:
            nonlocal pending, sent
            while pending:
                piece, pending = pending[:STREAM_PIECE], pending[STREAM_PIECE:]
                await self._broadcast(store, run_id, {**where, "offset": sent, "delta": piece})
                sent += len(piece)

        try:
            async with model_request_stream(
                built,
                messages,
                model_settings=settings,
                model_request_parameters=params,
                instrument=False,
            ) as stream:
                async for event in stream:
                    text = None
                    if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
                        text = event.part.content
                    elif isinstance(event, PartDeltaEvent) and isinstance(
                        event.delta, TextPartDelta
                    ):
                        text = event.delta.content_delta
                    if ctx is not None and clock() - checked >= STREAM_CANCEL_CHECK:
                        # the step may have been cancelled (a hedge took the other
                        # answer, the run was cancelled): the heartbeat's answer says so,
                        # and its text then ends as failed, not done
                        checked = clock()
                        ctx.heartbeat()
                    if ctx is not None and ctx.is_cancelled:
                        raise StepCancelled(
                            f"model {ref.name!r}: the step was cancelled while it streamed "
                            "(its run was cancelled, or a hedge took the other answer)"
                        )
                    if text and run_id is not None:
                        self._publish(run_id, {**where, "offset": heard, "delta": text})
                        heard += len(text)
                        pending += text
                        if clock() - flushed >= STREAM_FLUSH or len(pending) >= STREAM_PIECE:
                            await flush()
                            flushed = clock()
                response = stream.get()
        except BaseException as exc:
            if run_id is not None:
                # this attempt's text is void: a follower drops what it showed of it (a
                # worker killed outright says nothing; the next attempt's number does).
                # A task cancelled says why, as its worker knows it: the step was
                # cancelled (a hedge's loser, a step of a run cancelled: its worker
                # cancels its task at once, or at its lease renewal), as the heartbeat's
                # check would have said; its timeout ran out; its worker stopped
                doing = f"it streamed its answer ({heard} characters so far)"
                kind, why = _interrupted(ref, ctx, exc, doing)
                if kind == "TimeoutError" and ctx is not None:
                    ctx._timeout_note = why  # recorded as the attempt's error
                failed = {**where, "failed": kind, "error": why}
                self._publish(run_id, failed)
                if isinstance(exc, asyncio.CancelledError):
                    # the task is cancelled: its publish runs on even if it is cancelled
                    # again meanwhile (which stops only this wait)
                    sending = asyncio.ensure_future(self._broadcast(store, run_id, failed))
                    _SENDING.add(sending)
                    sending.add_done_callback(_SENDING.discard)
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(sending)
                else:
                    await self._broadcast(store, run_id, failed)
            raise
        if run_id is not None:
            await flush()
            self._publish(run_id, {**where, "done": True})
            await self._broadcast(store, run_id, {**where, "done": True})
        return response

    async def _stream_cached(self, ref: ModelRef, response: dict[str, Any]) -> None:
        """A streamed step answered from the answer cache: its followers get the whole
        text as one delta at offset 0 (in pieces of ``STREAM_PIECE`` characters to other
        processes), then ``done``, as if the model had sent it in one chunk."""
        where = _stream_where(ref)
        run_id = where["run_id"]
        if run_id is None:
            return
        text = load_response(response).text or ""
        store = self._step_store()
        if text:
            self._publish(run_id, {**where, "offset": 0, "delta": text})
        for start in range(0, len(text), STREAM_PIECE):
            piece = text[start : start + STREAM_PIECE]
            await self._broadcast(store, run_id, {**where, "offset": start, "delta": piece})
        self._publish(run_id, {**where, "done": True})
        await self._broadcast(store, run_id, {**where, "done": True})

    @staticmethod
    async def _broadcast(store: Store, run_id: str, item: dict[str, Any]) -> None:
        """Publish through the store; a failure loses only this ephemeral piece."""
        try:
            await store.publish(run_id, item)
        except Exception:  # the answer is still recorded; followers miss a piece
            log.warning("could not publish a streamed piece of run %s", run_id, exc_info=True)

    def _publish(self, run_id: str, item: dict[str, Any]) -> None:
        with self._followers_lock:
            followers = list(self._followers.get(run_id, ()))
        for loop, queue in followers:
            loop.call_soon_threadsafe(queue.put_nowait, item)

    async def follow(self, run_id: str) -> AsyncIterator[dict[str, Any]]:
        """The streamed output of ``run_id``'s model steps, as it is produced, in this
        process: ``{"run_id", "step", "model", "attempt", "offset", "delta": text}``
        items, ``{"failed": error type, "error": what happened, "attempt": n, ...}``
        when an attempt dies (its text is void: show the latest attempt's;
        ``TimeoutError``, ``WorkerStopped`` and ``StepCancelled`` when its timeout ran
        out, its worker stopped or it was cancelled), and ``{"done": True, ...}`` when a
        step's answer is complete.

        What a worker of this process streams (``stream=True``) from when you start
        following: a step under way streams on from there (its first ``offset`` says
        what was missed); recorded answers are never streamed again (a resumed run
        replays them silently). Stop by breaking out of the loop.
        """
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        entry = (asyncio.get_running_loop(), queue)
        with self._followers_lock:
            self._followers.setdefault(run_id, []).append(entry)
        try:
            while True:
                yield await queue.get()
        finally:
            with self._followers_lock:
                subs = self._followers.get(run_id, [])
                if entry in subs:
                    subs.remove(entry)
                if not subs:
                    self._followers.pop(run_id, None)

    def _step_store(self) -> Store:
        """The store of the worker running this step (the App's outside a step): a
        worker may serve a copy of the App (``tether.testing.evaluate`` does)."""
        try:
            store = activity_context()._store
        except NotInActivityError:
            store = None
        return store if store is not None else self.app.store

    async def _unpack(self, packed: dict[str, Any]) -> list[dict[str, Any]]:
        """Full messages from ``pack`` form.

        Everything a step refers to is in its run's history: the messages earlier
        steps sent in full (their arguments) and the answers they got (their
        results). The worker rebuilds the run's conversations from history once and
        then reads only the events recorded since, so this costs no write at all.
        """
        base: str | None = packed.get("base")
        new: list[dict[str, Any]] = packed["new"]
        if base is None and all("m" in e for e in new):
            return [e["m"] for e in new]  # all of it is here: no history to read
        full = (await self._conversations()).full(packed)
        if full is None:
            raise NonRetryable(
                f"a conversation this step refers to is not in its run's history (node {base}, "
                "messages missing): was the history changed by hand?"
            )
        return full

    async def _conversations(self) -> _Rebuilt:
        """This run's conversations as its history holds them (cached per run, updated
        with the events recorded since the last step)."""
        try:
            run_id = activity_context().run_id
        except NotInActivityError:
            return _Rebuilt()
        known = self._threads.pop(run_id, None) or _Rebuilt()
        self._threads[run_id] = known  # most recently used last
        while len(self._threads) > _THREADS_CACHED:
            self._threads.pop(next(iter(self._threads)))
        history = await self._step_store().read_history(run_id, known.after)
        known.apply(history, self._activity.name)
        return known

    # daily budgets (worker side: they are shared by every run of a tenant) -------------

    async def set_budget(
        self,
        *,
        tenant: str | None = None,
        tokens: int | None = None,
        cost: Decimal | float | str | None = None,
    ) -> None:
        """Set the daily model budget (UTC day) of ``tenant``, or the global one without it.

        Shared by every worker (it lives in the store); neither ``tokens`` nor ``cost``
        removes it. A call whose estimate would go over raises ``BudgetExceeded`` in
        the workflow before it is sent; raising the budget lets the next call through.
        Today's spend starts from what the usage ledger recorded today for the scope
        (other workers count calls against a new scope once they re-read the list, within
        ``_BUDGETS_TTL`` seconds).
        """
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ConfigurationError(f"tenant must be a non-empty string (got {tenant!r})")
        checked = Budget(tokens=tokens, cost=cost) if (tokens, cost) != (None, None) else None
        await self.app.store.set_model_budget(
            f"tenant:{tenant}" if tenant is not None else "global",
            checked.tokens if checked else None,
            None if checked is None or checked.cost is None else str(checked.cost),
        )
        self._budgets_read_at = 0.0

    async def budgets(self) -> list[dict[str, Any]]:
        """Every daily budget with today's spend: scope, limits, tokens and cost spent."""
        rows = await self.app.store.model_budgets(_day(self.app.store.clock()))
        return [
            {
                "scope": scope,
                "tokens": tokens,
                "cost": cost,
                "spent_tokens": int(spent_tokens or 0),
                "spent_cost": str(spent_cost or "0"),
            }
            for scope, tokens, cost, spent_tokens, spent_cost in rows
        ]

    async def daily_scopes(
        self, tenant: str | None
    ) -> tuple[tuple[str, ...], list[dict[str, Any]] | None]:
        """The scopes with a daily budget a call of ``tenant`` counts against, and the
        budgets when this read them (the list of scopes is re-read every few seconds)."""
        now = self.app.store.clock()
        rows: list[dict[str, Any]] | None = None
        if now - self._budgets_read_at > _BUDGETS_TTL:
            rows = await self.budgets()
            self._budget_scopes = {b["scope"] for b in rows}
            self._budgets_read_at = now
        known = self._budget_scopes
        if not known:  # no daily budget at all (the usual case)
            return (), rows
        scopes = tuple(s for s in (f"tenant:{tenant}" if tenant else None, "global") if s in known)
        return scopes, rows

    async def add_daily_spend(
        self,
        scopes: tuple[str, ...],
        tokens: int,
        cost: Decimal,
        reserved: dict[str, Any] | None = None,
    ) -> None:
        """Add what a call (or a batch) used to today's spend of ``scopes`` (to the day
        its estimate was ``reserved`` in, when it was)."""
        if scopes:
            store = self._step_store()
            day = (reserved or {}).get("day") or _day(store.clock())
            await store.add_model_spend(scopes, day, tokens, str(cost))

    async def give_back_daily(self, scopes: tuple[str, ...], reserved: dict[str, Any]) -> None:
        """Give back what ``reserve_daily`` held (work that ends without an answer), even
        when the step is cancelled meanwhile; a failure to write it is not raised."""
        if "tokens" not in reserved:
            return
        giving = asyncio.ensure_future(
            self.add_daily_spend(scopes, -reserved["tokens"], -reserved["cost"], reserved)
        )
        _SENDING.add(giving)
        giving.add_done_callback(_SENDING.discard)
        with contextlib.suppress(Exception):
            await asyncio.shield(giving)

    async def _check_daily_budgets(
        self, ref: ModelRef, request: dict[str, Any]
    ) -> tuple[tuple[str, ...], dict[str, Any], dict[str, Any]]:
        """The scopes with a daily budget this call counts against, the request (with
        the estimate the check used) and what it reserved of their spend (day, tokens,
        cost: empty when nothing); raise when one has no room for it."""
        sent = request.get("estimate")
        if not sent:
            # a run without a tenant and without a budget of its own sends none: the call
            # is estimated here, for the global daily budget (an unknown size is no pass)
            scopes, _rows = await self.daily_scopes(request.get("tenant"))
            if not scopes:
                return (), request, {}
            sent = ref.estimate(request["messages"], request.get("settings"), request.get("params"))
            request = {**request, "estimate": sent}
        scopes, reserved = await self.reserve_daily(request.get("tenant"), sent)
        return scopes, request, reserved

    async def reserve_daily(
        self, tenant: str | None, estimate: dict[str, Any]
    ) -> tuple[tuple[str, ...], dict[str, Any]]:
        """Hold ``estimate`` in today's spend of ``tenant``'s scopes with a daily budget
        (checked and added in one store transaction, so calls at the same moment cannot
        pass a budget together); ``DailyBudgetExceeded`` when it has no room. Returns
        the scopes and what was reserved (to correct to what the call used)."""
        scopes, _rows = await self.daily_scopes(tenant)
        if not scopes:
            return (), {}
        store = self._step_store()
        day = _day(store.clock())
        tokens = int(estimate.get("tokens") or 0)
        cost = estimate.get("cost")
        reserving = asyncio.ensure_future(
            store.reserve_model_spend(scopes, day, tokens, None if cost is None else str(cost))
        )
        try:
            over = await asyncio.shield(reserving)
        except asyncio.CancelledError:
            # cancelled while the store may still commit it: what it reserves then is
            # given back, as a call that ends without an answer gives back its estimate
            held = Decimal(cost or 0)
            back: dict[str, Any] = {"day": day, "tokens": tokens, "cost": held}

            def give_back(done: asyncio.Future[Any]) -> None:
                if done.cancelled() or done.exception() is not None or done.result():
                    return
                giving = asyncio.ensure_future(self.add_daily_spend(scopes, -tokens, -held, back))
                _SENDING.add(giving)
                giving.add_done_callback(_SENDING.discard)

            reserving.add_done_callback(give_back)
            raise
        if over is not None:
            raise daily_over(over, estimate)
        return scopes, {"day": day, "tokens": tokens, "cost": Decimal(cost or 0)}

    # the call (workflow side) -------------------------------------------------------

    async def request(
        self,
        ref: ModelRef,
        messages: list[ModelMessage],
        *,
        params: ModelRequestParameters | None = None,
        settings: ModelSettings | None = None,
        prompt_version: str | None = None,
        output_schema: str | None = None,
        stream: bool = False,
    ) -> tuple[ModelResponse, dict[str, Any]]:
        """One model request as a recorded step: budget check, fallbacks, hedging.

        With ``stream`` the answer's text goes to the run's followers as it arrives
        (``gateway.follow``); the recorded result is the same final answer.

        Returns the response and its call record (model, tokens, cost...).
        """
        answer, call = await self._request_json(
            ref,
            messages,
            params=params,
            settings=settings,
            prompt_version=prompt_version,
            output_schema=output_schema,
            stream=stream,
        )
        return load_response(answer), call

    async def _request_json(
        self,
        ref: ModelRef,
        messages: list[ModelMessage],
        *,
        params: ModelRequestParameters | None = None,
        params_json: dict[str, Any] | None = None,
        settings: ModelSettings | None = None,
        prompt_version: str | None = None,
        output_schema: str | None = None,
        stream: bool = False,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``request``, its response left as recorded (JSON): for a caller that reads
        only part of it (``complete`` its text), without building the whole object.
        ``params_json``: ``dump_params(params)`` made already (a structured step's,
        made once per output type), never changed here."""
        if ref.gateway is not self:
            raise ConfigurationError(f"{ref!r} is a model of another gateway")
        if settings:
            _refuse_recorded_credentials(ref, settings)
        body: dict[str, Any] = {
            "messages": dump_messages(messages),
            "params": dump_params(params) if params_json is None else params_json,
            "settings": dict(settings) if settings else None,
        }
        if prompt_version is not None:
            body["prompt_version"] = prompt_version
        if output_schema is not None:
            body["output_schema"] = output_schema
        if stream:
            body["stream"] = True
        chain = (ref, *ref.fallback)
        current = ref
        while True:
            try:
                out = await self._hedged(current, body, settings)
            except ActivityError as exc:
                if exc.error_type in _NO_FALLBACK:
                    raise
                inst = current_instance()
                following = self._fallback_of(inst, chain, current)
                if following is None:
                    raise
                if inst is not None:
                    inst.record(
                        "model_fallback",
                        {
                            "from": current.name,
                            "to": following.name,
                            "error": f"{exc.error_type}: {exc.message}"[:500],
                        },
                    )
                current = following
                continue
            return out["response"], out[CALL_KEY]

    def _fallback_of(
        self, inst: WorkflowInstance | None, chain: tuple[ModelRef, ...], current: ModelRef
    ) -> ModelRef | None:
        """The model to fall back to after ``current`` gave up (None: none, raise).

        A fallback this run recorded already is followed to the model it went to, and
        one it did not take is not taken, whatever this deploy's chain says (a deploy
        that changes the chain must not change what a run in flight replays); a new
        decision follows this deploy's chain."""
        recorded = inst.recorded_next() if inst is not None else None
        if inst is not None and recorded is not None:
            if recorded.type is not EventType.MARKER or recorded.data.get("marker") != (
                "model_fallback"
            ):
                return None  # the run gave up here then: it does now
            value = recorded.data.get("value")
            to = value.get("to") if isinstance(value, dict) else None
            if isinstance(to, str):
                model = self._models.get(to)
                if model is None:
                    inst.diverge(
                        f"Marker('model_fallback') from model {current.name!r} to {to!r}",
                        f"no model {to!r} on gateway {self.name!r} (this deploy removed it): "
                        f"register {to!r} again (gateway.model) so runs that fell back to it "
                        "can replay",
                        names_only=True,  # model and gateway names the engine recorded
                    )
                return model
        position = next((i for i, m in enumerate(chain) if m is current), len(chain) - 1)
        return chain[position + 1] if position + 1 < len(chain) else None

    async def _hedged(
        self, ref: ModelRef, body: dict[str, Any], settings: ModelSettings | None
    ) -> dict[str, Any]:
        """One model's call, hedged when the model has ``hedge=``: the hedge's timer is
        the call's first command. A call the run recorded already replays hedged or not
        as it ran (its history has the timer or not), whatever this deploy says."""
        inst = current_instance()
        if inst is None:
            return await self._one(ref, body, settings)
        recorded = inst.recorded_next()
        partner: ModelRef | None
        if recorded is not None:
            if recorded.type is not EventType.TIMER_STARTED:
                return await self._one(ref, body, settings)
            # hedged then: the timer as recorded (its delay is not compared on replay)
            fire_at = recorded.data.get("fire_at")
            after = max(0.0, float(fire_at) - inst.now) if fire_at is not None else 0.0
            partner = ref.hedge[0] if ref.hedge is not None else None
        elif ref.hedge is None:
            return await self._one(ref, body, settings)
        else:
            partner, after = ref.hedge
        # what each call holds reserved of the run's budget (a loser's is taken over
        # when the hedge is decided: see _record_hedge)
        holds: dict[str, dict[str, Any]] = {"first": {}, "second": {}}
        first = asyncio.ensure_future(self._one(ref, body, settings, holds["first"]))
        timer = asyncio.ensure_future(sleep(after))
        await asyncio.wait({first, timer}, return_when=asyncio.FIRST_COMPLETED)
        if first.done():
            timer.cancel()
            return first.result()
        other = self._hedge_partner(inst, ref, partner)
        if other is None:  # this deploy removed the hedge before it was due: no second call
            return await first
        second = asyncio.ensure_future(self._one(other, body, settings, holds["second"]))
        pending = {first, second}
        failure: BaseException | None = None
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in _hedge_order(current_instance(), first, second, other, done):
                if fut.exception() is None:
                    for loser in pending:
                        loser.cancel()
                    inst = current_instance()
                    if inst is not None:
                        won, lost = (ref, other) if fut is first else (other, ref)
                        hold = holds["second" if fut is first else "first"]
                        _record_hedge(inst, (ref, other), won, lost, body, settings, hold)
                    result: dict[str, Any] = fut.result()
                    return result
                failure = failure or fut.exception()
        assert failure is not None
        raise failure

    def _hedge_partner(
        self, inst: WorkflowInstance, ref: ModelRef, partner: ModelRef | None
    ) -> ModelRef | None:
        """The model a hedge of ``ref`` asks now that its delay passed: the one the run
        recorded asking (a deploy may have changed or removed ``ref``'s hedge since), or
        for a new decision this deploy's ``partner`` (None: no hedge any more)."""
        recorded = inst.recorded_next()
        if recorded is None:
            return partner
        name = _called_model(recorded, self._activity.name)
        if name is None:
            if partner is not None:
                return partner
            inst.diverge(
                f"the hedge of model {ref.name!r}'s call ({recorded.type.value})",
                f"model {ref.name!r} has no hedge in this deploy and history does not say "
                "which model the hedge asked",
                names_only=True,  # a model's name and an event type
            )
        other = self._models.get(name)
        if other is None:
            inst.diverge(
                f"the hedge of model {ref.name!r}'s call asking model {name!r}",
                f"no model {name!r} on gateway {self.name!r} (this deploy removed it): "
                f"register {name!r} again (gateway.model) so runs that hedged to it can replay",
                names_only=True,  # model and gateway names the engine recorded
            )
        return other

    async def _one(
        self,
        ref: ModelRef,
        body: dict[str, Any],
        settings: ModelSettings | None,
        hold: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        inst = current_instance()
        if inst is None:
            direct: dict[str, Any] = await ref.activity(ref.name, body)
            return direct
        tally = inst.spend
        estimate = _check_budget(
            inst,
            tally,
            ref,
            lambda: ref.estimate(body["messages"], settings, body["params"]),
            cached=bool(ref.cache_ttl),
        )
        refusal = estimate.pop("cache_only", None)
        if refusal is not None:
            body = {**body, "cache_only": refusal}
        started = inst.started
        tenant = (started.data if started is not None else {}).get("tenant")
        if tenant is not None:
            body = {**body, "tenant": tenant}
        if estimate["tokens"] or estimate["cost"]:
            body = {**body, "estimate": estimate}
        elif tenant is not None:
            body = {**body, "estimate": ref.estimate(body["messages"], settings, body["params"])}
        # the step names the model it calls, so a worker of a later deploy calls the same
        spec = _pinned(inst, self.name, ref) or (ref.spec if isinstance(ref.spec, str) else None)
        if spec is not None:
            body = {**body, "spec": spec}
        inline: list[str] = []
        tip = ""
        seen = _known.get(inst) or _known.setdefault(inst, _Seen())
        if self.message_refs:
            # the conversation so far by one node, then only the messages after it
            packed, inline, tip = pack(body["messages"], seen.messages, seen.nodes)
            body = {**body, "messages": packed}
            recorded = _recorded_pack(inst, self._activity.name)
            if recorded is not None:
                # a replayed step: what it sent is what its history holds (and what a
                # worker rebuilds), even if today's code words the prompt otherwise
                inline, tip = recorded
        hold = {} if hold is None else hold
        step = inst.step + 1  # the step the call is about to be
        hold.update(
            tokens=estimate["tokens"], cost=Decimal(estimate["cost"] or 0), held=True, step=step
        )
        tally.reserved_tokens += hold["tokens"]
        tally.reserved_cost += hold["cost"]
        try:
            out: dict[str, Any] = await ref.activity(ref.name, body)
        except ActivityError as exc:
            if exc.error_type != "DailyBudgetExceeded":
                raise
            raise daily_refusal(ref, exc) from None
        finally:
            _release(tally, hold)
        missed = out.get(CACHE_MISS_KEY)
        if isinstance(missed, dict):
            # a call over the run's budget the cache did not have: refused, unsent
            # (replay reads the refusal from the recorded result)
            inst.record("budget_exceeded", missed)
            raise BudgetExceeded(
                ref.name, missed["what"], missed["limit"], missed["spent"], missed["estimate"]
            )
        if self.message_refs:
            # the worker kept them (and the answer), so later steps may refer to them
            answer = canonical(out["response"])[0]
            seen.messages.update(inline)
            seen.messages.add(answer)
            seen.nodes.update((tip, link(tip, answer)))
        call = out[CALL_KEY]
        inputs, outputs = int(call.get("input_tokens") or 0), int(call.get("output_tokens") or 0)
        cost = Decimal(call["cost"]) if call.get("cost") is not None else None
        if not call.get("cache_hit"):
            # an answer from the cache costs nothing (as ``app.usage`` and the daily
            # budgets count it): it does not count against the run's budget either
            # (read from the record, so a replay counts as the run did)
            tally.tokens += inputs + outputs
            tally.cost += _budget_cost(call)
        # counted once, when the run first meets the answer (never on replay, nor for an
        # answer kept from the run a retry or fork came from: that run counted it)
        if inst.reused(step):
            return out
        labels = (inst.workflow.name, ref.name, tenant or "")
        inst.count("tether_ai_calls", (*labels, "cache" if call.get("cache_hit") else "model"))
        if not call.get("cache_hit"):
            count_usage(inst, labels, inputs, outputs, cost)
        return out


def _usage(
    ref: ModelRef, request: dict[str, Any], settings: ModelSettings | None, response: Any
) -> tuple[int, int, int, dict[str, Any] | None]:
    """(input, output, cache-read tokens, None) of an answer as its provider reported
    them; or, when the report cannot be true (no input tokens, a count that is not a
    whole number >= 0: a server that leaves usage out, a broken proxy), the call's
    estimate and the report as it came. Counting such a call as free would let a run
    spend past its budget: the estimate fails closed."""
    usage = response.usage
    counts = tokens_in, tokens_out, cache_read = (
        usage.input_tokens,
        usage.output_tokens,
        usage.cache_read_tokens,
    )
    if (
        type(tokens_in) is int
        and type(tokens_out) is int
        and type(cache_read) is int
        and tokens_in > 0
        and tokens_out >= 0
        and cache_read >= 0
    ):
        return tokens_in, tokens_out, cache_read, None
    tokens_in, tokens_out = ref.estimated_tokens(
        request["messages"], settings, request.get("params")
    )
    reported = {
        name: n if type(n) is int else repr(n)
        for name, n in zip(
            ("input_tokens", "output_tokens", "cache_read_tokens"), counts, strict=True
        )
    }
    if ref.name not in _WARNED:  # once per model and process: a server that never reports
        _WARNED.add(ref.name)
        log.warning(
            "model %r (%s) reported usage that cannot be true (%s); its calls count at their "
            "estimate (here %d input, %d output tokens)",
            ref.name,
            ref.model_name,
            reported,
            tokens_in,
            tokens_out,
        )
    return tokens_in, tokens_out, 0, reported


def _deployment_key(model: Model | str | Callable[[], Model], name: str) -> str:
    """The limiter of a model: one per provider, model and endpoint (``provider/model``
    for a ``"provider:name"`` string, which workers build for the provider's endpoint in
    their environment; ``@`` and the ``base_url`` of a ``Model`` object that has one,
    without credentials or query; the registered name for a factory, which is built
    only on the worker)."""
    if not isinstance(model, Model | str):
        return name
    key = f"{provider_of(model) or 'model'}/{model_name_of(model)}"
    base_url = getattr(model, "base_url", None) if isinstance(model, Model) else None
    if isinstance(base_url, str) and base_url:
        parts = urlsplit(base_url)
        host = parts.hostname or ""
        where = f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"
        key = f"{key}@{where.rstrip('/')}"
    return key[:MAX_NAME]


async def _watched(ref: ModelRef, asked: Coroutine[Any, Any, _T]) -> _T:
    """A call that asks every ``STREAM_CANCEL_CHECK`` seconds (a heartbeat) whether its
    step was cancelled, and then aborts its request: a hedge's loser running in another
    process than the run's workflow task (this process's workers cancel theirs at once
    when the run's cancel is committed; other processes would wait for their next
    lease renewal)."""
    try:
        ctx: ActivityContext | None = activity_context()
    except NotInActivityError:
        ctx = None
    if ctx is None:
        return await asked
    call = asyncio.ensure_future(asked)
    try:
        while True:
            done, _ = await asyncio.wait({call}, timeout=STREAM_CANCEL_CHECK)
            if done:
                return call.result()
            if ctx.is_cancelled:
                call.cancel()
                raise StepCancelled(
                    f"model {ref.name!r}: the step was cancelled while it waited for the "
                    "answer (its run was cancelled, or a hedge took the other answer)"
                )
            ctx.heartbeat()  # its answer sets ctx.is_cancelled
    finally:
        if not call.done():
            call.cancel()


def _interrupted(
    ref: ModelRef, ctx: ActivityContext | None, exc: BaseException, doing: str
) -> tuple[str, str]:
    """The error type and text of a model attempt that ended with ``exc`` while
    ``doing`` (what a streamed step's ``failed`` item says, and a timeout's record):
    a cancelled task says why its worker cancelled it, naming the model, the step and
    what to do, never a bare ``CancelledError``. Called from inside an activity of the
    user's (not the model's own step), the time limit is that activity's: it is named,
    and the advice is to raise its timeout (the model's does not apply there)."""
    where = f"model {ref.name!r} ({ref.model_name})"
    # the model's own step, or an activity of the user's that called the gateway inside
    inside = ctx is not None and ctx.name != ref.gateway._activity.name
    if ctx is not None:
        if inside:
            where += f", called in activity {ctx.name!r}"
        where += f", step {ctx.step}, attempt {ctx.attempt}"
    why = ctx._interruption() if ctx is not None else None
    if isinstance(exc, StepCancelled) or (
        isinstance(exc, asyncio.CancelledError) and why == "cancelled"
    ):
        return "StepCancelled", (
            f"{where}: cancelled while {doing} (its run was cancelled, or a hedge took "
            "the other model's answer); its text is void, nothing to do"
        )
    if not isinstance(exc, asyncio.CancelledError):
        return type(exc).__name__, f"{where}: {type(exc).__name__}: {exc}"
    if why == "stopping":
        return "WorkerStopped", (
            f"{where}: its worker stopped (a deploy, a restart) while {doing}; the step "
            "is handed back and retried by a running worker, this attempt not counted: "
            "nothing to do, unless no worker serves its queue"
        )
    if why == "timeout" and ctx is not None:
        secs = f"{round(ctx._timeout_s, 2):g}"
        secs += "" if "." in secs or "e" in secs else ".0"
        if not ctx._timeout_of:
            allowed = (
                ((ctx.task.options or {}).get("retry") or {}).get("attempts") if ctx.task else None
            )
            then = (
                f"that was its last attempt ({allowed} allowed)"
                if isinstance(allowed, int) and ctx.attempt >= allowed
                else "it is retried as its retry policy allows"
            )
            if inside:
                return "TimeoutError", (
                    f"{where}: timed out after {secs} s (the timeout per attempt of "
                    f"activity {ctx.name!r}) while {doing}; {then}. If answers this long "
                    f"are expected, raise the timeout of activity {ctx.name!r} "
                    "(@app.activity(timeout=), or options(timeout=) where it is called)"
                )
            return "TimeoutError", (
                f"{where}: timed out after {secs} s (its timeout per attempt) while "
                f"{doing}; {then}. If answers this long are expected, raise the "
                "model's timeout (gateway.model(..., timeout=) or ai.Gateway(timeout=))"
            )
        limit = ctx._timeout_of.removeprefix("step exceeded its ")
        step = f"activity {ctx.name!r}" if inside else "the step"
        return "TimeoutError", (
            f"{where}: timed out after {secs} s (the step's {limit} ran out) while "
            f"{doing}; no further attempt starts. If answers this long are expected, "
            f"give {step} more time (its retry's max_elapsed, its schedule_timeout)"
        )
    return "CancelledError", (
        f"{where}: its task was cancelled while {doing}, not by its worker (its event "
        "loop closed without worker.stop(), or the worker was killed); the step is "
        "retried once it is handed back or its lease runs out"
    )


def _stream_where(ref: ModelRef) -> dict[str, Any]:
    """What every streamed item of this step says of where it comes from."""
    try:
        ctx = activity_context()
    except NotInActivityError:
        return {"run_id": None, "step": None, "model": ref.name, "attempt": 1}
    return {"run_id": ctx.run_id, "step": ctx.step, "model": ref.name, "attempt": ctx.attempt}


#: models whose untrue usage this process has warned of
_WARNED: set[str] = set()


def count_usage(
    inst: WorkflowInstance,
    labels: tuple[str, str, str],
    inputs: int,
    outputs: int,
    cost: Decimal | None,
) -> None:
    """A model call's tokens and cost, met by the run for the first time: into the
    ``tether_ai_*`` counters (``labels``: workflow, model, tenant) and the tenant's ledger."""
    inst.count("tether_ai_tokens", (*labels, "input"), inputs)
    inst.count("tether_ai_tokens", (*labels, "output"), outputs)
    if cost is not None:
        inst.count("tether_ai_cost", labels, float(cost))
    inst.tally_usage(inputs + outputs, cost)


#: runs whose conversations a worker keeps in memory
_THREADS_CACHED = 256
#: how long a worker trusts its list of scopes with a daily budget
_BUDGETS_TTL = 2.0


class DailyBudgetExceeded(NonRetryable):
    """A tenant's (or the global) daily model budget would be exceeded (worker side)."""


def daily_over(over: tuple[Any, ...], estimate: dict[str, Any]) -> DailyBudgetExceeded:
    """The refusal of work whose ``estimate`` would pass the daily budget ``over`` names
    (the store's (scope, what, limit, tokens spent, cost spent))."""
    scope, what, limit, spent_tokens, spent_cost = over
    return DailyBudgetExceeded(
        json.dumps(
            {
                "scope": scope,
                "what": what,
                "limit": limit,
                "spent": {"tokens": int(spent_tokens), "cost": str(spent_cost)},
                "estimate": estimate,
            }
        )
    )


def daily_refusal(ref: ModelRef, exc: ActivityError) -> BudgetExceeded:
    """A step refused by a daily budget (``DailyBudgetExceeded`` on the worker) as the
    ``BudgetExceeded`` the workflow sees."""
    info = json.loads(exc.message)
    return BudgetExceeded(
        ref.name, info["what"], info["limit"], info["spent"], info["estimate"], scope=info["scope"]
    )


def _day(ts: float) -> str:
    """The UTC day of a timestamp, as daily budgets count it."""
    return datetime.fromtimestamp(ts, UTC).date().isoformat()


#: header names that carry credentials (matched anywhere in the name, any case)
_CREDENTIAL_HEADER = re.compile(r"auth|key|token|secret|password|cookie|signature", re.IGNORECASE)


def _refuse_recorded_credentials(ref: ModelRef, settings: ModelSettings | None) -> None:
    """A step's settings are recorded in its run's history (the worker that makes the
    call reads them there): a header that looks like a credential is refused before it
    is written, with where it belongs instead."""
    headers = (settings or {}).get("extra_headers") or {}
    for name in headers:
        if name.lower() != "idempotency-key" and _CREDENTIAL_HEADER.search(name):
            raise ConfigurationError(
                f"model {ref.name!r}: settings extra_headers {name!r} looks like a "
                "credential, and a step's settings are recorded in its run's history; set "
                "it on the model the worker builds instead (ai.openai_compatible(..., "
                "headers={...}) or ai.anthropic(..., headers={...})), where it is never "
                "recorded"
            )


def _cache_key(ref: ModelRef, request: dict[str, Any]) -> str:
    """What makes two requests the same question to the same model: the model the step
    calls, which for a run pinned to the ``"provider:name"`` it started with is that one
    (``request["spec"]``), not what today's deploy registers under the name; the gateway
    it is registered on and its deployment (provider, model and endpoint), so one name
    on two gateways or at two endpoints shares no answers. A function building the model
    is known by its registered name and ``version`` only: what it builds is not."""
    settings = {k: v for k, v in (request.get("settings") or {}).items() if k != "extra_headers"}
    spec: str | None = request.get("spec")
    material = {
        "gateway": ref.gateway.name,
        "deployment": _deployment_key(spec or ref.spec, ref.name),
        "model": ref.name,
        "model_name": model_name_of(spec) if spec else ref.model_name,
        "called": spec or ref.version,
        # as a message's address (``stable``), and without the id a provider gave an
        # earlier answer: the same conversation asked again is the same question
        "messages": [
            {k: v for k, v in stable(m).items() if k != "provider_response_id"}
            for m in request["messages"]
        ],
        "params": request["params"],
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _hour() -> int:
    """The hour (since the epoch) whose prices a gateway applies."""
    return int(time.time() // 3600)


#: failures the next model in a fallback chain would meet too
_NO_FALLBACK = frozenset({"ContentRefused", "BudgetExceeded"})
#: the result of a cache-only call (a call over the run's budget) the cache missed
CACHE_MISS_KEY = "tether.ai.cache_miss"


def _packed_of(scheduled: Event) -> dict[str, Any] | None:
    """The conversation a model step's recorded arguments hold in ``pack`` form (None:
    full messages, or not a model step's arguments)."""
    args = scheduled.data.get("args")
    request = (args.get("args") or [None])[-1] if isinstance(args, dict) else None
    packed = request.get("messages") if isinstance(request, dict) else None
    return packed if isinstance(packed, dict) and is_packed(packed) else None


def _recorded_pack(inst: WorkflowInstance, activity: str) -> tuple[list[str], str] | None:
    """For a step this run recorded already: the hashes it sent in full and the node of
    its conversation, from its history (None: a new step, or not a packed model call)."""
    recorded = inst.recorded_next()
    if recorded is None or recorded.type is not EventType.ACTIVITY_SCHEDULED:
        return None
    packed = _packed_of(recorded) if recorded.data.get("name") == activity else None
    if packed is None:
        return None
    node: str | None = packed.get("base")
    inline = []
    for entry in packed["new"]:
        node = link(node, entry["h"])
        if "m" in entry:
            inline.append(entry["h"])
    return inline, node or ""


def _run_pins(inst: WorkflowInstance, gateway: str) -> dict[str, Any]:
    """The pins a run recorded at its start for ``gateway``."""
    started = inst.started
    attrs = (started.data if started is not None else {}).get("attrs") or {}
    pins: dict[str, Any] = (attrs.get("pins") or {}).get(gateway) or {}
    return pins


def _note_repin(inst: WorkflowInstance, key: str, marker: str, data: dict[str, Any]) -> None:
    """Record ``marker`` once per run and ``key``, where the run first meets the change
    after a deploy (a step replayed from before the deploy records nothing: history
    has what it did already)."""
    seen = _known.setdefault(inst, _Seen())
    recorded = inst.recorded_next()
    replayed_step = recorded is not None and recorded.data.get("marker") != marker
    if key not in seen.repinned and not replayed_step:
        seen.repinned.add(key)
        inst.record(marker, data)


def check_output_pin(
    inst: WorkflowInstance | None, gateway: Gateway, output: Any
) -> tuple[str, str]:
    """The schema an output type has now (``name@version``, fingerprint), after recording
    ``output_schema_repinned`` when the run was pinned at its start to another one."""
    label, version, fingerprint = gateway.output_pin(output)
    if inst is not None:
        pin = (_run_pins(inst, gateway.name).get("outputs") or {}).get(label)
        if pin is not None and pin.get("fingerprint") != fingerprint:
            _note_repin(
                inst,
                f"output:{label}",
                "output_schema_repinned",
                {
                    "output": label,
                    "from": pin.get("version"),
                    "to": version,
                    "why": "this deploy's output type has another schema than the run started "
                    "with; answers recorded before are read with the new type",
                },
            )
    return f"{label}@{version}", fingerprint


def _pinned(inst: WorkflowInstance, gateway: str, ref: ModelRef) -> str | None:
    """The ``"provider:name"`` a run pinned at its start to call instead of today's ``ref``,
    or None to call ``ref`` (the same version, no pin, or a pin that cannot be rebuilt,
    which is then recorded once as ``model_repinned``)."""
    pin = _run_pins(inst, gateway).get("models", {}).get(ref.name)
    if pin is None or pin.get("version") == ref.version:
        return None
    if pin.get("spec"):
        return str(pin["spec"])
    _note_repin(
        inst,
        ref.name,
        "model_repinned",
        {
            "model": ref.name,
            "from": pin.get("version"),
            "to": ref.version,
            "why": "the pinned model is a Model object this deploy does not have",
        },
    )
    return None


def _hedge_order(
    inst: WorkflowInstance | None,
    first: asyncio.Future[Any],
    second: asyncio.Future[Any],
    second_ref: ModelRef,
    done: AbstractSet[asyncio.Future[Any]],
) -> list[asyncio.Future[Any]]:
    """The answered calls of a hedge in the order they are tried as its winner: the
    first call's before the second's (a set's order would differ from run to run when
    both answers arrive together), or on replay the recorded winner's first."""
    order = [fut for fut in (first, second) if fut in done]
    if len(order) == 2 and inst is not None:
        recorded = inst.recorded_next()
        value = recorded.data.get("value") if recorded is not None and _is_hedge(recorded) else None
        if isinstance(value, dict) and value.get("won") == second_ref.name:
            order.reverse()
    return order


def _record_hedge(
    inst: WorkflowInstance,
    asked: tuple[ModelRef, ModelRef],
    won: ModelRef,
    lost: ModelRef,
    body: dict[str, Any],
    settings: ModelSettings | None,
    lost_hold: dict[str, Any],
) -> None:
    """Record which deployment won a hedge. The loser, cancelled, may have been answered
    and billed already; what it used is unknown to the run, so its estimate counts as
    spent (a run that hedges stays within its budget) and is recorded with the marker,
    which replay reads rather than pricing it again."""
    tally = inst.spend
    still_running = _release(tally, lost_hold)  # its reservation becomes spend below
    recorded = inst.recorded_next()
    value = recorded.data.get("value") if recorded is not None and _is_hedge(recorded) else None
    if not isinstance(value, dict):
        value = {"asked": [r.name for r in asked], "won": won.name}
        if still_running:  # it may be answered, and billed, yet
            estimate = lost.estimate(body["messages"], settings, body["params"])
            value["abandoned"] = {"model": lost.name, **estimate, "step": lost_hold.get("step")}
    inst.record("model_hedge", value)
    abandoned = value.get("abandoned")
    if abandoned:
        used = (int(abandoned.get("tokens") or 0), Decimal(abandoned.get("cost") or 0))
        step = abandoned.get("step")
        if isinstance(step, int):
            # its estimate counts until its step's outcome is recorded; then what it
            # used does: its answer's usage, or nothing (Spend.settle)
            tally.abandoned[step] = used
        else:  # recorded before the step was: its estimate counts, as it did then
            tally.tokens += used[0]
            tally.cost += used[1]


def _called_model(recorded: Event, activity: str) -> str | None:
    """The model a recorded command of a model call names: a step's first argument, or
    a ``budget_exceeded`` marker's model (None: neither, or not readable)."""
    if recorded.type is EventType.ACTIVITY_SCHEDULED and recorded.data.get("name") == activity:
        args = recorded.data.get("args")
        positional = args.get("args") if isinstance(args, dict) else None
        if isinstance(positional, list) and positional and isinstance(positional[0], str):
            return positional[0]
    elif recorded.type is EventType.MARKER and recorded.data.get("marker") == "budget_exceeded":
        value = recorded.data.get("value")
        model = value.get("model") if isinstance(value, dict) else None
        return model if isinstance(model, str) else None
    return None


def _release(tally: _Tally, hold: dict[str, Any]) -> bool:
    """Give back what a call holds reserved of its run's budget, once (True: it held it,
    that is, the call had not ended yet)."""
    if not hold.pop("held", False):
        return False
    tally.reserved_tokens -= hold["tokens"]
    tally.reserved_cost -= hold["cost"]
    return True


def _is_hedge(event: Event) -> bool:
    """Whether ``event`` is a hedge's recorded decision (``model_hedge``)."""
    return event.type is EventType.MARKER and event.data.get("marker") == "model_hedge"


def _check_budget(
    inst: WorkflowInstance,
    tally: _Tally,
    ref: ModelRef,
    estimated: Callable[[], dict[str, Any]],
    *,
    cached: bool = False,
) -> dict[str, Any]:
    """Refuse a call (or a batch) that would go over the run's budget, ``estimated()``
    being what it may use (deterministically on replay: a call made then passed).

    ``cached``: the model has an answer cache, which only the worker can consult. A
    call that would go over is then not refused here but made cache-only (the estimate
    returned has ``"cache_only"``: the refusal, for the worker to send back on a miss):
    a hit costs nothing, so it needs no room."""
    budget = inst.budget()
    if budget is None:
        return {"tokens": 0, "cost": None}
    recorded = inst.recorded_next()
    if recorded is not None:
        if recorded.data.get("marker") == "budget_exceeded":
            # this run was refused here before: refuse again, whatever prices say today
            value = recorded.data.get("value") or {}
            inst.record("budget_exceeded", value)
            raise BudgetExceeded(
                ref.name, value["what"], value["limit"], value["spent"], value["estimate"]
            )
        # the call was made: it passed then, and holds what it held then until its
        # outcome replays (a call still in flight keeps counting against the budget)
        held = _recorded_hold(recorded)
        if held is not None:
            return held
        estimate = estimated()
        spent_tokens, spent_cost = tally.committed()
        if cached and _over(budget.tokens, budget.cost, spent_tokens, spent_cost, estimate):
            return {"tokens": 0, "cost": None}  # made cache-only then: it held nothing
        return estimate
    estimate = estimated()
    spent_tokens, spent_cost = tally.committed()  # children's shares included
    over = _over(budget.tokens, budget.cost, spent_tokens, spent_cost, estimate)
    if over is not None:
        value = {
            "model": ref.name,
            "what": over[0],
            "limit": over[1],
            "spent": {"tokens": spent_tokens, "cost": str(spent_cost)},
            "estimate": {"tokens": estimate["tokens"], "cost": estimate["cost"]},
        }
        if cached:  # the worker answers from the cache or refuses: nothing held
            return {"tokens": 0, "cost": None, "cache_only": value}
        inst.record("budget_exceeded", value)
        raise BudgetExceeded(ref.name, over[0], over[1], value["spent"], value["estimate"])
    return estimate


def _recorded_hold(recorded: Event) -> dict[str, Any] | None:
    """What a model call recorded at ``recorded`` held of its run's budget while in
    flight, read from the request it sent: its estimate, nothing when it went
    cache-only (None: not a call's request one can read, e.g. sealed or offloaded,
    or a batch's step; the caller estimates it again)."""
    if recorded.type is not EventType.ACTIVITY_SCHEDULED:
        return None
    args = recorded.data.get("args")
    positional = args.get("args") if isinstance(args, dict) else None
    request = positional[-1] if isinstance(positional, list) and positional else None
    if not isinstance(request, dict) or "messages" not in request:
        return None
    if "cache_only" in request:
        return {"tokens": 0, "cost": None}
    estimate = request.get("estimate")
    if not isinstance(estimate, dict):
        # no estimate sent: the budget check had found it nothing (no tokens, no cost)
        return {"tokens": 0, "cost": None}
    tokens, cost = estimate.get("tokens"), estimate.get("cost")
    return {
        "tokens": tokens if type(tokens) is int else 0,
        "cost": None if cost is None else str(cost),
    }


def _over(
    tokens: int | None,
    cost: Any,
    spent_tokens: int,
    spent_cost: Decimal | str,
    estimate: dict[str, Any],
) -> tuple[str, str] | None:
    """Which limit (``("tokens" | "cost", the limit)``) a call of ``estimate`` would pass."""
    if tokens is not None and spent_tokens + estimate["tokens"] > tokens:
        return ("tokens", str(tokens))
    if cost is not None and (
        # a model without a price could spend anything: a cost budget refuses it
        estimate["cost"] is None
        or Decimal(spent_cost) + Decimal(estimate["cost"]) > Decimal(str(cost))
    ):
        return ("cost", str(cost))
    return None


def _classified(ref: ModelRef, exc: Exception) -> Exception:
    """A provider error as tether classifies it: permanent ones become NonRetryable."""
    from pydantic_ai import exceptions as pe

    where = f"model {ref.name!r} ({ref.model_name})"
    permanent = tuple(
        cls
        for cls in (
            getattr(pe, "ModelQuotaExceededError", None),
            getattr(pe, "ModelRequestRejectedError", None),
            getattr(pe, "UserError", None),
        )
        if isinstance(cls, type)
    )
    if isinstance(exc, NonRetryable):
        return exc
    if permanent and isinstance(exc, permanent):
        return NonRetryable(
            f"{where}: {type(exc).__name__}: {exc}. The provider refused the request itself "
            "(quota, credentials, unknown model or an over-long prompt): fix it, then retry the run"
        )
    if type(exc).__name__ == "ContentFilterError":
        return ContentRefused(f"{where} refused the request on content policy: {exc}")
    return exc


def expand_history(events: list[Event], activity: str = "tether.ai.call") -> list[dict[str, Any]]:
    """``events`` as JSON with every model step's conversation written out in full
    (steps record it by reference: ``{"base": node, "new": [...]}``), for people and
    tools reading an exported history. Replay does not need it."""
    known = _Rebuilt()
    out = []
    for ev in events:
        item = ev.to_json()
        if ev.type is EventType.ACTIVITY_SCHEDULED and ev.data.get("name") == activity:
            args = ev.data.get("args") or {}
            positional = args.get("args") if isinstance(args, dict) else None
            request = positional[-1] if isinstance(positional, list) and positional else None
            packed = request.get("messages") if isinstance(request, dict) else None
            if is_packed(packed) and isinstance(request, dict) and isinstance(positional, list):
                assert isinstance(packed, dict)
                full = known.full(packed)
                if full is not None:
                    new_request = {**request, "messages": full}
                    item["data"] = {
                        **item["data"],
                        "args": {**args, "args": [*positional[:-1], new_request]},
                    }
        known.apply([ev], activity)
        out.append(item)
    return out
