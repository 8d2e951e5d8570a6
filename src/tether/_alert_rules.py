"""The thresholds of the alert watcher (``tether.alerts``), given to ``App(alert_rules=)``."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    #: the window of the count rules (seconds)
    window: float = 300.0
