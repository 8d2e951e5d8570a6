"""Schedules: cron and interval ticks (time zones, clock changes), one run per tick
whatever fires it, overlap policies, the catch-up window, pause/resume/trigger/delete,
and bad input refused with nothing stored. Simulated hours run on the time-skipping
``Env``; once-only across worker processes is tested with real processes."""

from __future__ import annotations

import asyncio
import bisect
import importlib
import os
import sqlite3
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

import tether
from tether._schedules import (
    CLAIM_GRACE,
    ScheduleSpec,
    count_ticks,
    jittered,
    make_spec,
    next_tick,
    plan,
    tick_run_id,
)
from tether.testing import Env
from tether.testing._env import VirtualClock

HERE = Path(__file__).parent
BERLIN = ZoneInfo("Europe/Berlin")
T0 = 1_800_000_000.0  # a whole minute (and hour) in UTC


def _spec(**kw: object) -> ScheduleSpec:
    base: dict[str, object] = {
        "cron": None,
        "every": None,
        "tz": None,
        "jitter": None,
        "overlap": "skip",
        "catchup_window": None,
        "start_at": None,
        "end_at": None,
    }
    return make_spec(**{**base, **kw})  # type: ignore[arg-type]


def _at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


# -- when ticks fall --------------------------------------------------------------------


def test_cron_ticks_in_a_time_zone_across_both_clock_changes() -> None:
    daily = _spec(cron="30 2 * * *", tz="Europe/Berlin")
    # spring forward (2026-03-29 02:00 -> 03:00): 02:30 does not exist, fires at 03:00
    t = next_tick(daily, _at("2026-03-28T12:00:00+01:00"))
    assert t == _at("2026-03-29T03:00:00+02:00")
    assert next_tick(daily, t) == _at("2026-03-30T02:30:00+02:00")
    # fall back (2026-10-25 03:00 -> 02:00): 02:30 happens twice, fires once (the first)
    t = next_tick(daily, _at("2026-10-24T12:00:00+02:00"))
    assert t == _at("2026-10-25T02:30:00+02:00")
    assert next_tick(daily, t) == _at("2026-10-26T02:30:00+01:00")
    # hourly through the repeated hour: each wall-clock hour once
    hourly = _spec(cron="0 * * * *", tz="Europe/Berlin")
    ticks, t = [], _at("2026-10-25T00:30:00+02:00")
    for _ in range(4):
        t = next_tick(hourly, t)
        ticks.append(datetime.fromtimestamp(t, BERLIN).isoformat())
    assert ticks == [
        "2026-10-25T01:00:00+02:00",
        "2026-10-25T02:00:00+02:00",
        "2026-10-25T03:00:00+01:00",
        "2026-10-25T04:00:00+01:00",
    ]


def test_interval_ticks_the_catch_up_window_and_the_end() -> None:
    every = _spec(every=60, catchup_window=150, end_at=T0 + 600)
    assert next_tick(every, T0 + 1) == T0 + 60 and next_tick(every, T0 + 60) == T0 + 120
    assert plan(every, T0 + 60, T0 + 30) == (None, 0, T0 + 60)  # not due yet
    # 10 minutes late: ticks older than 150 s are skipped, the rest fire one by one
    tick, skipped, after = plan(every, T0 + 60, T0 + 600)
    assert (tick, skipped, after) == (T0 + 480, 7, T0 + 540)
    assert next_tick(every, T0 + 600) is None  # past end_at
    anchored = _spec(every=3600, start_at=T0 + 900)
    assert next_tick(anchored, T0) == T0 + 900 and next_tick(anchored, T0 + 900) == T0 + 4500
    assert tick_run_id("nightly", T0) == "nightly@2027-01-15T08:00:00Z"


