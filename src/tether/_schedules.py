"""Schedules: what a schedule is, when it fires next, and what one firing decides.

A schedule starts runs of one workflow on a cron expression (in a time zone) or at a
fixed interval. Its ticks are instants; the run a tick starts has the id
``<schedule id>@<tick in UTC>``, so a tick can start at most one run whatever fires it
twice. The store holds each schedule and one ``schedule`` task due at its next tick
(plus jitter); whichever worker claims that task fires the tick (``plan`` here, then
one commit in the store), so no leader is elected anywhere.

Time zones and clock changes (cron schedules): a local time that does not exist on a
day the clocks go forward fires at the first valid time after it (02:30 becomes 03:00);
a local time that happens twice when they go back fires once, at its first
occurrence. Interval schedules count seconds and ignore time zones.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ._errors import ConfigurationError
from ._policy import seconds

#: what to do with a tick while the schedule's previous run is still going
OVERLAP_POLICIES = ("skip", "buffer_one", "allow_all", "cancel_previous")
#: how long after a tick it may still fire (e.g. after downtime), by default
DEFAULT_CATCHUP = 86_400.0
#: a tick claimed this long (seconds) after it was due is still on time, whatever the
#: catch-up window: a worker takes a moment (its poll interval, a commit) to claim it
CLAIM_GRACE = 10.0
#: a tick held back by ``buffer_one`` is looked at again this often (seconds)
BUFFER_RECHECK = 5.0
#: at most this many missed ticks are stepped over one by one before jumping
_MAX_STEPS = 100_000
#: the longest ``every``, ``jitter`` and ``catchup_window`` (seconds): about 100 years
MAX_SPAN = 100 * 365.25 * 86_400
#: the last instant a tick, ``start_at`` or ``end_at`` may be: the end of year 9999
MAX_EPOCH = 253_402_300_799
#: schedule ids are at most this long (a run id adds the tick)
MAX_ID = 150


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """When a schedule fires and how it treats overlaps and missed ticks."""

    cron: str | None = None  #: a five-field cron expression (``croniter``)
    every: float | None = None  #: or an interval in seconds (>= 1)
    tz: str = "UTC"  #: the time zone of ``cron``
    jitter: float = 0.0  #: up to this many seconds late, fixed per tick
    overlap: str = "skip"  #: one of OVERLAP_POLICIES
    catchup_window: float = DEFAULT_CATCHUP  #: missed ticks older than this are skipped
    start_at: float | None = None  #: no tick before (epoch seconds); intervals count from it
    end_at: float | None = None  #: no tick after

    def to_json(self) -> dict[str, Any]:
        """The spec as stored."""
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ScheduleSpec:
        """The spec from its stored form."""
        return cls(**data)


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule as the store holds it."""

    schedule_id: str
    workflow: str
    queue: str
    spec: ScheduleSpec
    paused: bool
    next_at: float | None  #: the next tick (None: ended, or paused)
    last_tick: float | None
    last_run_id: str | None
    fired: int  #: runs started
    skipped: int  #: ticks not fired (overlap, catch-up window)
    note: str | None
    created_at: float
    updated_at: float
    version: int  #: bumped by every change: a firing planned on an older one is redone
    input: Any = None  #: the workflow's arguments (decoded)
    buffered: float | None = None  #: a tick held by ``buffer_one``

    def to_json(self) -> dict[str, Any]:
        """As the CLI and the HTTP API show it."""
        return {
            "id": self.schedule_id,
            "workflow": self.workflow,
            "spec": self.spec.to_json(),
            "paused": self.paused,
            "next_at": self.next_at,
            "last_tick": self.last_tick,
            "last_run_id": self.last_run_id,
            "fired": self.fired,
            "skipped": self.skipped,
            "note": self.note,
            "input": self.input,
        }


def make_spec(
    *,
    cron: str | None,
    every: float | timedelta | None,
    tz: str | None,
    jitter: float | timedelta | None,
    overlap: str,
    catchup_window: float | timedelta | None,
    start_at: float | datetime | None,
    end_at: float | datetime | None,
) -> ScheduleSpec:
    """Validate a schedule's options (each error names its field); nothing is stored."""
    if (cron is None) == (every is None):
        raise ConfigurationError("a schedule needs exactly one of cron= or every=")
    interval = None
    if every is not None:
        interval = seconds(every, "every=")
        if interval is None or not 1 <= interval <= MAX_SPAN:
            raise ConfigurationError(
                f"every= must be from 1 second to {MAX_SPAN:.0f} (about 100 years; got {every!r})"
            )
    if tz is not None and not isinstance(tz, str):
        raise ConfigurationError(f"tz= takes a time zone name such as 'Europe/Paris' (got {tz!r})")
    zone = tz or "UTC"
    _zone(zone)
    if cron is not None:
        _check_cron(cron)
    if overlap not in OVERLAP_POLICIES:
        raise ConfigurationError(
            f"overlap= must be one of {', '.join(OVERLAP_POLICIES)} (got {overlap!r})"
        )
    spread = seconds(jitter, "jitter=") or 0.0
    if not 0 <= spread <= MAX_SPAN:
        raise ConfigurationError(f"jitter= must be from 0 to {MAX_SPAN:.0f} s (got {jitter!r})")
    window = (
        DEFAULT_CATCHUP if catchup_window is None else seconds(catchup_window, "catchup_window=")
    )
    if window is None or not 0 <= window <= MAX_SPAN:
        raise ConfigurationError(
            f"catchup_window= must be from 0 to {MAX_SPAN:.0f} s (got {catchup_window!r})"
        )
    first, last = _epoch(start_at, "start_at"), _epoch(end_at, "end_at")
    if first is not None and last is not None and last <= first:
        raise ConfigurationError("end_at= must be after start_at=")
    return ScheduleSpec(
        cron=cron,
        every=interval,
        tz=zone,
        jitter=spread,
        overlap=overlap,
        catchup_window=window,
        start_at=first,
        end_at=last,
    )


