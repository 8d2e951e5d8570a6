"""The blocking client: the App's operations for synchronous code (``SyncClient``).

Flask and Django views, scripts, notebooks and Celery tasks start and follow runs
from threads that have no event loop. ``tether.SyncClient(app)`` offers every client
operation of the async App under the same name, blocking. Each method is derived from the async
one (``_blocking(App.get)``), so the two sides cannot drift; a test pins that both
expose the same operations.

A call runs its coroutine on a small private loop thread the client starts on first
use and stops on ``close()``. A start still takes the fast path when an in-process
worker serves the run's queue (the run is stored with its first step): ``app.start``
hands it to that worker's loop, which the worker keeps running until the start is done
(``App._borrow_worker``). It works from any thread without a running event loop,
including a thread pool under one (``run_in_executor``, FastAPI's sync routes).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

from ._app import App
from ._errors import ConfigurationError
from .workflow._api import in_workflow

if TYPE_CHECKING:
    from ._app import Run

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")


class SyncRun(Generic[R]):
    """A handle on one run for synchronous code: ``result(timeout=)`` blocks."""

    def __init__(self, client: SyncClient, run: Run[R]) -> None:
        self._client = client
        self.run = run  #: the async handle
        self.run_id = run.run_id

    def __repr__(self) -> str:
        return f"<SyncRun {self.run_id}>"

    def result(self, timeout: float | timedelta | None = None) -> R:
        """Block until the run finishes and return its result (as ``Run.result``)."""
        return self._client._run("result", lambda: self.run.result(timeout))

    def info(self) -> Any:
        """The run's current state (``RunInfo``)."""
        return self._client._run("info", self.run.info)

    def signal(self, name: str, payload: Any = None, *, signal_id: str | None = None) -> bool:
        """Send the signal ``name`` to this run (``App.signal``)."""
        sent: bool = self._client._run(
            "signal", lambda: self.run.signal(name, payload, signal_id=signal_id)
        )
        return sent

    def cancel(self, reason: str | None = None) -> None:
        """Ask this run to cancel."""
        self._client._run("cancel", lambda: self.run.cancel(reason))


def _blocking(
    fn: Callable[Concatenate[App, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[SyncClient, P], T]:
    """The blocking form of an async App method: same name, arguments and result."""

    @functools.wraps(fn)
    def call(self: SyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(fn.__name__, lambda: fn(self._app, *args, **kwargs))

    return call


def _blocking_run(
    fn: Callable[Concatenate[App, P], Coroutine[Any, Any, Run[R]]],
) -> Callable[Concatenate[SyncClient, P], SyncRun[R]]:
    """The blocking form of an async App method that returns a ``Run``."""

    @functools.wraps(fn)
    def call(self: SyncClient, /, *args: P.args, **kwargs: P.kwargs) -> SyncRun[R]:
        run = self._run(fn.__name__, lambda: fn(self._app, *args, **kwargs))
        return SyncRun(self, run)

    return call


class _Portal:
    """A private event loop in a daemon thread, for calls when no worker loop runs."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="tether-sync-client", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def stop(self) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class SyncClient:
    """Every client operation of ``App``, blocking: ``client.start(...)`` and so on.

    Make one per App and share it between threads: ``client = tether.SyncClient(app)``.
    """

    def __init__(self, app: App) -> None:
        self._app = app
        self._portal: _Portal | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<SyncClient of {self._app!r}>"

    def _loop(self) -> asyncio.AbstractEventLoop:
        """Where calls run: the private loop. Not a worker's: it may stop (an ``app.run``
        in another thread ends) with a call pending, such as a ``result()`` wait."""
        with self._lock:
            if self._portal is None:
                self._portal = _Portal()
            return self._portal.loop

    def _run(self, name: str, make: Callable[[], Awaitable[T]]) -> T:
        """Run ``make()`` on a loop and block this thread until it is done."""
        if in_workflow():
            raise ConfigurationError(
                f"SyncClient.{name}() blocks, and workflow code must never block: "
                f"use `await app.{name}(...)` (or a child workflow or an activity) instead"
            )
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise ConfigurationError(
                f"SyncClient.{name}() was called on a thread that runs an event loop, which "
                f"it would block: use `await app.{name}(...)` there (or call it from a "
                "thread pool: `await loop.run_in_executor(None, ...)`)"
            )

        async def main() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(main(), self._loop()).result()

    # every client operation of App, blocking (tests/test_sync_client.py pins the list)
    start = _blocking_run(App.start)
    start_debounced = _blocking_run(App.start_debounced)
    get = _blocking(App.get)
    list = _blocking(App.list)
    history = _blocking(App.history)
    signal = _blocking(App.signal)
    cancel = _blocking(App.cancel)
    terminate = _blocking(App.terminate)
    suspend = _blocking(App.suspend)
    resume = _blocking(App.resume)
    retry = _blocking_run(App.retry)
    fork = _blocking_run(App.fork)
    dead_letters = _blocking(App.dead_letters)
    replay_dead_letter = _blocking(App.replay_dead_letter)
    resolve_dead_letter = _blocking(App.resolve_dead_letter)
    complete_step = _blocking_run(App.complete_step)
    pause_queue = _blocking(App.pause_queue)
    resume_queue = _blocking(App.resume_queue)
    queue_stats = _blocking(App.queue_stats)
    usage = _blocking(App.usage)
    approvals = _blocking(App.approvals)
    get_approval = _blocking(App.get_approval)
    decide = _blocking(App.decide)
    disable = _blocking(App.disable)
    enable = _blocking(App.enable)
    switches = _blocking(App.switches)
    audit_log = _blocking(App.audit_log)
    audit = _blocking(App.audit)
    purge = _blocking(App.purge)
    configure_retention = _blocking(App.configure_retention)
    reseal = _blocking(App.reseal)
    retentions = _blocking(App.retentions)
    erase_tenant = _blocking(App.erase_tenant)
    gc_blobs = _blocking(App.gc_blobs)
    query = _blocking(App.query)
    update = _blocking(App.update)
    entities = _blocking(App.entities)
    schedule = _blocking(App.schedule)
    schedules = _blocking(App.schedules)
    get_schedule = _blocking(App.get_schedule)
    pause_schedule = _blocking(App.pause_schedule)
    resume_schedule = _blocking(App.resume_schedule)
    trigger_schedule = _blocking_run(App.trigger_schedule)
    delete_schedule = _blocking(App.delete_schedule)

    def get_run(self, run_id: str) -> SyncRun[Any]:
        """A handle on an existing run (not checked until used)."""
        return SyncRun(self, self._app.get_run(run_id))

    def close(self) -> None:
        """Close the App's store and stop this client's private loop thread."""
        self._run("close", self._app.close)
        with self._lock:
            portal, self._portal = self._portal, None
        if portal is not None:
            portal.stop()
