"""Check recorded histories against today's workflow code, before a deploy.

``check_history(app, events)`` replays one history on a fresh instance of the
workflow it names and reports whether today's code issues the same commands,
with a unified diff of recorded vs produced commands when it does not. The
``tether replay`` command runs it over exported files or a store.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._errors import ConfigurationError, NonDeterminismError, TetherError
from .._history import COMMANDS, Event, EventType
from ..workflow._instance import WorkflowInstance, _describe
from ._files import read_text

if TYPE_CHECKING:
    from .._app import App


@dataclass
class ReplayReport:
    """The outcome of replaying one history."""

    run_id: str
    workflow: str
    ok: bool
    error: str | None = None
    recorded: list[str] = field(default_factory=list)
    produced: list[str] = field(default_factory=list)

    def diff(self) -> str:
        """A unified diff of the recorded commands against those today's code produced."""
        return "".join(
            difflib.unified_diff(
                [line + "\n" for line in self.recorded],
                [line + "\n" for line in self.produced],
                fromfile=f"{self.run_id} (recorded)",
                tofile=f"{self.run_id} (today's code)",
            )
        )


def events_from_json(doc: Any, run_id: str | None = None) -> list[Event]:
    """Events from ``tether history export`` output (or a bare list of events).

    Raises ``ConfigurationError`` naming what is wrong when ``doc`` is not a history.
    """
    items = doc.get("events", []) if isinstance(doc, dict) else doc
    run = doc.get("run") if isinstance(doc, dict) else None
    rid = run_id or (run.get("run_id") if isinstance(run, dict) else None) or "?"
    if not isinstance(items, list):
        raise ConfigurationError(
            "not a history: expected `tether history export` output (an object with an "
            f"'events' list) or a list of events, got {type(items).__name__}"
        )
    out = []
    for n, e in enumerate(items):
        if not isinstance(e, dict):
            raise ConfigurationError(
                f"not a history: event {n} is {type(e).__name__}, not an event object"
            )
        try:
            out.append(
                Event(
                    run_id=str(rid),
                    seq=int(e["seq"]),
                    type=EventType(e["type"]),
                    step=None if e.get("step") is None else int(e["step"]),
                    data=e.get("data") or {},
                    created_at=float(e.get("created_at", 0.0)),
                )
            )
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ConfigurationError(
                f"not a history: event {n} is not an event of `tether history export` ({what})"
            ) from None
    return out


def check_history(app: App, events: Sequence[Event]) -> ReplayReport:
    """Replay ``events`` with ``app``'s workflow code; never touches any store."""
    if not events or events[0].type is not EventType.WORKFLOW_STARTED:
        raise TetherError("a history must start with its WorkflowStarted event")
    run_id = events[0].run_id
    name = str(events[0].data.get("workflow", ""))
    recorded = [
        f"{e.step}: {_describe(e.type, e.data)}"
        for e in events
        if e.type in COMMANDS and e.step is not None
    ]
    wf = app.get_workflow(name)
    inst = WorkflowInstance(run_id, wf)
    inst.trace = []
    # replay only what was recorded up to the last completed workflow task
    last_marker = max(
        (i for i, e in enumerate(events) if e.type is EventType.WORKFLOW_TASK_COMPLETED),
        default=-1,
    )
    try:
        inst.advance(events[: last_marker + 1], events[last_marker].created_at)
    except NonDeterminismError as exc:
        return ReplayReport(run_id, name, False, str(exc), recorded, list(inst.trace))
    finally:
        inst.close()
    return ReplayReport(run_id, name, True, None, recorded, list(inst.trace))


def load_files(paths: Iterable[str]) -> list[list[Event]]:
    """Histories from exported JSON files; ``ConfigurationError`` naming the file when
    one is missing, unreadable, not JSON or not a history."""
    out = []
    for path in paths:
        text = read_text(path, "history file", "pass the JSON files in it")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigurationError(
                f"history file {path!r} is not valid JSON ({exc.msg})"
            ) from None
        try:
            out.append(events_from_json(doc))
        except ConfigurationError as exc:
            raise ConfigurationError(f"history file {path!r} is {exc}") from None
    return out