async def test_bad_input_is_refused_naming_the_field_and_nothing_is_stored(
    app: tether.App,
) -> None:
    @app.workflow
    async def job(n: int) -> int:
        return n

    cases = [
        ({"cron": "61 * * * *"}, "cron="),
        ({"cron": "every day"}, "cron="),
        ({"cron": "0 0 31 2 *"}, "never fires"),  # valid fields, no such date
        # croniter's random fields: a new time at each look, so ticks came at random
        ({"cron": "R * * * *"}, "random"),
        ({"cron": "0 r(1-5) * * *"}, "random"),
        ({"cron": "0 0 * * R/2"}, "random"),
        ({"cron": "0 2 * * *", "tz": "Mars/Olympus"}, "tz="),
        ({"cron": "0 2 * * *", "every": 60}, "exactly one"),
        ({}, "exactly one"),
        ({"every": 0.5}, "every="),
        ({"every": 60, "overlap": "queue"}, "overlap="),
        ({"every": 60, "jitter": -1}, "jitter"),
        # absurd values: stored, they crashed `tether schedules list` for every schedule
        ({"every": 1e300}, "every="),
        ({"every": 60, "start_at": float("nan")}, "start_at="),
        ({"every": 60, "start_at": 1e20}, "start_at="),
        ({"every": 60, "end_at": float("inf")}, "end_at="),
        ({"every": 60, "tz": 5}, "tz="),
        ({"every": 60, "jitter": 1e300}, "jitter="),
        ({"every": 60, "catchup_window": 1e300}, "catchup_window="),
        ({"every": 60, "catchup_window": -1}, "catchup_window="),
    ]
    for kw, needle in cases:
        with pytest.raises(tether.ConfigurationError, match=needle):
            await app.schedule("s", job, 1, **kw)  # type: ignore[arg-type]
    with pytest.raises(tether.ConfigurationError, match="schedule id"):
        await app.schedule("a@b", job, 1, every=60)
    with pytest.raises(tether.PayloadError):
        await app.schedule("s", job, "not a number", every=60)
    with pytest.raises(tether.UnknownWorkflowError):
        await app.schedule("s", "nope", every=60)
    assert await app.schedules() == []
    with pytest.raises(tether.ScheduleNotFoundError, match="tether schedules list"):
        await app.pause_schedule("missing")


# -- firing, on a virtual clock ----------------------------------------------------------


async def _until(env: Env, t: float, budget: float = 120.0) -> None:
    """Wait until the Env's clock has moved past ``t``: it only jumps ahead once nothing
    is due and nothing runs, so every tick due by ``t`` has fired and its run has done
    what it could (a fixed pause after reaching ``t`` was too short on a loaded VM)."""
    give_up = time.monotonic() + budget
    while env.clock.now <= t:
        assert time.monotonic() < give_up, f"the virtual clock stuck at {env.clock.now}"
        await asyncio.sleep(0.002)


async def _schedule_reaches(app: tether.App, schedule_id: str, tick: float) -> None:
    """Wait until the schedule has dealt with ``tick`` (fired, skipped or held it)."""
    give_up = time.monotonic() + 30
    while (await app.get_schedule(schedule_id)).last_tick != tick:
        assert time.monotonic() < give_up, f"schedule {schedule_id!r} never reached {tick}"
        await asyncio.sleep(0.02)


async def test_one_run_per_tick_over_a_simulated_hour(app: tether.App) -> None:
    @app.workflow
    async def ping() -> str:
        return tether.info().run_id

    async with Env(app, start=T0) as env:
        await app.schedule("ping", ping, every=60)
        await _until(env, T0 + 3600)
    runs = await app.list(workflow="ping", limit=1000)
    ids = sorted(r.run_id for r in runs if r.run_id <= tick_run_id("ping", T0 + 3600))
    assert ids == [tick_run_id("ping", T0 + 60 * i) for i in range(1, 61)]
    info = await app.get_schedule("ping")
    assert info.skipped == 0 and info.fired >= 60


async def test_a_declaration_repeated_at_each_deploy_changes_nothing(app: tether.App) -> None:
    @app.workflow
    async def job() -> None:
        return None

    async with Env(app, start=T0, skip_time=False) as env:
        first = await app.schedule("job", job, cron="0 * * * *")
        await env.advance(1800)
        again = await app.schedule("job", job, cron="0 * * * *")
        assert again.version == first.version and again.next_at == first.next_at == T0 + 3600
        changed = await app.schedule("job", job, cron="15 * * * *")
        # 08:30 now: the new spec's next tick is 09:15
        assert changed.version == first.version + 1 and changed.next_at == T0 + 4500


