"""tether: durable workflows for AI pipelines.

Write the pipeline as ordinary async Python; tether records every step's
outcome in an append-only history so a run survives crashes and restarts and
never repeats a finished step.
"""

from __future__ import annotations

from ._activity_context import ActivityContext, NotInActivityError, activity_context
from ._app import App, Run
from ._definitions import Activity, ActivityOptions, Workflow
from ._errors import (
    ActivityError,
    ChildWorkflowError,
    ConfigurationError,
    LeaseLostError,
    NonDeterminismError,
    NonRetryable,
    PayloadError,
    ResultTimeoutError,
    RunCancelledError,
    RunFinishedError,
    RunIdConflictError,
    RunNotFoundError,
    RunTerminatedError,
    StoreError,
    TetherError,
    UnknownActivityError,
    UnknownWorkflowError,
    WorkflowFailedError,
)
from ._history import Event, EventType, RunInfo, RunStatus
from ._policy import Retry
from ._worker import Worker
from .workflow._api import (
    NotInWorkflowError,
    continue_as_new,
    first,
    gather,
    in_workflow,
    is_replaying,
    logger,
    now,
    random,
    set_status,
    sleep,
    uuid,
    wait_event,
)
from .workflow._loop import WorkflowSandboxError

__version__ = "0.1.0"

__all__ = [
    "Activity",
    "ActivityContext",
    "ActivityError",
    "ActivityOptions",
    "App",
    "ChildWorkflowError",
    "ConfigurationError",
    "Event",
    "EventType",
    "LeaseLostError",
    "NonDeterminismError",
    "NonRetryable",
    "NotInActivityError",
    "NotInWorkflowError",
    "PayloadError",
    "ResultTimeoutError",
    "Retry",
    "Run",
    "RunCancelledError",
    "RunFinishedError",
    "RunIdConflictError",
    "RunInfo",
    "RunNotFoundError",
    "RunStatus",
    "RunTerminatedError",
    "StoreError",
    "TetherError",
    "UnknownActivityError",
    "UnknownWorkflowError",
    "Worker",
    "Workflow",
    "WorkflowFailedError",
    "WorkflowSandboxError",
    "__version__",
    "activity_context",
    "continue_as_new",
    "first",
    "gather",
    "in_workflow",
    "is_replaying",
    "logger",
    "now",
    "random",
    "set_status",
    "sleep",
    "uuid",
    "wait_event",
]
