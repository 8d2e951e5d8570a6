"""Shared fixtures: an App on a fresh SQLite file per test, and a running worker."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import tether


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """A fresh SQLite file for this test."""
    return tmp_path / "tether.db"


@pytest.fixture
def app(db_path: Path) -> Iterator[tether.App]:
    """An App on its own SQLite file; tests register workflows on it."""
    a = tether.App(store=f"sqlite:///{db_path}")
    yield a
    store = a._store
    if store is not None:
        store.close_sync()  # type: ignore[attr-defined]


@pytest.fixture
async def worker(app: tether.App) -> AsyncIterator[tether.Worker]:
    """A worker serving every queue of ``app`` while the test runs.

    Register workflows and activities on ``app`` before requesting this fixture
    only if they use queues other than the default; the worker serves
    ``app.queues()`` as they are when it starts.
    """
    w = app.worker(lease=5.0, poll_interval=0.05)
    await w.start()
    yield w
    await w.stop(grace=2.0)
