"""Operator and client control of a live run: signal, cancel, terminate,
suspend, resume; a chain answers to its first id; children closed by policy.
"""

from __future__ import annotations

import json
from typing import Any

from ..._definitions import chain_of
from ..._errors import RunFinishedError, RunNotFoundError, StoreError
from ..._history import EventType, RunStatus
from ._tx import _Tx

#: longest continue-as-new chain an operation follows (a guard against a cycle)
_MAX_CHAIN = 1_000_000


def _chain_head(tx: _Tx, run_id: str) -> str | None:
    """The latest run of ``run_id``'s continue-as-new chain as the ``chains`` table
    records it, when that is further along the chain than ``run_id`` (else None).

    One primary-key read, whatever the chain's length: what lets an operation on any
    link reach the live run without reading (or locking) the links in between."""
    first, n = chain_of(run_id)
    row = tx.execute("SELECT head_run_id FROM chains WHERE chain_id = ?", (first,)).fetchone()
    if row is None:
        return None
    base, k = chain_of(row[0])
    return row[0] if base == first and k > n else None


def _next_link(tx: _Tx, run_id: str, continued_to: str, jump: bool) -> str:
    """Where to look next from ``run_id``, which continued as new into ``continued_to``:
    the chain's recorded head when ``jump`` and it lies beyond, else the next link."""
    head = _chain_head(tx, run_id) if jump else None
    return head if head is not None else continued_to


def _note_chain_head(tx: _Tx, run_id: str, nxt: str) -> None:
    """Record ``nxt`` as the latest run of ``run_id``'s chain (``run_id`` continued as
    new into it), in the transaction that commits the continue-as-new."""
    tx.execute(
        "INSERT INTO chains (chain_id, head_run_id) VALUES (?, ?) "
        "ON CONFLICT (chain_id) DO UPDATE SET head_run_id = excluded.head_run_id",
        (chain_of(run_id)[0], nxt),
    )


def _live_run(tx: _Tx, run_id: str, action: str) -> tuple[str, tuple[Any, ...]]:
    """The run an operation on ``run_id`` acts on, with its ``_run_row``, locked.

    A run that continued as new answers to its first id (and to every other id of its
    chain): the operation goes to the chain's head as ``chains`` records it, reading
    (and locking) only the run addressed and that head. The head's row is read under a
    row lock (PostgreSQL), then checked to be live still: a head that continued
    meanwhile sends the lookup on to the new head, so a run finishing or continuing
    concurrently is seen as it is after that commit, never overwritten. A chain
    without its row (or one that disagrees) is followed link by link, as before.
    """
    rid = run_id
    jump = True
    fallback: str | None = None  # the next link, should the recorded head be missing
    for _ in range(_MAX_CHAIN):
        row = tx.execute(
            "SELECT status, queue, parent_run_id, parent_step, workflow, tenant, continued_to "
            f"FROM runs WHERE run_id = ?{tx.for_update}",
            (rid,),
        ).fetchone()
        if row is None:
            if fallback is not None:  # a stale head (its run removed): follow the links
                rid, fallback, jump = fallback, None, False
                continue
            raise _not_found(tx, run_id)
        if row[0] == RunStatus.CONTINUED_AS_NEW.value and row[6]:
            nxt = _next_link(tx, rid, row[6], jump)
            fallback = row[6] if nxt != row[6] else None
            rid = nxt
            continue
        if RunStatus(row[0]).is_terminal:
            raise RunFinishedError(rid, row[0], action)
        return rid, tuple(row[:6])
    raise StoreError(f"run {run_id!r} continues as new in a cycle")  # pragma: no cover


def _signal(
    tx: _Tx, run_id: str, name: str, payload: str, signal_id: str | None = None
) -> tuple[str, int, bool]:
    """Append the signal to the run (its live run if it continued as new); (that run's
    id, the signal's seq in its history, True).

    With a ``signal_id`` that already arrived in the run's continue-as-new chain (in
    ``signal_ids``), nothing is recorded: (the run it went to, its seq there, False),
    also when the run has ended since. The live run's row lock (PostgreSQL) makes
    concurrent sends of one id take turns: the second sees the first's row."""
    try:
        rid, (status, run_queue, _p, _s, workflow, _t) = _live_run(
            tx, run_id, f"signal {name!r} to"
        )
    except RunFinishedError as exc:
        seen = None if signal_id is None else _signal_arrived(tx, exc.run_id, signal_id)
        if seen is None:
            raise
        return seen[0], seen[1], False
    data: dict[str, Any] = {"name": name}
    if signal_id is not None:
        seen = _signal_arrived(tx, rid, signal_id)
        if seen is not None:
            return seen[0], seen[1], False
        data["signal_id"] = signal_id
    seq = _append(tx, rid, EventType.SIGNAL_RECEIVED, None, data, {"payload": payload})
    if signal_id is not None:
        tx.execute(
            "INSERT INTO signal_ids (chain_id, signal_id, run_id, seq, created_at) "
            "VALUES (?, ?, ?, ?, ?)",
            (chain_of(rid)[0], signal_id, rid, seq, tx.now),
        )
    if status != RunStatus.QUEUED.value:  # a queued run sees the signal when admitted
        _ensure_workflow_task(tx, rid, run_queue, workflow)
    return rid, seq, True


def _signal_arrived(tx: _Tx, run_id: str, signal_id: str) -> tuple[str, int] | None:
    """Where the signal ``signal_id`` of ``run_id``'s continue-as-new chain went: (run
    id, seq), or None if no signal of that id arrived."""
    row = tx.execute(
        "SELECT run_id, seq FROM signal_ids WHERE chain_id = ? AND signal_id = ?",
        (chain_of(run_id)[0], signal_id),
    ).fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


def _cancel(tx: _Tx, run_id: str, reason: str | None) -> None:
    rid, (status, run_queue, _p, _s, workflow, _t) = _live_run(tx, run_id, "cancel")
    # a run already cancelled (or past its deadline) is cleaning up: a repeat is recorded,
    # but neither its code (WorkflowInstance._interrupt) nor the steps of its cleanup are
    # told to stop again
    repeat = (
        tx.execute(
            "SELECT 1 FROM events WHERE run_id = ? AND type IN (?, ?) LIMIT 1",
            (rid, EventType.CANCEL_REQUESTED.value, EventType.DEADLINE_EXCEEDED.value),
        ).fetchone()
        is not None
    )
    _append(tx, rid, EventType.CANCEL_REQUESTED, None, {"reason": reason})
    if status == RunStatus.QUEUED.value:  # never admitted: no code ran, nothing to undo
        error = {"type": "CancelledError", "message": reason or "cancelled before admission"}
        _finish(tx, rid, RunStatus.CANCELLED, error=error)
        return
    _ensure_workflow_task(tx, rid, run_queue, workflow)
    if not repeat:
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
        json.loads(tx.open(data, f"run {run_id!r}, events") or "{}").get("child_step")
        for (data,) in tx.execute(
            "SELECT data FROM events WHERE run_id = ? AND type = ?",
            (run_id, EventType.CHILD_CANCEL_REQUESTED.value),
        )
    }
    for step, data in started:
        info = json.loads(tx.open(data, f"run {run_id!r}, step {step}") or "{}")
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


# operations of other concerns (imported last: see the package docstring)
from .history import _append  # noqa: E402
from .recovery import RecoveryError  # noqa: E402
from .runs import _finish, _not_found  # noqa: E402
from .tasks import _ensure_workflow_task  # noqa: E402
