"""Clocks: workers on one PostgreSQL database take their time from the server, so a
host whose clock is off neither steals leases nor fires timers early; on SQLite a clock
stepped back delays and never repeats."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import tether
from conftest import PG_URL, with_schema
from helpers import eventually
from tether.store._clock import ServerClock

HERE = Path(__file__).parent


class Fake:
    """A controllable time source."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_server_clock_trusts_its_quickest_reading() -> None:
    """A reading whose round trip was long (a loaded host) is uncertain by half of it;
    the clock keeps to the quickest of its recent readings."""
    mono = Fake(100.0)
    truth = 1_000.0  # server time minus monotonic time

    def reading(rtt: float, evaluated_at: float) -> Callable[[], float]:
        def read() -> float:
            start = mono.now
            mono.now += rtt
            return start + rtt * evaluated_at + truth  # the server read its clock then

        return read

    clock = ServerClock(wall=Fake(0.0), monotonic=mono)
    clock.sync(reading(0.002, 0.5))  # quick: exact
    assert abs(clock() - (mono.now + truth)) < 1e-9
    mono.now += 10
    clock.sync(reading(0.200, 0.0))  # slow, and the server answered at once: 0.1 s early
    assert abs(clock() - (mono.now + truth)) < 1e-9  # still the quick reading's
    for _ in range(ServerClock.KEEP):  # once the quick one has aged out, the best of the rest
        mono.now += 10
        clock.sync(reading(0.020, 0.0))
    assert abs(clock() - (mono.now + truth)) <= 0.010 + 1e-9


def test_the_server_clock_ignores_the_hosts_wall_clock() -> None:
    mono, wall = Fake(100.0), Fake(5_000.0)
    clock = ServerClock(wall=wall, monotonic=mono, resync_every=10.0)
    clock.sync(lambda: 1_000.0)
    assert clock() == 1_000.0 and clock.offset == -4_000.0
    mono.now += 2.5
    wall.now -= 3_600  # NTP steps the host's clock back an hour: nothing changes
    assert clock() == 1_002.5
    assert not clock.due()
    mono.now += 10
    assert clock.due()
    assert clock() == 1_012.5
    clock.sync(lambda: 1_012.0)  # a reading a little behind the estimate (1,012.5)
    assert clock() == 1_012.5  # time does not run backwards
    mono.now += 1
    assert clock() == 1_013.0


async def test_a_sqlite_hosts_clock_stepping_back_fires_nothing_early_leases_nothing_twice(
    tmp_path: Path,
) -> None:
    """All processes on one machine read the same wall clock: a step back delays, and
    never repeats or hurries."""
    app = tether.App(store=f"sqlite:///{tmp_path / 't.db'}")
    ran: list[str] = []
    step = {"back": 0.0}

    @app.activity
    async def work() -> None:
        ran.append("work")
        step["back"] = 30.0  # NTP steps the clock back while the step runs
        await asyncio.sleep(0.3)

    @app.workflow
    async def job() -> str:
        await work()
        await tether.sleep(0.2)
        return "done"

    app.store.clock = lambda: time.time() - step["back"]  # type: ignore[method-assign]
    async with app.worker(lease=1.0, poll_interval=0.02), app.worker(lease=1.0, poll_interval=0.02):
        run = await app.start(job)
        await eventually(lambda: asyncio.sleep(0, result=bool(ran)), what="the step")
        await asyncio.sleep(0.5)
        step["back"] = 0.0  # stepped forward again: the timer is due at once
        assert await run.result(timeout=10) == "done"
    assert ran == ["work"]
    await app.close()


def _spawn(url: str, directory: Path, skew: float) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}",
        "TETHER_TEST_SKEW": str(skew),
    }
    return subprocess.Popen(
        [sys.executable, str(HERE / "clock_app.py"), url, str(directory)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


async def test_a_worker_whose_clock_is_ahead_steals_no_lease(
    pg_schema: str, tmp_path: Path
) -> None:
    """A worker 20 s ahead would see a live 4 s lease as long expired on its own clock."""
    sys.path.insert(0, str(HERE))
    import clock_app

    url = with_schema(PG_URL, pg_schema)
    client = clock_app.build_app(url, tmp_path)
    on_time = _spawn(url, tmp_path, 0.0)
    ahead: subprocess.Popen[bytes] | None = None
    try:
        runs = [await client.start("holder", f"t{i}") for i in range(3)]
        log = tmp_path / "runs"
        await eventually(
            lambda: asyncio.sleep(0, result=log.exists() and len(log.read_text().split("\n")) > 3),
            what="the on-time worker to take all three",
        )
        ahead = _spawn(url, tmp_path, 20.0)
        for run in runs:
            await run.result(timeout=30)
        lines = log.read_text().split()
        tags = lines[0::2]
        assert sorted(tags) == ["t0", "t1", "t2"], lines  # each ran exactly once
        assert set(lines[1::2]) == {str(on_time.pid)}
    finally:
        _stop(on_time, *([ahead] if ahead else []))
        await client.close()


async def test_a_worker_whose_clock_is_ahead_fires_no_timer_early(
    pg_schema: str, tmp_path: Path
) -> None:
    sys.path.insert(0, str(HERE))
    import clock_app

    url = with_schema(PG_URL, pg_schema)
    client = clock_app.build_app(url, tmp_path)
    ahead: subprocess.Popen[bytes] | None = None
    try:
        t0 = time.monotonic()
        async with client.worker(poll_interval=0.05):  # on time: it sets the timer
            run = await client.start("napper")
            await eventually(
                lambda: _has(client, run.run_id, tether.EventType.TIMER_STARTED), what="timer"
            )
        ahead = _spawn(url, tmp_path, 20.0)  # and a worker 20 s ahead is there when it is due
        await run.result(timeout=30)
        assert time.monotonic() - t0 >= 3.9  # a 4 s durable sleep, not cut short
    finally:
        if ahead is not None:
            _stop(ahead)
        await client.close()


async def _has(app: tether.App, run_id: str, kind: tether.EventType) -> bool:
    return kind in [e.type for e in await app.history(run_id)]
