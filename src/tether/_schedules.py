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

import bisect
import calendar
import functools
import hashlib
import math
import re
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
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
#: at most this many ticks near the catch-up window's edge (late or not by their jitter)
#: are looked at one by one; past them, firing jumps to the first tick after the edge
_MAX_STEPS = 1_000
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
    means no catch-up after downtime, not that a tick must be claimed at its instant.

    The work is bounded whatever the downtime (it runs inside the firing's write
    transaction): the ticks surely late whatever their jitter are jumped over at once and
    counted by arithmetic (``count_ticks``), and only the few near the window's edge are
    looked at one by one."""
    if next_at > now:
        return None, 0, next_at
    allowed = spec.catchup_window + CLAIM_GRACE

    def late(t: float) -> bool:
        due = t if schedule_id is None else jittered(schedule_id, spec, t)
        return now - due > allowed

    tick: float | None = next_at
    skipped = 0
    # a tick up to a second before this one is late, whatever its share of jitter
    surely = now - allowed - spec.jitter - 1.0
    if next_at <= surely:
        tick, skipped = _pass(spec, next_at, surely)
    steps = 0
    while tick is not None and late(tick):
        if steps == _MAX_STEPS:
            # a jitter spanning very many ticks: on to the first a second before the
            # ticks no jitter can make late
            tick, passed = _pass(spec, tick, now - allowed - 1.0)
            skipped += passed
        else:
            tick = next_tick(spec, tick)
            skipped += 1
        steps += 1
    if tick is None or tick > now:
        return None, skipped, tick
    return tick, skipped, next_tick(spec, tick)


def _pass(spec: ScheduleSpec, tick: float, until: float) -> tuple[float | None, int]:
    """Go from ``tick`` past every tick up to ``until``, as stepping from ``tick`` would:
    (the first tick after ``until``, None if the schedule ends first; how many passed)."""
    if spec.cron is not None:
        until = _first_pass(_zone(spec.tz), tick, until)
    target = next_tick(spec, until)
    if target is None:  # ended: every tick left is passed
        end = MAX_EPOCH if spec.end_at is None else min(spec.end_at, MAX_EPOCH)
        # cron ticks are whole seconds (and a local time's float can round up to it)
        stop = math.nextafter(end, math.inf) if spec.cron is None else math.floor(end) + 1.0
        return None, count_ticks(spec, tick, stop)
    return target, count_ticks(spec, tick, target)


def _first_pass(zone: ZoneInfo, tick: float, until: float) -> float:
    """``until``, or the end of the repeated hour it falls in (clocks turned back) when
    ``tick`` is before that hour: stepping from ``tick`` fires each of its local times
    at their first pass, never in the second, so the next tick is after it."""
    if datetime.fromtimestamp(until, zone).fold == 0:
        return until
    for change, old, new in _offset_changes(zone, until - 2 * 86_400, until + 1):
        if new < old and change <= until < change + old - new and tick < change:
            return change + old - new - 0.5
    return until


def count_ticks(spec: ScheduleSpec, start: float, stop: float) -> int:
    """How many ticks stepping from ``start`` (a tick) meets before ``stop``, without
    stepping through them: by arithmetic for intervals; for cron, by counting the
    matching local minutes (the matching days times the minutes a day that fire),
    stepping only across the minutes around each clock change, so the cost grows with
    the days spanned (and the months, for days croniter must find), not the ticks."""
    if stop <= start:
        return 0
    if spec.every is not None:
        anchor = spec.start_at or 0.0
        first = round((start - anchor) / spec.every)
        n = math.ceil((stop - anchor) / spec.every)  # the first tick at or after stop
        while n > first and anchor + (n - 1) * spec.every >= stop:
            n -= 1
        while anchor + n * spec.every < stop:
            n += 1
        return max(0, n - first)
    assert spec.cron is not None
    zone, fields = _zone(spec.tz), _cron_fields(spec.cron)

    def stepped(lo: float, hi: float) -> int:  # the ticks from lo up to hi, one by one
        count, t = 0, next_tick(spec, lo - 0.5)
        while t is not None and t < hi:
            count, t = count + (t >= lo), next_tick(spec, t)
        return count

    total, at = 0, start
    for change, old, new in _offset_changes(zone, start - 2 * 86_400, stop + 2 * 86_400):
        if new < old:  # clocks turned back: local times from new to old pass twice
            end = change + old - new
            if end <= at or change >= stop:
                continue
            if at < change:
                # from before, the second pass never fires: each local minute once
                if stop < end:
                    total += fields.minutes(_wall(at, zone), _local(change, old))
                    return total
                continue
            # from within the second pass (a tick planned there): step to its end
            hi = min(end + 60.0, stop)
            total, at = total + stepped(at, hi), hi
        else:  # clocks turned forward: a skipped time fires at the end of the gap
            lo, hi = max(change - 60.0, at), min(change + 60.0, stop)
            if lo >= hi:
                continue
            total += fields.minutes(_wall(at, zone), _wall(lo, zone)) + stepped(lo, hi)
            at = hi
    if at < stop:
        total += fields.minutes(_wall(at, zone), _wall(stop, zone))
    return total


def _wall(instant: float, zone: ZoneInfo) -> datetime:
    """The local time of ``instant`` in ``zone``, naive."""
    return datetime.fromtimestamp(instant, zone).replace(tzinfo=None)


def _local(instant: float, offset: float) -> datetime:
    """The local time of ``instant`` at a UTC ``offset`` (seconds), naive."""
    return datetime.fromtimestamp(instant, UTC).replace(tzinfo=None) + timedelta(seconds=offset)


def _offset_changes(zone: ZoneInfo, lo: float, hi: float) -> list[tuple[float, float, float]]:
    """The instants from ``lo`` to ``hi`` at which ``zone``'s UTC offset changes, each
    with the offsets before and after (seconds): sampled every 6 hours, bisected to
    the second (time zone rules change offsets months apart)."""

    def offset(t: float) -> float:
        delta = datetime.fromtimestamp(t, zone).utcoffset()
        return 0.0 if delta is None else delta.total_seconds()

    changes = []
    t = math.floor(lo)
    before = offset(t)
    while t < hi:
        u = t + 6 * 3600
        after = offset(u)
        if after != before:
            a, b = t, u
            while b - a > 1:
                mid = (a + b) // 2
                a, b = (mid, b) if offset(mid) == before else (a, mid)
            after = offset(b)
            changes.append((float(b), before, after))
            u = b
        t, before = u, after
    return changes


@dataclass(frozen=True)
class _CronFields:
    """A cron expression's times of day and a test of its days, for counting ticks."""

    expr: str
    day_minutes: tuple[int, ...]  #: sorted minutes after midnight that fire
    #: plain fields (numbers, ranges, steps, names) are tested here; days with L, W or #
    #: are found by croniter, a month at a time (cached by the month's shape)
    plain: bool
    months: frozenset[int] | None  #: None: any
    days: frozenset[int] | None
    weekdays: frozenset[int] | None  #: 0 is Sunday
    shapes: dict[tuple[int, int, int], tuple[int, ...]] = field(default_factory=dict, compare=False)

    def minutes(self, start: datetime, stop: datetime) -> int:
        """How many local minutes from ``start`` up to ``stop`` (excluded) fire."""
        if stop <= start:
            return 0

        def index(moment: datetime) -> int:  # minutes that fire in its day before it
            minute = moment.hour * 60 + moment.minute + bool(moment.second or moment.microsecond)
            return bisect.bisect_left(self.day_minutes, minute)

        first, last = start.date(), stop.date()
        if first == last:
            return self.days_between(first, first + _DAY) * (index(stop) - index(start))
        return (
            self.days_between(first, first + _DAY) * (len(self.day_minutes) - index(start))
            + self.days_between(first + _DAY, last) * len(self.day_minutes)
            + self.days_between(last, last + _DAY) * index(stop)
        )

    def days_between(self, first: date, last: date) -> int:
        """How many days from ``first`` up to ``last`` (excluded) fire."""
        count = 0
        while first < last:
            month_end = (first.replace(day=28) + timedelta(days=4)).replace(day=1)
            upto = min(last, month_end)
            if self.plain:
                count += sum(
                    self._plain(first + timedelta(days=i)) for i in range((upto - first).days)
                )
            else:
                days = self._month(first.year, first.month)
                stop_day = (upto - first).days + first.day
                count += bisect.bisect_left(days, stop_day) - bisect.bisect_left(days, first.day)
            first = upto
        return count

    def _plain(self, day: date) -> bool:
        if self.months is not None and day.month not in self.months:
            return False
        dom = self.days is None or day.day in self.days
        dow = self.weekdays is None or day.isoweekday() % 7 in self.weekdays
        if self.days is not None and self.weekdays is not None:
            return dom or dow  # both restricted: either one (cron's rule)
        return dom and dow

    def _month(self, year: int, month: int) -> tuple[int, ...]:
        """The days of a month that fire, by croniter; the same for every month of the
        same shape (the month, its length, the weekday of its first)."""
        first_weekday, length = calendar.monthrange(year, month)
        shape = (month, length, first_weekday)
        if shape not in self.shapes:
            _, _, dom, mon, dow = self.expr.split()
            it = _croniter()(f"0 0 {dom} {mon} {dow}", datetime(year, month, 1) - _MINUTE)
            days = []
            while (day := it.get_next(datetime)).month == month and day.year == year:
                days.append(day.day)
            self.shapes[shape] = tuple(days)
        return self.shapes[shape]


