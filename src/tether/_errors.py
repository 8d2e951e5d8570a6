"""Every exception tether raises, under one base class.

Users catch these by name; each carries the data an operator needs (run id,
step, what was expected) and says what to do next.

    TetherError
    ├── ConfigurationError        bad decorator options, bad store URL
    ├── PayloadError              a value cannot be encoded or decoded
    │   └── KeyUnavailableError   a sealed payload's key is missing (tether.encryption)
    ├── UnknownWorkflowError      no workflow registered under that name
    ├── RunNotFoundError          no run with that id
    ├── RunIdConflictError        run id already used with other input
    ├── RunFinishedError          signal/cancel sent to a finished run
    ├── StoreError                the store cannot be opened or written
    │   └── LeaseLostError        a fenced write lost its lease (stale worker)
    ├── NonDeterminismError       replayed code diverged from history
    ├── ActivityError             an activity failed for good (inside workflows)
    ├── ChildWorkflowError        a child run did not complete
    ├── WorkflowFailedError       awaiting the result of a failed run
    │   ├── RunCancelledError     ... of a cancelled run
    │   ├── RunTerminatedError    ... of a terminated run
    │   ├── RunTimedOutError      ... of a run whose deadline passed
    │   └── RunNeedsInterventionError ... of a run whose compensation failed
    ├── CompensationFailed        a saga undo failed (workflow code sees it)
    ├── RecoveryError             retry/fork/replay not possible in this state
    └── ResultTimeoutError        run.result(timeout=) gave up waiting
    NonRetryable                  raise from an activity to fail at once
    RetryAfter                    raise from an activity to retry after N seconds
"""

from __future__ import annotations

import datetime
from typing import Any


class TetherError(Exception):
    """Base class of every error tether raises."""


class ConfigurationError(TetherError, ValueError):
    """An option, policy or store URL is invalid."""


class SignalIdConflictError(ConfigurationError):
    """A signal or update id that already arrived in the run (its continue-as-new
    chain) with another request: as the other kind (a signal id sent with an update, or
    the other way: signal ids and update ids are one namespace per run), with another
    name, or with another payload or arguments (``differs``). An id is one request: a
    retry sends the same one. Nothing was recorded."""

    def __init__(
        self, run_id: str, given_id: str, arrived: str, sent: str, differs: str = ""
    ) -> None:
        self.run_id = run_id
        self.id = given_id
        #: what the id arrived as, and what it was sent with now ("signal 'x'", "update 'y'")
        self.arrived, self.sent = arrived, sent
        #: what differs when the id arrived as the same kind: "name", "payload" or
        #: "arguments"; "" when it arrived as the other kind
        self.differs = differs
        head = f"id {given_id!r} already arrived in run {run_id!r} as the {arrived}"
        if not differs:
            super().__init__(
                f"{head}, so it cannot be the id of the {sent} (signal ids and update ids "
                "are one namespace per run): use another id"
            )
            return
        what = f", not the {sent}" if differs == "name" else f" with other {differs}"
        if differs == "payload":
            what = " with another payload"
        super().__init__(
            f"{head}{what}: an id is one request, and a retry sends the same one; use "
            "another id for another request"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.id, self.arrived, self.sent, self.differs))


class PayloadError(TetherError, TypeError):
    """A value could not be serialised to, or decoded from, the store."""


