"""Durable primitives for workflow code: timers, events, races, deterministic values.

Each function documents what it does on replay. Outside a workflow, the
helpers that have an obvious plain-asyncio meaning (``sleep``, ``gather``,
``first``, ``now``) fall back to it so workflow functions can be unit-tested
as ordinary coroutines; the others raise ``NotInWorkflowError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import logging
import random as _random
import uuid as _uuid
from collections.abc import Awaitable, Callable, Iterable
from datetime import timedelta
from typing import Any, Generic, TypeVar

from .._definitions import Activity, chain_of, check_signal_name
from .._errors import ContinueAsNew, TetherError
from .._policy import seconds
from .._serde import convert
from ._instance import WorkflowInstance, current_instance

T = TypeVar("T")


class NotInWorkflowError(TetherError, RuntimeError):
    """A workflow-only primitive was called outside workflow code."""


def _instance(what: str) -> WorkflowInstance:
    inst = current_instance()
    if inst is None:
        raise NotInWorkflowError(
            f"tether.{what}() can only be called inside a workflow function (one decorated "
            "with @app.workflow and run by a worker)"
        )
    return inst


def in_workflow() -> bool:
    """Whether the caller is workflow code being run by tether."""
    return current_instance() is not None


def is_replaying() -> bool:
    """Whether the workflow code is re-running recorded history (no new effects)."""
    inst = current_instance()
    return inst is not None and inst.replaying


def sleep(duration: float | timedelta) -> Awaitable[None]:
    """Wait durably: a timer recorded in history that survives restarts.

    On replay a fired timer resolves at once. Cancelling the awaiting task (for
    example as the loser of ``first``) cancels the timer.
    """
    delay = seconds(duration, "sleep duration") or 0.0
    inst = current_instance()
    if inst is None:
        return asyncio.sleep(delay)
    return inst.start_timer(delay)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkflowInfo:
    """What a run's code may know of itself; every field replays as recorded."""

    run_id: str  #: this run
    chain_id: str  #: the first run of its continue-as-new chain (``run_id`` if none)
    workflow: str  #: the workflow's registered name
    version: str | None  #: the code version that ran the run's first task (or today's)
    tenant: str | None  #: the tenant it was started under
    parent_run_id: str | None  #: the run that started it as a child
    started_at: _dt.datetime  #: when the run was created (UTC)


def info() -> WorkflowInfo:
    """This run's identity: run id, chain, workflow and version, tenant, parent, start.

    Outside workflow code raises ``NotInWorkflowError`` (activities have
    ``tether.activity_context()``).
    """
    inst = _instance("info")
    started = inst.started
    data = started.data if started is not None else {}
    return WorkflowInfo(
        run_id=inst.run_id,
        chain_id=chain_of(inst.run_id)[0],
        workflow=inst.workflow.name,
        version=inst.recorded_version or inst.workflow.version,
        tenant=data.get("tenant"),
        parent_run_id=data.get("parent_run_id"),
        started_at=_dt.datetime.fromtimestamp(
            inst.eager_time  # what the first task saw when it ran before the run was stored
            if inst.eager_time is not None
            else (started.created_at if started is not None else inst.now),
            _dt.UTC,
        ),
    )


def now() -> _dt.datetime:
    """The workflow's clock (UTC): the time of the current workflow task, replayed as recorded."""
    inst = current_instance()
    if inst is None:
        return _dt.datetime.now(_dt.UTC)
    return _dt.datetime.fromtimestamp(inst.now, _dt.UTC)


def uuid() -> _uuid.UUID:
    """A UUID4 recorded in the run's history: the same on every replay of this run (and
    in a fork of it from a later step); a replay that asks for one where the history
    has none is a divergence."""
    inst = _instance("uuid")
    return _uuid.UUID(inst.draw("uuid", _new_uuid))


def _new_uuid(rng: _random.Random) -> str:
    return str(_uuid.UUID(int=rng.getrandbits(128), version=4))


def random() -> float:
    """A float in [0, 1) recorded in the run's history: the same on every replay of this
    run (and in a fork of it from a later step)."""
    return float(_instance("random").draw("random", _random.Random.random))


def set_status(value: Any) -> None:
    """Publish a JSON-serialisable progress value that clients read with ``app.get``."""
    _instance("set_status").set_status(value)


