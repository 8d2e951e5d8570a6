"""The transaction view every operation runs in, and row codecs shared by all."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._history import RunEnd, RunInfo, RunStatus, Task
from ..._serde import dumps

_TERMINAL = tuple(s.value for s in RunStatus if s.is_terminal)


_RUN_COLS = (
    "run_id, workflow, status, queue, input, output, error, custom_status, parent_run_id, "
    "continued_to, task_error, created_at, updated_at, completed_at, tenant, waiting_on, attrs"
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
    #: runs whose history this operation appended to (event streams wake on them); the
    #: store may share one set across a batch
    touched: set[str] = field(default_factory=set)

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
        attrs=json.loads(row[16]) if len(row) > 16 and row[16] else None,
    )


def _compact(value: Any) -> str:
    """JSON without spaces (``waiting_on`` is matched with LIKE patterns)."""
    return json.dumps(value, separators=(",", ":"))


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
