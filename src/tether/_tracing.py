"""OpenTelemetry traces of runs, when ``opentelemetry-api`` is installed (``tether[otel]``).

A run belongs to the trace that was current when it was started (an HTTP request into
``tether serve``, the caller's own span), or to a short ``tether.run`` span made then:
``app.start`` keeps that context's W3C ``traceparent`` in the run's attrs, the
workflow side copies it into every activity it schedules (so a worker needs no extra
read), and each activity attempt becomes a span, a child of the run's context, with
the run id, step, attempt, queue, outcome and error type (never the message, which may
hold data). So a run resumed hours later on another worker continues the same trace.
Replays make no spans: only attempts that run do. With the API alone (no SDK
configured) every call here is a no-op; without it, this module does nothing at all.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from typing import Any

from ._policy import env_number

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
except ImportError:  # pragma: no cover - the extra is not installed
    trace = None  # type: ignore[assignment]

#: the instrumentation scope of tether's spans
SCOPE = "tether"


_TRACER: Any = None
#: attempts that take less than this (ns) and succeed get no span of their own
#: (``TETHER_TRACE_MIN_ATTEMPT_MS``); 0: every attempt gets one
_MIN_ATTEMPT_NS = int(env_number("TETHER_TRACE_MIN_ATTEMPT_MS", 0.0, unit="milliseconds") * 1e6)
#: the attempt running in this context when its span is decided at its end
_pending: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "tether_attempt_span", default=None
)


def set_min_attempt_ms(ms: float) -> None:
    """Give spans only to attempts that run at least ``ms`` or fail (0: to every one).

    The Python SDK costs tens of microseconds per span, a large share of a short step:
    with a threshold every run stays traced (its start, waits, workflow tasks and life,
    and every slow or failed attempt) while the many fast steps cost almost nothing.
    An attempt without a span of its own runs with the run's stored context current,
    so spans its own code makes nest under the run's context instead."""
    global _MIN_ATTEMPT_NS
    if ms < 0:
        raise ValueError(f"min_attempt_ms must be >= 0 (got {ms!r})")
    _MIN_ATTEMPT_NS = int(ms * 1e6)


#: parsed W3C contexts by traceparent: a run's attempts all parse the same one
_PARSED: dict[str, Any] = {}
_PARSED_MAX = 4096


def _tracer() -> Any:
    """tether's tracer, made once (``get_tracer`` costs tens of microseconds a call);
    one made before the SDK was configured forwards to it once it is."""
    global _TRACER
    if _TRACER is None:
        _TRACER = trace.get_tracer(SCOPE)
    return _TRACER


def _extract(carrier: dict[str, str]) -> Any:
    """The context in ``carrier``, parsed once per distinct traceparent."""
    key = carrier.get("traceparent")
    if key is None or carrier.get("tracestate") or len(carrier) > 1:
        return propagate.extract(carrier)
    ctx = _PARSED.get(key)
    if ctx is None:
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        ctx = _PARSED[key] = propagate.extract(carrier)
    return ctx


def available() -> bool:
    """Whether opentelemetry-api is installed."""
    return trace is not None


def start_carrier(workflow: str, run_id: str) -> dict[str, str] | None:
    """The W3C context a new run joins: the current span's, else a ``tether.run`` span's
    made now. None when nothing records traces (no SDK, or sampled out)."""
    if trace is None:
        return None
    current = trace.get_current_span().get_span_context()
    carrier: dict[str, str] = {}
    if current.is_valid:
        if current.trace_flags.sampled:  # an unsampled trace is not followed into runs
            propagate.inject(carrier)
    elif isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return None  # no SDK configured in this process: no span to make (and no cost)
    else:
        tracer = _tracer()
        with tracer.start_as_current_span(
            f"tether.run {workflow}",
            kind=trace.SpanKind.PRODUCER,
            attributes={"tether.run_id": run_id, "tether.workflow": workflow},
        ) as span:
            if span.get_span_context().trace_flags.sampled:
                propagate.inject(carrier)
    return carrier or None


@contextlib.contextmanager
def activity_span(
    name: str,
    run_id: str,
    step: int | None,
    attempt: int,
    queue: str,
    carrier: Any,
    tenant: str | None = None,
    began: int | None = None,
) -> Iterator[Any]:
    """A span for one activity attempt, a child of the run's stored context, current
    while the attempt runs (so the activity's own instrumentation nests under it).
    ``began`` (epoch ns) is when the attempt began, if before now (a batch's items).

    Exceptions are not recorded on it: their messages may hold data (``mark_failed``
    sets the type)."""
    if trace is None or not isinstance(carrier, dict):
        yield None
        return
    about = (run_id, step, attempt, queue, tenant)
    if _MIN_ATTEMPT_NS:
        yield from _decided_at_end(f"tether.activity {name}", carrier, about, began)
        return
    span = _tracer().start_span(
        f"tether.activity {name}",
        context=_extract(carrier),
        kind=trace.SpanKind.CONSUMER,
        attributes=_attempt_attributes(*about),
        start_time=began,
    )
    # how it ended is noted in ``pending`` (``mark_ok``/``mark_failed``) and set on the
    # span as it ends: no lookup of the current span per attempt
    pending: dict[str, Any] = {}
    marks = _pending.set(pending)
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield span
    finally:
        otel_context.detach(token)
        _pending.reset(marks)
        _mark(span, pending)
        span.end()


