"""The store interface every backend implements.

A store owns all durable state: runs, their append-only histories, and the
task queue. Every method that changes state is one atomic transaction; methods
that complete a leased task check its fence first and raise ``LeaseLostError``
(changing nothing) when the caller no longer holds the lease.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._codec import Codec
from .._history import DeadLetter, Event, EventType, RunEnd, RunInfo, RunStatus, Task
from .._queues import QueueStats
from .._schedules import ScheduleInfo, ScheduleSpec
from ..blobs import BlobStore


@dataclass(frozen=True, kw_only=True, slots=True)
class Command:
    """One thing workflow code asked for, recorded as a command event."""

    type: EventType
    step: int | None
    data: dict[str, Any] = field(default_factory=dict)
    #: payload fields already encoded as JSON text, embedded verbatim in the event
    raw: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkflowTaskResult:
    """What one workflow task produced: its commands and what it had seen."""

    commands: list[Command]
    through: int  #: last history seq the task had applied
    time: float  #: the workflow clock during the task (tether.now)
    version: str | None = None  #: the workflow code version that produced it
    #: whether the run may have started children (their parent-close policies then
    #: apply when it ends); False lets the store skip looking
    children: bool = True
    #: what the run waits for after this task (``RunInfo.waiting_on``); None: unknown
    waiting_on: list[dict[str, Any]] | None = None
    #: (tokens, cost) of the model calls whose answers this task met first: the store
    #: adds them to its run's tenant's ledger in the same commit (exactly once)
    usage: tuple[int, str] | None = None
    #: (scopes, tokens, cost, day) of work this task met first whose daily budgets' spend
    #: is added with its record (a batch's: a fetch retried after a crash is not paid
    #: again; and the estimate a submit of an older build held, given back on the day it
    #: was held): the store adds each to its scopes' spend of ``day`` (None: the task's)
    #: in the same commit
    spend: list[tuple[tuple[str, ...], int, str, str | None]] | None = None
    #: steps of the run whose provider batch's hold (``hold_model_spend``) this task
    #: replaces with what the batch used: the store gives back what each record still
    #: holds (nothing if it was given back already) and removes it, in the same commit
    holds: list[int] | None = None


#: what ``list_runs(waiting_for=)`` may name (optionally ``kind:name``: ``signal:review``)
WAITING_KINDS = ("signal", "timer", "activity", "child", "admission")

#: the marker ``complete_workflow_task`` returns for a result it did not apply: the
#: result would end the run while newer incoming events (a signal, a cancel...) wait,
#: so the task was released to run again with them
TASK_REJECTED = -1


#: runs a commit ended, each with how it ended; None when the listener must read the run
#: (another process's commit, or a run that no longer is finished: an operator's retry)
Finished = dict[str, RunEnd | None]
#: called after each commit with the queues that got ready work and the runs that ended
Listener = Callable[[set[str], Finished], None]
#: called after commits with the runs whose history grew (event streams follow these)
HistoryListener = Callable[[set[str]], None]
#: called with (run id, item) for each ephemeral item a run published (streamed tokens)
StreamListener = Callable[[str, dict[str, Any]], None]


def start_event_data(
    workflow: str,
    deadline_at: float | None,
    tenant: str | None = None,
    parent_run_id: str | None = None,
    attrs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The data of a run's ``WorkflowStarted`` event (without its input).

    Shared by the store that writes it and by eager start, which runs the first
    workflow task on this event before the store has written it. What the run's
    code may read of itself (``tether.info()``) is here, so it replays as recorded.
    """
    data: dict[str, Any] = {"workflow": workflow}
    if deadline_at is not None:
        data["deadline_at"] = deadline_at
    if tenant is not None:
        data["tenant"] = tenant
    if parent_run_id is not None:
        data["parent_run_id"] = parent_run_id
    if attrs:
        data["attrs"] = attrs  # e.g. a model budget (``app.start(budget=)``)
    return data


@dataclass(frozen=True, kw_only=True, slots=True)
class StartResult:
    """The outcome of ``create_run``."""

    run: RunInfo
    created: bool
    #: the run's first workflow task, when it was leased at once to ``lease_to``
    leased: Task | None = None
    #: with ``first``: the seq of the marker that recorded it (None: it was not applied)
    first_marker: int | None = None
    #: with ``first``: the activity tasks it scheduled that were leased to ``lease_to``
    first_leased: tuple[Task, ...] = ()
    #: with ``signal``: (the run it went to: the live run of a continued chain, its seq);
    #: with a ``signal_id`` that arrived before, where that first one went
    signalled: tuple[str, int] | None = None
    #: with ``signal_id``: False when a signal of that id had arrived (none recorded)
    signal_new: bool = True


