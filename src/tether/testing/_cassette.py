"""Cassettes: a finished run's activity calls, replayable as a regression test.

    tether cassette export RUN_ID --store prod.db > tests/cases/incident_42.json

    async def test_incident_42():
        cassette = Cassette.load("tests/cases/incident_42.json")
        assert await cassette.replay(app) == cassette.result

A cassette holds the run's workflow name and input, and each activity call in
step order: its name, arguments, and recorded result or final failure.
``replay`` runs today's workflow code with that input on a fresh in-memory store
and a time-skipping ``Env``, with every activity replaced by a stub that answers
what was recorded (a scripted model: no network, no cost), and returns the
workflow's result. Calling an activity the cassette does not have, or (with
``check_args``) with other arguments, raises ``CassetteMismatch`` naming the call.

Recorded signals are delivered right after the start (they wait, buffered, until
the code asks for them). Child workflows are not captured: their activities are
not in the parent's history, so a replay that starts a child reports them missing.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._app import App
from .._definitions import Activity, Workflow
from .._errors import NonRetryable, TetherError
from .._history import Event, EventType
from ._env import Env
from ._replay import events_from_json

FORMAT = "tether-cassette/1"


class CassetteMismatch(TetherError, AssertionError):
    """Today's code called an activity the cassette did not record (or with other arguments)."""


@dataclass
class CassetteCall:
    """One recorded activity call."""

    step: int
    name: str
    #: ``{"args": [...], "kwargs": {...}}`` as recorded (JSON values)
    args: dict[str, Any]
    #: the recorded result (JSON), when the call completed
    result: Any = None
    #: the final failure ``{"type", "message", ...}``, when it failed
    error: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """A plain dict for the cassette file."""
        out: dict[str, Any] = {"step": self.step, "name": self.name, "args": self.args}
        if self.error is not None:
            out["error"] = self.error
        else:
            out["result"] = self.result
        return out


