"""What observability costs: W1 (runs of sequential no-op steps on SQLite) in four modes,
each in its own process (an OpenTelemetry SDK is set once per process), interleaved and
repeated, against the raw commit rate (LIMIT) of the same machine in the same run:

* ``bare``: no counters, no tracing (the engine's recorder replaced by no-ops, as if
  ``opentelemetry-api`` were not installed): the baseline;
* ``metrics``: tether's counters and histograms (always on in a real deployment);
* ``api``: counters plus ``opentelemetry-api`` with no SDK configured;
* ``sdk``: counters plus the SDK with an in-memory exporter, every run traced (a span
  per attempt, workflow task and run end), and ``/metrics`` rendered every second (the
  store's figures read every 5 s, the default ``TETHER_METRICS_REFRESH``);
* ``sdk10``: the same with one trace in ten sampled (``ParentBased(TraceIdRatioBased(0.1))``,
  the usual production setting): unsampled runs carry no context and cost nothing;
* ``scrape``: counters and ``/metrics`` rendered every second, no tracing (what the
  scrape alone costs);
* ``sdk-trace``: every run traced, no scrape (what tracing alone costs);
* ``sdk-slow``: every run traced, but only attempts of 5 ms or more (or failed) get a
  span of their own (``TETHER_TRACE_MIN_ATTEMPT_MS=5``), no scrape.

Targets (issue #19): ``sdk`` within 15% of ``bare``'s steps/s, ``api`` within 3%. The
``sdk-trace`` children also time the SDK's own cost per span, and the summary prints the
best ratio any engine could reach with that SDK and that many spans per step.

    .venv/bin/python bench/observability.py [--quick] [--repeat N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODES = ("bare", "metrics", "api", "scrape", "sdk", "sdk-trace", "sdk-slow", "sdk10")
#: the modes that render /metrics every second (the store's figures read each time)
SCRAPED = ("scrape", "sdk", "sdk10")


def _mode_setup(mode: str) -> Any:
    """Configure this (child) process for ``mode``; return what to keep alive."""
    import tether._app
    import tether._tracing
    import tether._worker
    import tether.logs

    def nothing(*_: Any, **__: Any) -> None:
        return None

    if mode == "bare":
        for mod in (tether._worker, tether._app):
            for name in ("count", "observe"):
                if hasattr(mod, name):
                    setattr(mod, name, nothing)
    if mode in ("bare", "metrics", "scrape"):
        tether._tracing.trace = None  # type: ignore[assignment]  # as if not installed
        tether.logs._trace = None  # type: ignore[assignment]
        import tether._app as app_module

        app_module.tracing_available = lambda: False  # type: ignore[attr-defined]
    if mode.startswith("sdk"):
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        exporter = InMemorySpanExporter()
        sampler = ParentBased(TraceIdRatioBased(0.1)) if mode == "sdk10" else None
        provider = TracerProvider(sampler=sampler) if sampler else TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        if mode == "sdk-slow":
            tether._tracing.set_min_attempt_ms(5)
        return exporter
    return None


async def _w1(db: Path, runs_n: int, steps_n: int, mode: str, exporter: Any) -> dict[str, Any]:
    from tether.metrics import Metrics

    sys.path.insert(0, str(HERE))
    import run as bench_run  # W1's own app and workflow

    app, sequential = bench_run._make_app(db)

    scrapes = 0
    try:
        async with app.worker(**bench_run.WORKER_OPTIONS) as worker:
            metrics = Metrics(app, [worker]) if mode in SCRAPED else None

            async def scrape() -> None:
                nonlocal scrapes
                while True:
                    await asyncio.sleep(1.0)
                    assert metrics is not None
                    if scrapes % 5 == 0:  # the store's figures: every refresh (5 s default)
                        await metrics.update()
                    metrics.exposition()  # a scraper asking every second
                    scrapes += 1

            scraper = asyncio.create_task(scrape()) if metrics is not None else None
            t0 = time.perf_counter()
            cpu0 = time.process_time()
            runs = await asyncio.gather(
                *(app.start(sequential, steps_n, i, run_id=f"w1-{i}") for i in range(runs_n))
            )
            results = await asyncio.gather(*(r.result(timeout=600) for r in runs))
            wall = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            if scraper is not None:
                scraper.cancel()
    finally:
        await app.close()
    expected = [bench_run._expected(steps_n, i) for i in range(runs_n)]
    if results != expected:
        raise RuntimeError(f"{mode}: wrong results")
    spans = len(exporter.get_finished_spans()) if exporter is not None else 0
    if mode in ("sdk", "sdk-trace") and spans < runs_n * steps_n:
        raise RuntimeError(f"sdk: only {spans} spans for {runs_n * steps_n} attempts")
    steps = runs_n * steps_n
    return {
        "mode": mode,
        "steps_per_s": steps / wall,
        "cpu_us_per_step": 1e6 * cpu / steps,
        "spans": spans,
        "scrapes": scrapes,
    }


def _span_cost(exporter: Any, n: int = 5000) -> float:
    """Microseconds of CPU the configured SDK takes to make and end one span with an
    attempt's attributes (what tether hands it), measured in this process."""
    from opentelemetry import trace

    tracer = trace.get_tracer("bench")
    parent = trace.set_span_in_context(tracer.start_span("parent"))
    attributes = {"tether.run_id": "w1-1", "tether.step": 3, "tether.attempt": 1}
    attributes["tether.queue"] = "default"
    cpu0 = time.process_time()
    for _ in range(n):
        tracer.start_span("tether.activity noop", context=parent, attributes=attributes).end()
    cost = 1e6 * (time.process_time() - cpu0) / n
    exporter.clear()
    return cost