_DAY = timedelta(days=1)
_MINUTE = timedelta(minutes=1)


@functools.lru_cache(maxsize=128)
def _cron_fields(expr: str) -> _CronFields:
    it = _croniter()(expr, datetime(2000, 1, 1))
    minutes, hours, days, months, weekdays = it.expanded
    plain = (
        not it.nth_weekday_of_month
        and not getattr(it, "nearest_weekday", None)
        and all(isinstance(v, int) for f in (days, months, weekdays) for v in f if v != "*")
    )

    def values(field_: list[Any], modulo: int = 0) -> frozenset[int] | None:
        if field_ == ["*"] or not plain:
            return None
        return frozenset(int(v) % modulo if modulo else int(v) for v in field_)

    return _CronFields(
        expr=expr,
        day_minutes=tuple(
            sorted(
                h * 60 + m
                for h in (range(24) if hours == ["*"] else hours)
                for m in (range(60) if minutes == ["*"] else minutes)
            )
        ),
        plain=plain,
        months=values(months),
        days=values(days),
        weekdays=values(weekdays, 7),
    )


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


#: croniter's random field (``R``, ``R(0-30)``, ``R/5``): another value each time it is read
_RANDOM = re.compile(r"[rR](\(\d+-\d+\))?(/\d+)?")


def _check_cron(expr: str) -> None:
    croniter = _croniter()
    if not isinstance(expr, str) or len(expr.split()) != 5 or not croniter.is_valid(expr):
        raise ConfigurationError(
            f"cron= {expr!r} is not a valid five-field cron expression "
            "(minute hour day-of-month month day-of-week, e.g. '0 2 * * *')"
        )
    if any(_RANDOM.fullmatch(f) for f in expr.split()):
        raise ConfigurationError(
            f"cron= {expr!r} has a random field (R): it would name another time at each "
            "look, so a schedule's ticks would come at random; write the minute or hour"
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
