"""The PostgreSQL store: a few writer threads with group commit, LISTEN/NOTIFY wake-ups.

The shared operations (``store/ops/``) run unchanged; only the runner differs from
SQLite. A small number of writer threads (``writers``), each with its own
connection, drain one shared queue of operations and commit each drained batch
in one transaction. Completions take the task row ``FOR UPDATE`` to check the
fence and claims use ``FOR UPDATE SKIP LOCKED``, so any number of worker
processes can share one database.

A write batch first runs on the **fast path**: in libpq's pipeline mode and
without savepoints. A statement whose rows nobody reads (an ``INSERT``,
``UPDATE`` or ``DELETE`` without ``RETURNING``) is only queued, and goes out with
the next statement whose rows an operation needs, so ``BEGIN``, those
statements, one ``pg_notify`` statement and ``COMMIT`` cost no round trip of
their own. Operations almost never fail, but if one does (a stale lease, a
conflict, a racing insert) the transaction is rolled back and the batch runs
again on the **safe path**, each operation inside its own savepoint, so the
failing operation fails alone while the others share the commit. A batch that
hits a deadlock or serialization failure is rolled back and run again from the
start (operations are pure database work). Statements go to libpq directly
(prepared on their second use) rather than through a psycopg cursor, and
results reach each caller's event loop in one hand-off per batch.

Each committing transaction also sends ``pg_notify`` for the queues that got
ready work and the runs that finished; a listener thread in every store LISTENs
and calls the local listeners, so workers and ``run.result()`` in other
processes wake at once instead of polling.

``schema=`` (or ``?schema=NAME`` in the URL) puts tether's tables in their own
PostgreSQL schema, set as the ``search_path`` of every connection, to isolate
tenants or tests. Notification channels are per schema.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from .._errors import ConfigurationError, StoreError
from .._history import Task
from ._clock import ServerClock
from ._handoff import LoopFuture, Outcome, deliver
from ._pg_session import _ID_BLOCK, _Session
from .base import Finished, Listener, worker_id_in_use
from .ops import OpsStore
from .ops._tx import Op, _Tx
from .ops.claims import _claim, _claim_with_wake
from .ops.tasks import _heartbeat, _renew

log = logging.getLogger("tether.store")


_SCHEMA_VERSION = 5
#: statements that bring a store of the version before up to this one
_UPGRADES: dict[int, tuple[str, ...]] = {
    2: ("ALTER TABLE runs ADD COLUMN IF NOT EXISTS waiting_on TEXT",),
    3: (
        "CREATE TABLE IF NOT EXISTS api_keys (key_id TEXT PRIMARY KEY, secret_hash TEXT NOT "
        "NULL, name TEXT, tenant TEXT, role TEXT NOT NULL, created_at DOUBLE PRECISION NOT "
        "NULL, revoked_at DOUBLE PRECISION)",
    ),
    4: (
        "CREATE TABLE IF NOT EXISTS ai_cache (cache_key TEXT PRIMARY KEY, value TEXT NOT NULL, "
        "created_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION NOT NULL)",
        "CREATE TABLE IF NOT EXISTS ai_spend (scope TEXT NOT NULL, day TEXT NOT NULL, tokens "
        "BIGINT NOT NULL, cost TEXT NOT NULL, updated_at DOUBLE PRECISION NOT NULL, "
        "PRIMARY KEY (scope, day))",
        "CREATE TABLE IF NOT EXISTS ai_budgets (scope TEXT PRIMARY KEY, tokens BIGINT, cost TEXT, "
        "updated_at DOUBLE PRECISION NOT NULL)",
    ),
    5: (
        "ALTER TABLE runs ADD COLUMN IF NOT EXISTS attrs TEXT",
        "CREATE TABLE IF NOT EXISTS approvals (approval_id TEXT PRIMARY KEY, run_id TEXT NOT "
        "NULL, name TEXT NOT NULL, fingerprint TEXT NOT NULL, proposal TEXT NOT NULL, "
        "approvers TEXT NOT NULL, deadline_at DOUBLE PRECISION NOT NULL, status TEXT NOT NULL, "
        "level INTEGER NOT NULL, allow_edit INTEGER NOT NULL, decided_by TEXT, "
        "decided_at DOUBLE PRECISION, reason TEXT, reminded_at DOUBLE PRECISION, "
        "created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL)",
        "CREATE INDEX IF NOT EXISTS approvals_by_status ON approvals (status, created_at)",
        "CREATE INDEX IF NOT EXISTS approvals_by_run ON approvals (run_id)",
    ),
}
#: task columns added during development, missing from schemas made by older builds
_TASK_COLUMNS = ("priority", "limit_key", "heartbeat_timeout", "dependency", "batch_key")
_RETRYABLE = (
    pg_errors.DeadlockDetected,
    pg_errors.SerializationFailure,
    pg_errors.LockNotAvailable,  # only solo operations set a lock_timeout
)
_MAX_BATCH_ATTEMPTS = 8
_CLAIMS: frozenset[Op] = frozenset({_claim, _claim_with_wake})
_SOLO: frozenset[Op] = frozenset({_renew})  #: run alone, giving up row locks quickly
_SOLO_LOCK_TIMEOUT_MS = 200
_MAX_SOLO_ATTEMPTS = 100
_MAX_OP_ATTEMPTS = 3  #: re-runs of one operation after a unique violation (racing insert)
_STOP = object()


class PostgresStore(OpsStore):
    """PostgreSQL store for many worker processes sharing one database.

    ``url`` is a libpq URL (``postgresql://user:pass@host:port/db``); a
    ``schema`` query parameter or keyword selects the PostgreSQL schema.
    """

    def __init__(
        self,
        url: str,
        *,
        schema: str | None = None,
        writers: int = 4,
        max_batch: int = 256,
        connect_timeout: float = 10.0,
    ) -> None:
        conninfo, url_schema = _split_url(url)
        if schema is not None and url_schema is not None and schema != url_schema:
            raise StoreError(
                f"conflicting schemas for store {_redact(url)}: {url_schema!r} in the URL and "
                f"{schema!r} as an argument; give it once"
            )
        schema = schema if schema is not None else url_schema
        if schema is not None and (not schema or "\x00" in schema):
            raise StoreError(f"invalid PostgreSQL schema name {schema!r}")
        if writers < 1:
            raise StoreError(f"writers must be at least 1, got {writers}")
        self.url = _redact(conninfo)
        self.schema = schema
        #: the database server's time: every worker on this database agrees on it
        self.server_clock = ServerClock()
        self.clock: Callable[[], float] = self.server_clock
        self._conninfo = conninfo
        self._connect_timeout = connect_timeout
        self._max_batch = max_batch
        self._listeners: list[Listener] = []
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._commits = 0
        self._ops = 0
        self._retries = 0
        self._fallbacks = 0
        self._notified = 0
        self._own_pids: set[int] = set()
        self._known_limited: set[str] = set()  #: queues seen with limits (see _Tx)
        self._task_ids: list[int] = []  #: taken from the tasks' sequence, not used yet
        self._task_ids_lock = threading.Lock()
        self._closed = False
        self._ctl_channel = ""
        self._ready_channel = _channel("tether_ready", schema)
        self._finished_channel = _channel("tether_finished", schema)

        first = self._connect()
        try:
            self.server_clock.sync(functools.partial(_server_time, first))
            self._migrate(first)
            listen_conn = self._connect_listener()
        except BaseException:
            first.close()
            raise
        self._listen_conn: psycopg.Connection[Any] | None = listen_conn
        self._threads = [
            threading.Thread(
                target=self._loop,
                args=(first if i == 0 else None,),
                name=f"tether-pg-writer-{i}",
                daemon=True,
            )
            for i in range(writers)
        ]
        self._listener_thread = threading.Thread(
            target=self._listen_loop, name="tether-pg-listener", daemon=True
        )
        for t in self._threads:
            t.start()
        self._listener_thread.start()

    # -- connections ------------------------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        try:
            conn = psycopg.connect(
                self._conninfo,
                autocommit=True,
                connect_timeout=max(1, round(self._connect_timeout)),
                application_name=f"tether:{self.schema}"[:63] if self.schema else "tether",
            )
        except psycopg.Error as exc:
            raise StoreError(
                f"cannot connect to PostgreSQL store {self.url}: {_first_line(exc)}. Check that "
                "the server is running and reachable and that the URL's host, port, user, "
                "password and database are right (e.g. `pg_isready -h HOST -p PORT`)."
            ) from exc
        try:
            if self.schema is not None:
                conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
        except psycopg.Error as exc:
            conn.close()
            raise StoreError(f"PostgreSQL store {self.url}: {_first_line(exc)}") from exc
        return conn

    def _connect_listener(self) -> psycopg.Connection[Any]:
        conn = self._connect()
        try:
            # the control channel lets close() wake this thread at once
            ctl = f"tether_ctl_{conn.info.backend_pid}"
            for channel in (self._ready_channel, self._finished_channel, ctl):
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            self._ctl_channel = ctl
        except psycopg.Error as exc:
            conn.close()
            raise StoreError(f"PostgreSQL store {self.url}: {_first_line(exc)}") from exc
        return conn

    def _migrate(self, conn: psycopg.Connection[Any]) -> None:
        """Create the schema and tables once, safely when many workers start together."""
        where = f"{self.url} (schema {self.schema or 'public'!r})"
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key(self.schema),))
                if self.schema is not None:
                    exists = conn.execute(
                        "SELECT 1 FROM pg_namespace WHERE nspname = %s", (self.schema,)
                    ).fetchone()
                    if exists is None:
                        conn.execute(
                            sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.schema))
                        )
                row = conn.execute("SELECT to_regclass('tether_meta')").fetchone()
                version = 0
                if row is not None and row[0] is not None:
                    got = conn.execute("SELECT max(version) FROM tether_meta").fetchone()
                    version = got[0] if got is not None and got[0] is not None else 0
                if version > _SCHEMA_VERSION:
                    raise StoreError(
                        f"store {where} has schema version {version}, newer than this tether "
                        f"({_SCHEMA_VERSION}); upgrade tether to open it"
                    )
                if version == _SCHEMA_VERSION:
                    self._check_columns(conn, where)
                    return
                text = (
                    resources.files("tether.store").joinpath("sql/postgres/schema.sql").read_text()
                )
                code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
                if version == 0:
                    for statement in code.split(";"):
                        if statement.strip():
                            conn.execute(statement)
                else:
                    for step in range(version + 1, _SCHEMA_VERSION + 1):
                        for statement in _UPGRADES[step]:
                            conn.execute(statement)
                conn.execute(
                    "INSERT INTO tether_meta (version, applied_at) VALUES (%s, %s) "
                    "ON CONFLICT DO NOTHING",
                    (_SCHEMA_VERSION, time.time()),
                )
        except psycopg.Error as exc:
            raise StoreError(
                f"cannot set up the tether schema in PostgreSQL store {where}: "
                f"{_first_line(exc)}. The user needs CREATE privilege on the database (or on "
                "the schema) the first time tether opens it."
            ) from exc

    @staticmethod
    def _check_columns(conn: psycopg.Connection[Any], where: str) -> None:
        """Refuse a schema made by a pre-release build that lacks today's columns."""
        have = {
            (table, column)
            for table, column in conn.execute(
                "SELECT table_name, column_name FROM information_schema.columns "
                "WHERE table_schema = current_schema() AND table_name IN ('tasks', 'runs')"
            ).fetchall()
        }
        wanted = [("tasks", c) for c in _TASK_COLUMNS] + [("runs", "tenant")]
        missing = [f"{t}.{c}" for t, c in wanted if (t, c) not in have]
        if missing:
            raise StoreError(
                f"store {where} was created by an older development build of tether (it "
                f"lacks {', '.join(missing)}); finish or export its runs with that build, "
                "then use a new database or schema"
            )

    # -- writer threads -----------------------------------------------------

    def _next_batch(self) -> list[Any] | None:
        item = self._queue.get()
        if item is _STOP:
            return None
        batch = [item]
        while len(batch) < self._max_batch:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is _STOP:
                self._queue.put(_STOP)
                break
            batch.append(nxt)
        return batch

    def _loop(self, conn: psycopg.Connection[Any] | None) -> None:
        pid: int | None = None
        session = _Session(conn) if conn is not None else None
        try:
            while (batch := self._next_batch()) is not None:
                if session is None or session.conn.closed:
                    with self._lock:
                        self._own_pids.discard(pid or 0)
                    pid = None
                    try:
                        session = _Session(self._connect())
                    except StoreError as exc:
                        session = None
                        self._fail(batch, exc)
                        continue
                if pid is None:
                    pid = session.conn.info.backend_pid
                    with self._lock:
                        self._own_pids.add(pid)
                if self.server_clock.due():
                    try:
                        self.server_clock.sync(functools.partial(_server_time, session.conn))
                    except psycopg.Error as exc:  # the batch finds out what is wrong
                        log.warning("could not read the database server's clock: %s", exc)
                try:
                    session = self._run_batch(session, batch)
                except BaseException as exc:  # the writer thread must never die
                    log.exception("store batch failed")
                    self._fail(batch, StoreError(f"store operation failed: {exc!r}"))
                    if session is not None:
                        session.conn.close()
                    session = None
        finally:
            if session is not None:
                session.conn.close()

    def _run_batch(self, session: _Session, batch: list[Any]) -> _Session | None:
        """Run and commit one batch; return the session to keep (None if it broke)."""
        # a caller that gave up before its operation ran gets nothing applied
        batch = [item for item in batch if item[3].set_running_or_notify_cancel()]
        # lease renewals lock many task rows: alone in their own short transaction they
        # cannot close a deadlock cycle with completions (which lock a task, then its run)
        solo = [item for item in batch if item[0] in _SOLO and item[2]]
        rest = [item for item in batch if not (item[0] in _SOLO and item[2])]
        kept: _Session | None = session
        for part, alone in [(rest, False)] + [([item], True) for item in solo]:
            if not part:
                continue
            if kept is None:
                self._fail(part, StoreError(f"lost the connection to PostgreSQL store {self.url}"))
                continue
            kept = self._commit(kept, part, alone)
        return kept

    def _commit(self, session: _Session, batch: list[Any], solo: bool) -> _Session | None:
        conn = session.conn
        writes = any(w for _, _, w, _ in batch)
        if writes and len(batch) > 1:
            # one lock order for every batch: fewer deadlocks between writer threads
            # claims last: they may wait for a queue_limits row, and the batch that holds
            # it must not be waiting for rows this batch locked earlier
            batch.sort(key=lambda item: (item[0] in _CLAIMS, _run_key(item)))
        safe = not writes  # reads run statement by statement in autocommit mode
        attempt = 0
        while True:
            attempt += 1
            try:
                if safe:
                    results, ready, finished = self._attempt(session, batch, writes, solo)
                else:
                    results, ready, finished = self._attempt_fast(session, batch, solo)
            except _Fallback as fallback:
                # an operation failed on the fast path: nothing was committed; run the
                # batch again with a savepoint per operation, so that one fails alone
                self._rollback(conn)
                if conn.broken or conn.closed:
                    self._fail(batch, self._lost(fallback.error))
                    return None
                log.debug("batch of %d falls back to savepoints: %r", len(batch), fallback.error)
                with self._lock:
                    self._fallbacks += 1
                safe = True
                attempt -= 1
                continue
            except _Retry as retry:
                self._rollback(conn)
                if conn.broken:
                    self._fail(batch, self._lost(retry.error))
                    return None
                if attempt >= (_MAX_SOLO_ATTEMPTS if solo else _MAX_BATCH_ATTEMPTS):
                    self._fail(
                        batch,
                        StoreError(
                            f"PostgreSQL store {self.url}: gave up after {attempt} attempts "
                            f"({_first_line(retry.error)}); nothing was written, retry later"
                        ),
                    )
                    return session
                log.debug(
                    "retrying a batch of %d operations (%s): %s",
                    len(batch),
                    ", ".join(b[0].__name__ for b in batch),
                    retry.error,
                )
                with self._lock:
                    self._retries += 1
                time.sleep(random.uniform(0, 0.005 * min(attempt, 10)))
                continue
            except psycopg.Error as exc:
                self._rollback(conn)
                self._fail(batch, self._lost(exc) if conn.broken else self._explain(exc))
                return None if conn.broken else session
            break
        with self._lock:
            if writes:
                self._commits += 1
                self._notified += len(ready) + len(finished)
            self._ops += len(batch)
        deliver(results)
        if ready or finished:
            self._announce(ready, finished)
        return session

    def _attempt_fast(
        self, session: _Session, batch: list[Any], solo: bool
    ) -> tuple[list[Outcome], set[str], Finished]:
        """Run a write batch without savepoints and commit it.

        Raises ``_Retry`` (deadlock, serialization failure, lost connection) or
        ``_Fallback`` (any other failure of any operation); either way nothing was
        committed and the caller rolls back.
        """
        conn = session.conn
        results: list[Outcome] = []
        ready: set[str] = set()
        finished: Finished = {}
        now = self.clock()
        try:
            session.start_pipeline()
            session.send("BEGIN")
            if solo:
                session.send(f"SET LOCAL lock_timeout = {_SOLO_LOCK_TIMEOUT_MS}")
            for fn, args, _write, fut in batch:
                tx = self._tx(session, now, optimistic=True)
                value = fn(tx, *args)
                ready |= tx.ready
                finished |= tx.finished
                results.append((fut, value, None))
            notify = self._notify_text(ready, finished, conn)
            if notify:
                session.send(notify)
            session.send("COMMIT")
            session.finish_pipeline()
        except BaseException as exc:
            session.abandon_pipeline()
            if isinstance(exc, psycopg.Error) and (conn.broken or isinstance(exc, _RETRYABLE)):
                raise _Retry(exc) from exc
            if isinstance(exc, Exception):
                raise _Fallback(exc) from exc
            raise
        return results, ready, finished

    def _tx(self, session: _Session, now: float, *, optimistic: bool) -> _Tx:
        """One operation's view of the batch's transaction, in PostgreSQL's dialect."""
        return _Tx(
            session,
            now,
            paramstyle="format",
            for_update=" FOR UPDATE",
            skip_locked=" FOR UPDATE SKIP LOCKED",
            known_limited=self._known_limited,
            optimistic=optimistic,
            new_task_id=functools.partial(self._new_task_id, session) if optimistic else None,
        )

    def _new_task_id(self, session: _Session) -> int:
        """A task id from the tasks table's own sequence, taken ``_ID_BLOCK`` at a time
        (shared by the writers): a row inserted with it needs no ``RETURNING`` read."""
        with self._task_ids_lock:
            if not self._task_ids:
                self._task_ids = sorted(session.take_task_ids(_ID_BLOCK), reverse=True)
            return self._task_ids.pop()

    def _commit_text(
        self, pending: str, ready: set[str], finished: Finished, conn: psycopg.Connection[Any]
    ) -> str:
        """``COMMIT`` preceded by ``pending`` and one ``pg_notify`` per wake-up.

        NOTIFY is delivered at COMMIT: other stores wake only for committed work.
        """
        notify = self._notify_text(ready, finished, conn)
        return f"{pending}{notify}; COMMIT" if notify else f"{pending}COMMIT"

    def _notify_text(
        self, ready: set[str], finished: Finished, conn: psycopg.Connection[Any]
    ) -> str:
        """One statement sending every wake-up of a commit ("" if there is none)."""
        notes = [(self._ready_channel, q) for q in sorted(ready)]
        notes += [(self._finished_channel, r) for r in sorted(finished)]
        if not notes:
            return ""
        calls = ", ".join(
            sql.SQL("pg_notify({}, {})")
            .format(sql.Literal(channel), sql.Literal(payload))
            .as_string(conn)
            for channel, payload in notes
        )
        return f"SELECT {calls}"

    def _attempt(
        self, session: _Session, batch: list[Any], writes: bool, solo: bool
    ) -> tuple[list[Outcome], set[str], Finished]:
        """The safe path: each write operation in its own savepoint, one round trip at a time."""
        conn = session.conn
        results: list[Outcome] = []
        ready: set[str] = set()
        finished: Finished = {}
        # transaction control that needs no result rides along with the next one (one
        # round trip instead of two per operation): "RELEASE op; SAVEPOINT op"
        pending = "BEGIN; " if writes else ""
        if writes and solo:
            pending += f"SET LOCAL lock_timeout = {_SOLO_LOCK_TIMEOUT_MS}; "
        now = self.clock()
        for fn, args, _write, fut in batch:
            tries = 0
            while True:
                tries += 1
                tx = self._tx(session, now, optimistic=False)
                if writes:
                    session.send(f"{pending}SAVEPOINT op")
                try:
                    value = fn(tx, *args)
                except BaseException as exc:
                    if isinstance(exc, psycopg.Error) and (
                        conn.broken or isinstance(exc, _RETRYABLE)
                    ):
                        raise _Retry(exc) from exc
                    pending = "ROLLBACK TO SAVEPOINT op; RELEASE SAVEPOINT op; " if writes else ""
                    if isinstance(exc, pg_errors.UniqueViolation) and tries < _MAX_OP_ATTEMPTS:
                        continue  # a concurrent insert won; re-run to see its row
                    if isinstance(exc, psycopg.Error):
                        exc = self._explain(exc)
                    results.append((fut, None, exc))
                    break
                pending = "RELEASE SAVEPOINT op; " if writes else ""
                ready |= tx.ready
                finished |= tx.finished
                results.append((fut, value, None))
                break
        if writes:
            try:
                session.send(self._commit_text(pending, ready, finished, conn))
            except _RETRYABLE as exc:
                raise _Retry(exc) from exc
        return results, ready, finished

    @staticmethod
    def _rollback(conn: psycopg.Connection[Any]) -> None:
        if conn.broken or conn.closed:
            return
        try:
            conn.execute("ROLLBACK")
        except psycopg.Error:
            conn.close()

    @staticmethod
    def _fail(batch: list[Any], error: BaseException) -> None:
        deliver([(fut, None, error) for _, _, _, fut in batch])

    def _lost(self, exc: BaseException) -> StoreError:
        return StoreError(
            f"lost the connection to PostgreSQL store {self.url} ({_first_line(exc)}); the "
            "operation may or may not have been committed. tether reconnects on the next "
            "operation; check the server if this repeats."
        )

    def _explain(self, exc: psycopg.Error) -> StoreError:
        err = StoreError(f"PostgreSQL store {self.url}: {_first_line(exc)}")
        err.__cause__ = exc
        return err

    def _announce(self, ready: set[str], finished: Finished) -> None:
        for cb in list(self._listeners):
            cb(ready, finished)

    # -- cross-process wake-ups ---------------------------------------------------

    def _listen_loop(self) -> None:
        conn = self._listen_conn
        delay = 0.1
        while not self._closed:
            try:
                if conn is None:
                    conn = self._connect_listener()
                    delay = 0.1
                for note in _notifies(conn):
                    if self._closed or note.channel == self._ctl_channel:
                        break
                    if note.pid in self._own_pids:
                        continue  # our own commit: listeners were already called
                    if note.channel == self._ready_channel:
                        self._announce({note.payload}, {})
                    elif note.channel == self._finished_channel:
                        self._announce(set(), {note.payload: None})
            except (psycopg.Error, StoreError):
                if conn is not None:
                    conn.close()
                    conn = None
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        if conn is not None:
            conn.close()

    # -- Store plumbing ---------------------------------------------------------

    def _submit(self, fn: Op, *args: Any, write: bool = True) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise StoreError("the store is closed")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((fn, args, write, fut))
        return fut

    async def _do(self, fn: Op, *args: Any, write: bool = True) -> Any:
        if self._closed:
            raise StoreError("the store is closed")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.put((fn, args, write, LoopFuture(loop, fut)))
        return await fut

    def hold_worker_id(self, worker_id: str) -> Callable[[], None]:
        """A session advisory lock on its own connection: the server drops it when the
        holding process dies (its connection closes)."""
        key = hashlib.blake2b(
            f"tether:worker:{self.schema or ''}:{worker_id}".encode(), digest_size=8
        ).digest()
        conn = self._connect()
        try:
            row = conn.execute(
                "SELECT pg_try_advisory_lock(%s)", (int.from_bytes(key, "big", signed=True),)
            ).fetchone()
        except psycopg.Error as exc:
            conn.close()
            raise self._explain(exc) from exc
        if not (row and row[0]):
            conn.close()
            raise ConfigurationError(worker_id_in_use(worker_id))
        return conn.close

    def call_sync(self, fn: Op, *args: Any, write: bool = True) -> Any:
        """Run an operation from a thread that has no event loop (sync activities)."""
        return self._submit(fn, *args, write=write).result()

    def heartbeat_sync(self, task: Task, lease: float, details: str | None) -> bool:
        """``heartbeat`` for sync activities running in a thread."""
        out: bool = self.call_sync(_heartbeat, task, lease, details)
        return out

    def add_listener(self, callback: Listener) -> None:
        self._listeners.append(callback)

    def remove_listener(self, callback: Listener) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "commits": self._commits,
                "operations": self._ops,
                "retries": self._retries,
                "fallbacks": self._fallbacks,
                "notifications": self._notified,
            }

    def _stop(self) -> list[threading.Thread]:
        self._closed = True
        wake: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((_wake_listener, (self._ctl_channel,), False, wake))
        for _ in self._threads:
            self._queue.put(_STOP)
        return [*self._threads, self._listener_thread]

    async def close(self) -> None:
        if self._closed:
            return
        threads = self._stop()
        await asyncio.to_thread(_join, threads)

    def close_sync(self) -> None:
        """Close from synchronous code."""
        if self._closed:
            return
        _join(self._stop())


