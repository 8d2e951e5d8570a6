"""History event types and the records the store hands back.

A run's history is an append-only list of events numbered by ``seq``. Three
families matter to replay:

* *incoming* events are outcomes the workflow reacts to (a step completed, a
  timer fired, a signal arrived);
* *command* events record what the workflow code asked for, each numbered by
  ``step`` in the order the code issued them; replay checks them;
* a ``WorkflowTaskCompleted`` marker closes each workflow task and says which
  incoming events (``through``) it had seen and at what time, so replay feeds
  the code exactly the batches it saw the first time.
"""

from __future__ import annotations

import datetime as _dt
import enum
import json
from dataclasses import dataclass
from typing import Any


class EventType(enum.StrEnum):
    """Kinds of history events; values are what the store records."""

    # incoming
    WORKFLOW_STARTED = "WorkflowStarted"
    ACTIVITY_COMPLETED = "ActivityCompleted"
    ACTIVITY_FAILED = "ActivityFailed"
    TIMER_FIRED = "TimerFired"
    CHILD_COMPLETED = "ChildCompleted"
    CHILD_FAILED = "ChildFailed"
    SIGNAL_RECEIVED = "SignalReceived"
    CANCEL_REQUESTED = "CancelRequested"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    # commands
    ACTIVITY_SCHEDULED = "ActivityScheduled"
    ACTIVITY_CANCEL_REQUESTED = "ActivityCancelRequested"
    TIMER_STARTED = "TimerStarted"
    TIMER_CANCELLED = "TimerCancelled"
    CHILD_STARTED = "ChildStarted"
    CHILD_CANCEL_REQUESTED = "ChildCancelRequested"
    STATUS_SET = "StatusSet"
    PATCH_MARKER = "PatchMarker"
    #: a fact the workflow decided and recorded (a route, a validation verdict), for audit
    MARKER = "Marker"
    WORKFLOW_COMPLETED = "WorkflowCompleted"
    WORKFLOW_FAILED = "WorkflowFailed"
    WORKFLOW_CANCELLED = "WorkflowCancelled"
    WORKFLOW_TIMED_OUT = "WorkflowTimedOut"
    WORKFLOW_NEEDS_INTERVENTION = "WorkflowNeedsIntervention"
    CONTINUED_AS_NEW = "ContinuedAsNew"
    # marker
    WORKFLOW_TASK_COMPLETED = "WorkflowTaskCompleted"
    # informational: neither outcomes nor commands, ignored by replay
    ACTIVITY_ATTEMPT_FAILED = "ActivityAttemptFailed"
    # operator actions, informational for replay
    WORKFLOW_TERMINATED = "WorkflowTerminated"
    RUN_RETRIED = "RunRetried"  #: ``data["voided"]`` lists seqs replay must skip
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"


INCOMING = frozenset(
    {
        EventType.WORKFLOW_STARTED,
        EventType.ACTIVITY_COMPLETED,
        EventType.ACTIVITY_FAILED,
        EventType.TIMER_FIRED,
        EventType.CHILD_COMPLETED,
        EventType.CHILD_FAILED,
        EventType.SIGNAL_RECEIVED,
        EventType.CANCEL_REQUESTED,
        EventType.DEADLINE_EXCEEDED,
    }
)

COMMANDS = frozenset(
    {
        EventType.ACTIVITY_SCHEDULED,
        EventType.ACTIVITY_CANCEL_REQUESTED,
        EventType.TIMER_STARTED,
        EventType.TIMER_CANCELLED,
        EventType.CHILD_STARTED,
        EventType.CHILD_CANCEL_REQUESTED,
        EventType.STATUS_SET,
        EventType.PATCH_MARKER,
        EventType.MARKER,
        EventType.WORKFLOW_COMPLETED,
        EventType.WORKFLOW_FAILED,
        EventType.WORKFLOW_CANCELLED,
        EventType.WORKFLOW_TIMED_OUT,
        EventType.WORKFLOW_NEEDS_INTERVENTION,
        EventType.CONTINUED_AS_NEW,
    }
)


#: events that, written by someone else, make a cached instance stale
REPLAY_CHANGING = COMMANDS | {EventType.WORKFLOW_TASK_COMPLETED, EventType.RUN_RETRIED}

#: outcome events that resolve one command step
OUTCOMES = frozenset(
    {
        EventType.ACTIVITY_COMPLETED,
        EventType.ACTIVITY_FAILED,
        EventType.TIMER_FIRED,
        EventType.CHILD_COMPLETED,
        EventType.CHILD_FAILED,
    }
)


