"""What a running activity can learn about itself: its step, attempt, idempotency
key, and whether its run was cancelled; and how it renews its lease (heartbeat)."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._errors import TetherError
from ._serde import encode

if TYPE_CHECKING:
    from ._history import Task
    from .store.base import Store

_ctx: contextvars.ContextVar[ActivityContext | None] = contextvars.ContextVar(
    "tether_activity_context", default=None
)


class NotInActivityError(TetherError, RuntimeError):
    """``activity_context()`` was called outside an activity run by a worker."""


@dataclass(kw_only=True)
class ActivityContext:
    """Facts about the current activity attempt."""

    run_id: str
    step: int
    name: str
    #: 1, 2, ... within one run of the step's retry policy; not a "first time" test: a
    #: graceful hand-off keeps the number and ``app.retry`` starts again at 1 (ask the
    #: downstream system by ``idempotency_key`` instead)
    attempt: int
    #: stable across every attempt and redelivery of this step: ``run_id:step``
    idempotency_key: str
    #: the details of the last heartbeat of an earlier attempt, to resume long work
    heartbeat_details: Any = None
    #: one key per item for a batched call (``tether.Batch``), in the order of the
    #: items list; for any other call, just ``(idempotency_key,)``
    idempotency_keys: tuple[str, ...] = ()
    task: Task | None = field(repr=False)
    _store: Store | None = field(repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(repr=False)
    _lease: float = field(repr=False, default=30.0)
    #: the run's tenant, with per-tenant keys (``put_blob`` seals for it); else None
    _tenant: str | None = field(repr=False, default=None)
    #: set (from any thread) when the run was cancelled or the lease was lost; a plain
    #: flag rather than a threading.Event: nothing waits on it, and it is made per attempt
    _cancelled: bool = field(default=False, repr=False)
    _returned: bool = field(default=False, repr=False)  #: the function has returned
    _began: float = field(default=0.0, repr=False)  #: perf_counter when the attempt began
    #: monotonic time a heartbeat that then succeeded was sent (0: none yet): the lease
    #: of a step with a heartbeat timeout runs from there (see Worker._lease_left)
    _beat_at: float = field(default=0.0, repr=False)
    #: the attempt's time limit as the worker enforces it on an async activity: its
    #: ``asyncio.timeout``, its seconds, and which limit it is ("": the timeout per
    #: attempt; else the step's deadline, as ``_Plan.deadline_reason`` words it)
    _timeout: asyncio.Timeout | None = field(default=None, repr=False)
    _timeout_s: float = field(default=0.0, repr=False)
    _timeout_of: str = field(default="", repr=False)
    #: set by a stopping worker just before it cancels the attempt (handed back, its
    #: attempt given back: it did not fail)
    _stopping: bool = field(default=False, repr=False)
    #: what the activity said of its own timeout: recorded instead of the worker's words
    _timeout_note: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.idempotency_keys:
            self.idempotency_keys = (self.idempotency_key,)

    @property
    def is_cancelled(self) -> bool:
        """Whether the run was cancelled or this worker lost the task: stop and clean up."""
        return self._cancelled

    def _interruption(self) -> str | None:
        """Why this attempt's task is being cancelled, as far as its worker said:
        ``"cancelled"`` (its run or step was, or its lease was lost), ``"stopping"`` (its
        worker stops: the step is handed back), ``"timeout"`` (its time limit ran out),
        or None (something else cancelled it: its event loop closed, say)."""
        if self._cancelled:
            return "cancelled"
        if self._stopping:
            return "stopping"
        if self._timeout is not None and self._timeout.expired():
            return "timeout"
        return None

    def heartbeat(self, details: Any = None) -> None:
        """Renew the lease and record progress ``details`` (JSON-serialisable).

        Call it from long activities; ``is_cancelled`` turns true when the store
        answers that the run was cancelled or the lease is gone.
        """
        text = None if details is None else encode(details, "heartbeat details")
        if self._store is None or self.task is None or self._loop is None:
            return  # replayed by an operator outside a worker: nothing to renew
        coro = self._beat(text)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            fut: asyncio.Future[bool] = asyncio.ensure_future(coro)
            fut.add_done_callback(self._on_beat)
            return
        cf = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            if cf.result():
                self._cancelled = True
        except TetherError:
            self._cancelled = True

    def _beat(self, details: str | None) -> Coroutine[Any, Any, bool]:
        """The store call that renews this attempt's lease (True: cancelled or lost)."""
        return self._beat_one(details)

    async def _beat_one(self, details: str | None) -> bool:
        assert self._store is not None and self.task is not None
        sent = time.monotonic()
        cancelled = await self._store.heartbeat(self.task, self._lease, details)
        self._beat_at = sent  # the lease runs from before the call
        return cancelled

    def _on_beat(self, fut: asyncio.Future[bool]) -> None:
        if fut.cancelled():
            return
        if fut.exception() is not None or fut.result():
            self._cancelled = True


def activity_context() -> ActivityContext:
    """The context of the activity running now; raises outside an activity."""
    ctx = _ctx.get()
    if ctx is None:
        raise NotInActivityError(
            "tether.activity_context() is only available while a worker runs an activity"
        )
    return ctx


def set_context(ctx: ActivityContext | None) -> contextvars.Token[ActivityContext | None]:
    """Install ``ctx`` as the current activity context (worker use)."""
    return _ctx.set(ctx)


def reset_context(token: contextvars.Token[ActivityContext | None]) -> None:
    """Undo ``set_context`` (worker use, after an activity awaited inline)."""
    _ctx.reset(token)