class _Retry(Exception):
    """A batch must be rolled back and run again (deadlock, serialization failure)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _Fallback(Exception):
    """An operation failed on the fast path: roll back, run the batch with savepoints."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(repr(error))
        self.error = error


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join()


def _server_time(conn: psycopg.Connection[Any]) -> float:
    """The database server's clock, in seconds since the epoch (one round trip)."""
    row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
    assert row is not None
    return float(row[0])


def _wake_listener(tx: _Tx, channel: str) -> None:
    """Queued by ``close``: notify the listener thread's control channel."""
    tx.execute("SELECT pg_notify(?, '')", (channel,))


def _notifies(conn: psycopg.Connection[Any]) -> Iterator[psycopg.Notify]:
    """Notifications arriving within a short wait (so the loop can see ``close``)."""
    yield from conn.notifies(timeout=1.0)


def _run_key(item: tuple[Op, tuple[Any, ...], bool, Any]) -> str:
    """The run an operation mainly touches, to order a batch's row locks."""
    for arg in item[1]:
        if isinstance(arg, Task):
            return arg.run_id
        if isinstance(arg, str):
            return arg
    return ""


def _lock_key(schema: str | None) -> int:
    """The advisory lock serialising schema set-up in one PostgreSQL schema."""
    digest = hashlib.blake2b(f"tether:migrate:{schema or ''}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _channel(base: str, schema: str | None) -> str:
    """A NOTIFY channel per schema, within PostgreSQL's 63-byte identifier limit."""
    if schema is None:
        return base
    name = f"{base}:{schema}"
    if len(name.encode()) <= 63:
        return name
    return f"{base}:{hashlib.blake2b(schema.encode(), digest_size=16).hexdigest()}"


def _split_url(url: str) -> tuple[str, str | None]:
    """Take tether's own ``schema`` parameter out of a libpq URL."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    schema = None
    rest = []
    for key, value in query:
        if key == "schema":
            schema = value
        else:
            rest.append((key, value))
    if parts.scheme == "postgres":
        parts = parts._replace(scheme="postgresql")
    return urlunsplit(parts._replace(query=urlencode(rest))), schema


def _redact(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
