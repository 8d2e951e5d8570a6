"""The App of the schedule process tests: ``tether worker schedule_app:app`` with
TETHER_TEST_STORE (the store) and SCHEDULE_EFFECTS (a side table of executions)."""

from __future__ import annotations

import os

import tether
from helpers import shared_side_db

app = tether.App(store=os.environ["TETHER_TEST_STORE"])


@app.activity
def record(run_id: str) -> None:
    """One row per execution: a tick fired twice (or run twice) shows as two rows."""
    shared_side_db(
        os.environ["SCHEDULE_EFFECTS"], "CREATE TABLE IF NOT EXISTS effects (run_id TEXT)"
    ).execute("INSERT INTO effects VALUES (?)", (tether.activity_context().run_id,))


@app.workflow
async def tick() -> None:
    await record(tether.info().run_id)
