"""Store operations, written once for every SQL backend.

Each function is one logical operation run inside the caller's transaction
(``_Tx``); backends differ only in how they run them (SQLite: one writer thread
with group commit; PostgreSQL: pooled connections) and in a few dialect
details carried by ``_Tx`` (placeholder style, row locks, SKIP LOCKED).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._errors import (
    AdmissionLimitError,
    LeaseLostError,
    RunFinishedError,
    RunIdConflictError,
    RunNotFoundError,
    StoreError,
    TetherError,
)
from .._history import (
    COMMANDS,
    INCOMING,
    OUTCOMES,
    DeadLetter,
    Event,
    EventType,
    RunEnd,
    RunInfo,
    RunStatus,
    Task,
)
from .._queues import DEPENDENCY_PREFIX, QueueStats
from .._serde import dumps
from .base import (
    TASK_REJECTED,
    Command,
    StartResult,
    Store,
    WorkflowTaskResult,
    start_event_data,
)

_TERMINAL = tuple(s.value for s in RunStatus if s.is_terminal)
_RUN_COLS = (
    "run_id, workflow, status, queue, input, output, error, custom_status, parent_run_id, "
    "continued_to, task_error, created_at, updated_at, completed_at, tenant, waiting_on"
)
_TASK_COLS = (
    "task_id, run_id, kind, step, queue, name, payload, options, fence, attempt, available_at, "
    "heartbeat, dependency"
)

Op = Callable[..., Any]


@dataclass
class _Tx:
    """One operation's view of the open transaction, plus what to announce after commit."""

    conn: Any
    now: float
    paramstyle: str = "qmark"
    for_update: str = ""  #: " FOR UPDATE" where row locks exist
    skip_locked: str = ""  #: " FOR UPDATE SKIP LOCKED" where supported
    ready: set[str] = field(default_factory=set)
    #: runs this operation ended, with how they ended (None: changed, but look it up)
    finished: dict[str, RunEnd | None] = field(default_factory=dict)
    #: queues known to have limits or not, asked once per operation (the SQLite store
    #: shares one dict per batch: its write lock keeps other processes out meanwhile)
    limited: dict[str, bool] = field(default_factory=dict)
    #: queues seen with limits by this store (shared by its operations): treating a queue
    #: as limited is always safe (its work goes through the claim, which applies them)
    known_limited: set[str] = field(default_factory=set)
    #: the PostgreSQL fast path: skip a read whose answer is almost always the same and
    #: send a guard instead (``guard``), which fails the batch when the guess was wrong;
    #: the batch then runs again on the safe path, where every read is made
    optimistic: bool = False
    #: a fresh task id (optimistic mode): a task row inserted with it needs no RETURNING
    new_task_id: Callable[[], int] | None = None

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement; ``?`` placeholders are translated for the backend."""
        if self.paramstyle != "qmark":
            sql = sql.replace("?", "%s")
        return self.conn.execute(sql, params)

    def guard(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Send a statement that raises (division by zero) if an optimistic guess was
        wrong, without waiting for it: its error fails the batch before it commits."""
        self.conn.guard(sql.replace("?", "%s"), params)


def _json(data: dict[str, Any], raw: dict[str, str] | None = None) -> str:
    """JSON for an event's data, embedding already-encoded payloads verbatim."""
    text = dumps(data)
    if not raw:
        return text
    inner = ",".join(f"{_key_json(k)}:{v}" for k, v in raw.items())
    return text[:-1] + ("," if data else "") + inner + "}"


_KEYS: dict[str, str] = {}  #: the few payload keys, JSON-encoded once


def _key_json(key: str) -> str:
    known = _KEYS.get(key)
    if known is None:
        known = json.dumps(key)
        if len(_KEYS) < 64:
            _KEYS[key] = known
    return known


def _run_from_row(row: Sequence[Any]) -> RunInfo:
    return RunInfo(
        run_id=row[0],
        workflow=row[1],
        status=RunStatus(row[2]),
        queue=row[3],
        input=row[4],
        output=row[5],
        error=json.loads(row[6]) if row[6] else None,
        custom_status=json.loads(row[7]) if row[7] else None,
        parent_run_id=row[8],
        continued_to=row[9],
        task_error=row[10],
        created_at=row[11],
        updated_at=row[12],
        completed_at=row[13],
        tenant=row[14],
        waiting_on=(
            [{"kind": "admission", "tenant": row[14]}]
            if row[2] == "queued"
            else json.loads(row[15])
            if row[15]
            else None
        ),
    )


def _compact(value: Any) -> str:
    """JSON without spaces (``waiting_on`` is matched with LIKE patterns)."""
    return json.dumps(value, separators=(",", ":"))


#: an activity task's columns as ``_apply_workflow_result`` gives their values
_TASK_INSERT_NAMES = (
    "run_id",
    "step",
    "queue",
    "name",
    "payload",
    "options",
    "available_at",
    "lease_owner",
    "fence",
    "attempt",
    "heartbeat_timeout",
    "priority",
    "limit_key",
    "dependency",
    "batch_key",
    "batch_max",
    "batch_wait",
    "created_at",
)
_task_inserts: dict[tuple[tuple[bool, ...], bool, str], str] = {}


def _task_insert(values: Sequence[Any], with_id: bool, tail: str) -> tuple[str, list[Any]]:
    """An activity task's INSERT and its parameters, NULL columns left out.

    The sqlite3 module adapts a None parameter the slow way (an attribute lookup
    that fails and formats an error, per parameter): a column that stays NULL is
    simply not named. One statement per pattern of NULLs (a handful), cached.
    """
    mask = tuple(v is not None for v in values)
    key = (mask, with_id, tail)
    text = _task_inserts.get(key)
    if text is None:
        cols = [name for name, given in zip(_TASK_INSERT_NAMES, mask, strict=True) if given]
        names = (["task_id"] if with_id else []) + ["kind", *cols]
        marks = (["?"] if with_id else []) + ["'activity'"] + ["?"] * len(cols)
        text = f"INSERT INTO tasks ({', '.join(names)}) VALUES ({', '.join(marks)}){tail}"
        if len(_task_inserts) < 256:
            _task_inserts[key] = text
    return text, [v for v in values if v is not None]


def _new_activity_task(task_id: int, values: Sequence[Any], options: dict[str, Any]) -> Task:
    """The Task a leased activity row inserted with ``values`` is (no RETURNING read)."""
    return Task(
        task_id=task_id,
        run_id=values[0],
        kind="activity",
        step=values[1],
        queue=values[2],
        name=values[3],
        payload=values[4],
        options=options,
        fence=values[8],
        attempt=values[9],
        lease_expires_at=values[6],
        heartbeat=None,
        dependency=values[13],
    )


def _insert_activity_task(
    tx: _Tx, values: Sequence[Any], options: dict[str, Any], local: bool
) -> Task | None:
    """Insert an activity task row (``_TASK_INSERT_NAMES``); the Task if leased to us."""
    if tx.optimistic and tx.new_task_id is not None:
        # nothing to wait for: the id is ours already and the row is new (a conflicting
        # row fails the batch, and the safe path sees it below)
        if not local:
            tx.execute(*_task_insert(values, False, " ON CONFLICT DO NOTHING"))
            return None
        task_id = tx.new_task_id()
        text, params = _task_insert(values, True, "")
        tx.execute(text, [task_id, *params])
        return _new_activity_task(task_id, values, options)
    text, params = _task_insert(values, False, " ON CONFLICT DO NOTHING RETURNING task_id")
    row = tx.execute(text, params).fetchone()
    return _new_activity_task(row[0], values, options) if local and row is not None else None


