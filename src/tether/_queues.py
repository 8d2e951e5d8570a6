"""Queue limits (``app.configure_queue``) and queue statistics (``app.queue_stats``).

Limits live in the store's ``queue_limits`` table, so every worker process that
claims from a queue obeys the same caps: the claim query itself enforces them
(see ``_claim`` in ``store/ops/claims.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._errors import ConfigurationError
from ._history import INT32_MAX
from ._policy import seconds

#: priorities are stored as 32-bit integers (PostgreSQL INTEGER)
PRIORITY_MIN, PRIORITY_MAX = -INT32_MAX - 1, INT32_MAX


#: the bounds of a rate in tokens per second (``rate / per``): one a ~30 years to a
#: billion a second; beyond them the bucket's arithmetic overflows or never refills
RATE_MIN, RATE_MAX = 1e-9, 1e9


#: the longest name of a queue, workflow or activity (a column and an HTTP path segment)
MAX_NAME = 200


def check_name(value: Any, what: str, longest: int = MAX_NAME) -> str:
    """A name (of a queue, workflow, activity, signal, run...): 1-``longest`` printable
    characters. A number would be stored as one and never match the text a worker serves
    (its runs would wait for ever); NUL is refused by PostgreSQL mid-commit."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{what} must be a non-empty string (got {value!r})")
    if len(value) > longest or not value.isprintable():
        raise ConfigurationError(
            f"{what} {value[:80]!r} must be at most {longest} printable characters "
            "(no control characters, line breaks or unpaired surrogates)"
        )
    return value


def _positive_int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{what} must be a positive integer (got {value!r})")
    if value < 1:
        raise ConfigurationError(f"{what} must be at least 1 (got {value!r})")
    if value > INT32_MAX:  # kept in a 32-bit column (PostgreSQL INTEGER)
        raise ConfigurationError(f"{what} must be at most {INT32_MAX:,} (got {value!r})")
    return value


def _positive_number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{what} must be a positive number (got {value!r})")
    if not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{what} must be a positive, finite number (got {value!r})")
    return float(value)