@pytest.mark.parametrize(
    ("overlap", "expected"),
    [
        # runs take 150 s, ticks every 60 s, for 10 minutes
        ("skip", [60, 240, 420, 600]),
        ("allow_all", [60, 120, 180, 240, 300, 360, 420, 480, 540, 600]),
        # 60 runs to 210; 120 is held, 180 dropped; 120 starts at ~210 and runs to ~360;
        # 240 is held, 300 and 360 dropped; 240 starts at ~360...
        ("buffer_one", [60, 120, 240, 420]),
        ("cancel_previous", [60, 120, 180, 240, 300, 360, 420, 480, 540, 600]),
    ],
)
async def test_overlap_policies(app: tether.App, overlap: str, expected: list[int]) -> None:
    @app.workflow
    async def long() -> None:
        await tether.sleep(150)

    async with Env(app, start=T0) as env:
        await app.schedule("long", long, every=60, overlap=overlap)
        await _until(env, T0 + 600)
    runs = {r.run_id: r for r in await app.list(workflow="long", limit=100)}
    ticks = [T0 + 60 * i for i in range(1, 11)]
    fired = sorted(t for t in ticks if tick_run_id("long", t) in runs)
    assert [int(t - T0) for t in fired] == expected
    if overlap == "cancel_previous":
        assert runs[tick_run_id("long", T0 + 60)].status is tether.RunStatus.CANCELLED
    if overlap == "buffer_one":
        # the held tick starts once the run before it ended (within the 5 s re-check)
        held = runs[tick_run_id("long", T0 + 120)]
        assert T0 + 210 <= held.created_at <= T0 + 216
    info = await app.get_schedule("long")
    assert info.last_tick is not None  # every tick so far was fired, skipped or is held
    ticks_seen = round((info.last_tick - T0) / 60)
    assert info.fired + info.skipped + (1 if info.buffered else 0) == ticks_seen


async def test_missed_ticks_fire_late_within_the_catch_up_window_only(app: tether.App) -> None:
    @app.workflow
    async def job() -> None:
        return None

    clock = VirtualClock(T0)
    app.store.clock = clock  # no worker for ten minutes
    # allow_all: this test is about the window, not about overlaps among the late runs
    await app.schedule("late", job, every=60, catchup_window=150, overlap="allow_all")
    async with Env(app, start=T0 + 600, skip_time=False):
        await _schedule_reaches(app, "late", T0 + 600)
    ids = sorted(r.run_id for r in await app.list(workflow="job"))
    assert ids == [tick_run_id("late", T0 + s) for s in (480, 540, 600)]
    assert (await app.get_schedule("late")).skipped == 7


async def test_a_daily_cron_over_the_night_the_clocks_go_back(app: tether.App) -> None:
    @app.workflow
    async def nightly() -> None:
        return None

    start = _at("2026-10-24T12:00:00+02:00")
    async with Env(app, start=start) as env:
        await app.schedule("nightly", nightly, cron="30 2 * * *", tz="Europe/Berlin")
        await _until(env, _at("2026-10-27T12:00:00+01:00"))
    last = "nightly@2026-10-27T01:30:00Z"  # the Env goes on skipping time afterwards
    ids = sorted(r.run_id for r in await app.list(workflow="nightly") if r.run_id <= last)
    assert ids == [
        "nightly@2026-10-25T00:30:00Z",  # 02:30 summer time, once
        "nightly@2026-10-26T01:30:00Z",
        "nightly@2026-10-27T01:30:00Z",
    ]


