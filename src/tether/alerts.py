"""Alerts as hooks: conditions an operator must hear about, sent to ``App(on_alert=...)``.

``tether serve`` watches them (rules from ``App(alert_rules=AlertRules(...))``, else the
defaults below; without a hook they are logged); elsewhere start an ``AlertWatcher``
yourself, in one process per store. Every ``interval`` seconds it reads the store (queue
age, dead letters, runs over their expected duration, runs in ``needs_intervention``
nobody was told about) and this process's counters (retries, 429s, breaker refusals,
invalid model outputs, budget stops, orphaned tasks taken back: ``tether._telemetry``)
over the last ``window``. A condition calls the hook once when it starts to hold
(``on_alert(subject, details)``, ``details["alert"]`` naming it) and again only after it
has cleared; a hook that raised (sync or async: logged as "the on_alert hook failed") is
called again at the next check while the condition holds.

A run that needs an operator is told by its worker as it ends; being told is recorded
in the store (an ``alerted`` entry in the run's audit log), and the watcher tells the
runs without one (the hook raised, the worker died or closed first) at every check
until told, once they ended ``AlertRules.needs_intervention`` seconds ago (at once when
the hook failed in this process): once per run ending when the hook succeeds.

The counters cover only the process the watcher runs in: for fleet-wide spikes use the
Prometheus rules in docs/observability.md on the same counters.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from typing import TYPE_CHECKING, Any

from ._alert_rules import AlertRules
from ._errors import ConfigurationError, RunNotFoundError
from ._history import RunStatus
from ._periodic import Periodic
from ._telemetry import RECORDER

if TYPE_CHECKING:
    from ._app import App

log = logging.getLogger("tether.alerts")

__all__ = ["AlertRules", "AlertWatcher"]


#: count rules: (rule, counter name, labels filter: which label equals what, or None)
_COUNTED: tuple[tuple[str, str, tuple[int, str] | None], ...] = (
    ("retries", "tether_activity_retries", None),
    ("rate_limited", "tether_rate_limited", None),
    ("breaker_rejections", "tether_breaker_rejections", None),
    ("validation_failures", "tether_decisions", (1, "output_invalid")),
    ("budget_stops", "tether_decisions", (1, "budget_exceeded")),
    ("orphans", "tether_orphans_recovered", None),
)


class AlertWatcher:
    """Checks ``rules`` every ``interval`` seconds and tells ``app``'s alert hook."""

    def __init__(self, app: App, rules: AlertRules | None = None, *, interval: float = 30.0):
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not math.isfinite(interval)
            or interval <= 0
        ):
            raise ConfigurationError(
                f"AlertWatcher interval must be a finite number of seconds > 0 (got {interval!r})"
            )
        self.app = app
        self.rules = rules or getattr(app, "alert_rules", None) or AlertRules()
        self.interval = interval
        #: conditions told (True) or being told by the hook (its task), by key
        self._firing: dict[str, bool | asyncio.Future[Any]] = {}
        #: (monotonic time, counter totals, open dead letters) of earlier checks
        self._history: collections.deque[tuple[float, dict[str, float], int]] = collections.deque()
        self._periodic = Periodic(
            "tether-alerts", self.check, lambda: self.interval, log, "checking alert conditions"
        )

    def start(self) -> None:
        """Check in the background on the running loop."""
        self._periodic.start()

    async def stop(self) -> None:
        """Stop checking."""
        await self._periodic.stop()

    async def check(self, now: float | None = None) -> list[tuple[str, dict[str, Any]]]:
        """Evaluate every rule now; return (and send) the alerts that started to hold,
        and those still holding whose hook failed when they were sent."""
        loop_now = asyncio.get_running_loop().time() if now is None else now
        holding = await self._conditions(loop_now)
        fired: list[tuple[str, dict[str, Any]]] = []
        firing: dict[str, bool | asyncio.Future[Any]] = {}
        for key, (subject, details) in holding.items():
            told = self._firing.get(key, False)
            if isinstance(told, asyncio.Future) and told.done():
                told = not told.cancelled() and told.exception() is None
            if told is False:
                fired.append((subject, details))
                told = self.app._alert(subject, details)
            firing[key] = told
        self._firing = firing
        return fired

    async def _conditions(self, now: float) -> dict[str, tuple[str, dict[str, Any]]]:
        rules, app = self.rules, self.app
        out: dict[str, tuple[str, dict[str, Any]]] = {}

        def hold(key: str, subject: str, alert: str, value: float, limit: float, msg: str) -> None:
            details = {"alert": alert, "value": value, "threshold": limit, "message": msg}
            out[key] = (subject, details)

        if rules.needs_intervention is not None:
            # runs nobody was told about: their worker's hook raised, or the worker died
            # or closed before it returned (those it is telling now are left to it)
            clock = app.store.clock()
            for run_id, ended in await app.store.untold_interventions(clock):
                if run_id in app._telling:
                    continue
                if ended > clock - rules.needs_intervention and run_id not in app._untold:
                    continue  # its worker may be telling it now (in another process)
                try:
                    info = await app._peek(run_id, follow=False)
                except RunNotFoundError:  # purged meanwhile
                    continue
                if info.status is RunStatus.NEEDS_INTERVENTION:
                    out[f"needs_intervention:{run_id}"] = (
                        run_id,
                        {"alert": "needs_intervention", **(info.error or {})},
                    )
        if rules.queue_age is not None:
            for q in await app.queue_stats():
                age = q.oldest_ready_age or 0.0
                if age > rules.queue_age:
                    hold(
                        f"queue_age:{q.queue}",
                        f"queue:{q.queue}",
                        "queue_age",
                        age,
                        rules.queue_age,
                        f"the oldest ready task of queue {q.queue!r} has waited {age:.0f}s "
                        f"(threshold {rules.queue_age:.0f}s): are its workers up and unpaused?",
                    )
        clock = app.store.clock()
        for workflow, expected in rules.overdue.items():
            cutoff = (clock - expected, "")  # created before it (keyset: newest first)
            late = await app.list(
                status=RunStatus.RUNNING, workflow=workflow, before=cutoff, limit=100
            )
            if late:
                hold(
                    f"overdue:{workflow}",
                    f"workflow:{workflow}",
                    "run_overdue",
                    len(late),
                    expected,
                    f"{len(late)}{'+' if len(late) == 100 else ''} running run(s) of "
                    f"{workflow!r} started over {expected:.0f}s ago (oldest listed: "
                    f"{late[-1].run_id})",
                )
        totals: dict[str, float] = collections.defaultdict(float)
        for name, labels, value in RECORDER.counters():
            for rule, counter, match in _COUNTED:
                if name == counter and (match is None or labels[match[0]] == match[1]):
                    totals[rule] += value
        letters = (await app.store.open_counts())["dead_letters"]
        self._history.append((now, dict(totals), letters))
        while len(self._history) > 1 and self._history[1][0] <= now - rules.window:
            self._history.popleft()
        _, before, letters_before = self._history[0]
        if rules.dead_letters is not None and letters - letters_before >= rules.dead_letters:
            new = letters - letters_before
            hold(
                "dead_letters",
                "dead_letters",
                "dead_letter_growth",
                new,
                rules.dead_letters,
                f"{new} new dead letter(s) in {rules.window:.0f}s ({letters} open)",
            )
        for rule, _counter, _match in _COUNTED:
            limit = getattr(rules, rule)
            grew = totals.get(rule, 0.0) - before.get(rule, 0.0)
            if limit is not None and grew >= limit:
                hold(
                    rule,
                    "process",
                    rule,
                    grew,
                    limit,
                    f"{grew:.0f} {rule.replace('_', ' ')} in {rules.window:.0f}s in this process",
                )
        return out
