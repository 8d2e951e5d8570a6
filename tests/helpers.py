"""Small helpers shared by the tests: polling instead of sleeping, history checks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import tether
from tether import EventType


async def eventually(
    check: Callable[[], Awaitable[Any]], timeout: float = 10.0, what: str = "condition"
) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def event_types(app: tether.App, run_id: str) -> list[EventType]:
    return [e.type for e in await app.history(run_id)]


async def has_event(app: tether.App, run_id: str, type_: EventType) -> bool:
    return type_ in await event_types(app, run_id)
