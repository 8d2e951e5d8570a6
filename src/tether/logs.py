"""Structured logs: one JSON object per line, with the run and step a line belongs to.

``tether worker --log-format json`` and ``tether serve --log-format json`` use it; in
your own process, ``tether.logs.configure()``. A record logged inside an activity
carries ``run_id``, ``step``, ``activity`` and ``attempt``; inside workflow code
(``tether.logger``, which drops lines while replaying) ``run_id``, ``workflow`` and
``step``; anything passed in ``extra=`` is kept. Exceptions go out as their type and
traceback text in ``error``.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from datetime import UTC, datetime
from typing import Any

from ._activity_context import NotInActivityError, activity_context
from .workflow._instance import current_instance

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
    """The run and step the calling code works for, if any."""
    try:
        ctx = activity_context()
    except NotInActivityError:
        inst = current_instance()
        if inst is None:
            return {}
        return {"run_id": inst.run_id, "workflow": inst.workflow.name, "step": inst.step}
    return {"run_id": ctx.run_id, "step": ctx.step, "activity": ctx.name, "attempt": ctx.attempt}


def configure(level: int | str = logging.INFO, stream: Any = None) -> None:
    """Send the root logger's records to ``stream`` (stderr) as JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