#: the signal a decision of ``tether.approval`` is delivered as: this prefix + the approval id
#: the largest integers a store column holds: INTEGER on PostgreSQL (priorities, caps),
#: and the 64-bit integers of both stores (ids, sequence numbers, counts)
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

APPROVAL_SIGNAL = "tether.approval:"
#: an update request is a signal named this prefix + the update's name, its payload
#: ``{"id": ..., "args": [...]}``; its outcome a Marker ``update`` with the same id
UPDATE_SIGNAL = "tether.update:"
UPDATE_MARKER = "update"


#: the statuses a review (``Approval.status``) can have; ``deciding``: a decision is on
#: its way to the run
REVIEW_STATUSES = (
    "open",
    "deciding",
    "approved",
    "rejected",
    "expired_rejected",
    "expired_approved",
    "closed",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Approval:
    """A review opened by ``tether.approval`` (``app.approvals()``, ``app.get_approval()``)."""

    approval_id: str  #: ``run_id:step``; name it (and the fingerprint) to decide
    run_id: str
    workflow: str
    tenant: str | None
    name: str
    fingerprint: str  #: of the proposal under review
    proposal: Any  #: the proposal as JSON
    approvers: list[str]  #: who may decide now (anyone when empty)
    deadline_at: float  #: of the current level; then escalation or the default
    #: ``open``; ``deciding`` (a decision is on its way to the run: others are refused
    #: until it takes it, or refuses it and the review opens again); ``approved`` /
    #: ``rejected``; ``expired_rejected`` / ``expired_approved`` (the default at the last
    #: deadline); ``closed`` (the run ended undecided)
    status: str
    level: int  #: 0, then 1.. for each escalation
    allow_edit: bool
    decided_by: str | None
    decided_at: float | None
    reason: str | None
    reminded_at: float | None
    created_at: float

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Approval:
        """Build from the store's row: its columns, then the run's tenant, status, workflow."""
        status = row[7]
        if status in ("open", "deciding") and RunStatus(row[17]).is_terminal:
            status = "closed"
        return cls(
            approval_id=row[0],
            run_id=row[1],
            name=row[2],
            fingerprint=row[3],
            proposal=json.loads(row[4]),
            approvers=json.loads(row[5]),
            deadline_at=float(row[6]),
            status=status,
            level=int(row[8]),
            allow_edit=bool(row[9]),
            decided_by=row[10],
            decided_at=row[11],
            reason=row[12],
            reminded_at=row[13],
            created_at=float(row[14]),
            tenant=row[16],
            workflow=row[18],
        )


class RunStatus(enum.StrEnum):
    """Lifecycle of a run; values equal the strings stored in ``runs.status``."""

    QUEUED = "queued"  #: held back by its tenant's admission limit; starts as others finish
    PENDING = "pending"  #: accepted, no workflow task has completed yet
    RUNNING = "running"  #: in progress or waiting (timer, event, step)
    SUSPENDED = "suspended"  #: paused by an operator; resume continues it
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TERMINATED = "terminated"
    TIMED_OUT = "timed_out"  #: the run's deadline passed (its compensations ran)
    NEEDS_INTERVENTION = "needs_intervention"  #: a compensation failed: an operator must act
    CONTINUED_AS_NEW = "continued_as_new"  #: ended here, continued in ``continued_to``

    @property
    def is_terminal(self) -> bool:
        """Whether the run can change no more."""
        return self in _TERMINAL


_TERMINAL = frozenset(
    {
        RunStatus.COMPLETED,
        RunStatus.FAILED,
        RunStatus.CANCELLED,
        RunStatus.TERMINATED,
        RunStatus.TIMED_OUT,
        RunStatus.NEEDS_INTERVENTION,
        RunStatus.CONTINUED_AS_NEW,
    }
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """One history event."""

    run_id: str
    seq: int
    type: EventType
    step: int | None
    data: dict[str, Any]
    created_at: float

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Event:
        """Build from ``(run_id, seq, type, step, data, created_at)``."""
        return cls(
            run_id=row[0],
            seq=row[1],
            type=EventType(row[2]),
            step=row[3],
            data=json.loads(row[4]) if row[4] else {},
            created_at=row[5],
        )

    def to_json(self) -> dict[str, Any]:
        """A plain dict for export."""
        return {
            "seq": self.seq,
            "type": str(self.type),
            "step": self.step,
            "data": self.data,
            "created_at": self.created_at,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class RunInfo:
    """What the store knows about one run (``app.get`` returns this)."""

    run_id: str
    workflow: str
    status: RunStatus
    queue: str
    input: str
    output: str | None
    error: dict[str, Any] | None
    custom_status: Any
    parent_run_id: str | None
    continued_to: str | None
    task_error: str | None
    created_at: float
    updated_at: float
    completed_at: float | None
    tenant: str | None = None  #: ``app.start(tenant=)``: whose admission limit applies
    #: what a live run waits for, as of its last workflow task: ``{"kind": "signal",
    #: "name": ..., "until": ts | None}``, ``{"kind": "timer", "until": ts}``,
    #: ``{"kind": "activity", "name": ..., "step": n}``, ``{"kind": "child", "run_id":
    #: ..., "workflow": ...}``, or ``{"kind": "admission", "tenant": ...}`` while queued
    waiting_on: list[dict[str, Any]] | None = None
    #: what the run was started with: ``{"budget": ..., "pins": {"models": ...}}``
    attrs: dict[str, Any] | None = None
    #: fields whose stored value cannot be read, and why (a missing blob, a destroyed
    #: or absent key): in listings and pages they show as null (an error keeps its
    #: type) instead of failing the whole call. ``app.get`` raises instead
    unavailable: dict[str, str] | None = None

    @property
    def is_finished(self) -> bool:
        """Whether the run has reached a terminal status."""
        return self.status.is_terminal


@dataclass(frozen=True, kw_only=True, slots=True)
class RunEnd:
    """How a run ended, as the commit that ended it knows it.

    Stores hand this to their listeners with each finished run id, so a
    ``run.result()`` waiting in the same process needs no read of the run.
    """

    run_id: str
    workflow: str
    status: RunStatus
    output: str | None
    error: dict[str, Any] | None
    continued_to: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    """A leased unit of work: a workflow task, an activity attempt or a due timer."""

    task_id: int
    run_id: str
    kind: str
    step: int | None
    queue: str
    name: str | None
    payload: str | None
    options: dict[str, Any]
    fence: int
    attempt: int
    lease_expires_at: float
    heartbeat: str | None = None  #: last heartbeat details (JSON), for resuming work
    dependency: str | None = None  #: the ``tether.Dependency`` limiter it runs under
    #: set by the claim on the tasks of a batched activity leased together as one
    #: batch (the first task's id): the worker runs them in one call
    batch_id: int | None = None
    #: history after ``prefetched_after``, read in the transaction that leased this task
    prefetched: tuple[Event, ...] | None = None
    prefetched_after: int = 0
    #: the run's tenant, read with the task by the claim when the store seals per
    #: tenant (an activity's ``put_blob`` seals for it); ``tenant_known`` False: not
    #: read with it (the worker reads it before the attempt)
    tenant: str | None = None
    tenant_known: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class DeadLetter:
    """A step or run that exhausted its failure policy, kept for an operator."""

    id: int
    run_id: str
    step: int | None
    kind: str  #: "activity" or "run"
    name: str  #: activity or workflow name
    input: str | None
    error: dict[str, Any] | None
    attempts: int | None
    reason: str | None
    created_at: float
    resolved_at: float | None
    resolution: Any
    #: fields whose stored value cannot be read, and why (a missing blob, a destroyed
    #: or absent key): they show as null (an error keeps its type) instead of failing
    #: the listing; the letter can still be resolved (a replay is refused)
    unavailable: dict[str, str] | None = None

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> DeadLetter:
        """Build from a ``dead_letters`` row in column order."""
        return cls(
            id=row[0],
            run_id=row[1],
            step=row[2],
            kind=row[3],
            name=row[4],
            input=row[5],
            error=json.loads(row[6]) if row[6] else None,
            attempts=row[7],
            reason=row[8],
            created_at=row[9],
            resolved_at=row[10],
            resolution=json.loads(row[11]) if row[11] else None,
        )


def describe_waiting(waiting: list[dict[str, Any]] | None) -> str:
    """``RunInfo.waiting_on`` in a few words: ``signal 'review' until 12:00:00``."""

    def until(ts: float | None) -> str:
        if ts is None:
            return ""
        return " until " + _dt.datetime.fromtimestamp(ts, _dt.UTC).strftime("%Y-%m-%d %H:%M:%S")

    parts = []
    for w in waiting or []:
        kind = w.get("kind")
        if kind == "signal":
            parts.append(f"signal {w.get('name')!r}{until(w.get('until'))}")
        elif kind == "timer":
            parts.append(f"timer{until(w.get('until'))}")
        elif kind == "activity":
            parts.append(f"step {w.get('step')} {w.get('name')}")
        elif kind == "child":
            parts.append(f"child {w.get('run_id')}")
        elif kind == "admission":
            parts.append(f"a slot of tenant {w.get('tenant')!r}")
    return ", ".join(parts)