def _task_from_row(row: Sequence[Any]) -> Task:
    return Task(
        task_id=row[0],
        run_id=row[1],
        kind=row[2],
        step=row[3],
        queue=row[4],
        name=row[5],
        payload=row[6],
        options=json.loads(row[7]) if row[7] else {},
        fence=row[8],
        attempt=row[9],
        lease_expires_at=row[10],
        heartbeat=row[11],
        dependency=row[12],
    )


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

    async def signal(self, run_id: str, name: str, payload: str) -> None:
        await self._do(_signal, run_id, name, payload)

    async def cancel(self, run_id: str, reason: str | None) -> None:
        await self._do(_cancel, run_id, reason)

    async def terminate(self, run_id: str, reason: str | None) -> None:
        await self._do(_terminate, run_id, reason)

    async def suspend(self, run_id: str) -> None:
        await self._do(_suspend, run_id)

    async def resume(self, run_id: str) -> None:
        await self._do(_resume, run_id)

    async def get_run(self, run_id: str, *, follow: bool = False) -> RunInfo | None:
        out: RunInfo | None = await self._do(_get_run, run_id, follow, write=False)
        return out

    async def list_runs(
        self,
        *,
        status: RunStatus | None = None,
        workflow: str | None = None,
        limit: int = 100,
        offset: int = 0,
        waiting_for: str | None = None,
    ) -> list[RunInfo]:
        out: list[RunInfo] = await self._do(
            _list_runs, status, workflow, limit, offset, waiting_for, write=False
        )
        return out

    async def reclaim(self, worker_id: str) -> int:
        out: int = await self._do(_reclaim, worker_id)
        return out

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
        self, tasks: Sequence[Task], delay: float = 0.0, *, unstarted: bool = False
    ) -> None:
        await self._do(_release, tuple(tasks), delay, unstarted)

    async def breaker_admit(self, cfg: dict[str, Any]) -> float | None:
        out: float | None = await self._do(_breaker_admit, cfg)
        return out

    async def breaker_record(self, cfg: dict[str, Any], ok: bool) -> None:
        await self._do(_breaker_record, cfg, ok)

    async def dead_letters(
        self, *, include_resolved: bool = False, run_id: str | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        out: list[DeadLetter] = await self._do(
            _dead_letters, include_resolved, run_id, limit, write=False
        )
        return out

    async def claim_dead_letter(self, letter_id: int) -> DeadLetter:
        out: DeadLetter = await self._do(_claim_dead_letter, letter_id)
        return out

    async def resolve_dead_letter(self, letter_id: int, resolution: Any) -> None:
        await self._do(_resolve_dead_letter, letter_id, resolution)

    async def retry_run(self, run_id: str) -> None:
        await self._do(_retry_run, run_id)

    async def fork_run(self, run_id: str, new_run_id: str, at_step: int) -> None:
        await self._do(_fork_run, run_id, new_run_id, at_step)

    async def next_due(self, queues: Sequence[str]) -> float | None:
        out: float | None = await self._do(_next_due, tuple(queues), write=False)
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


# -- operations (run inside a transaction, each in its own savepoint) --------


def _append(
    tx: _Tx,
    run_id: str,
    type_: EventType,
    step: int | None,
    data: dict[str, Any],
    raw: dict[str, str] | None = None,
) -> int:
    row = tx.execute(
        "UPDATE runs SET next_seq = next_seq + 1, updated_at = ? WHERE run_id = ? "
        "RETURNING next_seq - 1",
        (tx.now, run_id),
    ).fetchone()
    if row is None:
        raise RunNotFoundError(run_id)
    seq: int = row[0]
    tx.execute(
        "INSERT INTO events (run_id, seq, type, step, data, created_at) VALUES (?,?,?,?,?,?)",
        (run_id, seq, type_.value, step, _json(data, raw), tx.now),
    )
    return seq


#: an event waiting to be appended: (type, step, data, raw payloads)
_Pending = tuple[EventType, int | None, dict[str, Any], dict[str, str] | None]


def _insert_events(tx: _Tx, run_id: str, events: list[_Pending], first: int) -> int:
    """Insert ``events`` into one run's history from seq ``first``, in one INSERT.

    The caller read the run's counter under the write lock and writes the new one
    (the returned seq + 1) in an update of its own. Returns the seq of the last event.
    """
    params: list[Any] = []
    for i, (type_, step, data, raw) in enumerate(events):
        if step is None:  # NULL in the statement: a None parameter is slow to bind
            params += (run_id, first + i, type_.value, _json(data, raw), tx.now)
        else:
            params += (run_id, first + i, type_.value, step, _json(data, raw), tx.now)
    tx.execute(_events_insert(tuple(e[1] is None for e in events)), params)
    return first + len(events) - 1


_events_inserts: dict[tuple[bool, ...], str] = {}


def _events_insert(no_step: tuple[bool, ...]) -> str:
    """A multi-row INSERT of events, with NULL written for the rows without a step."""
    text = _events_inserts.get(no_step)
    if text is None:
        rows = ",".join("(?,?,?,NULL,?,?)" if none else "(?,?,?,?,?,?)" for none in no_step)
        text = f"INSERT INTO events (run_id, seq, type, step, data, created_at) VALUES {rows}"
        if len(_events_inserts) < 512:
            _events_inserts[no_step] = text
    return text


def _ensure_workflow_task(
    tx: _Tx,
    run_id: str,
    queue: str,
    workflow: str,
    lease_to: str | None = None,
    lease_queues: tuple[str, ...] = (),
    lease: float = 30.0,
) -> Task | None:
    """Make sure the run has a workflow task; return it if created and leased to us.

    The task is leased at once to ``lease_to`` when that worker serves the run's
    queue: it usually holds the run in its sticky cache, so it can continue it
    without another claim.
    """
    if lease_to is not None and queue in lease_queues:
        row = tx.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is not None and row[0] == RunStatus.SUSPENDED.value:
            lease_to = None  # a suspended run's work waits for resume, not for this worker
    if lease_to is None or queue not in lease_queues:
        tx.execute(
            "INSERT INTO tasks (run_id, kind, queue, name, available_at, created_at) "
            "VALUES (?, 'workflow', ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (run_id, queue, workflow, tx.now, tx.now),
        )
        tx.ready.add(queue)
        return None
    row = tx.execute(
        "INSERT INTO tasks (run_id, kind, queue, name, available_at, lease_owner, fence, "
        "created_at) VALUES (?, 'workflow', ?, ?, ?, ?, 1, ?) ON CONFLICT DO NOTHING "
        f"RETURNING {_TASK_COLS}",
        (run_id, queue, workflow, tx.now + lease, lease_to, tx.now),
    ).fetchone()
    return _task_from_row(row) if row else None


def _run_row(tx: _Tx, run_id: str) -> tuple[Any, ...]:
    """(status, queue, parent_run_id, parent_step, workflow, tenant) of a run."""
    row = tx.execute(
        "SELECT status, queue, parent_run_id, parent_step, workflow, tenant FROM runs "
        "WHERE run_id = ?",
        (run_id,),
    ).fetchone()
    if row is None:
        raise RunNotFoundError(run_id)
    return tuple(row)


def _check_fence(tx: _Tx, task: Task) -> None:
    row = tx.execute(
        f"SELECT fence FROM tasks WHERE task_id = ?{tx.for_update}", (task.task_id,)
    ).fetchone()
    if row is None or row[0] != task.fence:
        raise LeaseLostError(
            f"lease lost on {task.kind} task {task.task_id} of run {task.run_id!r}: another "
            "worker took it over or the run ended; this worker's result was discarded"
        )


def _insert_run(
    tx: _Tx,
    run_id: str,
    workflow: str,
    queue: str,
    input: str,
    parent_run_id: str | None = None,
    parent_step: int | None = None,
    deadline_at: float | None = None,
    tenant: str | None = None,
    queued: bool = False,
    lease_to: str | None = None,
    lease_queues: tuple[str, ...] = (),
    lease: float = 30.0,
    task: bool = True,
    start_event: bool = True,
) -> Task | None:
    """Insert a run and its start event; unless ``queued`` or not ``task``, its workflow task.

    Without ``start_event`` the caller appends the start event (``_start_event``) as seq 1,
    and the run is ``running`` at once: its first workflow task is recorded with it
    (eager start), so it never is ``pending``.
    """
    tx.execute(
        "INSERT INTO runs (run_id, workflow, status, queue, input, parent_run_id, parent_step, "
        "created_at, updated_at, tenant, next_seq) VALUES (?,?,?,?,?,?,?,?,?,?,2)",
        (
            run_id,
            workflow,
            "queued" if queued else ("pending" if start_event else "running"),
            queue,
            input,
            parent_run_id,
            parent_step,
            tx.now,
            tx.now,
            tenant,
        ),
    )
    if deadline_at is not None:
        # the deadline is a task like a timer: due at the deadline, deleted when the run ends
        tx.execute(
            "INSERT INTO tasks (run_id, kind, queue, available_at, created_at) "
            "VALUES (?, 'deadline', ?, ?, ?)",
            (run_id, queue, deadline_at, tx.now),
        )
    if start_event:
        # the start event is seq 1 (the row above already counts it): no counter round trip
        _, _, data, raw = _start_event(workflow, input, deadline_at, tenant, parent_run_id)
        tx.execute(
            "INSERT INTO events (run_id, seq, type, step, data, created_at) "
            "VALUES (?,1,?,NULL,?,?)",
            (run_id, EventType.WORKFLOW_STARTED.value, _json(data, raw), tx.now),
        )
    if queued or not task:  # a queued run gets its workflow task when admitted (_promote)
        return None
    return _ensure_workflow_task(tx, run_id, queue, workflow, lease_to, lease_queues, lease)


def _start_event(
    workflow: str,
    input: str,
    deadline_at: float | None,
    tenant: str | None = None,
    parent_run_id: str | None = None,
) -> _Pending:
    """A run's ``WorkflowStarted`` event, to append as its seq 1."""
    data = start_event_data(workflow, deadline_at, tenant, parent_run_id)
    return (EventType.WORKFLOW_STARTED, None, data, {"input": input})


def _create_run(
    tx: _Tx,
    run_id: str,
    workflow: str,
    queue: str,
    input: str,
    deadline_at: float | None,
    tenant: str | None = None,
    on_limit: str = "raise",
    lease_to: str | None = None,
    lease_queues: tuple[str, ...] = (),
    lease: float = 30.0,
    first: WorkflowTaskResult | None = None,
    lease_limit: int = 0,
) -> StartResult:
    # optimistic: no read; if the run exists, inserting it fails and the safe path reads
    row = None
    if not tx.optimistic:
        row = tx.execute(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    if row is not None:
        existing = _run_from_row(row)
        if existing.workflow != workflow:
            raise RunIdConflictError(run_id, f"workflow {existing.workflow!r}")
        if existing.input != input:
            raise RunIdConflictError(run_id, "different input")
        if existing.tenant != tenant:
            raise RunIdConflictError(run_id, f"tenant {existing.tenant!r}")
        return StartResult(run=existing, created=False)
    queued = False
    if tenant is not None:
        # the tenant's row is locked (PostgreSQL) before counting, so concurrent starts
        # and finishes of one tenant take turns and the count cannot be overshot
        limit, running = _admission(tx, tenant)
        if limit is not None and running < limit:
            # FIFO: runs already waiting for admission go first
            running += _admit_queued(tx, tenant, limit - running)
        if limit is not None and running >= limit:
            if on_limit != "queue":
                raise AdmissionLimitError(tenant, limit, running)
            queued = True
    # the caller ran the first workflow task already: record it here, with no task row
    eager = first is not None and not queued and lease_to is not None and queue in lease_queues
    leased = _insert_run(
        tx,
        run_id,
        workflow,
        queue,
        input,
        deadline_at=deadline_at,
        tenant=tenant,
        queued=queued,
        lease_to=lease_to,
        lease_queues=lease_queues,
        lease=lease,
        task=not eager,
        start_event=not eager,
    )
    if eager:
        assert first is not None
        # the start event, the task's commands and its marker in one history write, the
        # counter in one update (the run was inserted running)
        marker, acts, ended = _apply_workflow_result(
            tx,
            run_id,
            (RunStatus.RUNNING.value, queue, None, None, workflow, tenant),
            first,
            [_start_event(workflow, input, deadline_at, tenant)],
            1,
            lease_to,
            lease_queues,
            lease,
            lease_limit,
        )
        if ended or any(c.type is EventType.STATUS_SET for c in first.commands):
            row = tx.execute(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = ?", (run_id,))
            info = _run_from_row(row.fetchone())
        else:  # nothing else can have changed it: no read back
            info = _new_run(tx, run_id, workflow, RunStatus.RUNNING, queue, input, tenant)
        return StartResult(run=info, created=True, first_marker=marker, first_leased=tuple(acts))
    if leased is None:
        status = RunStatus.QUEUED if queued else RunStatus.PENDING
        return StartResult(
            run=_new_run(tx, run_id, workflow, status, queue, input, tenant), created=True
        )
    row = tx.execute(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    if leased is not None:  # hand the worker the history too: it needs no read to start
        events = _read_history(tx, run_id, 0)
        leased = dataclasses.replace(leased, prefetched=tuple(events), prefetched_after=0)
    return StartResult(run=_run_from_row(row), created=True, leased=leased)


def _new_run(
    tx: _Tx,
    run_id: str,
    workflow: str,
    status: RunStatus,
    queue: str,
    input: str,
    tenant: str | None,
) -> RunInfo:
    """The RunInfo of a run this transaction just created (what a read would return)."""
    return RunInfo(
        run_id=run_id,
        workflow=workflow,
        status=status,
        queue=queue,
        input=input,
        output=None,
        error=None,
        custom_status=None,
        parent_run_id=None,
        continued_to=None,
        task_error=None,
        created_at=tx.now,
        updated_at=tx.now,
        completed_at=None,
        tenant=tenant,
    )


_LIVE = "('pending', 'running', 'suspended')"  #: statuses that count against admission


def _admission(tx: _Tx, tenant: str) -> tuple[int | None, int]:
    """Lock the tenant's row; return its admission limit (None: none) and live runs."""
    tx.execute(
        "INSERT INTO tenant_limits (tenant, max_running, updated_at) VALUES (?, NULL, ?) "
        "ON CONFLICT DO NOTHING",
        (tenant, tx.now),
    )
    row = tx.execute(
        f"SELECT max_running FROM tenant_limits WHERE tenant = ?{tx.for_update}", (tenant,)
    ).fetchone()
    limit = row[0] if row is not None else None
    if limit is None:
        default = tx.execute("SELECT max_running FROM tenant_limits WHERE tenant = ''").fetchone()
        limit = default[0] if default is not None else None
    if limit is None:
        return None, 0
    (running,) = tx.execute(
        f"SELECT count(*) FROM runs WHERE tenant = ? AND status IN {_LIVE}", (tenant,)
    ).fetchone()
    return int(limit), int(running)


def _admit_queued(tx: _Tx, tenant: str, n: int | None) -> int:
    """Admit up to ``n`` (None: all) of the tenant's queued runs, oldest first."""
    rows = tx.execute(
        "SELECT run_id, queue, workflow FROM runs WHERE tenant = ? AND status = 'queued' "
        "ORDER BY created_at, run_id LIMIT ?",
        (tenant, n if n is not None else 2**62),
    ).fetchall()
    for run_id, queue, workflow in rows:
        tx.execute(
            "UPDATE runs SET status = 'pending', updated_at = ? WHERE run_id = ?", (tx.now, run_id)
        )
        _ensure_workflow_task(tx, run_id, queue, workflow)
    return len(rows)


def _promote(tx: _Tx, tenant: str) -> None:
    """A run of ``tenant`` ended (or its limit changed): admit queued runs into free room."""
    if not tx.execute(
        "SELECT 1 FROM runs WHERE tenant = ? AND status = 'queued' LIMIT 1", (tenant,)
    ).fetchone():
        return
    limit, running = _admission(tx, tenant)
    if limit is None:
        _admit_queued(tx, tenant, None)
    elif running < limit:
        _admit_queued(tx, tenant, limit - running)


def _configure_admission(tx: _Tx, tenant: str, max_running: int | None) -> None:
    """Set a tenant's admission limit ('' is the default); admit what now fits."""
    tx.execute(
        "INSERT INTO tenant_limits (tenant, max_running, updated_at) VALUES (?, ?, ?) "
        "ON CONFLICT (tenant) DO UPDATE SET max_running = excluded.max_running, "
        "updated_at = excluded.updated_at",
        (tenant, max_running, tx.now),
    )
    tenants = (
        [tenant]
        if tenant
        else [
            r[0]
            for r in tx.execute(
                "SELECT DISTINCT tenant FROM runs WHERE status = 'queued' AND tenant IS NOT NULL"
            ).fetchall()
        ]
    )
    for t in sorted(tenants):
        _promote(tx, t)


def _claim(
    tx: _Tx, worker_id: str, queues: tuple[str, ...], limit: int, lease: float
) -> list[Task]:
    tasks, _wake = _claim_with_wake(tx, worker_id, queues, limit, lease)
    return tasks


def _claim_with_wake(
    tx: _Tx, worker_id: str, queues: tuple[str, ...], limit: int, lease: float
) -> tuple[list[Task], float | None]:
    """Lease up to ``limit`` ready tasks; also say when a throttled queue may yield more.

    Activity tasks of queues with a ``queue_limits`` row go through
    ``_claim_limited`` (their rows locked first, in queue order, so concurrent
    claimers serialise per queue); everything else takes the plain indexed path.
    The second value is the earliest time a queue held back by its rate limit or
    a pause can let work through (None when nothing was held back that way).
    """
    limited = _lock_queue_limits(tx, queues) if queues else []
    tasks: list[Task] = []
    wake: float | None = None
    for row in limited:
        if len(tasks) >= limit:
            break
        got, gate = _claim_limited(tx, worker_id, row, limit - len(tasks), lease)
        tasks += got
        if gate is not None:
            wake = gate if wake is None else min(wake, gate)
    batched = 0  # tasks beyond the first of each batch: a batch takes one slot
    if len(tasks) < limit and queues:
        got, gate = _claim_batches(tx, worker_id, queues, limit - len(tasks), lease)
        batched = len(got) - len({t.batch_id for t in got})
        tasks += got
        if gate is not None:
            wake = gate if wake is None else min(wake, gate)
    if len(tasks) - batched < limit and queues:
        got, gate = _claim_dependencies(tx, worker_id, queues, limit - len(tasks) + batched, lease)
        tasks += got
        if gate is not None:
            wake = gate if wake is None else min(wake, gate)
    if len(tasks) - batched < limit:
        tasks += _claim_plain(
            tx,
            worker_id,
            queues,
            tuple(r[0] for r in limited),
            limit - len(tasks) + batched,
            lease,
        )
    return tasks, wake


def _claim_dependencies(
    tx: _Tx, worker_id: str, queues: tuple[str, ...], limit: int, lease: float
) -> tuple[list[Task], float | None]:
    """Activity tasks under a ``tether.Dependency``: each limiter row is locked (in
    name order) and obeyed like a queue's limits, over every served queue."""
    marks = ",".join("?" * len(queues))
    deps = [
        r[0]
        for r in tx.execute(
            "SELECT DISTINCT dependency FROM tasks WHERE dependency IS NOT NULL "
            f"AND available_at <= ? AND queue IN ({marks})",
            (tx.now, *queues),
        ).fetchall()
    ]
    if not deps:
        return [], None
    rows = _lock_queue_limits(tx, tuple(sorted(deps)))
    tasks: list[Task] = []
    wake: float | None = None
    for row in rows:
        if len(tasks) >= limit:
            break
        got, gate = _claim_limited(tx, worker_id, row, limit - len(tasks), lease, queues)
        tasks += got
        if gate is not None:
            wake = gate if wake is None else min(wake, gate)
    return tasks, wake


_NOT_SUSPENDED = (
    "(t.kind IN ('timer', 'deadline') OR NOT EXISTS (SELECT 1 FROM runs r "
    "WHERE r.run_id = t.run_id AND r.status = 'suspended'))"
)
_LEASE_SET = (
    "UPDATE tasks SET lease_owner = ?, available_at = ? + COALESCE(heartbeat_timeout, ?), "
    "fence = fence + 1, "
    "attempt = attempt + CASE WHEN kind = 'activity' THEN 1 ELSE 0 END WHERE task_id IN "
)


# -- batches (tether.Batch) ------------------------------------------------------


def _batch_cols(data: dict[str, Any]) -> tuple[str | None, int | None, float | None]:
    """The ``batch_key, batch_max, batch_wait`` columns of an ActivityScheduled's task."""
    batch = data.get("batch")
    if not batch:
        return None, None, None
    return str(batch["key"]), int(batch["max_items"]), float(batch["max_wait"])


def _claim_batches(
    tx: _Tx, worker_id: str, queues: tuple[str, ...], limit: int, lease: float
) -> tuple[list[Task], float | None]:
    """Lease up to ``limit`` batches of batched activity tasks; say when the next is due.

    Ready tasks are grouped by (batch key, queue). A group yields a batch when
    ``batch_max`` of them are ready or the oldest became ready ``batch_wait``
    seconds ago; the batch is its oldest ``batch_max`` tasks. A batch is one call:
    one of the worker's slots, one running task under the queue's
    ``max_concurrency``, one rate-limit token. The candidates are locked first
    (SKIP LOCKED on PostgreSQL) and the rule is checked on what was locked, so
    concurrent claimers never share a task and never flush a partial batch early.
    Every task of a batch gets ``batch_id``, its first task's id (also stored, so
    limits count the batch once). The second value is the earliest time a waiting
    group becomes due, or a throttled queue may let a batch through.
    """
    marks = ",".join("?" * len(queues))
    groups = tx.execute(
        "SELECT t.batch_key, t.queue, count(*), min(t.available_at), min(t.batch_max), "
        "min(t.batch_wait) FROM tasks t WHERE t.batch_key IS NOT NULL AND t.available_at <= ? "
        f"AND t.queue IN ({marks}) AND {_NOT_SUSPENDED} GROUP BY t.batch_key, t.queue "
        "ORDER BY min(t.available_at)",
        (tx.now, *queues),
    ).fetchall()
    tasks: list[Task] = []
    wake: float | None = None
    batches = 0
    for key, queue, ready, oldest, size, wait in groups:
        size, wait = int(size), float(wait)
        if int(ready) < size and float(oldest) + wait > tx.now:
            due = float(oldest) + wait  # not full yet: flush it when the oldest has waited
            wake = due if wake is None else min(wake, due)
            continue
        while batches < limit:
            allowed, gate = _batch_allowed(tx, queue)
            if gate is not None:
                wake = gate if wake is None else min(wake, gate)
            if not allowed:
                break
            rows = tx.execute(
                "SELECT t.task_id, t.available_at FROM tasks t WHERE t.batch_key = ? "
                f"AND t.queue = ? AND t.available_at <= ? AND {_NOT_SUSPENDED} "
                f"ORDER BY t.available_at, t.task_id LIMIT ?{tx.skip_locked}",
                (key, queue, tx.now, size),
            ).fetchall()
            if not rows:
                break
            due = float(rows[0][1]) + wait
            if len(rows) < size and due > tx.now:
                wake = due if wake is None else min(wake, due)
                break  # what is left (or not locked by others) is not a batch yet
            ids = [r[0] for r in rows]
            leased = tx.execute(
                "UPDATE tasks SET lease_owner = ?, "
                "available_at = ? + COALESCE(heartbeat_timeout, ?), fence = fence + 1, "
                "attempt = attempt + 1, batch_id = ? WHERE task_id IN "
                f"({','.join('?' * len(ids))}) RETURNING {_TASK_COLS}",
                (worker_id, tx.now, lease, ids[0], *ids),
            ).fetchall()
            rank = {tid: i for i, tid in enumerate(ids)}
            got = sorted((_task_from_row(r) for r in leased), key=lambda t: rank[t.task_id])
            tasks += [dataclasses.replace(t, batch_id=ids[0]) for t in got]
            batches += 1
            _spend_tokens(tx, queue, 1)
            if len(rows) < size:
                break  # every ready task of the group was taken
    return tasks, wake


def _batch_allowed(tx: _Tx, queue: str) -> tuple[bool, float | None]:
    """Whether the limits of ``queue`` let one more batch start now; and when, if not.

    The queue's ``queue_limits`` row (if any) is already locked by this claim.
    """
    row = tx.execute(
        f"SELECT {_QL_COLS} FROM queue_limits WHERE queue = ?{tx.for_update}", (queue,)
    ).fetchone()
    if row is None:
        return True, None
    _q, cap, rate, burst, tokens, refilled_at, _k, _f, _p, paused_until, _c = row
    if paused_until is not None and float(paused_until) > tx.now:
        return False, float(paused_until)
    if cap is not None:
        (running,) = tx.execute(
            f"SELECT {_CALLS} FROM tasks WHERE queue = ? AND kind = 'activity' AND {_RUNNING}",
            (queue, tx.now),
        ).fetchone()
        if int(running) >= int(cap):
            return False, None  # at its concurrency cap: a completion wakes the workers
    if rate is not None:
        have = _tokens_now(tx, rate, burst, tokens, refilled_at)
        if have < 1.0 - 1e-9:
            return False, tx.now + (1.0 - have) / float(rate)  # the next token
    return True, None


def _spend_tokens(tx: _Tx, queue: str, n: int) -> None:
    """Take ``n`` tokens from the bucket of ``queue``, if it has a rate limit."""
    row = tx.execute(
        "SELECT rate, burst, tokens, refilled_at FROM queue_limits WHERE queue = ?", (queue,)
    ).fetchone()
    if row is None or row[0] is None or n <= 0:
        return
    left = _tokens_now(tx, row[0], row[1], row[2], row[3]) - n
    tx.execute(
        "UPDATE queue_limits SET tokens = ?, refilled_at = ? WHERE queue = ?",
        (left, _refill_mark(tx, row[3]), queue),
    )


def _batch_due(tx: _Tx, queues: tuple[str, ...]) -> float | None:
    """When a batched task on ``queues`` is next due: a waiting one when its batch is
    flushed (ready since ``available_at``, plus ``batch_wait``), others at ``available_at``."""
    marks = ",".join("?" * len(queues))
    row = tx.execute(
        "SELECT min(CASE WHEN available_at > ? THEN available_at "
        "ELSE available_at + batch_wait END) FROM tasks "
        f"WHERE batch_key IS NOT NULL AND queue IN ({marks})",
        (tx.now, *queues),
    ).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def _claim_plain(
    tx: _Tx,
    worker_id: str,
    queues: tuple[str, ...],
    limited: tuple[str, ...],
    limit: int,
    lease: float,
) -> list[Task]:
    """Queues without limits (and non-activity tasks of limited ones): by priority, then age."""
    marks = ",".join("?" * len(queues))
    # claimed by _claim_dependencies and _claim_batches
    skip = "AND t.dependency IS NULL AND t.batch_key IS NULL "
    if limited:
        skip += f"AND NOT (t.kind = 'activity' AND t.queue IN ({','.join('?' * len(limited))})) "
    if tx.skip_locked:
        # PostgreSQL: one ordered, bounded index scan per queue (tasks_ready_order) and a
        # merge of at most ``limit`` rows each; ``queue IN (...)`` with this ORDER BY
        # would sort every ready row of every queue on each claim (a backlog of 100,000
        # made each claim take 50-200 ms)
        rows = tx.execute(
            f"{_LEASE_SET}(SELECT c.task_id FROM unnest(?::text[]) AS q(name) "
            "CROSS JOIN LATERAL (SELECT t.task_id, t.priority, t.available_at FROM tasks t "
            f"WHERE t.queue = q.name AND t.available_at <= ? {skip}AND {_NOT_SUSPENDED} "
            f"ORDER BY t.priority DESC, t.available_at LIMIT ?{tx.skip_locked}) c "
            f"ORDER BY c.priority DESC, c.available_at LIMIT ?) RETURNING {_TASK_COLS}",
            (worker_id, tx.now, lease, list(queues), tx.now, *limited, limit, limit),
        ).fetchall()
        return [_task_from_row(r) for r in rows]
    rows = tx.execute(
        f"{_LEASE_SET}("
        f"SELECT t.task_id FROM tasks t WHERE t.queue IN ({marks}) AND t.available_at <= ? "
        f"{skip}AND {_NOT_SUSPENDED} ORDER BY t.priority DESC, t.available_at "
        f"LIMIT ?{tx.skip_locked}) "
        f"RETURNING {_TASK_COLS}",
        (worker_id, tx.now, lease, *queues, tx.now, *limited, limit),
    ).fetchall()
    return [_task_from_row(r) for r in rows]


# -- queue limits --------------------------------------------------------------

_QL_COLS = (
    "queue, max_concurrency, rate, burst, tokens, refilled_at, key_concurrency, fair, "
    "pause_on_429, paused_until, fair_cursor"
)
_RUNNING = "lease_owner IS NOT NULL AND available_at > ?"  #: a live lease
#: running activity calls among the selected tasks: a batch (tether.Batch) is one call
_CALLS = "count(DISTINCT COALESCE(batch_id, task_id))"


def _lock_queue_limits(tx: _Tx, queues: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """The limits rows of ``queues``, locked in queue order (PostgreSQL) for this claim."""
    marks = ",".join("?" * len(queues))
    rows = tx.execute(
        f"SELECT {_QL_COLS} FROM queue_limits WHERE queue IN ({marks}) "
        f"ORDER BY queue{tx.for_update}",
        queues,
    ).fetchall()
    return [tuple(r) for r in rows]


def _tokens_now(tx: _Tx, rate: float, burst: float, tokens: Any, refilled_at: Any) -> float:
    """The token bucket refilled up to now: ``rate`` per second, at most ``burst``."""
    have = float(burst) if tokens is None else float(tokens)
    if refilled_at is not None:
        have += max(0.0, tx.now - float(refilled_at)) * float(rate)
    return min(float(burst), have)


def _refill_mark(tx: _Tx, refilled_at: Any) -> float:
    """The bucket's new refill time: never earlier than the one stored.

    A claim's ``now`` is read when its batch starts, so one that waited for the
    queue's row lock (or runs on a host whose clock is behind) can be older than the
    last refill; moving the mark back would credit that interval twice.
    """
    return tx.now if refilled_at is None else max(tx.now, float(refilled_at))


def _claim_limited(
    tx: _Tx,
    worker_id: str,
    row: tuple[Any, ...],
    limit: int,
    lease: float,
    served: tuple[str, ...] | None = None,
) -> tuple[list[Task], float | None]:
    """Activity tasks of one limited queue, within its caps; and when a gate lifts.

    With ``served``, ``row`` is a dependency limiter: its tasks are those with that
    ``dependency``, from the ``served`` queues.
    """
    q, cap, rate, burst, tokens, refilled_at, key_cap, fair, _p429, paused_until, cursor = row
    if paused_until is not None and float(paused_until) > tx.now:
        return [], float(paused_until)
    col = "queue" if served is None else "dependency"
    budget = limit
    if cap is not None:
        (running,) = tx.execute(
            f"SELECT {_CALLS} FROM tasks WHERE {col} = ? AND kind = 'activity' AND {_RUNNING}",
            (q, tx.now),
        ).fetchone()
        budget = min(budget, int(cap) - int(running))
    have = 0.0
    if rate is not None:
        have = _tokens_now(tx, rate, burst, tokens, refilled_at)
        budget = min(budget, int(have + 1e-9))
    if budget <= 0:
        if rate is not None and have < 1.0 - 1e-9:
            return [], tx.now + (1.0 - have) / float(rate)  # the next token
        return [], None  # at its concurrency cap: a completion wakes the workers
    ready = f"t.{col} = ? AND t.kind = 'activity' AND t.available_at <= ? AND " + _NOT_SUSPENDED
    if served is not None:
        ready += f" AND t.queue IN ({','.join('?' * len(served))})"
    else:
        # claimed under their dependency's limiter, or as batches (_claim_batches)
        ready += " AND t.dependency IS NULL AND t.batch_key IS NULL"
    if (key_cap is None and not fair) or served is not None:
        ids = [
            r[0]
            for r in tx.execute(
                f"SELECT t.task_id FROM tasks t WHERE {ready} "
                "ORDER BY t.priority DESC, t.available_at, t.task_id LIMIT ?",
                (q, tx.now, *(served or ()), budget),
            ).fetchall()
        ]
    else:
        # rank each limit key's ready tasks after what the key already runs; a key may
        # start at most key_concurrency minus what it runs. A fair queue takes tasks by
        # that rank (each key's next task before any key's task after it) and breaks
        # ties round robin from the key after the last one served, so a tenant's
        # backlog cannot starve another tenant's few tasks, even one claim at a time.
        per_key = ""
        args: tuple[Any, ...] = ()
        if key_cap is not None:
            per_key = "WHERE k.limit_key IS NULL OR k.rn + COALESCE(b.n, 0) <= ? "
            args = (int(key_cap),)
        order = ""
        if fair:
            order = "k.rn + COALESCE(b.n, 0), CASE WHEN k.key > ? THEN 0 ELSE 1 END, k.key, "
            args += (cursor or "",)
        picked = tx.execute(
            "SELECT k.task_id, k.key FROM (SELECT t.task_id, t.limit_key, "
            "COALESCE(t.limit_key, '') AS key, t.priority, t.available_at, "
            "ROW_NUMBER() OVER (PARTITION BY COALESCE(t.limit_key, '') "
            "ORDER BY t.priority DESC, t.available_at, t.task_id) AS rn "
            f"FROM tasks t WHERE {ready}) k "
            "LEFT JOIN (SELECT COALESCE(limit_key, '') AS key, count(*) AS n FROM tasks "
            f"WHERE queue = ? AND kind = 'activity' AND {_RUNNING} "
            f"GROUP BY COALESCE(limit_key, '')) b ON b.key = k.key {per_key}"
            f"ORDER BY {order}k.priority DESC, k.available_at, k.task_id LIMIT ?",
            (q, tx.now, q, tx.now, *args, budget),
        ).fetchall()
        ids = [r[0] for r in picked]
        if fair and picked:
            tx.execute(
                "UPDATE queue_limits SET fair_cursor = ? WHERE queue = ?", (picked[-1][1], q)
            )
    tasks: list[Task] = []
    if ids:
        marks = ",".join("?" * len(ids))
        rows = tx.execute(
            f"{_LEASE_SET}(SELECT task_id FROM tasks WHERE task_id IN ({marks}) "
            f"AND available_at <= ?{tx.skip_locked}) RETURNING {_TASK_COLS}",
            (worker_id, tx.now, lease, *ids, tx.now),
        ).fetchall()
        rank = {tid: i for i, tid in enumerate(ids)}
        tasks = sorted((_task_from_row(r) for r in rows), key=lambda t: rank[t.task_id])
    if rate is not None:
        left = have - len(tasks)
        if tasks:
            tx.execute(
                "UPDATE queue_limits SET tokens = ?, refilled_at = ? WHERE queue = ?",
                (left, _refill_mark(tx, refilled_at), q),
            )
        if left < 1.0 - 1e-9:
            return tasks, tx.now + (1.0 - left) / float(rate)
    return tasks, None


def _read_history(tx: _Tx, run_id: str, after_seq: int) -> list[Event]:
    rows = tx.execute(
        "SELECT run_id, seq, type, step, data, created_at FROM events "
        "WHERE run_id = ? AND seq > ? ORDER BY seq",
        (run_id, after_seq),
    ).fetchall()
    return [Event.from_row(r) for r in rows]


def _finish(
    tx: _Tx,
    run_id: str,
    status: RunStatus,
    *,
    output: str | None = None,
    error: dict[str, Any] | None = None,
    continued_to: str | None = None,
    known: tuple[Any, ...] | None = None,
    next_seq: int | None = None,
    children: bool = False,
) -> None:
    """End a run: its status and outcome, its tasks gone, its parent and tenant told.

    ``known`` is the run's (parent_run_id, parent_step, workflow, tenant) when the
    caller read them already in this transaction (saving a read); ``next_seq`` a
    new history counter to write in the same update. With ``children``, running
    children get their parent-close policy in the same commit.
    """
    if known is None:
        known = tx.execute(
            "SELECT parent_run_id, parent_step, workflow, tenant FROM runs WHERE run_id = ?",
            (run_id,),
        ).fetchone()
        if known is None:
            raise RunNotFoundError(run_id)
    parent_run_id, parent_step, workflow, tenant = known
    tx.execute(
        "UPDATE runs SET status = ?, output = ?, error = ?, continued_to = ?, completed_at = ?, "
        "waiting_on = NULL, "
        f"updated_at = ?{', next_seq = ?' if next_seq is not None else ''} WHERE run_id = ?",
        (
            status.value,
            output,
            dumps(error) if error else None,
            continued_to,
            tx.now,
            tx.now,
            *(() if next_seq is None else (next_seq,)),
            run_id,
        ),
    )
    tx.execute("DELETE FROM tasks WHERE run_id = ?", (run_id,))
    if children:
        _close_children(tx, run_id)
    tx.finished[run_id] = RunEnd(
        run_id=run_id,
        workflow=workflow,
        status=status,
        output=output,
        error=error,
        continued_to=continued_to,
    )
    # the continuation keeps the run's place; otherwise admit the tenant's oldest queued
    # run, in this commit
    if status is not RunStatus.CONTINUED_AS_NEW and tenant is not None:
        _promote(tx, tenant)
    if status in (RunStatus.FAILED, RunStatus.NEEDS_INTERVENTION, RunStatus.TIMED_OUT):
        tx.execute(
            "INSERT INTO dead_letters (run_id, kind, name, input, error, reason, created_at) "
            "SELECT run_id, 'run', workflow, input, ?, ?, ? FROM runs WHERE run_id = ?",
            (json.dumps(error) if error else None, status.value, tx.now, run_id),
        )
    if parent_run_id is None or status is RunStatus.CONTINUED_AS_NEW:
        return
    pstatus, pqueue, _pp, _ps, pworkflow, _pt = _run_row(tx, parent_run_id)
    if RunStatus(pstatus).is_terminal:
        return
    if status is RunStatus.COMPLETED:
        _append(
            tx,
            parent_run_id,
            EventType.CHILD_COMPLETED,
            parent_step,
            {"child_run_id": run_id},
            {"result": output or "null"},
        )
    else:
        _append(
            tx,
            parent_run_id,
            EventType.CHILD_FAILED,
            parent_step,
            {"child_run_id": run_id, "status": status.value, "error": error},
        )
    _ensure_workflow_task(tx, parent_run_id, pqueue, pworkflow)


def _complete_workflow_task(
    tx: _Tx,
    task: Task,
    result: WorkflowTaskResult,
    lease_to: str | None,
    lease_queues: tuple[str, ...],
    lease: float,
    lease_limit: int,
) -> tuple[int, list[Task]]:
    _check_fence(tx, task)
    row = tx.execute(
        "SELECT status, queue, parent_run_id, parent_step, workflow, tenant, next_seq "
        f"FROM runs WHERE run_id = ?{tx.for_update}",
        (task.run_id,),
    ).fetchone()
    if row is None:
        raise RunNotFoundError(task.run_id)
    if RunStatus(row[0]).is_terminal:
        # ended meanwhile (terminated, cancelled while queued...): the result has no run
        tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
        raise LeaseLostError(
            f"run {task.run_id!r} ended ({row[0]}) while its workflow task ran; "
            "the task's result was discarded"
        )
    run = tuple(row[:6])
    if any(c.type in _ENDINGS for c in result.commands) and _newer_incoming(
        tx, task.run_id, result.through
    ):
        # a signal, cancel or result arrived after the task read the history: ending the
        # run now would drop it; the task runs again with it instead
        tx.execute(
            "UPDATE tasks SET lease_owner = NULL, available_at = ? WHERE task_id = ?",
            (tx.now, task.task_id),
        )
        tx.ready.add(run[1])
        return TASK_REJECTED, []
    marker, leased, ended = _apply_workflow_result(
        tx,
        task.run_id,
        run,
        result,
        [],
        row[6],
        lease_to,
        lease_queues,
        lease,
        lease_limit,
        activate=True,
    )
    if ended:
        return marker, []
    if _newer_incoming(tx, task.run_id, result.through):
        tx.execute(
            "UPDATE tasks SET lease_owner = NULL, available_at = ? WHERE task_id = ?",
            (tx.now, task.task_id),
        )
        tx.ready.add(run[1])
    else:
        tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
    return marker, leased


def _child_outcome(tx: _Tx, child: str, step: int | None) -> _Pending | None:
    """A child's outcome as its parent's event at ``step``, or None while it runs.

    A child that continued as new is followed to its latest run, which is told to
    report to ``step`` (where its parent now waits for it).
    """
    info = _get_run(tx, child, True)
    if info is None:
        return None
    if not info.status.is_terminal:
        tx.execute("UPDATE runs SET parent_step = ? WHERE run_id = ?", (step, info.run_id))
        return None
    if info.status is RunStatus.COMPLETED:
        return (
            EventType.CHILD_COMPLETED,
            step,
            {"child_run_id": child},
            {"result": info.output or "null"},
        )
    return (
        EventType.CHILD_FAILED,
        step,
        {"child_run_id": child, "status": info.status.value, "error": info.error},
        None,
    )


#: commands that end a run (or hand it to the next run of its chain)
_ENDINGS = frozenset(
    {
        EventType.WORKFLOW_COMPLETED,
        EventType.WORKFLOW_FAILED,
        EventType.WORKFLOW_CANCELLED,
        EventType.WORKFLOW_TIMED_OUT,
        EventType.WORKFLOW_NEEDS_INTERVENTION,
        EventType.CONTINUED_AS_NEW,
    }
)
#: events a workflow task consumes, as stored (the start is never "newer")
_INCOMING = (
    "("
    + ",".join(sorted(f"'{t.value}'" for t in INCOMING if t is not EventType.WORKFLOW_STARTED))
    + ")"
)


def _newer_incoming(tx: _Tx, run_id: str, through: int) -> bool:
    """Whether events a workflow task has not seen (after ``through``) wait for it."""
    row = tx.execute(
        f"SELECT 1 FROM events WHERE run_id = ? AND seq > ? AND type IN {_INCOMING} LIMIT 1",
        (run_id, through),
    ).fetchone()
    return row is not None


def _marker(result: WorkflowTaskResult) -> _Pending:
    """The ``WorkflowTaskCompleted`` event closing a workflow task.

    Its JSON is written here (an int and a finite float need no encoder): every step
    writes one.
    """
    raw = {"through": str(int(result.through)), "time": repr(float(result.time))}
    if result.version is not None:
        return (EventType.WORKFLOW_TASK_COMPLETED, None, {"version": result.version}, raw)
    return (EventType.WORKFLOW_TASK_COMPLETED, None, {}, raw)


def _apply_workflow_result(
    tx: _Tx,
    run_id: str,
    run: tuple[Any, ...],
    result: WorkflowTaskResult,
    events: list[_Pending],
    next_seq: int,
    lease_to: str | None,
    lease_queues: tuple[str, ...],
    lease: float,
    lease_limit: int,
    *,
    activate: bool = False,
) -> tuple[int, list[Task], bool]:
    """Record a workflow task's commands and act on them (tasks, children, the end).

    ``run`` is the run's ``_run_row``; ``events`` are appended before the
    commands (the fast path's activity result), all in one history write.
    ``next_seq`` is the run's counter, read under the write lock; the new value is
    written in one update with the end or, with ``activate``, with a run that goes on
    leaving ``pending`` and its ``task_error`` cleared.
    Returns (marker seq, activity tasks leased to ``lease_to``, run ended).
    """
    status, run_queue, parent_run_id, parent_step, workflow, tenant = run
    if status == RunStatus.SUSPENDED.value:
        lease_to = None  # suspended while this task ran: dispatch nothing locally
    leased: list[Task] = []
    ending: Command | None = None
    for cmd in result.commands:
        events.append((cmd.type, cmd.step, cmd.data, cmd.raw))
        t = cmd.type
        if t is EventType.ACTIVITY_SCHEDULED and cmd.data.get("reused"):
            # a result kept from before an operator's retry: record it, run nothing
            events.append(
                (
                    EventType.ACTIVITY_COMPLETED,
                    cmd.step,
                    {"attempt": 0, "reused": True},
                    {"result": cmd.raw.get("result", "null")},
                )
            )
        elif t is EventType.ACTIVITY_SCHEDULED:
            q = cmd.data["queue"]
            hb_timeout = (cmd.data.get("options") or {}).get("heartbeat_timeout")
            dep = cmd.data.get("dependency")
            if dep is not None:
                _ensure_dependency(tx, dep, cmd.data.get("dependency_limits") or {})
            batch = _batch_cols(cmd.data)
            local = (
                lease_to is not None
                and q in lease_queues
                and len(leased) < lease_limit
                and dep is None  # a dependency's work goes through the claim
                and batch[0] is None  # so does a batched call: the claim forms batches
            )
            if local:
                local = not _has_limits(tx, q)  # a limited queue's work goes through the claim
            options = cmd.data.get("options", {})
            values = (
                run_id,
                cmd.step,
                q,
                cmd.data["name"],
                cmd.raw.get("args", "{}"),
                dumps(options),
                tx.now + (hb_timeout or lease) if local else tx.now,
                lease_to if local else None,
                1 if local else 0,
                1 if local else 0,
                hb_timeout,
                int(cmd.data.get("priority") or 0),
                cmd.data.get("limit_key"),
                dep,
                *batch,
                tx.now,
            )
            task = _insert_activity_task(tx, values, options, local)
            if task is not None:
                leased.append(task)
            else:
                tx.ready.add(q)
        elif t is EventType.TIMER_STARTED:
            tx.execute(
                "INSERT INTO tasks (run_id, kind, step, queue, available_at, created_at) "
                "VALUES (?, 'timer', ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (run_id, cmd.step, run_queue, cmd.data["fire_at"], tx.now),
            )
            tx.ready.add(run_queue)
        elif t is EventType.TIMER_CANCELLED:
            tx.execute(
                "DELETE FROM tasks WHERE run_id = ? AND step = ? AND kind = 'timer'",
                (run_id, cmd.data["timer_step"]),
            )
        elif t is EventType.ACTIVITY_CANCEL_REQUESTED:
            target = cmd.data["activity_step"]
            tx.execute(
                "DELETE FROM tasks WHERE run_id = ? AND step = ? AND kind = 'activity' "
                "AND lease_owner IS NULL",
                (run_id, target),
            )
            tx.execute(
                "UPDATE tasks SET cancel_requested = 1 WHERE run_id = ? AND step = ? "
                "AND kind = 'activity'",
                (run_id, target),
            )
        elif t is EventType.CHILD_STARTED:
            child = cmd.data["child_run_id"]
            exists = tx.execute(
                "SELECT parent_run_id FROM runs WHERE run_id = ?", (child,)
            ).fetchone()
            if exists is None:
                _insert_run(
                    tx,
                    child,
                    cmd.data["workflow"],
                    cmd.data["queue"],
                    cmd.raw["input"],
                    run_id,
                    cmd.step,
                )
            elif exists[0] == run_id:
                # started again after an operator's retry voided its start: it may have
                # ended meanwhile (its end found this run failed and was not delivered)
                outcome = _child_outcome(tx, child, cmd.step)
                if outcome is not None:
                    events.append(outcome)
            else:
                events.append(
                    (
                        EventType.CHILD_FAILED,
                        cmd.step,
                        {
                            "child_run_id": child,
                            "status": "failed",
                            "error": {
                                "type": "RunIdConflictError",
                                "message": f"run id {child!r} is already used by another run",
                            },
                        },
                        None,
                    )
                )
        elif t is EventType.CHILD_CANCEL_REQUESTED:
            # a child that continued as new is cancelled in its live run
            why = f"parent run {run_id!r} stopped waiting for it"
            with contextlib.suppress(RunNotFoundError, RunFinishedError):
                _cancel(tx, cmd.data["child_run_id"], why)
        elif t is EventType.STATUS_SET:
            tx.execute(
                "UPDATE runs SET custom_status = ? WHERE run_id = ?",
                (cmd.raw.get("value", "null"), run_id),
            )
        elif t in _ENDINGS:
            ending = cmd
    events.append(_marker(result))
    marker = _insert_events(tx, run_id, events, next_seq)
    if ending is None:  # the counter, with the status when the run leaves pending
        waiting = None if result.waiting_on is None else _compact(result.waiting_on)
        tx.execute(
            "UPDATE runs SET next_seq = ?, updated_at = ?, waiting_on = ?"
            f"{_ACTIVATE if activate else ''} WHERE run_id = ?",
            (marker + 1, tx.now, waiting, run_id),
        )
        return marker, leased, False
    known = (parent_run_id, parent_step, workflow, tenant)
    # the counter is written by the end's update
    end = functools.partial(
        _finish, tx, run_id, known=known, next_seq=marker + 1, children=result.children
    )
    if ending.type is EventType.WORKFLOW_COMPLETED:
        end(RunStatus.COMPLETED, output=ending.raw.get("result", "null"))
    elif ending.type is EventType.WORKFLOW_FAILED:
        end(RunStatus.FAILED, error=ending.data["error"])
    elif ending.type is EventType.WORKFLOW_TIMED_OUT:
        end(RunStatus.TIMED_OUT, error=ending.data.get("error"))
    elif ending.type is EventType.WORKFLOW_NEEDS_INTERVENTION:
        end(RunStatus.NEEDS_INTERVENTION, error=ending.data["error"])
    elif ending.type is EventType.WORKFLOW_CANCELLED:
        end(RunStatus.CANCELLED, error=ending.data.get("error"))
    else:
        nxt = ending.data["next_run_id"]
        # the chain keeps the run's deadline (a task, deleted by the end) and suspension
        deadline = tx.execute(
            "SELECT available_at FROM tasks WHERE run_id = ? AND kind = 'deadline'", (run_id,)
        ).fetchone()
        end(RunStatus.CONTINUED_AS_NEW, continued_to=nxt)
        _insert_run(
            tx,
            nxt,
            workflow,
            run_queue,
            ending.raw["input"],
            parent_run_id,
            parent_step,
            deadline_at=deadline[0] if deadline else None,
            tenant=tenant,
        )
        if status == RunStatus.SUSPENDED.value:
            _append(tx, nxt, EventType.SUSPENDED, None, {"carried_from": run_id})
            tx.execute("UPDATE runs SET status = 'suspended' WHERE run_id = ?", (nxt,))
    return marker, [], True


#: leaving pending for running, a failed workflow task's error cleared (a suspended
#: run stays suspended)
_ACTIVATE = (
    ", status = CASE status WHEN 'pending' THEN 'running' ELSE status END, task_error = NULL"
)


def _fail_workflow_task(tx: _Tx, task: Task, error: str, retry_at: float) -> None:
    _check_fence(tx, task)
    tx.execute("UPDATE runs SET task_error = ? WHERE run_id = ?", (error, task.run_id))
    tx.execute(
        "UPDATE tasks SET lease_owner = NULL, available_at = ? WHERE task_id = ?",
        (retry_at, task.task_id),
    )


def _complete_activity(
    tx: _Tx,
    task: Task,
    result: str,
    lease_to: str | None,
    lease_queues: tuple[str, ...],
    lease: float,
) -> Task | None:
    _take_task(tx, task)
    _append_completed(tx, task, result)
    return _after_activity(tx, task, lease_to, lease_queues, lease)


def _append_completed(tx: _Tx, task: Task, result: str) -> None:
    """Record an activity attempt's result (``result`` is already-encoded JSON)."""
    _append(
        tx,
        task.run_id,
        EventType.ACTIVITY_COMPLETED,
        task.step,
        {"attempt": task.attempt},
        {"result": result},
    )


def _take_task(tx: _Tx, task: Task) -> None:
    """Delete a finished task's row, provided our lease on it still holds (its fence)."""
    if tx.optimistic:  # the lease almost always holds: no wait; the guard fails if it did not
        tx.guard(
            "WITH d AS (DELETE FROM tasks WHERE task_id = ? AND fence = ? RETURNING 1) "
            "SELECT 1 / count(*)::int FROM d",
            (task.task_id, task.fence),
        )
        return
    row = tx.execute(
        "DELETE FROM tasks WHERE task_id = ? AND fence = ? RETURNING 1",
        (task.task_id, task.fence),
    ).fetchone()
    if row is None:
        raise LeaseLostError(
            f"lease lost on {task.kind} task {task.task_id} of run {task.run_id!r}: another "
            "worker took it over or the run ended; this worker's result was discarded"
        )


def _after_activity(
    tx: _Tx, task: Task, lease_to: str | None, lease_queues: tuple[str, ...], lease: float
) -> Task | None:
    """Wake claimers of a limited queue and make sure the run gets a workflow task."""
    if task.dependency is not None or _has_limits(tx, task.queue):
        tx.ready.add(task.queue)  # a slot under its concurrency cap is free: wake claimers
    _, run_queue, _p, _s, workflow, _t = _run_row(tx, task.run_id)
    return _ensure_workflow_task(
        tx, task.run_id, run_queue, workflow, lease_to, lease_queues, lease
    )


def _fail_activity(
    tx: _Tx,
    task: Task,
    error: dict[str, Any],
    retry_at: float | None,
    lease_to: str | None,
    lease_queues: tuple[str, ...],
    lease: float,
) -> Task | None:
    _check_fence(tx, task)
    if task.dependency is not None:
        # rate-limit feedback reshapes the dependency's limiter (not the queue): every
        # step waiting for it waits out the Retry-After or the x-ratelimit reset
        retry_after = error.get("retry_after") if error.get("rate_limited") else None
        until = _dependency_feedback(tx, None, task.dependency, retry_after, error)
        if until is not None:
            error = {**error, "dependency_paused_until": until}
        tx.ready.add(task.queue)
    elif error.get("rate_limited") and error.get("retry_after") is not None:
        # HTTP 429 with Retry-After: the dependency asked everyone to back off
        until = _pause_on_429(tx, task.queue, float(error["retry_after"]))
        if until is not None:
            error = {**error, "queue_paused_until": until}
    elif _has_limits(tx, task.queue):
        tx.ready.add(task.queue)  # a slot under its concurrency cap is free: wake claimers
    if retry_at is not None:
        tx.execute(
            "UPDATE tasks SET lease_owner = NULL, available_at = ?, last_error = ? "
            "WHERE task_id = ?",
            (retry_at, json.dumps(error), task.task_id),
        )
        _append(
            tx,
            task.run_id,
            EventType.ACTIVITY_ATTEMPT_FAILED,
            task.step,
            {"attempt": task.attempt, "error": error, "retry_at": retry_at},
        )
        tx.ready.add(task.queue)
        return None
    requested = tx.execute(
        "SELECT cancel_requested FROM tasks WHERE task_id = ?", (task.task_id,)
    ).fetchone()
    if not (requested and requested[0]):
        # a step the workflow (or an operator) asked to cancel did what it was asked:
        # not a failure to replay, so no dead letter
        _dead_letter(tx, task, error)
    _append(
        tx,
        task.run_id,
        EventType.ACTIVITY_FAILED,
        task.step,
        {"attempt": task.attempt, "error": error},
    )
    tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
    _, run_queue, _p, _s, workflow, _t = _run_row(tx, task.run_id)
    return _ensure_workflow_task(
        tx, task.run_id, run_queue, workflow, lease_to, lease_queues, lease
    )


def _dead_letter(tx: _Tx, task: Task, error: dict[str, Any]) -> None:
    """Record a step that exhausted its failure policy, for an operator to replay."""
    tx.execute(
        "INSERT INTO dead_letters (run_id, step, kind, name, input, error, attempts, reason, "
        "created_at) VALUES (?, ?, 'activity', ?, ?, ?, ?, ?, ?)",
        (
            task.run_id,
            task.step,
            task.name,
            task.payload,
            json.dumps(error),
            task.attempt,
            error.get("reason"),
            tx.now,
        ),
    )


def _fire_timer(tx: _Tx, task: Task) -> None:
    _check_fence(tx, task)
    if task.kind == "debounce":
        _fire_debounce(tx, task)
        return
    if task.kind == "deadline" and _run_row(tx, task.run_id)[0] == RunStatus.QUEUED.value:
        # the deadline passed while the run waited for admission: it never started
        error = {"type": "DeadlineExceeded", "message": "deadline passed while queued"}
        _append(tx, task.run_id, EventType.DEADLINE_EXCEEDED, None, {})
        _finish(tx, task.run_id, RunStatus.TIMED_OUT, error=error)
        return
    if task.kind == "deadline":
        _append(tx, task.run_id, EventType.DEADLINE_EXCEEDED, None, {})
    else:
        _append(tx, task.run_id, EventType.TIMER_FIRED, task.step, {})
    tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
    _, run_queue, _p, _s, workflow, _t = _run_row(tx, task.run_id)
    _ensure_workflow_task(tx, task.run_id, run_queue, workflow)


def _renew(tx: _Tx, tasks: tuple[Task, ...], lease: float) -> dict[int, bool]:
    out: dict[int, bool] = {}
    for t in tasks:
        row = tx.execute(
            "UPDATE tasks SET available_at = CASE WHEN heartbeat_timeout IS NULL THEN ? "
            "ELSE available_at END WHERE task_id = ? AND fence = ? RETURNING cancel_requested",
            (tx.now + lease, t.task_id, t.fence),
        ).fetchone()
        if row is not None:
            out[t.task_id] = bool(row[0])
    return out


def _reclaim(tx: _Tx, worker_id: str) -> int:
    """Make the tasks leased to ``worker_id`` claimable now (its process restarted).

    Safe even if the old process is somehow alive: the next claim bumps each fence,
    so anything the old one tries to commit is refused.
    """
    rows = tx.execute(
        "UPDATE tasks SET available_at = ? WHERE lease_owner = ? AND available_at > ? "
        "RETURNING queue",
        (tx.now, worker_id, tx.now),
    ).fetchall()
    for (queue,) in rows:
        tx.ready.add(queue)
    return len(rows)


def _foreign_leases(tx: _Tx, queues: tuple[str, ...], worker_id: str) -> tuple[int, float | None]:
    marks = ",".join("?" * len(queues))
    row = tx.execute(
        f"SELECT count(*), max(available_at) FROM tasks WHERE queue IN ({marks}) "
        "AND lease_owner IS NOT NULL AND lease_owner <> ? AND available_at > ?",
        (*queues, worker_id, tx.now),
    ).fetchone()
    return (int(row[0]), row[1]) if row else (0, None)


def _release(tx: _Tx, tasks: tuple[Task, ...], delay: float = 0.0, unstarted: bool = False) -> None:
    """Give leased tasks back; ``unstarted`` ones never ran, so their claim's attempt
    is taken back too (a graceful stop must not use up a step's retries)."""
    undo = (
        ", attempt = CASE WHEN kind = 'activity' AND attempt > 0 THEN attempt - 1 ELSE attempt END"
        if unstarted
        else ""
    )
    for t in tasks:
        tx.execute(
            f"UPDATE tasks SET lease_owner = NULL, available_at = ?{undo} "
            "WHERE task_id = ? AND fence = ?",
            (tx.now + delay, t.task_id, t.fence),
        )
        tx.ready.add(t.queue)


def _heartbeat(tx: _Tx, task: Task, lease: float, details: str | None) -> bool:
    row = tx.execute(
        "UPDATE tasks SET available_at = ? + COALESCE(heartbeat_timeout, ?), "
        "heartbeat = coalesce(?, heartbeat) WHERE task_id = ? AND fence = ? "
        "RETURNING cancel_requested",
        (tx.now, lease, details, task.task_id, task.fence),
    ).fetchone()
    if row is None:
        raise LeaseLostError(
            f"activity task {task.task_id} of run {task.run_id!r} is no longer held by this "
            "worker (lease expired, run ended or cancelled); stop work and clean up"
        )
    return bool(row[0])


#: longest continue-as-new chain an operation follows (a guard against a cycle)
_MAX_CHAIN = 1_000_000


def _live_run(tx: _Tx, run_id: str, action: str) -> tuple[str, tuple[Any, ...]]:
    """The run an operation on ``run_id`` acts on, with its ``_run_row``, locked.

    A run that continued as new answers to its first id: the chain is followed to its
    live run. Each row is read under a row lock (PostgreSQL), so a run finishing or
    continuing concurrently is seen as it is after that commit, never overwritten.
    """
    rid = run_id
    for _ in range(_MAX_CHAIN):
        row = tx.execute(
            "SELECT status, queue, parent_run_id, parent_step, workflow, tenant, continued_to "
            f"FROM runs WHERE run_id = ?{tx.for_update}",
            (rid,),
        ).fetchone()
        if row is None:
            raise RunNotFoundError(run_id)
        if row[0] == RunStatus.CONTINUED_AS_NEW.value and row[6]:
            rid = row[6]
            continue
        if RunStatus(row[0]).is_terminal:
            raise RunFinishedError(rid, row[0], action)
        return rid, tuple(row[:6])
    raise StoreError(f"run {run_id!r} continues as new in a cycle")  # pragma: no cover


def _signal(tx: _Tx, run_id: str, name: str, payload: str) -> None:
    rid, (status, run_queue, _p, _s, workflow, _t) = _live_run(tx, run_id, f"signal {name!r} to")
    _append(tx, rid, EventType.SIGNAL_RECEIVED, None, {"name": name}, {"payload": payload})
    if status != RunStatus.QUEUED.value:  # a queued run sees the signal when admitted
        _ensure_workflow_task(tx, rid, run_queue, workflow)


def _cancel(tx: _Tx, run_id: str, reason: str | None) -> None:
    rid, (status, run_queue, _p, _s, workflow, _t) = _live_run(tx, run_id, "cancel")
    _append(tx, rid, EventType.CANCEL_REQUESTED, None, {"reason": reason})
    if status == RunStatus.QUEUED.value:  # never admitted: no code ran, nothing to undo
        error = {"type": "CancelledError", "message": reason or "cancelled before admission"}
        _finish(tx, rid, RunStatus.CANCELLED, error=error)
        return
    _ensure_workflow_task(tx, rid, run_queue, workflow)
    tx.execute(
        "UPDATE tasks SET cancel_requested = 1 WHERE run_id = ? AND kind = 'activity'", (rid,)
    )


def _terminate(tx: _Tx, run_id: str, reason: str | None) -> None:
    rid, _row = _live_run(tx, run_id, "terminate")
    _append(tx, rid, EventType.WORKFLOW_TERMINATED, None, {"reason": reason})
    _finish(
        tx,
        rid,
        RunStatus.TERMINATED,
        error={"type": "Terminated", "message": reason or "terminated by an operator"},
        children=True,
    )


def _close_children(tx: _Tx, run_id: str) -> None:
    """Apply each running child's parent-close policy: ``run_id`` has just ended.

    Children are found in the parent's own history (its ``ChildStarted`` events, with
    the policy each was started with; terminate by default) and followed to their live
    run when they continued as new. A child the parent already asked to cancel is left
    to finish its cancellation; ``abandon`` leaves a child running on its own.
    """
    started = tx.execute(
        "SELECT step, data FROM events WHERE run_id = ? AND type = ?",
        (run_id, EventType.CHILD_STARTED.value),
    ).fetchall()
    if not started:
        return
    asked = {
        json.loads(data).get("child_step")
        for (data,) in tx.execute(
            "SELECT data FROM events WHERE run_id = ? AND type = ?",
            (run_id, EventType.CHILD_CANCEL_REQUESTED.value),
        )
    }
    for step, data in started:
        info = json.loads(data)
        policy = info.get("parent_close", "terminate")
        if policy == "abandon" or step in asked:
            continue
        reason = f"parent run {run_id!r} ended (parent_close={policy!r})"
        try:
            rid, row = _live_run(tx, info["child_run_id"], "close")
        except (RunNotFoundError, RunFinishedError):
            continue
        if row[2] != run_id:
            continue  # a run of that id that this parent did not start
        if policy == "cancel":
            _cancel(tx, rid, reason)
        else:
            _terminate(tx, rid, reason)


def _suspend(tx: _Tx, run_id: str) -> None:
    rid, (status, *_) = _live_run(tx, run_id, "suspend")
    if status == RunStatus.SUSPENDED.value:
        return
    if status == RunStatus.QUEUED.value:
        raise RecoveryError(
            f"run {rid!r} is queued for admission and has not started: cancel it, or let "
            "it start and suspend it then"
        )
    _append(tx, rid, EventType.SUSPENDED, None, {})
    tx.execute("UPDATE runs SET status = 'suspended' WHERE run_id = ?", (rid,))


def _resume(tx: _Tx, run_id: str) -> None:
    rid, (status, run_queue, *_) = _live_run(tx, run_id, "resume")
    if status != RunStatus.SUSPENDED.value:
        return
    _append(tx, rid, EventType.RESUMED, None, {})
    tx.execute("UPDATE runs SET status = 'running' WHERE run_id = ?", (rid,))
    tx.ready.add(run_queue)
    for (q,) in tx.execute("SELECT DISTINCT queue FROM tasks WHERE run_id = ?", (rid,)):
        tx.ready.add(q)


def _get_run(tx: _Tx, run_id: str, follow: bool = False) -> RunInfo | None:
    """A run's row; with ``follow``, its chain's latest run (live or last) instead."""
    for _ in range(_MAX_CHAIN):
        row = tx.execute(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            return None
        info = _run_from_row(row)
        if not follow or info.continued_to is None:
            return info
        run_id = info.continued_to
    raise StoreError(f"run {run_id!r} continues as new in a cycle")  # pragma: no cover


def _list_runs(
    tx: _Tx,
    status: RunStatus | None,
    workflow: str | None,
    limit: int,
    offset: int,
    waiting_for: str | None = None,
) -> list[RunInfo]:
    where, args = [], []
    if waiting_for is not None:
        kind, _, name = waiting_for.partition(":")
        if kind == "admission":
            where.append("status = 'queued'")
        else:
            pattern = f'"kind":"{kind}"' + (f',"name":{json.dumps(name)}' if name else "")
            escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            where.append(
                "status IN ('pending', 'running', 'suspended') AND waiting_on LIKE ? ESCAPE '\\'"
            )
            args.append(f"%{escaped}%")
    if status is not None:
        where.append("status = ?")
        args.append(status.value)
    if workflow is not None:
        where.append("workflow = ?")
        args.append(workflow)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    rows = tx.execute(
        f"SELECT {_RUN_COLS} FROM runs {clause} ORDER BY created_at DESC, run_id LIMIT ? OFFSET ?",
        (*args, limit, offset),
    ).fetchall()
    return [_run_from_row(r) for r in rows]


def _next_due(tx: _Tx, queues: tuple[str, ...]) -> float | None:
    # batched tasks are due when their batch is (_batch_due), not when they became ready
    if tx.skip_locked:
        # PostgreSQL: one index endpoint lookup per queue (tasks_ready); min() over
        # ``queue IN (...)`` read every task of those queues on each idle poll
        row = tx.execute(
            "SELECT min(m.due) FROM unnest(?::text[]) AS q(name) CROSS JOIN LATERAL "
            "(SELECT t.available_at AS due FROM tasks t WHERE t.queue = q.name "
            "AND t.batch_key IS NULL ORDER BY t.available_at LIMIT 1) m",
            (list(queues),),
        ).fetchone()
    else:
        marks = ",".join("?" * len(queues))
        row = tx.execute(
            f"SELECT min(available_at) FROM tasks WHERE queue IN ({marks}) AND batch_key IS NULL",
            queues,
        ).fetchone()
    due: float | None = row[0] if row else None
    batched = _batch_due(tx, queues) if queues else None
    if batched is not None and (due is None or batched < due):
        return batched
    return due


def _has_limits(tx: _Tx, queue: str) -> bool:
    known = tx.limited.get(queue)
    if known is None:
        if queue in tx.known_limited:
            known = True
        elif tx.optimistic:  # almost always: no limits; the guard fails the batch if there are
            tx.guard("SELECT 1 / (1 - count(*))::int FROM queue_limits WHERE queue = ?", (queue,))
            known = False
        else:
            row = tx.execute("SELECT 1 FROM queue_limits WHERE queue = ?", (queue,)).fetchone()
            known = row is not None
            if known:
                tx.known_limited.add(queue)
        tx.limited[queue] = known
    return known


def _pause_on_429(tx: _Tx, queue: str, seconds: float) -> float | None:
    """Pause ``queue`` for ``seconds`` if it asks for that; return the pause end."""
    row = tx.execute(
        f"SELECT pause_on_429, paused_until FROM queue_limits WHERE queue = ?{tx.for_update}",
        (queue,),
    ).fetchone()
    if row is None or not row[0]:
        return None
    until = tx.now + max(0.0, seconds)
    if row[1] is not None and float(row[1]) > until:
        return float(row[1])
    tx.execute("UPDATE queue_limits SET paused_until = ? WHERE queue = ?", (until, queue))
    return until


def _configure_queue(tx: _Tx, queue: str, cfg: dict[str, Any]) -> None:
    """Create or update a queue's limits, keeping its live bucket and pause."""
    tx.limited.clear()  # queues cached as unlimited in this batch may not be now
    cols = ("max_concurrency", "rate", "burst", "key_concurrency", "fair", "pause_on_429")
    values = (
        cfg.get("max_concurrency"),
        cfg.get("rate"),
        cfg.get("burst"),
        cfg.get("key_concurrency"),
        1 if cfg.get("fair") else 0,
        1 if cfg.get("pause_on_429", True) else 0,
    )
    row = tx.execute(
        f"SELECT {', '.join(cols)}, tokens, refilled_at FROM queue_limits "
        f"WHERE queue = ?{tx.for_update}",
        (queue,),
    ).fetchone()
    if row is None:
        tx.execute(
            f"INSERT INTO queue_limits (queue, {', '.join(cols)}, tokens, refilled_at, "
            "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (queue, *values, values[2], tx.now, tx.now),
        )
        tx.ready.add(queue)
        return
    if tuple(row[: len(cols)]) == values:
        return  # every worker writes its config at start: most writes change nothing
    rate, burst = values[1], values[2]
    tokens: float | None = None
    if rate is not None and burst is not None:
        tokens = (
            float(burst)
            if row[1] is None  # the queue had no rate: start with a full bucket
            else min(float(burst), _tokens_now(tx, row[1], row[2], row[6], row[7]))
        )
    tx.execute(
        f"UPDATE queue_limits SET {', '.join(f'{c} = ?' for c in cols)}, tokens = ?, "
        "refilled_at = ?, updated_at = ? WHERE queue = ?",
        (*values, tokens, tx.now, tx.now, queue),
    )
    tx.ready.add(queue)


def _pause_queue(tx: _Tx, queue: str, until: float | None) -> None:
    """Set (or with None, clear) a queue's pause; an unconfigured queue gets a row."""
    tx.limited.clear()  # queues cached as unlimited in this batch may not be now
    tx.execute(
        "INSERT INTO queue_limits (queue, fair, pause_on_429, updated_at) VALUES (?, 0, 0, ?) "
        "ON CONFLICT DO NOTHING",
        (queue, tx.now),
    )
    tx.execute(
        "UPDATE queue_limits SET paused_until = ?, updated_at = ? WHERE queue = ?",
        (until, tx.now, queue),
    )
    if until is None:
        tx.ready.add(queue)


def _queue_stats(tx: _Tx) -> list[QueueStats]:
    now = tx.now
    counts: dict[str, list[Any]] = {}
    for q, ready, oldest, running, later in tx.execute(
        "SELECT queue, "
        "sum(CASE WHEN available_at <= ? THEN 1 ELSE 0 END), "
        "min(CASE WHEN available_at <= ? THEN available_at END), "
        f"sum(CASE WHEN {_RUNNING} THEN 1 ELSE 0 END), "
        "sum(CASE WHEN lease_owner IS NULL AND available_at > ? THEN 1 ELSE 0 END) "
        "FROM tasks GROUP BY queue",
        (now, now, now, now),
    ).fetchall():
        counts[q] = [int(ready or 0), oldest, int(running or 0), int(later or 0), {}]
    for q, key, n in tx.execute(
        "SELECT queue, limit_key, count(*) FROM tasks WHERE kind = 'activity' "
        f"AND limit_key IS NOT NULL AND {_RUNNING} GROUP BY queue, limit_key",
        (now,),
    ).fetchall():
        counts[q][4][key] = int(n)
    limits = {
        r[0]: tuple(r)
        for r in tx.execute(f"SELECT {_QL_COLS} FROM queue_limits").fetchall()
        if not str(r[0]).startswith(DEPENDENCY_PREFIX)  # dependency limiters: not queues
    }
    out: list[QueueStats] = []
    for q in sorted(set(counts) | set(limits)):
        ready, oldest, running, later, by_key = counts.get(q, [0, None, 0, 0, {}])
        row = limits.get(q)
        if row is None:
            out.append(
                QueueStats(
                    queue=q,
                    ready=ready,
                    oldest_ready_age=None if oldest is None else max(0.0, now - oldest),
                    running=running,
                    running_by_key=by_key,
                    scheduled=later,
                )
            )
            continue
        _q, cap, rate, burst, tokens, refilled_at, key_cap, fair, p429, paused, _c = row
        out.append(
            QueueStats(
                queue=q,
                ready=ready,
                oldest_ready_age=None if oldest is None else max(0.0, now - oldest),
                running=running,
                running_by_key=by_key,
                scheduled=later,
                paused_until=paused if paused is not None and paused > now else None,
                tokens=(
                    None if rate is None else _tokens_now(tx, rate, burst, tokens, refilled_at)
                ),
                max_concurrency=cap,
                rate=rate,
                burst=burst,
                key_concurrency=key_cap,
                fair=bool(fair),
                pause_on_429=bool(p429),
                configured=True,
            )
        )
    return out


# -- dead letters, retry and fork -------------------------------------------

_DL_COLS = (
    "id, run_id, step, kind, name, input, error, attempts, reason, created_at, resolved_at, "
    "resolution"
)


class RecoveryError(TetherError):
    """A retry, fork or dead-letter replay cannot be done in the run's current state."""


def _dead_letters(
    tx: _Tx, include_resolved: bool, run_id: str | None, limit: int
) -> list[DeadLetter]:
    where, args = [], []
    if not include_resolved:
        where.append("resolved_at IS NULL")
    if run_id is not None:
        where.append("run_id = ?")
        args.append(run_id)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    rows = tx.execute(
        f"SELECT {_DL_COLS} FROM dead_letters {clause} ORDER BY id LIMIT ?", (*args, limit)
    ).fetchall()
    return [DeadLetter.from_row(tuple(r)) for r in rows]


def _claim_dead_letter(tx: _Tx, letter_id: int) -> DeadLetter:
    row = tx.execute(
        f"UPDATE dead_letters SET resolved_at = ?, resolution = ? WHERE id = ? "
        f"AND resolved_at IS NULL RETURNING {_DL_COLS}",
        (tx.now, json.dumps({"state": "replaying"}), letter_id),
    ).fetchone()
    if row is None:
        raise RecoveryError(
            f"dead letter {letter_id} does not exist or was already replayed or resolved; "
            "list open ones with app.dead_letters()"
        )
    return DeadLetter.from_row(tuple(row))


def _resolve_dead_letter(tx: _Tx, letter_id: int, resolution: Any) -> None:
    if resolution is None:  # the replay failed: reopen it
        tx.execute(
            "UPDATE dead_letters SET resolved_at = NULL, resolution = NULL WHERE id = ?",
            (letter_id,),
        )
    else:
        tx.execute(
            "UPDATE dead_letters SET resolved_at = ?, resolution = ? WHERE id = ?",
            (tx.now, json.dumps(resolution), letter_id),
        )


def _live_history(tx: _Tx, run_id: str) -> list[Event]:
    """The run's history without events voided by earlier retries."""
    events = _read_history(tx, run_id, 0)
    voided: set[int] = set()
    for ev in events:
        if ev.type is EventType.RUN_RETRIED:
            voided.update(ev.data.get("voided", []))
    return [e for e in events if e.seq not in voided and e.type is not EventType.RUN_RETRIED]


def _pending_work(tx: _Tx, run_id: str, kept: list[Event], run_queue: str, fork: bool) -> None:
    """Re-create tasks for commands in ``kept`` that have no outcome and were not cancelled."""
    done = {e.step for e in kept if e.type in OUTCOMES}
    cancelled = {
        e.data.get("timer_step") or e.data.get("activity_step") or e.data.get("child_step")
        for e in kept
        if e.type
        in (
            EventType.TIMER_CANCELLED,
            EventType.ACTIVITY_CANCEL_REQUESTED,
            EventType.CHILD_CANCEL_REQUESTED,
        )
    }
    for e in kept:
        if e.step is None or e.step in done or e.step in cancelled:
            continue
        if e.type is EventType.ACTIVITY_SCHEDULED:
            hb = (e.data.get("options") or {}).get("heartbeat_timeout")
            if e.data.get("dependency") is not None:
                _ensure_dependency(tx, e.data["dependency"], e.data.get("dependency_limits") or {})
            tx.execute(
                "INSERT INTO tasks (run_id, kind, step, queue, name, payload, options, "
                "available_at, heartbeat_timeout, priority, limit_key, dependency, batch_key, "
                "batch_max, batch_wait, created_at) "
                "VALUES (?, 'activity', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    e.step,
                    e.data["queue"],
                    e.data["name"],
                    json.dumps(e.data.get("args", {})),
                    json.dumps(e.data.get("options", {})),
                    tx.now,
                    hb,
                    int(e.data.get("priority") or 0),
                    e.data.get("limit_key"),
                    e.data.get("dependency"),
                    *_batch_cols(e.data),
                    tx.now,
                ),
            )
            tx.ready.add(e.data["queue"])
        elif e.type is EventType.TIMER_STARTED:
            tx.execute(
                "INSERT INTO tasks (run_id, kind, step, queue, available_at, created_at) "
                "VALUES (?, 'timer', ?, ?, ?, ?)",
                (run_id, e.step, run_queue, e.data["fire_at"], tx.now),
            )
            tx.ready.add(run_queue)
        elif e.type is EventType.CHILD_STARTED:
            child = e.data["child_run_id"]
            if fork:
                _insert_run(
                    tx,
                    f"{run_id}/{e.step}",
                    e.data["workflow"],
                    e.data["queue"],
                    json.dumps(e.data.get("input")),
                    run_id,
                    e.step,
                )
                continue
            row = tx.execute(
                "SELECT status, output, error FROM runs WHERE run_id = ?", (child,)
            ).fetchone()
            if row is None or not RunStatus(row[0]).is_terminal:
                continue  # still running: its completion will reach this run
            if row[0] == RunStatus.COMPLETED.value:
                _append(
                    tx,
                    run_id,
                    EventType.CHILD_COMPLETED,
                    e.step,
                    {"child_run_id": child},
                    {"result": row[1] or "null"},
                )
            else:
                _append(
                    tx,
                    run_id,
                    EventType.CHILD_FAILED,
                    e.step,
                    {
                        "child_run_id": child,
                        "status": row[0],
                        "error": json.loads(row[2]) if row[2] else None,
                    },
                )


def _retry_run(tx: _Tx, run_id: str) -> None:
    status, run_queue, _p, _s, workflow, _t = _run_row(tx, run_id)
    if status not in (RunStatus.FAILED.value, RunStatus.NEEDS_INTERVENTION.value):
        raise RecoveryError(
            f"run {run_id!r} is {status}: only failed or needs_intervention runs can be "
            "retried (use app.fork to re-run a finished run from a chosen step)"
        )
    events = _live_history(tx, run_id)
    terminal = max(
        (e.seq for e in events if e.type in COMMANDS and e.step is not None and e.type in _ENDINGS),
        default=None,
    )
    failures = [
        e
        for e in events
        if e.type in (EventType.ACTIVITY_FAILED, EventType.CHILD_FAILED)
        and (terminal is None or e.seq < terminal)
    ]
    cut = failures[-1].seq if failures else (terminal or events[-1].seq)
    voided_cmd_steps = {
        e.step for e in events if e.seq > cut and e.type in COMMANDS and e.step is not None
    }
    voided = sorted(
        e.seq
        for e in events
        if e.seq == cut
        or (
            e.seq > cut
            and (
                e.type in COMMANDS
                or e.type is EventType.WORKFLOW_TASK_COMPLETED
                or (e.type in OUTCOMES and e.step in voided_cmd_steps)
            )
        )
    )
    voided_set = set(voided)
    kept = [e for e in events if e.seq not in voided_set]
    # steps that succeeded after the failure are voided with it, but their results are
    # offered back: if the code schedules the same activity at the same step again,
    # the recorded result is reused and the step does not run twice
    scheduled = {
        e.step: (e.data.get("name"), e.data.get("args"))
        for e in events
        if e.seq in voided_set and e.type is EventType.ACTIVITY_SCHEDULED
    }
    reuse = {
        str(e.step): {
            "name": scheduled[e.step][0],
            "args": scheduled[e.step][1],
            "result": e.data.get("result"),
        }
        for e in events
        if e.seq in voided_set and e.type is EventType.ACTIVITY_COMPLETED and e.step in scheduled
    }
    tx.execute(
        "UPDATE runs SET status = 'running', output = NULL, error = NULL, completed_at = NULL "
        "WHERE run_id = ?",
        (run_id,),
    )
    _append(tx, run_id, EventType.RUN_RETRIED, None, {"voided": voided, "cut": cut, "reuse": reuse})
    tx.finished[run_id] = None  # no longer finished: waiters woken by its end read it again
    tx.execute("DELETE FROM tasks WHERE run_id = ?", (run_id,))
    _pending_work(tx, run_id, kept, run_queue, fork=False)
    tx.execute(
        "UPDATE dead_letters SET resolved_at = ?, resolution = ? WHERE run_id = ? "
        "AND resolved_at IS NULL",
        (tx.now, json.dumps({"state": "retried"}), run_id),
    )
    _ensure_workflow_task(tx, run_id, run_queue, workflow)


def _fork_run(tx: _Tx, run_id: str, new_run_id: str, at_step: int) -> None:
    _status, run_queue, _p, _s, workflow, _t = _run_row(tx, run_id)
    if tx.execute("SELECT 1 FROM runs WHERE run_id = ?", (new_run_id,)).fetchone():
        raise RunIdConflictError(new_run_id, "an existing run")
    events = _live_history(tx, run_id)
    cut = next(
        (
            e.seq
            for e in events
            if (e.type in OUTCOMES and e.step is not None and e.step > at_step)
            or e.type in _ENDINGS
        ),
        None,
    )
    informational = (
        EventType.WORKFLOW_TERMINATED,
        EventType.SUSPENDED,
        EventType.RESUMED,
        EventType.ACTIVITY_ATTEMPT_FAILED,
    )
    # keep everything before the cut, plus later outcomes of steps up to ``at_step``:
    # with no marker after the cut, they are applied in the fork's first new task
    kept = [
        e
        for e in events
        if e.type not in informational
        and (
            cut is None
            or e.seq < cut
            or (e.type in OUTCOMES and e.step is not None and e.step <= at_step)
        )
    ]
    row = tx.execute("SELECT input FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    tx.execute(
        "INSERT INTO runs (run_id, workflow, status, queue, input, created_at, updated_at) "
        "VALUES (?, ?, 'running', ?, ?, ?, ?)",
        (new_run_id, workflow, run_queue, row[0], tx.now, tx.now),
    )
    for e in kept:
        data = dict(e.data)
        if e.type is EventType.WORKFLOW_STARTED:
            data["forked_from"] = {"run_id": run_id, "at_step": at_step}
        _append(tx, new_run_id, e.type, e.step, data)
    _pending_work(tx, new_run_id, kept, run_queue, fork=True)
    _ensure_workflow_task(tx, new_run_id, run_queue, workflow)


# -- circuit breakers ------------------------------------------------------


def _breaker_row(tx: _Tx, name: str) -> tuple[Any, ...]:
    row = tx.execute(
        f"SELECT state, opened_at, window_start, calls, failures, trial_at FROM breakers "
        f"WHERE name = ?{tx.for_update}",
        (name,),
    ).fetchone()
    if row is None:
        tx.execute(
            "INSERT INTO breakers (name, state, window_start, calls, failures) "
            "VALUES (?, 'closed', ?, 0, 0) ON CONFLICT DO NOTHING",
            (name, tx.now),
        )
        return ("closed", None, tx.now, 0, 0, None)
    return tuple(row)


def _breaker_admit(tx: _Tx, cfg: dict[str, Any]) -> float | None:
    """None if the call may go ahead, else seconds until the breaker may let one through."""
    name, cooldown = cfg["name"], float(cfg["cooldown"])
    state, opened_at, _ws, _c, _f, trial_at = _breaker_row(tx, name)
    if state == "closed":
        return None
    if state == "open":
        wait = float(opened_at) + cooldown - tx.now
        if wait > 0:
            return wait
        tx.execute(
            "UPDATE breakers SET state = 'half_open', trial_at = ? WHERE name = ?", (tx.now, name)
        )
        return None  # this caller is the trial
    # half-open: one trial at a time; a trial that never reported is replaced after a cooldown
    if trial_at is not None and tx.now - float(trial_at) < cooldown:
        return max(0.1, float(trial_at) + cooldown - tx.now)
    tx.execute("UPDATE breakers SET trial_at = ? WHERE name = ?", (tx.now, name))
    return None


def _breaker_record(tx: _Tx, cfg: dict[str, Any], ok: bool) -> None:
    name = cfg["name"]
    state, _opened, window_start, calls, failures, _trial = _breaker_row(tx, name)
    if state == "half_open":
        if ok:
            tx.execute(
                "UPDATE breakers SET state = 'closed', window_start = ?, calls = 0, "
                "failures = 0, trial_at = NULL WHERE name = ?",
                (tx.now, name),
            )
        else:
            tx.execute(
                "UPDATE breakers SET state = 'open', opened_at = ?, trial_at = NULL WHERE name = ?",
                (tx.now, name),
            )
        return
    if state == "open":
        return  # a call admitted before it opened: its outcome changes nothing
    if tx.now - float(window_start) > float(cfg["window"]):
        window_start, calls, failures = tx.now, 0, 0
    calls += 1
    failures += 0 if ok else 1
    if calls >= int(cfg["min_calls"]) and failures / calls >= float(cfg["failure_ratio"]):
        tx.execute(
            "UPDATE breakers SET state = 'open', opened_at = ?, window_start = ?, calls = 0, "
            "failures = 0 WHERE name = ?",
            (tx.now, tx.now, name),
        )
    else:
        tx.execute(
            "UPDATE breakers SET window_start = ?, calls = ?, failures = ? WHERE name = ?",
            (window_start, calls, failures, name),
        )


def _with_history(tx: _Tx, op: Op, read_after: int | None, *args: Any) -> Task | None:
    """Run an activity-outcome op; if it leased the run's workflow task to the caller,
    attach the history after ``read_after`` so the caller's cached instance continues
    without another round trip to the store."""
    leased: Task | None = op(tx, *args)
    if leased is None or read_after is None:
        return leased
    events = _read_history(tx, leased.run_id, read_after)
    return dataclasses.replace(leased, prefetched=tuple(events), prefetched_after=read_after)


def _complete_activity_fast(
    tx: _Tx,
    task: Task,
    result: str,
    workflow_result: WorkflowTaskResult,
    expected_seq: int,
    lease_to: str,
    lease_queues: tuple[str, ...],
    lease: float,
    lease_limit: int,
) -> tuple[bool, int, list[Task], Task | None]:
    """Record an activity's result AND the next workflow task it leads to, in one commit.

    The worker holding the run in its cache computed the workflow task on the
    assumption that the result lands at ``expected_seq`` with nothing else new. If
    that holds (and no workflow task is queued), both are committed here, without
    a workflow task row ever being written; otherwise only the result is recorded,
    as ``complete_activity`` would, and the caller drops its speculative instance.
    Returns (fast, marker seq, leased tasks, workflow task leased on the slow path).
    """
    _take_task(tx, task)
    row = tx.execute(
        "SELECT next_seq, status, queue, parent_run_id, parent_step, workflow, task_error, "
        "(SELECT 1 FROM tasks WHERE tasks.run_id = runs.run_id AND kind = 'workflow'), "
        "(SELECT 1 FROM queue_limits WHERE queue_limits.queue = ?), tenant "
        f"FROM runs WHERE run_id = ?{tx.for_update}",
        (task.queue, task.run_id),
    ).fetchone()
    if row is not None and task.queue not in tx.limited:
        tx.limited[task.queue] = row[8] is not None  # read here: one statement fewer
        if row[8] is not None:
            tx.known_limited.add(task.queue)
    if (
        row is None
        or row[0] != expected_seq
        or row[1] not in (RunStatus.RUNNING.value, RunStatus.PENDING.value)
        or row[7] is not None  # a workflow task is queued: something else is new
        or row[2] not in lease_queues
    ):
        # record the result alone, as complete_activity does (the row is gone already)
        _append_completed(tx, task, result)
        slow = _after_activity(tx, task, lease_to, lease_queues, lease)
        return False, 0, [], slow
    if task.dependency is not None or _has_limits(tx, task.queue):
        tx.ready.add(task.queue)  # a slot under its concurrency cap is free: wake claimers
    completed: list[_Pending] = [
        (
            EventType.ACTIVITY_COMPLETED,
            task.step,
            {},
            {"attempt": str(int(task.attempt)), "result": result},
        )
    ]
    marker, leased, _ended = _apply_workflow_result(
        tx,
        task.run_id,
        (row[1], row[2], row[3], row[4], row[5], row[9]),
        workflow_result,
        completed,
        expected_seq,
        lease_to,
        lease_queues,
        lease,
        lease_limit,
        activate=row[1] != RunStatus.RUNNING.value or row[6] is not None,
    )
    return True, marker, leased, None


# -- dependency limiters --------------------------------------------------------


def _ensure_dependency(tx: _Tx, dep: str, cfg: dict[str, Any]) -> None:
    """Create the dependency limiter row ``dep``; update it if its limits changed.

    The usual case (the row exists, unchanged) reads it without a lock, so
    scheduling never waits for claims holding the limiter.
    """
    row = tx.execute(
        "SELECT max_concurrency, rate, burst FROM queue_limits WHERE queue = ?", (dep,)
    ).fetchone()
    want = (cfg.get("max_concurrency"), cfg.get("rate"), cfg.get("burst"))
    if row is not None and tuple(row) == want:
        return
    _configure_queue(tx, dep, {**cfg, "fair": False, "key_concurrency": None})


def _dependency_feedback(
    tx: _Tx,
    task_id: int | None,
    dep: str | None,
    retry_after: float | None,
    error: dict[str, Any] | float | None = None,
) -> float | None:
    """Pause the dependency limiter ``dep`` (or the task's) by rate-limit feedback.

    ``retry_after`` is a 429's Retry-After; ``error`` is the recorded error (its
    ``ratelimit_pause``: seconds until the reset of an exhausted x-ratelimit
    budget) or directly that pause. Returns the pause end, or None.
    """
    if dep is None and task_id is not None:
        row = tx.execute("SELECT dependency FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
        dep = row[0] if row is not None else None
    if dep is None:
        return None
    pause = error if isinstance(error, float | int) else (error or {}).get("ratelimit_pause")
    waits = [float(w) for w in (retry_after, pause) if w is not None and float(w) > 0]
    if not waits:
        return None
    until = tx.now + max(waits)
    row = tx.execute(
        f"SELECT paused_until FROM queue_limits WHERE queue = ?{tx.for_update}", (dep,)
    ).fetchone()
    if row is None:
        return None
    if row[0] is not None and float(row[0]) >= until:
        return float(row[0])
    tx.execute(
        "UPDATE queue_limits SET paused_until = ?, tokens = CASE WHEN rate IS NULL THEN tokens "
        "ELSE 0 END, refilled_at = CASE WHEN rate IS NULL THEN refilled_at ELSE ? END "
        "WHERE queue = ?",
        (until, until, dep),
    )
    return until


# -- debounce ----------------------------------------------------------------------


def _debounce(
    tx: _Tx,
    key: str,
    run_id: str,
    workflow: str,
    queue: str,
    input: str,
    window: float,
    max_wait: float | None,
) -> tuple[str, int, float]:
    """Record one trigger of debounce ``key``: keep the LAST input, push the due time
    to ``window`` after this trigger (but at most ``max_wait`` after the first).

    Returns (the run id the debounce will start, triggers so far, due time).
    """
    row = tx.execute(
        "INSERT INTO debounces (debounce_key, run_id, workflow, queue, input, triggers, "
        "first_at, due_at, updated_at) VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?) "
        "ON CONFLICT (debounce_key) DO UPDATE SET input = excluded.input, "
        "workflow = excluded.workflow, queue = excluded.queue, "
        "triggers = debounces.triggers + 1, due_at = excluded.due_at, "
        "updated_at = excluded.updated_at RETURNING run_id, triggers, first_at, queue",
        (key, run_id, workflow, queue, input, tx.now, tx.now + window, tx.now),
    ).fetchone()
    rid, triggers, first_at, q = row[0], int(row[1]), float(row[2]), row[3]
    due = tx.now + window
    if max_wait is not None and first_at + max_wait < due:
        due = max(tx.now, first_at + max_wait)
        tx.execute("UPDATE debounces SET due_at = ? WHERE debounce_key = ?", (due, key))
    if triggers == 1:
        tx.execute(
            "INSERT INTO tasks (run_id, kind, queue, name, available_at, created_at) "
            "VALUES (?, 'debounce', ?, ?, ?, ?)",
            (rid, q, key, due, tx.now),
        )
    else:  # a task being fired right now sees the later due time and waits again
        tx.execute(
            "UPDATE tasks SET queue = ?, available_at = ? WHERE run_id = ? AND kind = 'debounce' "
            "AND lease_owner IS NULL",
            (q, due, rid),
        )
    tx.ready.add(q)
    return rid, triggers, due


def _fire_debounce(tx: _Tx, task: Task) -> None:
    """A debounce came due: start its run with the last input (or wait, if re-triggered)."""
    row = tx.execute(
        "SELECT run_id, workflow, queue, input, due_at FROM debounces "
        f"WHERE debounce_key = ?{tx.for_update}",
        (task.name,),
    ).fetchone()
    if row is None or row[0] != task.run_id:
        tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
        return
    run_id, workflow, queue, input, due_at = row
    if float(due_at) > tx.now:  # triggered again after this task was claimed
        tx.execute(
            "UPDATE tasks SET lease_owner = NULL, available_at = ? WHERE task_id = ?",
            (due_at, task.task_id),
        )
        tx.ready.add(queue)
        return
    tx.execute("DELETE FROM debounces WHERE debounce_key = ?", (task.name,))
    tx.execute("DELETE FROM tasks WHERE task_id = ?", (task.task_id,))
    if tx.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone() is None:
        _insert_run(tx, run_id, workflow, queue, input)
