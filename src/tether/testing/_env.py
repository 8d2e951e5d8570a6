"""A test environment with a virtual clock that skips time while every run waits."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

from .._app import App
from .._errors import ConfigurationError
from .._policy import seconds
from .._worker import Worker

#: skip-loop rounds (5 ms each) a lease held by the Env's own worker must outlast before
#: the clock may jump to its expiry (the worker lost track of the task)
OWN_LEASE_ROUNDS = 200


def _carry_leases(tx: Any, worker_id: str, by: float) -> None:
    """Move the unexpired leases of ``worker_id`` ``by`` seconds later (see Env.advance)."""
    tx.execute(
        "UPDATE tasks SET available_at = available_at + ? "
        "WHERE lease_owner = ? AND available_at > ?",
        (by, worker_id, tx.now),
    )


class SimulatedCrash(BaseException):
    """Raised by the store of a worker that has 'died'; nothing it asks for is written."""


class VirtualClock:
    """A clock that only moves when told to (or when the Env skips ahead)."""

    def __init__(self, start: float | None = None) -> None:
        if start is not None and (
            isinstance(start, bool)
            or not isinstance(start, int | float)
            or not math.isfinite(start)
        ):
            raise ConfigurationError(
                f"start= must be epoch seconds, a finite number (got {start!r})"
            )
        self.now = time.time() if start is None else float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, delta: float) -> None:
        """Move the clock forward by ``delta`` seconds."""
        if delta < 0:
            raise ValueError("the clock never goes back")
        self.now += delta


class Env:
    """Run an App's workflows in-process on a virtual clock.

    While the worker has nothing in flight and nothing is ready, the clock jumps
    to the next due timer, retry or deadline, so a workflow that sleeps for 30
    days finishes in milliseconds; ``advance()`` moves time explicitly. Use an App
    on a temporary store: the Env replaces its store's clock while it runs.

        async with tether.testing.Env(app) as env:
            run = await app.start(wf)
            assert await run.result(timeout=5) == ...
    """

    def __init__(
        self, app: App, *, skip_time: bool = True, start: float | None = None, **worker: Any
    ) -> None:
        self.app = app
        self.clock = VirtualClock(start)
        self.skip_time = skip_time
        self._worker_options = {"poll_interval": 0.02, **worker}
        self.worker: Worker | None = None
        self._skipper: asyncio.Task[None] | None = None
        self._real_clock: Any = None
        #: how far the clock has jumped by itself, in seconds
        self.skipped = 0.0

    async def __aenter__(self) -> Env:
        store = self.app.store
        self._real_clock = store.clock
        store.clock = self.clock
        self.worker = self.app.worker(**self._worker_options)
        await self.worker.start()
        if self.skip_time:
            self._skipper = asyncio.create_task(self._skip_loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._skipper is not None:
            self._skipper.cancel()
        if self.worker is not None:
            await self.worker.stop(grace=2.0)
        self.app.store.clock = self._real_clock

    async def advance(self, duration: float | Any) -> None:
        """Move virtual time forward and let due work run.

        The Env's own worker lives through the jump: the leases it holds move forward
        with the clock, as its renewals would have moved them, so the work it is doing
        is not taken from it and run a second time. (A worker the test killed, or whose
        store it crashed, keeps nothing: its leases expire.)
        """
        by = seconds(duration, "advance") or 0.0
        w = self.worker
        if by > 0 and w is not None and w.running_loop() is not None:
            with contextlib.suppress(Exception, SimulatedCrash):
                await self.app.store._do(_carry_leases, w.id, by)  # type: ignore[attr-defined]
        self.clock.advance(by)
        self._wake()
        await asyncio.sleep(0)

    def _wake(self) -> None:
        w = self.worker
        if w is not None and w._wake is not None:
            w._wake.set()

    async def _skip_loop(self) -> None:
        store = self.app.store
        assert self.worker is not None
        idle_rounds = own_rounds = 0
        while True:
            await asyncio.sleep(0.005)
            if self.worker._inflight:
                idle_rounds = 0
                continue
            worker = self.worker
            try:
                due = await store.next_due(worker.queues)
                others = (
                    None
                    if due is None or due <= self.clock.now
                    else await store.next_due(worker.queues, exclude_owner=worker.id)
                )
            except (Exception, SimulatedCrash):
                continue  # the store is briefly unavailable (or a test crashed it)
            if due is None or due <= self.clock.now or worker._inflight:
                idle_rounds = own_rounds = 0
                continue
            if others is not None and others <= due:
                own_rounds = 0
            else:
                # the next thing due is the lease of a task our live worker holds but
                # has not started yet (claimed, or leased by a commit, a moment ago):
                # jumping there would take it from the worker. Wait; only a lease it
                # still holds after a second of real time is treated as lost.
                own_rounds += 1
                if own_rounds < OWN_LEASE_ROUNDS:
                    idle_rounds = 0
                    continue
            idle_rounds += 1
            if idle_rounds < 2:  # idle twice in a row: nothing is about to become ready
                continue
            self.skipped += due - self.clock.now
            self.clock.now = due
            idle_rounds = own_rounds = 0
            self._wake()
