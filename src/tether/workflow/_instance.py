"""One workflow run in memory: applies history, runs the code, collects commands.

An instance is advanced by ``advance(events)``. Events up to the last
``WorkflowTaskCompleted`` marker are *replay*: they are fed to the code in the
same batches as the first time and every command the code issues must match the
recorded one at the same step. Events after the last marker are new: the
commands they cause are returned to be committed. A cached instance (the sticky
cache) is advanced with only the events it has not seen, so an n-step run costs
O(n) in total.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import random
import traceback
import weakref
from asyncio import events as asyncio_events
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, NoReturn

import pydantic

from .._definitions import CHAIN_SEPARATOR, Activity, Workflow, chain_of, running
from .._errors import (
    ActivityError,
    ChildWorkflowError,
    ContinueAsNew,
    NonDeterminismError,
    PayloadError,
)
from .._history import (
    APPROVAL_SIGNAL,
    COMMANDS,
    INCOMING,
    UPDATE_MARKER,
    UPDATE_SIGNAL,
    Event,
    EventType,
)
from .._redact import made_by_engine
from .._serde import Signature, convert, encode, json_equal
from .._usage import Budget, Spend
from ..store.base import Command, WorkflowTaskResult
from ._loop import DeterministicLoop
from ._saga import CompensationFailed

#: set while this side runs workflow code (declared with the definitions that read it)
_current = running


def current_instance() -> WorkflowInstance | None:
    """The workflow instance whose code is running now, if any."""
    inst = _current.get()
    return inst if isinstance(inst, WorkflowInstance) else None


#: the patch marker a run records the first time a cancel request or its deadline comes
#: while its code already handles one (not delivered again); runs whose history passed
#: such a repeat without it replay the old way (delivered again)
ONE_INTERRUPT = "tether.cancel-once"


#: the patch marker a run records when update requests that came before their handlers
#: (``register_updates``) are applied in the order they arrived, which the older code
#: did not (grouped by name); runs whose history applied them the old way replay so
ARRIVAL_ORDER = "tether.updates-arrival-order"


#: the patch marker a run records the first time it stops waiting for a child started
#: with ``parent_close="abandon"`` (the child is left running); runs whose history asked
#: such a child to cancel without it replay the old way
ABANDON_RUNS_ON = "tether.abandon-runs-on"


#: the patch marker a run records the first time its code asks for a random value or an
#: id (``tether.random``, ``tether.uuid``): each value is then recorded (a Marker named
#: ``VALUE_MARKERS[kind]``) and replayed from history. Runs whose history drew values
#: without it replay the old way: derived from a seed (the run id) and the call order
RECORDED_VALUES = "tether.recorded-values"

#: the Marker recording each value drawn by ``WorkflowInstance.draw``, by kind
VALUE_MARKERS = {"uuid": "tether.uuid", "random": "tether.random"}


class InstanceClosed(BaseException):
    """Raised at durable calls of an instance being unwound; never recorded."""


#: the outcomes that answer a pending step of each kind
_OUTCOMES: dict[str, tuple[EventType, ...]] = {
    "activity": (EventType.ACTIVITY_COMPLETED, EventType.ACTIVITY_FAILED),
    "child": (EventType.CHILD_COMPLETED, EventType.CHILD_FAILED),
    "timer": (EventType.TIMER_FIRED,),
}


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Any]
    kind: str
    name: str
    result_type: Any
    #: what ``waiting_on`` shows of it (a timer's fire time, a child's run id); None:
    #: nothing (a wait_event's own timer, shown with its signal)
    shown: dict[str, Any] | None = None
    since: float = 0.0  #: the workflow clock when the wait began


log = logging.getLogger("tether.workflow")


def _error_dict(exc: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc))[-8000:],
    }
    if isinstance(exc, ActivityError):  # what the step raised: listable by its type
        out["cause"] = {"type": exc.error_type, "activity": exc.activity}
    return out


def _describe(type_: EventType | str, data: dict[str, Any], detail: bool = False) -> str:
    """A command as replay checks name it; ``detail`` adds why a run ended failing (its
    error's type and message), for the message of a divergence."""
    name = data.get("name") or data.get("workflow") or data.get("marker") or data.get("patch_id")
    text = f"{type_}({name!r})" if name else str(type_)
    err = data.get("error")
    if detail and isinstance(err, dict) and err.get("type"):
        message = str(err.get("message") or "")
        if len(message) > 300:
            message = message[:300] + "..."
        text += f" ({err['type']}: {message})" if message else f" ({err['type']})"
    return text


def _names_only(
    exc: NonDeterminismError, *commands: tuple[EventType | str, dict[str, Any]]
) -> NonDeterminismError:
    """``exc`` marked as the engine's (shown whole: names and step numbers alone) unless
    a command's description carries a run's error message (``_describe``'s detail)."""
    if all(_describe(t, d, detail=True) == _describe(t, d) for t, d in commands):
        return made_by_engine(exc)
    return exc


class WorkflowInstance:
    """The in-memory state of one run of a workflow."""

    def __init__(self, run_id: str, workflow: Workflow[Any, Any]) -> None:
        self.run_id = run_id
        self.workflow = workflow
        self.now = 0.0
        self.loop = DeterministicLoop(lambda: self.now)  # type: ignore[abstract]
        self._rng: random.Random | None = None
        self.step = 0
        self.replaying = False
        self.last_seq = 0  #: history seq this instance has consumed up to
        self.through = 0  #: last incoming event seq applied
        self.finished = False
        self.cancel_requested = False
        self.deadline_exceeded = False
        self.started_children = 0  #: children this run started (replayed ones included)
        self.started: Event | None = None  #: the run's WorkflowStarted event, once applied
        #: the time the run's first task ran with, when it was recorded in the commit that
        #: created the run (an eager start ran it before the store stamped the run)
        self.eager_time: float | None = None
        #: how long each signal wait lasts (None: no timeout)
        self._signal_until: weakref.WeakKeyDictionary[asyncio.Future[Any], float | None] = (
            weakref.WeakKeyDictionary()
        )
        #: when each signal wait began (the workflow clock)
        self._signal_since: weakref.WeakKeyDictionary[asyncio.Future[Any], float] = (
            weakref.WeakKeyDictionary()
        )
        #: the futures of the activity steps scheduled (``is_activity``)
        self._activity_futures: weakref.WeakSet[asyncio.Future[Any]] = weakref.WeakSet()
        #: durable waits that ended in new (not replayed) events since the last
        #: ``take_waits``: (kind, name, began, ended); the worker makes spans and metrics
        self._waits: list[tuple[str, str, float, float]] = []
        #: counters noted by code that ran for the first time (``count``), flushed by the
        #: worker once the task that ran it commits
        self._counts: list[tuple[str, tuple[str, ...], float]] = []
        #: model tokens and cost met first by the task being computed (``tally_usage``)
        self._usage: tuple[int, Decimal] | None = None
        #: daily budgets' spend met first by the task being computed (``tally_spend``)
        self._spend: list[tuple[tuple[str, ...], int, str, str | None]] = []
        self._holds: list[int] = []
        #: model spend as this run's code met it (replay included), for its budget
        self.spend = Spend()
        #: steps whose outcome was kept from before a retry or fork (not run again)
        self._reused: set[int] = set()
        #: read-only handlers by name (``tether.on_query``): answered by replaying, never
        #: recorded
        self.queries: dict[str, Callable[..., Any]] = {}
        #: update handlers by name (``tether.on_update``): (handler, validator or None)
        self.updates: dict[str, tuple[Callable[..., Any], Callable[..., Any] | None]] = {}
        #: kept in a worker's cache while it waits for signals (an entity: each of its
        #: operations would otherwise cost a replay of its whole run)
        self.hot = False
        #: update requests that arrived before their handler was registered, by name:
        #: (arrival number, request)
        self._early_updates: dict[str, list[tuple[int, dict[str, Any]]]] = collections.defaultdict(
            list
        )
        self._arrivals = 0
        self.main: asyncio.Task[Any] | None = None
        self._new: list[Command] = []
        self._recorded: dict[int, Event] = {}
        self._max_recorded = 0
        #: the custom status last set by this run's code (the same on every replay)
        self.last_status: Any = None
        self._pending: dict[int, _Pending] = {}
        #: outcomes that came before the code asked for their step (a retry that voided
        #: the run's first task replays its start and a child's end in one batch); each
        #: is applied when the code issues that step
        self._early: dict[int, Event] = {}
        #: signals no code has taken yet, by name: (seq, payload), oldest first
        self._buffers: dict[str, collections.deque[tuple[int, Any]]] = collections.defaultdict(
            collections.deque
        )
        #: the ids of buffered signals sent with one, by seq (carried on with them)
        self._buffered_ids: dict[int, str] = {}
        self._waiters: dict[str, collections.deque[asyncio.Future[Any]]] = collections.defaultdict(
            collections.deque
        )
        self._nd_error: NonDeterminismError | None = None
        self._closed = False
        self._patches: dict[str, bool] = {}
        #: the code version that ran this run's first workflow task (None: unversioned)
        self.recorded_version: str | None = None
        #: when a list, every command the code issues is described here (replay checks)
        self.trace: list[str] | None = None
        self._voided: set[int] = set()
        self._retries_seen: set[int] = set()
        #: results of steps voided by an operator's retry, reusable at the same step
        #: (name, arguments, result) by step
        self._reuse: dict[int, tuple[str, Any, Any]] = {}

    @property
    def rng(self) -> random.Random:
        """The run's deterministic random generator, made on first use: seeded by its id,
        or, for a run whose values are not recorded (``RECORDED_VALUES``), by the id of
        the run it was forked from, so a fork draws the values its history drew."""
        if self._rng is None:
            source = self.run_id
            if not self._patches.get(RECORDED_VALUES) and self.started is not None:
                source = str(self.started.data.get("seed") or self.run_id)
            seed = int.from_bytes(hashlib.sha256(source.encode()).digest()[:8])
            self._rng = random.Random(seed)
        return self._rng

    def draw(self, kind: str, make: Callable[[random.Random], Any]) -> Any:
        """A value for ``tether.uuid``/``tether.random`` (``kind``): ``make(rng)``, recorded
        as a Marker and read back from history on replay, so neither a code change
        above the call nor a fork changes it (a call history does not hold where the code
        now makes one is a divergence). Drawn on replay too: the generator then stands
        where it stood, and a new value never repeats an earlier one."""
        if not self.patched(RECORDED_VALUES):  # decided first: it chooses the seed
            return make(self.rng)  # a run recorded before values were: derived as then
        value = make(self.rng)
        replayed = self.step + 1 <= self._max_recorded
        step = self._command(
            EventType.MARKER, {"marker": VALUE_MARKERS[kind]}, {"value": encode(value, kind)}
        )
        if replayed:
            recorded = self._recorded[step].data.get("value")
            # a history exported without its payloads ("[withheld]") replays a stand-in
            return recorded if isinstance(recorded, type(value)) else value
        return value

    # -- driving -----------------------------------------------------------

    def advance(self, events: Sequence[Event], now: float) -> WorkflowTaskResult:
        """Apply events not yet seen; return the new commands for the new ones.

        Raises NonDeterminismError if the code diverges from recorded history.
        """
        incoming: list[Event] = []
        for ev in events:
            if ev.type is EventType.RUN_RETRIED and ev.seq not in self._retries_seen:
                self._retries_seen.add(ev.seq)
                self._voided.update(ev.data.get("voided", []))
                for step, kept in (ev.data.get("reuse") or {}).items():
                    self._reuse[int(step)] = (kept["name"], kept.get("args"), kept.get("result"))
        for ev in events:
            if ev.seq in self._voided:
                continue
            if ev.type in INCOMING:
                if ev.seq > self.through:
                    incoming.append(ev)
                continue
            if ev.seq <= self.last_seq:
                continue
            if ev.type in COMMANDS:
                if ev.step is not None:
                    self._recorded[ev.step] = ev
                    self._max_recorded = max(self._max_recorded, ev.step)
            elif ev.type is EventType.WORKFLOW_TASK_COMPLETED:
                if self.recorded_version is None:
                    self.recorded_version = ev.data.get("version")
                through = int(ev.data["through"])
                batch = [e for e in incoming if e.seq <= through]
                incoming = [e for e in incoming if e.seq > through]
                self.replaying = True
                self.now = float(ev.data["time"])
                if (
                    self.started is None
                    and batch
                    and batch[0].type is EventType.WORKFLOW_STARTED
                    and batch[0].created_at == ev.created_at  # one commit: an eager start
                ):
                    self.eager_time = self.now
                try:
                    self._activate(batch)
                finally:
                    self.replaying = False
                if self.step < self._max_recorded:
                    missing = self._recorded[self.step + 1]
                    raise _names_only(
                        NonDeterminismError(
                            self.run_id,
                            self.step + 1,
                            _describe(missing.type, missing.data, detail=True),
                            "no command (the code now waits or ends earlier)",
                        ),
                        (missing.type, missing.data),
                    )
                self._new.clear()
                self.through = max(self.through, through)
            self.last_seq = ev.seq
        # what remains is new
        self.now = now
        self._new = []
        self._usage = None
        self._spend = []
        self._holds = []
        through = self.through
        if incoming:
            through = incoming[-1].seq
        self._activate(incoming)
        self.through = through
        commands, self._new = self._new, []
        usage, self._usage = self._usage, None
        spend, self._spend = self._spend, []
        holds, self._holds = self._holds, []
        return WorkflowTaskResult(
            commands=commands,
            through=through,
            time=now,
            version=self.workflow.version,
            children=self.started_children > 0,
            waiting_on=None if self.finished else self.waiting_on(),
            usage=(usage[0], str(usage[1])) if usage is not None else None,
            spend=spend or None,
            holds=holds or None,
        )

    def close(self) -> None:
        """Unwind every coroutine of this instance without effects (eviction, shutdown).

        Their ``finally`` blocks run here, inside the instance, where any durable call
        raises ``InstanceClosed`` instead of doing anything; left to the garbage
        collector they would run outside a workflow, where activities run for real.
        """
        if self._closed:
            return
        self._closed = True
        self.finished = True
        token = _current.set(self)
        previous = asyncio_events._get_running_loop()
        asyncio_events._set_running_loop(self.loop)
        try:
            for task in [t for t in self.loop.tasks if not t.done()]:
                try:
                    task.get_coro().close()
                except BaseException:
                    pass
        finally:
            asyncio_events._set_running_loop(previous)
            _current.reset(token)
        self._pending.clear()
        self._waiters.clear()
        self.loop.close()

    def committed(self, marker_seq: int) -> None:
        """Note that the last result was committed with its marker at ``marker_seq``."""
        self.last_seq = marker_seq
        self._recorded.clear()
        self._max_recorded = self.step

    def _activate(self, batch: Sequence[Event]) -> None:
        token = _current.set(self)
        try:
            for ev in batch:
                self._apply(ev)
            self.loop.run_until_idle()
        finally:
            _current.reset(token)
        if self._nd_error is not None:
            raise self._nd_error
        if self.main is not None and self.main.done() and not self.finished:
            self._finish(self.main)

    def _finish(self, main: asyncio.Task[Any]) -> None:
        token = _current.set(self)
        try:
            self.refuse_early_updates(None if main.cancelled() else main.exception())
        finally:
            _current.reset(token)
        self.finished = True
        token = _current.set(self)
        try:
            exc = None if main.cancelled() else main.exception()
            if isinstance(exc, CompensationFailed):
                self._command(EventType.WORKFLOW_NEEDS_INTERVENTION, {"error": _error_dict(exc)})
                return
            if self.deadline_exceeded and (main.cancelled() or exc is not None):
                error = {"type": "DeadlineExceeded", "message": "the run's deadline passed"}
                if exc is not None and not isinstance(exc, asyncio.CancelledError):
                    error = _error_dict(exc)
                self._command(EventType.WORKFLOW_TIMED_OUT, self._ending({"error": error}))
                return
            if main.cancelled():
                self._command(EventType.WORKFLOW_CANCELLED, self._ending({"error": None}))
                return
            if exc is None:
                self._say_unawaited()
                try:
                    text = encode(main.result(), f"result of workflow {self.workflow.name!r}")
                except PayloadError as err:
                    self._command(
                        EventType.WORKFLOW_FAILED, self._ending({"error": _error_dict(err)})
                    )
                    return
                self._command(EventType.WORKFLOW_COMPLETED, self._ending({}), {"result": text})
            elif isinstance(exc, ContinueAsNew):
                raw = {"input": exc.input_json}
                carried = self.untaken_signals()
                if carried:  # a signal sent to the chain reaches the chain
                    raw["signals"] = encode(carried, "signals carried to the next run")
                self._command(
                    EventType.CONTINUED_AS_NEW,
                    {"next_run_id": _next_run_id(self.run_id), "carried_signals": len(carried)}
                    if carried
                    else {"next_run_id": _next_run_id(self.run_id)},
                    raw,
                )
            elif isinstance(exc, asyncio.CancelledError) and self.cancel_requested:
                self._command(EventType.WORKFLOW_CANCELLED, self._ending({"error": None}))
            elif isinstance(exc, NonDeterminismError):
                raise exc
            else:
                self._command(EventType.WORKFLOW_FAILED, self._ending({"error": _error_dict(exc)}))
        finally:
            _current.reset(token)
        if self._nd_error is not None:
            raise self._nd_error

    def _say_unawaited(self) -> None:
        """Warn of activity steps the run completed without awaiting (an ``await``
        forgotten: ``classify(text)`` schedules the step, and the run does not wait for
        it). Said as the run completes, not as it is replayed."""
        if self.replaying:
            return
        left = [
            f"{p.name} (step {step})"
            for step, p in self._pending.items()
            if p.kind == "activity" and not p.future.done()
        ]
        if left:
            log.warning(
                "run %r (workflow %r) completed while %d step(s) it scheduled were still "
                "unfinished, never awaited: %s. The run does not wait for them and nothing "
                "uses their results: was an `await` forgotten?",
                self.run_id,
                self.workflow.name,
                len(left),
                ", ".join(left),
                extra={"run_id": self.run_id},
            )

    def _apply(self, ev: Event) -> None:
        t = ev.type
        if t is EventType.WORKFLOW_STARTED:
            self.started = ev
            args, kwargs = self.workflow.sig.decode_args_obj(ev.data.get("input"))
            self.main = self.loop.create_task(self._run_main(args, kwargs), name=self.run_id)
            return
        if t is EventType.SIGNAL_RECEIVED:
            name = ev.data["name"]
            if name.startswith(UPDATE_SIGNAL):
                self._deliver_update(name[len(UPDATE_SIGNAL) :], ev.data.get("payload") or {})
                return
            waiters = self._waiters[name]
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    if not self.replaying:
                        since = self._signal_since.get(fut, ev.created_at)
                        label = "approval" if name.startswith(APPROVAL_SIGNAL) else name
                        kind = "approval" if label == "approval" else "signal"
                        self._waits.append((kind, label, since, ev.created_at))
                    fut.set_result(ev.data.get("payload"))
                    return
            self._buffers[name].append((ev.seq, ev.data.get("payload")))
            if ev.data.get("signal_id") is not None:
                self._buffered_ids[ev.seq] = ev.data["signal_id"]
            return
        if t is EventType.CANCEL_REQUESTED or t is EventType.DEADLINE_EXCEEDED:
            self._interrupt(t is EventType.DEADLINE_EXCEEDED, ev.data.get("reason"))
            return
        assert ev.step is not None
        ended = t is EventType.CHILD_COMPLETED or t is EventType.CHILD_FAILED
        if ended and ev.step in self.spend.shares:
            # a child with a share of this run's budget ended: what it spent counts
            self.spend.reported[ev.step] = ev.data.get("model_spend")
        if ev.step in self.spend.abandoned and (
            t is EventType.ACTIVITY_COMPLETED or t is EventType.ACTIVITY_FAILED
        ):
            # a call the run stopped waiting for (a hedge's loser) ended: it counts
            # against the budget, and the ledger, as what it used (once)
            done = t is EventType.ACTIVITY_COMPLETED
            used = self.spend.settle(ev.step, ev.data.get("result") if done else None)
            if used is not None and not self.reused(ev.step):
                self.tally_usage(*used)
        p = self._pending.pop(ev.step, None)
        if p is None and ev.step > self.step:
            self._early[ev.step] = ev  # not asked for yet: applied when the code asks
            return
        if p is None or p.future.done():
            return  # the code stopped waiting (cancelled, lost a race): the outcome is ignored
        if t is EventType.ACTIVITY_COMPLETED or t is EventType.CHILD_COMPLETED:
            try:
                value = convert(ev.data.get("result"), p.result_type, f"result of {p.name}")
            except PayloadError as exc:
                # the code's type does not take what the step returned (a deploy made a
                # field required since): a divergence, whether the result is replayed or
                # new, never a failure of the run: it waits for code that reads it
                self._diverged(
                    NonDeterminismError(
                        self.run_id,
                        ev.step,
                        f"{_describe(t, {'name': p.name})} with a result",
                        f"code whose return type {_type_name(p.result_type)} no longer "
                        f"accepts that result ({_invalid_fields(exc)})",
                    )
                )
            p.future.set_result(value)
        elif t is EventType.TIMER_FIRED:
            if not self.replaying and p.shown is not None:
                self._waits.append(("timer", "timer", p.since, ev.created_at))
            p.future.set_result(None)
        elif t is EventType.ACTIVITY_FAILED:
            err = ev.data.get("error") or {}
            p.future.set_exception(
                ActivityError(
                    p.name,
                    err.get("type", "Error"),
                    err.get("message", ""),
                    int(ev.data.get("attempt", 1)),
                )
            )
        elif t is EventType.CHILD_FAILED:
            err = ev.data.get("error") or {}
            msg = f"{err.get('type')}: {err.get('message')}" if err else None
            p.future.set_exception(
                ChildWorkflowError(ev.data.get("child_run_id", ""), ev.data.get("status", ""), msg)
            )

    def _interrupt(self, deadline: bool, reason: str | None) -> None:
        """A cancel request or the run's deadline: cancel the workflow's code, once.

        The code sees ``CancelledError`` at its current await and may clean up (a saga
        compensates). A further cancel request, or the deadline passing, while it does
        is recorded in history but not delivered: cancelling again would abort the
        cleanup at its next await (the remaining undos of a saga). The first one decides
        how the run ends (``cancelled`` or ``timed_out``). Histories written before this
        rule delivered every one: the first repeat consults ``ONE_INTERRUPT`` (a patch
        marker), so they replay as they ran.
        """
        main = self.main
        live = main is not None and not main.done()
        if (
            live
            and (self.cancel_requested or self.deadline_exceeded)
            and self.patched(ONE_INTERRUPT)
        ):
            if not deadline:
                self.cancel_requested = True
            return  # recorded, not delivered: the code is already handling one
        if deadline:
            self.deadline_exceeded = True
        else:
            self.cancel_requested = True
        if main is not None and live:
            main.cancel("the run's deadline passed" if deadline else reason)

    async def _run_main(self, args: list[Any], kwargs: dict[str, Any]) -> Any:
        return await self.workflow.fn(*args, **kwargs)

    # -- commands ----------------------------------------------------------

    def _command(
        self,
        type_: EventType,
        data: dict[str, Any],
        raw: dict[str, str] | None = None,
        *,
        inputs: tuple[str, Signature, frozenset[str]] | None = None,
    ) -> int:
        """Issue one command (checked against history when it replays a recorded step).

        ``inputs`` names the field of ``raw`` that holds what the command asks for (a
        step's arguments, a child's input), the signature they bind to and the
        parameters not compared: on replay they must equal the recorded ones, or the
        recorded outcome would answer another call.
        """
        if self._closed:
            raise InstanceClosed(self.run_id)
        self.step += 1
        step = self.step
        if self.trace is not None:
            self.trace.append(f"{step}: {_describe(type_, data)}")
        if step <= self._max_recorded:
            rec = self._recorded.get(step)
            produced = _describe(type_, data)
            if rec is None or rec.type is not type_ or _key(rec.data) != _key(data):
                expected = _describe(rec.type, rec.data, detail=True) if rec else "no command"
                produced = _describe(type_, data, detail=True)
                self._diverged(
                    _names_only(
                        NonDeterminismError(self.run_id, step, expected, produced),
                        *([(rec.type, rec.data)] if rec else []),
                        (type_, data),
                    )
                )
            if inputs is not None and raw and not self._copied(step):
                differs = _inputs_differ(rec.data.get(inputs[0]), raw[inputs[0]], *inputs[1:])
                if differs is not None:
                    what = "arguments" if inputs[0] == "args" else "input"
                    self._diverged(
                        made_by_engine(  # names and which arguments differ: no values
                            NonDeterminismError(
                                self.run_id,
                                step,
                                f"{produced} called with other {what}",
                                f"the same call with {differs} different (values not shown)",
                            )
                        )
                    )
            if (
                type_ is EventType.CHILD_STARTED
                and rec.data.get("child_run_id") != data.get("child_run_id")
                and not self._copied(step)
            ):
                self._diverged(
                    made_by_engine(  # names and run ids
                        NonDeterminismError(
                            self.run_id,
                            step,
                            f"{produced} as child run {rec.data.get('child_run_id')!r}",
                            f"the same child start as run {data.get('child_run_id')!r}",
                        )
                    )
                )
        elif self.replaying:
            self._diverged(
                _names_only(
                    NonDeterminismError(
                        self.run_id,
                        step,
                        "no command (the task ended here)",
                        _describe(type_, data, detail=True),
                    ),
                    (type_, data),
                )
            )
        else:
            self._new.append(Command(type=type_, step=step, data=data, raw=raw or {}))
        return step

    def _diverged(self, err: NonDeterminismError) -> NoReturn:
        """Raise ``err``, kept as the task's outcome (the first one wins) whatever the
        code does with the exception."""
        if self._nd_error is None:
            self._nd_error = err
        raise err

    def _copied(self, step: int) -> bool:
        """Whether ``step`` was recorded by the run this one was forked from: its inputs
        may name that run (its id, an idempotency key, a child's run id) and are not
        compared."""
        forked = self.started.data.get("forked_from") if self.started is not None else None
        return isinstance(forked, dict) and step <= int(forked.get("at_step") or 0)

    def _take_early(self, step: int) -> None:
        """Apply the outcome of ``step`` that came before the code asked for it: only to
        a step of its own kind (an activity's result never fires a timer)."""
        early = self._early.pop(step, None)
        if early is None:
            return
        kind = self._pending[step].kind
        if early.type not in _OUTCOMES.get(kind, ()):
            self._diverged(
                made_by_engine(
                    NonDeterminismError(
                        self.run_id,
                        step,
                        f"{early.type.value} for step {step}",
                        f"a {kind} at step {step}",
                    )
                )
            )
        self._apply(early)

    def _watch_cancel(self, step: int, cancel_type: EventType, field: str, **extra: Any) -> None:
        fut = self._pending[step].future

        def on_done(f: asyncio.Future[Any]) -> None:
            if f.cancelled() and self._pending.pop(step, None) is not None and not self.finished:
                self._command(cancel_type, {field: step, **extra})

        fut.add_done_callback(on_done)

    def trace_context(self) -> Any:
        """The W3C context the run was started in (``app.start``), if it is traced."""
        attrs = (self.started.data.get("attrs") if self.started is not None else None) or {}
        return attrs.get("trace")

    # -- queries and updates ---------------------------------------------------------

    def register_update(
        self, name: str, handler: Callable[..., Any], validator: Callable[..., Any] | None
    ) -> None:
        """Register an update handler; requests that came before it are handled now."""
        self.updates[name] = (handler, validator)
        for _n, request in self._early_updates.pop(name, []):
            self._deliver_update(name, request)

    def register_updates(self, handlers: dict[str, Callable[..., Any]]) -> None:
        """Register several update handlers (no validators) at once: the requests that
        came before them are handled now, in the order they arrived (an entity's
        operations), not grouped by name as one ``register_update`` each would."""
        early = [(n, name, r) for name in handlers for n, r in self._early_updates.pop(name, [])]
        for name, handler in handlers.items():
            self.updates[name] = (handler, None)
        arrived = sorted(early)
        if arrived != early and not self.patched(ARRIVAL_ORDER):
            arrived = early  # a history of the older code: grouped by name, as it ran
        for _n, name, request in arrived:
            self._deliver_update(name, request)

    def _deliver_update(self, name: str, request: dict[str, Any]) -> None:
        """Apply one update request: validate, run the handler, record its outcome as a
        Marker (the same on every replay: the request is an event in history)."""
        if name not in self.updates:
            self._arrivals += 1  # its handler is not registered yet
            self._early_updates[name].append((self._arrivals, request))
            return
        handler, validator = self.updates[name]
        update_id, args = request.get("id"), list(request.get("args") or [])
        if validator is not None:
            try:
                validator(*args)
            except Exception as exc:  # accepted by the caller's check, refused now
                self._update_done(update_id, name, error=exc, rejected=True)
                return
        try:
            out = handler(*args)
        except Exception as exc:
            self._update_done(update_id, name, error=exc)
            return
        if not asyncio.iscoroutine(out):
            self._update_done(update_id, name, result=out)
            return

        async def finish(coro: Any) -> None:
            try:
                value = await coro
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._update_done(update_id, name, error=exc)
            else:
                self._update_done(update_id, name, result=value)

        self.loop.create_task(finish(out))

    def _update_done(
        self,
        update_id: Any,
        name: str,
        *,
        result: Any = None,
        error: BaseException | None = None,
        rejected: bool = False,
    ) -> None:
        outcome: dict[str, Any] = {"id": update_id, "name": name}
        if error is None:
            outcome["result"] = result
        else:
            outcome["error"] = {
                "type": "UpdateRejected" if rejected else type(error).__name__,
                "message": str(error),
            }
        self.record(UPDATE_MARKER, outcome)

    def refuse_early_updates(self, failure: BaseException | None = None) -> None:
        """At the run's end: requests whose handler was never registered are answered
        (naming ``failure``, the error that ended the run, when it failed)."""
        why = (
            f" (its code failed first: {type(failure).__name__}: {failure})"
            if isinstance(failure, Exception)  # not a continue-as-new, nor a cancel
            else ""
        )
        for name, requests in list(self._early_updates.items()):
            for _n, request in requests:
                err = LookupError(f"the run ended without a handler for update {name!r}{why}")
                self._update_done(request.get("id"), name, error=err, rejected=True)
        self._early_updates.clear()

    def count(self, name: str, labels: tuple[str, ...], n: float = 1.0) -> None:
        """Note a counter (``tether._telemetry``) for code running for the first time:
        counted when its task commits, so neither a replay nor a task whose commit
        failed (and that runs again) counts twice."""
        if not self.replaying:
            self._counts.append((name, labels, n))

    def reused(self, step: int) -> bool:
        """Whether ``step``'s outcome was kept from before a retry or a fork (its work,
        a model call's cost included, was done and counted by the run it came from)."""
        forked = self.started.data.get("forked_from") if self.started is not None else None
        if isinstance(forked, dict) and step <= int(forked.get("at_step") or 0):
            return True  # copied from the run it was forked from
        return step in self._reused

    def tally_usage(self, tokens: int, cost: Decimal | None) -> None:
        """Add a model call's tokens and cost to the ledger of the run's tenant, with the
        commit of the task that first met its answer (never on replay)."""
        if not self.replaying:
            before = self._usage or (0, Decimal(0))
            self._usage = (before[0] + tokens, before[1] + (cost or Decimal(0)))

    def tally_spend(
        self, scopes: tuple[str, ...], tokens: int, cost: Decimal, day: str | None = None
    ) -> None:
        """Add work's tokens and cost to the daily spend of ``scopes`` (its tenant's and the
        global daily budgets) on ``day`` (None: the commit's), with the commit of the task
        that first met it (never on replay)."""
        if not self.replaying and scopes:
            self._spend.append((tuple(scopes), tokens, str(cost), day))

    def settle_hold(self, step: int) -> None:
        """Give back what the record of the daily hold of this run's batch submit
        ``step`` still holds, and remove it, with the commit of this task (never on
        replay)."""
        if not self.replaying:
            self._holds.append(step)

    def take_counts(self) -> list[tuple[str, tuple[str, ...], float]]:
        """The counters noted since the last call."""
        counts, self._counts = self._counts, []
        return counts

    def is_activity(self, awaitable: object) -> bool:
        """Whether ``awaitable`` is the future of an activity step this run scheduled
        (done or not): a saga waits for those only, not for a child, a timer, a signal."""
        return isinstance(awaitable, asyncio.Future) and awaitable in self._activity_futures

    def interrupted(self) -> bool:
        """Whether a cancel request or the run's deadline is being delivered to its code."""
        return self.cancel_requested or self.deadline_exceeded

    def take_waits(self) -> list[tuple[str, str, float, float]]:
        """The waits that ended since the last call (kind, name, began, ended)."""
        waits, self._waits = self._waits, []
        return waits

    def schedule_activity(
        self,
        activity: Activity[Any, Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        *,
        map_item: bool = False,
    ) -> asyncio.Future[Any]:
        """Issue an ActivityScheduled command; the future resolves with its outcome.

        ``map_item``: an item of ``tether.map``, whose failure the run goes on without
        (recorded, not compared on replay: its dead letter may be replayed alone)."""
        opts = activity.opts
        args_json = activity.sig.encode_args(args, kwargs)
        options = {**activity.options_json, "scheduled_at": self.now}
        trace = self.trace_context()
        if trace is not None:  # the run is traced: the attempt's span joins its trace
            options["trace"] = trace
        tenant = self.started.data.get("tenant") if self.started is not None else None
        if tenant is not None:  # for the attempt's span and log lines
            options["tenant"] = tenant
        data: dict[str, Any] = {
            "name": activity.name,
            "queue": opts.queue,
            "options": options,
            # evaluated now and recorded, so the task row never depends on today's code
            **opts.scheduling(activity.name, args, kwargs),
        }
        if map_item:
            data["map_item"] = True
        raw = {"args": args_json}
        kept = self._reuse.get(self.step + 1)
        if (
            kept is not None
            and not self.replaying
            and kept[0] == activity.name
            # the same call: a fixed deploy that passes other arguments runs the step
            and (kept[1] is None or kept[1] == json.loads(args_json))
        ):
            del self._reuse[self.step + 1]
            data["reused"] = True
            raw["result"] = encode(kept[2], "reused result")
        step = self._command(
            EventType.ACTIVITY_SCHEDULED,
            data,
            raw,
            inputs=("args", activity.sig, activity.replay_unchecked),
        )
        if data.get("reused"):
            self._reused.add(step)
        fut = self.loop.create_future()
        self._pending[step] = _Pending(
            fut,
            "activity",
            activity.name,
            activity.sig.return_type,
            {"kind": "activity", "name": activity.name, "step": step},
        )
        self._activity_futures.add(fut)
        self._watch_cancel(step, EventType.ACTIVITY_CANCEL_REQUESTED, "activity_step")
        self._take_early(step)
        return fut

    def start_child(
        self,
        workflow: Workflow[Any, Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        run_id: str | None,
        parent_close: str = "terminate",
        budget: Budget | None = None,
    ) -> asyncio.Future[Any]:
        """Issue a ChildStarted command; the future resolves with the child's result.

        ``parent_close`` is what happens to the child if this run ends first
        (terminate, cancel or abandon); recorded with the start, applied by the store.
        ``budget`` is the child's model budget; a run with a budget gives its child a
        share of what it has left (``budget`` when less), held while the child runs.
        """
        input_json = workflow.sig.encode_args(args, kwargs)
        child_id = run_id or f"{self.run_id}/{self.step + 1}"
        data = {"workflow": workflow.name, "child_run_id": child_id, "queue": workflow.queue}
        own = self.budget()
        recorded = self.recorded_next()
        if recorded is not None and recorded.type is EventType.CHILD_STARTED:
            share = recorded.data.get("budget")  # as decided then (or none: older code)
        elif own is not None:
            share = self.spend.share(own, budget).to_json()
        else:
            share = budget.to_json() if budget is not None else None
        if share is not None:
            data["budget"] = share
        trace = self.trace_context()
        if trace is not None:  # the child continues its parent's trace
            data["trace"] = trace
        if parent_close != "terminate":  # the default is not written: histories stay as before
            data["parent_close"] = parent_close
        self.started_children += 1
        step = self._command(
            EventType.CHILD_STARTED,
            data,
            {"input": input_json},
            inputs=("input", workflow.sig, frozenset()),
        )
        if share is not None and own is not None:
            self.spend.shares[step] = share
        fut = self.loop.create_future()
        self._pending[step] = _Pending(
            fut,
            "child",
            workflow.name,
            workflow.sig.return_type,
            {"kind": "child", "workflow": workflow.name, "run_id": child_id},
        )
        if parent_close == "abandon":
            self._watch_abandoned(step, child_id)
        else:
            self._watch_cancel(
                step, EventType.CHILD_CANCEL_REQUESTED, "child_step", child_run_id=child_id
            )
        self._take_early(step)
        return fut

    def _watch_abandoned(self, step: int, child_id: str) -> None:
        """A child started with ``parent_close="abandon"`` lives on its own: when the
        parent stops waiting for it (the parent is cancelled, or the child lost a race)
        only the parent's await is cancelled, never the child. Histories written before
        this rule asked it to cancel: the first such stop consults ``ABANDON_RUNS_ON``
        (a patch marker), so they replay as they ran."""
        fut = self._pending[step].future

        def on_done(f: asyncio.Future[Any]) -> None:
            if (
                f.cancelled()
                and self._pending.pop(step, None) is not None
                and not self.finished
                and not self.patched(ABANDON_RUNS_ON)  # histories of the older code
            ):
                self._command(
                    EventType.CHILD_CANCEL_REQUESTED, {"child_step": step, "child_run_id": child_id}
                )

        fut.add_done_callback(on_done)

    def start_timer(self, delay: float, *, shown: bool = True) -> asyncio.Future[Any]:
        """Issue a TimerStarted command; the future resolves when it fires.

        ``shown=False``: the timer bounds another wait (a signal's), which shows it.
        """
        fire_at = self.now + delay
        step = self._command(EventType.TIMER_STARTED, {"fire_at": fire_at})
        fut = self.loop.create_future()
        self._pending[step] = _Pending(
            fut,
            "timer",
            "timer",
            None,
            {"kind": "timer", "until": fire_at} if shown else None,
            self.now,
        )
        self._watch_cancel(step, EventType.TIMER_CANCELLED, "timer_step")
        self._take_early(step)
        return fut

    def set_status(self, value: Any) -> None:
        """Issue a StatusSet command."""
        self.last_status = value
        self._command(EventType.STATUS_SET, {}, {"value": encode(value, "status")})

    def budget(self) -> Budget | None:
        """The model budget this run was started with (``app.start(budget=)``, or its
        parent's share), or None."""
        started = self.started
        raw = ((started.data if started is not None else {}).get("attrs") or {}).get("budget")
        return Budget.from_json(raw) if raw is not None else None

    def _ending(self, data: dict[str, Any]) -> dict[str, Any]:
        """An ending command's data, with what the run spent when it has a budget (a
        parent that gave it a share of its own counts that, not the whole share)."""
        if self.started is None or self.budget() is None:
            return data
        tokens, cost = self.spend.spent()
        return {**data, "model_spend": {"tokens": tokens, "cost": str(cost)}}

    def recorded_next(self) -> Event | None:
        """The command history holds for the next step, when this run already got there.

        Lets a decision that must not change on replay (a budget check whose price
        table changed since) follow what was recorded instead of deciding again.
        """
        nxt = self.step + 1
        return self._recorded.get(nxt) if nxt <= self._max_recorded else None

    def diverge(self, expected: str, produced: str, *, names_only: bool = False) -> NoReturn:
        """Raise a ``NonDeterminismError`` at the next step (kept as the task's outcome:
        the run waits for code that can replay it), for a recorded decision that this
        deploy cannot follow: ``expected`` says what history holds, ``produced`` why.

        The message may quote recorded data (a model's answer), so it is the engine's
        (``made_by_engine``: logged whole, shown to keys without payloads) only with
        ``names_only``: for a caller that built both texts from names, ids and hashes
        the engine or the deploy's code controls (models, gateways, schemas, types'
        own field names), never from a payload."""
        exc = NonDeterminismError(self.run_id, self.step + 1, expected, produced)
        self._diverged(made_by_engine(exc) if names_only else exc)

    def record(self, marker: str, data: dict[str, Any]) -> int:
        """Issue a Marker command: a decision of workflow code recorded for audit.

        ``marker`` names its kind and is checked on replay like an activity's name;
        ``data`` (JSON) is only stored.
        """
        self.count("tether_decisions", (self.workflow.name, marker))
        return self._command(
            EventType.MARKER, {"marker": marker}, {"value": encode(data, "marker")}
        )

    def patched(self, patch_id: str, *, deprecated: bool = False) -> bool:
        """Whether this run takes the new branch of change ``patch_id``.

        New runs (and runs reaching this point for the first time) record a
        PatchMarker and take the new branch; runs whose history reached this point
        without the marker replay the old branch. ``deprecated`` consumes an old
        marker if present and never records a new one.
        """
        if patch_id in self._patches:
            return self._patches[patch_id]
        nxt = self.step + 1
        if self.replaying or nxt <= self._max_recorded:
            rec = self._recorded.get(nxt)
            taken = (
                rec is not None
                and rec.type is EventType.PATCH_MARKER
                and rec.data.get("patch_id") == patch_id
            )
            if taken:
                self._command(EventType.PATCH_MARKER, {"patch_id": patch_id})
        elif deprecated:
            taken = True
        else:
            self._command(EventType.PATCH_MARKER, {"patch_id": patch_id})
            taken = True
        self._patches[patch_id] = taken
        return taken

    def only_waiting_on(self, step: int) -> bool:
        """Whether ``step`` is the one durable outcome this instance is waiting for."""
        return len(self._pending) == 1 and step in self._pending

    def waits_only_on_time_or_events(self) -> bool:
        """Whether nothing but timers and signals can wake this instance (no step in flight):
        such a run may wait for days, so a worker should not hold it in memory."""
        return all(p.kind == "timer" for p in self._pending.values())

    def take_signal(self, name: str) -> tuple[bool, Any]:
        """Pop the oldest buffered signal ``name``, if any."""
        buf = self._buffers.get(name)
        if buf:
            seq, payload = buf.popleft()
            self._buffered_ids.pop(seq, None)
            return True, payload
        return False, None

    def untaken_signals(self) -> list[dict[str, Any]]:
        """The signals this run received and its code never took, in arrival order
        (approval decisions left out: they answer this run's own reviews), each with
        its ``signal_id`` if it was sent with one."""
        waiting = sorted(
            (seq, name, payload)
            for name, buf in self._buffers.items()
            if not name.startswith(APPROVAL_SIGNAL)
            for seq, payload in buf
        )
        out: list[dict[str, Any]] = []
        for seq, name, payload in waiting:
            item = {"name": name, "payload": payload}
            if seq in self._buffered_ids:
                item["signal_id"] = self._buffered_ids[seq]
            out.append(item)
        return out

    def wait_signal(self, name: str, until: float | None = None) -> asyncio.Future[Any]:
        """A future resolved by the next signal ``name`` to arrive (awaited ``until``)."""
        fut = self.loop.create_future()
        self._waiters[name].append(fut)
        self._signal_until[fut] = until
        self._signal_since[fut] = self.now
        return fut

    def waiting_on(self) -> list[dict[str, Any]]:
        """What the run waits for now: signals (until when), timers, steps, children."""
        out: list[dict[str, Any]] = []
        for name, waiters in self._waiters.items():
            for fut in waiters:
                if not fut.done():
                    out.append(
                        {"kind": "signal", "name": name, "until": self._signal_until.get(fut)}
                    )
        for p in self._pending.values():
            if p.shown is not None and not p.future.done():
                out.append(p.shown)
        return out


def _key(data: dict[str, Any]) -> tuple[Any, ...]:
    """The parts of a command that replay must reproduce exactly."""
    return (
        data.get("name"),
        data.get("workflow"),
        data.get("timer_step"),
        data.get("activity_step"),
        data.get("child_step"),
        data.get("patch_id"),
        data.get("marker"),
    )


def _inputs_differ(
    recorded: Any, text: str, sig: Signature, unchecked: frozenset[str]
) -> str | None:
    """What differs between a recorded call's arguments (decoded JSON, opened if sealed,
    fetched if offloaded) and those the code passes now (``text``, JSON): None if they
    are the same values. Compared as values (a dict's key order, a keyword written for a
    positional argument, a default written out do not count), never as text; the answer
    names parameters, never values. A call recorded without its arguments (a history
    written by hand) is not checked, nor are the ``unchecked`` parameters."""
    if not isinstance(recorded, dict):
        return None
    now = json.loads(text)
    if now == recorded and json_equal(now, recorded):
        return None  # the common case: the same JSON
    was_bound, now_bound = _bound(sig, recorded), _bound(sig, now)
    if was_bound is None or now_bound is None:
        if json_equal(recorded, now):
            return None
        return "the arguments"
    names = [
        name
        for name in dict.fromkeys([*was_bound, *now_bound])
        if name not in unchecked
        and (
            name not in was_bound
            or name not in now_bound
            or not json_equal(was_bound[name], now_bound[name])
        )
    ]
    if not names:
        return None
    return ("arguments " if len(names) > 1 else "argument ") + ", ".join(map(repr, names))


def _bound(sig: Signature, value: dict[str, Any]) -> dict[str, Any] | None:
    """Recorded or new arguments by parameter name, defaults filled in (JSON values)."""
    args, kwargs = value.get("args") or [], value.get("kwargs") or {}
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        return None
    try:
        bound = sig.sig.bind(*args, **kwargs)
        bound.apply_defaults()
        plain: dict[str, Any] = json.loads(encode(dict(bound.arguments), "arguments"))
    except (TypeError, ValueError):  # PayloadError is a TypeError
        return None
    return plain


def _type_name(tp: Any) -> str:
    return str(getattr(tp, "__qualname__", None) or tp)


def _invalid_fields(exc: PayloadError) -> str:
    """What a validation error says is wrong, by field, without the values it saw."""
    cause = exc.__cause__
    if not isinstance(cause, pydantic.ValidationError):
        return "it does not validate"
    parts = [
        f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
        for e in cause.errors(include_input=False, include_url=False, include_context=False)
    ]
    return "; ".join(parts[:5]) + ("; ..." if len(parts) > 5 else "")


def _next_run_id(run_id: str) -> str:
    first, n = chain_of(run_id)
    return f"{first}{CHAIN_SEPARATOR}{n + 1}"