class UnknownWorkflowError(TetherError, LookupError):
    """No workflow is registered under the given name."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = known
        hint = ", ".join(sorted(known)) or "none"
        super().__init__(
            f"no workflow named {name!r} is registered with this App "
            f"(registered: {hint}); decorate it with @app.workflow and import its module "
            "in the worker"
        )


class UnknownActivityError(TetherError, LookupError):
    """No activity is registered under the given name."""


class DeadLetterNotFoundError(TetherError, LookupError):
    """No dead letter has this id."""

    def __init__(self, letter_id: int) -> None:
        super().__init__(
            f"no dead letter {letter_id}; list them with app.dead_letters() or GET /v1/dead-letters"
        )
        self.letter_id = letter_id


#: how a ``QueryError`` begins for a run whose code has not run yet (nothing to replay)
NOT_RUN_YET = "its code has not run yet"


class QueryError(TetherError):
    """A query could not be answered: no such handler in the run, or it failed."""

    def __init__(self, run_id: str, name: str, problem: str) -> None:
        super().__init__(f"query {name!r} of run {run_id!r}: {problem}")
        self.run_id, self.name, self.problem = run_id, name, problem

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.name, self.problem))


class UpdateRejectedError(TetherError):
    """An update was refused (unknown, or its validator raised): nothing was applied."""

    def __init__(self, run_id: str, name: str, problem: str) -> None:
        super().__init__(f"update {name!r} of run {run_id!r} refused: {problem}")
        self.run_id, self.name, self.problem = run_id, name, problem

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.name, self.problem))


class UpdateFailedError(TetherError):
    """An accepted update's handler raised; ``error_type`` and the message say what."""

    def __init__(self, run_id: str, name: str, error_type: str, message: str) -> None:
        super().__init__(f"update {name!r} of run {run_id!r} failed: {error_type}: {message}")
        self.run_id, self.name, self.error_type, self.message = run_id, name, error_type, message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.name, self.error_type, self.message))


class ScheduleNotFoundError(TetherError, LookupError):
    """No schedule has this id."""

    def __init__(self, schedule_id: str) -> None:
        super().__init__(
            f"no schedule {schedule_id!r}; list them with app.schedules() or tether schedules list"
        )
        self.schedule_id = schedule_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.schedule_id,))


class SwitchedOffError(TetherError):
    """A kill switch is off for what was asked (a tenant's new runs)."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__(
            f"{kind} {name!r} is switched off by an operator: no new work of it starts until "
            f"it is switched on again (tether switch on {kind} {name})"
        )
        self.kind, self.name = kind, name


class RunNotFoundError(TetherError, LookupError):
    """No run exists with the given id."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"no run with id {run_id!r} exists in this store")


class RunPurgedError(RunNotFoundError):
    """The run existed and was removed (retention or tenant erasure)."""

    def __init__(self, run_id: str, reason: str = "retention", purged_at: float = 0.0) -> None:
        super().__init__(run_id)
        self.reason, self.purged_at = reason, purged_at
        when = datetime.datetime.fromtimestamp(purged_at, datetime.UTC).isoformat(
            timespec="seconds"
        )
        self.args = (f"run {run_id!r} was purged at {when} ({reason}): its data is gone",)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.reason, self.purged_at))


class RunIdConflictError(TetherError):
    """A run id is already in use by a run with different input or workflow."""

    def __init__(self, run_id: str, detail: str, *, fields: tuple[str, ...] = ()) -> None:
        self.run_id = run_id
        #: what the start asked for differently (``input``, ``budget``, ``deadline``,
        #: ``webhook``), when that is the conflict; their values are not repeated
        self.fields = fields
        super().__init__(
            f"run id {run_id!r} is already used by a run with {detail}; starting with the same "
            "run id is idempotent only for the same workflow, input, deadline, webhook and "
            "budget: pick a new run id, or fetch the existing run (app.get_run(run_id), "
            "tether get RUN_ID, GET /v1/runs/{id})"
        )


class AdmissionLimitError(TetherError):
    """``app.start(..., tenant=, on_limit="raise")`` found the tenant at its admission limit."""

    def __init__(self, tenant: str, limit: int, running: int) -> None:
        self.tenant = tenant
        self.limit = limit
        self.running = running
        super().__init__(
            f"tenant {tenant!r} already has {running} run(s) in flight, at its admission limit "
            f"of {limit} (app.configure_admission); no run was created: retry later, or start "
            'with on_limit="queue" to queue the run until one of the tenant\'s runs finishes'
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.tenant, self.limit, self.running))


class RunFinishedError(TetherError):
    """The run has already finished, so it can no longer take signals or requests."""

    def __init__(self, run_id: str, status: str, action: str) -> None:
        self.run_id = run_id
        self.status = status
        super().__init__(
            f"cannot {action} run {run_id!r}: it has already finished with status {status!r}"
        )


