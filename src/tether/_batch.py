"""Keyed batching of activity calls: ``@app.activity(batch=tether.Batch(...))``.

A batched activity is written as a function of a list of items returning a list
of results (one per item, in order; an ``Exception`` instance in place of a
result fails only that item). Workflows call it with ONE item and get ONE
result back. Each call is an ordinary activity step of its own run (its own
``ActivityScheduled``, outcome, retries, attempt count, idempotency key and
dead letter); only the execution is shared: the store leases up to
``max_items`` ready tasks with the same batch key together (``_claim_batches``
in ``store/_ops.py``) and the worker runs the function once for all of them
(``run_batch`` below), then records every item's outcome against its own fence.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import functools
import inspect
import json
import logging
import types
from collections.abc import Awaitable, Callable, Coroutine, Sequence
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

from ._activity_context import ActivityContext, set_context
from ._breaker import CircuitOpenError
from ._definitions import Activity, ActivityOptions
from ._errors import (
    ConfigurationError,
    NonRetryable,
    PayloadError,
    StoreError,
    TetherError,
)
from ._history import Task
from ._policy import Retry, seconds
from ._serde import Signature, encode

if TYPE_CHECKING:
    from ._queues import Dependency
    from ._worker import Worker

log = logging.getLogger("tether.worker")

T = TypeVar("T")
R = TypeVar("R")


class Batch:
    """How calls of one activity are batched: ``tether.Batch(max_items=, max_wait=, key=)``.

    A batch is run when ``max_items`` calls with the same key are ready, or when
    the oldest of them has waited ``max_wait`` (seconds or a timedelta). ``key``
    is a function of the item returning a string (e.g. the model); calls with
    different keys never share a batch. Without it, every call of the activity
    may join the same batch.
    """

    def __init__(
        self,
        *,
        max_items: int,
        max_wait: float | timedelta,
        key: Callable[[Any], str] | None = None,
    ) -> None:
        if isinstance(max_items, bool) or not isinstance(max_items, int):
            raise ConfigurationError(
                f"max_items of tether.Batch must be an integer (got {max_items!r})"
            )
        if max_items < 1:
            raise ConfigurationError(
                f"max_items of tether.Batch must be at least 1 (got {max_items})"
            )
        wait = seconds(max_wait, "max_wait of tether.Batch")
        if wait is None or wait <= 0:
            raise ConfigurationError(
                f"max_wait of tether.Batch must be a positive duration (got {max_wait!r}): "
                "how long the oldest waiting call may wait for its batch to fill"
            )
        if key is not None and not callable(key):
            raise ConfigurationError(
                "key of tether.Batch takes a function of the item returning a string "
                f"(e.g. lambda req: req.model), got {type(key).__name__}"
            )
        self.max_items = max_items
        self.max_wait = wait
        self.key = key

    def __repr__(self) -> str:
        return f"<tether.Batch max_items={self.max_items} max_wait={self.max_wait}s>"

    def scheduling(self, activity: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """What one call records in ActivityScheduled: its batch key and the batch limits.

        The key function runs here, in the workflow, once; the store groups tasks
        by the recorded key, so replay, retry and fork never call user code again.
        """
        item = args[0] if args else next(iter(kwargs.values()), None)
        value: str | None = None
        if self.key is not None:
            try:
                value = self.key(item)
            except Exception as exc:
                raise ConfigurationError(
                    f"batch key of activity {activity!r} failed on this call's item: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(value, str):
                raise ConfigurationError(
                    f"batch key of activity {activity!r} must return a string, "
                    f"got {type(value).__name__} ({value!r})"
                )
        group = [activity] if value is None else [activity, value]
        return {
            "key": json.dumps(group, separators=(",", ":")),
            "max_items": self.max_items,
            "max_wait": self.max_wait,
        }


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


# -- the activity context of a batch --------------------------------------------


class BatchActivityContext(ActivityContext):
    """The context of a batched call: ``idempotency_keys`` has one key per item.

    The scalar fields (``run_id``, ``step``, ``attempt``, ``idempotency_key``)
    describe the first item. ``heartbeat()`` renews the lease of every item;
    ``is_cancelled`` turns true when every item was cancelled or lost.
    """

    _tasks: tuple[Task, ...] = ()

    def _beat(self, details: str | None) -> Coroutine[Any, Any, bool]:
        return self._beat_all(details)

    async def _beat_all(self, details: str | None) -> bool:
        assert self._store is not None
        store, lease = self._store, self._lease
        beats = await asyncio.gather(
            *(store.heartbeat(t, lease, details) for t in self._tasks), return_exceptions=True
        )
        return all(b is not False for b in beats)  # True: nothing of this batch is live


# -- running a batch (the worker side) -------------------------------------------


async def run_batch(w: Worker, tasks: list[Task]) -> None:
    """Run the activity once for ``tasks`` (leased together) and record each outcome.

    Items whose step is already out of time or attempts fail before the call;
    the rest go to the function as one list. Its exception fails every item
    (each by its own retry policy and attempt count); an Exception in the
    result list fails only that item. The outcomes are written concurrently, so
    the store's group commit puts them in one transaction, each with its own fence.
    """
    from ._worker import _Plan, _StepTimeout

    store = w.app.store
    assert w._loop is not None
    try:
        act: Activity[Any, Any] | None = w.app.get_activity(tasks[0].name or "")
    except TetherError:
        act = None
    if not isinstance(act, BatchActivity) or act.fn is not act.item_fn:
        # unknown here, no longer batched, or wrapped by a testing tool: one by one
        await asyncio.gather(*(w._run_activity(t) for t in tasks))
        return
    now = store.clock()
    outcomes: list[Awaitable[None]] = []
    live: list[tuple[Task, _Plan, Any]] = []
    for task in tasks:
        opts = task.options or {}
        plan = _Plan(Retry.from_json(opts.get("retry") or {}, act.opts.retry.non_retryable), opts)
        early: BaseException | None = None
        if plan.deadline is not None and now >= plan.deadline:
            early = _StepTimeout(plan.deadline_reason)
        elif task.attempt > plan.retry.attempts:
            early = TimeoutError(
                f"attempt {task.attempt} exceeds the {plan.retry.attempts} allowed: earlier "
                "attempts were lost (worker crash or heartbeat timeout)"
            )
        else:
            try:
                args, kwargs = act.sig.decode_args(task.payload or "{}")
                live.append((task, plan, args[0] if args else next(iter(kwargs.values()))))
                continue
            except PayloadError as exc:
                early = NonRetryable(str(exc))
        outcomes.append(w._record_failure(task, early, plan, None))
    if outcomes:
        await _settle(w, outcomes, tasks)  # recorded now: the batch may run a long time
        outcomes = []
    if not live:
        return
    breaker = (live[0][0].options or {}).get("breaker")
    if breaker:
        wait = await store.breaker_admit(breaker)
        if wait is not None:  # open: fail fast, never touching the dependency
            w.stats["breaker_rejections"] += len(live)
            err = CircuitOpenError(breaker["name"], wait)
            await _settle(w, [w._record_failure(t, err, p, None) for t, p, _ in live], tasks)
            return
    first = live[0][0]
    ctx = BatchActivityContext(
        run_id=first.run_id,
        step=first.step or 0,
        name=act.name,
        attempt=first.attempt,
        idempotency_key=f"{first.run_id}:{first.step}",
        idempotency_keys=tuple(f"{t.run_id}:{t.step}" for t, _, _ in live),
        task=first,
        _store=store,
        _loop=w._loop,
        _lease=w.lease,
    )
    ctx._tasks = tuple(t for t, _, _ in live)
    limits = [t for t in (p.attempt_timeout(now) for _, p, _ in live) if t]
    timeout = min(limits) if limits else None
    items = [item for _, _, item in live]
    error: BaseException | None = None
    results: list[Any] = []
    try:
        cv = contextvars.copy_context()
        cv.run(set_context, ctx)
        fut: asyncio.Future[Any]
        if act.is_async:
            fut = asyncio.ensure_future(w._loop.create_task(act.batch_fn(items), context=cv))
        else:
            fut = w._loop.run_in_executor(w._pool, functools.partial(cv.run, act.batch_fn, items))
        value = await asyncio.wait_for(fut, timeout) if timeout else await fut
        ctx._returned = True
        results = split_results(act.name, value, len(items))
    except asyncio.CancelledError:
        if w._stopping:
            raise
        error = asyncio.CancelledError("activity cancelled")
    except TimeoutError as exc:
        error = TimeoutError(
            str(exc)
            or f"batch of {len(items)} item(s) of activity {act.name!r} timed out after {timeout}s"
        )
    except Exception as exc:
        error = exc
    w.stats["batches"] += 1
    w.stats["batch_items"] += len(live)
    for i, (task, plan, _) in enumerate(live):
        outcome: BaseException | str
        if error is not None:
            outcome = error
        elif isinstance(results[i], BaseException):
            outcome = results[i]
        else:
            try:
                outcome = encode(results[i], f"result of activity {act.name!r}")
            except PayloadError as exc:
                outcome = NonRetryable(str(exc))
        if isinstance(outcome, str):
            w.stats["activities"] += 1
            outcomes.append(_complete(w, task, outcome, breaker))
        else:
            outcomes.append(w._record_failure(task, outcome, plan, None))
    await _settle(w, outcomes, tasks)


async def _complete(w: Worker, task: Task, result: str, breaker: dict[str, Any] | None) -> None:
    """Record one item's result (the one-commit path when the worker can take it)."""
    if breaker:
        await w._breaker_record(breaker, True)
    await w._record_result(task, result)


async def _settle(w: Worker, outcomes: list[Awaitable[None]], tasks: list[Task]) -> None:
    """Write the outcomes together; a store failure leaves that item to its lease."""
    done = await asyncio.gather(*outcomes, return_exceptions=True)
    for got in done:
        if isinstance(got, StoreError):
            log.warning("could not record an item of a batch of %r: %s", tasks[0].name, got)
        elif isinstance(got, BaseException):
            raise got
