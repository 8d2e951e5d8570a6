"""crash_at_every_step catches a non-idempotent step, names the crash point, and
passes its idempotent fix."""

from __future__ import annotations

import collections

import pytest

import tether
from tether.testing import CrashInvariantError, crash_at_every_step

#: the downstream system: how many times each charge was applied (every application
#: counts, so a repeat shows as 2)
LEDGER: collections.Counter[str] = collections.Counter()


def _reset() -> None:
    LEDGER.clear()


def _app(idempotent: bool) -> tether.App:
    app = tether.App(store=":memory:")

    @app.activity
    def extract(doc: str) -> str:
        return doc.upper()

    @app.activity
    def charge(doc: str, cents: int) -> str:
        if idempotent:
            key = tether.activity_context().idempotency_key
            if key not in LEDGER:  # the destination refuses a key it has applied
                LEDGER[key] += 1
            return key
        LEDGER[f"charge:{doc}"] += 1  # applied blindly: a repeat charges twice
        return f"charge:{doc}"

    @app.workflow
    async def bill(doc: str) -> str:
        text = await extract(doc)
        receipt = await charge(text, 500)
        await tether.sleep(3600)
        return f"{text} billed as {receipt}"

    return app


async def test_crash_at_every_step_names_the_point_that_double_charges() -> None:
    app = _app(idempotent=False)
    report = await crash_at_every_step(
        app, app.get_workflow("bill"), "inv-1", effects=lambda: LEDGER, reset=_reset
    )
    # one per durable write: the start with its first task, each result with the next
    # task (extract, charge), the timer firing (with the end, where it fits)
    assert report.crash_points >= 4
    assert not report.ok
    first = report.failures[0]
    assert "more than once" in first.problem and "charge:INV-1" in first.problem
    # the failing crash point is the commit of charge's result: the charge had happened
    assert any(e.type is tether.EventType.ACTIVITY_SCHEDULED for e in first.history)
    assert "store write #" in first.describe()
    with pytest.raises(CrashInvariantError):
        report.raise_for_failures()


async def test_crash_at_every_step_passes_the_idempotent_fix() -> None:
    app = _app(idempotent=True)
    report = await crash_at_every_step(
        app, app.get_workflow("bill"), "inv-1", effects=lambda: LEDGER, reset=_reset
    )
    report.raise_for_failures()
    assert report.ok and report.crash_points >= 4
    assert report.result == "INV-1 billed as crash-test:2"


async def test_crash_at_every_step_crashes_after_each_commit_too() -> None:
    """A crash right after a commit (the worker never acts on what it was handed: the
    next step leased to it waits for its lease to expire) is a crash point of its own.
    Only the crash *before* charge's result commits charges twice: after it, the result
    is recorded and the step never runs again."""
    app = _app(idempotent=False)
    report = await crash_at_every_step(
        app, app.get_workflow("bill"), "inv-1", effects=lambda: LEDGER, reset=_reset
    )
    assert [f.when for f in report.failures] == ["before"]
    assert "more than once" in report.failures[0].problem
    assert report.failures[0].describe().startswith("crash before store write #")
