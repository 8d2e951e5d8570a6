"""Debounced starts: one run per burst of triggers for a key."""

from __future__ import annotations

from ._tx import _Tx


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
        (key, run_id, workflow, queue, tx.seal(input), tx.now, tx.now + window, tx.now),
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