def check_priority(value: Any, what: str) -> int:
    """Validate an activity priority (an int; higher is claimed first)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"priority of {what} must be an integer (got {value!r})")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ConfigurationError(
            f"priority of {what} must fit in 32 bits ({PRIORITY_MIN}..{PRIORITY_MAX}), got {value}"
        )
    return value


@dataclass(frozen=True, kw_only=True)
class QueueLimits:
    """The validated limits of one queue, as stored in ``queue_limits``."""

    queue: str
    max_concurrency: int | None = None
    rate: float | None = None  #: tokens per second
    burst: float | None = None
    key_concurrency: int | None = None
    fair: bool = False
    pause_on_429: bool = True

    @classmethod
    def build(
        cls,
        name: Any,
        *,
        max_concurrency: Any = None,
        rate: Any = None,
        per: Any = 1.0,
        burst: Any = None,
        key_concurrency: Any = None,
        fair: Any = False,
        pause_on_429: Any = True,
        what: str | None = None,
    ) -> QueueLimits:
        """Validate ``app.configure_queue`` arguments; errors name the field (of
        ``what``: the queue, or the ``Dependency`` whose hidden row this is)."""
        check_name(name, "queue name")
        what = what or f"queue {name!r}"
        cap = _positive_int(max_concurrency, f"max_concurrency of {what}")
        per_s = seconds(per, f"per of {what}")
        if per_s is None or per_s <= 0:
            raise ConfigurationError(f"per of {what} must be a positive duration (got {per!r})")
        r = _positive_number(rate, f"rate of {what}")
        b = _positive_number(burst, f"burst of {what}")
        if b is not None and r is None:
            raise ConfigurationError(f"burst of {what} needs a rate (burst={burst!r}, no rate=)")
        if b is not None and b < 1:
            raise ConfigurationError(
                f"burst of {what} must be at least 1 (a bucket smaller than one token never "
                f"lets a task through), got {burst!r}"
            )
        per_second = None if r is None else r / per_s
        if per_second is not None and not RATE_MIN <= per_second <= RATE_MAX:
            raise ConfigurationError(
                f"rate of {what} must be between {RATE_MIN:g} and {RATE_MAX:g} per second "
                f"(rate / per), got {rate!r} per {per!r}s = {per_second:g}/s"
            )
        if per_second is not None and b is None:
            b = max(1.0, per_second)
        keys = _positive_int(key_concurrency, f"key_concurrency of {what}")
        for flag, value in (("fair", fair), ("pause_on_429", pause_on_429)):
            if not isinstance(value, bool):
                raise ConfigurationError(f"{flag} of {what} must be True or False (got {value!r})")
        return cls(
            queue=name,
            max_concurrency=cap,
            rate=per_second,
            burst=b,
            key_concurrency=keys,
            fair=fair,
            pause_on_429=pause_on_429,
        )

    def to_json(self) -> dict[str, Any]:
        """The settings written by the store's ``configure_queue``."""
        return {
            "max_concurrency": self.max_concurrency,
            "rate": self.rate,
            "burst": self.burst,
            "key_concurrency": self.key_concurrency,
            "fair": self.fair,
            "pause_on_429": self.pause_on_429,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueStats:
    """What one queue holds now, from ``app.queue_stats()`` or ``tether queues``."""

    queue: str
    ready: int  #: tasks due now and not leased (all kinds; not those of a suspended run)
    oldest_ready_age: float | None  #: seconds the oldest ready task has waited
    running: int  #: tasks leased to a worker, lease not expired
    running_by_key: dict[str, int] = field(default_factory=dict)  #: running activities
    scheduled: int = 0  #: tasks due later (timers, retries waiting out a backoff)
    paused_until: float | None = None
    tokens: float | None = None  #: rate-limit tokens available now (None: no rate)
    max_concurrency: int | None = None
    rate: float | None = None  #: tokens per second
    burst: float | None = None
    key_concurrency: int | None = None
    fair: bool = False
    pause_on_429: bool = False
    configured: bool = False  #: the queue has a row in ``queue_limits``


#: prefix of the hidden ``queue_limits`` rows that hold dependency limiters
DEPENDENCY_PREFIX = "dep:"


class Dependency:
    """A shared limit on an external dependency, e.g. one model behind one API key.

    ``tether.Dependency("openai", key=lambda model, *a, **k: model, rate=60, per=60,
    max_concurrency=8)`` declared on activities (``@app.activity(dependency=...)``)
    makes every step calling it, in any queue and any worker process, share one
    limiter per (name, key): at most ``max_concurrency`` running and ``rate`` starts
    per ``per`` seconds (token bucket of ``burst``). ``key`` is a string or a
    function of the call's arguments, evaluated when the step is scheduled (e.g. the
    model and API key). Rate-limit feedback from the dependency (HTTP 429
    ``Retry-After``; ``x-ratelimit-remaining-*: 0`` with ``x-ratelimit-reset-*``)
    pauses that limiter, so every waiting step for it waits, not only the refused one.
    """

    def __init__(
        self,
        name: str,
        key: str | Callable[..., str] | None = None,
        *,
        max_concurrency: int | None = None,
        rate: float | None = None,
        per: Any = 1.0,
        burst: float | None = None,
    ) -> None:
        if not isinstance(name, str) or not name or ":" in name:
            raise ConfigurationError(
                f"dependency name must be a non-empty string without ':' (got {name!r})"
            )
        if key is not None and not (isinstance(key, str) or callable(key)):
            raise ConfigurationError(
                f"key of dependency {name!r} must be a string or a function of the "
                f"activity's arguments returning one (got {type(key).__name__})"
            )
        self.name = name
        self.key = key
        self.limits = QueueLimits.build(
            f"{DEPENDENCY_PREFIX}{name}",
            max_concurrency=max_concurrency,
            rate=rate,
            per=per,
            burst=burst,
            what=f"dependency {name!r}",
        )

    def __repr__(self) -> str:
        return f"<tether.Dependency {self.name}>"

    def limiter(self, activity: str, args: Any, kwargs: dict[str, Any]) -> str:
        """The limiter id (the hidden ``queue_limits`` row) for one call."""
        key = self.key
        if callable(key):
            try:
                key = key(*args, **kwargs)
            except Exception as exc:
                raise ConfigurationError(
                    f"key of dependency {self.name!r} (activity {activity!r}) failed on this "
                    f"call's arguments: {type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(key, str):
                raise ConfigurationError(
                    f"key of dependency {self.name!r} must return a string, "
                    f"got {type(key).__name__} ({key!r})"
                )
        base = f"{DEPENDENCY_PREFIX}{self.name}"
        return base if key is None else f"{base}:{key}"
