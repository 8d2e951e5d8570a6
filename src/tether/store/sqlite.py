"""The embedded SQLite store: WAL mode, one writer thread, group commit.

Every operation is a function run on the store's single connection by its own
thread. The thread drains whatever operations are queued and commits them in
one transaction, each inside its own savepoint, so many runs' steps that finish
together share one fsync while a failing operation (a stale lease, a conflict)
rolls back alone. Other processes may open the same file; they coordinate
through the same leases and fences, with ``BEGIN IMMEDIATE`` serialising writes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import queue
import random
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable
from importlib import resources
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: worker ids are not held
    fcntl = None  # type: ignore[assignment]

from .._errors import ConfigurationError, StoreError
from .._history import RunInfo, RunStatus, Task
from ._counters import COUNT_TABLES
from ._counters import SQLITE as COUNTERS
from ._handoff import LoopFuture, deliver
from .base import Finished, HistoryListener, Listener, StreamListener, worker_id_in_use
from .ops import OpsStore
from .ops._tx import CHAINS, ENCRYPTED_BEFORE, OFFLOADED_BEFORE, Op, SealState, _Tx
from .ops.runs import _get_run, _run_status
from .ops.tasks import _heartbeat

log = logging.getLogger("tether.store")

_OWN_TABLES = {
    "runs",
    "events",
    "tasks",
    "dead_letters",
    "breakers",
    "queue_limits",
    "tenant_limits",
    "debounces",
    "api_keys",
    "ai_cache",
    "ai_spend",
    "ai_budgets",
    "ai_holds",
    "approvals",
    "seal_keys",
    "blob_deletions",
    "chains",
    *COUNT_TABLES,
}

#: tables every tether store has had since its first schema version
_CORE_TABLES = {"runs", "events", "tasks"}

_SCHEMA_VERSION = 16
#: the version whose upgrade rebuilds the events table (a rowid table since)
_EVENTS_REBUILT = 15
#: the oldest version a read-only open reads as it is: 15 changed only how the history
#: is stored, not its columns; 14 filled the new chains table from the runs, so an
#: older file read as it is lacks rows its upgrade would add; 16 only added a table,
#: empty until then (``migrate._ADDED_SINCE``). (A new version whose upgrade adds or
#: changes rows or columns moves this up to itself.)
_READ_ONLY_FROM = 14
#: statements that bring a store of the version before up to this one
_UPGRADES: dict[int, tuple[str, ...]] = {
    2: ("ALTER TABLE runs ADD COLUMN waiting_on TEXT",),
    3: (
        "CREATE TABLE IF NOT EXISTS api_keys (key_id TEXT PRIMARY KEY, secret_hash TEXT NOT "
        "NULL, name TEXT, tenant TEXT, role TEXT NOT NULL, created_at REAL NOT NULL, "
        "revoked_at REAL)",
    ),
    4: (
        "CREATE TABLE IF NOT EXISTS ai_cache (cache_key TEXT PRIMARY KEY, value TEXT NOT NULL, "
        "created_at REAL NOT NULL, expires_at REAL NOT NULL)",
        "CREATE TABLE IF NOT EXISTS ai_spend (scope TEXT NOT NULL, day TEXT NOT NULL, tokens "
        "BIGINT NOT NULL, cost TEXT NOT NULL, updated_at REAL NOT NULL, "
        "PRIMARY KEY (scope, day))",
        "CREATE TABLE IF NOT EXISTS ai_budgets (scope TEXT PRIMARY KEY, tokens BIGINT, cost TEXT, "
        "updated_at REAL NOT NULL)",
    ),
    5: (
        "ALTER TABLE runs ADD COLUMN attrs TEXT",
        "CREATE TABLE IF NOT EXISTS approvals (approval_id TEXT PRIMARY KEY, run_id TEXT NOT "
        "NULL, name TEXT NOT NULL, fingerprint TEXT NOT NULL, proposal TEXT NOT NULL, "
        "approvers TEXT NOT NULL, deadline_at REAL NOT NULL, status TEXT NOT NULL, "
        "level INTEGER NOT NULL, allow_edit INTEGER NOT NULL, decided_by TEXT, "
        "decided_at REAL, reason TEXT, reminded_at REAL, "
        "created_at REAL NOT NULL, updated_at REAL NOT NULL)",
        "CREATE INDEX IF NOT EXISTS approvals_by_status ON approvals (status, created_at)",
        "CREATE INDEX IF NOT EXISTS approvals_by_run ON approvals (run_id)",
    ),
    6: (
        "CREATE TABLE IF NOT EXISTS webhook_outbox (delivery_id INTEGER PRIMARY KEY "
        "AUTOINCREMENT, run_id TEXT NOT NULL, url TEXT NOT NULL, workflow TEXT NOT NULL, "
        "status TEXT NOT NULL, output TEXT, error TEXT, tenant TEXT, ended_at REAL, attempts "
        "INTEGER NOT NULL, state TEXT NOT NULL, last_error TEXT, next_at REAL NOT NULL, "
        "delivered_at REAL, created_at REAL NOT NULL)",
        "CREATE INDEX IF NOT EXISTS webhook_outbox_due ON webhook_outbox (state, next_at)",
        "CREATE INDEX IF NOT EXISTS webhook_outbox_by_run ON webhook_outbox (run_id)",
    ),
    7: (
        "CREATE TABLE IF NOT EXISTS switches (kind TEXT NOT NULL, name TEXT NOT NULL, by_whom"
        " TEXT, reason TEXT, created_at REAL NOT NULL, PRIMARY KEY (kind, name))",
        "CREATE TABLE IF NOT EXISTS audit_log (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL "
        "NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL, target TEXT NOT NULL, detail "
        "TEXT)",
        "CREATE INDEX IF NOT EXISTS audit_log_by_target ON audit_log (target, id)",
    ),
    8: (
        "CREATE TABLE IF NOT EXISTS schedules (schedule_id TEXT PRIMARY KEY, workflow "
        "TEXT NOT NULL, queue TEXT NOT NULL, input TEXT NOT NULL, spec TEXT NOT NULL, "
        "tenant TEXT, paused INTEGER NOT NULL DEFAULT 0, note TEXT, next_at REAL, "
        "last_tick REAL, last_run_id TEXT, buffered REAL, fired BIGINT NOT NULL DEFAULT "
        "0, skipped BIGINT NOT NULL DEFAULT 0, version BIGINT NOT NULL DEFAULT 1, "
        "created_at REAL NOT NULL, updated_at REAL NOT NULL)",
        "CREATE TABLE IF NOT EXISTS purged_runs (run_id TEXT PRIMARY KEY, workflow TEXT, "
        "reason TEXT NOT NULL, purged_at REAL NOT NULL)",
        "CREATE INDEX IF NOT EXISTS dead_letters_by_run ON dead_letters (run_id)",
    ),
    9: ("ALTER TABLE tenant_limits ADD COLUMN retention REAL",),
    10: COUNTERS,  # run counters kept by triggers
    11: (
        "CREATE TABLE IF NOT EXISTS signal_ids (chain_id TEXT NOT NULL, signal_id TEXT NOT "
        "NULL, run_id TEXT NOT NULL, seq INTEGER NOT NULL, created_at REAL NOT NULL, "
        "PRIMARY KEY (chain_id, signal_id))",
        "CREATE INDEX IF NOT EXISTS signal_ids_by_run ON signal_ids (run_id)",
    ),
    12: (
        "CREATE TABLE IF NOT EXISTS seal_keys (key_id TEXT PRIMARY KEY, fingerprint TEXT "
        "NOT NULL, created_at REAL NOT NULL)",
        ENCRYPTED_BEFORE,
        OFFLOADED_BEFORE,
    ),
    13: (
        "CREATE TABLE IF NOT EXISTS blob_deletions (ref TEXT PRIMARY KEY, spare_from "
        "REAL NOT NULL, noted_at REAL NOT NULL)",
    ),
    14: CHAINS,  # each continue-as-new chain's head, for chains made before it
    # the history as a rowid table (see schema.sql), rebuilt once: each run's events
    # copied together, in order
    15: (
        "CREATE TABLE events_v15 (run_id TEXT NOT NULL, seq INTEGER NOT NULL, type TEXT "
        "NOT NULL, step INTEGER, data TEXT, created_at REAL NOT NULL, "
        "PRIMARY KEY (run_id, seq))",
        "INSERT INTO events_v15 (run_id, seq, type, step, data, created_at) "
        "SELECT run_id, seq, type, step, data, created_at FROM events ORDER BY run_id, seq",
        "DROP TABLE events",
        "ALTER TABLE events_v15 RENAME TO events",
    ),
    16: (
        "CREATE TABLE IF NOT EXISTS ai_holds (run_id TEXT NOT NULL, step INTEGER NOT NULL, "
        "holder TEXT NOT NULL, scopes TEXT NOT NULL, day TEXT NOT NULL, tokens BIGINT NOT "
        "NULL, cost TEXT NOT NULL, created_at REAL NOT NULL, PRIMARY KEY (run_id, step))",
    ),
}


def _lock_file(path: str) -> int | None:
    """A descriptor of ``path`` (created if missing) holding its exclusive ``flock``;
    None when another process holds it."""
    assert fcntl is not None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class SqliteStore(OpsStore):
    """SQLite store; ``path`` may be ``":memory:"`` (one process only).

    ``read_only`` opens an existing file without upgrading its schema or writing to it
    (``tether store migrate``'s source): operations that write are refused.
    """

    def __init__(
        self,
        path: str,
        *,
        synchronous: str = "FULL",
        busy_timeout: float = 30.0,
        max_batch: int = 512,
        read_only: bool = False,
    ) -> None:
        self.path = path
        self.read_only = read_only
        #: what ``sqlite3.connect`` opens (a ``file:`` URI when read-only)
        self._target = path
        self.clock: Callable[[], float] = time.time
        self._max_batch = max_batch
        self._listeners: list[Listener] = []
        #: worker id -> [the descriptor of its locked file, the file's path]
        self._id_holds: dict[str, list[Any]] = {}
        #: a check of a hold (in a thread) may take it again while the hold is released
        self._id_lock = threading.Lock()
        self._history_listeners: list[HistoryListener] = []
        self._stream_listeners: list[StreamListener] = []
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._commits = 0
        self._ops = 0
        self._known_limited: set[str] = set()  #: queues seen with limits (see _Tx)
        self._keys = SealState()  #: whether a keyring sealed into the store (see _Tx)
        self._closed = False
        self._busy_timeout = busy_timeout
        self._idle = True  #: the writer thread is waiting for work
        #: per-thread read-only connections for point reads that need not queue behind
        #: the writer's commits (WAL readers never block it); none for ":memory:"
        self._readers = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        if path != ":memory:":
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise StoreError(
                    f"cannot open store {path!r}: directory {parent!r} does not exist; "
                    "create it or choose another path"
                )
            if os.path.isdir(path):
                raise StoreError(
                    f"cannot open store {path!r}: it is a directory; name a file in it "
                    f"(e.g. {os.path.join(path, 'tether.db')!r})"
                )
        if read_only:
            self._conn = self._open_read_only(path, busy_timeout)
            self._thread = threading.Thread(target=self._loop, name="tether-sqlite", daemon=True)
            self._thread.start()
            return
        try:
            self._conn = sqlite3.connect(
                path,
                isolation_level=None,
                check_same_thread=False,
                timeout=busy_timeout,
                # multi-row INSERTs and NULL patterns make many statement texts: keep
                # them all prepared (the default is 128)
                cached_statements=512,
            )
        except sqlite3.Error as exc:
            raise StoreError(
                f"cannot create or open store {path!r} ({exc}): check that this user may "
                "read and write the file and its directory, or choose another path"
            ) from exc
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            self._refuse_foreign()
            if path != ":memory:":
                self._wal(busy_timeout)
            if synchronous.upper() not in ("FULL", "NORMAL", "OFF", "EXTRA"):
                raise StoreError(f"unknown synchronous mode {synchronous!r}")
            self._conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise StoreError(_explain(path, exc)) from exc
        except StoreError:
            self._conn.close()
            raise
        self._thread = threading.Thread(target=self._loop, name="tether-sqlite", daemon=True)
        self._thread.start()

    # -- plumbing --------------------------------------------------------

    def _open_read_only(self, path: str, busy_timeout: float) -> sqlite3.Connection:
        """A connection that reads the file as it is: no upgrade, no WAL switch, no
        checkpoint (``mode=ro``); refuses a schema it cannot read without upgrading."""
        if path == ":memory:" or not os.path.isfile(path):
            raise StoreError(
                f"no tether store at {path!r} to open read-only: name an existing store file"
            )
        base = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
        conn = None
        try:
            for uri in (base, f"{base}&immutable=1"):
                conn = sqlite3.connect(
                    uri,
                    uri=True,
                    isolation_level=None,
                    check_same_thread=False,
                    timeout=busy_timeout,
                    cached_statements=512,
                )
                try:
                    # the first read opens the WAL: a WAL-mode file needs its -wal and
                    # -shm files, which SQLite creates beside it when they are missing
                    conn.execute("PRAGMA user_version").fetchone()
                    break
                except sqlite3.OperationalError as exc:
                    conn.close()
                    conn = None
                    if uri != base or not _cannot_make_wal_files(exc):
                        raise
                    wal = f"{path}-wal"
                    if os.path.exists(wal) and os.path.getsize(wal) > 0:
                        raise StoreError(
                            f"cannot read store {path!r} without writing beside it: its "
                            f"{os.path.basename(wal)} file holds commits not yet in the file "
                            "(it was not closed cleanly, or a process has it open) and "
                            f"SQLite cannot create the {os.path.basename(path)}-shm file it "
                            "needs to read them in that directory. Copy the file with its "
                            "-wal file to a writable directory and read the copy"
                        ) from exc
                    if os.path.exists(wal) or os.path.exists(f"{path}-shm"):
                        # a -shm (or an empty -wal) left beside it: a process may have it
                        # open, writing it; read unlocked (immutable) it could tear
                        raise StoreError(
                            f"cannot read store {path!r} without writing beside it: its "
                            "-wal or -shm file says a process may have it open (or it was "
                            "not closed cleanly), and SQLite cannot use them in that "
                            "directory. Stop its workers, or copy the file with its -wal "
                            "file to a writable directory and read the copy"
                        ) from exc
                    # closed cleanly (no -wal, no -shm): the file holds every commit, and
                    # nothing writes it where this process cannot create files: read it as
                    # it is, without locks
            assert conn is not None
            self._target = uri
            conn.execute("PRAGMA query_only = ON")
            self._conn = conn
            self._refuse_foreign()
            self._readable()
        except sqlite3.DatabaseError as exc:
            if conn is not None:
                conn.close()
            raise StoreError(_explain(path, exc)) from exc
        except StoreError:
            if conn is not None:
                conn.close()
            raise
        return conn

    def _readable(self) -> None:
        """Refuse, opening read-only, a schema this tether cannot read as it is."""
        (version,) = self._conn.execute("PRAGMA user_version").fetchone()
        if version > _SCHEMA_VERSION:
            raise StoreError(
                f"store {self.path!r} has schema version {version}, newer than this tether "
                f"({_SCHEMA_VERSION}); upgrade tether to read it"
            )
        if version == 0:
            raise StoreError(
                f"no tether store at {self.path!r}: the file is empty (no tables); name the "
                "database your workers use"
            )
        if version < _READ_ONLY_FROM:
            raise StoreError(
                f"store {self.path!r} has schema version {version}: this tether reads a "
                f"store without upgrading it (as `tether store migrate` reads its source) "
                f"only from version {_READ_ONLY_FROM} on. Upgrade it in place by opening it "
                f"once with this tether (e.g. `tether runs --store {self.path}`; back it up "
                "first to keep it as it is), or migrate it with the tether that wrote it"
            )
        if version == _SCHEMA_VERSION:
            self._check_columns()

    def _wal(self, busy_timeout: float) -> None:
        """Switch the file to WAL mode, waiting out other processes doing the same.

        Switching journal modes needs the file to itself and SQLite answers "locked"
        at once instead of calling the busy handler, so workers started together on a
        new file retry here, for up to the busy timeout, rather than fail.
        """
        deadline = time.monotonic() + busy_timeout
        while True:
            try:
                (mode,) = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01 + random.random() * 0.04)
        if str(mode).lower() != "wal":
            # e.g. a file system without shared memory (some network mounts): another
            # journal mode would silently change tether's concurrency and durability
            raise StoreError(
                f"SQLite store {self.path}: the file system refused WAL mode (the journal "
                f"mode stayed {mode!r}); put the store on a local disk"
            )

    def _refuse_foreign(self) -> None:
        """Never write tether's schema into another program's database (nor switch it
        to WAL): a file with tables must be tether's, whatever its ``user_version``."""
        (version,) = self._conn.execute("PRAGMA user_version").fetchone()
        tables = {
            r[0]
            for r in self._conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        }
        # a new file (no tables, version 0) becomes a store; a store of any version has
        # these; anything else belongs to another program
        foreign = tables - _OWN_TABLES
        if (version == 0 and foreign) or (version != 0 and not tables >= _CORE_TABLES):
            listed = ", ".join(sorted(foreign)) or "none"
            raise StoreError(
                f"store {self.path!r} is a SQLite database of another program (user_version "
                f"{version}, tables: {listed}; not tether's schema); tether left it "
                "untouched: point tether at a new file"
            )

    def _migrate(self) -> None:
        (version,) = self._conn.execute("PRAGMA user_version").fetchone()
        if version > _SCHEMA_VERSION:
            raise StoreError(
                f"store {self.path!r} has schema version {version}, newer than this tether "
                f"({_SCHEMA_VERSION}); upgrade tether to open it"
            )
        if version == _SCHEMA_VERSION:
            self._check_columns()
            return
        schema = resources.files("tether.store").joinpath("sql/sqlite/schema.sql").read_text()
        self._conn.execute("BEGIN IMMEDIATE")
        (version,) = self._conn.execute("PRAGMA user_version").fetchone()
        if version == _SCHEMA_VERSION:  # another process migrated it while we waited
            self._conn.execute("COMMIT")
            return
        if version == 0:
            code = "\n".join(line.split("--", 1)[0] for line in schema.splitlines())
            for statement in code.split(";"):
                if statement.strip():
                    self._conn.execute(statement)
            for statement in COUNTERS:  # (trigger bodies hold semicolons)
                self._conn.execute(statement)
        else:
            try:
                for step in range(version + 1, _SCHEMA_VERSION + 1):
                    for statement in _UPGRADES[step]:
                        self._conn.execute(statement)
            except sqlite3.DatabaseError as exc:
                if version >= _EVENTS_REBUILT:
                    raise
                # (closing the connection rolls the whole upgrade back)
                raise StoreError(
                    f"upgrading store {self.path!r} from schema version {version} to "
                    f"{_SCHEMA_VERSION} failed ({exc}); nothing was changed. The upgrade "
                    "rebuilds the run histories (the events table) once, in one "
                    "transaction: it needs free disk of about twice the file's size and "
                    "holds the file's write lock meanwhile; free some space (or stop the "
                    "store's other processes if it was locked) and open it again"
                ) from exc
        self._conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        self._conn.execute("COMMIT")
        if 0 < version < _EVENTS_REBUILT:
            # the rebuild went through the WAL: give its space back now (best effort;
            # a reader elsewhere keeps it until a later checkpoint)
            with contextlib.suppress(sqlite3.DatabaseError):
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _check_columns(self) -> None:
        """Refuse a file made by a pre-release build whose schema lacks today's columns."""
        have = {r[1] for r in self._conn.execute("PRAGMA table_info(tasks)")}
        missing = {"priority", "limit_key", "heartbeat_timeout", "dependency", "batch_key"} - have
        if "tenant" not in {r[1] for r in self._conn.execute("PRAGMA table_info(runs)")}:
            missing.add("runs.tenant")
        if missing:
            raise StoreError(
                f"store {self.path!r} was created by an older development build of tether "
                f"(its tasks table lacks {', '.join(sorted(missing))}); finish or export its "
                "runs with that build, then start from a new file"
            )

    def _loop(self) -> None:
        conn = self._conn
        while True:
            self._idle = True
            item = self._queue.get()
            self._idle = False
            if item is None:
                break
            batch = [item]
            while len(batch) < self._max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            try:
                self._run_batch(conn, batch)
            except BaseException as exc:  # the writer thread must never die
                log.exception("store batch failed")
                for _, _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(StoreError(f"store operation failed: {exc!r}"))
        conn.close()

    def _run_batch(self, conn: sqlite3.Connection, batch: list[Any]) -> None:
        # a sync caller that gave up before its operation ran gets nothing applied
        live = [item for item in batch if item[3].set_running_or_notify_cancel()]
        if not live:
            return
        try:
            # fast path: no savepoints; operations almost never fail
            outcome = self._attempt(conn, live, savepoints=False)
            if outcome is None:
                # one failed: redo the batch with a savepoint each, so it fails alone
                outcome = self._attempt(conn, live, savepoints=True)
            assert outcome is not None
        except sqlite3.DatabaseError as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            err = StoreError(_explain(self.path, exc))
            deliver([(fut, None, err) for _, _, _, fut in live])
            return
        results, ready, finished, touched = outcome
        self._ops += len(live)
        deliver(results)
        if ready or finished:
            for cb in list(self._listeners):
                cb(ready, finished)
        if touched:
            self._history_grew(touched)

    def _attempt(
        self, conn: sqlite3.Connection, live: list[Any], *, savepoints: bool
    ) -> tuple[list[tuple[Any, Any, BaseException | None]], set[str], Finished, set[str]] | None:
        """Run the batch in one transaction; None if an operation failed without savepoints."""
        writes = any(w for _, _, w, _ in live)
        results: list[tuple[Any, Any, BaseException | None]] = []
        ready: set[str] = set()
        finished: Finished = {}
        touched: set[str] = set()
        before = conn.total_changes
        if writes:
            conn.execute("BEGIN IMMEDIATE")
        now = self.clock()
        limited: dict[str, bool] = {}  # one "has limits?" lookup per queue per batch
        learned: dict[str, str | None] = {}
        for fn, args, write, fut in live:
            tx = _Tx(
                conn,
                now,
                limited=limited,
                known_limited=self._known_limited,
                codec=self.codec,
                keys=self._keys,
            )
            if savepoints and write:
                conn.execute("SAVEPOINT op")
            try:
                value = fn(tx, *args)
            except BaseException as exc:
                if write and not savepoints:
                    conn.execute("ROLLBACK")
                    return None
                if savepoints and write:
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                if isinstance(exc, sqlite3.DatabaseError):
                    exc = StoreError(_explain(self.path, exc))
                elif isinstance(exc, OverflowError):  # a caller's number past 64 bits
                    exc = ConfigurationError(
                        f"a number passed to the store is too large for it ({exc}): ids, "
                        "limits and counts are 64-bit integers"
                    )
                results.append((fut, None, exc))
                continue
            if savepoints and write:
                conn.execute("RELEASE op")
            ready |= tx.ready
            finished |= tx.finished
            touched |= tx.touched
            if tx.learned:
                learned.update(tx.learned)
            results.append((fut, value, None))
        if writes:
            conn.execute("COMMIT")
            if conn.total_changes != before:
                self._commits += 1  # durable commits only: an empty claim writes nothing
        if learned and self.codec is not None:
            self.codec.learned(learned)  # (committed: see _Tx.learn)
        return results, ready, finished, touched

    def _refuse_write(self) -> None:
        raise StoreError(
            f"store {self.path!r} was opened read-only (it is read as it is, never "
            "upgraded or written): this operation writes"
        )

    def _submit(self, fn: Op, *args: Any, write: bool = True) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise StoreError("the store is closed")
        if write and self.read_only:
            self._refuse_write()
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((fn, args, write, fut))
        return fut

    async def _do(self, fn: Op, *args: Any, write: bool = True) -> Any:
        if self._closed:
            raise StoreError("the store is closed")
        if write and self.read_only:
            self._refuse_write()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.put((fn, args, write, LoopFuture(loop, fut)))
        return await fut

    def _reader(self) -> sqlite3.Connection | None:
        """This thread's read-only connection (opened on first use)."""
        if self.path == ":memory:" or self._closed:
            return None
        conn: sqlite3.Connection | None = getattr(self._readers, "conn", None)
        if conn is None:
            conn = sqlite3.connect(
                self._target,
                uri=self.read_only,
                isolation_level=None,
                check_same_thread=False,
                timeout=self._busy_timeout,
            )
            conn.execute("PRAGMA query_only = ON")
            with self._readers_lock:
                self._reader_conns.append(conn)
            self._readers.conn = conn
        return conn

    async def get_run(
        self, run_id: str, *, follow: bool = False, lenient: bool = False
    ) -> RunInfo | None:
        """One run's row; while the writer is idle, read on the calling thread.

        A primary-key lookup costs less than two thread hand-offs (``run.result()``
        on a quiet store); under load it queues with the writer's batches instead.
        """
        conn = self._reader() if self._idle else None
        if conn is None:  # busy: a read here would contend with it for the GIL
            return await super().get_run(run_id, follow=follow, lenient=lenient)
        try:
            return _get_run(_Tx(conn, self.clock(), codec=self.codec), run_id, follow, lenient)
        except sqlite3.DatabaseError as exc:
            raise StoreError(_explain(self.path, exc)) from exc

    async def run_status(self, run_id: str) -> RunStatus | None:
        """A run's status; while the writer is idle, read on the calling thread (as
        ``get_run``)."""
        conn = self._reader() if self._idle else None
        if conn is None:
            return await super().run_status(run_id)
        try:
            return _run_status(_Tx(conn, self.clock(), codec=self.codec), run_id)
        except sqlite3.DatabaseError as exc:
            raise StoreError(_explain(self.path, exc)) from exc

    def _close_readers(self) -> None:
        with self._readers_lock:
            conns, self._reader_conns = self._reader_conns, []
        for conn in conns:
            conn.close()

    def hold_worker_id(self, worker_id: str) -> Callable[[], None]:
        """An exclusive ``flock`` on ``<store>.worker-<hash>.lock``, which the OS drops
        when the holding process dies (SIGKILL included)."""
        if self.path == ":memory:" or fcntl is None:
            return super().hold_worker_id(worker_id)
        digest = hashlib.blake2b(worker_id.encode(), digest_size=8).hexdigest()
        path = f"{self.path}.worker-{digest}.lock"
        fd = _lock_file(path)
        if fd is None:
            raise ConfigurationError(worker_id_in_use(worker_id))
        hold = self._id_holds[worker_id] = [fd, path]

        def release() -> None:
            with self._id_lock:
                if self._id_holds.get(worker_id) is hold:
                    del self._id_holds[worker_id]
                os.close(hold[0])  # closing the file drops its lock

        return release

    def check_worker_id(self, worker_id: str) -> bool:
        """The lock lasts as long as the process, but not if its file is deleted (or
        replaced): another process could then lock a new file under the same name. Lock
        the file found there now; False when another process holds it."""
        hold = self._id_holds.get(worker_id)
        if hold is None:
            return True
        fd, path = hold
        try:
            now, mine = os.stat(path), os.fstat(fd)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return True
        except FileNotFoundError:
            pass
        except OSError:
            return True  # asked again at the next check
        try:
            new = _lock_file(path)
        except OSError:
            return True
        if new is None:
            return False
        with self._id_lock:
            if self._id_holds.get(worker_id) is hold:
                os.close(fd)
                hold[0] = new
                return True
        os.close(new)  # released meanwhile (the worker stopped): not to be held again
        return True

    def call_sync(self, fn: Op, *args: Any, write: bool = True) -> Any:
        """Run an operation from a thread that has no event loop (sync activities)."""
        return self._submit(fn, *args, write=write).result()

    def add_listener(self, callback: Listener) -> None:
        self._listeners.append(callback)

    def remove_listener(self, callback: Listener) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    async def publish(self, run_id: str, item: dict[str, Any]) -> None:
        # one process per SQLite file can hear: another process's followers miss it
        self._hand_out(run_id, item)

    def stats(self) -> dict[str, int]:
        return {"commits": self._commits, "operations": self._ops}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        await asyncio.to_thread(self._thread.join)
        self._close_readers()

    def close_sync(self) -> None:
        """Close from synchronous code."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._close_readers()

    # -- public operations -----------------------------------------------
    def heartbeat_sync(self, task: Task, lease: float, details: str | None) -> bool:
        """``heartbeat`` for sync activities running in a thread."""
        out: bool = self.call_sync(_heartbeat, task, lease, details)
        return out


def _cannot_make_wal_files(exc: sqlite3.OperationalError) -> bool:
    """The error of a read-only open of a WAL-mode file whose -wal or -shm file SQLite
    cannot create (its directory refuses new files)."""
    name = getattr(exc, "sqlite_errorname", "")
    return name in ("SQLITE_READONLY_DIRECTORY", "SQLITE_CANTOPEN", "SQLITE_READONLY_CANTINIT")


def _explain(path: str, exc: sqlite3.DatabaseError) -> str:
    msg = str(exc)
    if "locked" in msg or "busy" in msg:
        return (
            f"store {path!r} is locked by another process and stayed locked past the busy "
            "timeout; stop whatever holds it (another writer, a long read) and retry. "
            "Nothing was written."
        )
    if "not a database" in msg or "malformed" in msg or "corrupt" in msg:
        return (
            f"store {path!r} is not a readable tether database ({msg}): it is corrupted or "
            "another kind of file. Restore it from a backup or point tether at another path; "
            "tether did not modify it."
        )
    return f"store {path!r}: {msg}"


# -- operations (run on the store thread, inside a savepoint) ----------------