async def test_pause_resume_trigger_and_delete(app: tether.App) -> None:
    @app.workflow
    async def job() -> str:
        return "done"

    async with Env(app, start=T0, skip_time=False) as env:
        await app.schedule("ops", job, every=60)
        await env.advance(60)
        await _schedule_reaches(app, "ops", T0 + 60)  # fired before the pause
        assert await app.pause_schedule("ops", note="maintenance") is True
        assert await app.pause_schedule("ops") is False
        await env.advance(300)  # ticks while paused never fire
        await asyncio.sleep(0.2)  # best effort: a late firing would only pass unseen
        paused = await app.get_schedule("ops")
        assert paused.paused and paused.next_at is None and paused.note == "maintenance"
        assert await app.resume_schedule("ops") is True
        assert (await app.get_schedule("ops")).next_at == T0 + 420
        run = await app.trigger_schedule("ops")
        assert run.run_id.startswith("ops@trigger-") and await run.result(timeout=30) == "done"
        await app.delete_schedule("ops")
        await env.advance(600)
        await asyncio.sleep(0.2)  # best effort, as above: nothing may fire now
    ids = sorted(r.run_id for r in await app.list(workflow="job"))
    assert ids[:1] == [tick_run_id("ops", T0 + 60)] and len(ids) == 2  # and the trigger
    assert await app.schedules() == []
    with pytest.raises(tether.ScheduleNotFoundError):
        await app.get_schedule("ops")


# -- once per tick across worker processes ----------------------------------------------


async def pause_and_drain(store_url: str) -> None:
    """Pause the every-second schedule, then wait until each tick run it fired has ended:
    a tick fired just before the workers stop must still be run, not cut off by SIGTERM."""
    app = tether.App(store=store_url)
    try:
        assert await app.pause_schedule("every-second") is True
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            runs = await app.list(workflow="tick", limit=1000)
            if all(r.status == "completed" for r in runs):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"tick runs still open: {[r.run_id for r in runs]}")
    finally:
        await app.close()


async def wait_for_ticks(store_url: str, n: int, within: float) -> None:
    """Wait until the every-second schedule has fired ``n`` tick runs."""
    app = tether.App(store=store_url)
    try:
        deadline = time.monotonic() + within
        while len(await app.list(workflow="tick", limit=1000)) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"fewer than {n} ticks fired in {within} s")
            await asyncio.sleep(0.2)
    finally:
        await app.close()


def test_three_worker_processes_fire_each_tick_exactly_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    effects = tmp_path / "effects.db"
    env = {
        **os.environ,
        "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}",
        "TETHER_TEST_STORE": store_url,
        "SCHEDULE_EFFECTS": str(effects),
    }
    sys.path.insert(0, str(HERE))
    monkeypatch.setenv("TETHER_TEST_STORE", store_url)
    monkeypatch.setenv("SCHEDULE_EFFECTS", str(effects))
    try:
        import schedule_app

        schedule_app = importlib.reload(schedule_app)  # on this test's store
    finally:
        sys.path.remove(str(HERE))

    async def declare() -> float:
        await schedule_app.app.schedule(
            "every-second", schedule_app.tick, every=1, overlap="allow_all"
        )
        began = schedule_app.app.store.clock()
        await schedule_app.app.close()
        return began

    began = asyncio.run(declare())
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tether.cli", "worker", "schedule_app:app"],
            cwd=HERE,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(3)
    ]
    try:
        # several ticks, each by whichever worker won it: counted, not timed (a loaded
        # machine takes seconds just to start three workers)
        asyncio.run(wait_for_ticks(store_url, 5, 60))
        asyncio.run(pause_and_drain(store_url))  # the last tick's run ends before SIGTERM
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(30)

    async def read() -> tuple[list[str], tether.ScheduleInfo]:
        app = tether.App(store=store_url)
        try:
            runs = await app.list(workflow="tick", limit=1000)
            return [r.run_id for r in runs], await app.get_schedule("every-second")
        finally:
            await app.close()

    ids, info = asyncio.run(read())
    last = info.last_tick
    assert last is not None
    expected = [tick_run_id("every-second", t) for t in range(int(began) + 1, int(last) + 1)]
    assert sorted(ids) == expected  # every tick, none missed
    assert len(expected) >= 5 and info.fired == len(ids) and info.skipped == 0
    with sqlite3.connect(effects) as conn:
        rows = conn.execute("SELECT run_id, count(*) FROM effects GROUP BY run_id").fetchall()
    assert sorted(r[0] for r in rows) == expected and all(r[1] == 1 for r in rows)
    assert datetime.fromtimestamp(last, UTC) > datetime.fromtimestamp(began, UTC)


