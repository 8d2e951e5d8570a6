"""Runs: creating them (with an eager first task), ending them, reading them."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..._errors import (
    AdmissionLimitError,
    RunIdConflictError,
    RunNotFoundError,
    RunPurgedError,
    StoreError,
    SwitchedOffError,
)
from ..._history import EventType, RunEnd, RunInfo, RunStatus, Task
from ..._serde import dumps
from ..._serde import json_equal as _equal
from ..base import StartResult, WorkflowTaskResult, start_event_data
from ._tx import _RUN_COLS, _opened, _run_from_row, _Tx


def _run_row(tx: _Tx, run_id: str, *, lock: bool = False) -> tuple[Any, ...]:
    """(status, queue, parent_run_id, parent_step, workflow, tenant) of a run.

    ``lock``: read it under a row lock (PostgreSQL; SQLite's write lock serialises
    anyway), for an operation that changes the run by the status it reads here: one
    running concurrently waits, then reads the status this one left."""
    row = tx.execute(
        "SELECT status, queue, parent_run_id, parent_step, workflow, tenant FROM runs "
        f"WHERE run_id = ?{tx.for_update if lock else ''}",
        (run_id,),
    ).fetchone()
    if row is None:
        raise _not_found(tx, run_id)
    return tuple(row)


def _not_found(tx: _Tx, run_id: str) -> RunNotFoundError:
    """The error for a run the store does not have: ``RunPurgedError`` if it was purged."""
    purged = _purged_run(tx, run_id)
    return RunNotFoundError(run_id) if purged is None else RunPurgedError(run_id, *purged)


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
    attrs: dict[str, Any] | None = None,
) -> Task | None:
    """Insert a run and its start event; unless ``queued`` or not ``task``, its workflow task.

    Without ``start_event`` the caller appends the start event (``_start_event``) as seq 1,
    and the run is ``running`` at once: its first workflow task is recorded with it
    (eager start), so it never is ``pending``.
    """
    if tx.codec is not None:
        # for this operation's seals alone: the codec's cache learns it from the stored row
        if tx.inserting is None:
            tx.inserting = {}
        tx.inserting[run_id] = tenant
    tx.execute(
        "INSERT INTO runs (run_id, workflow, status, queue, input, parent_run_id, parent_step, "
        "created_at, updated_at, tenant, attrs, next_seq) VALUES (?,?,?,?,?,?,?,?,?,?,?,2)",
        (
            run_id,
            workflow,
            "queued" if queued else ("pending" if start_event else "running"),
            queue,
            tx.seal(input, run_id),
            parent_run_id,
            parent_step,
            tx.now,
            tx.now,
            tenant,
            json.dumps(attrs) if attrs else None,
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
        _, _, data, raw = _start_event(workflow, input, deadline_at, tenant, parent_run_id, attrs)
        tx.touched.add(run_id)
        tx.execute(
            "INSERT INTO events (run_id, seq, type, step, data, created_at) "
            "VALUES (?,1,?,NULL,?,?)",
            (run_id, EventType.WORKFLOW_STARTED.value, tx.data(run_id, data, raw), tx.now),
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
    attrs: dict[str, Any] | None = None,
) -> _Pending:
    """A run's ``WorkflowStarted`` event, to append as its seq 1."""
    data = start_event_data(workflow, deadline_at, tenant, parent_run_id, attrs)
    return (EventType.WORKFLOW_STARTED, None, data, {"input": input})


def _same_input(stored: str | None, given: str) -> bool:
    """Whether a start's input equals a run's, as values: a client that retries with
    its object's keys in another order, or ``100.0`` for ``100``, starts the same run."""
    if stored == given:
        return True
    try:
        return _equal(json.loads(stored or "null"), json.loads(given))
    except ValueError:
        return False


#: what a start is asked for besides its input, kept in the run's attrs: a start that
#: repeats the run id asks for the same, or it is a conflict (not silently dropped)
_START_ATTRS = ("budget", "deadline", "webhook")


