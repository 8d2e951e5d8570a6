"""The webhook outbox: a run's outcome queued for delivery in the commit that ends it.

A run started with a callback URL (``attrs["webhook"]``) gets a delivery row when it
reaches a terminal status, in the same transaction as its end: a crash can never end
the run without queueing the delivery. Relays lease due rows (``next_at``), post them,
and mark them delivered or due again later; several relays never post the same row at
the same time.
"""

from __future__ import annotations

import json
from typing import Any

from ..._codec import MARKS
from ._tx import _error_json, _Tx

_DELIVERY_COLS = (
    "delivery_id, run_id, url, workflow, status, output, error, tenant, ended_at, "
    "attempts, state, last_error, next_at, delivered_at, created_at"
)


def _url_of_attrs(tx: _Tx) -> str:
    """The SQL expression for a run row's webhook URL, in the backend's dialect."""
    if tx.paramstyle == "qmark":
        return "json_extract(attrs, '$.webhook')"
    return "(attrs::jsonb ->> 'webhook')"


def _queue_webhook(tx: _Tx, run_id: str) -> None:
    """Queue the ended run's outcome for its callback URL, if it has one (no row else).

    Runs without attrs cost one primary-key probe; the statement needs no answer."""
    url = _url_of_attrs(tx)
    tx.execute(
        "INSERT INTO webhook_outbox (run_id, url, workflow, status, output, error, tenant, "
        "ended_at, attempts, state, next_at, created_at) "
        f"SELECT run_id, {url}, workflow, status, output, error, tenant, completed_at, 0, "
        f"'pending', ?, ? FROM runs WHERE run_id = ? AND attrs IS NOT NULL AND {url} IS NOT NULL",
        (tx.now, tx.now, run_id),
    )


def _claim_webhooks(tx: _Tx, limit: int, lease: float) -> list[tuple[Any, ...]]:
    """Lease up to ``limit`` due deliveries for ``lease`` seconds (they come due again
    then, should this relay die while posting).

    Each row comes with one more column: None, or why the run's output or error cannot
    be read (a missing blob, an unavailable key); such a row is as stored, for the relay
    to record as that delivery's failed attempt: it never fails the others' claim."""
    rows = tx.execute(
        f"SELECT {_DELIVERY_COLS} FROM webhook_outbox WHERE state = 'pending' AND next_at <= ? "
        f"ORDER BY next_at LIMIT ?{tx.skip_locked}",
        (tx.now, limit),
    ).fetchall()
    for row in rows:
        tx.execute(
            "UPDATE webhook_outbox SET next_at = ?, attempts = attempts + 1 WHERE delivery_id = ?",
            (tx.now + lease, row[0]),
        )
    out = []
    for row in rows:
        leased = (*row[:9], row[9] + 1, *row[10:])
        try:
            out.append((*_opened(tx, leased), None))
        except Exception as exc:  # this row's payload alone: a missing blob, a lost key
            out.append((*leased, f"cannot read the run's outcome: {type(exc).__name__}: {exc}"))
    return out


def _finish_webhook(
    tx: _Tx, delivery_id: int, ok: bool, error: str | None, retry_at: float | None
) -> None:
    """Record a post's outcome: delivered, due again at ``retry_at``, or given up (None)."""
    if ok:
        tx.execute(
            "UPDATE webhook_outbox SET state = 'delivered', delivered_at = ?, last_error = NULL "
            "WHERE delivery_id = ?",
            (tx.now, delivery_id),
        )
    else:
        tx.execute(
            "UPDATE webhook_outbox SET state = ?, last_error = ?, next_at = ? "
            "WHERE delivery_id = ?",
            (
                "pending" if retry_at is not None else "failed",
                error,
                retry_at if retry_at is not None else tx.now,
                delivery_id,
            ),
        )


def _webhook_deliveries(
    tx: _Tx, run_id: str | None, state: str | None, limit: int
) -> list[tuple[Any, ...]]:
    where, params = [], []
    if run_id is not None:
        where.append("run_id = ?")
        params.append(run_id)
    if state is not None:
        where.append("state = ?")
        params.append(state)
    sql = f"SELECT {_DELIVERY_COLS} FROM webhook_outbox"
    if where:
        sql += " WHERE " + " AND ".join(where)
    rows = tx.execute(f"{sql} ORDER BY delivery_id DESC LIMIT ?", (*params, limit)).fetchall()
    return [_opened(tx, r, keep=True) for r in rows]


def _opened(tx: _Tx, found: Any, keep: bool = False) -> tuple[Any, ...]:
    """A delivery's row with the run's output and error opened if sealed; with ``keep``,
    as stored if they cannot be (a missing blob, an unavailable key) instead of raising."""
    row: tuple[Any, ...] = tuple(found)
    if keep:
        try:
            return _opened(tx, row)
        except Exception:
            return row
    if (
        tx.codec is None
        and not (row[5] or "").startswith(MARKS)
        and '"sealed"' not in (row[6] or "")
    ):
        return row
    where = f"webhook delivery {row[0]} (run {row[1]!r})"
    error = _error_json(tx.codec, row[6], row[1], f"webhook delivery {row[0]}, error")
    return (
        *row[:5],
        tx.open(row[5], f"{where}, output"),
        None if error is None else json.dumps(error),
        *row[7:],
    )
