"""The engine's own counters and latency histograms, kept in process memory.

Workers and stores note what happened here as it happens (an attempt's duration, a
retry and its error type, a run's end); ``tether.metrics`` exports them. Recording
costs a lock and a dict update, so it is always on, with or without an exporter.
Labels are bounded by code (workflow, activity, queue, status, error type): never a
run id or a message. Each process counts what it did; Prometheus sums processes.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

#: seconds; covers sub-millisecond steps to day-long waits
DURATION_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
    14400.0,
    86400.0,
    604800.0,
)


@dataclass(frozen=True, slots=True)
class Spec:
    """One metric: its kind (counter or histogram), help text and label names."""

    kind: str
    help: str
    labels: tuple[str, ...]


#: every figure the engine records, by Prometheus name (without ``_total``/``_seconds``
#: suffixes, which the exporter adds)
SPECS: dict[str, Spec] = {
    "tether_runs_started": Spec("counter", "Runs started from this process", ("workflow",)),
    "tether_runs_ended": Spec(
        "counter", "Runs ended by commits of this process", ("workflow", "status")
    ),
    "tether_run_duration": Spec(
        "histogram", "Start to end of runs ended by workflow code", ("workflow", "status")
    ),
    "tether_activity_duration": Spec(
        "histogram", "Duration of activity attempts", ("activity", "outcome")
    ),
    "tether_queue_wait": Spec(
        "histogram",
        "Time a due task waited for a worker: an activity's first attempt (kind activity), "
        "a run's first workflow task (kind workflow: the time it was pending)",
        ("queue", "kind"),
    ),
    "tether_wait_duration": Spec(
        "histogram", "Durable waits that ended: timers and signals (approvals)", ("kind", "name")
    ),
    "tether_activity_retries": Spec(
        "counter", "Activity attempts that failed and will be retried", ("activity", "error_type")
    ),
    "tether_activity_failures": Spec(
        "counter", "Activity steps that failed for good", ("activity", "error_type")
    ),
    "tether_activity_timeouts": Spec("counter", "Activity attempts that timed out", ("activity",)),
    "tether_breaker_opens": Spec(
        "counter", "Circuit breakers opened (by this process's outcomes)", ("breaker",)
    ),
    "tether_breaker_rejections": Spec(
        "counter", "Attempts refused by an open circuit breaker", ("activity",)
    ),
    "tether_runs_dead_lettered": Spec(
        "counter", "Runs that ended needing an operator (dead-lettered)", ("workflow", "status")
    ),
    "tether_compensations": Spec(
        "counter", "Saga compensations run, by outcome", ("workflow", "undo", "outcome")
    ),
    "tether_nondeterminism_errors": Spec(
        "counter", "Workflow tasks whose code diverged from history", ("workflow",)
    ),
    "tether_workflow_task_failures": Spec(
        "counter", "Workflow tasks that raised (bugs in workflow code)", ("workflow", "error_type")
    ),
    "tether_decisions": Spec(
        "counter",
        "Decisions recorded by workflow code, by kind: route, output_invalid (a repair or a "
        "failure), output_default, budget_exceeded, approval_requested, model_hedge...",
        ("workflow", "marker"),
    ),
    "tether_routes": Spec(
        "counter",
        "Routing decisions (tether.route) by route, chosen value and reason",
        ("workflow", "route", "chosen", "reason"),
    ),
    "tether_ai_calls": Spec(
        "counter",
        "Model calls answered, by source (model, cache or batch)",
        ("workflow", "model", "tenant", "source"),
    ),
    "tether_ai_tokens": Spec(
        "counter", "Model tokens used, by direction", ("workflow", "model", "tenant", "direction")
    ),
    "tether_ai_cost": Spec(
        "counter",
        "Model spend in the price table's currency (USD)",
        ("workflow", "model", "tenant"),
    ),
    "tether_rate_limited": Spec(
        "counter", "Attempts answered 429 (rate limited) by their dependency", ("activity",)
    ),
    "tether_lease_lost": Spec(
        "counter", "Results refused because the lease had passed to another worker", ()
    ),
    "tether_orphans_recovered": Spec(
        "counter", "Tasks of a dead predecessor taken back at worker start", ()
    ),
    "tether_runs_purged": Spec(
        "counter", "Ended runs purged by their workflow's retention", ("workflow",)
    ),
}


class _Histogram:
    __slots__ = ("count", "counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(DURATION_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0


#: also told of every observation: (name, labels, value, is a histogram)
Sink = Callable[[str, tuple[str, ...], float, bool], None]


class Recorder:
    """Counters and histograms by (name, label values); safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self._histograms: dict[tuple[str, tuple[str, ...]], _Histogram] = {}
        #: other places every observation goes (OpenTelemetry metrics, when bridged)
        self.sinks: list[Sink] = []

    def count(self, name: str, labels: tuple[str, ...] = (), n: float = 1.0) -> None:
        """Add ``n`` to counter ``name``."""
        key = (name, labels)
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + n
        for sink in self.sinks:
            sink(name, labels, n, False)

    def observe(self, name: str, labels: tuple[str, ...], seconds: float) -> None:
        """Record one observation of histogram ``name``."""
        key = (name, labels)
        i = bisect.bisect_left(DURATION_BUCKETS, seconds)
        with self._lock:
            h = self._histograms.get(key)
            if h is None:
                h = self._histograms[key] = _Histogram()
            h.counts[i] += 1
            h.sum += seconds
            h.count += 1
        for sink in self.sinks:
            sink(name, labels, seconds, True)

    def counter(self, name: str, labels: tuple[str, ...] = ()) -> float:
        """The value of one counter (0 if never counted)."""
        with self._lock:
            return self._counters.get((name, labels), 0.0)

    def counters(self) -> Iterator[tuple[str, tuple[str, ...], float]]:
        """Every counter, as (name, labels, value)."""
        with self._lock:
            items = list(self._counters.items())
        for (name, labels), value in items:
            yield name, labels, value

    def histograms(self) -> Iterator[tuple[str, tuple[str, ...], list[int], float, int]]:
        """Every histogram, as (name, labels, per-bucket counts (last: +Inf), sum, count)."""
        with self._lock:
            items = [(k, list(h.counts), h.sum, h.count) for k, h in self._histograms.items()]
        for (name, labels), counts, total, n in items:
            yield name, labels, counts, total, n

    def reset(self) -> None:
        """Forget everything (tests)."""
        with self._lock:
            self._counters.clear()
            self._histograms.clear()


#: the process's recorder
RECORDER = Recorder()
count = RECORDER.count
observe = RECORDER.observe
