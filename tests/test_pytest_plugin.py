"""The tether pytest plugin (pytest11 entry point): its fixtures are available everywhere."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import tether
from tether.testing import Env

DAY = 86_400.0


async def test_tether_env_runs_a_time_skipping_env_on_a_file_app(
    tether_app: tether.App,
    tether_env: Callable[..., Awaitable[Env]],
    tmp_path: Path,
) -> None:
    @tether_app.workflow
    async def remind() -> str:
        await tether.sleep(7 * DAY)
        return "sent"

    env = await tether_env(tether_app)
    assert env.worker is not None
    run = await tether_app.start(remind)
    assert await run.result(timeout=5) == "sent"
    assert env.skipped >= 7 * DAY
    assert (tmp_path / "tether-test.db").exists()


async def test_tether_memory_app_is_fresh_and_in_memory(
    tether_memory_app: tether.App, tether_env: Callable[..., Awaitable[Env]]
) -> None:
    assert getattr(tether_memory_app.store, "path", None) == ":memory:"
    assert await tether_memory_app.list() == []

    @tether_memory_app.workflow
    async def hello(name: str) -> str:
        return f"hello {name}"

    await tether_env(tether_memory_app)
    run = await tether_memory_app.start(hello, "ada")
    assert await run.result(timeout=5) == "hello ada"


def test_plugin_is_registered_through_the_entry_point(pytestconfig: pytest.Config) -> None:
    plugin: Any = pytestconfig.pluginmanager.get_plugin("tether")
    assert plugin is not None
    assert plugin.__name__ == "tether.testing.pytest_plugin"
