"""Appending to and reading a run's append-only history."""

from __future__ import annotations

from typing import Any

from ..._codec import MARKS, decode_text, open_fields
from ..._errors import RunNotFoundError
from ..._history import Event, EventType
from ._tx import _Tx


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
    tx.touched.add(run_id)
    tx.execute(
        "INSERT INTO events (run_id, seq, type, step, data, created_at) VALUES (?,?,?,?,?,?)",
        (run_id, seq, type_.value, step, tx.data(run_id, data, raw), tx.now),
    )
    return seq


#: an event waiting to be appended: (type, step, data, raw payloads)
_Pending = tuple[EventType, int | None, dict[str, Any], dict[str, str] | None]


def _insert_events(tx: _Tx, run_id: str, events: list[_Pending], first: int) -> int:
    """Insert ``events`` into one run's history from seq ``first``, in one INSERT.

    The caller read the run's counter under the write lock and writes the new one
    (the returned seq + 1) in an update of its own. Returns the seq of the last event.
    """
    tx.touched.add(run_id)
    params: list[Any] = []
    for i, (type_, step, data, raw) in enumerate(events):
        if step is None:  # NULL in the statement: a None parameter is slow to bind
            params += (run_id, first + i, type_.value, tx.data(run_id, data, raw), tx.now)
        else:
            params += (run_id, first + i, type_.value, step, tx.data(run_id, data, raw), tx.now)
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


def _read_history(tx: _Tx, run_id: str, after_seq: int) -> list[Event]:
    rows = tx.execute(
        "SELECT run_id, seq, type, step, data, created_at FROM events "
        "WHERE run_id = ? AND seq > ? ORDER BY seq",
        (run_id, after_seq),
    ).fetchall()
    return [_event(tx, r) for r in rows]


def _event(tx: _Tx, row: Any) -> Event:
    """An event from its row, its data opened if sealed."""
    data = row[4]
    if not data or ('"~' not in data and not data.startswith(MARKS)):
        return Event.from_row(row)  # nothing sealed or offloaded
    where = f"run {row[0]!r}, event {row[1]}" + (f" (step {row[3]})" if row[3] else "")
    if data.startswith(MARKS):  # offloaded whole
        row = (*row[:4], decode_text(tx.codec, data, where), row[5])
    event = Event.from_row(row)
    open_fields(tx.codec, event.data, where)
    return event


def _live_history(tx: _Tx, run_id: str) -> list[Event]:
    """The run's history without events voided by earlier retries."""
    events = _read_history(tx, run_id, 0)
    voided: set[int] = set()
    for ev in events:
        if ev.type is EventType.RUN_RETRIED:
            voided.update(ev.data.get("voided", []))
    return [e for e in events if e.seq not in voided and e.type is not EventType.RUN_RETRIED]