class ApprovalError(TetherError):
    """A decision could not be taken: the review is unknown, closed, or not the one named."""

    def __init__(self, approval_id: str, message: str) -> None:
        self.approval_id = approval_id
        super().__init__(f"approval {approval_id!r}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.approval_id, str(self).split(": ", 1)[1]))


class ApprovalNotFoundError(ApprovalError):
    """No review has that id (ids look like ``run-id:step``)."""


class ApprovalEditError(ApprovalError):
    """``App.decide`` refused an edit at once, recording nothing: it is not of the shape
    the review takes (a deferred tool call's edit is ``{"tool": <that tool>, "args":
    {...}}``); the review stays open."""


class StoreError(TetherError):
    """The store could not be opened, read or written; stored runs are untouched."""

    #: set when the store cannot be opened and waiting will not mend it (a database or
    #: role the server does not have, a wrong password, a malformed URL): why and what
    #: to do, without the store's URL (a caller may be shown it)
    permanent: str | None = None


class LeaseLostError(StoreError):
    """A worker tried to commit work for a task whose lease it no longer holds."""


class NonDeterminismError(TetherError):
    """Replayed workflow code issued a different command than the one recorded."""

    def __init__(self, run_id: str, step: int, expected: str, produced: str) -> None:
        self.run_id = run_id
        self.step = step
        self.expected = expected
        self.produced = produced
        if expected.startswith("PatchMarker(") and not expected.startswith("PatchMarker('tether."):
            how = (
                "the code no longer calls tether.patched at this point for a patch this run "
                "recorded: keep the call while such runs are in flight (once the old branch "
                "is gone, tether.deprecate_patch with the same id)"
            )
        else:
            how = (
                "deploy code that makes the same calls, with the same arguments, for runs "
                "in flight (guard a change with tether.patched)"
            )
        super().__init__(
            f"non-deterministic workflow code in run {run_id!r} at step {step}: history "
            f"recorded {expected}, but the code now produced {produced}. The run is left as "
            f"it was and will be retried: {how} and it will continue. A run that should "
            "not continue can be ended (tether terminate), or forked from the step before "
            f"(app.fork({run_id!r}, at_step={max(step - 1, 0)})) to run today's code from there"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.step, self.expected, self.produced))


class ActivityError(TetherError):
    """An activity failed after its retry policy gave up (raised inside workflows)."""

    def __init__(self, activity: str, error_type: str, message: str, attempts: int) -> None:
        self.activity = activity
        self.error_type = error_type
        self.message = message
        self.attempts = attempts
        super().__init__(
            f"activity {activity!r} failed after {attempts} attempt(s): {error_type}: {message}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.activity, self.error_type, self.message, self.attempts))


class ChildWorkflowError(TetherError):
    """A child run ended without completing (failed, cancelled or terminated)."""

    def __init__(self, run_id: str, status: str, error: str | None) -> None:
        self.run_id = run_id
        self.status = status
        self.error = error
        super().__init__(f"child run {run_id!r} ended {status}: {error}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.status, self.error))


class WorkflowFailedError(TetherError):
    """The run ended without a result; ``error`` holds the recorded reason."""

    def __init__(self, run_id: str, status: str, error: str | None) -> None:
        self.run_id = run_id
        self.status = status
        self.error = error
        super().__init__(f"run {run_id!r} ended {status}: {error}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.status, self.error))


class RunCancelledError(WorkflowFailedError):
    """The run was cancelled."""


class RunTerminatedError(WorkflowFailedError):
    """The run was terminated."""


class RunTimedOutError(WorkflowFailedError):
    """The run's deadline passed; its compensations ran."""


class RunNeedsInterventionError(WorkflowFailedError):
    """A compensation failed; an operator must finish the rollback (then ``app.retry``)."""


class ResultTimeoutError(TetherError, TimeoutError):
    """The run did not finish within the time given to ``run.result``; it goes on."""


class NonRetryable(Exception):
    """Raise from an activity to fail the step at once, skipping remaining retries."""


class ContinueAsNew(BaseException):
    """Raised by ``tether.continue_as_new``; a BaseException so ``except Exception``
    in workflow code cannot swallow it (here, below the workflow side, so a saga block
    can tell it apart without importing the instance)."""

    def __init__(self, input_json: str) -> None:
        super().__init__("continue as new")
        self.input_json = input_json
