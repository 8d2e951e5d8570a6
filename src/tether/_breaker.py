"""Circuit breakers shared by every worker through the store.

A breaker guards a dependency (by default the activity; name one to share it,
e.g. ``CircuitBreaker("openai")`` on every activity that calls that API). It
counts outcomes in a rolling window; when at least ``min_calls`` calls in the
window failed at a ratio of ``failure_ratio`` or more it *opens*: attempts fail
fast (never calling the dependency) and are rescheduled for when it may close.
After ``cooldown`` one trial call is let through (*half-open*): success closes
the breaker, failure opens it again. State lives in the store's ``breakers``
table, so fifty workers on five hosts see the same state.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ._classify import RetryAfter
from ._errors import ConfigurationError
from ._policy import seconds


@dataclass(frozen=True)
class CircuitBreaker:
    """Settings of one named breaker (the name is what workers share)."""

    name: str | None = None
    failure_ratio: float = 0.5
    min_calls: int = 5
    window: float | timedelta = 60.0
    cooldown: float | timedelta = 30.0

    def __post_init__(self) -> None:
        ratio = self.failure_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
            raise ConfigurationError(
                f"CircuitBreaker.failure_ratio must be within (0, 1] (got {self.failure_ratio})"
            )
        if isinstance(self.min_calls, bool) or not isinstance(self.min_calls, int):
            raise ConfigurationError("CircuitBreaker.min_calls must be a whole number")
        if self.min_calls < 1:
            raise ConfigurationError("CircuitBreaker.min_calls must be at least 1")
        if not seconds(self.window, "CircuitBreaker.window"):
            raise ConfigurationError("CircuitBreaker.window must be positive")
        if not seconds(self.cooldown, "CircuitBreaker.cooldown"):
            raise ConfigurationError("CircuitBreaker.cooldown must be positive")

    def to_json(self, default_name: str) -> dict[str, Any]:
        """The settings as stored with an activity task."""
        return {
            "name": self.name or default_name,
            "failure_ratio": self.failure_ratio,
            "min_calls": self.min_calls,
            "window": seconds(self.window, "window"),
            "cooldown": seconds(self.cooldown, "cooldown"),
        }


class CircuitOpenError(RetryAfter):
    """The dependency's breaker is open: the attempt failed fast without calling it."""

    def __init__(self, name: str, retry_in: float) -> None:
        self.breaker = name
        super().__init__(
            retry_in, f"circuit breaker {name!r} is open; next trial in {retry_in:.1f}s"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.breaker, self.retry_after))
