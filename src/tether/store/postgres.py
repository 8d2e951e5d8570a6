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
import contextlib
import functools
import hashlib
import json
import logging
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, unquote, unquote_plus, urlsplit, urlunsplit

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from .._errors import ConfigurationError, StoreError
from .._history import Task
from .._redact import shown_error
from ._clock import ServerClock
from ._counters import POSTGRES as COUNTERS
from ._handoff import LoopFuture, Outcome, deliver
from ._pg_session import _ID_BLOCK, _Session
from .base import Finished, HistoryListener, Listener, StreamListener, worker_id_in_use
from .ops import OpsStore
from .ops._tx import CHAINS, ENCRYPTED_BEFORE, OFFLOADED_BEFORE, Op, SealState, _Tx
from .ops.ai import _add_spend, _hold_spend, _release_hold, _reserve_spend
from .ops.claims import _claim, _claim_with_wake
from .ops.tasks import _heartbeat, _renew

log = logging.getLogger("tether.store")


_SCHEMA_VERSION = 16
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
    6: (
        "CREATE TABLE IF NOT EXISTS webhook_outbox (delivery_id BIGINT GENERATED BY DEFAULT "
        "AS IDENTITY PRIMARY KEY, run_id TEXT NOT NULL, url TEXT NOT NULL, workflow TEXT NOT "
        "NULL, status TEXT NOT NULL, output TEXT, error TEXT, tenant TEXT, ended_at DOUBLE "
        "PRECISION, attempts INTEGER NOT NULL, state TEXT NOT NULL, last_error TEXT, next_at "
        "DOUBLE PRECISION NOT NULL, delivered_at DOUBLE PRECISION, created_at DOUBLE "
        "PRECISION NOT NULL)",
        "CREATE INDEX IF NOT EXISTS webhook_outbox_due ON webhook_outbox (state, next_at)",
        "CREATE INDEX IF NOT EXISTS webhook_outbox_by_run ON webhook_outbox (run_id)",
    ),
    7: (
        "CREATE TABLE IF NOT EXISTS switches (kind TEXT NOT NULL, name TEXT NOT NULL, by_whom"
        " TEXT, reason TEXT, created_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (kind, name))",
        "CREATE TABLE IF NOT EXISTS audit_log (id BIGINT GENERATED BY DEFAULT AS IDENTITY "
        "PRIMARY KEY, at DOUBLE PRECISION NOT NULL, actor TEXT NOT NULL, action TEXT NOT "
        "NULL, target TEXT NOT NULL, detail TEXT)",
        "CREATE INDEX IF NOT EXISTS audit_log_by_target ON audit_log (target, id)",
    ),
    8: (
        "CREATE TABLE IF NOT EXISTS schedules (schedule_id TEXT PRIMARY KEY, workflow "
        "TEXT NOT NULL, queue TEXT NOT NULL, input TEXT NOT NULL, spec TEXT NOT NULL, "
        "tenant TEXT, paused INTEGER NOT NULL DEFAULT 0, note TEXT, next_at DOUBLE "
        "PRECISION, last_tick DOUBLE PRECISION, last_run_id TEXT, buffered DOUBLE "
        "PRECISION, fired BIGINT NOT NULL DEFAULT 0, skipped BIGINT NOT NULL DEFAULT 0, "
        "version BIGINT NOT NULL DEFAULT 1, created_at DOUBLE PRECISION NOT NULL, "
        "updated_at DOUBLE PRECISION NOT NULL)",
        "CREATE TABLE IF NOT EXISTS purged_runs (run_id TEXT PRIMARY KEY, workflow TEXT, "
        "reason TEXT NOT NULL, purged_at DOUBLE PRECISION NOT NULL)",
        "CREATE INDEX IF NOT EXISTS dead_letters_by_run ON dead_letters (run_id)",
    ),
    9: ("ALTER TABLE tenant_limits ADD COLUMN IF NOT EXISTS retention DOUBLE PRECISION",),
    10: COUNTERS,  # run counters kept by triggers
    11: (
        "CREATE TABLE IF NOT EXISTS signal_ids (chain_id TEXT NOT NULL, signal_id TEXT NOT "
        "NULL, run_id TEXT NOT NULL, seq BIGINT NOT NULL, created_at DOUBLE PRECISION NOT NULL, "
        "PRIMARY KEY (chain_id, signal_id))",
        "CREATE INDEX IF NOT EXISTS signal_ids_by_run ON signal_ids (run_id)",
    ),
    12: (
        "CREATE TABLE IF NOT EXISTS seal_keys (key_id TEXT PRIMARY KEY, fingerprint TEXT "
        "NOT NULL, created_at DOUBLE PRECISION NOT NULL)",
        ENCRYPTED_BEFORE,
        OFFLOADED_BEFORE,
    ),
    13: (
        "CREATE TABLE IF NOT EXISTS blob_deletions (ref TEXT PRIMARY KEY, spare_from "
        "DOUBLE PRECISION NOT NULL, noted_at DOUBLE PRECISION NOT NULL)",
    ),
    14: CHAINS,  # each continue-as-new chain's head, for chains made before it
    # SQLite's history became a rowid table; PostgreSQL's heap table needs nothing (the
    # two stores keep one version number)
    15: (),
    16: (
        "CREATE TABLE IF NOT EXISTS ai_holds (run_id TEXT NOT NULL, step BIGINT NOT NULL, "
        "holder TEXT NOT NULL, scopes TEXT NOT NULL, day TEXT NOT NULL, tokens BIGINT NOT "
        "NULL, cost TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL, "
        "PRIMARY KEY (run_id, step))",
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
#: run alone, giving up row locks quickly: lease renewals (many task rows), and a model
#: call's (or a batch's) daily-spend writes (a tenant's row, then the global one: in a
#: batch with other tenants' writes they would close lock cycles between writer threads)
_SOLO: frozenset[Op] = frozenset({_renew, _reserve_spend, _add_spend, _hold_spend, _release_hold})
_SOLO_LOCK_TIMEOUT_MS = 200
_MAX_SOLO_ATTEMPTS = 100
_MAX_OP_ATTEMPTS = 3  #: re-runs of one operation after a unique violation (racing insert)
_STOP = object()

#: libpq's TCP settings for every store connection, unless the URL sets its own: a
#: network path cut without a reset (a firewall dropping state, a host gone) fails the
#: connection within about 30 s instead of hanging a worker or a request for ever
_TCP_DEFAULTS = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",  # ms that sent data may stay unacknowledged
}
#: the server's twins of those settings (set per session): the server drops a dead
#: client's backend as soon, rolling back its transaction and releasing its row locks
_SERVER_TCP = {
    "tcp_keepalives_idle": "keepalives_idle",
    "tcp_keepalives_interval": "keepalives_interval",
    "tcp_keepalives_count": "keepalives_count",
    "tcp_user_timeout": "tcp_user_timeout",
}


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
        try:
            conninfo, url_schema = _split_url(url)
            _check_conninfo(conninfo)
        except ValueError as exc:  # e.g. an unclosed "[" of an IPv6 host
            why = _masked(url, exc)
            raise _never(
                f"invalid store URL {_redact(url)}: {why}; the form is "
                "postgresql://user:password@host:port/dbname",
                f"the store URL is invalid ({why}): fix it",
            ) from None
        if schema is not None and url_schema is not None and schema != url_schema:
            raise _never(
                f"conflicting schemas for store {_redact(url)}: {url_schema!r} in the URL and "
                f"{schema!r} as an argument; give it once",
                "the store URL and the schema argument name different schemas: give it once",
            )
        schema = schema if schema is not None else url_schema
        if schema is not None and (not schema or "\x00" in schema):
            raise _never(
                f"invalid PostgreSQL schema name {schema!r}",
                "the store URL's schema name is invalid: fix it",
            )
        if writers < 1:
            raise StoreError(f"writers must be at least 1, got {writers}")
        self.url = _redact(conninfo)
        self.schema = schema
        #: the database server's time: every worker on this database agrees on it
        self.server_clock = ServerClock()
        self.clock: Callable[[], float] = self.server_clock
        self._conninfo = conninfo
        self._tcp, self._setup = _tcp_settings(conninfo, schema)
        self._connect_timeout = connect_timeout
        self._max_batch = max_batch
        self._listeners: list[Listener] = []
        #: worker id -> [the connection holding its advisory lock, the lock's key]
        self._id_holds: dict[str, list[Any]] = {}
        #: a check of a hold (in a thread) may take it again while the hold is released
        self._id_lock = threading.Lock()
        self._history_listeners: list[HistoryListener] = []
        self._stream_listeners: list[StreamListener] = []
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._commits = 0
        self._ops = 0
        self._retries = 0
        self._fallbacks = 0
        self._reconnects = 0
        self._notified = 0
        self._own_pids: set[int] = set()
        self._known_limited: set[str] = set()  #: queues seen with limits (see _Tx)
        self._keys = SealState()  #: whether a keyring sealed into the store (see _Tx)
        self._task_ids: list[int] = []  #: taken from the tasks' sequence, not used yet
        self._task_ids_lock = threading.Lock()
        self._closed = False
        self._ctl_channel = ""
        self._ready_channel = _channel("tether_ready", schema)
        self._finished_channel = _channel("tether_finished", schema)
        self._events_channel = _channel("tether_events", schema)
        self._stream_channel = _channel("tether_stream", schema)

        began = time.monotonic()
        try:
            first = self._connect()
        except StoreError as exc:
            sqlstate = getattr(exc.__cause__, "sqlstate", None)
            # a quick failure to connect may be the server's refusal (no such database
            # or role...), whose SQLSTATE libpq keeps to itself: asked for again
            quick = time.monotonic() - began < connect_timeout / 2
            if sqlstate is None and quick and isinstance(exc.__cause__, psycopg.OperationalError):
                sqlstate = _refusal_once(conninfo, _first_line(exc.__cause__), connect_timeout)
            raise self._refused(exc, sqlstate) from exc.__cause__
        try:
            self.server_clock.sync(functools.partial(_server_time, first))
            self._migrate(first)
            listen_conn = self._connect_listener()
        except BaseException as exc:
            first.close()
            if isinstance(exc, StoreError) and not exc.permanent:
                sqlstate = getattr(exc.__cause__, "sqlstate", None)
                raise self._refused(exc, sqlstate, connecting=False) from exc.__cause__
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
                **self._tcp,
            )
        except psycopg.Error as exc:
            raise StoreError(_cannot_connect(self._conninfo, exc)) from exc
        try:
            if self._setup is not None:  # one round trip (the simple query protocol)
                conn.execute(self._setup)
        except psycopg.Error as exc:
            conn.close()
            raise StoreError(f"PostgreSQL store {self.url}: {_first_line(exc)}") from exc
        return conn

    def _refused(
        self, exc: StoreError, sqlstate: str | None, *, connecting: bool = True
    ) -> StoreError:
        """``exc`` (opening failed) or, if the server refused with a ``sqlstate`` that
        waiting does not mend, a ``StoreError`` saying so (``permanent``)."""
        what = _NEVER.get(sqlstate or "")
        if what is None or (not connecting and sqlstate in _URL_OPTIONS):
            return exc  # (after connecting, a bad setting is not the URL's: retried)
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        # (a failure to connect said to check that the server runs: it does)
        said = (
            f"cannot open PostgreSQL store {self.url}: {_masked(self._conninfo, cause)}"
            if connecting
            else str(exc)
        )
        err = _never(f"{said} [SQLSTATE {sqlstate}]: {what}", f"{what} (SQLSTATE {sqlstate})")
        err.__cause__ = cause
        return err

    def _connect_listener(self) -> psycopg.Connection[Any]:
        conn = self._connect()
        try:
            # the control channel lets close() wake this thread at once
            ctl = f"tether_ctl_{conn.info.backend_pid}"
            for channel in (
                self._ready_channel,
                self._finished_channel,
                self._events_channel,
                self._stream_channel,
                ctl,
            ):
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
                    raise _never(
                        f"store {where} has schema version {version}, newer than this tether "
                        f"({_SCHEMA_VERSION}); upgrade tether to open it",
                        f"its schema version {version} is newer than this tether's "
                        f"({_SCHEMA_VERSION}): upgrade tether",
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
                    for statement in COUNTERS:  # (a function body holds semicolons)
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
            raise _never(
                f"store {where} was created by an older development build of tether (it "
                f"lacks {', '.join(missing)}); finish or export its runs with that build, "
                "then use a new database or schema",
                "it was created by an older development build of tether: finish or "
                "export its runs with that build, then use a new database or schema",
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
        session = self._adopt(conn) if conn is not None else None
        try:
            while (batch := self._next_batch()) is not None:
                if session is not None and not session.alive():
                    # the server ended the session while it was idle (a restart, a
                    # terminated backend, a cut proxy): no batch is failed for that
                    self._drop(session)
                    session = None
                if session is None:
                    try:
                        session = self._open_session()
                    except StoreError as exc:
                        self._fail(batch, exc)
                        continue
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
                        self._drop(session)
                    session = None
        finally:
            if session is not None:
                self._drop(session)

    def _adopt(self, conn: psycopg.Connection[Any]) -> _Session:
        """A writer's session on ``conn``; its notifications are known as our own."""
        session = _Session(conn)
        with self._lock:
            self._own_pids.add(session.pid)
        return session

    def _open_session(self) -> _Session:
        """A writer's session on a new connection (``StoreError`` if none can be had)."""
        return self._adopt(self._connect())

    def _drop(self, session: _Session) -> None:
        """Close a writer's session (whatever state it is in)."""
        with self._lock:
            self._own_pids.discard(session.pid)
        with contextlib.suppress(Exception):
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
                try:
                    kept = self._open_session()
                except StoreError as exc:
                    self._fail(part, exc)
                    continue
            kept = self._commit(kept, part, alone)
        return kept

    def _commit(self, session: _Session, batch: list[Any], solo: bool) -> _Session | None:
        writes = any(w for _, _, w, _ in batch)
        if writes and len(batch) > 1:
            # one lock order for every batch: fewer deadlocks between writer threads
            # claims last: they may wait for a queue_limits row, and the batch that holds
            # it must not be waiting for rows this batch locked earlier
            batch.sort(key=lambda item: (item[0] in _CLAIMS, _run_key(item)))
        safe = not writes  # reads run statement by statement in autocommit mode
        attempt = 0
        moved = False  #: the batch already moved to a new connection once
        while True:
            attempt += 1
            conn = session.conn
            session.committing = False
            try:
                if safe:
                    results, ready, finished, touched = self._attempt(session, batch, writes, solo)
                else:
                    results, ready, finished, touched = self._attempt_fast(session, batch, solo)
            except _Fallback as fallback:
                # an operation failed on the fast path: nothing was committed; run the
                # batch again with a savepoint per operation, so that one fails alone
                self._rollback(conn)
                if conn.broken or conn.closed:
                    fresh = self._move(session, batch, writes, moved, fallback.error)
                    if fresh is None:
                        return None
                    session, moved = fresh, True
                    attempt -= 1
                    continue
                # (the error's text may hold a payload: shown as the redaction hook allows)
                log.debug(
                    "batch of %d falls back to savepoints: %s: %s",
                    len(batch),
                    type(fallback.error).__name__,
                    shown_error(fallback.error),
                )
                with self._lock:
                    self._fallbacks += 1
                safe = True
                attempt -= 1
                continue
            except _Retry as retry:
                self._rollback(conn)
                if conn.broken or conn.closed:
                    fresh = self._move(session, batch, writes, moved, retry.error)
                    if fresh is None:
                        return None
                    session, moved = fresh, True
                    attempt -= 1
                    continue
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
                if conn.broken or conn.closed:
                    fresh = self._move(session, batch, writes, moved, exc)
                    if fresh is None:
                        return None
                    session, moved = fresh, True
                    attempt -= 1
                    continue
                self._fail(batch, self._explain(exc))
                return session
            break
        with self._lock:
            if writes:
                self._commits += 1
                self._notified += len(ready) + len(finished)
            self._ops += len(batch)
        deliver(results)
        if ready or finished:
            self._announce(ready, finished)
        if touched:
            self._history_grew(touched)
        return session

    def _move(
        self,
        session: _Session,
        batch: list[Any],
        writes: bool,
        moved: bool,
        error: BaseException,
    ) -> _Session | None:
        """The connection broke under ``batch``: drop it, and return a new session to run
        the batch again on, or None (the batch failed).

        Only a batch that certainly did not commit moves: a read, or a write whose
        ``COMMIT`` was not yet handed to libpq (the server rolls back a transaction
        whose connection is gone). One whose ``COMMIT`` may have reached the server
        fails with "may or may not have been committed", and so does one that moved
        once already (the database is away: the caller hears so at once).
        """
        unknown = writes and session.committing
        self._drop(session)
        if moved or unknown:
            self._fail(batch, self._lost(error, unknown))
            return None
        log.info(
            "the connection to PostgreSQL store %s broke before the batch committed (%s); "
            "running it again on a new connection",
            self.url,
            _first_line(error),
        )
        try:
            fresh = self._open_session()
        except StoreError as exc:
            self._fail(batch, exc)
            return None
        with self._lock:
            self._reconnects += 1
        return fresh

    def _attempt_fast(
        self, session: _Session, batch: list[Any], solo: bool
    ) -> tuple[list[Outcome], set[str], Finished, set[str]]:
        """Run a write batch without savepoints and commit it.

        Raises ``_Retry`` (deadlock, serialization failure, lost connection) or
        ``_Fallback`` (any other failure of any operation); either way nothing was
        committed and the caller rolls back.
        """
        conn = session.conn
        results: list[Outcome] = []
        ready: set[str] = set()
        finished: Finished = {}
        touched: set[str] = set()
        learned: dict[str, str | None] = {}
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
                touched |= tx.touched
                if tx.learned:
                    learned.update(tx.learned)
                results.append((fut, value, None))
            notify = self._notify_text(ready, finished, touched, conn)
            if notify:
                session.send(notify)
            session.committing = True
            session.send("COMMIT")
            session.finish_pipeline()
        except BaseException as exc:
            session.abandon_pipeline()
            if isinstance(exc, psycopg.Error) and (conn.broken or isinstance(exc, _RETRYABLE)):
                raise _Retry(exc) from exc
            if isinstance(exc, Exception):
                raise _Fallback(exc) from exc
            raise
        if learned and self.codec is not None:
            self.codec.learned(learned)  # (committed: see _Tx.learn)
        return results, ready, finished, touched

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
            codec=self.codec,
            keys=self._keys,
        )

    def _new_task_id(self, session: _Session) -> int:
        """A task id from the tasks table's own sequence, taken ``_ID_BLOCK`` at a time
        (shared by the writers): a row inserted with it needs no ``RETURNING`` read."""
        with self._task_ids_lock:
            if not self._task_ids:
                self._task_ids = sorted(session.take_task_ids(_ID_BLOCK), reverse=True)
            return self._task_ids.pop()

    def _commit_text(
        self,
        pending: str,
        ready: set[str],
        finished: Finished,
        touched: set[str],
        conn: psycopg.Connection[Any],
    ) -> str:
        """``COMMIT`` preceded by ``pending`` and one ``pg_notify`` per wake-up.

        NOTIFY is delivered at COMMIT: other stores wake only for committed work.
        """
        notify = self._notify_text(ready, finished, touched, conn)
        return f"{pending}{notify}; COMMIT" if notify else f"{pending}COMMIT"

    def _notify_text(
        self,
        ready: set[str],
        finished: Finished,
        touched: set[str],
        conn: psycopg.Connection[Any],
    ) -> str:
        """One statement sending every wake-up of a commit ("" if there is none); the
        runs whose history grew go newline-separated in as few notes as fit PostgreSQL's
        payload limit."""
        notes = [(self._ready_channel, q) for q in sorted(ready)]
        notes += [(self._finished_channel, r) for r in sorted(finished)]
        notes += [(self._events_channel, p) for p in _joined(sorted(touched))]
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
    ) -> tuple[list[Outcome], set[str], Finished, set[str]]:
        """The safe path: each write operation in its own savepoint, one round trip at a time."""
        conn = session.conn
        results: list[Outcome] = []
        ready: set[str] = set()
        finished: Finished = {}
        touched: set[str] = set()
        learned: dict[str, str | None] = {}
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
                touched |= tx.touched
                if tx.learned:
                    learned.update(tx.learned)
                results.append((fut, value, None))
                break
        if writes:
            session.committing = True
            try:
                session.send(self._commit_text(pending, ready, finished, touched, conn))
            except _RETRYABLE as exc:
                raise _Retry(exc) from exc
        if learned and self.codec is not None:
            self.codec.learned(learned)  # (committed: see _Tx.learn)
        return results, ready, finished, touched

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

    def _lost(self, exc: BaseException, unknown: bool = True) -> StoreError:
        """``unknown``: the ``COMMIT`` may have reached the server."""
        outcome = (
            "the operation may or may not have been committed"
            if unknown
            else "nothing was committed"
        )
        return StoreError(
            f"lost the connection to PostgreSQL store {self.url} ({_first_line(exc)}); "
            f"{outcome}. tether reconnects on the next operation; check the server if this "
            "repeats."
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
                    elif note.channel == self._stream_channel and self._stream_listeners:
                        self._heard(note.payload)
                    elif note.channel == self._events_channel and self._history_listeners:
                        runs = set(note.payload.split("\n"))
                        self._history_grew(runs)
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
        lock = int.from_bytes(key, "big", signed=True)
        conn = self._connect()
        # The server ends a dead session's locks only once its backend has exited, a
        # moment after the connection dropped: a worker restarted at once after a crash
        # tries again for a short grace before it is refused.
        deadline = time.monotonic() + _ID_HOLD_GRACE
        while True:
            try:
                row = conn.execute("SELECT pg_try_advisory_lock(%s)", (lock,)).fetchone()
            except psycopg.Error as exc:
                conn.close()
                raise self._explain(exc) from exc
            if row and row[0]:
                # [connection, lock key, guard]: the guard keeps the id's watch and its
                # release off the connection at the same moment (psycopg's C code may
                # crash the process on a connection closed while another thread uses it)
                hold = self._id_holds[worker_id] = [conn, lock, threading.RLock()]
                return functools.partial(self._release_id, worker_id, hold)
            if time.monotonic() >= deadline:
                conn.close()
                raise ConfigurationError(worker_id_in_use(worker_id))
            time.sleep(0.1)

    def _release_id(self, worker_id: str, hold: list[Any]) -> None:
        """End the hold on ``worker_id`` (its lock ends with its session)."""
        with hold[2], self._id_lock:
            if self._id_holds.get(worker_id) is hold:
                del self._id_holds[worker_id]
            hold[0].close()

    def check_worker_id(self, worker_id: str) -> bool:
        """The session holding the id's lock may have ended while this process lives
        (``pg_terminate_backend``, a dropped connection), and the lock with it: take it
        again on a new session. False when another process took it meanwhile; True when
        the hold stands, was taken again, or the server cannot be reached (asked again
        at the next check)."""
        hold = self._id_holds.get(worker_id)
        if hold is None:
            return True
        with hold[2]:  # (never beside _release_id on the same connection)
            if self._id_holds.get(worker_id) is not hold:
                return True  # released meanwhile (the worker stopped or was killed)
            try:
                hold[0].execute("SELECT 1").fetchone()
                return True
            except psycopg.Error:
                pass
            with contextlib.suppress(Exception):
                hold[0].close()
            try:
                conn = self._connect()
            except Exception:
                return True
            try:
                row = conn.execute("SELECT pg_try_advisory_lock(%s)", (hold[1],)).fetchone()
            except psycopg.Error:
                conn.close()
                return True
            if row and row[0]:
                with self._id_lock:
                    if self._id_holds.get(worker_id) is hold:
                        hold[0] = conn
                        return True
                conn.close()  # released meanwhile: not to be held again
                return True
            conn.close()
            return False

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

    async def publish(self, run_id: str, item: dict[str, Any]) -> None:
        self._hand_out(run_id, item)
        payload = json.dumps({"r": run_id, "i": item}, separators=(",", ":"), ensure_ascii=False)
        if len(payload.encode()) > _PAYLOAD_LIMIT:
            return  # too big for a notification: other processes' followers miss it
        await self._do(_notify, self._stream_channel, payload)

    def _heard(self, payload: str) -> None:
        """A published item from another process: to the stream listeners."""
        try:
            note = json.loads(payload)
            run_id, item = note["r"], note["i"]
        except (ValueError, KeyError, TypeError):
            return
        self._hand_out(run_id, item)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "commits": self._commits,
                "operations": self._ops,
                "retries": self._retries,
                "fallbacks": self._fallbacks,
                "notifications": self._notified,
                "reconnects": self._reconnects,
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


#: seconds ``close`` waits for the store's threads to finish what they run: a server
#: that does not answer (frozen, or a network that drops packets silently) would keep
#: a writer waiting, and the close with it, for as long as the socket stays open
CLOSE_WAIT = 10.0


def _join(threads: list[threading.Thread]) -> None:
    deadline = time.monotonic() + CLOSE_WAIT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        log.warning(
            "closing the PostgreSQL store: %d thread(s) (%s) did not finish within %g s, "
            "waiting on a server that does not answer; the store is closed without them "
            "(daemon threads: an operation they run may still end, or fail, later; a "
            "statement_timeout in the store URL bounds such waits)",
            len(stuck),
            ", ".join(stuck),
            CLOSE_WAIT,
        )


def _server_time(conn: psycopg.Connection[Any]) -> float:
    """The database server's clock, in seconds since the epoch (one round trip)."""
    row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
    assert row is not None
    return float(row[0])


#: PostgreSQL refuses a NOTIFY payload of 8,000 bytes or more
#: how long a worker id held by a session that just died is waited for (seconds)
_ID_HOLD_GRACE = 3.0
_PAYLOAD_LIMIT = 7900


def _joined(run_ids: list[str]) -> list[str]:
    """``run_ids`` newline-separated into payloads under the NOTIFY limit (a run id
    holding a newline only misses its wake-up; streams re-read now and then anyway)."""
    out: list[str] = []
    part: list[str] = []
    size = 0
    for r in run_ids:
        if part and size + len(r) + 1 > _PAYLOAD_LIMIT:
            out.append("\n".join(part))
            part, size = [], 0
        part.append(r)
        size += len(r) + 1
    if part:
        out.append("\n".join(part))
    return out


def _notify(tx: _Tx, channel: str, payload: str) -> None:
    """Send one notification, delivered when the batch commits."""
    tx.execute("SELECT pg_notify(?, ?)", (channel, payload))


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


def _tcp_settings(conninfo: str, schema: str | None) -> tuple[dict[str, Any], sql.Composed | None]:
    """The TCP settings libpq is to add to ``conninfo`` (those it does not set), and
    the statements that set up each new session: its search path, and the server's
    side of the same TCP settings (unless ``options`` sets them with ``-c``)."""
    try:
        given = {k: str(v) for k, v in psycopg.conninfo.conninfo_to_dict(conninfo).items()}
    except psycopg.Error:  # connecting fails and says why
        given = {}
    client: dict[str, Any] = {k: v for k, v in _TCP_DEFAULTS.items() if k not in given}
    wanted = {**_TCP_DEFAULTS, **{k: given[k] for k in _TCP_DEFAULTS if k in given}}
    statements = []
    if schema is not None:
        statements.append(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
    for guc, param in _SERVER_TCP.items():
        if guc in given.get("options", "") or (
            param.startswith("keepalives") and wanted["keepalives"] == "0"
        ):
            continue  # the URL's own choice
        statements.append(
            sql.SQL("SET {} = {}").format(sql.Identifier(guc), sql.Literal(wanted[param]))
        )
    return client, sql.SQL("; ").join(statements) if statements else None


def _split_url(url: str) -> tuple[str, str | None]:
    """Take tether's own ``schema`` parameter out of a libpq URL."""
    parts = urlsplit(url)
    schema = None
    rest = []  # libpq's parameters as written: re-encoding would turn "%20" into "+"
    for item in parts.query.split("&") if parts.query else ():
        pairs = parse_qsl(item, keep_blank_values=True)
        if pairs and pairs[0][0] == "schema":
            schema = pairs[0][1]
        elif item:
            rest.append(item)
    if parts.scheme == "postgres":
        parts = parts._replace(scheme="postgresql")
    return urlunsplit(parts._replace(query="&".join(rest))), schema


#: parts of query parameter names whose values are secret (libpq's ``password`` and
#: ``sslpassword``, and whatever a pooler or driver adds: tokens, keys, secrets)
_SECRET_PARAMS = ("pass", "pwd", "secret", "token", "key")


def _secret_param(name: str) -> bool:
    name = unquote_plus(name).lower()
    if name in ("sslkey", "sslrootcert", "sslcert", "sslcrl", "passfile"):
        return False  # file paths, not secrets
    return any(part in name for part in _SECRET_PARAMS)


#: a password in a key=value connection string (``host=... password=s3cr3t``), quoted
#: or not
_KV_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s']+)")


def _redact(url: str) -> str:
    """The URL without its password or any secret query parameter, for messages
    (also when the URL does not parse: then everything that might be one is masked;
    a key=value connection string: its password)."""
    if "://" not in url:
        return _KV_PASSWORD.sub(r"\1***", url)
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # malformed: mask the user info and every parameter's value
        url = re.sub(r"(://[^:/@?#]*):.*@", r"\1:***@", url)  # up to the last "@"
        return re.sub(r"([?&][^=&#]*=)[^&#]*", r"\1***", url)
    if password is not None:
        user = parts.netloc.rsplit("@", 1)[0].split(":", 1)[0]
        parts = parts._replace(netloc=f"{user}:***@{parts.netloc.rsplit('@', 1)[1]}")
    if parts.query:
        masked = []
        for item in parts.query.split("&"):
            name, sep, _ = item.partition("=")
            masked.append(f"{name}=***" if sep and _secret_param(name) else item)
        parts = parts._replace(query="&".join(masked))
    return urlunsplit(parts)


def _secrets(url: str) -> list[str]:
    """The password and secret parameter values in ``url``, as written and decoded."""
    found: set[str] = set()
    if "://" not in url:  # a key=value connection string
        for match in _KV_PASSWORD.finditer(url):
            value = match.group(2)
            found |= {value, value.strip("'")} - {""}
        return sorted(found, key=len, reverse=True)
    try:
        parts = urlsplit(url)
        if parts.password:
            found |= {parts.password, unquote(parts.password)}
    except ValueError:
        return []
    for item in parts.query.split("&"):
        name, sep, value = item.partition("=")
        if sep and value and _secret_param(name):
            found |= {value, unquote_plus(value)}
    return sorted(found, key=len, reverse=True)


def _cannot_connect(url: str, exc: BaseException) -> str:
    """Why connecting to ``url`` failed (libpq may quote a secret: masked) and what to check."""
    why = _first_line(exc)
    for secret in _secrets(url):
        why = why.replace(secret, "***")
    return (
        f"cannot connect to PostgreSQL store {_redact(url)}: {why}. Check that the server "
        "is running and reachable and that the URL's host, port, user, password and "
        "database are right (e.g. `pg_isready -h HOST -p PORT`)."
    )


#: the SQLSTATEs with which a server refuses a store that waiting will not mend (what
#: the URL names is wrong, or lacks a grant), and what to do. Any other failure (the
#: server down or starting up, too many connections...) is retried.
_NEVER = {
    "3D000": "the database does not exist: create it (createdb) or fix the store URL's "
    "database name",
    "28000": "the server refuses the role (it does not exist, or pg_hba.conf does not "
    "let it connect): create the role, or fix the store URL's user or pg_hba.conf",
    "28P01": "password authentication failed: fix the store URL's password (or the role's)",
    "42501": "the role lacks a privilege tether needs (CONNECT on the database; CREATE on "
    "it or on the schema the first time tether opens it): grant it",
    "22023": "an option in the store URL has an invalid value: fix it",
    "42704": "an option in the store URL names an unknown setting: fix it",
}


#: the SQLSTATEs of ``_NEVER`` that blame the URL's options: only while connecting
_URL_OPTIONS = frozenset({"22023", "42704"})


def _never(message: str, permanent: str) -> StoreError:
    """A ``StoreError`` that waiting does not mend: ``permanent`` says why without the URL."""
    err = StoreError(message)
    err.permanent = permanent
    return err


def _masked(url: str, exc: BaseException) -> str:
    """``exc``'s first line with ``url``'s secrets masked (libpq may quote one)."""
    why = _first_line(exc)
    for secret in _secrets(url):
        why = why.replace(secret, "***")
    return why


def _check_conninfo(conninfo: str) -> None:
    """``ValueError`` if libpq cannot take ``conninfo`` (what no attempt to connect mends)."""
    try:
        given = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        raise ValueError(_first_line(exc)) from None
    for port in str(given.get("port") or "").split(","):
        if port.strip() and not port.strip().isdigit():
            raise ValueError(f"invalid port {port.strip()!r}")


#: a field of an ErrorResponse in libpq's trace: its SQLSTATE (``C "3D000"``)
_TRACED_SQLSTATE = re.compile(rb'\tErrorResponse\t.* C "([0-9A-Z]{5})"')


#: what ``_refusal`` found, by store and error: a store retried while its server is down
#: (or refuses it) asks once, not at every attempt (each asks for a connection more, and
#: leaves libpq's trace stream behind)
_REFUSALS: dict[tuple[str, str], str | None] = {}


def _refusal_once(conninfo: str, error: str, timeout: float) -> str | None:
    """``_refusal`` of ``conninfo``, asked once per error it failed with."""
    key = (conninfo, error)
    if key not in _REFUSALS:
        if len(_REFUSALS) >= 64:
            _REFUSALS.clear()
        _REFUSALS[key] = _refusal(conninfo, timeout)
    return _REFUSALS[key]


def _refusal(conninfo: str, timeout: float) -> str | None:
    """The SQLSTATE with which the server refuses a connection to ``conninfo``, or None
    (it was not reached, or accepted; more than one host; not on Linux).

    libpq does not keep the SQLSTATE of a failed connection where psycopg could show it
    (its error's ``sqlstate`` is None then), and its message is in the server's language,
    so a second attempt is made with libpq tracing the startup exchange (into memory: it
    may hold a password message) and the code read from the server's ``ErrorResponse``."""
    import os
    import selectors

    from psycopg import pq

    try:
        hosts = str(psycopg.conninfo.conninfo_to_dict(conninfo).get("host") or "")
        if "," in hosts or not hasattr(os, "memfd_create"):
            return None
        target = psycopg.conninfo.make_conninfo(
            conninfo, connect_timeout=max(1, round(timeout)), application_name="tether"
        )
        fd = os.memfd_create("tether-pg-trace")
    except (psycopg.Error, OSError):
        return None
    pgconn = pq.PGconn.connect_start(target.encode())
    try:
        try:
            pgconn.trace(fd)  # (libpq's stream on fd is never closed: a few bytes)
            pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        except psycopg.Error:  # tracing is only on Linux
            return None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            while pgconn.status != pq.ConnStatus.BAD:
                polled = pgconn.connect_poll()
                if polled in (pq.PollingStatus.OK, pq.PollingStatus.FAILED):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                event = (
                    selectors.EVENT_READ
                    if polled == pq.PollingStatus.READING
                    else selectors.EVENT_WRITE
                )
                selector.register(pgconn.socket, event)
                selector.select(left)
                selector.unregister(pgconn.socket)
        pgconn.untrace()
        traced = os.pread(fd, 1 << 16, 0)
    except (psycopg.Error, OSError):
        return None
    finally:
        # untraced (libpq's stream flushed: nothing of it is written to fd once closed)
        with contextlib.suppress(psycopg.Error):
            pgconn.untrace()
        pgconn.finish()
        os.close(fd)
    codes = _TRACED_SQLSTATE.findall(traced)
    return codes[-1].decode() if codes else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