@pytest.mark.parametrize("overlap", ["skip", "cancel_previous"])
async def test_a_trigger_does_not_hide_the_running_tick_from_the_overlap_policy(
    app: tether.App, overlap: str
) -> None:
    """A trigger replaced the schedule's last run with its own: once the triggered run
    ended, the next tick saw nothing running, so 'skip' started a second run beside the
    tick's (and 'cancel_previous' cancelled nothing)."""

    @app.workflow
    async def job() -> None:
        if "@trigger-" not in tether.info().run_id:
            await tether.sleep(150)  # ticks run long, triggers end at once

    async with Env(app, start=T0, skip_time=False) as env:
        await app.schedule("s", job, every=60, overlap=overlap)
        first, second = tick_run_id("s", T0 + 60), tick_run_id("s", T0 + 120)
        await env.advance(60)
        await _schedule_reaches(app, "s", T0 + 60)  # the tick's run exists, then:
        triggered = await app.trigger_schedule("s")
        await triggered.result(timeout=30)
        await env.advance(60)
        await _schedule_reaches(app, "s", T0 + 120)
        if overlap == "cancel_previous":  # the cancel is carried out by the worker
            give_up = time.monotonic() + 30
            while not (await app.get(first)).is_finished:
                assert time.monotonic() < give_up, "the first tick's run was never cancelled"
                await asyncio.sleep(0.02)
        runs = {r.run_id: r for r in await app.list(workflow="job")}
    if overlap == "skip":
        assert second not in runs and not runs[first].is_finished
    else:
        assert runs[first].status is tether.RunStatus.CANCELLED and second in runs
    assert sum(1 for r in runs.values() if not r.is_finished) == 1


def test_a_tick_claimed_on_time_fires_whatever_the_window_and_jitter() -> None:
    """catchup_window=0 skipped every tick (a claim is never at the tick's exact instant)
    and a jitter longer than the window skipped most jittered ticks: lateness is now
    measured from the tick's due time (with its jitter), with a grace for the claim."""
    no_catchup = _spec(every=2, catchup_window=0)
    assert plan(no_catchup, T0 + 2, T0 + 2.3, "s") == (T0 + 2, 0, T0 + 4)
    tick, skipped, _after = plan(no_catchup, T0 + 2, T0 + 600, "s")  # after downtime
    assert tick is None or tick >= T0 + 600 - CLAIM_GRACE
    assert skipped >= (600 - CLAIM_GRACE) // 2 - 1
    jittery = _spec(every=2, jitter=10, catchup_window=5)
    for n in range(1, 50):
        due = jittered("s", jittery, T0 + 2 * n)
        assert plan(jittery, T0 + 2 * n, due + 0.5, "s")[0] == T0 + 2 * n
    # the window still bounds late firings: two days late is skipped, one day is not
    daily = _spec(every=86_400, start_at=T0)
    assert plan(daily, T0, T0 + 2 * 86_400, "s")[:2] == (T0 + 86_400, 1)


async def test_a_redeclaration_keeps_an_operators_pause_and_stores_a_new_note(
    app: tether.App,
) -> None:
    """Each deploy's unchanged declaration un-paused a schedule an operator had paused,
    a changed note alone was ignored, and resume wiped the note."""

    @app.workflow
    async def job() -> None:
        return None

    async with Env(app, start=T0, skip_time=False):
        first = await app.schedule("job", job, cron="0 * * * *", note="hourly")
        assert first.note == "hourly"
        assert await app.pause_schedule("job", note="maintenance") is True
        again = await app.schedule("job", job, cron="0 * * * *", note="hourly")  # deploy
        assert again.paused and again.next_at is None and again.note == "maintenance"
        assert await app.resume_schedule("job") is True
        resumed = await app.get_schedule("job")
        assert not resumed.paused and resumed.next_at == T0 + 3600
        assert resumed.note == "maintenance"  # resume does not wipe it
        noted = await app.schedule("job", job, cron="0 * * * *", note="hourly, v2")
        assert noted.note == "hourly, v2" and noted.next_at == T0 + 3600
        assert (await app.get_schedule("job")).note == "hourly, v2"
        paused = await app.schedule("job", job, cron="0 * * * *", paused=True, note="off")
        assert paused.paused and paused.next_at is None and paused.note == "off"


# -- catch-up after a long downtime: bounded work inside the firing's transaction --------