def _child(mode: str, runs_n: int, steps_n: int) -> None:
    exporter = _mode_setup(mode)
    span_us = _span_cost(exporter) if mode == "sdk-trace" else None
    with tempfile.TemporaryDirectory() as d:
        out = asyncio.run(_w1(Path(d) / "w1.db", runs_n, steps_n, mode, exporter))
    if span_us is not None:
        out["span_us"] = span_us
    print(json.dumps(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="50 runs instead of 500")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the four modes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--modes", help="comma-separated modes (default: all)")
    args = parser.parse_args()
    runs_n, steps_n = (50 if args.quick else 500), 10
    if args.child:
        _child(args.child, runs_n, steps_n)
        return 0
    sys.path.insert(0, str(HERE))
    import rounds

    limit = rounds.raw_limit(0.3 if args.quick else 2.0)
    print(f"LIMIT (raw SQLite INSERT+COMMIT): {limit:,.0f} commits/s")
    modes = tuple(args.modes.split(",")) if args.modes else MODES
    got = rounds.interleave(__file__, modes, args.repeat, args.quick)
    if got is None:
        return 1
    print(f"\nW1 {runs_n} runs x {steps_n} steps, medians of {args.repeat}:")
    rounds.medians(got, "bare" if "bare" in got else modes[0], limit)
    if "sdk-trace" in got and "bare" in got:
        # the floor the SDK itself sets: its CPU per span times the spans per step, on
        # top of bare's CPU per step, if tether spent nothing else on tracing
        import statistics

        span_us = statistics.median(x["span_us"] for x in got["sdk-trace"])
        per_step = statistics.median(x["spans"] for x in got["sdk-trace"]) / (runs_n * steps_n)
        bare_cpu = statistics.median(x["cpu_us_per_step"] for x in got["bare"])
        floor = bare_cpu / (bare_cpu + per_step * span_us)
        print(
            f"SDK span: {span_us:.1f} us CPU each, {per_step:.2f} spans per step (sdk-trace); "
            f"bare {bare_cpu:.0f} us CPU/step -> at best {floor:.2f} of bare with every "
            "attempt a span"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