def set_progress(done: int, total: int | None = None, *, unit: str | None = None) -> None:
    """Publish progress by units of work (``done`` of ``total`` ``unit``), shown as the
    run's ``progress`` by ``tether serve``; kept under ``"progress"`` in the custom status
    (merged into it when the status is a dict, replacing it otherwise)."""
    if not isinstance(done, int) or done < 0 or (total is not None and total < 0):
        raise ValueError(f"progress needs whole counts >= 0 (got done={done!r}, total={total!r})")
    inst = _instance("set_progress")
    current = inst.last_status if isinstance(inst.last_status, dict) else {}
    inst.set_status({**current, "progress": {"done": done, "total": total, "unit": unit}})


async def wait_event(
    name: str, timeout: float | timedelta | None = None, *, type: Any = None
) -> Any:
    """Wait for the signal ``name``; return its payload, or None when ``timeout`` passes.

    Signals sent before the wait are buffered and delivered in order. With a
    timeout, a durable timer races the signal; the signal wins a tie. Pass
    ``type=`` to decode the payload into a dataclass or pydantic model.
    """
    inst = _instance("wait_event")
    check_signal_name(name)  # a name no sender may use would wait for ever
    delay = None if timeout is None else seconds(timeout, "wait_event timeout") or 0.0
    got, payload = await signal_until(inst, name, None if delay is None else inst.now + delay)
    return convert(payload, type) if got else None


