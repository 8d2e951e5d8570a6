"""Prometheus metrics of an App and its workers (``pip install 'tether[server]'``, or
``prometheus-client`` alone).

``tether serve`` answers ``GET /metrics``; ``tether worker --metrics-port N`` serves
them on its own port. Figures come from the store and from the workers of this
process, read in the background on the App's event loop (every ``refresh`` seconds;
runs by status every ``slow_refresh``, since that one counts the runs table), so a
scrape never waits on the store:

- backlog per queue: ready tasks, age of the oldest ready task, running and scheduled;
- reliability: open dead letters, webhook deliveries pending or given up, open reviews,
  kill switches that are off;
- flow health: runs by workflow and status;
- this process's workers: task counters (activities, workflow tasks, replays, cache
  hits, held by a switch...), tasks in flight and slots;
- what this process did (``tether._telemetry``; ``to_opentelemetry()`` also sends it to
  the OpenTelemetry metrics API): runs started and ended, dead letters,
  retries and final failures by activity and error type, timeouts, breaker rejections,
  non-determinism errors, lost leases, orphans taken back; histograms of attempt
  durations, queue waits, run durations and durable waits (timers, signals, approvals).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ._app import App
from ._periodic import Periodic
from ._policy import env_number
from ._telemetry import DURATION_BUCKETS, RECORDER, SPECS
from ._worker import Worker

log = logging.getLogger("tether.metrics")


class Metrics:
    """The figures of ``app`` (and ``workers``), refreshed in the background."""

    def __init__(
        self,
        app: App,
        workers: Sequence[Worker] = (),
        *,
        refresh: float | None = None,
        slow_refresh: float | None = None,
    ) -> None:
        self.app = app
        self.workers = workers
        #: seconds between reads (``TETHER_METRICS_REFRESH``, default 5); runs by status
        #: every 12 times that
        self.refresh = refresh or env_number("TETHER_METRICS_REFRESH", 5.0, least=0.1)
        self.slow_refresh = slow_refresh or 12 * self.refresh
        self._fast: dict[str, Any] = {}
        self._runs: list[tuple[str, str, int]] = []
        self._runs_at = 0.0
        self._periodic = Periodic(
            "tether-metrics", self.update, lambda: self.refresh, log, "reading metrics"
        )

    def start(self) -> None:
        """Refresh in the background on the running loop."""
        self._periodic.start()

    async def stop(self) -> None:
        """Stop refreshing."""
        await self._periodic.stop()

    async def update(self) -> None:
        """Read the store's figures now (runs by status at most every ``slow_refresh``)."""
        store = self.app.store
        counts = await store.open_counts()
        fast: dict[str, Any] = {
            "queues": await self.app.queue_stats(),
            "dead_letters": counts["dead_letters"],
            "approvals": counts["approvals"],
            "switches": await self.app.switches(),
            "webhooks": {
                "pending": counts["webhooks_pending"],
                "failed": counts["webhooks_failed"],
            },
        }
        self._fast = fast
        if time.monotonic() - self._runs_at >= self.slow_refresh or not self._runs_at:
            self._runs = await store.run_counts()
            self._runs_at = time.monotonic()

    def collect(self) -> Iterator[Any]:
        """prometheus_client's collector protocol: the latest figures."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        fast = self._fast
        ready = GaugeMetricFamily(
            "tether_queue_ready_tasks", "Tasks due and not leased", labels=["queue"]
        )
        oldest = GaugeMetricFamily(
            "tether_queue_oldest_ready_seconds", "Age of the oldest ready task", labels=["queue"]
        )
        running = GaugeMetricFamily(
            "tether_queue_running_tasks", "Tasks leased to a worker", labels=["queue"]
        )
        scheduled = GaugeMetricFamily(
            "tether_queue_scheduled_tasks",
            "Tasks due later (timers, retry backoffs)",
            labels=["queue"],
        )
        for q in fast.get("queues", ()):
            ready.add_metric([q.queue], q.ready)
            oldest.add_metric([q.queue], q.oldest_ready_age or 0.0)
            running.add_metric([q.queue], q.running)
            scheduled.add_metric([q.queue], q.scheduled)
        yield from (ready, oldest, running, scheduled)
        if fast:
            yield GaugeMetricFamily(
                "tether_dead_letters_open",
                "Steps and runs waiting for an operator",
                value=fast["dead_letters"],
            )
            yield GaugeMetricFamily(
                "tether_approvals_open", "Reviews waiting for a decision", value=fast["approvals"]
            )
            hooks = GaugeMetricFamily(
                "tether_webhook_deliveries", "Webhook deliveries not delivered", labels=["state"]
            )
            for state, n in fast["webhooks"].items():
                hooks.add_metric([state], n)
            yield hooks
            off = GaugeMetricFamily(
                "tether_switches_off", "Kill switches that are off", labels=["kind"]
            )
            kinds: dict[str, int] = {}
            for s in fast["switches"]:
                kinds[s["kind"]] = kinds.get(s["kind"], 0) + 1
            for kind, n in sorted(kinds.items()):
                off.add_metric([kind], n)
            yield off
        runs = GaugeMetricFamily(
            "tether_runs", "Runs by workflow and status", labels=["workflow", "status"]
        )
        for workflow, status, n in self._runs:
            runs.add_metric([workflow, status], n)
        yield runs
        events = CounterMetricFamily(
            "tether_worker_events", "What this process's workers did", labels=["worker", "event"]
        )
        inflight = GaugeMetricFamily(
            "tether_worker_inflight_tasks", "Tasks running now", labels=["worker"]
        )
        slots = GaugeMetricFamily(
            "tether_worker_slots", "Tasks a worker runs at once", labels=["worker"]
        )
        for w in self.workers:
            for name, n in sorted(w.stats.items()):
                events.add_metric([w.id, name], n)
            inflight.add_metric([w.id], len(w._inflight))
            slots.add_metric([w.id], w.concurrency)
        yield from (events, inflight, slots)
        yield from _recorded()

    def exposition(self) -> bytes:
        """The figures in Prometheus's text format."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry()
        registry.register(self)
        return bytes(generate_latest(registry))


