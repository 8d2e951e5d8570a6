"""Singletons and signal-with-start: concurrent starts of one run id, from several
store connections at once, make one run; concurrent signal-with-starts make one run
that receives every signal, in one order; the store decides (a unique key, one commit),
never a check-then-act in the client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import tether
from tether import EventType


def _define(app: tether.App) -> tuple[tether.Workflow, tether.Workflow]:
    @app.workflow
    async def controller(article: str) -> str:
        await tether.wait_event("stop")
        return article

    @app.workflow
    async def collector() -> list[int]:
        got: list[int] = []
        while len(got) < 20:
            got.append(await tether.wait_event("item"))
        return got

    return controller, collector


@pytest.fixture
def apps(store_url: str) -> Iterator[list[tether.App]]:
    """Four Apps on one store: four connections (writer threads) racing each other."""
    made = [tether.App(store=store_url) for _ in range(4)]
    for a in made:
        _define(a)
    yield made
    for a in made:
        if a._store is not None:
            a.store.close_sync()  # type: ignore[attr-defined]


async def test_twenty_concurrent_starts_of_a_singleton_make_one_run(
    apps: list[tether.App],
) -> None:
    runs = await asyncio.gather(
        *(
            apps[i % 4].start("controller", f"input {i}", run_id="article-42", if_running="return")
            for i in range(20)
        )
    )
    assert {r.run_id for r in runs} == {"article-42"}
    assert sum(1 for r in runs if r.created) == 1  # one start made it, the rest joined it
    listed = await apps[0].list(workflow="controller")
    assert [r.run_id for r in listed] == ["article-42"]
    with pytest.raises(tether.RunIdConflictError, match="refuses"):
        await apps[1].start("controller", "x", run_id="article-42", if_running="reject")
    # the default: the same input returns the run, other input is a conflict
    winner = next(i for i, r in enumerate(runs) if r.created)
    same = await apps[2].start("controller", f"input {winner}", run_id="article-42")
    assert same.run_id == "article-42" and same.created is False
    with pytest.raises(tether.RunIdConflictError, match="different input"):
        await apps[3].start("controller", f"input {winner + 1}", run_id="article-42")


async def test_twenty_concurrent_signal_with_starts_make_one_run_with_every_signal(
    apps: list[tether.App],
) -> None:
    runs = await asyncio.gather(
        *(
            apps[i % 4].start("collector", run_id="inbox", if_running="signal", signal=("item", i))
            for i in range(20)
        )
    )
    assert sum(1 for r in runs if r.created) == 1 and {r.run_id for r in runs} == {"inbox"}
    async with apps[0].worker(poll_interval=0.05):
        got = await apps[0].get_run("inbox").result(timeout=30)
    assert sorted(got) == list(range(20))
    history = await apps[0].history("inbox")
    received = [e.data["payload"] for e in history if e.type is EventType.SIGNAL_RECEIVED]
    assert received == got  # one order: the history's
    # a signal-with-start to a run that ended is refused: a run id names one run
    with pytest.raises(tether.RunFinishedError):
        await apps[1].start("collector", run_id="inbox", if_running="signal", signal=("item", 1))


async def test_signal_with_start_reaches_the_live_run_of_a_chain(app: tether.App) -> None:
    @app.workflow
    async def looping(generation: int) -> int:
        if generation < 2:
            tether.continue_as_new(generation + 1)
        return int(await tether.wait_event("go"))

    async with app.worker(poll_interval=0.05):
        run = await app.start(looping, 0, run_id="loop")
        for _ in range(500):  # the chain's live run (loop~2) waits for "go"
            live = await app.get("loop")  # followed along the chain
            if live.run_id == "loop~2" and live.waiting_on:
                break
            await asyncio.sleep(0.02)
        again = await app.start(looping, 5, run_id="loop", if_running="signal", signal=("go", 7))
        assert again.created is False
        assert await run.result(timeout=20) == 7


async def test_bad_singleton_options_are_refused(app: tether.App) -> None:
    @app.workflow
    async def job() -> None:
        return None

    for kw, needle in [
        ({"run_id": "j", "if_running": "maybe"}, "if_running="),
        ({"run_id": "j", "if_running": "signal"}, "needs signal"),
        ({"if_running": "return"}, "run_id="),
        ({"run_id": "j", "if_running": "return", "signal": ("x", 1)}, "if_running='signal'"),
        ({"run_id": "j", "signal": "x"}, "tuple"),
    ]:
        with pytest.raises(tether.ConfigurationError, match=needle):
            await app.start(job, **kw)  # type: ignore[arg-type]
    assert await app.list() == []
