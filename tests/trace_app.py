"""A traced worker process: ``python tests/trace_app.py DB SPANS MARKER``.

It configures the OpenTelemetry SDK with an exporter that appends every finished span
to SPANS as a JSON line (flushed at once, so a SIGKILL loses only unfinished spans).
Step 2 of ``traced_three`` touches MARKER and, on its first attempt, sleeps long enough
to be killed in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import tether

DB, SPANS, MARKER = sys.argv[1:4] if len(sys.argv) >= 4 else ("t.db", "spans.jsonl", "marker")


class FileExporter(SpanExporter):
    """Appends spans as JSON lines: name, ids, parent, attributes."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(SPANS, "a") as f:
            for s in spans:
                ctx = s.get_span_context()
                assert ctx is not None
                f.write(
                    json.dumps(
                        {
                            "name": s.name,
                            "trace_id": format(ctx.trace_id, "032x"),
                            "span_id": format(ctx.span_id, "016x"),
                            "parent": format(s.parent.span_id, "016x") if s.parent else None,
                            "attributes": dict(s.attributes or {}),
                            "pid": os.getpid(),
                        }
                    )
                    + "\n"
                )
            f.flush()
            os.fsync(f.fileno())
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(FileExporter()))
trace.set_tracer_provider(provider)

app = tether.App(store=f"sqlite:///{DB}")


@app.activity
def first() -> int:
    return 1


@app.activity(retry=tether.Retry(attempts=3, initial=0.1))
def second(x: int) -> int:
    if not os.path.exists(MARKER):
        open(MARKER, "w").close()  # tells the test the first attempt is in flight
        time.sleep(60)  # killed here
    return x + 1


@app.activity
def third(x: int) -> int:
    return x * 10


@app.workflow
async def traced_three() -> int:
    return await third(await second(await first()))


if __name__ == "__main__":
    worker = app.worker(lease=1.0, poll_interval=0.05)
    asyncio.run(worker.run())