DAY = 86_400.0


class _CronSteps:
    """Counts croniter steps (``get_next``/``get_prev`` calls) while ``active``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from croniter import croniter  # type: ignore[import-untyped]

        self.steps = 0
        self.active = True
        for name in ("get_next", "get_prev"):
            original = getattr(croniter, name)

            def counted(it: object, *args: object, _original: object = original, **kw: object):  # type: ignore[no-untyped-def]
                if self.active:
                    self.steps += 1
                return _original(it, *args, **kw)  # type: ignore[operator]

            monkeypatch.setattr(croniter, name, counted)


def test_a_cron_back_from_30_days_of_downtime_plans_in_a_few_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A per-minute cron back after 30 days stepped croniter over each of its ~43,000
    missed ticks (seconds of CPU inside the firing's write transaction); now the ticks
    surely too late are jumped over and counted by arithmetic, with the same result."""
    counter = _CronSteps(monkeypatch)
    every_minute = _spec(cron="* * * * *")  # catch-up window: a day
    now = T0 + 30 * DAY
    tick, skipped, after = plan(every_minute, T0 + 60, now, "s")
    # late by more than the window plus the claim grace (86,410 s): skipped
    assert tick == now - DAY and after == now - DAY + 60
    assert skipped == round((now - DAY - (T0 + 60)) / 60)  # T0+60 ... now-DAY-60
    assert counter.steps <= 50
    # the same with a window of 5 minutes and jitter, in a time zone with clock changes
    counter.steps = 0
    berlin = _spec(cron="*/5 * * * *", tz="Europe/Berlin", catchup_window=300, jitter=20)
    start, now = _at("2026-03-01T00:05:00+01:00"), _at("2026-04-30T12:00:00+02:00")
    tick, skipped, _after = plan(berlin, start, now, "s")
    assert counter.steps <= 50
    counter.active = False  # the check below steps through every tick
    assert tick is not None and now - 300 - 10 - 20 <= tick <= now
    late = _ticks(berlin, start, tick)
    assert skipped == len(late) and all(now - jittered("s", berlin, t) > 310 for t in late)
    assert now - jittered("s", berlin, tick) <= 310


def _ticks(spec: ScheduleSpec, start: float, stop: float) -> list[float]:
    """Every tick from ``start`` (a tick) up to ``stop``, excluded, by stepping."""
    out: list[float] = []
    t: float | None = start
    while t is not None and t < stop:
        out.append(t)
        t = next_tick(spec, t)
    return out


