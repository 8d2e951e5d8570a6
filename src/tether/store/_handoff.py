"""Handing a writer thread's results back to the callers' event loops.

Both store runners (SQLite and PostgreSQL) queue operations to writer threads; a
batch's results are delivered to each waiting event loop in ONE thread-safe call,
not one wake-up per operation (as ``asyncio.wrap_future`` would), which saves a
self-pipe write and a loop iteration per operation under group commit.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: (caller's future, value, error) for one operation of a batch
Outcome = tuple[Any, Any, BaseException | None]


class LoopFuture:
    """An asyncio caller waiting on a writer thread, resolved on its own loop.

    The results of one batch are handed to each loop in one thread-safe call, not
    one wake-up per operation (as ``asyncio.wrap_future`` would).
    """

    __slots__ = ("fut", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any]) -> None:
        self.loop = loop
        self.fut = fut

    def set_running_or_notify_cancel(self) -> bool:
        """False if the caller was cancelled before its operation ran (it is skipped)."""
        return not self.fut.cancelled()

    def done(self) -> bool:
        """Whether the caller's future is resolved (read from the writer thread)."""
        return self.fut.done()


def deliver(results: list[Outcome]) -> None:
    """Resolve each caller's future: sync ones directly, async ones per loop in one call."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}
    for fut, value, error in results:
        if isinstance(fut, LoopFuture):
            by_loop.setdefault(fut.loop, []).append((fut.fut, value, error))
        elif fut.done():
            continue
        elif error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, items)
        except RuntimeError:
            pass  # that loop is closed: nobody is waiting any more


def _resolve(items: list[Outcome]) -> None:
    for fut, value, error in items:
        if fut.done():
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
