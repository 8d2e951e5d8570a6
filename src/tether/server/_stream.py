"""Server-Sent Events of a run's history, woken by the store's commit notifications.

One history listener serves every open stream of the service: a commit that appends
to a run's history wakes the streams following that run (in this process through the
store's listeners; on PostgreSQL, other processes' commits arrive by LISTEN/NOTIFY).
A woken stream reads its run's new events once. Commits the store cannot announce
(another process on the same SQLite file) are caught by a slow re-read.

Streamed model output (``ai.complete(..., stream=True)``) is not history: the store
passes it on as it comes (``Store.publish``) and streams send it as ``token`` events
without an ``id`` (a reconnect does not get them again; the final answer is in the
history). On SQLite only a worker in the same process reaches the stream.

When the server begins to stop (``EventHub.close``: SIGTERM), every open stream ends at
once with a ``closing`` message (``retry:`` set), so no follower holds the process
past its grace; the client reconnects, with ``Last-Event-ID``, to another replica or
the restarted server and misses nothing. A stream whose store read fails (an outage:
``StoreError``) ends the same way, its reason ``store unavailable``, with one warning
in the log: once a stream's headers are sent no ``503`` can be answered, and a
response cut off mid-stream is an error to every client.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request

from .._app import App
from .._errors import StoreError, TetherError
from .._history import Event
from ._models import event_view
from ._problems import problem_of

log = logging.getLogger("tether.server")

T = TypeVar("T")

#: how often a stream re-reads without a wake-up (commits no notification reaches)
SAFETY_READ = 2.0
#: how long a quiet stream waits before it sends a keep-alive comment
KEEPALIVE = 15.0
#: the shortest time between two ``changed`` messages of a changes stream
CHANGES_EVERY = 1.0
#: run ids a changes stream keeps between two looks (a follower bound to a tenant looks
#: them up; beyond, its page's slower poll shows the change)
CHANGES_KEPT = 50


def _closing(reason: str) -> str:
    """The last message of a stream the server ends: reconnect in 2 s (``retry``)."""
    text = f"{reason}: reconnect (with Last-Event-ID) to resume"
    data = json.dumps({"reason": text}, separators=(",", ":"))
    return f"retry: 2000\nevent: closing\ndata: {data}\n\n"


#: the last message of a stream the server ended because it is stopping
CLOSING = _closing("the server is stopping")
#: the last message of a stream ended because the store could not be read (an outage)
STORE_UNAVAILABLE = _closing("store unavailable")


class ServerClosing(Exception):
    """The server began to stop while a request waited (``EventHub.unless_closing``)."""


class EventHub:
    """Wakes the streams that follow a run when a commit appends to its history."""

    def __init__(self, app: App) -> None:
        self._app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._following: dict[str, set[asyncio.Event]] = {}
        self._tokens: dict[asyncio.Event, list[dict[str, Any]]] = {}
        #: streams of "some run changed" (the console's runs list): the runs touched since
        self._watching: dict[asyncio.Event, set[str]] = {}
        #: the server is stopping: streams end (with ``CLOSING``), new ones at once
        self.closing = False
        self._closed = asyncio.Event()

    def start(self) -> None:
        """Begin listening (call on the service's event loop)."""
        self._loop = asyncio.get_running_loop()
        self.closing = False
        self._closed = asyncio.Event()
        self._app.store.add_history_listener(self._on_commit)
        self._app.store.add_stream_listener(self._on_item)

    def stop(self) -> None:
        """Stop listening."""
        self._app.store.remove_history_listener(self._on_commit)
        self._app.store.remove_stream_listener(self._on_item)

    def close(self) -> None:
        """The server is stopping: end every open stream now (call on the loop)."""
        self.closing = True
        self._closed.set()
        for followers in self._following.values():
            for ev in followers:
                ev.set()
        for ev in self._watching:
            ev.set()

    async def unless_closing(self, work: Awaitable[T], settled: asyncio.Event | None = None) -> T:
        """``work``'s outcome, or ``ServerClosing`` (``work`` cancelled) once the server
        is stopping: a long poll answers "not yet" at once, not holding the shutdown.

        With ``settled``, ``work`` is cancelled only once that is set (an update is
        recorded: cut before, whether it was is unknown) or it ends by itself."""
        task = asyncio.ensure_future(work)
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait({task, closed}, return_when=asyncio.FIRST_COMPLETED)
            if settled is not None and not task.done():
                done = asyncio.ensure_future(settled.wait())
                try:
                    await asyncio.wait({task, done}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    done.cancel()
        finally:
            closed.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
        if task.cancelled():
            raise ServerClosing()
        return task.result()

    def _on_item(self, run_id: str, item: dict[str, Any]) -> None:
        if self._following and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._hand, run_id, item)

    def _hand(self, run_id: str, item: dict[str, Any]) -> None:
        for ev in self._following.get(run_id, ()):
            self._tokens.setdefault(ev, []).append(item)
            ev.set()

    def _on_commit(self, runs: set[str]) -> None:
        # any thread: hand over to the loop, and only while some stream follows a run
        # (or watches for changes)
        loop = self._loop
        if (self._following or self._watching) and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, runs)

    def _wake(self, runs: set[str]) -> None:
        for run_id in runs:
            for ev in self._following.get(run_id, ()):
                ev.set()
        for ev, touched in self._watching.items():
            if len(touched) < CHANGES_KEPT:
                touched.update(runs)
            ev.set()

    async def changes(
        self, request: Request, sees: Callable[[set[str]], Awaitable[bool]]
    ) -> AsyncIterator[str]:
        """``changed`` SSE messages, at most one per ``CHANGES_EVERY`` seconds, whenever a
        commit appended to the history of a run that ``sees`` (given the run ids touched)
        says the follower may see; keep-alive comments between."""
        woken = asyncio.Event()
        touched: set[str] = set()
        self._watching[woken] = touched
        try:
            yield ": following\n\n"
            while not await request.is_disconnected():
                if self.closing:
                    yield CLOSING
                    return
                try:
                    await asyncio.wait_for(woken.wait(), KEEPALIVE)
                except TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                woken.clear()
                runs = set(touched)
                touched.clear()
                if self.closing:
                    continue
                try:
                    seen = await sees(runs)
                except StoreError as exc:  # headers are sent: no 503, end it cleanly
                    log.warning("changes event stream ended: store unavailable: %s", exc)
                    yield STORE_UNAVAILABLE
                    return
                if seen:
                    yield "event: changed\ndata: {}\n\n"
                    await asyncio.sleep(CHANGES_EVERY)  # what commits meanwhile waits
        finally:
            self._watching.pop(woken, None)

    async def stream(
        self, run_id: str, after: int, request: Request, payloads: bool = True
    ) -> AsyncIterator[str]:
        """The run's events after ``after`` as SSE messages (``id`` is the event's seq),
        then new ones as they are committed, until the run has ended and all was sent
        (without ``payloads``: events withheld as ``event_view`` does, no model tokens)."""
        woken = asyncio.Event()
        self._following.setdefault(run_id, set()).add(woken)
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        streaming: dict[tuple[Any, Any], dict[str, Any]] = {}  # attempts not ended yet
        try:
            while True:
                woken.clear()  # before the read: a commit during it wakes the next wait
                for item in self._tokens.pop(woken, ()):
                    if payloads:
                        yield _token(item, streaming)
                events = await self._app.store.read_history(run_id, after)
                for e in events:
                    after = e.seq
                    yield _message(e, payloads)
                if events:
                    quiet_since = loop.time()
                else:
                    info = await self._app._peek(run_id, follow=False)
                    if info.is_finished:
                        # the run may have ended between the read above and this look:
                        # read once more, so its last events are sent before the end
                        for e in await self._app.store.read_history(run_id, after):
                            after = e.seq
                            yield _message(e, payloads)
                        for item in self._tokens.pop(woken, []) if payloads else ():
                            yield _token(item, streaming)
                        # a step still streaming was cut by the run's end (a hedge's
                        # loser, a step of a run cancelled): its own end may come after
                        for where in streaming.values():
                            yield _token({**where, "failed": "StepCancelled", "error": _CUT}, {})
                        if info.continued_to:
                            nxt = json.dumps({"next": info.continued_to})
                            yield f"event: continued\ndata: {nxt}\n\n"
                        return
                    if loop.time() - quiet_since > KEEPALIVE:
                        quiet_since = loop.time()
                        yield ": keep-alive\n\n"
                if await request.is_disconnected():
                    return
                if self.closing:  # after what was committed so far was sent
                    yield CLOSING
                    return
                try:
                    await asyncio.wait_for(woken.wait(), SAFETY_READ)
                except TimeoutError:
                    pass
        except StoreError as exc:
            # the headers are sent, so no 503 can be answered: end the stream with a
            # message (not a cut response); the client resumes from its last id
            log.warning("event stream of run %r ended: store unavailable: %s", run_id, exc)
            yield STORE_UNAVAILABLE
        except TetherError as exc:
            # the run was purged meanwhile, or a payload cannot be opened (a key the
            # keyring lacks): end with the problem the route would now answer
            log.warning("event stream of run %r ended: %s", run_id, exc)
            yield _error(exc)
        finally:
            self._tokens.pop(woken, None)
            followers = self._following.get(run_id)
            if followers is not None:
                followers.discard(woken)
                if not followers:
                    del self._following[run_id]


