"""Keyed batching of activity calls: ``@app.activity(batch=tether.Batch(...))``.

A batched activity is written as a function of a list of items returning a list
of results (one per item, in order; an ``Exception`` instance in place of a
result fails only that item). Workflows call it with ONE item and get ONE
result back. Each call is an ordinary activity step of its own run (its own
``ActivityScheduled``, outcome, retries, attempt count, idempotency key and
dead letter); only the execution is shared: the store leases up to
``max_items`` ready tasks with the same batch key together (``_claim_batches``
in ``store/ops/batches.py``) and the worker runs the function once for all of them
(``run_batch`` in ``_batch_run.py``), then records every item's outcome against its own fence.
"""

from __future__ import annotations

import collections.abc
import inspect
import logging
import types
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Protocol,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    overload,
)

from ._batching import Batch
from ._definitions import Activity, ActivityOptions
from ._errors import (
    ConfigurationError,
    NonRetryable,
)
from ._policy import Retry
from ._serde import Signature

if TYPE_CHECKING:
    from ._queues import Dependency

log = logging.getLogger("tether.worker")

T = TypeVar("T")
R = TypeVar("R")


class BatchResultError(NonRetryable):
    """A batched activity returned something other than one result per item.

    It is a programming error, so every item of that batch fails at once (no
    retries); the message names the activity and both lengths.
    """


def split_results(activity: str, value: Any, n: int) -> list[Any]:
    """Check that a batch returned ``n`` results (a list or other sequence); return them."""
    if isinstance(value, str | bytes | bytearray) or not isinstance(
        value, collections.abc.Sequence
    ):
        raise BatchResultError(
            f"batched activity {activity!r} must return a list with one result per item; "
            f"it returned {type(value).__name__} for {n} item(s)"
        )
    if len(value) != n:
        raise BatchResultError(
            f"batched activity {activity!r} returned {len(value)} result(s) for {n} item(s); "
            f"expected {n}: one result (or Exception) per item, in order"
        )
    return list(value)


def _single(activity: str, value: Any) -> Any:
    """The one result of a batch of one item; an Exception in its place is raised."""
    (out,) = split_results(activity, value, 1)
    if isinstance(out, BaseException):
        raise out
    return out


_SEQUENCES = (
    list,
    tuple,
    collections.abc.Sequence,
    collections.abc.MutableSequence,
    collections.abc.Collection,
    collections.abc.Iterable,
)


def _element_type(tp: Any, what: str) -> Any:
    """The element type of a ``list[X]``-like annotation (``empty`` when not annotated)."""
    if tp is inspect.Parameter.empty or tp is Any:
        return inspect.Parameter.empty
    if tp in _SEQUENCES:
        return inspect.Parameter.empty
    origin = get_origin(tp)
    if origin in _SEQUENCES:
        args = get_args(tp)
        if origin is tuple and not (len(args) == 2 and args[1] is ...):
            return Any  # a fixed-length tuple: no single element type
        return args[0] if args else inspect.Parameter.empty
    raise ConfigurationError(f"{what} must be annotated as a list (e.g. list[str]), got {tp!r}")


def _without_errors(tp: Any) -> Any:
    """``R`` out of ``R | Exception``: results may hold an Exception for a failed item."""

    def is_error(t: Any) -> bool:
        return isinstance(t, type) and issubclass(t, BaseException)

    if get_origin(tp) in (Union, types.UnionType):
        keep = [a for a in get_args(tp) if not is_error(a)]
        if not keep:
            return inspect.Parameter.empty
        return keep[0] if len(keep) == 1 else Union[tuple(keep)]  # noqa: UP007
    return inspect.Parameter.empty if is_error(tp) else tp


class ItemSignature(Signature):
    """The per-call signature of a batched activity: one ``item`` in, one result out."""

    def __init__(self, name: str, item_type: Any, result_type: Any) -> None:
        def item(item: Any) -> Any:  # stands in for the per-item function
            raise NotImplementedError

        hints = {"item": item_type, "return": result_type}
        item.__annotations__ = {k: v for k, v in hints.items() if v is not inspect.Parameter.empty}
        super().__init__(item)
        self.name = name


