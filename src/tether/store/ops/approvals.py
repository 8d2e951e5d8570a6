"""Open reviews of ``tether.approval``: kept in step with the run's approval markers.

The workflow records every approval event as a ``Marker``; the commit that appends
it also updates the ``approvals`` row, so the list of open reviews can never
disagree with history. A review whose run ended without a decision reads as
``closed``.
"""

from __future__ import annotations

import json
from typing import Any

from ..._history import APPROVAL_SIGNAL, RunStatus
from ._tx import _Tx

#: the markers that change a review's row
APPROVAL_MARKERS = frozenset(
    {
        "approval_requested",
        "approval_escalated",
        "approval_reminder",
        "approval_refused",
        "approval_decided",
    }
)

#: the status of a review while a decision is on its way to the run (delivered, not yet
#: taken or refused by it): further decisions are refused meanwhile
DECIDING = "deciding"

#: what refuses a decision delivered after the current level's deadline (the run has
#: not yet taken the deadline: its timer waits for a worker), never a review's status
PAST_DEADLINE = "past_deadline"

_COLS = (
    "a.approval_id, a.run_id, a.name, a.fingerprint, a.proposal, a.approvers, a.deadline_at, "
    "a.status, a.level, a.allow_edit, a.decided_by, a.decided_at, a.reason, a.reminded_at, "
    "a.created_at, a.updated_at, r.tenant, r.status, r.workflow"
)


def _apply_approval_marker(tx: _Tx, run_id: str, marker: str, raw: str) -> None:
    """Bring the review's row up to date with one approval marker of ``run_id``."""
    value: dict[str, Any] = json.loads(raw)
    aid = value["approval_id"]
    if marker == "approval_requested":
        tx.execute(
            "INSERT INTO approvals (approval_id, run_id, name, fingerprint, proposal, approvers, "
            "deadline_at, status, level, allow_edit, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, 'open', 0, ?, ?, ?) ON CONFLICT (approval_id) DO NOTHING",
            (
                aid,
                run_id,
                value["name"],
                value["fingerprint"],
                tx.seal(json.dumps(value["proposal"]), run_id),
                json.dumps(value["approvers"]),
                value["deadline_at"],
                1 if value.get("allow_edit") else 0,
                tx.now,
                tx.now,
            ),
        )
    elif marker == "approval_escalated":
        tx.execute(
            "UPDATE approvals SET approvers = ?, deadline_at = ?, level = ?, reminded_at = NULL, "
            "updated_at = ? WHERE approval_id = ?",
            (json.dumps(value["approvers"]), value["deadline_at"], value["level"], tx.now, aid),
        )
    elif marker == "approval_reminder":
        tx.execute(
            "UPDATE approvals SET reminded_at = ?, updated_at = ? WHERE approval_id = ?",
            (tx.now, tx.now, aid),
        )
    elif marker == "approval_refused":
        if value.get("held"):  # the decision that held the review was refused: reopen it
            tx.execute(
                "UPDATE approvals SET status = 'open', decided_by = NULL, decided_at = NULL, "
                "updated_at = ? WHERE approval_id = ? AND status = ?",
                (tx.now, aid, DECIDING),
            )
    elif marker == "approval_decided":
        status = "approved" if value["approved"] else "rejected"
        if value.get("timed_out"):
            status = "expired_" + status
        tx.execute(
            "UPDATE approvals SET status = ?, decided_by = ?, decided_at = ?, reason = ?, "
            "updated_at = ? WHERE approval_id = ?",
            (status, value.get("by"), tx.now, tx.seal(value.get("reason"), run_id), tx.now, aid),
        )


def _deliver_decision(
    tx: _Tx, approval_id: str, payload: str, by: str, hold: bool
) -> tuple[str, str | None] | None:
    """Deliver a decision to the review's run if the review is open, in one commit.

    ``hold`` (a decision that names the proposal's fingerprint and comes from an
    approver) also marks the review ``deciding`` until the run takes the decision or
    refuses it (``approval_refused`` with ``held`` reopens it), so of two decisions at
    once only the first reaches the run. None when delivered; else the review's
    (status, decided_by) that refused it (``missing``: no such review;
    ``past_deadline``: the current level's deadline has passed, its timer not yet taken).
    """
    row = tx.execute(
        "SELECT run_id FROM approvals WHERE approval_id = ?", (approval_id,)
    ).fetchone()
    if row is None:
        return ("missing", None)
    run_id = row[0]
    # the run's row first, locked (PostgreSQL): the order a workflow task's commit takes
    # them in; then the review as it is after any commit that changed it
    run = tx.execute(
        f"SELECT status FROM runs WHERE run_id = ?{tx.for_update}", (run_id,)
    ).fetchone()
    status, decided_by, deadline_at = tx.execute(
        "SELECT status, decided_by, deadline_at FROM approvals WHERE approval_id = ?",
        (approval_id,),
    ).fetchone()
    if run is None or (status in ("open", DECIDING) and RunStatus(run[0]).is_terminal):
        return ("closed", None)
    if status != "open":
        return (status, decided_by)
    if tx.now > float(deadline_at):
        # fails closed at its deadline, even before a worker has processed its timer
        return (PAST_DEADLINE, None)
    if hold:
        tx.execute(
            "UPDATE approvals SET status = ?, decided_by = ?, decided_at = ?, updated_at = ? "
            "WHERE approval_id = ?",
            (DECIDING, by, tx.now, tx.now, approval_id),
        )
    _signal(tx, run_id, f"{APPROVAL_SIGNAL}{approval_id}", payload)
    return None


def _list_approvals(
    tx: _Tx,
    status: str | None,
    run_id: str | None,
    tenant: str | None,
    limit: int,
) -> list[tuple[Any, ...]]:
    """Reviews, oldest first; ``status="open"`` keeps the undecided ones of live runs."""
    where, args = [], []
    if status == "open":
        where.append(
            "a.status = 'open' AND r.status NOT IN ('completed', 'failed', 'cancelled', "
            "'terminated', 'timed_out', 'needs_intervention', 'continued_as_new')"
        )
    elif status is not None:
        where.append("a.status = ?")
        args.append(status)
    if run_id is not None:
        where.append("a.run_id = ?")
        args.append(run_id)
    if tenant is not None:
        where.append("r.tenant = ?")
        args.append(tenant)
    sql = f"SELECT {_COLS} FROM approvals a JOIN runs r ON r.run_id = a.run_id"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY a.created_at, a.approval_id LIMIT ?"
    rows = tx.execute(sql, (*args, limit)).fetchall()
    return [_opened_row(tx, r) for r in rows]


def _opened_row(tx: _Tx, row: Any) -> tuple[Any, ...]:
    """A review's row with its proposal and reason opened if sealed."""
    row = tuple(row)
    where = f"review {row[0]!r}"
    return (
        *row[:4],
        tx.open(row[4], f"{where}, proposal"),
        *row[5:12],
        tx.open(row[12], f"{where}, reason"),
        *row[13:],
    )


def _get_approval(tx: _Tx, approval_id: str) -> tuple[Any, ...] | None:
    row = tx.execute(
        f"SELECT {_COLS} FROM approvals a JOIN runs r ON r.run_id = a.run_id "
        "WHERE a.approval_id = ?",
        (approval_id,),
    ).fetchone()
    return _opened_row(tx, row) if row is not None else None


# operations of other concerns (imported last: see the package docstring)
from .control import _signal  # noqa: E402
