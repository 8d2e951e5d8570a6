"""tether's pytest plugin (registered through the ``pytest11`` entry point).

Fixtures, all prefixed ``tether_`` so they never collide with a project's own:

* ``tether_app``: an ``App`` on a fresh SQLite file in the test's ``tmp_path``;
* ``tether_memory_app``: an ``App`` on an in-memory store;
* ``tether_env``: a factory, ``env = await tether_env(app, **worker_options)``,
  returning a running time-skipping ``Env``; every Env it made is stopped after
  the test. Needs pytest-asyncio (the fixture is async).

    async def test_reminder(tether_memory_app, tether_env):
        app = tether_memory_app
        ...register workflows and activities on app...
        env = await tether_env(app)
        run = await app.start(remind, "ada")
        assert await run.result(timeout=5) == "sent"
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .._app import App
from ._env import Env


def _close(app: App) -> None:
    store = app._store
    close = getattr(store, "close_sync", None)
    if close is not None:
        close()
    app._store = None


@pytest.fixture
def tether_app(tmp_path: Path) -> Iterator[App]:
    """An App on a fresh SQLite file (closed after the test)."""
    app = App(store=f"sqlite:///{tmp_path / 'tether-test.db'}")
    yield app
    _close(app)


@pytest.fixture
def tether_memory_app() -> Iterator[App]:
    """An App on a fresh in-memory store (closed after the test)."""
    app = App(store=":memory:")
    yield app
    _close(app)


EnvFactory = Callable[..., Awaitable[Env]]

try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - pytest-asyncio is a dev dependency

    @pytest.fixture(name="tether_env")
    def _tether_env_unavailable() -> Any:
        """Needs pytest-asyncio."""
        pytest.skip("the tether_env fixture needs pytest-asyncio: pip install pytest-asyncio")

else:

    @pytest_asyncio.fixture
    async def tether_env() -> AsyncIterator[EnvFactory]:
        """A factory of running time-skipping Envs: ``env = await tether_env(app)``."""
        envs: list[Env] = []

        async def make(app: App, **options: Any) -> Env:
            env = Env(app, **options)
            await env.__aenter__()
            envs.append(env)
            return env

        yield make
        for env in reversed(envs):
            await env.__aexit__(None, None, None)
