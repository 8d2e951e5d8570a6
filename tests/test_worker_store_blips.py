"""A worker meeting a store blip (a dropped connection, a failed round trip) waits for
the store, not for a workflow failure's retry delay or a lease to run out."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import tether

#: what a store says when its connection drops (the URL is the operator's to see)
LOST = "lost the connection to PostgreSQL store postgresql://u@db:5432/prod"


async def test_a_store_blip_reading_a_runs_history_is_not_a_workflow_failure(
    app: tether.App, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    @app.workflow
    async def wf(x: int) -> int:
        return x + 1

    run = await app.start(wf, 1, run_id="r1")  # no worker yet: its task is claimed below
    real = app.store.read_history
    calls: list[int] = []

    async def flaky(run_id: str, after: int = 0) -> Any:
        calls.append(after)
        if len(calls) == 1:
            raise tether.StoreError(LOST)
        return await real(run_id, after)

    monkeypatch.setattr(app.store, "read_history", flaky)
    caplog.set_level(logging.WARNING, logger="tether")
    w = app.worker(lease=30.0, poll_interval=0.05, workflow_retry_delay=60.0)
    await w.start()
    try:
        # taken again at once: not after the 60 s a failed workflow task waits
        assert await run.result(timeout=10) == 2
    finally:
        await w.stop(grace=2.0)
    assert len(calls) >= 2
    assert w.stats["workflow_task_failures"] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert LOST in caplog.text  # the whole message, for the operator