def _recorded() -> Iterator[Any]:
    """The engine's counters and histograms of this process (``tether._telemetry``)."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    families: dict[str, Any] = {}
    for name, spec in SPECS.items():
        if spec.kind == "counter":
            families[name] = CounterMetricFamily(name, spec.help, labels=list(spec.labels))
        else:
            families[name] = HistogramMetricFamily(
                f"{name}_seconds", spec.help, labels=list(spec.labels)
            )
    for name, labels, value in RECORDER.counters():
        families[name].add_metric(list(labels), value)
    bounds = [str(b) for b in DURATION_BUCKETS] + ["+Inf"]
    for name, labels, counts, total, _n in RECORDER.histograms():
        cumulative, running = [], 0
        for bound, c in zip(bounds, counts, strict=True):
            running += c
            cumulative.append((bound, running))
        families[name].add_metric(list(labels), cumulative, total)
    yield from families.values()


def to_opentelemetry(meter_provider: Any = None) -> None:
    """Also record the engine's counters and histograms as OpenTelemetry metrics
    (instruments of meter ``tether``, same names and labels as attributes), from now on,
    for the meter provider you configured (``opentelemetry-sdk`` and an exporter).

    Calling it again with the same provider changes nothing (nothing is counted twice);
    with another provider, the figures go to that one instead."""
    from opentelemetry import metrics as otel_metrics

    provider = meter_provider or otel_metrics.get_meter_provider()
    for old in list(RECORDER.sinks):
        if isinstance(old, _OtelSink):
            if old.provider is provider:
                return
            RECORDER.sinks.remove(old)
    meter = provider.get_meter("tether")
    instruments: dict[str, Any] = {}
    for name, spec in SPECS.items():
        if spec.kind == "counter":
            instruments[name] = meter.create_counter(name, description=spec.help)
        else:
            instruments[name] = meter.create_histogram(
                f"{name}_seconds",
                unit="s",
                description=spec.help,
                explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS),
            )

    RECORDER.sinks.append(_OtelSink(provider, instruments))


class _OtelSink:
    """Sends each observation to its OpenTelemetry instrument (one per provider)."""

    def __init__(self, provider: Any, instruments: dict[str, Any]) -> None:
        self.provider = provider
        self.instruments = instruments

    def __call__(self, name: str, labels: tuple[str, ...], value: float, histogram: bool) -> None:
        instrument = self.instruments.get(name)
        if instrument is None:
            return
        attributes = dict(zip(SPECS[name].labels, labels, strict=False))
        if histogram:
            instrument.record(value, attributes)
        else:
            instrument.add(value, attributes)
