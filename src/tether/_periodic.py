"""A background job on the running loop, repeated every few seconds until stopped,
that survives its own failures (a store hiccup must not end it for good)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from ._errors import StoreError


class Periodic:
    """Calls ``job()`` every ``interval()`` seconds; failures are logged as ``what``."""

    def __init__(
        self,
        name: str,
        job: Callable[[], Awaitable[object]],
        interval: Callable[[], float],
        log: logging.Logger,
        what: str,
    ) -> None:
        self._name, self._job, self._interval, self._log, self._what = (
            name,
            job,
            interval,
            log,
            what,
        )
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start on the running loop."""
        self._task = asyncio.create_task(self._loop(), name=self._name)

    async def stop(self) -> None:
        """Stop (waits for the job in progress to be cancelled)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            try:
                await self._job()
            except StoreError as exc:  # an outage: its message says it all, every time
                self._log.warning("%s failed: %s", self._what, exc)
            except Exception:
                self._log.warning("%s failed", self._what, exc_info=True)
            await asyncio.sleep(self._interval())