def _differences(
    tx: _Tx, existing: RunInfo, input: str, attrs: dict[str, Any] | None
) -> tuple[str, ...]:
    """What a start of an existing run asks for that the run was not started with: its
    input, and each of ``_START_ATTRS`` (names, never values)."""
    out = [] if _same_input(existing.input, input) else ["input"]
    had, asked = existing.attrs or {}, attrs or {}
    for key in _START_ATTRS:
        if key == "deadline" and key not in had and asked.get(key) is not None:
            # not recorded: the run had no deadline, or was started before the deadline
            # asked for was kept in its attrs (its seconds unknown: any deadline matches)
            if not _had_unrecorded_deadline(tx, existing):
                out.append(key)
            continue
        if not _equal(json.loads(json.dumps(had.get(key))), json.loads(json.dumps(asked.get(key)))):
            out.append(key)
    return tuple(out)


def _had_unrecorded_deadline(tx: _Tx, run: RunInfo) -> bool:
    """Whether ``run`` has a deadline its attrs do not name: it was started before the
    deadline asked for was kept there (its start event has always had ``deadline_at``)."""
    row = tx.execute(
        "SELECT data FROM events WHERE run_id = ? AND seq = 1", (run.run_id,)
    ).fetchone()
    if row is None:
        return False
    text = _opened(tx.codec, row[0], run.run_id, "start event", keep=True) or "{}"
    if not text.startswith("{"):
        return True  # sealed or offloaded and not readable here: unknown, not different
    data = json.loads(text)
    return isinstance(data, dict) and data.get("deadline_at") is not None


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
    attrs: dict[str, Any] | None = None,
    if_exists: str = "same_input",
    signal: tuple[str, str] | None = None,
    signal_id: str | None = None,
) -> StartResult:
    # optimistic: no read; if the run exists, inserting it fails and the safe path reads
    row = None
    if not tx.optimistic or signal is not None or if_exists != "same_input":
        row = tx.execute(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    if row is not None:
        existing = _run_from_row(row, tx.codec)
        if existing.workflow != workflow:
            raise RunIdConflictError(run_id, f"workflow {existing.workflow!r}")
        if existing.tenant != tenant:  # another tenant's run: never returned nor signalled
            raise RunIdConflictError(run_id, f"tenant {existing.tenant!r}")
        if if_exists == "reject":
            raise RunIdConflictError(run_id, "a run (this start refuses to join it)")
        if if_exists == "same_input" and signal is None:
            differ = _differences(tx, existing, input, attrs)
            if differ:
                raise RunIdConflictError(run_id, f"different {', '.join(differ)}", fields=differ)
        if signal is None:
            return StartResult(run=existing, created=False)
        # to the run (its live run, if it continued as new)
        rid, seq, new = _signal(tx, run_id, signal[0], signal[1], signal_id)
        return StartResult(run=existing, created=False, signalled=(rid, seq), signal_new=new)
    # a run id names one run ever: a purged one is not started again
    if tx.optimistic:  # PostgreSQL, no wait: the guard fails the batch, run again safely
        tx.guard("SELECT 1 / (1 - count(*)::int) FROM purged_runs WHERE run_id = ?", (run_id,))
    else:
        purged = _purged_run(tx, run_id)
        if purged is not None:
            raise RunPurgedError(run_id, *purged)
    if signal is not None:
        first = None  # the first workflow task must see the signal: no eager task
    queued = False
    if tenant is not None:
        off = tx.execute(
            "SELECT 1 FROM switches WHERE kind = 'tenant' AND name = ?", (tenant,)
        ).fetchone()
        if off is not None:  # an operator stopped this tenant's new runs
            raise SwitchedOffError("tenant", tenant)
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
        attrs=attrs,
    )
    signalled = None
    if signal is not None:  # right after the start event: the code's first task sees it
        signalled = _signal(tx, run_id, signal[0], signal[1], signal_id)[:2]
    if eager:
        assert first is not None
        # the start event, the task's commands and its marker in one history write, the
        # counter in one update (the run was inserted running)
        marker, acts, ended = _apply_workflow_result(
            tx,
            run_id,
            (RunStatus.RUNNING.value, queue, None, None, workflow, tenant),
            first,
            [_start_event(workflow, input, deadline_at, tenant, attrs=attrs)],
            1,
            lease_to,
            lease_queues,
            lease,
            lease_limit,
        )
        if ended or any(c.type is EventType.STATUS_SET for c in first.commands):
            row = tx.execute(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = ?", (run_id,))
            info = _run_from_row(row.fetchone(), tx.codec)
        else:  # nothing else can have changed it: no read back
            info = _new_run(tx, run_id, workflow, RunStatus.RUNNING, queue, input, tenant, attrs)
        return StartResult(run=info, created=True, first_marker=marker, first_leased=tuple(acts))
    if leased is None:
        status = RunStatus.QUEUED if queued else RunStatus.PENDING
        return StartResult(
            run=_new_run(tx, run_id, workflow, status, queue, input, tenant, attrs),
            created=True,
            signalled=signalled,
        )
    row = tx.execute(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    if leased is not None:  # hand the worker the history too: it needs no read to start
        events = _read_history(tx, run_id, 0)
        leased = dataclasses.replace(leased, prefetched=tuple(events), prefetched_after=0)
    return StartResult(
        run=_run_from_row(row, tx.codec), created=True, leased=leased, signalled=signalled
    )


def _new_run(
    tx: _Tx,
    run_id: str,
    workflow: str,
    status: RunStatus,
    queue: str,
    input: str,
    tenant: str | None,
    attrs: dict[str, Any] | None = None,
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
        attrs=attrs,
    )


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
    ran: bool = False,
    spend: dict[str, Any] | None = None,
) -> None:
    """End a run: its status and outcome, its tasks gone, its parent and tenant told.
    With ``ran`` (its own code ended it), a failed workflow task's error is cleared;
    ``spend`` (its model spend, when it had a budget) goes to its parent with its end.

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
    if tx.codec is not None:
        tx.learn(run_id, tenant)
    tx.execute(
        "UPDATE runs SET status = ?, output = ?, error = ?, continued_to = ?, completed_at = ?, "
        f"waiting_on = NULL{', task_error = NULL' if ran else ''}, "
        f"updated_at = ?{', next_seq = ?' if next_seq is not None else ''} WHERE run_id = ?",
        (
            status.value,
            tx.seal(output, run_id),
            tx.seal_error(dumps(error), run_id) if error else None,
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
    if status is not RunStatus.CONTINUED_AS_NEW:
        _queue_webhook(tx, run_id)  # its outcome for its callback URL, in this commit
    # the continuation keeps the run's place; otherwise admit the tenant's oldest queued
    # run, in this commit
    if status is not RunStatus.CONTINUED_AS_NEW and tenant is not None:
        _promote(tx, tenant)
    if status in (RunStatus.FAILED, RunStatus.NEEDS_INTERVENTION, RunStatus.TIMED_OUT):
        tx.execute(
            "INSERT INTO dead_letters (run_id, kind, name, input, error, reason, created_at) "
            "SELECT run_id, 'run', workflow, input, ?, ?, ? FROM runs WHERE run_id = ?",
            (
                tx.seal_error(json.dumps(error), run_id) if error else None,
                status.value,
                tx.now,
                run_id,
            ),
        )
    if parent_run_id is None or status is RunStatus.CONTINUED_AS_NEW:
        return
    # under the parent's row lock (PostgreSQL): a parent another transaction is ending
    # (or retrying) is read as it leaves it, so an ended parent is never told (and given
    # a workflow task) and a retried one always is (its retry reads this run's end)
    pstatus, pqueue, _pp, _ps, pworkflow, _pt = _run_row(tx, parent_run_id, lock=True)
    if RunStatus(pstatus).is_terminal:
        return
    told = {"model_spend": spend} if spend is not None else {}
    if status is RunStatus.COMPLETED:
        _append(
            tx,
            parent_run_id,
            EventType.CHILD_COMPLETED,
            parent_step,
            {"child_run_id": run_id, **told},
            {"result": output or "null"},
        )
    else:
        _append(
            tx,
            parent_run_id,
            EventType.CHILD_FAILED,
            parent_step,
            {"child_run_id": run_id, "status": status.value, "error": error, **told},
        )
    _ensure_workflow_task(tx, parent_run_id, pqueue, pworkflow)


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


def _get_run(tx: _Tx, run_id: str, follow: bool = False, lenient: bool = False) -> RunInfo | None:
    """A run's row; with ``follow``, its chain's latest run (live or last) instead;
    ``lenient``: fields that cannot be read are marked ``unavailable``, not raised.

    Following reads the chain's head from ``chains`` (one read, whatever the chain's
    length), re-checked to be the latest still; link by link when that is missing."""
    jump = True
    fallback: str | None = None
    for _ in range(_MAX_CHAIN):
        row = tx.execute(f"SELECT {_RUN_COLS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            if fallback is not None:  # a stale head (its run removed): follow the links
                run_id, fallback, jump = fallback, None, False
                continue
            return None
        info = _run_from_row(row, tx.codec, lenient)
        if not follow or info.continued_to is None:
            return info
        nxt = _next_link(tx, run_id, info.continued_to, jump)
        fallback = info.continued_to if nxt != info.continued_to else None
        run_id = nxt
    raise StoreError(f"run {run_id!r} continues as new in a cycle")  # pragma: no cover


def _contains(text: str) -> str:
    """A LIKE pattern (escape character ``\\``) matching text that contains ``text``."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _list_runs(
    tx: _Tx,
    status: RunStatus | None,
    workflow: str | None,
    limit: int,
    offset: int,
    waiting_for: str | None = None,
    before: tuple[float, str] | None = None,
    tenant: str | None = None,
    since: float | None = None,
    error_type: str | None = None,
    search: str | None = None,
    stuck: bool = False,
) -> list[RunInfo]:
    where: list[str] = []
    args: list[Any] = []
    if stuck:
        # live runs only: through the runs_by_status index, never a scan of ended runs
        where.append("status IN ('pending', 'running', 'suspended') AND task_error IS NOT NULL")
    if tenant is not None:
        where.append("tenant = ?")
        args.append(tenant)
    if since is not None:
        where.append("created_at >= ?")
        args.append(since)
    if search:
        where.append("run_id LIKE ? ESCAPE '\\'")
        args.append(_contains(search))
    if error_type is not None:
        where.append("error LIKE ? ESCAPE '\\'")
        args.append(_contains(f'"type":{json.dumps(error_type)}'))
    if before is not None:  # keyset paging: stable while runs are added
        where.append("(created_at < ? OR (created_at = ? AND run_id > ?))")
        args += [before[0], before[0], before[1]]
    if waiting_for is not None:
        kind, _, name = waiting_for.partition(":")
        if kind == "admission":
            where.append("status = 'queued'")
        else:
            pattern = f'"kind":"{kind}"' + (f',"name":{json.dumps(name)}' if name else "")
            where.append(
                "status IN ('pending', 'running', 'suspended') AND waiting_on LIKE ? ESCAPE '\\'"
            )
            args.append(_contains(pattern))
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
    # a run whose payload cannot be read is listed with it marked, never failing the page
    return [_run_from_row(r, tx.codec, True) for r in rows]


# operations of other concerns (imported last: see the package docstring)
from .admission import _admission, _admit_queued, _promote  # noqa: E402
from .control import _MAX_CHAIN, _close_children, _next_link, _signal  # noqa: E402
from .history import _append, _Pending, _read_history  # noqa: E402
from .retention import _purged_run  # noqa: E402
from .tasks import _ensure_workflow_task  # noqa: E402
from .webhooks import _queue_webhook  # noqa: E402
from .workflow_tasks import _apply_workflow_result  # noqa: E402


def _run_status(tx: _Tx, run_id: str) -> RunStatus | None:
    """A run's status (None: no such run); no payload is read or opened."""
    row = tx.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return RunStatus(row[0]) if row else None


def _run_tenant(tx: _Tx, run_id: str) -> str | None:
    """A run's tenant (None: none, or no such run), remembered by the codec."""
    if tx.codec is None:
        row = tx.execute("SELECT tenant FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return row[0] if row else None
    return tx.tenant_of(run_id)