def _split_signature(fn: Callable[..., Any], name: str) -> tuple[Any, Any]:
    """The item and result types of a batch function ``(list[T]) -> list[R]``."""
    what = f"batched activity {name!r}"
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [
        p
        for p in params[1:]
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if not positional or positional[0] is not params[0] or required:
        raise ConfigurationError(
            f"{what} must take exactly one argument, the list of items "
            f"(e.g. def {name}(items: list[str]) -> list[...]); "
            f"its parameters are ({', '.join(p.name for p in params)})"
        )
    try:
        hints = get_type_hints(fn)
    except Exception:
        hints = {}
    item_type = _element_type(
        hints.get(params[0].name, inspect.Parameter.empty),
        f"the parameter {params[0].name!r} of {what}",
    )
    result_type = _without_errors(
        _element_type(hints.get("return", inspect.Parameter.empty), f"the return type of {what}")
    )
    return item_type, result_type


class BatchActivity(Activity[[T], R], Generic[T, R]):
    """An activity whose calls are collected into batches and run together.

    Call it with one item; it returns an awaitable of that item's result. The
    registered function (``batch_fn``) takes the list of items. Outside a
    workflow, a call runs the function with ``[item]`` and returns (or raises)
    the single outcome.
    """

    def __init__(
        self, batch_fn: Callable[[list[T]], Any], *, name: str, options: ActivityOptions
    ) -> None:
        batch = options.batch
        if not isinstance(batch, Batch):
            raise ConfigurationError(
                f"batch= of activity {name!r} takes a tether.Batch, got {type(batch).__name__}"
            )
        _check_options(options, name)
        item_type, result_type = _split_signature(batch_fn, name)
        self.batch_fn = batch_fn
        self.batch = batch
        one: Callable[[T], Any]
        if inspect.iscoroutinefunction(batch_fn):

            async def one_async(item: T) -> Any:
                return _single(name, await batch_fn([item]))

            one = one_async
        else:

            def one_sync(item: T) -> Any:
                return _single(name, batch_fn([item]))

            one = one_sync
        #: the per-item function the worker runs a batch with; a testing tool that
        #: replaces ``fn`` (fault injection, cassettes) makes the worker run items one by one
        self.item_fn = one
        super().__init__(one, name=name, options=options)
        self.sig = ItemSignature(getattr(batch_fn, "__qualname__", name), item_type, result_type)
        self.is_async = inspect.iscoroutinefunction(batch_fn)
        self.__doc__ = batch_fn.__doc__
        self.__wrapped__ = batch_fn

    def options(
        self,
        *,
        retry: Retry | None = None,
        timeout: float | timedelta | None = None,
        schedule_timeout: float | timedelta | None = None,
        heartbeat_timeout: float | timedelta | None = None,
        queue: str | None = None,
        priority: int | None = None,
        limit_key: Callable[..., str] | None = None,
        dependency: Dependency | None = None,
    ) -> BatchActivity[T, R]:
        """A copy with some per-item options changed (retry, timeouts, queue)."""
        opts = self.opts.replace(
            what=f"activity {self.name!r}",
            retry=retry,
            timeout=timeout,
            schedule_timeout=schedule_timeout,
            heartbeat_timeout=heartbeat_timeout,
            queue=queue,
            priority=priority,
            limit_key=limit_key,
            dependency=dependency,
        )
        return BatchActivity(self.batch_fn, name=self.name, options=opts)

    def __call__(self, item: T) -> Awaitable[R]:
        return super().__call__(item)

    def __repr__(self) -> str:
        return f"<tether batched activity {self.name}>"


def _check_options(opts: ActivityOptions, name: str) -> None:
    """Refuse options that cannot apply to a batch, naming the activity."""
    what = f"batched activity {name!r}"
    if opts.dependency is not None:
        raise ConfigurationError(
            f"{what} cannot have a dependency= limiter: a batch is claimed by its batch key; "
            "put the batched activity on a queue with limits (app.configure_queue) instead"
        )
    if opts.limit_key is not None:
        raise ConfigurationError(
            f"{what} cannot have a limit_key: per-key caps and fairness apply to single steps"
        )
    if opts.priority:
        raise ConfigurationError(
            f"{what} cannot have a priority: a batch always takes its oldest ready items first"
        )


class BatchDecorator(Protocol):
    """What ``@app.activity(batch=...)`` returns: it turns ``(list[T]) -> list[R]``
    (sync or async; results may hold an Exception per failed item) into a
    ``BatchActivity[T, R]`` that workflows call with one ``T``."""

    @overload
    def __call__(
        self, fn: Callable[[list[T]], Awaitable[Sequence[R | Exception]]], /
    ) -> BatchActivity[T, R]: ...

    @overload
    def __call__(
        self, fn: Callable[[list[T]], Sequence[R | Exception]], /
    ) -> BatchActivity[T, R]: ...

    def __call__(self, fn: Callable[[list[Any]], Any], /) -> BatchActivity[Any, Any]:
        """Register ``fn`` as the batch function."""
        ...
