"""A deterministic asyncio event loop for one workflow instance.

Workflow code is ordinary ``async`` Python, so it needs an event loop, but not
one with sockets, threads or a wall clock. This loop only keeps a FIFO of ready
callbacks: it runs them until none is left and then the instance is *idle*,
waiting on durable outcomes. Because ``asyncio.Task``, ``Future``, ``gather``
and ``wait`` only ever ask a loop for ``call_soon`` and ``create_future``, they
work unchanged and in a reproducible order. Anything that needs real time or
I/O (``asyncio.sleep(1)``, ``wait_for``, executors) fails with a message naming
the durable replacement.

Design log: the alternative of driving generators (``yield ctx.call(...)``)
was rejected because users could not use ``asyncio.gather``/``create_task`` or
``async with``; re-executing the function per step (numbering calls) was
rejected because concurrent branches then need a hand-written scheduler anyway.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import weakref
from asyncio import events
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn, TypeVar

from .._errors import TetherError

_T = TypeVar("_T")


class WorkflowSandboxError(TetherError, RuntimeError):
    """Workflow code used something that is not deterministic (wall clock, threads, I/O)."""


class DeterministicLoop(asyncio.AbstractEventLoop):
    """Runs ready callbacks in FIFO order; time comes from the workflow clock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._ready: collections.deque[asyncio.Handle] = collections.deque()
        self._clock = clock
        self._closed = False
        self.errors: list[dict[str, Any]] = []
        #: this loop's own tasks (asyncio.all_tasks would scan every loop in the process)
        self.tasks: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()

    # scheduling ----------------------------------------------------------

    def call_soon(  # type: ignore[override]
        self,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        handle = asyncio.Handle(callback, args, self, context)
        self._ready.append(handle)
        return handle

    def call_soon_threadsafe(  # type: ignore[override]
        self,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        return self.call_soon(callback, *args, context=context)

    def call_later(  # type: ignore[override]
        self, delay: float, callback: Callable[..., object], *args: Any, **_: Any
    ) -> NoReturn:
        raise WorkflowSandboxError(
            "workflow code asked the event loop for a wall-clock timer (asyncio.sleep with a "
            "delay, asyncio.wait_for, asyncio.timeout...); use tether.sleep for a durable timer "
            "and tether.first(step, tether.sleep(...)) for a deadline"
        )

    def call_at(  # type: ignore[override]
        self, when: float, callback: Callable[..., object], *args: Any, **_: Any
    ) -> NoReturn:
        self.call_later(0, callback)

    def time(self) -> float:
        return self._clock()

    def create_future(self) -> asyncio.Future[Any]:
        return asyncio.Future(loop=self)

    def create_task(  # type: ignore[override]
        self,
        coro: Coroutine[Any, Any, _T],
        *,
        name: str | None = None,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[_T]:
        task = asyncio.Task(coro, loop=self, name=name, context=context)
        self.tasks.add(task)
        return task

    def run_in_executor(self, executor: Any, func: Callable[..., _T], *args: Any) -> NoReturn:  # type: ignore[override]
        raise WorkflowSandboxError(
            "workflow code cannot run threads or blocking calls; put the work in an activity"
        )

    # state ---------------------------------------------------------------

    def get_debug(self) -> bool:
        return False

    def is_running(self) -> bool:
        return True

    def is_closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        self._ready.clear()

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        self.errors.append(context)

    def default_exception_handler(self, context: dict[str, Any]) -> None:
        self.errors.append(context)

    def get_exception_handler(self) -> None:
        return None

    def get_task_factory(self) -> None:
        return None

    # driving -------------------------------------------------------------

    def run_until_idle(self) -> None:
        """Run ready callbacks until none is left, with this loop as the running loop."""
        previous = events._get_running_loop()
        events._set_running_loop(self)
        try:
            ready = self._ready
            while ready:
                handle = ready.popleft()
                if not handle.cancelled():
                    handle._run()
        finally:
            events._set_running_loop(previous)
