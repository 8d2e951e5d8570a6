"""tether: durable workflows for AI pipelines.

Write the pipeline as ordinary async Python; tether records every step's
outcome in an append-only history so a run survives crashes and restarts and
never repeats a finished step.
"""

from __future__ import annotations

from ._activity_context import ActivityContext, NotInActivityError, activity_context
from ._app import App, Run
from ._batch import BatchActivity
from ._batching import Batch
from ._blob_api import put_blob, read_blob
from ._breaker import CircuitBreaker, CircuitOpenError
from ._classify import RetryAfter, Verdict, classify
from ._definitions import Activity, ActivityOptions, Workflow
from ._errors import (
    ActivityError,
    AdmissionLimitError,
    ApprovalEditError,
    ApprovalError,
    ApprovalNotFoundError,
    ChildWorkflowError,
    ConfigurationError,
    DeadLetterNotFoundError,
    LeaseLostError,
    NonDeterminismError,
    NonRetryable,
    PayloadError,
    QueryError,
    ResultTimeoutError,
    RunCancelledError,
    RunFinishedError,
    RunIdConflictError,
    RunNeedsInterventionError,
    RunNotFoundError,
    RunPurgedError,
    RunTerminatedError,
    RunTimedOutError,
    ScheduleNotFoundError,
    SignalIdConflictError,
    StoreError,
    SwitchedOffError,
    TetherError,
    UnknownActivityError,
    UnknownWorkflowError,
    UpdateFailedError,
    UpdateRejectedError,
    WorkflowFailedError,
)
from ._history import Approval, DeadLetter, Event, EventType, RunEnd, RunInfo, RunStatus
from ._policy import Retry
from ._queues import Dependency, QueueStats
from ._schedules import ScheduleInfo, ScheduleSpec
from ._sync import SyncClient, SyncRun
from ._usage import Budget, Usage
from ._worker import Worker
from .blobs import Blob, BlobError
from .encryption import KeyringMismatchError, KeyUnavailableError
from .store.ops.recovery import RecoveryError
from .workflow._api import (
    ItemOutcome,
    NotInWorkflowError,
    WorkflowInfo,
    continue_as_new,
    deprecate_patch,
    first,
    gather,
    idempotency_key,
    in_workflow,
    info,
    is_replaying,
    logger,
    map,
    now,
    on_query,
    on_update,
    patched,
    random,
    set_progress,
    set_status,
    sleep,
    uuid,
    wait_event,
)
from .workflow._approval import Decision, approval
from .workflow._loop import WorkflowSandboxError
from .workflow._route import route
from .workflow._saga import CompensationFailed, Saga, saga

__version__ = "0.1.0"

__all__ = [
    "AdmissionLimitError",
    "Dependency",
    "Activity",
    "ActivityContext",
    "ActivityError",
    "ActivityOptions",
    "App",
    "Approval",
    "ApprovalEditError",
    "ApprovalError",
    "ApprovalNotFoundError",
    "Batch",
    "BatchActivity",
    "Budget",
    "ChildWorkflowError",
    "CircuitBreaker",
    "CircuitOpenError",
    "CompensationFailed",
    "ConfigurationError",
    "DeadLetter",
    "Decision",
    "Event",
    "EventType",
    "ItemOutcome",
    "KeyUnavailableError",
    "KeyringMismatchError",
    "LeaseLostError",
    "NonDeterminismError",
    "NonRetryable",
    "NotInActivityError",
    "NotInWorkflowError",
    "PayloadError",
    "QueueStats",
    "RecoveryError",
    "ResultTimeoutError",
    "Retry",
    "RetryAfter",
    "Run",
    "RunCancelledError",
    "RunEnd",
    "RunFinishedError",
    "RunIdConflictError",
    "RunInfo",
    "RunNeedsInterventionError",
    "RunNotFoundError",
    "DeadLetterNotFoundError",
    "ScheduleInfo",
    "Blob",
    "BlobError",
    "put_blob",
    "read_blob",
    "RunPurgedError",
    "QueryError",
    "UpdateFailedError",
    "UpdateRejectedError",
    "on_query",
    "on_update",
    "ScheduleNotFoundError",
    "ScheduleSpec",
    "SignalIdConflictError",
    "SwitchedOffError",
    "RunStatus",
    "RunTerminatedError",
    "RunTimedOutError",
    "Saga",
    "SyncClient",
    "SyncRun",
    "StoreError",
    "TetherError",
    "UnknownActivityError",
    "UnknownWorkflowError",
    "Usage",
    "Verdict",
    "Worker",
    "Workflow",
    "WorkflowFailedError",
    "WorkflowInfo",
    "WorkflowSandboxError",
    "__version__",
    "activity_context",
    "approval",
    "classify",
    "continue_as_new",
    "deprecate_patch",
    "first",
    "gather",
    "idempotency_key",
    "in_workflow",
    "info",
    "is_replaying",
    "logger",
    "map",
    "now",
    "patched",
    "random",
    "route",
    "saga",
    "set_progress",
    "set_status",
    "sleep",
    "uuid",
    "wait_event",
]
