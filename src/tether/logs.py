"""Structured logs: one JSON object per line, with the run and step a line belongs to.

``tether worker --log-format json`` and ``tether serve --log-format json`` use it; in
your own process, ``tether.logs.configure()``. A record logged inside an activity
carries ``run_id``, ``step``, ``activity`` and ``attempt``; inside workflow code
(``tether.logger``, which drops lines while replaying) ``run_id``, ``workflow``,
``step`` and ``tenant``; with OpenTelemetry, ``trace_id`` and ``span_id``; anything
passed in ``extra=`` is kept. Exceptions go out as their type and traceback text in
``error``. ``ContextFilter`` adds the same fields to records for any other formatter.

The engine never logs payloads (inputs, outputs, prompts, error messages, which may
quote them): where a line would carry such text it goes through ``redact``, which
replaces it unless a hook set with ``set_redactor`` returns what may be shown.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from datetime import UTC, datetime
from typing import Any

from ._activity_context import NotInActivityError, activity_context
from ._redact import redact, set_redactor
from .workflow._instance import current_instance

try:
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - the otel extra is not installed
    _trace = None  # type: ignore[assignment]

#: attributes every LogRecord has: what is left over came from ``extra=``
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON with tether's context."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(context())
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info and record.exc_info[0] is not None:
            out["error"] = {
                "type": record.exc_info[0].__name__,
                "traceback": "".join(traceback.format_exception(*record.exc_info))[-4000:],
            }
        return json.dumps(out, default=str, ensure_ascii=False)


def context() -> dict[str, Any]:
    """The run and step the calling code works for, if any (and the current trace)."""
    out: dict[str, Any]
    try:
        ctx = activity_context()
    except NotInActivityError:
        inst = current_instance()
        if inst is None:
            out = {}
        else:
            out = {"run_id": inst.run_id, "workflow": inst.workflow.name, "step": inst.step}
            tenant = inst.started.data.get("tenant") if inst.started is not None else None
            if tenant is not None:
                out["tenant"] = tenant
    else:
        out = {
            "run_id": ctx.run_id,
            "step": ctx.step,
            "activity": ctx.name,
            "attempt": ctx.attempt,
        }
        tenant = ((ctx.task.options or {}) if ctx.task is not None else {}).get("tenant")
        if tenant is not None:
            out["tenant"] = tenant
    if _trace is not None:
        span = _trace.get_current_span().get_span_context()
        if span.is_valid:
            out["trace_id"] = format(span.trace_id, "032x")
            out["span_id"] = format(span.span_id, "016x")
    return out


#: the fields ``context()`` may give: ``ContextFilter`` sets each one on every record
_FIELDS = (
    "run_id",
    "workflow",
    "step",
    "activity",
    "attempt",
    "tenant",
    "trace_id",
    "span_id",
)


class ContextFilter(logging.Filter):
    """Adds ``context()`` to every record as attributes (``%(run_id)s``...), so plain
    formatters can show them; a field the record's context lacks (every one outside a
    run, ``activity`` in workflow code...) is None unless ``extra=`` gave it."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = context()
        for key in _FIELDS:
            if key in ctx:
                setattr(record, key, ctx[key])
            elif not hasattr(record, key):
                setattr(record, key, None)
        return True


def configure(level: int | str = logging.INFO, stream: Any = None) -> None:
    """Send the root logger's records to ``stream`` (stderr) as JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


__all__ = ["ContextFilter", "JsonFormatter", "configure", "context", "redact", "set_redactor"]