#: what a streamed attempt the run's end cut off says (its own end came too late)
_CUT = (
    "the run ended while this step streamed (a hedge's loser, or a step of a run "
    "cancelled): its text is void, nothing to do"
)


def _error(exc: BaseException) -> str:
    """The last message of a stream ended by ``exc``: the problem document the route
    would answer (a client that reconnects gets that answer)."""
    status, title = problem_of(exc)
    data = json.dumps({"status": status, "title": title, "detail": str(exc)}, separators=(",", ":"))
    return f"event: error\ndata: {data}\n\n"


def _message(event: Event, payloads: bool = True) -> str:
    """One history event as an SSE message (``id`` is its seq, for reconnects)."""
    payload = json.dumps(event_view(event, payloads).model_dump(), separators=(",", ":"))
    return f"id: {event.seq}\nevent: {event.type.value}\ndata: {payload}\n\n"


def _token(item: dict[str, Any], streaming: dict[tuple[Any, Any], dict[str, Any]]) -> str:
    """A streamed item as an SSE ``token`` message; ``streaming`` keeps each step's
    attempt that sent text and has not ended (``done``, ``failed``) yet."""
    key = (item.get("step"), item.get("model"))
    if "delta" in item:
        streaming[key] = {k: v for k, v in item.items() if k not in ("offset", "delta")}
    elif "done" in item or "failed" in item:
        now = streaming.get(key)
        if now is not None and now.get("attempt") == item.get("attempt"):
            del streaming[key]  # (an earlier attempt's end leaves the later one on)
    return f"event: token\ndata: {json.dumps(item, separators=(',', ':'))}\n\n"
