"""Copy every run from one store to another, and prove the copy: ``tether store migrate``.

``migrate(source, target)`` copies runs (in flight or finished, with their ids),
their histories, their tasks (timers keep their fire time; leased work is released
so the target's workers can claim it at once), dead letters, circuit breakers and
queue limits, every table that belongs to no run, and the blobs payloads refer to
(copied first), from any tether store to any other (SQLite to PostgreSQL first of
all). It refuses to start when any of the source's run ids already exists in the
target, so it never overwrites or merges a run. Then it verifies: every run's row
and history are identical in both stores, every run has the same tasks, and, given
the App, every history replays cleanly against today's code.

Stop the source's workers first: runs that move while they are copied are reported
as mismatches (nothing in the source is changed, so just run it again on a fresh
target). A SQLite source is opened read-only: a file of an older schema version is
read as it is, not upgraded in place (from version 14 on; older ones are refused),
and may sit on read-only media.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._codec import Codec, decode_text, open_fields
from .._errors import StoreError, TetherError
from .._history import Event, RunStatus
from ..blobs import BlobError, BlobStore, default_root
from ._open import open_store
from .base import Store
from .ops import OpsStore
from .ops._tx import _Tx
from .ops.retention import RUN_TABLES

if TYPE_CHECKING:
    from .._app import App

#: tables copied per run, in order (every one has a ``run_id`` column): the run's row
#: first, then those retention removes with it
_RUN_TABLES = ("runs", *RUN_TABLES)
#: run tables a source read as it is (an older SQLite file, never upgraded) may predate,
#: with the version that added them: such a store had none of their rows to copy
_ADDED_SINCE = {"ai_holds": 16}
#: tables copied whole, row by row, where the target lacks the row's key
_SHARED_TABLES: dict[str, tuple[str, ...]] = {
    "breakers": ("name",),
    "queue_limits": ("queue",),  # dependency limiters too (rows named "dep:...")
    "tenant_limits": ("tenant",),  # admission limits and retentions
    "debounces": ("debounce_key",),  # (their tasks name no run yet: copied as loose tasks)
    "schedules": ("schedule_id",),  # (their tasks too)
    "api_keys": ("key_id",),
    "switches": ("kind", "name"),
    "purged_runs": ("run_id",),
    "ai_cache": ("cache_key",),
    "ai_budgets": ("scope",),
    "ai_spend": ("scope", "day"),
    "usage_days": ("tenant", "day"),
    "seal_keys": ("key_id",),  # the fingerprints of the keys the payloads copied are under
    "chains": ("chain_id",),  # each continue-as-new chain's latest run
}
#: tables of rows with no key of their own: copied whole into a target that has none
_LOG_TABLES = ("audit_log", "usage_deltas")
#: tables not copied, and why: the target keeps them itself
NOT_COPIED = {
    "run_count_deltas": "counters kept by triggers as the runs are inserted",
    "run_counts": "counters kept by triggers as the runs are inserted",
    "run_ends": "counters kept by triggers as the runs are inserted",
    "tether_meta": "the target's own schema version",
    "blob_deletions": "the source's pending blob deletions: only blobs in use are copied",
}
#: columns the target assigns itself
_FRESH_IDS = {
    "tasks": "task_id",
    "dead_letters": "id",
    "webhook_outbox": "delivery_id",
    "audit_log": "id",
}


def copied_tables() -> set[str]:
    """Every table ``migrate`` copies (with ``NOT_COPIED``: every table of a store)."""
    return {*_RUN_TABLES, *_SHARED_TABLES, *_LOG_TABLES}


class MigrationError(TetherError):
    """The migration was refused, or the copy does not match its source."""


@dataclass
class MigrationReport:
    """What was copied and checked."""

    runs: int = 0
    in_flight: int = 0
    events: int = 0
    tasks: int = 0
    dead_letters: int = 0
    blobs: int = 0  # copied to the target's blob store (those it had already too)
    shared: dict[str, int] = field(default_factory=dict)  # and reviews, deliveries, logs
    replayed: int = 0
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        shared = ", ".join(f"{n} {t}" for t, n in sorted(self.shared.items()))
        text = (
            f"copied {self.runs} runs ({self.runs - self.in_flight} finished, "
            f"{self.in_flight} in flight), {self.events} events, {self.tasks} tasks, "
            f"{self.dead_letters} dead letters, {self.blobs} blobs"
        )
        if shared:
            text += f", {shared}"
        text += "; verified every history"
        if self.replayed:
            text += f"; {self.replayed} histories replay cleanly against the app's code"
        return text


# -- operations run inside each store's transactions -----------------------------------


def _columns(tx: _Tx, table: str) -> list[str]:
    cur = tx.execute(f"SELECT * FROM {table} WHERE 1 = 0")
    return [d[0] for d in cur.description]


def _run_ids(tx: _Tx, after: str, limit: int) -> list[tuple[str, str]]:
    rows = tx.execute(
        "SELECT run_id, status FROM runs WHERE run_id > ? ORDER BY run_id LIMIT ?", (after, limit)
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


def _existing(tx: _Tx, run_ids: tuple[str, ...]) -> list[str]:
    marks = ",".join("?" * len(run_ids))
    rows = tx.execute(f"SELECT run_id FROM runs WHERE run_id IN ({marks})", run_ids).fetchall()
    return [r[0] for r in rows]


def _rows(
    tx: _Tx, table: str, cols: tuple[str, ...], run_ids: tuple[str, ...]
) -> list[tuple[Any, ...]]:
    marks = ",".join("?" * len(run_ids))
    order = {
        "events": "run_id, seq",
        "tasks": "run_id, task_id",
        "dead_letters": "id",
        "approvals": "approval_id",
        "webhook_outbox": "delivery_id",
        "signal_ids": "chain_id, signal_id",
        "ai_holds": "run_id, step",
    }
    rows = tx.execute(
        f"SELECT {', '.join(cols)} FROM {table} WHERE run_id IN ({marks}) "
        f"ORDER BY {order.get(table, 'run_id')}",
        run_ids,
    ).fetchall()
    return [tuple(r) for r in rows]


def _all_rows(tx: _Tx, table: str, cols: tuple[str, ...]) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in tx.execute(f"SELECT {', '.join(cols)} FROM {table}").fetchall()]


def _insert(
    tx: _Tx,
    plan: tuple[tuple[str, tuple[str, ...], list[tuple[Any, ...]]], ...],
    run_ids: tuple[str, ...],
) -> None:
    """Insert one batch of runs with all their rows; refuse if any run appeared meanwhile."""
    if run_ids and _existing(tx, run_ids):
        raise MigrationError(
            "runs appeared in the target while copying: another process writes to it"
        )
    for table, cols, rows in plan:
        if not rows:
            continue
        text = f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({','.join('?' * len(cols))})"
        if tx.paramstyle != "qmark":
            text = text.replace("?", "%s")
        tx.conn.cursor().executemany(text, rows)


def _loose_tasks(tx: _Tx, cols: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """Tasks that name no run: a schedule's next tick, a debounce's pending start."""
    rows = tx.execute(
        f"SELECT {', '.join(cols)} FROM tasks t WHERE NOT EXISTS "
        "(SELECT 1 FROM runs r WHERE r.run_id = t.run_id) ORDER BY task_id"
    ).fetchall()
    return [tuple(r) for r in rows]


def _count(tx: _Tx, table: str) -> int:
    return int(tx.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


def _insert_all(tx: _Tx, table: str, cols: tuple[str, ...], rows: list[tuple[Any, ...]]) -> int:
    """Insert rows as they are (the target has none of them)."""
    text = f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({','.join('?' * len(cols))})"
    if tx.paramstyle != "qmark":
        text = text.replace("?", "%s")
    if rows:
        tx.conn.cursor().executemany(text, rows)
    return len(rows)


def _insert_shared(
    tx: _Tx, table: str, key: tuple[str, ...], cols: tuple[str, ...], rows: list[tuple[Any, ...]]
) -> int:
    """Insert rows of a shared table whose key the target does not have yet."""
    at = [cols.index(k) for k in key]
    where = " AND ".join(f"{k} = ?" for k in key)
    added = 0
    for row in rows:
        if tx.execute(f"SELECT 1 FROM {table} WHERE {where}", [row[i] for i in at]).fetchone():
            continue
        tx.execute(
            f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({','.join('?' * len(cols))})", row
        )
        added += 1
    return added


# -- the migration ---------------------------------------------------------------------


def _ops_store(store: Store, role: str) -> OpsStore:
    if not isinstance(store, OpsStore):
        raise MigrationError(f"the {role} store ({type(store).__name__}) is not a SQL store")
    return store


async def _table_columns(store: OpsStore, table: str) -> list[str] | None:
    try:
        cols: list[str] = await store._do(_columns, table, write=False)
    except StoreError:
        return None  # an older schema without this table
    return cols


def _with_blobs(store: OpsStore, root: str | None) -> BlobStore:
    """The store's blob store: ``root``, the one an App gave it, else where an App would
    put it (``TETHER_BLOBS``, or the store's default); its codec then reads offloaded
    payloads from it."""
    if root is None and store.blobs is not None:
        return store.blobs
    blobs = BlobStore(
        root or os.environ.get("TETHER_BLOBS") or default_root(getattr(store, "path", None))
    )
    sealer = store.codec.sealer if store.codec is not None else None
    blobs.sealer = sealer
    store.blobs = blobs
    store.codec = Codec(sealer, blobs, None)
    return blobs


async def migrate(
    source: Store | str,
    target: Store | str,
    *,
    app: App | None = None,
    batch: int = 200,
    progress: Callable[[str], None] | None = None,
    source_blobs: str | None = None,
    target_blobs: str | None = None,
) -> MigrationReport:
    """Copy every run of ``source`` into ``target`` and verify the copy.

    The blobs the source's payloads refer to (offloaded payloads, ``put_blob``) are
    copied from ``source_blobs`` to ``target_blobs`` (by default each store's own blob
    store, where an App on it would look) before any row. Raises ``MigrationError``
    (having written nothing) when a run id already exists in the target or a blob is
    missing, and after copying when verification finds a difference; the report of a
    successful migration says what was copied.
    """
    # a SQLite source is read as it is: never upgraded (nor checkpointed) in place
    src = _ops_store(open_store(source, read_only=True), "source")
    dst = _ops_store(open_store(target), "target")
    from_blobs = _with_blobs(src, source_blobs)
    to_blobs = _with_blobs(dst, target_blobs)
    note = progress or (lambda _msg: None)
    report = MigrationReport()
    try:
        cols: dict[str, tuple[str, ...]] = {}
        for table in _RUN_TABLES:
            have = await _table_columns(src, table)
            want = await _table_columns(dst, table)
            if have is None and want is not None and table in _ADDED_SINCE:
                continue  # (a source older than the table: nothing of it to copy)
            if have is None or want is None:
                raise MigrationError(f"table {table!r} is missing in the source or the target")
            missing = [c for c in have if c not in want]
            if missing:
                raise MigrationError(
                    f"the target's {table} table lacks columns {missing}: upgrade the tether "
                    "that created it (open it once with this version) and run again"
                )
            fresh = _FRESH_IDS.get(table)
            cols[table] = tuple(c for c in have if c != fresh)

        # every run id, and refuse before writing anything if any exists in the target
        runs: list[tuple[str, str]] = []
        after = ""
        while chunk := await src._do(_run_ids, after, 1000, write=False):
            runs += chunk
            after = chunk[-1][0]
        taken: list[str] = []
        for i in range(0, len(runs), 500):
            ids = tuple(r for r, _ in runs[i : i + 500])
            taken += await dst._do(_existing, ids, write=False)
        if taken:
            partly = (
                " (some but not all: an earlier migrate into it was probably interrupted; "
                "it copies runs in batches and verifies at the end, so drop that target "
                "and start again)"
                if len(taken) < len(runs)
                else ""
            )
            raise MigrationError(
                f"{len(taken)} of the {len(runs)} runs already exist in the target (e.g. "
                f"{', '.join(repr(r) for r in taken[:3])}){partly}; nothing was copied. "
                "Migrate into an empty store (or a fresh PostgreSQL schema)"
            )
        # the blobs first: a run copied without them could never read its payloads
        refs = sorted(await src.blob_refs())
        lost = [r for r in refs if from_blobs.modified(r) is None]
        if lost:
            raise MigrationError(
                f"{len(lost)} blob(s) the source's payloads refer to are missing from its "
                f"blob store at {from_blobs.root!r} (e.g. {lost[0]}); nothing was copied. "
                "Name the right one (source_blobs=, TETHER_BLOBS)"
            )
        note(f"copying {len(refs)} blobs")
        for ref in refs:
            data = from_blobs.kept(ref)
            try:
                if to_blobs.kept(ref) == data:
                    continue  # the same blob store, or copied before
            except BlobError:
                pass
            to_blobs.keep(ref, data)
        report.blobs = len(refs)
        note(f"copying {len(runs)} runs")

        lease_cols = cols["tasks"]
        owner_at = lease_cols.index("lease_owner")
        avail_at = lease_cols.index("available_at")
        now = dst.clock()
        for i in range(0, len(runs), batch):
            ids = tuple(r for r, _ in runs[i : i + batch])
            plan = []
            for table in cols:  # (in _RUN_TABLES' order)
                rows = await src._do(_rows, table, cols[table], ids, write=False)
                if table == "tasks":
                    # leases held in the source mean nothing in the target: claimable now
                    rows = [_released(r, owner_at, avail_at, now) for r in rows]
                plan.append((table, cols[table], rows))
            await dst._do(_insert, tuple(plan), ids)
            copied = {table: len(rows) for table, _cols, rows in plan}  # (by name, not place)
            del copied["runs"]
            report.events += copied.pop("events")
            report.tasks += copied.pop("tasks")
            report.dead_letters += copied.pop("dead_letters")
            for table, n in copied.items():
                report.shared[table] = report.shared.get(table, 0) + n
            note(f"copied {min(i + batch, len(runs))}/{len(runs)} runs")
        report.runs = len(runs)
        report.in_flight = sum(1 for _, s in runs if not RunStatus(s).is_terminal)

        shared = await _copy_shared(src, dst, lease_cols, now, report)
        await _verify(src, dst, runs, cols, app, report, note)
        await _verify_shared(src, dst, shared, report)
        for ref in refs:  # every blob reads back in the target as it is in the source
            try:
                same = to_blobs.kept(ref) == from_blobs.kept(ref)
            except BlobError:
                same = False
            if not same:
                report.problems.append(f"blob {ref} differs in the target's blob store")
    finally:
        if not isinstance(source, Store):
            await src.close()
        if not isinstance(target, Store):
            await dst.close()
    if report.problems:
        shown = "; ".join(report.problems[:5])
        more = f" (and {len(report.problems) - 5} more)" if len(report.problems) > 5 else ""
        raise MigrationError(f"the copy does not match its source: {shown}{more}")
    return report


async def _copy_shared(
    src: OpsStore,
    dst: OpsStore,
    task_cols: tuple[str, ...],
    now: float,
    report: MigrationReport,
) -> dict[str, tuple[str, ...]]:
    """Copy the tables that belong to no run, and the tasks that name none; the columns
    copied per table (for the verification)."""
    done: dict[str, tuple[str, ...]] = {}
    for table, key in _SHARED_TABLES.items():
        have = await _table_columns(src, table)
        want = await _table_columns(dst, table)
        if have is None or want is None:
            continue
        shared_cols = done[table] = tuple(c for c in have if c in want)
        rows = await src._do(_all_rows, table, shared_cols, write=False)
        report.shared[table] = await dst._do(_insert_shared, table, key, shared_cols, rows)
    for table in _LOG_TABLES:
        have = await _table_columns(src, table)
        want = await _table_columns(dst, table)
        if have is None or want is None:
            continue
        if await dst._do(_count, table, write=False):
            continue  # copied before (a log has no key to tell its rows apart)
        log_cols = done[table] = tuple(c for c in have if c in want and c != _FRESH_IDS.get(table))
        rows = await src._do(_all_rows, table, log_cols, write=False)
        report.shared[table] = await dst._do(_insert_all, table, log_cols, rows)
    owner_at, avail_at = task_cols.index("lease_owner"), task_cols.index("available_at")
    loose = [
        _released(r, owner_at, avail_at, now)
        for r in await src._do(_loose_tasks, task_cols, write=False)
    ]
    rid, kind = task_cols.index("run_id"), task_cols.index("kind")
    there = {(r[rid], r[kind]) for r in await dst._do(_loose_tasks, task_cols, write=False)}
    loose = [r for r in loose if (r[rid], r[kind]) not in there]  # copied before
    if loose:
        await dst._do(_insert_all, "tasks", task_cols, loose)
        report.tasks += len(loose)
    return done


async def _verify_shared(
    src: OpsStore, dst: OpsStore, done: dict[str, tuple[str, ...]], report: MigrationReport
) -> None:
    """Every row of the tables that belong to no run is in the target."""
    for table, cols in done.items():
        a = await src._do(_all_rows, table, cols, write=False)
        b = set(await dst._do(_all_rows, table, cols, write=False))
        missing = [r for r in a if r not in b]
        if missing:
            report.problems.append(f"{table}: {len(missing)} row(s) not in the target")


def _released(row: tuple[Any, ...], owner_at: int, avail_at: int, now: float) -> tuple[Any, ...]:
    if row[owner_at] is None:
        return row  # queued, a retry waiting for its time, or a timer: keep its time
    out = list(row)
    out[owner_at] = None
    out[avail_at] = min(float(row[avail_at]), now)
    return tuple(out)


async def _verify(
    src: OpsStore,
    dst: OpsStore,
    runs: Sequence[tuple[str, str]],
    cols: dict[str, tuple[str, ...]],
    app: App | None,
    report: MigrationReport,
    note: Callable[[str], None],
) -> None:
    from ..testing import check_history

    task_cols = cols["tasks"]
    task_key = tuple(task_cols.index(c) for c in ("run_id", "kind", "step", "queue", "fence"))
    for i in range(0, len(runs), 200):
        ids = tuple(r for r, _ in runs[i : i + 200])
        for table in cols:
            a = await src._do(_rows, table, cols[table], ids, write=False)
            b = await dst._do(_rows, table, cols[table], ids, write=False)
            if table == "tasks":
                a = sorted(tuple(r[k] for k in task_key) for r in a)
                b = sorted(tuple(r[k] for k in task_key) for r in b)
            if a != b:
                diff = sorted({r[0] for r in set(a) ^ set(b)})
                report.problems.append(
                    f"{table} differ for {len(diff)} run(s) (e.g. {', '.join(diff[:3])})"
                )
        if app is not None:
            events = await dst._do(_rows, "events", cols["events"], ids, write=False)
            by_run: dict[str, list[Event]] = {}
            order = [cols["events"].index(c) for c in _EVENT_COLS]
            for row in events:
                values = [row[k] for k in order]
                where = f"run {values[0]!r}, event {values[1]}"
                if isinstance(values[4], str):  # the data column, fetched if offloaded
                    values[4] = decode_text(dst.codec, values[4], where)
                ev = Event.from_row(tuple(values))
                open_fields(dst.codec, ev.data, where)
                by_run.setdefault(ev.run_id, []).append(ev)
            for rid, history in by_run.items():
                try:
                    result = check_history(app, history)
                except TetherError as exc:
                    report.problems.append(f"run {rid!r} cannot be replayed: {exc}")
                    continue
                if not result.ok:
                    report.problems.append(f"run {rid!r} does not replay: {result.error}")
                else:
                    report.replayed += 1
        note(f"verified {min(i + 200, len(runs))}/{len(runs)} runs")


_EVENT_COLS = ("run_id", "seq", "type", "step", "data", "created_at")
