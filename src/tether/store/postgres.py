"""The PostgreSQL store: a few writer threads with group commit, LISTEN/NOTIFY wake-ups.

The shared operations (``_ops.py``) run unchanged; only the runner differs from
SQLite. A small number of writer threads (``writers``), each with its own
connection, drain one shared queue of operations and commit each drained batch
in one transaction, every operation inside its own savepoint, so a failing
operation (a stale lease, a conflict) rolls back alone while the others share
the commit. Completions take the task row ``FOR UPDATE`` to check the fence and
claims use ``FOR UPDATE SKIP LOCKED``, so any number of worker processes can
share one database. A batch that hits a deadlock or serialization failure is
rolled back and run again from the start (operations are pure database work).

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

from .._errors import StoreError
from .._history import Task
from ._ops import Op, OpsStore, _claim, _claim_with_wake, _heartbeat, _renew, _Tx

log = logging.getLogger("tether.store")

Listener = Callable[[set[str], set[str]], None]

_SCHEMA_VERSION = 1
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
        self.clock: Callable[[], float] = time.time
        self._conninfo = conninfo
        self._connect_timeout = connect_timeout
        self._max_batch = max_batch
        self._listeners: list[Listener] = []
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._commits = 0
        self._ops = 0
        self._retries = 0
        self._notified = 0
        self._own_pids: set[int] = set()
        self._closed = False
        self._ctl_channel = ""
        self._ready_channel = _channel("tether_ready", schema)
        self._finished_channel = _channel("tether_finished", schema)

        first = self._connect()
        try:
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
                    return
                text = (
                    resources.files("tether.store").joinpath("sql/postgres/schema.sql").read_text()
                )
                code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
                for statement in code.split(";"):
                    if statement.strip():
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
        try:
            while (batch := self._next_batch()) is not None:
                if conn is None or conn.closed:
                    with self._lock:
                        self._own_pids.discard(pid or 0)
                    pid = None
                    try:
                        conn = self._connect()
                    except StoreError as exc:
                        conn = None
                        self._fail(batch, exc)
                        continue
                if pid is None:
                    pid = conn.info.backend_pid
                    with self._lock:
                        self._own_pids.add(pid)
                try:
                    conn = self._run_batch(conn, batch)
                except BaseException as exc:  # the writer thread must never die
                    log.exception("store batch failed")
                    self._fail(batch, StoreError(f"store operation failed: {exc!r}"))
                    if conn is not None:
                        conn.close()
                    conn = None
        finally:
            if conn is not None:
                conn.close()

    def _run_batch(
        self, conn: psycopg.Connection[Any], batch: list[Any]
    ) -> psycopg.Connection[Any] | None:
        """Run and commit one batch; return the connection to keep (None if it broke)."""
        # a caller that gave up before its operation ran gets nothing applied
        batch = [item for item in batch if item[3].set_running_or_notify_cancel()]
        # lease renewals lock many task rows: alone in their own short transaction they
        # cannot close a deadlock cycle with completions (which lock a task, then its run)
        solo = [item for item in batch if item[0] in _SOLO and item[2]]
        rest = [item for item in batch if not (item[0] in _SOLO and item[2])]
        kept: psycopg.Connection[Any] | None = conn
        for part, alone in [(rest, False)] + [([item], True) for item in solo]:
            if not part:
                continue
            if kept is None:
                self._fail(part, StoreError(f"lost the connection to PostgreSQL store {self.url}"))
                continue
            kept = self._commit(kept, part, alone)
        return kept

    def _commit(
        self, conn: psycopg.Connection[Any], batch: list[Any], solo: bool
    ) -> psycopg.Connection[Any] | None:
        writes = any(w for _, _, w, _ in batch)
        if writes and len(batch) > 1:
            # one lock order for every batch: fewer deadlocks between writer threads
            # claims last: they may wait for a queue_limits row, and the batch that holds
            # it must not be waiting for rows this batch locked earlier
            batch.sort(key=lambda item: (item[0] in _CLAIMS, _run_key(item)))
        attempt = 0
        while True:
            attempt += 1
            try:
                results, ready, finished = self._attempt(conn, batch, writes, solo)
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
                    return conn
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
                return None if conn.broken else conn
            break
        with self._lock:
            if writes:
                self._commits += 1
                self._notified += len(ready) + len(finished)
            self._ops += len(batch)
        for fut, value, error in results:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)
        if ready or finished:
            self._announce(ready, finished)
        return conn

    def _attempt(
        self, conn: psycopg.Connection[Any], batch: list[Any], writes: bool, solo: bool
    ) -> tuple[
        list[tuple[concurrent.futures.Future[Any], Any, BaseException | None]], set[str], set[str]
    ]:
        results: list[tuple[concurrent.futures.Future[Any], Any, BaseException | None]] = []
        ready: set[str] = set()
        finished: set[str] = set()
        # transaction control that needs no result rides along with the next one (one
        # round trip instead of two per operation): "RELEASE op; SAVEPOINT op"
        pending = "BEGIN; " if writes else ""
        if writes and solo:
            pending += f"SET LOCAL lock_timeout = {_SOLO_LOCK_TIMEOUT_MS}; "
        now = self.clock()
        for fut, fn, args, _write in ((b[3], b[0], b[1], b[2]) for b in batch):
            tries = 0
            while True:
                tries += 1
                tx = _Tx(
                    conn,
                    now,
                    paramstyle="format",
                    for_update=" FOR UPDATE",
                    skip_locked=" FOR UPDATE SKIP LOCKED",
                )
                if writes:
                    conn.execute(f"{pending}SAVEPOINT op")
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
            notes = [(self._ready_channel, q) for q in sorted(ready)]
            notes += [(self._finished_channel, r) for r in sorted(finished)]
            # NOTIFY is sent at COMMIT: other stores wake only for committed work
            tail = "".join(
                sql.SQL("SELECT pg_notify({}, {}); ")
                .format(sql.Literal(channel), sql.Literal(payload))
                .as_string(conn)
                for channel, payload in notes
            )
            try:
                conn.execute(f"{pending}{tail}COMMIT")
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
        for _, _, _, fut in batch:
            if not fut.done():
                fut.set_exception(error)

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

    def _announce(self, ready: set[str], finished: set[str]) -> None:
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
                        self._announce({note.payload}, set())
                    elif note.channel == self._finished_channel:
                        self._announce(set(), {note.payload})
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
        return await asyncio.wrap_future(self._submit(fn, *args, write=write))

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


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join()


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
