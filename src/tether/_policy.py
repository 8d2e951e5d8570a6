"""Retry policy for activities: exponential backoff with jitter and capped attempts."""

from __future__ import annotations

import functools
import math
import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ._errors import ConfigurationError


def seconds(value: float | timedelta | None, what: str) -> float | None:
    """Normalise a duration given as seconds or a timedelta; reject negatives and NaN."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        raise ConfigurationError(
            f"{what} must be a number of seconds or a timedelta (got {value!r})"
        )
    s = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not math.isfinite(s):
        raise ConfigurationError(f"{what} must be a finite duration (got {value!r})")
    if s < 0:
        raise ConfigurationError(f"{what} must not be negative (got {value!r})")
    return s


def env_number(name: str, default: float, *, least: float = 0.0, unit: str = "seconds") -> float:
    """A number from the environment variable ``name`` (``default`` when unset or empty):
    finite and at least ``least``. Anything else is a ``ConfigurationError`` naming the
    variable, not a ``ValueError`` from ``float()`` (nor a zero interval that would make
    a background loop spin)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < least:
        raise ConfigurationError(
            f"{name}={text!r}: must be a number of {unit}, at least {least:g} "
            f"(unset it for the default, {default:g})"
        )
    return value


@dataclass(frozen=True, kw_only=True)
class Retry:
    """How an activity is retried.

    ``attempts`` counts the first try: ``attempts=1`` means never retry. The delay
    before retry ``n`` is ``initial * backoff**(n-1)``, capped at ``max_interval``,
    then spread by +/- ``jitter`` (a fraction). Exceptions whose type is in
    ``non_retryable`` (or that subclass ``tether.NonRetryable``) fail at once.
    """

    attempts: int = 5
    initial: float | timedelta = 1.0
    backoff: float = 2.0
    max_interval: float | timedelta = 60.0
    #: give up once this long has passed since the step was scheduled (None: no limit)
    max_elapsed: float | timedelta | None = None
    jitter: float = 0.2
    non_retryable: tuple[type[BaseException], ...] = field(default=())

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise ConfigurationError(
                f"Retry.attempts must be a whole number (got {self.attempts!r})"
            )
        if self.attempts < 1:
            raise ConfigurationError(
                f"Retry.attempts must be at least 1 (got {self.attempts}); 1 means no retries"
            )
        init = seconds(self.initial, "Retry.initial")
        mx = seconds(self.max_interval, "Retry.max_interval")
        if (
            isinstance(self.backoff, bool)
            or not isinstance(self.backoff, int | float)
            or not math.isfinite(self.backoff)
        ):
            raise ConfigurationError(
                f"Retry.backoff must be a finite number (got {self.backoff!r})"
            )
        if self.backoff < 1:
            raise ConfigurationError(f"Retry.backoff must be >= 1 (got {self.backoff})")
        if init is not None and mx is not None and mx < init:
            raise ConfigurationError(
                f"Retry.max_interval ({mx}s) must not be below Retry.initial ({init}s)"
            )
        elapsed = seconds(self.max_elapsed, "Retry.max_elapsed")
        if elapsed is not None and elapsed <= 0:
            raise ConfigurationError(f"Retry.max_elapsed must be positive (got {elapsed})")
        if not isinstance(self.jitter, int | float) or not 0 <= self.jitter <= 1:
            raise ConfigurationError(f"Retry.jitter must be within 0..1 (got {self.jitter})")

    def delay(self, failed_attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after attempt number ``failed_attempt`` (1-based) failed."""
        init = seconds(self.initial, "initial") or 0.0
        mx = seconds(self.max_interval, "max_interval") or 0.0
        base = min(mx, init * self.backoff ** max(0, failed_attempt - 1))
        if self.jitter:
            r = (rng or random).uniform(-self.jitter, self.jitter)
            base = max(0.0, base * (1 + r))
        return base

    def to_json(self) -> dict[str, Any]:
        """The numeric part of the policy, as stored with each activity task."""
        return {
            "attempts": self.attempts,
            "initial": seconds(self.initial, "initial"),
            "backoff": self.backoff,
            "max_interval": seconds(self.max_interval, "max_interval"),
            "max_elapsed": seconds(self.max_elapsed, "max_elapsed"),
            "jitter": self.jitter,
        }

    @classmethod
    def from_json(
        cls, data: dict[str, Any], non_retryable: tuple[type[BaseException], ...] = ()
    ) -> Retry:
        """Rebuild a policy stored with a task (exception types come from the registry).

        Cached: every attempt of every step of an activity rebuilds the same policy.
        """
        return _retry_from_values(
            data.get("attempts", 5),
            data.get("initial", 1.0),
            data.get("backoff", 2.0),
            data.get("max_interval", 60.0),
            data.get("max_elapsed"),
            data.get("jitter", 0.2),
            non_retryable,
        )


@functools.lru_cache(maxsize=256)
def _retry_from_values(
    attempts: Any,
    initial: Any,
    backoff: Any,
    max_interval: Any,
    max_elapsed: Any,
    jitter: Any,
    non_retryable: tuple[type[BaseException], ...],
) -> Retry:
    return Retry(
        attempts=int(attempts),
        initial=float(initial),
        backoff=float(backoff),
        max_interval=float(max_interval),
        max_elapsed=max_elapsed,
        jitter=float(jitter),
        non_retryable=non_retryable,
    )


DEFAULT_RETRY = Retry()