class Store(abc.ABC):
    """Durable state behind an App. Methods are coroutines; each write is one commit."""

    #: seconds since the epoch; replaceable for tests with a virtual clock
    clock: Callable[[], float]
    #: where large payloads go by reference (``tether.blobs``); set by the App
    blobs: BlobStore | None = None
    #: seals payloads as they are written and opens them as they are read
    #: (``tether.encryption``); set by ``open_store`` or the App. None: plaintext
    codec: Codec | None = None

    @abc.abstractmethod
    async def create_run(
        self,
        *,
        run_id: str,
        workflow: str,
        queue: str,
        input: str,
        deadline_at: float | None = None,
        tenant: str | None = None,
        on_limit: str = "raise",
        lease_to: str | None = None,
        lease_queues: Sequence[str] = (),
        lease: float = 30.0,
        first: WorkflowTaskResult | None = None,
        lease_limit: int = 0,
        attrs: dict[str, Any] | None = None,
        if_exists: str = "same_input",
        signal: tuple[str, str] | None = None,
        signal_id: str | None = None,
    ) -> StartResult:
        """Create a run with its first workflow task, or return the existing identical one.

        ``if_exists``: ``same_input`` (the existing run if its workflow, input and tenant
        match, else ``RunIdConflictError``), ``return`` (the existing run whatever its
        input) or ``reject`` (``RunIdConflictError``); a run of another workflow or
        tenant is a ``RunIdConflictError`` whatever ``if_exists`` says. With ``signal``
        (name, encoded payload), the signal goes to the run in the same commit: to the
        existing run (its live run if it continued as new; ``RunFinishedError`` if it
        ended), or to the new one before its code first runs (signal-with-start); with
        ``signal_id`` too, only if no signal of that id arrived in the run's chain
        before (``signal``'s dedup: ``StartResult.signalled`` then names the first).

        With ``lease_to`` (an in-process worker serving the run's queue), the first
        workflow task is leased to it in the same commit and returned, saving a claim.
        With ``first`` as well (that worker already ran the first workflow task on
        the run's start event), its commands are recorded in the same commit instead,
        and up to ``lease_limit`` activities it schedules are leased to ``lease_to``.

        With ``deadline_at``, a deadline task fires ``DeadlineExceeded`` into the run then.
        With ``tenant``, the tenant's admission limit applies: at the limit the start
        raises ``AdmissionLimitError`` (``on_limit="raise"``) or creates the run
        ``queued`` (``on_limit="queue"``), admitted when a run of the tenant ends.
        """

    @abc.abstractmethod
    async def claim(
        self, *, worker_id: str, queues: Sequence[str], limit: int, lease: float
    ) -> list[Task]:
        """Lease up to ``limit`` ready tasks on ``queues``, oldest first."""

    @abc.abstractmethod
    async def read_history(self, run_id: str, after_seq: int = 0) -> list[Event]:
        """Events of a run with ``seq > after_seq``, in order."""

    @abc.abstractmethod
    async def complete_workflow_task(
        self,
        task: Task,
        result: WorkflowTaskResult,
        *,
        lease_to: str | None = None,
        lease_queues: Sequence[str] = (),
        lease: float = 30.0,
        lease_limit: int = 1_000_000,
    ) -> tuple[int, list[Task]]:
        """Record a workflow task's commands; return the marker seq and activity tasks
        leased at once to ``lease_to`` (up to ``lease_limit`` on ``lease_queues``)."""

    @abc.abstractmethod
    async def fail_workflow_task(self, task: Task, error: str, retry_at: float) -> None:
        """Release a workflow task that could not run (e.g. non-determinism) for a retry."""

    @abc.abstractmethod
    async def complete_activity(
        self,
        task: Task,
        result: str,
        *,
        lease_to: str | None = None,
        lease_queues: Sequence[str] = (),
        lease: float = 30.0,
        read_after: int | None = None,
    ) -> Task | None:
        """Record an activity's result; may return the run's workflow task leased to
        ``lease_to`` when it was created by this call (with the history after
        ``read_after`` attached, when given)."""

    @abc.abstractmethod
    async def fail_activity(
        self,
        task: Task,
        error: dict[str, Any],
        retry_at: float | None,
        *,
        lease_to: str | None = None,
        lease_queues: Sequence[str] = (),
        lease: float = 30.0,
        read_after: int | None = None,
    ) -> Task | None:
        """Schedule a retry at ``retry_at``, or record the final failure when it is None."""

    @abc.abstractmethod
    async def fire_timer(self, task: Task) -> None:
        """Record that a due timer fired."""

    @abc.abstractmethod
    async def renew(self, tasks: Sequence[Task], lease: float) -> dict[int, bool]:
        """Extend leases; return ``{task_id: cancel_requested}`` for tasks still held."""

    def hold_worker_id(self, worker_id: str) -> Callable[[], None]:
        """Hold ``worker_id`` for this process while it lives; return the release.

        Raises ``ConfigurationError`` when a live process holds it already (its tasks
        would otherwise be taken over and run twice). A crashed holder's hold ends
        with its process (or its database session), so its successor gets it at once.
        """
        return _no_release

    def check_worker_id(self, worker_id: str) -> bool:
        """Whether this process still holds ``worker_id`` (taken again if its hold
        ended while the process lives, as a database session can); False: another
        process holds it now. Called by the worker every few seconds, in a thread."""
        return True

    @abc.abstractmethod
    async def list_approvals(
        self,
        *,
        status: str | None = None,
        run_id: str | None = None,
        tenant: str | None = None,
        limit: int = 100,
    ) -> list[tuple[Any, ...]]:
        """Rows of reviews (``Approval.from_row``), oldest first; ``status="open"``: undecided
        reviews of live runs."""

    @abc.abstractmethod
    async def get_approval(self, approval_id: str) -> tuple[Any, ...] | None:
        """One review's row, or None."""

    @abc.abstractmethod
    async def deliver_decision(
        self, approval_id: str, payload: str, by: str, hold: bool
    ) -> tuple[str, str | None] | None:
        """Deliver a decision (the approval signal's payload) if the review is open, in
        one commit; ``hold`` also marks it ``deciding`` until the run takes or refuses
        it. None when delivered; else the (status, decided_by) that refused it."""

    @abc.abstractmethod
    async def ai_cache_get(self, key: str) -> str | None:
        """A cached model answer (tether.ai) still within its TTL, or None."""

    @abc.abstractmethod
    async def ai_cache_put(self, key: str, value: str, ttl: float) -> None:
        """Keep a model answer for ``ttl`` seconds under ``key``."""

    @abc.abstractmethod
    async def set_model_budget(self, scope: str, tokens: int | None, cost: str | None) -> None:
        """Set (or, with neither, remove) the daily model budget of a scope; today's
        spend of the scope becomes at least what the usage ledger recorded today for it."""

    @abc.abstractmethod
    async def model_budgets(self, day: str) -> list[tuple[Any, ...]]:
        """(scope, token limit, cost limit, tokens spent, cost spent) per budget on ``day``."""

    @abc.abstractmethod
    async def add_model_spend(
        self, scopes: tuple[str, ...], day: str, tokens: int, cost: str
    ) -> None:
        """Add one call's tokens and cost to each scope's spend of ``day``."""

    @abc.abstractmethod
    async def reserve_model_spend(
        self, scopes: tuple[str, ...], day: str, tokens: int, cost: str | None
    ) -> tuple[Any, ...] | None:
        """Add a call's estimate to each scope's spend of ``day`` unless it would pass one
        of their budgets (checked and added at once); else (scope, what, limit, tokens
        spent, cost spent) of the budget it would pass, nothing added."""

    @abc.abstractmethod
    async def hold_model_spend(
        self,
        run_id: str,
        step: int,
        holder: str,
        scopes: tuple[str, ...],
        day: str,
        tokens: int,
        cost: str | None,
        how: str = "check",
        task: Task | None = None,
    ) -> tuple[tuple[list[str], str, int, str] | None, tuple[Any, ...] | None]:
        """Hold a provider batch's estimate in each scope's spend of ``day`` for its
        submit step (``run_id``, ``step``) and attempt ``holder``, recorded by the step
        in the same transaction; or reuse (take over) the hold an earlier attempt of the
        step left. ``how``: ``"check"`` (as ``reserve_model_spend``), ``"add"``
        (unchecked) or ``"noted"`` (already counted: only recorded). Returns ((scopes,
        day, tokens, cost) held or None, the budget it would pass or None). ``task``:
        the attempt's (a worker's), whose lease is checked in the same transaction
        (``LeaseLostError``: a later attempt has the step, nothing held);
        ``RunNotFoundError`` when the run is gone."""

    @abc.abstractmethod
    async def release_model_hold(
        self, run_id: str, step: int, holder: str, task: Task | None = None
    ) -> bool:
        """Give back what the submit step (``run_id``, ``step``) holds for its attempt
        ``holder`` (nothing once a later attempt took it over), its record removed with
        it; whether it held anything. ``task``: as for ``hold_model_spend`` (an attempt
        that lost it gives nothing back: ``LeaseLostError``)."""

    @abc.abstractmethod
    async def create_api_key(
        self, key_id: str, secret_hash: str, name: str | None, tenant: str | None, role: str
    ) -> None:
        """Record an API key of the HTTP service (only a hash of its secret)."""

    @abc.abstractmethod
    async def api_key(self, key_id: str) -> tuple[Any, ...] | None:
        """(key_id, secret_hash, name, tenant, role, created_at, revoked_at) or None."""

    @abc.abstractmethod
    async def list_api_keys(self) -> list[tuple[Any, ...]]:
        """Every API key (revoked ones too), oldest first."""

    @abc.abstractmethod
    async def revoke_api_key(self, key_id: str) -> bool:
        """Revoke a key; False when it does not exist or was revoked already."""

    @abc.abstractmethod
    async def has_api_keys(self) -> bool:
        """Whether any key is live (then the HTTP service requires one)."""

    @abc.abstractmethod
    async def claim_webhooks(self, limit: int, lease: float) -> list[tuple[Any, ...]]:
        """Lease up to ``limit`` due webhook deliveries for ``lease`` seconds: each row
        ends with None, or why its payload cannot be read (that delivery's failure)."""

    @abc.abstractmethod
    async def finish_webhook(
        self, delivery_id: int, ok: bool, error: str | None, retry_at: float | None
    ) -> None:
        """Mark a delivery delivered (``ok``), due again at ``retry_at``, or given up."""

    @abc.abstractmethod
    async def webhook_deliveries(
        self, *, run_id: str | None = None, state: str | None = None, limit: int = 100
    ) -> list[tuple[Any, ...]]:
        """Webhook deliveries, newest first."""

    @abc.abstractmethod
    async def blob_refs(
        self,
        tenant: str | None = None,
        *,
        other_than: str | None = None,
        run_ids: Sequence[str] | None = None,
    ) -> set[str]:
        """Every blob reference the store's payloads hold (for ``gc_blobs``), or those of
        ``tenant``'s runs, or those of all but ``other_than``'s runs, or the rows of the
        runs ``run_ids`` (``tether store check`` names the runs of a missing blob)."""

    @abc.abstractmethod
    async def open_counts(self) -> dict[str, int]:
        """Open dead letters and reviews, webhook deliveries pending and given up."""

    @abc.abstractmethod
    async def run_counts(self, tenant: str | None = None) -> list[tuple[str, str, int]]:
        """(workflow, status, runs) of every pair that has runs."""

    @abc.abstractmethod
    async def fold_run_counts(self) -> None:
        """Fold the run counters' appended changes (workers do it now and then)."""

    @abc.abstractmethod
    async def usage_on(self, day: str, tenant: str | None = None) -> list[tuple[str, int, str]]:
        """(tenant, tokens, cost) of the model calls recorded on ``day`` (YYYY-MM-DD, UTC)
        per tenant ('' for runs without one), or of one ``tenant``: exact, once per call."""

    @abc.abstractmethod
    async def run_outcomes(
        self, since: float, bucket: float, tenant: str | None = None
    ) -> list[tuple[int, str, int]]:
        """(bucket number, status, runs) of runs that ended since ``since``."""

    @abc.abstractmethod
    async def spend_on(self, day: str) -> list[tuple[str, int, str]]:
        """(scope, tokens, cost) of model spend recorded on ``day`` (YYYY-MM-DD, UTC)."""

    @abc.abstractmethod
    async def set_switch(
        self, kind: str, name: str, off: bool, by: str | None, reason: str | None
    ) -> bool:
        """Turn ``kind``/``name`` off or back on; True when that changed anything."""

    @abc.abstractmethod
    async def purge(
        self,
        cutoff: float,
        *,
        workflow: str | None = None,
        tenant: str | None = None,
        limit: int = 500,
        dry_run: bool = False,
        reason: str = "retention",
        spare_from: float | None = None,
    ) -> tuple[dict[str, int], set[str]]:
        """Remove up to ``limit`` runs that ended before ``cutoff`` (one transaction):
        rows removed per table, and the blobs the removed runs referred to (with
        ``spare_from``, recorded as pending deletions in the same transaction)."""

    @abc.abstractmethod
    async def erase_tenant_batch(
        self,
        tenant: str,
        *,
        limit: int = 500,
        dry_run: bool = False,
        spare_from: float | None = None,
    ) -> tuple[dict[str, int], set[str]]:
        """Remove up to ``limit`` runs of a tenant, then its own rows: counts per table,
        and the blobs the removed runs referred to (``spare_from``: as ``purge``)."""

    @abc.abstractmethod
    async def blob_deletions(self) -> dict[str, float]:
        """Blob deletions a purge or erasure recorded and has not carried out yet: each
        ref, and the time from which a write of the blob spares it."""

    @abc.abstractmethod
    async def forget_blob_deletions(self, refs: Sequence[str]) -> None:
        """Remove these refs from the pending blob deletions."""

    @abc.abstractmethod
    async def purged_run(self, run_id: str) -> tuple[str, float] | None:
        """(why, when) if the run was purged."""

    @abc.abstractmethod
    async def reseal_batch(
        self, table: str, after: list[Any] | None, limit: int
    ) -> tuple[int, list[Any] | None]:
        """Seal up to ``limit`` rows' payloads of ``table`` (after key ``after``) under the
        current keys; (values rewritten, the key to go on after, None when done)."""

    @abc.abstractmethod
    async def configure_retention(self, tenant: str, seconds: float | None) -> None:
        """Keep the tenant's ended runs ``seconds`` (None: until purged by hand)."""

    @abc.abstractmethod
    async def tenant_retentions(self) -> dict[str, float]:
        """Every tenant with a retention, and its seconds."""

    @abc.abstractmethod
    async def workflow_names(self, limit: int = 1000) -> list[str]:
        """The names of the workflows the store has runs of, sorted (at most ``limit``)."""

    @abc.abstractmethod
    async def seal_keys(self) -> dict[str, str]:
        """The fingerprint of each key id payloads were sealed under in this store
        (``Sealer.fingerprint``; ``tether keyring list --store`` and ``tether store
        check`` compare a keyring's keys with them)."""

    @abc.abstractmethod
    async def orphans(self) -> dict[str, int]:
        """Rows naming a run (or schedule) the store does not have, per table."""

    @abc.abstractmethod
    async def put_schedule(
        self,
        schedule_id: str,
        workflow: str,
        queue: str,
        input: str,
        spec: ScheduleSpec,
        *,
        paused: bool = False,
        note: str | None = None,
    ) -> tuple[ScheduleInfo, bool]:
        """Create or change a schedule; (it, whether anything changed)."""

    @abc.abstractmethod
    async def get_schedule(self, schedule_id: str) -> ScheduleInfo:
        """One schedule (ScheduleNotFoundError if none)."""

    @abc.abstractmethod
    async def list_schedules(self, limit: int = 1000) -> list[ScheduleInfo]:
        """Schedules by id."""

    @abc.abstractmethod
    async def pause_schedule(self, schedule_id: str, paused: bool, note: str | None) -> bool:
        """Pause or resume; True if it changed."""

    @abc.abstractmethod
    async def delete_schedule(self, schedule_id: str) -> None:
        """Delete a schedule (its runs stay)."""

    @abc.abstractmethod
    async def trigger_schedule(self, schedule_id: str) -> str:
        """Start the schedule's run now; its run id."""

    @abc.abstractmethod
    async def switches(self) -> list[tuple[Any, ...]]:
        """(kind, name, by, reason, created_at) of every switch that is off."""

    @abc.abstractmethod
    async def audit(
        self, actor: str, action: str, target: str, detail: dict[str, Any] | None = None
    ) -> None:
        """Record who did what to which target."""

    @abc.abstractmethod
    async def audit_log(
        self, *, target: str | None = None, limit: int = 100
    ) -> list[tuple[Any, ...]]:
        """(id, at, actor, action, target, detail) entries, newest first."""

    @abc.abstractmethod
    async def untold_interventions(
        self, ended_before: float, limit: int = 20
    ) -> list[tuple[str, float]]:
        """(run id, completed_at) of runs that ended ``needs_intervention`` before
        ``ended_before`` whose operator was not told since (no ``alerted`` audit entry
        on ``run:<id>`` from then on), oldest end first."""

    @abc.abstractmethod
    async def leases(self, worker_id: str) -> dict[int, tuple[int, float, bool]]:
        """The unexpired leases of ``worker_id``: task id -> (fence, expiry, whether only
        heartbeats extend it). A restarted worker reads its predecessor's at start."""

    @abc.abstractmethod
    async def reclaim(
        self, worker_id: str, seen: Mapping[int, tuple[int, float, bool]]
    ) -> int | None:
        """Make claimable now the leases ``seen`` (read by ``leases`` a few seconds
        earlier) that are still ``worker_id``'s, unless any was renewed meanwhile (its
        holder lives: a hold on the id proves no more than that its session ended);
        return how many, None when they are left to expire. Leases that only
        heartbeats extend are never taken back (nothing renews them on a schedule, so
        nothing tells whether their holder lives): they are left to their heartbeat
        timeouts, and the others decide (None when there are no others)."""

    @abc.abstractmethod
    async def give_back(
        self, worker_id: str, run_id: str, keep: Sequence[int] = (), *, since: float
    ) -> int:
        """Make claimable now the tasks of ``run_id`` that a commit made at or after
        ``since`` (store clock) leased to ``worker_id`` and no one claimed since, except
        those in ``keep`` (task ids the worker is running); return how many. A worker
        that could not tell whether a commit leasing it the run's next tasks landed
        gives them back instead of letting them wait out their leases; tasks the id
        holds from claims are left alone."""

    @abc.abstractmethod
    async def release(
        self,
        tasks: Sequence[Task],
        delay: float = 0.0,
        *,
        unstarted: bool = False,
        note: str | None = None,
    ) -> int:
        """Give back leased tasks (a worker stopping, or one that does not serve a run's
        version) so any worker can claim them after ``delay`` seconds, and return how
        many were still held (the others' fences moved or their rows are gone: taken
        over, or a commit of them landed, perhaps one whose answer was lost); ``unstarted``
        ones never ran (or a stopping worker interrupted them), so the attempt their
        claim counted is taken back. A ``note`` becomes the ``task_error`` of each
        task's live run that has none (why its step waits); the run's next completed
        workflow task clears it."""

    @abc.abstractmethod
    async def heartbeat(self, task: Task, lease: float, details: str | None) -> bool:
        """Extend one activity's lease and record progress; return whether it was cancelled."""

    @abc.abstractmethod
    async def signal(
        self, run_id: str, name: str, payload: str, signal_id: str | None = None
    ) -> tuple[str, int, bool]:
        """Append a signal to the run's history (its live run if it continued as new);
        durable when this returns. (The run it went to, the signal's seq there, True.)

        With a ``signal_id`` that already arrived in the run's continue-as-new chain,
        nothing is recorded, even if the run has ended since: (the run the first went
        to, its seq there, False). Concurrent sends of one id record it once."""

    @abc.abstractmethod
    async def signal_arrived(self, run_id: str, signal_id: str) -> tuple[str, int] | None:
        """Where the signal ``signal_id`` of the run's continue-as-new chain went (run
        id, seq), or None if none of that id arrived."""

    @abc.abstractmethod
    async def cancel(self, run_id: str, reason: str | None) -> None:
        """Ask the run to cancel; its code sees it at the next await."""

    @abc.abstractmethod
    async def terminate(self, run_id: str, reason: str | None) -> None:
        """End the run (and its running children) at once, running no more of its code."""

    @abc.abstractmethod
    async def suspend(self, run_id: str) -> None:
        """Stop dispatching the run's work until ``resume``."""

    @abc.abstractmethod
    async def resume(self, run_id: str) -> None:
        """Dispatch a suspended run's work again."""

    @abc.abstractmethod
    async def get_run(
        self, run_id: str, *, follow: bool = False, lenient: bool = False
    ) -> RunInfo | None:
        """One run, or None. A payload it cannot read raises; ``lenient``: that field is
        null and named in ``RunInfo.unavailable``."""

    async def run_status(self, run_id: str) -> RunStatus | None:
        """A run's status (None: no such run), without reading its payloads: what a
        ``result()`` waiting on another process's run polls (cheap, and nothing to open)."""
        info = await self.get_run(run_id, lenient=True)
        return info.status if info is not None else None

    async def run_tenant(self, run_id: str) -> str | None:
        """A run's tenant (None: none, or no such run), without reading its payloads."""
        info = await self.get_run(run_id, lenient=True)
        return info.tenant if info is not None else None

    @abc.abstractmethod
    async def list_runs(
        self,
        *,
        status: RunStatus | None = None,
        workflow: str | None = None,
        limit: int = 100,
        offset: int = 0,
        waiting_for: str | None = None,
        before: tuple[float, str] | None = None,
        tenant: str | None = None,
        since: float | None = None,
        error_type: str | None = None,
        search: str | None = None,
        stuck: bool = False,
    ) -> list[RunInfo]:
        """Runs, newest first, optionally filtered (``waiting_for``: see ``App.list``);
        ``before`` is the (created_at, run_id) of the last run of the previous page;
        ``since`` keeps runs created at or after it; ``error_type`` runs whose error (or
        its cause) has that type; ``search`` runs whose id contains it; ``stuck`` live
        runs with a ``task_error``."""

    @abc.abstractmethod
    async def next_due(
        self, queues: Sequence[str], *, exclude_owner: str | None = None
    ) -> float | None:
        """The earliest ``available_at`` among tasks on ``queues``, or None; with
        ``exclude_owner``, tasks leased to that worker are left out (a test clock
        must not jump past a lease its own live worker holds)."""

    @abc.abstractmethod
    async def claim_with_wake(
        self, *, worker_id: str, queues: Sequence[str], limit: int, lease: float
    ) -> tuple[list[Task], float | None]:
        """``claim``, plus the earliest time a queue held back by its rate limit or a
        pause can let more work through (None when no queue was held back that way)."""

    @abc.abstractmethod
    async def configure_queue(self, queue: str, limits: dict[str, Any]) -> None:
        """Create or update a queue's limits (``QueueLimits.to_json``), keeping its
        live token bucket and pause."""

    @abc.abstractmethod
    async def pause_queue(self, queue: str, until: float | None) -> None:
        """Stop claims from ``queue`` until ``until`` (None: resume now)."""

    @abc.abstractmethod
    async def queue_stats(self) -> list[QueueStats]:
        """Depth, age, running work, pause and tokens of every queue in use."""

    async def configure_admission(self, tenant: str, max_running: int | None) -> None:
        """Set the admission limit of ``tenant`` ('' for every tenant without its own)."""
        raise NotImplementedError(f"{type(self).__name__} has no admission limits")

    async def debounce(
        self,
        *,
        key: str,
        run_id: str,
        workflow: str,
        queue: str,
        input: str,
        window: float,
        max_wait: float | None,
    ) -> tuple[str, int, float]:
        """Record a debounced start; returns (run id, triggers so far, due time)."""
        raise NotImplementedError(f"{type(self).__name__} has no debounce")

    async def dependency_feedback(self, task: Task, pause: float) -> float | None:
        """Pause the dependency limiter of ``task`` for ``pause`` seconds (None: none)."""
        return None

    @abc.abstractmethod
    async def breaker_admit(self, cfg: dict[str, Any]) -> float | None:
        """Ask the named breaker for a call: None to go ahead, or seconds to wait."""

    @abc.abstractmethod
    async def breaker_record(self, cfg: dict[str, Any], ok: bool) -> bool:
        """Report a call's outcome to the named breaker (may open or close it; True when
        this outcome opened it)."""

    @abc.abstractmethod
    async def dead_letters(
        self,
        *,
        include_resolved: bool = False,
        run_id: str | None = None,
        limit: int = 100,
        letter_id: int | None = None,
        tenant: str | None = None,
    ) -> list[DeadLetter]:
        """Dead letters, oldest first (open ones only unless ``include_resolved``);
        ``letter_id`` picks one, ``tenant`` keeps those of that tenant's runs."""

    @abc.abstractmethod
    async def claim_dead_letter(self, letter_id: int, claim: str) -> DeadLetter:
        """Mark an open dead letter as being replayed under the token ``claim`` (exactly
        one caller wins); a claim not renewed for ``CLAIM_TTL`` seconds (its process
        died mid-replay) counts as open and is taken over."""

    @abc.abstractmethod
    async def renew_dead_letter_claim(self, letter_id: int, claim: str) -> None:
        """Keep a replay's claim fresh while its step runs (no-op if no longer held)."""

    @abc.abstractmethod
    async def resolve_dead_letter(
        self, letter_id: int, resolution: Any, claim: str | None = None
    ) -> None:
        """Record how a claimed letter was resolved; ``None`` reopens it. With ``claim``,
        only while that claim still holds the letter."""

    @abc.abstractmethod
    async def close_dead_letter(
        self, letter_id: int, resolution: Any, actor: str, detail: dict[str, Any]
    ) -> DeadLetter:
        """Resolve an open letter and write its audit entry (``resolve dead letter`` by
        ``actor``) in one transaction; a letter not open is refused (``RecoveryError``)."""

    @abc.abstractmethod
    async def retry_run(self, run_id: str, letter_id: int | None = None) -> None:
        """Void a failed run's failure and what followed it, and continue it; mark the
        letters whose work runs again retried. With ``letter_id`` (replaying it), in the
        same transaction: refused unless that letter is open and one of them."""

    @abc.abstractmethod
    async def complete_step(
        self, run_id: str, step: int, result: str, actor: str, reason: str
    ) -> dict[str, Any]:
        """Record ``result`` (encoded JSON) as an operator's outcome of activity step
        ``step``, with its audit entry (``complete step`` by ``actor``), in one
        transaction; a failed run whose failed step it is is reopened. A step that
        completed, runs now, or cannot take it is refused (``RecoveryError``)."""

    @abc.abstractmethod
    async def fork_run(
        self, run_id: str, new_run_id: str, at_step: int, attrs: dict[str, Any] | None = None
    ) -> None:
        """Copy a run's history up to its outcome of step ``at_step`` into a new run."""

    @abc.abstractmethod
    def add_listener(self, callback: Listener) -> None:
        """Call ``callback(ready_queues, finished)`` after commits (any thread)."""

    @abc.abstractmethod
    def remove_listener(self, callback: Listener) -> None:
        """Stop calling ``callback``."""

    #: set by each backend's constructor (the registries below are shared code)
    _history_listeners: list[HistoryListener]
    _stream_listeners: list[StreamListener]

    def add_history_listener(self, callback: HistoryListener) -> None:
        """Call ``callback(run_ids)`` after commits that appended to those runs' histories
        (any thread; on PostgreSQL, other processes' commits too)."""
        self._history_listeners.append(callback)

    def remove_history_listener(self, callback: HistoryListener) -> None:
        """Stop calling ``callback``."""
        if callback in self._history_listeners:
            self._history_listeners.remove(callback)

    def _history_grew(self, runs: set[str]) -> None:
        """Tell the history listeners which runs' histories grew."""
        for callback in list(self._history_listeners):
            callback(runs)

    @abc.abstractmethod
    async def publish(self, run_id: str, item: dict[str, Any]) -> None:
        """Hand an ephemeral item of ``run_id`` (a streamed model delta) to the stream
        listeners: in this process, and on PostgreSQL in every process. Never stored:
        a listener that is not there misses it (the final answer is in history)."""

    def add_stream_listener(self, callback: StreamListener) -> None:
        """Call ``callback(run_id, item)`` for published items (any thread)."""
        self._stream_listeners.append(callback)

    def remove_stream_listener(self, callback: StreamListener) -> None:
        """Stop calling ``callback``."""
        if callback in self._stream_listeners:
            self._stream_listeners.remove(callback)

    def _hand_out(self, run_id: str, item: dict[str, Any]) -> None:
        """Give a published item to this process's stream listeners."""
        for callback in list(self._stream_listeners):
            callback(run_id, item)

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections and threads."""

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: commits, operations (for benchmarks)."""


def _no_release() -> None:
    """Nothing was held."""


def worker_id_in_use(worker_id: str) -> str:
    """The message for a worker id that a live process holds."""
    return (
        f"worker id {worker_id!r} is in use by a live worker process on this store; "
        "two processes with one id would take over each other's tasks and run them "
        "twice: stop the other process first, or give this one another --id"
    )
