"""Sagas: register an undo after each step succeeds, run them in reverse on failure.

    async with tether.saga() as saga:
        hold = await saga.step(reserve_seat(flight), undo=release_seat)
        await saga.step(charge_card(card, price), undo=refund)
        await book(hold)

If anything in the block raises (including the run's cancellation or deadline),
the undos registered so far run newest first, each awaited in turn, to the end even
if a cancel or the deadline comes during the rollback (undos are
normally activities, so each has its own retries and idempotency key, and the
rollback is recorded in history: a crash mid-rollback resumes it). If every undo
succeeds the original error propagates; if any undo fails, the remaining undos
still run and ``CompensationFailed`` carries both the original error and every
undo failure, which ends the run ``needs_intervention`` and calls the App's
alert hook.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

from .._definitions import running
from .._errors import TetherError

T = TypeVar("T")

#: the patch marker a saga records when its rollback begins: the rollback then runs to
#: its end whatever cancel or deadline comes meanwhile (histories whose rollback began
#: without it replay the old way: a cancel then cut the undo in flight)
SHIELDED_ROLLBACK = "tether.saga-rollback-shielded"


class CompensationFailed(TetherError):
    """A saga's compensation failed; the run needs an operator."""

    def __init__(self, original: str, failures: list[dict[str, str]]) -> None:
        self.original = original
        self.failures = failures
        listed = "; ".join(f"{f['undo']}: {f['error']}" for f in failures)
        super().__init__(
            f"compensation failed after {original}: {len(failures)} undo step(s) failed "
            f"({listed}); the run needs an operator to finish the rollback"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.original, self.failures))


class Saga:
    """Collects undo steps; see the module docstring."""

    def __init__(self) -> None:
        self._undos: list[tuple[str, Callable[[], Awaitable[Any]]]] = []
        self.compensated: list[str] = []  #: undo names that ran successfully, in order
        #: the cancellation (a cancel request, the deadline) that came during the
        #: rollback: raised once every undo has run
        self.interrupted: asyncio.CancelledError | None = None

    async def step(
        self,
        action: Awaitable[T],
        undo: Callable[[T], Awaitable[Any]] | None = None,
        *,
        name: str | None = None,
    ) -> T:
        """Await ``action``; once it succeeded, register ``undo(result)`` to compensate it."""
        result = await action
        if undo is not None:
            label = name or getattr(undo, "name", None) or getattr(undo, "__name__", "undo")
            self._undos.append((str(label), lambda: undo(result)))
        return result

    def add_undo(self, undo: Callable[[], Awaitable[Any]], *, name: str | None = None) -> None:
        """Register a compensation directly (called with no arguments)."""
        label = name or getattr(undo, "__name__", "undo")
        self._undos.append((str(label), undo))

    async def compensate(self) -> list[dict[str, str]]:
        """Run every registered undo, newest first; return the failures.

        A cancel or the deadline arriving meanwhile does not cut the rollback short (it
        is the cleanup they ask for): the undo in flight finishes and the rest run; the
        cancellation is kept in ``interrupted``."""
        failures: list[dict[str, str]] = []
        inst: Any = running.get()
        shielded = inst is not None and hasattr(inst, "patched") and inst.patched(SHIELDED_ROLLBACK)
        while self._undos:
            label, undo = self._undos.pop()
            try:
                if shielded:
                    await self._through_cancels(undo())
                else:
                    await undo()
            except Exception as exc:
                failures.append({"undo": label, "error": f"{type(exc).__name__}: {exc}"})
                _count(label, "failed")
            else:
                self.compensated.append(label)
                _count(label, "ok")
        return failures

    async def _through_cancels(self, undo: Awaitable[Any]) -> Any:
        """Await ``undo`` to its end: a cancellation of the run's code is kept, not passed
        on to the undo (its activity is not told to stop)."""
        step = asyncio.ensure_future(undo)
        while True:
            try:
                return await asyncio.shield(step)
            except asyncio.CancelledError as exc:
                if step.cancelled():
                    raise
                self.interrupted = self.interrupted or exc

    async def __aenter__(self) -> Saga:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None:
            self._undos.clear()
            return False
        failures = await self.compensate()
        if failures:
            original = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise CompensationFailed(original, failures) from exc
        if self.interrupted is not None and not isinstance(exc, asyncio.CancelledError):
            raise self.interrupted  # the run was cancelled while it rolled back: it ends so
        return False


def _count(undo: str, outcome: str) -> None:
    """Count a compensation's outcome once: when it is new, not when a replay meets it."""
    inst: Any = running.get()
    if inst is not None and hasattr(inst, "count"):
        inst.count("tether_compensations", (inst.workflow.name, undo, outcome))


def saga() -> Saga:
    """Start a saga block: ``async with tether.saga() as saga: ...``."""
    return Saga()
