"""A hedge whose two answers arrive in one batch takes the same winner every time: the
first call's on a new decision, the recorded winner's on replay (not a set's order)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from tether import Event, EventType
from tether.ai._gateway import _hedge_order


class _Replaying:
    """Stands in for a replaying instance whose next recorded command is ``event``."""

    def __init__(self, event: Event | None) -> None:
        self.event = event

    def recorded_next(self) -> Event | None:
        return self.event


def _marker(won: str) -> Event:
    value = {"asked": ["fast", "slow"], "won": won}
    data = {"marker": "model_hedge", "value": value}
    return Event(run_id="r", seq=9, type=EventType.MARKER, step=4, data=data, created_at=0.0)


async def test_both_answered_the_first_call_wins_then_the_recorded_winner() -> None:
    loop = asyncio.get_running_loop()
    for _ in range(20):  # a set of futures iterates in an order of their ids
        first: asyncio.Future[Any] = loop.create_future()
        second: asyncio.Future[Any] = loop.create_future()
        first.set_result("a")
        second.set_result("b")
        slow: Any = SimpleNamespace(name="slow")
        done = {second, first}
        assert _hedge_order(None, first, second, slow, done) == [first, second]
        inst: Any = _Replaying(None)
        assert _hedge_order(inst, first, second, slow, done) == [first, second]
        inst = _Replaying(_marker("slow"))
        assert _hedge_order(inst, first, second, slow, done) == [second, first]
        inst = _Replaying(_marker("fast"))
        assert _hedge_order(inst, first, second, slow, done) == [first, second]
        assert _hedge_order(inst, first, second, slow, {second}) == [second]
