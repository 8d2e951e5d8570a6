"""``crash_at_every_step``: prove a workflow survives a crash at any point.

The workflow runs once uncrashed to learn its result and how many state-changing
store writes it makes (claims and lease renewals are not counted: their number
varies with timing). Then, for every write k, it runs again on a fresh store with a
worker that dies (as if SIGKILLed) twice over: once just before write k would commit
(the write never happens), once just after it committed, before the worker acted on
its answer (the leased work it was handed is never run by it). Either way the
worker's memory is gone and its leases are left to expire. A new worker takes over
on the same store, and the run must finish with the same result, while every side
effect recorded by idempotency key happened exactly once, under the keys the
uncrashed run used. Crash points include the gap between an activity's side effect
and the commit of its result, which is where non-idempotent steps break.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._app import App
from .._definitions import Workflow
from .._errors import TetherError
from .._history import Event
from ._env import Env, SimulatedCrash


@dataclass
class CrashFailure:
    """One crash point that broke an invariant."""

    crash_point: int
    problem: str
    history: list[Event] = field(repr=False)
    #: "before" the write committed, or "after" it committed and before it was acted on
    when: str = "before"

    def describe(self) -> str:
        """The problem and the run's history at the end, one event per line."""
        lines = [f"crash {self.when} store write #{self.crash_point}: {self.problem}"]
        lines += [f"  {e.seq:3} {e.type.value:26} step={e.step} {e.data}" for e in self.history]
        return "\n".join(lines)


@dataclass
class CrashReport:
    """What ``crash_at_every_step`` found."""

    crash_points: int
    result: Any
    failures: list[CrashFailure]

    @property
    def ok(self) -> bool:
        """Whether every crash point kept every invariant."""
        return not self.failures

    def raise_for_failures(self) -> None:
        """Raise ``CrashInvariantError`` describing the first failing crash point."""
        if self.failures:
            raise CrashInvariantError(self.failures[0].describe())


class CrashInvariantError(TetherError, AssertionError):
    """A crash point broke the result or an exactly-once effect."""


def _clone(app: App) -> App:
    fresh = App(store=":memory:", queue=app.default_queue)
    fresh._workflows = dict(app._workflows)
    fresh._activities = dict(app._activities)
    return fresh


#: writes whose number varies with timing (claim polls, lease renewals): crashing before
#: them is covered by the crash before the next state-changing write, and counting them
#: would make the crash points shift from one sweep to the next
_HOUSEKEEPING = frozenset({"_claim", "_renew", "_release", "_heartbeat"})


def _arm(
    app: App, crash_at: int | None, counter: list[int], after: bool = False
) -> Callable[[], None]:
    """Count write operations; from write ``crash_at`` on, the store 'is dead'.

    With ``after``, write ``crash_at`` itself commits and its caller gets the crash
    instead of the answer.
    """
    store: Any = app.store
    original = store._do
    state = {"dead": False}

    async def do(fn: Any, *args: Any, write: bool = True) -> Any:
        if state["dead"]:
            raise SimulatedCrash()
        name = getattr(fn, "__name__", "")
        if write and name not in _HOUSEKEEPING and not name.startswith("_claim"):
            counter[0] += 1
            if crash_at is not None and counter[0] >= crash_at:
                state["dead"] = True
                if after and counter[0] == crash_at:
                    await original(fn, *args, write=write)
                raise SimulatedCrash()
        return await original(fn, *args, write=write)

    store._do = do

    def disarm() -> None:
        store._do = original

    return disarm


async def _one(
    app: App,
    workflow: Workflow[Any, Any],
    args: tuple[Any, ...],
    crash_at: int | None,
    timeout: float,
    after: bool = False,
) -> tuple[Any, int, list[Event], bool]:
    """Run once, crashing before (or ``after``) write ``crash_at``; return result, writes,
    history, crashed."""
    work = _clone(app)
    counter = [0]
    crashed = False
    async with Env(work, lease=5.0) as env:
        run = await work.start(workflow, *args, run_id="crash-test")
        disarm = _arm(work, crash_at, counter, after)
        try:
            result = await run.result(timeout=timeout) if crash_at is None else None
        finally:
            if crash_at is not None:
                # wait until the worker has died (or the run finished before write k)
                for _ in range(int(timeout / 0.01)):
                    if counter[0] >= crash_at:
                        break
                    info = await work.store.get_run("crash-test")
                    if info is not None and info.is_finished:
                        break
                    await asyncio.sleep(0.01)
                crashed = counter[0] >= crash_at
            disarm()
        if crash_at is not None:
            assert env.worker is not None
            await env.worker.kill()
            env.clock.advance(60.0)  # past every lease the dead worker held
            env.worker = work.worker(poll_interval=0.02, lease=5.0)
            await env.worker.start()
            result = await run.result(timeout=timeout)
        history = await work.history("crash-test")
    await work.close()
    return result, counter[0], history, crashed


async def crash_at_every_step(
    app: App,
    workflow: Workflow[Any, Any],
    *args: Any,
    effects: Callable[[], Mapping[str, int]] | None = None,
    reset: Callable[[], None] | None = None,
    timeout: float = 10.0,
    max_points: int = 1000,
) -> CrashReport:
    """Crash a run of ``workflow(*args)`` at every store write and check it recovers.

    ``effects()`` returns how many times each side effect was applied, keyed by
    idempotency key (your stub of the downstream system); ``reset()`` clears it
    between runs. Each crash point (before and after each write) must give the
    uncrashed result and apply every effect exactly once, under the same keys.
    """
    if reset:
        reset()
    baseline, writes, _, _ = await _one(app, workflow, args, None, timeout)
    expected = dict(effects()) if effects else {}
    failures: list[CrashFailure] = []
    bad = {k: n for k, n in expected.items() if n != 1}
    if bad:
        failures.append(CrashFailure(0, f"effects not exactly once without a crash: {bad}", []))
    points = min(writes, max_points)
    for k, when in [(k, w) for k in range(1, points + 1) for w in ("before", "after")]:
        if reset:
            reset()
        try:
            result, _, history, _ = await _one(app, workflow, args, k, timeout, when == "after")
        except Exception as exc:
            failures.append(CrashFailure(k, f"run did not recover: {exc!r}", [], when))
            continue
        problems = []
        if result != baseline:
            problems.append(f"result {result!r} != uncrashed result {baseline!r}")
        if effects is not None:
            seen = dict(effects())
            twice = {key: n for key, n in seen.items() if n != 1}
            if twice:
                problems.append(f"effects applied more than once: {twice}")
            missing = set(expected) - set(seen)
            if missing:
                problems.append(f"effects missing: {sorted(missing)}")
            extra = set(seen) - set(expected)
            if extra:  # e.g. a re-run step got a new idempotency key
                problems.append(f"effects under keys the uncrashed run did not use: {extra}")
        if problems:
            failures.append(CrashFailure(k, "; ".join(problems), history, when))
    return CrashReport(crash_points=points, result=baseline, failures=failures)
