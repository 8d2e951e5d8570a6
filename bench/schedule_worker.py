"""The App of ``bench/schedules.py``: ``tether worker schedule_worker:app`` with
TETHER_BENCH_STORE. Its workflow does nothing: the benchmark measures firing."""

from __future__ import annotations

import os

import tether

app = tether.App(store=os.environ["TETHER_BENCH_STORE"])


@app.workflow
async def tick() -> None:
    """A scheduled run: started, then done."""
    return None