@dataclass
class Cassette:
    """A run's workflow, input, activity calls and outcome; see the module docstring."""

    workflow: str
    input: dict[str, Any]
    calls: list[CassetteCall]
    run_id: str = "?"
    #: ``completed``, ``failed``, ... or ``running`` for a run not finished when captured
    status: str = "running"
    #: the workflow's result (JSON) when it completed
    result: Any = None
    #: the workflow's error when it failed
    error: dict[str, Any] | None = None
    #: recorded signals, in order: ``{"name", "payload"}``
    signals: list[dict[str, Any]] = field(default_factory=list)

    # -- building ----------------------------------------------------------------

    @classmethod
    def from_history(cls, events: Sequence[Event] | dict[str, Any] | list[Any]) -> Cassette:
        """Build from a history: a list of ``Event``, or ``tether history export`` JSON."""
        if isinstance(events, dict) or (events and not isinstance(events[0], Event)):
            evs = events_from_json(events)
        else:
            evs = list(events)
        if not evs or evs[0].type is not EventType.WORKFLOW_STARTED:
            raise TetherError("a history must start with its WorkflowStarted event")
        voided: set[int] = set()
        for e in evs:
            if e.type is EventType.RUN_RETRIED:
                voided.update(int(s) for s in e.data.get("voided", []))
        start = evs[0]
        calls: dict[int, CassetteCall] = {}
        signals: list[dict[str, Any]] = []
        status, result, error = "running", None, None
        for e in evs:
            if e.seq in voided:
                continue
            t = e.type
            if t is EventType.ACTIVITY_SCHEDULED and e.step is not None:
                call = CassetteCall(e.step, str(e.data.get("name")), e.data.get("args") or {})
                if "result" in e.data:  # reused by an operator's retry: already answered
                    call.result = e.data["result"]
                calls[e.step] = call
            elif t is EventType.ACTIVITY_COMPLETED and e.step in calls:
                calls[e.step].result = e.data.get("result")
                calls[e.step].error = None
            elif t is EventType.ACTIVITY_FAILED and e.step in calls:
                calls[e.step].error = dict(e.data.get("error") or {})
            elif t is EventType.SIGNAL_RECEIVED:
                signals.append({"name": e.data.get("name"), "payload": e.data.get("payload")})
            elif t is EventType.WORKFLOW_COMPLETED:
                status, result = "completed", e.data.get("result")
            elif t in _TERMINAL:
                status, error = _TERMINAL[t], e.data.get("error")
        return cls(
            workflow=str(start.data.get("workflow", "")),
            input=dict(start.data.get("input") or {"args": [], "kwargs": {}}),
            calls=[calls[s] for s in sorted(calls)],
            run_id=start.run_id,
            status=status,
            result=result,
            error=error,
            signals=signals,
        )

    def to_json(self) -> dict[str, Any]:
        """The cassette as a JSON document."""
        return {
            "format": FORMAT,
            "run_id": self.run_id,
            "workflow": self.workflow,
            "input": self.input,
            "status": self.status,
            "result": self.result,
            "error": self.error,
            "signals": self.signals,
            "calls": [c.to_json() for c in self.calls],
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Cassette:
        """Read a cassette document (or a ``tether history export`` document)."""
        if doc.get("format") != FORMAT:
            if "events" in doc:
                return cls.from_history(doc)
            raise TetherError(
                f"not a tether cassette (format {doc.get('format')!r}, expected {FORMAT!r})"
            )
        return cls(
            workflow=doc["workflow"],
            input=doc.get("input") or {"args": [], "kwargs": {}},
            calls=[
                CassetteCall(
                    int(c["step"]), c["name"], c.get("args") or {}, c.get("result"), c.get("error")
                )
                for c in doc.get("calls", [])
            ],
            run_id=doc.get("run_id", "?"),
            status=doc.get("status", "running"),
            result=doc.get("result"),
            error=doc.get("error"),
            signals=list(doc.get("signals") or []),
        )

    def save(self, path: str | Path) -> None:
        """Write the cassette as JSON."""
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Cassette:
        """Read a cassette file (``tether cassette export`` or ``history export`` output)."""
        with open(path, encoding="utf-8") as fh:
            return cls.from_json(json.load(fh))

    # -- replaying ---------------------------------------------------------------

    async def replay(
        self,
        app: App,
        workflow: Workflow[Any, Any] | str | None = None,
        *,
        check_args: bool = True,
        require_all: bool = False,
        timeout: float = 30.0,
    ) -> Any:
        """Run today's code on the recorded input, every activity answered from the cassette.

        Returns the workflow's result; raises what ``Run.result`` raises if the run
        does not complete, and ``CassetteMismatch`` if the code called an activity
        that is not recorded, with other arguments (``check_args``), or (with
        ``require_all``) left recorded calls unused.
        """
        wf = (
            workflow
            if isinstance(workflow, Workflow)
            else app.get_workflow(workflow or self.workflow)
        )
        player = _Player(self, check_args)
        fresh = App(store=":memory:", queue=app.default_queue)
        fresh._workflows = dict(app._workflows)
        fresh._activities = {name: player.stub(act) for name, act in app._activities.items()}
        try:
            async with Env(fresh):
                args = list(self.input.get("args") or [])
                kwargs = dict(self.input.get("kwargs") or {})
                run = await fresh.start(wf, *args, kwargs=kwargs)
                for sig in self.signals:
                    await run.signal(str(sig["name"]), sig.get("payload"))
                try:
                    value = await run.result(timeout=timeout)
                except Exception:
                    player.raise_problems()
                    raise
            player.raise_problems()
            if require_all:
                unused = [c for c in self.calls if id(c) not in player.used]
                if unused:
                    raise CassetteMismatch(
                        "the code did not make these recorded calls: "
                        + ", ".join(f"step {c.step} {c.name}" for c in unused)
                    )
            return value
        finally:
            await fresh.close()


_TERMINAL = {
    EventType.WORKFLOW_FAILED: "failed",
    EventType.WORKFLOW_CANCELLED: "cancelled",
    EventType.WORKFLOW_TIMED_OUT: "timed_out",
    EventType.WORKFLOW_NEEDS_INTERVENTION: "needs_intervention",
    EventType.WORKFLOW_TERMINATED: "terminated",
    EventType.CONTINUED_AS_NEW: "continued_as_new",
}


def _recorded_error(error: dict[str, Any]) -> BaseException:
    """A non-retryable exception whose type name is the recorded one."""
    name = str(error.get("type") or "Error")
    cls = type(name, (NonRetryable,), {"__module__": "tether.testing.cassette"})
    exc: BaseException = cls(str(error.get("message", "")))
    return exc


class _Player:
    """Answers activity calls from a cassette, by step first, then in order per name."""

    def __init__(self, cassette: Cassette, check_args: bool) -> None:
        self.by_step = {c.step: c for c in cassette.calls}
        self.calls = cassette.calls
        self.check_args = check_args
        self.used: set[int] = set()
        self.problems: list[str] = []

    def _find(self, name: str, step: int | None) -> CassetteCall | None:
        hit = self.by_step.get(step) if step is not None else None
        if hit is not None and hit.name == name and id(hit) not in self.used:
            return hit
        for c in self.calls:
            if c.name == name and id(c) not in self.used:
                return c
        return None

    def answer(self, act: Activity[Any, Any], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        from .._activity_context import _ctx

        ctx = _ctx.get()
        step = ctx.step if ctx is not None else None
        call = self._find(act.name, step)
        if call is None:
            msg = (
                f"step {step}: the code called activity {act.name!r} but the cassette has no "
                f"unused recorded call of it (recorded: "
                f"{', '.join(f'{c.step}:{c.name}' for c in self.calls) or 'none'})"
            )
            self.problems.append(msg)
            raise NonRetryable(msg)
        if self.check_args:
            given = json.loads(act.sig.encode_args(args, kw))
            if given != call.args:
                msg = (
                    f"step {step}: activity {act.name!r} was called with {given} but the "
                    f"cassette recorded {call.args} (step {call.step})"
                )
                self.problems.append(msg)
                raise NonRetryable(msg)
        self.used.add(id(call))
        if call.error is not None:
            raise _recorded_error(call.error)
        return copy.deepcopy(call.result)

    def stub(self, act: Activity[Any, Any]) -> Activity[Any, Any]:
        async def fn(*args: Any, **kwargs: Any) -> Any:
            return self.answer(act, args, kwargs)

        stub = copy.copy(act)
        stub.fn = fn
        stub.is_async = True
        return stub

    def raise_problems(self) -> None:
        if self.problems:
            raise CassetteMismatch("; ".join(self.problems))
