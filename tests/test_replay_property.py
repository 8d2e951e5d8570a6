"""Property: any workflow built from durable primitives replays its own history
cleanly, and a fresh worker continuing from that history reaches the same result."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tether
from tether._history import COMMANDS
from tether.testing import Env, check_history

# a plan is a list of operations; each op is one of:
#   ("step", n)            await echo(n)
#   ("gather", [n, ...])   await gather of echo(n) for each n
#   ("sleep", seconds)     await tether.sleep(seconds)
#   ("race", n, seconds)   await first(echo(n), sleep(seconds))
#   ("status", n)          tether.set_status(n)
#   ("map", [n, ...])      await tether.map(echo, items, concurrency=2)
ops = st.one_of(
    st.tuples(st.just("step"), st.integers(0, 9)),
    st.tuples(st.just("gather"), st.lists(st.integers(0, 9), min_size=1, max_size=4)),
    st.tuples(st.just("sleep"), st.sampled_from([1.0, 60.0, 3600.0])),
    st.tuples(st.just("race"), st.integers(0, 9), st.sampled_from([0.5, 10.0])),
    st.tuples(st.just("status"), st.integers(0, 9)),
    st.tuples(st.just("map"), st.lists(st.integers(0, 9), min_size=1, max_size=5)),
)


def _app() -> tether.App:
    app = tether.App(store=":memory:")

    @app.activity
    async def echo(n: int) -> int:
        return n

    @app.workflow
    async def planned(plan: list[Any]) -> list[Any]:
        out: list[Any] = []
        for op in plan:
            kind = op[0]
            if kind == "step":
                out.append(await echo(op[1]))
            elif kind == "gather":
                out.append(await tether.gather(*[echo(n) for n in op[1]]))
            elif kind == "sleep":
                await tether.sleep(op[1])
                out.append("slept")
            elif kind == "race":
                out.append(await tether.first(echo(op[1]), tether.sleep(op[2])))
            elif kind == "status":
                tether.set_status(op[1])
            else:
                outcomes = await tether.map(echo, op[1], concurrency=2)
                out.append([o.value for o in outcomes])
        out.append(str(tether.uuid())[:8])
        return out

    return app


async def _run(plan: list[Any], **worker: Any) -> tuple[list[Any], list[tether.Event], tether.App]:
    app = _app()
    async with Env(app, start=1_000_000.0, **worker):
        run = await app.start(app.get_workflow("planned"), plan, run_id="planned")
        result = await run.result(timeout=10)
        return result, await app.history(run.run_id), app


#: recorded values that carry the clock, not the code's decisions
_CLOCK_KEYS = {"scheduled_at", "fire_at", "time"}


def _commands(history: list[tether.Event]) -> dict[int, tuple[str, Any]]:
    """Every command by step with all it recorded (arguments, results, options), the
    clock's readings left out."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _CLOCK_KEYS}
        return value

    return {
        e.step: (e.type.value, strip(e.data))
        for e in history
        if e.type in COMMANDS and e.step is not None
    }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(ops, max_size=6))
def test_replay_any_plan_replays_its_own_history(plan: list[Any]) -> None:
    async def main() -> None:
        result, history, app = await _run(plan)
        seqs = [e.seq for e in history]
        assert seqs == list(range(1, len(seqs) + 1))  # no gap, no duplicate
        report = check_history(_app(), history)
        assert report.ok, report.diff()
        assert report.recorded == report.produced
        # and the code would pass the same check on the very App that ran it
        assert check_history(app, history).ok
        assert result[-1]  # the deterministic uuid is part of the result
        await app.close()

        # a worker that keeps nothing in memory replays the whole history for every task
        # (as a fresh worker after a crash does): same result, and the same commands
        # with the same arguments, options and results, step by step
        again, history2, app2 = await _run(plan, cache_size=0)
        await app2.close()
        assert again == result
        assert _commands(history2) == _commands(history)

    asyncio.run(main())