def check_schedule_id(schedule_id: str) -> None:
    """Schedule ids name runs (``<id>@<tick>``): short, printable, no ``@``."""
    if (
        not isinstance(schedule_id, str)
        or not schedule_id
        or len(schedule_id) > MAX_ID
        or not schedule_id.isprintable()
        or "@" in schedule_id
    ):
        raise ConfigurationError(
            f"schedule id must be 1-{MAX_ID} printable characters without '@' (got {schedule_id!r})"
        )


def next_tick(spec: ScheduleSpec, after: float) -> float | None:
    """The first tick strictly after ``after`` (epoch seconds); None past ``end_at``."""
    floor = spec.start_at
    if floor is not None and after < floor:
        after = floor - 1e-6  # the first tick may be start_at itself
    if spec.every is not None:
        anchor = spec.start_at or 0.0
        n = math.floor((after - anchor) / spec.every) + 1
        tick = anchor + n * spec.every
    else:
        assert spec.cron is not None
        tick = _next_cron(spec.cron, _zone(spec.tz), after)
    if (spec.end_at is not None and tick > spec.end_at) or tick > MAX_EPOCH:
        return None
    return tick


def plan(
    spec: ScheduleSpec, next_at: float, now: float, schedule_id: str | None = None
) -> tuple[float | None, int, float | None]:
    """What firing at ``now`` does: (the tick to fire, or None when ``next_at`` is not
    due; ticks skipped for being older than the catch-up window; the tick after).

    A tick is late by ``now`` minus its due time (the tick plus its jitter, given the
    schedule's id) and is skipped when that exceeds ``catchup_window`` plus
    ``CLAIM_GRACE`` (the time a worker may take to claim a due task): a window of 0
    means no catch-up after downtime, not that a tick must be claimed at its instant."""
    if next_at > now:
        return None, 0, next_at
    allowed = spec.catchup_window + CLAIM_GRACE

    def late(t: float) -> bool:
        due = t if schedule_id is None else jittered(schedule_id, spec, t)
        return now - due > allowed

    tick: float | None = next_at
    skipped = 0
    while tick is not None and late(tick):
        if spec.every is not None and skipped == 0:
            # jump straight to the last tick surely late (whatever its jitter)
            missed = math.floor((now - allowed - spec.jitter - tick) / spec.every)
            if missed > 1:
                tick += (missed - 1) * spec.every
                skipped += missed - 1
                continue
        tick = next_tick(spec, tick)
        skipped += 1
        if skipped >= _MAX_STEPS:
            tick = next_tick(spec, now - allowed - spec.jitter)
            break
    if tick is None or tick > now:
        return None, skipped, tick
    return tick, skipped, next_tick(spec, tick)


def jittered(schedule_id: str, spec: ScheduleSpec, tick: float) -> float:
    """When the task for ``tick`` is due: the tick plus its own fixed share of jitter."""
    if not spec.jitter:
        return tick
    digest = hashlib.sha256(f"{schedule_id}\0{tick!r}".encode()).digest()
    return tick + spec.jitter * (int.from_bytes(digest[:4]) / 2**32)


def tick_run_id(schedule_id: str, tick: float) -> str:
    """The id of the run a tick starts: one per (schedule, tick), so never two."""
    when = datetime.fromtimestamp(tick, UTC)
    text = when.strftime("%Y-%m-%dT%H:%M:%S")
    if when.microsecond:
        text += f".{when.microsecond:06d}"
    return f"{schedule_id}@{text}Z"


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigurationError(
            f"tz= {name!r} is not a known time zone (use an IANA name like 'Europe/Paris'; "
            "pip install tzdata where the system has none)"
        ) from None


def _croniter() -> Any:
    try:
        from croniter import croniter  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigurationError(
            "cron schedules need croniter: pip install 'tether[schedules]'"
        ) from None
    return croniter


def _check_cron(expr: str) -> None:
    croniter = _croniter()
    if not isinstance(expr, str) or len(expr.split()) != 5 or not croniter.is_valid(expr):
        raise ConfigurationError(
            f"cron= {expr!r} is not a valid five-field cron expression "
            "(minute hour day-of-month month day-of-week, e.g. '0 2 * * *')"
        )
    try:  # valid fields can still name no date at all (the 31st of February)
        croniter(expr, datetime.now(UTC)).get_next(datetime)
    except Exception:
        raise ConfigurationError(
            f"cron= {expr!r} never fires: no date matches it (a day its month does not have?)"
        ) from None


def _next_cron(expr: str, zone: ZoneInfo, after: float) -> float:
    croniter = _croniter()
    start = datetime.fromtimestamp(after, zone)
    it = croniter(expr, start)
    wall = start.replace(tzinfo=None)
    while True:
        candidate: datetime = it.get_next(datetime)
        if candidate.timestamp() <= after:
            continue
        # clocks turned back: a wall time seen already (its second occurrence) is skipped
        if candidate.replace(tzinfo=None) <= wall:
            continue
        return float(candidate.timestamp())


def _epoch(value: float | datetime | None, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ConfigurationError(f"{field}= needs a timezone-aware datetime")
        seconds_ = value.timestamp()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds_ = float(value)
    else:
        raise ConfigurationError(f"{field}= takes epoch seconds or an aware datetime")
    if not 0 <= seconds_ <= MAX_EPOCH:  # also NaN
        raise ConfigurationError(
            f"{field}= must be a time from 1970 to the end of year 9999 "
            f"(epoch seconds 0 to {MAX_EPOCH}; got {value!r})"
        )
    return seconds_
