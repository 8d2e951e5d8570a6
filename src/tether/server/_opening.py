"""Opening the service's store: at its start or, while a PostgreSQL store cannot be
opened (the database is down, restarting, or not up yet when the service is), again
and again in the background.

Until the store opens, the service runs: ``/healthz`` answers, ``/readyz`` and every
route that needs the store answer ``503`` with ``Retry-After`` (``StoreOpening.check``),
and an attempt is made every ``FIRST_RETRY`` seconds, doubling up to ``MAX_RETRY``, with
one log line each. Once the store opens, what needs it starts (``begin``: the event hub,
the webhook relay, in-process workers, metrics, alerts) and the service serves
everything, without a restart. A store that is not a PostgreSQL URL (a SQLite path that
cannot be opened is the setup's fault, which waiting does not mend) fails the start as
before.

So does a PostgreSQL store that waiting will not mend (``StoreError.permanent``: the
server refuses the database or role the URL names, or the password; the URL is
malformed): logged once, as an error, with what to do. If that is only learnt later (the
server was down at the start, then answered), the service stays up: ``/readyz`` and the
routes say the store cannot be opened and why, the log says it once, and an attempt is
made every ``PERMANENT_RETRY`` seconds (a database or role created, or a grant, is taken
without a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .._app import App
from .._errors import StoreError
from ..store._open import _PG_SCHEMES

log = logging.getLogger("tether.server")

#: seconds before the second attempt to open the store (then doubling)
FIRST_RETRY = 1.0
#: the longest wait between two attempts to open the store (seconds)
MAX_RETRY = 5.0
#: the longest a stop waits for an attempt in progress (a connect has its own timeout)
ATTEMPT_WAIT = 15.0
#: seconds between attempts once the store answered that it cannot be opened
PERMANENT_RETRY = 30.0
#: the log's line for each failed attempt (the store's message names its URL)
_CANNOT = "cannot open the store (attempt %d; routes answer 503 until it opens; next in %g s): %s"
#: the log's line when the store cannot be opened and waiting will not mend it
_NEVER = "cannot open the store, and waiting will not mend it: %s (%s)"


class StoreOpening:
    """Opens ``app``'s store, then calls ``begin`` (resumable: after a ``StoreError`` it
    is called again and goes on from what it did not do); ``ready`` once both are done.
    ``failed`` is called if ``begin`` fails otherwise after a background opening (the
    service cannot serve: it should stop)."""

    def __init__(
        self, app: App, begin: Callable[[], Awaitable[None]], failed: Callable[[], None]
    ) -> None:
        self._app = app
        self._begin = begin
        self._failed = failed
        #: the store is open and what needs it started: every route may be served
        self.ready = False
        self._task: asyncio.Task[None] | None = None
        self._attempt: asyncio.Future[Any] | None = None
        self._beginning = False
        #: why the store cannot be opened, when waiting will not mend it (no URL in it)
        self.failure: str | None = None

    async def start(self) -> None:
        """Open the store and ``begin``; if a PostgreSQL store cannot be opened now,
        return at once and go on trying in the background. Other errors raise."""
        self.ready = False
        spec = self._app._store_spec
        if not (isinstance(spec, str) and spec.startswith(_PG_SCHEMES)):
            _ = self._app.store  # as ever: on this loop, errors fail the start
            await self._begin()
            self.ready = True
            return
        try:
            await self._open_and_begin()
        except StoreError as exc:
            if exc.permanent:  # fix the setup, then start again
                log.error(_NEVER, exc, "the service does not start")
                raise
            log.warning(_CANNOT, 1, FIRST_RETRY, exc)
            self._task = asyncio.create_task(self._keep_trying(), name="tether-store-opening")
            return
        self.ready = True

    def check(self) -> None:
        """Raise ``StoreError`` (a ``503`` with ``Retry-After``) while not ``ready``."""
        if self.failure is not None:
            err = StoreError(f"the store cannot be opened: {self.failure}")
            err.permanent = self.failure
            raise err
        if not self.ready:
            raise StoreError(
                "the store is not open yet (the service tries to open it in the "
                "background: see the log's 'cannot open the store' lines)"
            )

    async def stop(self) -> None:
        """Stop trying (the service stops): an attempt in progress is waited for, so
        a store it opens is closed with the App."""
        task, self._task = self._task, None
        if task is None:
            return
        if not self._beginning:  # begin is let finish: it sees the service stopping
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        attempt = self._attempt
        if attempt is not None and not attempt.done():
            await asyncio.wait({attempt}, timeout=ATTEMPT_WAIT)

    async def _open_and_begin(self) -> None:
        # in a thread: connecting may take its timeout, and the loop serves meanwhile
        self._attempt = asyncio.get_running_loop().run_in_executor(None, lambda: self._app.store)
        await asyncio.shield(self._attempt)
        self._beginning = True
        try:
            await self._begin()
        finally:
            self._beginning = False

    async def _keep_trying(self) -> None:
        delay, attempt = FIRST_RETRY, 1
        while True:
            await asyncio.sleep(delay)
            attempt += 1
            try:
                await self._open_and_begin()
            except StoreError as exc:
                if exc.permanent:  # said once (again if it changes), tried now and then
                    if exc.permanent != self.failure:
                        log.error(
                            _NEVER, exc, f"/readyz says so; tried again every {PERMANENT_RETRY:g} s"
                        )
                    self.failure, delay = exc.permanent, PERMANENT_RETRY
                    continue
                self.failure = None
                delay = min(delay * 2, MAX_RETRY)
                log.warning(_CANNOT, attempt, delay, exc)
                continue
            except Exception:
                log.exception("the store opened, but the service could not start: stopping")
                self._failed()
                return
            self.failure = None
            self.ready = True
            log.info("store opened (attempt %d): serving every route", attempt)
            return
