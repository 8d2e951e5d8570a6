"""The thresholds of the alert watcher (``tether.alerts``), given to ``App(alert_rules=)``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ._errors import ConfigurationError

#: the count rules: a number of events in the window, at least 1 (None: off)
_COUNTS = (
    "dead_letters",
    "retries",
    "rate_limited",
    "breaker_rejections",
    "validation_failures",
    "budget_stops",
    "orphans",
)


def _real(value: Any) -> bool:
    """A finite int or float (not a bool, which is an int to Python)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class AlertRules:
    """Thresholds; None turns a rule off. Counts are per ``window`` seconds."""

    #: a queue's oldest ready task has waited longer than this (seconds): work is stuck
    queue_age: float | None = 300.0
    #: open dead letters grew by at least this many
    dead_letters: int | None = 10
    #: activity attempts retried (any activity)
    retries: int | None = 100
    #: attempts answered 429 by their dependency
    rate_limited: int | None = 20
    #: attempts refused by an open circuit breaker
    breaker_rejections: int | None = 20
    #: model outputs that failed validation (repairs included)
    validation_failures: int | None = 10
    #: runs stopped by a token or cost budget
    budget_stops: int | None = 1
    #: tasks of a dead worker taken back (orphan recoveries)
    orphans: int | None = 1
    #: workflow name -> expected duration (seconds): running runs older than that
    overdue: dict[str, float] = field(default_factory=dict)
    #: a run that ended ``needs_intervention`` this many seconds ago and whose operator
    #: was never told (its worker's hook raised, or the worker died or closed first):
    #: told now. Its worker tells it at once; this leaves that call time to finish.
    needs_intervention: float | None = 60.0
    #: the window of the count rules (seconds)
    window: float = 300.0

    def __post_init__(self) -> None:
        if not _real(self.window) or self.window <= 0:
            raise ConfigurationError(
                f"AlertRules.window must be a finite number of seconds > 0 (got {self.window!r})"
            )
        for name in ("queue_age", "needs_intervention"):
            value = getattr(self, name)
            if value is not None and (not _real(value) or value < 0):
                raise ConfigurationError(
                    f"AlertRules.{name} must be None (off) or a finite number of "
                    f"seconds >= 0 (got {value!r})"
                )
        for name in _COUNTS:
            value = getattr(self, name)
            if value is not None and (not _real(value) or value < 1):
                raise ConfigurationError(
                    f"AlertRules.{name} must be None (off) or a count >= 1 (got {value!r})"
                )
        if not isinstance(self.overdue, dict):
            raise ConfigurationError(
                "AlertRules.overdue must be a dict of workflow name -> expected seconds "
                f"(got {type(self.overdue).__name__})"
            )
        for workflow, expected in self.overdue.items():
            if not isinstance(workflow, str) or not workflow:
                raise ConfigurationError(f"AlertRules.overdue: {workflow!r} is not a workflow name")
            if not _real(expected) or expected < 0:
                raise ConfigurationError(
                    f"AlertRules.overdue[{workflow!r}] must be a finite number of "
                    f"seconds >= 0 (got {expected!r})"
                )
