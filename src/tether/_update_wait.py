"""Waiting for the outcomes of updates: one reader of a run's history for all callers.

An update (``app.update``, an entity's ``call``) is a signal the run answers with an
``update`` Marker in its history. Each caller waits for the marker of its own
request. With many callers on one run (a hot entity) one follower per run reads each
new stretch of history once for all of them, woken by the commits that grow it (this
process's, and other processes' on PostgreSQL), with a slow re-read for commits
nobody announces (another process on the same SQLite file).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ._errors import ResultTimeoutError, UpdateFailedError, UpdateRejectedError
from ._history import UPDATE_MARKER, EventType, RunInfo

#: history events that end a run (its history then holds every outcome it will record)
ENDING_EVENTS = frozenset(
    {
        EventType.WORKFLOW_COMPLETED,
        EventType.WORKFLOW_FAILED,
        EventType.WORKFLOW_CANCELLED,
        EventType.WORKFLOW_TERMINATED,
        EventType.WORKFLOW_TIMED_OUT,
        EventType.CONTINUED_AS_NEW,
        EventType.WORKFLOW_NEEDS_INTERVENTION,
    }
)


class UpdateOutcomes:
    """An App's followers of the runs that callers wait on, one per run and event loop."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._followers: dict[tuple[asyncio.AbstractEventLoop, str], _Follower] = {}

    async def wait(
        self, run_id: str, update_id: str, name: str, timeout: float | None, after: int
    ) -> Any:
        """The outcome of update ``update_id`` (requested at seq ``after``) of ``run_id``:
        its result, or ``UpdateRejectedError`` / ``UpdateFailedError``; after
        ``timeout`` seconds ``ResultTimeoutError`` (the update still applies)."""
        loop = asyncio.get_running_loop()
        key = (loop, run_id)
        follower = self._followers.get(key)
        if follower is None or follower.done:
            follower = self._followers[key] = _Follower(
                self._app, run_id, loop, lambda: self._followers.pop(key, None)
            )
        outcome = follower.add(update_id, name, after)
        try:
            async with asyncio.timeout(timeout):
                return await outcome
        except TimeoutError:
            raise ResultTimeoutError(
                f"update {name!r} of run {run_id!r} has no outcome after {timeout}s; it is "
                "recorded and still applies when the run reaches it"
            ) from None
        finally:
            follower.discard(update_id, outcome)


class _Follower:
    """Reads one run's history as it grows and hands each update outcome to its caller."""

    def __init__(
        self, app: Any, run_id: str, loop: asyncio.AbstractEventLoop, on_idle: Any
    ) -> None:
        self._app, self._run_id, self._loop, self._on_idle = app, run_id, loop, on_idle
        self._waiting: dict[str, list[tuple[asyncio.Future[Any], str]]] = {}
        self._after: int | None = None  #: read the history from here
        self._rewind: int | None = None  #: a new caller asked from an earlier seq
        self._grew = asyncio.Event()
        self.done = False
        app.store.add_history_listener(self._on_growth)
        self._task = loop.create_task(self._follow(), name=f"tether-updates-{run_id}")

    def add(self, update_id: str, name: str, after: int) -> asyncio.Future[Any]:
        outcome: asyncio.Future[Any] = self._loop.create_future()
        self._waiting.setdefault(update_id, []).append((outcome, name))
        if self._after is None or after < self._after:
            self._rewind = after if self._rewind is None else min(self._rewind, after)
        self._grew.set()
        return outcome

    def discard(self, update_id: str, outcome: asyncio.Future[Any]) -> None:
        waiters = [w for w in self._waiting.get(update_id, ()) if w[0] is not outcome]
        if waiters:
            self._waiting[update_id] = waiters
        else:
            self._waiting.pop(update_id, None)

    def _on_growth(self, runs: set[str]) -> None:
        if self._run_id in runs:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._grew.set)

    async def _follow(self) -> None:
        delay = 0.01
        ended: RunInfo | None = None
        status_at = self._loop.time() + 1.0
        try:
            while self._waiting:
                self._grew.clear()
                if self._rewind is not None:
                    self._after = (
                        self._rewind if self._after is None else min(self._after, self._rewind)
                    )
                    self._rewind = None
                    delay = 0.01
                # the history says when the run ended (its last command is in it); a few
                # ends write no event (a queued run cancelled), so the run is read too,
                # now and then. Read before the history: an outcome recorded by the
                # commit that ended it is then found below, never missed.
                if self._loop.time() >= status_at:
                    ended = await self._app.get(self._run_id, follow=False)
                    status_at = self._loop.time() + 1.0
                for ev in await self._app.store.read_history(self._run_id, self._after or 0):
                    self._after = max(self._after or 0, ev.seq)
                    if ev.type in ENDING_EVENTS and ended is None:
                        ended = await self._app.get(self._run_id, follow=False)
                    if ev.type is EventType.MARKER and ev.data.get("marker") == UPDATE_MARKER:
                        self._settle(ev.data.get("value"))
                # a caller that joined meanwhile from an earlier seq (a retry whose
                # marker this reader already passed) is looked for there first
                if ended is not None and ended.is_finished and self._rewind is None:
                    self._fail_all(
                        f"the run ended ({ended.status.value}) before it handled the update"
                    )
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._grew.wait()
                delay = min(0.5, delay * 2)
        except Exception as exc:  # a store error: every caller hears it
            self._fail_all(None, exc)
        finally:
            self.done = True
            self._app.store.remove_history_listener(self._on_growth)
            self._on_idle()

    def _settle(self, value: Any) -> None:
        if not isinstance(value, dict):
            return
        for outcome, name in self._waiting.pop(str(value.get("id")), ()):
            if outcome.done():
                continue
            err = value.get("error")
            if err is None:
                outcome.set_result(value.get("result"))
            elif err.get("type") == "UpdateRejected":
                outcome.set_exception(
                    UpdateRejectedError(self._run_id, name, str(err.get("message")))
                )
            else:
                outcome.set_exception(
                    UpdateFailedError(
                        self._run_id, name, str(err.get("type")), str(err.get("message"))
                    )
                )

    def _fail_all(self, why: str | None, error: BaseException | None = None) -> None:
        """End every wait: rejected for ``why``, or with ``error``."""
        waiting, self._waiting = self._waiting, {}
        for waiters in waiting.values():
            for outcome, name in waiters:
                if not outcome.done():
                    outcome.set_exception(
                        error or UpdateRejectedError(self._run_id, name, str(why))
                    )
