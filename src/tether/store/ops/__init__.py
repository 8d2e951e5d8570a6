"""Store operations by concern, written once for every SQL backend.

Each operation is a function run inside the caller's transaction (``_tx._Tx``);
backends differ only in how they run them (SQLite: one writer thread with group
commit; PostgreSQL: pipelined writer connections) and in the dialect details
``_Tx`` carries. ``OpsStore`` (here) gives every ``Store`` method its operation.

Operations call across concerns (a run's end admits the tenant's next queued run,
a cancel of a queued run ends it), so the modules import each other's functions
at their end, after their own definitions: any import order then works.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._history import DeadLetter, Event, RunInfo, RunStatus, Task
from ..._queues import QueueStats
from ..._schedules import ScheduleInfo, ScheduleSpec
from ..base import StartResult, Store, WorkflowTaskResult
from ._tx import Op


@dataclass
class OpsStore(Store):
    """A Store whose methods run the shared operations through ``_do``."""

    @abc.abstractmethod
    async def _do(self, fn: Op, *args: Any, write: bool = True) -> Any:
        """Run ``fn(tx, *args)`` in a transaction and return its result."""

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
        result: StartResult = await self._do(
            _create_run,
            run_id,
            workflow,
            queue,
            input,
            deadline_at,
            tenant,
            on_limit,
            lease_to,
            tuple(lease_queues),
            lease,
            first,
            lease_limit,
            attrs,
            if_exists,
            signal,
            signal_id,
        )
        return result

    async def configure_admission(self, tenant: str, max_running: int | None) -> None:
        await self._do(_configure_admission, tenant, max_running)

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
        out: tuple[str, int, float] = await self._do(
            _debounce, key, run_id, workflow, queue, input, window, max_wait
        )
        return out

    async def dependency_feedback(self, task: Task, pause: float) -> float | None:
        out: float | None = await self._do(_dependency_feedback, task.task_id, None, pause)
        return out

    async def claim(
        self, *, worker_id: str, queues: Sequence[str], limit: int, lease: float
    ) -> list[Task]:
        tasks: list[Task] = await self._do(_claim, worker_id, tuple(queues), limit, lease)
        return tasks

    async def read_history(self, run_id: str, after_seq: int = 0) -> list[Event]:
        events: list[Event] = await self._do(_read_history, run_id, after_seq, write=False)
        return events

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
        out: tuple[int, list[Task]] = await self._do(
            _complete_workflow_task, task, result, lease_to, tuple(lease_queues), lease, lease_limit
        )
        return out

    async def fail_workflow_task(self, task: Task, error: str, retry_at: float) -> None:
        await self._do(_fail_workflow_task, task, error, retry_at)

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
        out: Task | None = await self._do(
            _with_history,
            _complete_activity,
            read_after,
            task,
            result,
            lease_to,
            tuple(lease_queues),
            lease,
        )
        return out

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
        out: Task | None = await self._do(
            _with_history,
            _fail_activity,
            read_after,
            task,
            error,
            retry_at,
            lease_to,
            tuple(lease_queues),
            lease,
        )
        return out

    async def complete_activity_fast(
        self,
        task: Task,
        result: str,
        workflow_result: WorkflowTaskResult,
        expected_seq: int,
        *,
        lease_to: str,
        lease_queues: Sequence[str],
        lease: float,
        lease_limit: int,
    ) -> tuple[bool, int, list[Task], Task | None]:
        out: tuple[bool, int, list[Task], Task | None] = await self._do(
            _complete_activity_fast,
            task,
            result,
            workflow_result,
            expected_seq,
            lease_to,
            tuple(lease_queues),
            lease,
            lease_limit,
        )
        return out

    async def fire_timer(self, task: Task) -> None:
        await self._do(_fire_timer, task)

    async def renew(self, tasks: Sequence[Task], lease: float) -> dict[int, bool]:
        out: dict[int, bool] = await self._do(_renew, tuple(tasks), lease)
        return out

    async def heartbeat(self, task: Task, lease: float, details: str | None) -> bool:
        out: bool = await self._do(_heartbeat, task, lease, details)
        return out

    async def signal(
        self, run_id: str, name: str, payload: str, signal_id: str | None = None
    ) -> tuple[str, int, bool]:
        got: tuple[str, int, bool] = await self._do(_signal, run_id, name, payload, signal_id)
        return got

    async def signal_arrived(self, run_id: str, signal_id: str) -> tuple[str, int] | None:
        got: tuple[str, int] | None = await self._do(
            _signal_arrived, run_id, signal_id, write=False
        )
        return got

    async def cancel(self, run_id: str, reason: str | None) -> None:
        await self._do(_cancel, run_id, reason)

    async def terminate(self, run_id: str, reason: str | None) -> None:
        await self._do(_terminate, run_id, reason)

    async def suspend(self, run_id: str) -> None:
        await self._do(_suspend, run_id)

    async def resume(self, run_id: str) -> None:
        await self._do(_resume, run_id)

    async def get_run(
        self, run_id: str, *, follow: bool = False, lenient: bool = False
    ) -> RunInfo | None:
        out: RunInfo | None = await self._do(_get_run, run_id, follow, lenient, write=False)
        return out

    async def run_status(self, run_id: str) -> RunStatus | None:
        out: RunStatus | None = await self._do(_run_status, run_id, write=False)
        return out

    async def run_tenant(self, run_id: str) -> str | None:
        out: str | None = await self._do(_run_tenant, run_id, write=False)
        return out

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
        out: list[RunInfo] = await self._do(
            _list_runs,
            status,
            workflow,
            limit,
            offset,
            waiting_for,
            before,
            tenant,
            since,
            error_type,
            search,
            stuck,
            write=False,
        )
        return out

    async def claim_webhooks(self, limit: int, lease: float) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = await self._do(_claim_webhooks, limit, lease)
        return out

    async def finish_webhook(
        self, delivery_id: int, ok: bool, error: str | None, retry_at: float | None
    ) -> None:
        await self._do(_finish_webhook, delivery_id, ok, error, retry_at)

    async def webhook_deliveries(
        self, *, run_id: str | None = None, state: str | None = None, limit: int = 100
    ) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = await self._do(
            _webhook_deliveries, run_id, state, limit, write=False
        )
        return out

    async def blob_refs(
        self,
        tenant: str | None = None,
        *,
        other_than: str | None = None,
        run_ids: Sequence[str] | None = None,
    ) -> set[str]:
        ids = None if run_ids is None else list(run_ids)
        refs: set[str] = await self._do(_blob_refs, tenant, ids, other_than, write=False)
        return refs

    async def open_counts(self) -> dict[str, int]:
        counts: dict[str, int] = await self._do(_open_counts, write=False)
        return counts

    async def run_counts(self, tenant: str | None = None) -> list[tuple[str, str, int]]:
        out: list[tuple[str, str, int]] = await self._do(_run_counts, tenant)
        return out

    async def fold_run_counts(self) -> None:
        await self._do(_fold_run_counts)

    async def usage_on(self, day: str, tenant: str | None = None) -> list[tuple[str, int, str]]:
        out: list[tuple[str, int, str]] = await self._do(_usage_on, day, tenant)
        return out

    async def run_outcomes(
        self, since: float, bucket: float, tenant: str | None = None
    ) -> list[tuple[int, str, int]]:
        out: list[tuple[int, str, int]] = await self._do(
            _run_outcomes, since, bucket, tenant, write=False
        )
        return out

    async def spend_on(self, day: str) -> list[tuple[str, int, str]]:
        out: list[tuple[str, int, str]] = await self._do(_spend_on, day, write=False)
        return out

    async def set_switch(
        self, kind: str, name: str, off: bool, by: str | None, reason: str | None
    ) -> bool:
        out: bool = await self._do(_set_switch, kind, name, off, by, reason)
        return out

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
        got: tuple[dict[str, int], set[str]] = await self._do(
            _purge_batch,
            cutoff,
            workflow,
            tenant,
            limit,
            dry_run,
            reason,
            spare_from,
            write=not dry_run,
        )
        return got

    async def erase_tenant_batch(
        self,
        tenant: str,
        *,
        limit: int = 500,
        dry_run: bool = False,
        spare_from: float | None = None,
    ) -> tuple[dict[str, int], set[str]]:
        got: tuple[dict[str, int], set[str]] = await self._do(
            _erase_tenant_batch, tenant, limit, dry_run, spare_from, write=not dry_run
        )
        return got

    async def blob_deletions(self) -> dict[str, float]:
        got: dict[str, float] = await self._do(_blob_deletions, write=False)
        return got

    async def forget_blob_deletions(self, refs: Sequence[str]) -> None:
        if refs:
            await self._do(_forget_blob_deletions, list(refs))

    async def reseal_batch(
        self, table: str, after: list[Any] | None, limit: int
    ) -> tuple[int, list[Any] | None]:
        got: tuple[int, list[Any] | None] = await self._do(_reseal_batch, table, after, limit)
        return got

    async def configure_retention(self, tenant: str, seconds: float | None) -> None:
        await self._do(_configure_retention, tenant, seconds)

    async def tenant_retentions(self) -> dict[str, float]:
        got: dict[str, float] = await self._do(_tenant_retentions, write=False)
        return got

    async def purged_run(self, run_id: str) -> tuple[str, float] | None:
        got: tuple[str, float] | None = await self._do(_purged_run, run_id, write=False)
        return got

    async def workflow_names(self, limit: int = 1000) -> list[str]:
        got: list[str] = await self._do(_workflow_names, limit, write=False)
        return got

    async def seal_keys(self) -> dict[str, str]:
        keys: dict[str, str] = await self._do(_seal_keys, write=False)
        return keys

    async def orphans(self) -> dict[str, int]:
        counts: dict[str, int] = await self._do(_orphans, write=False)
        return counts

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
        result: tuple[ScheduleInfo, bool] = await self._do(
            _put_schedule, schedule_id, workflow, queue, input, spec, None, paused, note
        )
        return result

    async def get_schedule(self, schedule_id: str) -> ScheduleInfo:
        info: ScheduleInfo = await self._do(_get_schedule, schedule_id, write=False)
        return info

    async def list_schedules(self, limit: int = 1000) -> list[ScheduleInfo]:
        infos: list[ScheduleInfo] = await self._do(_list_schedules, limit, write=False)
        return infos

    async def pause_schedule(self, schedule_id: str, paused: bool, note: str | None) -> bool:
        changed: bool = await self._do(_pause_schedule, schedule_id, paused, note)
        return changed

    async def delete_schedule(self, schedule_id: str) -> None:
        await self._do(_delete_schedule, schedule_id)

    async def trigger_schedule(self, schedule_id: str) -> str:
        run_id: str = await self._do(_trigger_schedule, schedule_id)
        return run_id

    async def switches(self) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = await self._do(_switches, write=False)
        return out

    async def audit(
        self, actor: str, action: str, target: str, detail: dict[str, Any] | None = None
    ) -> None:
        await self._do(_audit, actor, action, target, detail)

    async def audit_log(
        self, *, target: str | None = None, limit: int = 100
    ) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = await self._do(_audit_log, target, limit, write=False)
        return out

    async def untold_interventions(
        self, ended_before: float, limit: int = 20
    ) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = await self._do(
            _untold_interventions, ended_before, limit, write=False
        )
        return out

    async def leases(self, worker_id: str) -> dict[int, tuple[int, float, bool]]:
        out: dict[int, tuple[int, float, bool]] = await self._do(_leases, worker_id, write=False)
        return out

    async def reclaim(
        self, worker_id: str, seen: Mapping[int, tuple[int, float, bool]]
    ) -> int | None:
        out: int | None = await self._do(_reclaim, worker_id, dict(seen))
        return out

    async def give_back(
        self, worker_id: str, run_id: str, keep: Sequence[int] = (), *, since: float
    ) -> int:
        n: int = await self._do(_give_back, worker_id, run_id, tuple(keep), since)
        return n

    async def foreign_leases(
        self, queues: Sequence[str], worker_id: str
    ) -> tuple[int, float | None]:
        """How many tasks of ``queues`` other worker ids hold, and when the last lease
        ends (for ``tether worker``'s hint about work waiting for leases to expire)."""
        out: tuple[int, float | None] = await self._do(
            _foreign_leases, tuple(queues), worker_id, write=False
        )
        return out

    async def release(
        self,
        tasks: Sequence[Task],
        delay: float = 0.0,
        *,
        unstarted: bool = False,
        note: str | None = None,
    ) -> int:
        held: int = await self._do(_release, tuple(tasks), delay, unstarted, note)
        return held

    async def breaker_admit(self, cfg: dict[str, Any]) -> float | None:
        out: float | None = await self._do(_breaker_admit, cfg)
        return out

    async def breaker_record(self, cfg: dict[str, Any], ok: bool) -> bool:
        opened: bool = await self._do(_breaker_record, cfg, ok)
        return opened

    async def list_approvals(
        self,
        *,
        status: str | None = None,
        run_id: str | None = None,
        tenant: str | None = None,
        limit: int = 100,
    ) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = await self._do(
            _list_approvals, status, run_id, tenant, limit, write=False
        )
        return out

    async def get_approval(self, approval_id: str) -> tuple[Any, ...] | None:
        out: tuple[Any, ...] | None = await self._do(_get_approval, approval_id, write=False)
        return out

    async def deliver_decision(
        self, approval_id: str, payload: str, by: str, hold: bool
    ) -> tuple[str, str | None] | None:
        out: tuple[str, str | None] | None = await self._do(
            _deliver_decision, approval_id, payload, by, hold
        )
        return out

    async def ai_cache_get(self, key: str) -> str | None:
        out: str | None = await self._do(_cache_get, key, write=False)
        return out

    async def ai_cache_put(self, key: str, value: str, ttl: float) -> None:
        await self._do(_cache_put, key, value, ttl)

    async def set_model_budget(self, scope: str, tokens: int | None, cost: str | None) -> None:
        await self._do(_set_model_budget, scope, tokens, cost)

    async def model_budgets(self, day: str) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = await self._do(_model_budgets, day, write=False)
        return out

    async def add_model_spend(
        self, scopes: tuple[str, ...], day: str, tokens: int, cost: str
    ) -> None:
        await self._do(_add_spend, scopes, day, tokens, cost)

    async def reserve_model_spend(
        self, scopes: tuple[str, ...], day: str, tokens: int, cost: str | None
    ) -> tuple[Any, ...] | None:
        out: tuple[Any, ...] | None = await self._do(_reserve_spend, scopes, day, tokens, cost)
        return out

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
        out: tuple[Any, Any] = await self._do(
            _hold_spend, run_id, step, holder, tuple(scopes), day, tokens, cost, how, task
        )
        return out

    async def release_model_hold(
        self, run_id: str, step: int, holder: str, task: Task | None = None
    ) -> bool:
        out: bool = await self._do(_release_hold, run_id, step, holder, task)
        return out

    async def create_api_key(
        self, key_id: str, secret_hash: str, name: str | None, tenant: str | None, role: str
    ) -> None:
        await self._do(_create_api_key, key_id, secret_hash, name, tenant, role)

    async def api_key(self, key_id: str) -> tuple[Any, ...] | None:
        out: tuple[Any, ...] | None = await self._do(_api_key, key_id, write=False)
        return out

    async def list_api_keys(self) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = await self._do(_list_api_keys, write=False)
        return out

    async def revoke_api_key(self, key_id: str) -> bool:
        return bool(await self._do(_revoke_api_key, key_id))

    async def has_api_keys(self) -> bool:
        return bool(await self._do(_has_api_keys, write=False))

    async def dead_letters(
        self,
        *,
        include_resolved: bool = False,
        run_id: str | None = None,
        limit: int = 100,
        letter_id: int | None = None,
        tenant: str | None = None,
    ) -> list[DeadLetter]:
        out: list[DeadLetter] = await self._do(
            _dead_letters, include_resolved, run_id, limit, letter_id, tenant, write=False
        )
        return out

    async def claim_dead_letter(self, letter_id: int, claim: str) -> DeadLetter:
        out: DeadLetter = await self._do(_claim_dead_letter, letter_id, claim)
        return out

    async def renew_dead_letter_claim(self, letter_id: int, claim: str) -> None:
        await self._do(_renew_dead_letter_claim, letter_id, claim)

    async def resolve_dead_letter(
        self, letter_id: int, resolution: Any, claim: str | None = None
    ) -> None:
        await self._do(_resolve_dead_letter, letter_id, resolution, claim)

    async def close_dead_letter(
        self, letter_id: int, resolution: Any, actor: str, detail: dict[str, Any]
    ) -> DeadLetter:
        out: DeadLetter = await self._do(_close_dead_letter, letter_id, resolution, actor, detail)
        return out

    async def retry_run(self, run_id: str, letter_id: int | None = None) -> None:
        await self._do(_retry_run, run_id, letter_id)

    async def complete_step(
        self, run_id: str, step: int, result: str, actor: str, reason: str
    ) -> dict[str, Any]:
        out: dict[str, Any] = await self._do(_complete_step, run_id, step, result, actor, reason)
        return out

    async def fork_run(
        self, run_id: str, new_run_id: str, at_step: int, attrs: dict[str, Any] | None = None
    ) -> None:
        await self._do(_fork_run, run_id, new_run_id, at_step, attrs)

    async def next_due(
        self, queues: Sequence[str], *, exclude_owner: str | None = None
    ) -> float | None:
        out: float | None = await self._do(_next_due, tuple(queues), exclude_owner, write=False)
        return out

    async def claim_with_wake(
        self, *, worker_id: str, queues: Sequence[str], limit: int, lease: float
    ) -> tuple[list[Task], float | None]:
        out: tuple[list[Task], float | None] = await self._do(
            _claim_with_wake, worker_id, tuple(queues), limit, lease
        )
        return out

    async def configure_queue(self, queue: str, limits: dict[str, Any]) -> None:
        await self._do(_configure_queue, queue, limits)

    async def pause_queue(self, queue: str, until: float | None) -> None:
        await self._do(_pause_queue, queue, until)

    async def queue_stats(self) -> list[QueueStats]:
        out: list[QueueStats] = await self._do(_queue_stats, write=False)
        return out


# operations of other concerns (imported last: see the package docstring)
from .activities import _complete_activity, _complete_activity_fast, _fail_activity, _with_history  # noqa: E402
from .admission import _configure_admission  # noqa: E402
from .ai import (  # noqa: E402
    _add_spend,
    _cache_get,
    _cache_put,
    _hold_spend,
    _model_budgets,
    _release_hold,
    _reserve_spend,
    _set_model_budget,
)
from .approvals import _deliver_decision, _get_approval, _list_approvals  # noqa: E402
from .breakers import _breaker_admit, _breaker_record  # noqa: E402
from .claims import _claim, _claim_with_wake  # noqa: E402
from .control import (  # noqa: E402
    _cancel,
    _resume,
    _signal,
    _signal_arrived,
    _suspend,
    _terminate,
)
from .debounce import _debounce  # noqa: E402
from .dependencies import _dependency_feedback  # noqa: E402
from .history import _read_history  # noqa: E402
from .keys import (  # noqa: E402
    _api_key,
    _create_api_key,
    _has_api_keys,
    _list_api_keys,
    _revoke_api_key,
)
from .overview import (  # noqa: E402
    _blob_refs,
    _fold_run_counts,
    _open_counts,
    _run_counts,
    _run_outcomes,
    _spend_on,
    _usage_on,
)
from .queues import _configure_queue, _pause_queue, _queue_stats  # noqa: E402
from .recovery import (  # noqa: E402
    _claim_dead_letter,
    _close_dead_letter,
    _complete_step,
    _dead_letters,
    _fork_run,
    _renew_dead_letter_claim,
    _resolve_dead_letter,
    _retry_run,
)
from .reseal import _reseal_batch, _seal_keys  # noqa: E402
from .retention import (  # noqa: E402
    _blob_deletions,
    _configure_retention,
    _erase_tenant_batch,
    _forget_blob_deletions,
    _orphans,
    _purge_batch,
    _purged_run,
    _tenant_retentions,
    _workflow_names,
)
from .runs import _create_run, _get_run, _list_runs, _run_status, _run_tenant  # noqa: E402
from .schedules import (  # noqa: E402
    _delete_schedule,
    _get_schedule,
    _list_schedules,
    _pause_schedule,
    _put_schedule,
    _trigger_schedule,
)
from .switches import (  # noqa: E402
    _audit,
    _audit_log,
    _set_switch,
    _switches,
    _untold_interventions,
)
from .tasks import (  # noqa: E402
    _foreign_leases,
    _give_back,
    _heartbeat,
    _leases,
    _next_due,
    _reclaim,
    _release,
    _renew,
)
from .timers import _fire_timer  # noqa: E402
from .webhooks import _claim_webhooks, _finish_webhook, _webhook_deliveries  # noqa: E402
from .workflow_tasks import _complete_workflow_task, _fail_workflow_task  # noqa: E402