async def test_a_firing_after_30_days_of_downtime_holds_its_transaction_briefly(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On both stores: the firing after a month of downtime fires the right ticks and
    counts the rest as skipped, with a few croniter steps inside its transaction."""
    from tether.store.ops import timers

    @app.workflow
    async def job() -> None:
        return None

    counter = _CronSteps(monkeypatch)
    counter.active = False
    worst: list[int] = []
    fire = timers._fire_schedule

    def measured(tx: object, task: object) -> None:
        counter.steps, counter.active = 0, True
        try:
            fire(tx, task)  # type: ignore[arg-type]
        finally:
            counter.active = False
            worst.append(counter.steps)

    monkeypatch.setattr(timers, "_fire_schedule", measured)
    app.store.clock = VirtualClock(T0)  # declared, then no worker for 30 days
    await app.schedule("minutely", job, cron="* * * * *", catchup_window=300, overlap="allow_all")
    back = T0 + 30 * DAY
    async with Env(app, start=back, skip_time=False):
        await _schedule_reaches(app, "minutely", back)
        info = await app.get_schedule("minutely")
    ids = sorted(r.run_id for r in await app.list(workflow="job"))
    # late by up to 310 s (window plus claim grace) fires: the last 5 minutes and now
    assert ids == [tick_run_id("minutely", back - s) for s in (300, 240, 180, 120, 60, 0)]
    assert info.skipped == round((back - 360 - T0) / 60)  # T0+60 ... back-360
    assert info.fired == 6
    assert worst and max(worst) <= 50


def test_an_ended_interval_schedule_counts_only_its_own_ticks_as_skipped() -> None:
    """An interval schedule whose end passed during downtime counted as skipped every
    interval up to the catch-up window, far past its last tick."""
    hourly = _spec(every=60, start_at=T0, end_at=T0 + 3600)  # ticks T0 ... T0+3600
    assert plan(hourly, T0, T0 + 10 * DAY, "s") == (None, 61, None)
    cron = _spec(cron="* * * * *", start_at=T0, end_at=T0 + 3600)
    assert plan(cron, T0, T0 + 10 * DAY, "s") == (None, 61, None)


# (cron, time zone, from, to): dense and sparse expressions, L/W/# days, over clock
# changes (Lord Howe's are half an hour; Samoa skipped a whole day in December 2011)
COUNTED = [
    ("* * * * *", "UTC", "2026-02-27T22:00", "2026-03-02T01:00"),
    ("* * * * *", "Europe/Berlin", "2026-03-28T00:00", "2026-03-30T00:00"),
    ("* * * * *", "Europe/Berlin", "2026-10-24T12:00", "2026-10-26T00:00"),
    ("*/7 1-3 * * *", "Europe/Berlin", "2026-10-20T00:00", "2026-11-02T00:00"),
    ("30 2 * * *", "America/New_York", "2026-03-01T00:00", "2026-11-30T00:00"),
    ("30 1 * * *", "America/New_York", "2026-10-30T00:00", "2026-11-03T00:00"),
    ("*/10 * * * *", "Australia/Lord_Howe", "2026-04-04T00:00", "2026-04-06T00:00"),
    ("*/10 * * * *", "Australia/Lord_Howe", "2026-10-03T00:00", "2026-10-05T00:00"),
    ("0 * * * *", "Pacific/Apia", "2011-12-28T00:00", "2012-01-02T00:00"),
    ("0 9 * * 1-5", "Europe/Paris", "2025-12-20T00:00", "2026-04-10T00:00"),
    ("0 0 1,15 * 1", "UTC", "2024-01-01T00:00", "2026-01-01T00:00"),
    ("0 0 29 2 *", "UTC", "2001-01-01T00:00", "2030-01-01T00:00"),
    ("0 12 L * *", "Europe/London", "2025-01-01T00:00", "2027-01-01T00:00"),
    ("0 0 * * 5#2", "UTC", "2025-01-01T00:00", "2027-01-01T00:00"),
    ("5 1 15W * *", "America/Sao_Paulo", "2016-01-01T00:00", "2019-01-01T00:00"),
    ("0 2 * * L6", "Europe/Berlin", "2025-01-01T00:00", "2027-01-01T00:00"),
]


@pytest.mark.parametrize(("cron", "tz", "first", "last"), COUNTED)
def test_skipped_cron_ticks_are_counted_as_stepping_would(
    cron: str, tz: str, first: str, last: str
) -> None:
    """The count of passed ticks is exact: the same as stepping through them, from any
    tick (one planned inside a repeated hour included) to any instant."""
    spec = _spec(cron=cron, tz=tz)
    zone = ZoneInfo(tz)
    lo = datetime.fromisoformat(first).replace(tzinfo=zone).timestamp()
    hi = datetime.fromisoformat(last).replace(tzinfo=zone).timestamp()
    ticks = _ticks(spec, next_tick(spec, lo) or hi, hi)
    assert ticks
    for start in (ticks[0], ticks[len(ticks) // 3], ticks[-1]):
        for stop in (hi, hi - 1234.5, ticks[-1], (ticks[0] + hi) / 2):
            expected = bisect.bisect_left(ticks, stop) - bisect.bisect_left(ticks, start)
            assert count_ticks(spec, start, stop) == max(0, expected), (start, stop)
    if tz == "America/New_York" and cron.startswith("30 1"):
        # a tick planned in the repeated hour (declared then): the next ones follow it
        second = datetime(2026, 11, 1, 1, 10, fold=1, tzinfo=zone).timestamp()
        ticks = _ticks(spec, next_tick(spec, second) or hi, hi)
        assert datetime.fromtimestamp(ticks[0], zone).fold == 1
        for stop in (hi, ticks[1] + 1, ticks[0] + 1):
            expected = bisect.bisect_left(ticks, stop)
            assert count_ticks(spec, ticks[0], stop) == expected