async def signal_until(inst: WorkflowInstance, name: str, until: float | None) -> tuple[bool, Any]:
    """``(True, payload)`` of the next signal ``name``, or ``(False, None)`` when the
    workflow clock reaches ``until`` first (a durable timer; a signal wins a tie)."""
    found, payload = inst.take_signal(name)
    if found:
        return True, payload
    fut = inst.wait_signal(name, until)
    if until is None:
        return True, await fut
    timer = inst.start_timer(max(0.0, until - inst.now), shown=False)
    try:
        await asyncio.wait([fut, timer], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        fut.cancel()
        timer.cancel()
        raise
    if fut.done() and not fut.cancelled():
        timer.cancel()
        return True, fut.result()
    fut.cancel()
    return False, None


async def gather(*aws: Awaitable[Any], return_exceptions: bool = False) -> list[Any]:
    """Run awaitables concurrently; results in argument order (commands issued in that order)."""
    return list(await asyncio.gather(*aws, return_exceptions=return_exceptions))


async def first(*aws: Awaitable[Any]) -> Any:
    """Return the result of the first awaitable to finish and cancel the others.

    Typical use is a deadline: ``await tether.first(step(x), tether.sleep(60))``
    returns None when the timer wins. A loser's later outcome is ignored, so it
    can never change the result after the fact.
    """
    if not aws:
        raise ValueError("tether.first() needs at least one awaitable")
    futs = [asyncio.ensure_future(a) for a in aws]
    try:
        done, _ = await asyncio.wait(futs, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        for f in futs:
            f.cancel()
        raise
    winner = next(f for f in futs if f in done)
    for f in futs:
        if f is not winner:
            f.cancel()
    return winner.result()


def continue_as_new(*args: Any, **kwargs: Any) -> Any:
    """End this run and start the same workflow afresh with new arguments and an empty
    history (for loops that would otherwise grow history without bound)."""
    inst = _instance("continue_as_new")
    raise ContinueAsNew(inst.workflow.sig.encode_args(args, kwargs))


class _ReplaySafeLogger(logging.LoggerAdapter[logging.Logger]):
    """Drops records while the workflow replays, so each line is logged once."""

    def isEnabledFor(self, level: int) -> bool:
        return not is_replaying() and self.logger.isEnabledFor(level)

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        inst = current_instance()
        if inst is not None:
            extra = dict(kwargs.get("extra") or {})
            extra.setdefault("run_id", inst.run_id)
            kwargs["extra"] = extra
            msg = f"[{inst.run_id}] {msg}"
        return msg, kwargs


logger = _ReplaySafeLogger(logging.getLogger("tether.workflow"), {})


@dataclasses.dataclass(frozen=True, slots=True)
class ItemOutcome(Generic[T]):
    """What happened to one item of ``tether.map``."""

    index: int
    ok: bool
    value: T | None = None
    error: str | None = None  #: "Type: message" when the item failed
    error_type: str | None = None


async def map(
    fn: Callable[[Any], Awaitable[T]], items: Iterable[Any], *, concurrency: int = 10
) -> list[ItemOutcome[T]]:
    """Apply ``fn`` (an activity, a child workflow, any async callable) to each item,
    at most ``concurrency`` at a time; return one outcome per item, in input order.

    A failing item (a poison input) never stops its siblings: it comes back as
    ``ok=False`` with its reason, and (for activities) sits in the dead-letter
    list. Items start in input order as slots free up, so replay is deterministic
    and no more than ``concurrency`` calls are in flight or buffered at once.
    """
    if concurrency < 1:
        raise ValueError("tether.map concurrency must be at least 1")
    pending = list(items)
    out: list[ItemOutcome[T] | None] = [None] * len(pending)
    running: dict[asyncio.Future[Any], int] = {}
    next_index = 0

    async def call(item: Any) -> T:
        inst = current_instance()
        if isinstance(fn, Activity) and inst is not None:
            # marked as an item: its dead letter may be replayed on its own
            value: T = await inst.schedule_activity(fn, (item,), {}, map_item=True)
            return value
        return await fn(item)

    def launch() -> None:
        nonlocal next_index
        while next_index < len(pending) and len(running) < concurrency:
            fut = asyncio.ensure_future(call(pending[next_index]))
            running[fut] = next_index
            next_index += 1

    launch()
    try:
        while running:
            done, _ = await asyncio.wait(list(running), return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=running.__getitem__):  # set order is not replay-safe
                i = running.pop(fut)
                exc = fut.exception()
                if exc is None:
                    out[i] = ItemOutcome(index=i, ok=True, value=fut.result())
                else:
                    out[i] = ItemOutcome(
                        index=i,
                        ok=False,
                        error=f"{type(exc).__name__}: {exc}",
                        error_type=type(exc).__name__,
                    )
            launch()
    except asyncio.CancelledError:
        for fut in running:
            fut.cancel()
        raise
    return [o for o in out if o is not None]


def idempotency_key(label: str) -> str:
    """A key for ``label`` that is the same on every replay of this run: pass it to a
    downstream system so a retried or replayed step is applied once."""
    inst = _instance("idempotency_key")
    return f"{inst.run_id}:{label}"


def patched(patch_id: str) -> bool:
    """True if this run takes the new code path of change ``patch_id``.

    Deploy changed workflow code as ``if tether.patched("x"): new() else: old()``:
    runs in flight that already passed this point without the change replay the
    old branch; new runs record a marker and take the new one. Once no run that
    may take the old branch is left, switch to ``tether.deprecate_patch("x")``
    and delete the old branch.
    """
    return _instance("patched").patched(patch_id)


def deprecate_patch(patch_id: str) -> None:
    """Keep replaying runs that recorded ``patch_id`` after the old branch is removed."""
    _instance("deprecate_patch").patched(patch_id, deprecated=True)


def on_query(name: str, handler: Callable[..., Any] | None = None) -> Any:
    """Register a read-only query handler (``tether.on_query("stage", fn)`` or as a
    decorator). ``app.query(run_id, name, *args)`` answers it from the run's state, which
    the caller rebuilds by replaying the run's history up to its last workflow task: no
    event is recorded and no worker is asked. A handler must only read (its changes are
    thrown away) and must not await."""
    inst = _instance("on_query")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        inst.queries[name] = fn
        return fn

    return register if handler is None else register(handler)


def on_update(
    name: str,
    handler: Callable[..., Any] | None = None,
    *,
    validate: Callable[..., Any] | None = None,
) -> Any:
    """Register an update handler: ``app.update(run_id, name, *args)`` runs it in the run
    and returns its result. ``validate(*args)`` (raise to refuse) runs first in the
    caller, against the replayed state: a refused update records nothing and the caller
    gets the error. An accepted one is recorded (a request and a Marker with its
    outcome), then validated again and run when the run reaches it. Handlers may be
    ``async`` (they can then call activities and children; they interleave with the
    code at awaits). JSON arguments and results."""
    inst = _instance("on_update")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        inst.register_update(name, fn, validate)
        return fn

    return register if handler is None else register(handler)
