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

An activity step still running when the block exits (a cancel, the deadline, a sibling
failing first in ``tether.gather``) is waited for, not told to stop, and undone if it
succeeded. A child run, timer or signal wait is cancelled, as is a step a cancel is aimed
at (the loser of ``tether.first``). ``continue_as_new`` leaves the block like a
``return``: the steps stand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

from .._definitions import running
from .._errors import ContinueAsNew, TetherError

T = TypeVar("T")

#: the patch marker a saga records when its rollback begins: the rollback then runs to
#: its end whatever cancel or deadline comes meanwhile (histories whose rollback began
#: without it replay the old way: a cancel then cut the undo in flight)
SHIELDED_ROLLBACK = "tether.saga-rollback-shielded"

#: the patch marker a saga records at its first activity step with an undo: from then on
#: such a step still in flight when the block exits (a cancel, the deadline, a failing
#: sibling in ``tether.gather``) is waited for, not told to stop, and undone if it succeeded
#: (histories without it replay the old way: the step was cancelled and forgotten)
IN_FLIGHT_STEPS = "tether.saga-waits-in-flight-steps"

#: the patch marker a saga records when ``continue_as_new`` leaves its block: the steps
#: are kept, like a ``return`` (histories without it replay the old way: the undos ran)
CONTINUE_KEEPS_STEPS = "tether.saga-continue-as-new-keeps-steps"


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
        #: steps awaited but not settled yet: (future, its undo, its name, its position)
        self._in_flight: list[
            tuple[asyncio.Future[Any], Callable[[Any], Awaitable[Any]], str | None, int]
        ] = []
        self._position = 0  #: steps and add_undo calls so far (labels name their position)
        #: the block is leaving on an error: the steps still running are its to settle
        self._exiting = False
        #: labels (``undo (step n)``) of the undos that ran successfully, in order
        self.compensated: list[str] = []
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
        """Await ``action``; once it succeeded, register ``undo(result)`` to compensate it.

        If the block exits (the run's cancel or deadline, a failing sibling) while
        ``action`` is an activity still running, the exit waits for it (the activity is
        not told to stop: its effect happens anyway) and registers its undo if it
        succeeded. Any other step (a child run, a timer, a signal wait), and any cancel
        aimed at the step itself (a ``tether.first`` loser), is cancelled as usual."""
        self._position += 1
        position = self._position
        inst: Any = running.get()
        # outside a workflow there is no telling what the awaitable is: it is waited for
        activity = inst is None or not hasattr(inst, "is_activity") or inst.is_activity(action)
        if undo is None or not activity or not _patched(IN_FLIGHT_STEPS):
            result = await action
            if undo is not None:
                self._register(undo, result, name, position)
            return result
        fut = asyncio.ensure_future(action)
        entry = (fut, undo, name, position)
        self._in_flight.append(entry)
        try:
            result = await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not (self._exiting or _interrupted(inst)):
                fut.cancel()  # aimed at this step (a race's loser): the activity stops
            if fut.cancelled() and entry in self._in_flight:
                self._in_flight.remove(entry)
            raise  # else the step goes on: the block's exit waits for it and undoes it
        except BaseException:
            if entry in self._in_flight:
                self._in_flight.remove(entry)
            raise
        if entry in self._in_flight:  # not already taken over by the block's exit
            self._in_flight.remove(entry)
            self._register(undo, result, name, position)
        return result

    def _register(
        self, undo: Callable[[Any], Awaitable[Any]], result: Any, name: str | None, position: int
    ) -> None:
        label = name or getattr(undo, "name", None) or getattr(undo, "__name__", "undo")
        self._undos.append((f"{label} (step {position})", lambda: undo(result)))

    def add_undo(self, undo: Callable[[], Awaitable[Any]], *, name: str | None = None) -> None:
        """Register a compensation directly (called with no arguments)."""
        self._position += 1
        label = name or getattr(undo, "__name__", "undo")
        self._undos.append((f"{label} (step {self._position})", undo))

    async def _settle(self) -> None:
        """Wait for every step still in flight (a cancel meanwhile is kept in
        ``interrupted``); register the undo of each that succeeded, in completion order."""
        while self._in_flight:
            done = [entry for entry in self._in_flight if entry[0].done()]
            if not done:
                await self._through_cancels(
                    asyncio.wait(
                        [entry[0] for entry in self._in_flight], return_when=asyncio.FIRST_COMPLETED
                    )
                )
                continue
            for entry in done:
                self._in_flight.remove(entry)
                fut, undo, label, position = entry
                if not fut.cancelled() and fut.exception() is None:
                    self._register(undo, fut.result(), label, position)

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
                _count(_name_of(label), "failed")
            else:
                self.compensated.append(label)
                _count(_name_of(label), "ok")
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
        if exc is not None or _interrupted(running.get()):
            # a failing sibling in a gather, a cancel, the deadline: the steps still
            # running are the exit's to wait for (a step left running by a block that
            # ends well, such as a race's loser being told to stop, is not)
            self._exiting = True
            if self._in_flight:
                await self._settle()
        cut = False  # a cancel came while the block waited for its steps: it ends so
        if self.interrupted is not None and (exc is None or isinstance(exc, ContinueAsNew)):
            exc, cut = self.interrupted, True
        if exc is None:
            self._undos.clear()
            return False
        if isinstance(exc, ContinueAsNew) and _patched(CONTINUE_KEEPS_STEPS):
            self._undos.clear()  # like a return: the steps stand, the next run has no undos
            return False
        failures = await self.compensate()
        if failures:
            original = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise CompensationFailed(original, failures) from exc
        if cut:
            raise exc
        if self.interrupted is not None and not isinstance(exc, asyncio.CancelledError):
            raise self.interrupted  # the run was cancelled while it rolled back: it ends so
        return False


def _patched(patch_id: str) -> bool:
    """Whether the running workflow takes change ``patch_id`` (outside one: yes)."""
    inst: Any = running.get()
    if inst is None or not hasattr(inst, "patched"):
        return True
    return bool(inst.patched(patch_id))


def _interrupted(inst: Any) -> bool:
    """Whether the run's cancel or deadline is being delivered (outside a workflow: any
    cancel counts as the block's own)."""
    if inst is None or not hasattr(inst, "interrupted"):
        return True
    return bool(inst.interrupted())


def _name_of(label: str) -> str:
    """The undo's own name in ``label`` (metrics are labelled by it, not the position)."""
    return label.rsplit(" (step ", 1)[0]


def _count(undo: str, outcome: str) -> None:
    """Count a compensation's outcome once: when it is new, not when a replay meets it."""
    inst: Any = running.get()
    if inst is not None and hasattr(inst, "count"):
        inst.count("tether_compensations", (inst.workflow.name, undo, outcome))


def saga() -> Saga:
    """Start a saga block: ``async with tether.saga() as saga: ...``."""
    return Saga()