def _mark(span: Any, pending: dict[str, Any]) -> None:
    """Set an attempt's outcome (and error type) on its span."""
    failed = pending.get("error_type")
    if failed is not None:
        span.set_attributes(
            {"tether.outcome": "retry" if pending["retrying"] else "failed", "error.type": failed}
        )
        span.set_status(trace.Status(trace.StatusCode.ERROR, failed))
    elif pending.get("ok"):
        span.set_attribute("tether.outcome", "ok")
    if pending.get("lease_lost"):  # its result (or failure) was refused: not recorded
        span.set_attribute("tether.outcome", "lease_lost")


def _attempt_attributes(
    run_id: str, step: int | None, attempt: int, queue: str, tenant: str | None
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "tether.run_id": run_id,
        "tether.step": step if step is not None else -1,
        "tether.attempt": attempt,
        "tether.queue": queue,
    }
    if tenant is not None:
        attributes["tether.tenant"] = tenant
    return attributes


def _decided_at_end(
    name: str, carrier: Any, about: tuple[Any, ...], began: int | None = None
) -> Iterator[None]:
    """An attempt whose span is made at its end, if it was slow or failed (its
    attributes are built only then). While it runs, the run's stored context is current,
    so spans its code makes (in this task or a thread it starts) join the run's trace."""
    assert trace is not None
    pending: dict[str, Any] = {}
    token = _pending.set(pending)
    context = _extract(carrier)
    attached = otel_context.attach(context)
    if began is None:
        began = time.time_ns()
    try:
        yield None
    finally:
        otel_context.detach(attached)
        _pending.reset(token)
        ended = time.time_ns()
        failed = pending.get("error_type")
        # the attempt's own run time decides (until it returned), not the wait for the
        # commit that records it, which group commit makes longer under load
        ran = pending.get("returned_at", ended) - began
        if failed is not None or ran >= _MIN_ATTEMPT_NS or pending.get("lease_lost"):
            span = _tracer().start_span(
                name,
                context=context,
                kind=trace.SpanKind.CONSUMER,
                attributes=_attempt_attributes(*about),
                start_time=began,
            )
            _mark(span, pending)
            span.end(end_time=ended)


def mark_failed(error_type: str, retrying: bool) -> None:
    """For the current attempt's span: how it failed (the type only). Nothing when the
    attempt has no span (its run is not traced)."""
    pending = _pending.get()
    if pending is not None:
        pending.update(error_type=error_type, retrying=retrying)


def mark_ok() -> None:
    """For the current attempt's span: it succeeded."""
    pending = _pending.get()
    if pending is not None:
        pending.update(ok=True, returned_at=time.time_ns())


def mark_lease_lost() -> None:
    """For the current attempt's span: its lease had passed to another worker, so what
    it reported was refused (another attempt's result counts)."""
    pending = _pending.get()
    if pending is not None:
        pending["lease_lost"] = True


@contextlib.contextmanager
def joined(headers: Any) -> Iterator[None]:
    """Make the W3C context in ``headers`` (an HTTP request's) current for a while."""
    if trace is None:
        yield
        return
    token = otel_context.attach(propagate.extract(headers))
    try:
        yield
    finally:
        otel_context.detach(token)


def _closed_span(
    name: str,
    carrier: Any,
    began: float,
    ended: float,
    attributes: dict[str, Any],
    error: str | None = None,
) -> None:
    """Record a finished span from ``began`` to ``ended`` (epoch seconds) under the run's
    trace ``carrier``, marked as an error when ``error`` names one. Nothing without the
    OpenTelemetry API or a carrier."""
    if trace is None or not isinstance(carrier, dict):
        return
    span = _tracer().start_span(
        name,
        context=_extract(carrier),
        kind=trace.SpanKind.INTERNAL,
        attributes=attributes,
        start_time=int(began * 1e9),
    )
    if error is not None:
        span.set_attribute("error.type", error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end(end_time=int(max(began, ended) * 1e9))


def wait_spans(
    workflow: str, run_id: str, carrier: Any, waits: list[tuple[str, str, float, float]]
) -> None:
    """A span per durable wait that ended (timer, signal, approval), from its recorded
    start to the event that ended it. Made once, after the commit that consumed the
    event; a replay of the same events makes none."""
    for kind, name, began, ended in waits:
        attributes = {
            "tether.run_id": run_id,
            "tether.workflow": workflow,
            "tether.wait.kind": kind,
            "tether.wait.name": name,
        }
        _closed_span(f"tether.wait {kind}", carrier, began, ended, attributes)


def workflow_task_span(
    workflow: str,
    run_id: str,
    carrier: Any,
    began: float,
    ended: float,
    attributes: dict[str, Any],
    error_type: str | None = None,
) -> None:
    """A span for one executed workflow task (its replay, code and commit)."""
    _closed_span(
        f"tether.workflow_task {workflow}",
        carrier,
        began,
        ended,
        {"tether.run_id": run_id, "tether.workflow": workflow, **attributes},
        error_type,
    )


def run_span(
    workflow: str, run_id: str, carrier: Any, began: float, ended: float, status: str
) -> None:
    """At a run's end, a span over its whole life (start to end), in its trace."""
    _closed_span(
        f"tether.lifetime {workflow}",
        carrier,
        began,
        ended,
        {"tether.run_id": run_id, "tether.workflow": workflow, "tether.outcome": status},
        status if status in ("failed", "timed_out", "needs_intervention") else None,
    )
