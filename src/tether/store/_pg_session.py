"""The PostgreSQL writer's session: one connection driven in libpq pipeline mode.

A batch of operations runs through a ``_Session``: statements are adapted by psycopg's
``Transformer``, prepared on second use, and sent without waiting when nobody reads
their rows, so ``BEGIN``, the writes, ``pg_notify`` and ``COMMIT`` of a batch cost one
round trip. ``PostgresStore`` (``postgres.py``) owns the sessions and their fallback.
"""

from __future__ import annotations

import collections
import itertools
import logging
import select
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, cast

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer

from .._errors import StoreError

log = logging.getLogger("tether.store")


class _Rows:
    """The rows of one statement, read at once (the connection serves the next one)."""

    __slots__ = ("_pos", "_res", "_rows")

    def __init__(self, rows: list[Any], res: pq.abc.PGresult | None) -> None:
        self._rows = rows
        self._res = res
        self._pos = 0

    @property
    def description(self) -> list[tuple[str, int]] | None:
        """(name, type oid) of each column, or None for a statement without rows."""
        res = self._res
        if res is None:
            return None
        return [((res.fname(i) or b"").decode(), res.ftype(i)) for i in range(res.nfields)]

    def fetchone(self) -> Any:
        """The next row, or None."""
        if self._pos < len(self._rows):
            self._pos += 1
            return self._rows[self._pos - 1]
        return None

    def fetchall(self) -> list[Any]:
        """The remaining rows."""
        rest = self._rows[self._pos :]
        self._pos = len(self._rows)
        return rest

    def __iter__(self) -> Iterator[Any]:
        return iter(self.fetchall())


class _Session:
    """A writer's connection as the operations see it (``_Tx.conn``).

    Statements go straight to libpq (psycopg's ``pgconn``) instead of through a
    psycopg cursor, whose machinery (query conversion, prepared-statement manager,
    result bookkeeping) costs about as much client CPU as the round trip itself.
    psycopg's ``Transformer`` still adapts the parameters and the rows, so values
    are exactly those a cursor would give. A statement is prepared on its second
    use (parse and plan once per connection) and sent with the unnamed statement
    before that, so one-off statements (a ``VALUES`` list of unusual length) leave
    nothing behind on the server.

    Between ``start_pipeline`` and ``finish_pipeline`` the connection is in libpq's
    pipeline mode: a statement without rows to return is only queued, and the
    queue goes out with the next statement whose rows an operation needs (or with
    ``COMMIT``), in one round trip.
    """

    __slots__ = (
        "__weakref__",
        "_counts",
        "_encoding",
        "_ended",
        "_poll",
        "_prepared",
        "_requests",
        "_tx",
        "committing",
        "conn",
        "pgconn",
        "pid",
        "pipelined",
    )

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.pgconn = conn.pgconn
        self.pipelined = False
        #: the batch's COMMIT was handed to libpq: if the connection breaks now, whether
        #: the transaction committed is unknown (before it, it certainly did not)
        self.committing = False
        self.pid = conn.info.backend_pid
        #: the server said it ends the session (a FATAL message while idle)
        self._ended = False
        conn.add_notice_handler(_EndNotice(self))
        self._tx = Transformer(conn)
        self._encoding = conn.info.encoding
        self._prepared: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
        self._counts: dict[tuple[bytes, tuple[int, ...]], int] = {}
        #: pipelined requests whose results are not read yet: each a PREPARE's key, or None
        self._requests: collections.deque[tuple[bytes, tuple[int, ...]] | None] = (
            collections.deque()
        )
        self._poll = select.poll()
        self._poll.register(self.pgconn.socket, select.POLLIN)

    def alive(self) -> bool:
        """Whether the idle connection is still usable, as far as can be told without a
        round trip: a server that ended the session (a restart, ``pg_terminate_backend``,
        a proxy that cut it) has sent its goodbye (``FATAL``) or closed the socket,
        which is then readable. Nothing is sent; a session found dead is the caller's
        to close."""
        pg = self.pgconn
        if pg.status != pq.ConnStatus.OK or self._ended:
            return False
        for _ in range(3):  # (each read takes what is there: a goodbye, then the close)
            if self._ended or not self._poll.poll(0):
                break
            try:
                pg.consume_input()
            except psycopg.Error:  # the socket was closed
                return False
            pg.is_busy()  # parses what came: an error while idle goes to the notice handlers
        return pg.status == pq.ConnStatus.OK and not self._ended

    # -- statements ----------------------------------------------------------

    def guard(self, query: str, params: Sequence[Any] = ()) -> None:
        """Queue a statement whose rows nobody reads; only its error matters (pipelined)."""
        if not self.pipelined:
            raise StoreError("tether: a guard statement outside pipeline mode")
        self.execute(query, params, wait=False)

    def take_task_ids(self, n: int) -> list[int]:
        """``n`` new values of the tasks table's id sequence (never handed out again)."""
        rows = self.execute(
            "SELECT nextval(pg_get_serial_sequence('tasks', 'task_id')) "
            "FROM generate_series(1, %s)",
            (n,),
        ).fetchall()
        return [r[0] for r in rows]

    def execute(
        self, query: str, params: Sequence[Any] = (), *, wait: bool | None = None
    ) -> _Rows | _Sent:
        """Run one statement (``%s`` placeholders); its rows, already read.

        In pipeline mode, ``wait=False`` only queues it (its rows are never read),
        and ``None`` waits when the statement returns rows.
        """
        text = _numbered(query)
        if params:
            tx = self._tx
            values = tx.dump_sequence(params, [PyFormat.AUTO] * len(params))
            types: tuple[int, ...] = tuple(tx.types or ())
            formats: Sequence[pq.Format] | None = tx.formats
        else:
            values, types, formats = [], (), None
        # NULL parameters are None, as for exec_params (psycopg's stub omits it)
        args = cast(Sequence[bytes], values)
        key = (text, types)
        pg = self.pgconn
        name = self._prepared.get(key)
        if name is None:
            seen = self._counts.get(key, 0) + 1
            if seen < _PREPARE_AT or (self.pipelined and len(self._prepared) >= _MAX_PREPARED):
                if len(self._counts) > _MAX_PREPARED:
                    self._counts.clear()
                self._counts[key] = seen
                if not self.pipelined:
                    return self._rows(pg.exec_params(text, values, types, formats, 0))
                pg.send_query_params(text, values, types, formats, 0)
                return self._after_send(query, wait)
            if len(self._prepared) >= _MAX_PREPARED:  # only ours: psycopg keeps its own
                drop = b"; ".join(b"DEALLOCATE " + n for n in self._prepared.values())
                self._check(pg.exec_(drop))
                self._prepared.clear()
            name = b"tether_%d" % next(_statement_ids)
            self._prepared[key] = name
            if not self.pipelined:
                try:
                    self._check(pg.prepare(name, text, types))
                except BaseException:
                    del self._prepared[key]
                    raise
            else:
                pg.send_prepare(name, text, types)
                self._requests.append(key)
        if not self.pipelined:
            return self._rows(pg.exec_prepared(name, args, formats, 0))
        pg.send_query_prepared(name, args, formats, 0)
        return self._after_send(query, wait)

    def send(self, query: str) -> None:
        """Run statements that take no parameters and return nothing of interest.

        In pipeline mode ``query`` must be a single statement (it is only queued).
        """
        if self.pipelined:
            self.pgconn.send_query_params(query.encode(), None)
            self._requests.append(None)
        else:
            self._check(self.pgconn.exec_(query.encode()))

    def cursor(self) -> psycopg.Cursor[Any]:
        """A psycopg cursor on the connection (``executemany`` in ``migrate``)."""
        self.leave_pipeline()  # psycopg must find the connection in its ordinary mode
        return self.conn.cursor()

    # -- pipeline mode ---------------------------------------------------------

    def start_pipeline(self) -> None:
        """Queue statements from now on (the connection must be idle)."""
        self.pgconn.enter_pipeline_mode()
        self.pipelined = True
        self._requests.clear()

    def finish_pipeline(self) -> None:
        """Send everything queued, read every result, leave pipeline mode.

        Raises the first error any queued statement got, after leaving pipeline mode.
        """
        if not self.pipelined:
            return
        pg = self.pgconn
        pg.pipeline_sync()
        self._flush()
        _last, error = self._drain(sync=True)
        pg.exit_pipeline_mode()
        self.pipelined = False
        if error is not None:
            raise pg_errors.error_from_result(error, encoding=self._encoding)

    def leave_pipeline(self) -> None:
        """Like ``finish_pipeline``, for a caller inside an operation (keeps the transaction)."""
        self.finish_pipeline()

    def abandon_pipeline(self) -> None:
        """After a failure: read and drop whatever is queued, leave pipeline mode.

        The transaction stays open (the caller rolls it back). A connection that
        cannot be brought back to a known state is closed.
        """
        if not self.pipelined:
            return
        self.pipelined = False
        pg = self.pgconn
        if pg.status == pq.ConnStatus.BAD:
            self._forget_requests()
            return
        try:
            pg.pipeline_sync()
            self._flush()
            self._drain(sync=True)
            pg.exit_pipeline_mode()
        except psycopg.Error:
            log.debug("could not leave pipeline mode cleanly; closing the connection")
            self._forget_requests()
            self.conn.close()

    def _forget_requests(self) -> None:
        """Unread requests of a broken pipeline: their PREPAREs may not have run."""
        for key in self._requests:
            if key is not None:
                self._prepared.pop(key, None)
        self._requests.clear()

    def _after_send(self, query: str, wait: bool | None) -> _Rows | _Sent:
        self._requests.append(None)
        if not (_returns_rows(query) if wait is None else wait):
            return _SENT
        self.pgconn.send_flush_request()
        self._flush()
        last, error = self._drain(sync=False)
        if error is not None:
            raise pg_errors.error_from_result(error, encoding=self._encoding)
        assert last is not None
        return self._rows(last)

    def _drain(self, *, sync: bool) -> tuple[pq.abc.PGresult | None, pq.abc.PGresult | None]:
        """Read the results of every queued request, and then the sync if ``sync``.

        Returns the last request's result and the first error (or None).
        """
        error: pq.abc.PGresult | None = None
        last: pq.abc.PGresult | None = None
        requests = self._requests
        while requests:
            res = self._next_result()
            if res is None or self._next_result() is not None:
                # every request answers with one result and then NULL
                raise psycopg.OperationalError("tether: pipeline results out of step")
            key = requests.popleft()
            status = res.status
            if key is not None and status != _COMMAND_OK:
                self._prepared.pop(key, None)  # not prepared: prepare it again next time
            if status == _PIPELINE_ABORTED:
                continue  # skipped after an earlier error, which is the one reported
            if status not in (_COMMAND_OK, _TUPLES_OK, _EMPTY_QUERY) and error is None:
                error = res
            last = res
        if sync:
            res = self._next_result()
            if res is None or res.status != _PIPELINE_SYNC:
                raise psycopg.OperationalError("tether: pipeline sync out of step")
        return last, error

    def _next_result(self) -> pq.abc.PGresult | None:
        """``PQgetResult`` without blocking while holding the GIL."""
        pg = self.pgconn
        while pg.is_busy():
            self._poll.poll()  # releases the GIL
            pg.consume_input()
        return pg.get_result()

    def _flush(self) -> None:
        pg = self.pgconn
        while pg.flush():  # the socket buffer is full: wait until it drains
            select.select([], [pg.socket], [])

    # -- results ---------------------------------------------------------------

    def _rows(self, res: pq.abc.PGresult) -> _Rows:
        status = res.status
        if status == _TUPLES_OK:
            tx = self._tx
            tx.set_pgresult(res)
            return _Rows(tx.load_rows(0, res.ntuples, tuple), res)
        self._check(res)
        return _Rows([], None)

    def _check(self, res: pq.abc.PGresult) -> None:
        if res.status not in (_COMMAND_OK, _TUPLES_OK, _EMPTY_QUERY):
            raise pg_errors.error_from_result(res, encoding=self._encoding)


class _EndNotice:
    """A connection's notice handler: notes the server's FATAL goodbye on its session.

    An ended backend sends ``FATAL`` (e.g. 57P01, "terminating connection due to
    administrator command") before it closes the socket; libpq hands a message that
    arrives while the connection is idle to the notice handlers.
    """

    __slots__ = ("_session",)

    def __init__(self, session: _Session) -> None:
        self._session = weakref.ref(session)

    def __call__(self, diag: psycopg.errors.Diagnostic) -> None:
        session = self._session()
        if session is not None and diag.severity_nonlocalized in ("FATAL", "PANIC"):
            session._ended = True


class _NeedsRows(Exception):
    """An operation read the rows of a statement sent without waiting for it."""


class _Sent:
    """A statement queued in pipeline mode: it has no rows to read."""

    __slots__ = ()
    description = None

    def fetchone(self) -> Any:
        """Never: reading this means ``_returns_rows`` misjudged the statement."""
        raise _NeedsRows()

    def fetchall(self) -> list[Any]:
        """As ``fetchone``."""
        raise _NeedsRows()

    def __iter__(self) -> Iterator[Any]:
        raise _NeedsRows()


_SENT = _Sent()
#: statements that answer with rows whatever follows their first word
_ROW_VERBS = frozenset({"SELECT", "WITH", "VALUES", "SHOW", "TABLE", "EXPLAIN", "FETCH"})
_returns_rows_cache: dict[str, bool] = {}


def _returns_rows(query: str) -> bool:
    """Whether ``query`` answers with rows (a read, or a write with ``RETURNING``).

    Decides only whether a pipelined statement is waited for. A wrong guess costs
    time, never correctness: reading the rows of a statement taken for a plain
    write raises ``_NeedsRows``, and the batch runs again on the safe path.
    """
    known = _returns_rows_cache.get(query)
    if known is not None:
        return known
    text = query.lstrip().upper()
    verb = text.split(None, 1)[0] if text else ""
    answer = verb in _ROW_VERBS or "RETURNING" in text
    if len(_returns_rows_cache) > 2000:  # statements with variable IN (...) lists
        _returns_rows_cache.clear()
    _returns_rows_cache[query] = answer
    return answer


_ID_BLOCK = 128  #: task ids a store takes from the sequence at once
_PREPARE_AT = 2  #: uses of a statement (per connection) after which it is prepared
_MAX_PREPARED = 500  #: prepared statements per connection before they are all dropped
_statement_ids = itertools.count(1)
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_EMPTY_QUERY = pq.ExecStatus.EMPTY_QUERY
_PIPELINE_SYNC = pq.ExecStatus.PIPELINE_SYNC
_PIPELINE_ABORTED = pq.ExecStatus.PIPELINE_ABORTED
_numbered_cache: dict[str, bytes] = {}


def _numbered(query: str) -> bytes:
    """``%s`` placeholders as PostgreSQL's ``$1, $2, ...``, encoded (cached)."""
    known = _numbered_cache.get(query)
    if known is not None:
        return known
    parts = query.split("%s")
    if "%" in "".join(parts):
        raise StoreError(f"unsupported '%' in a store statement: {query[:80]!r}")
    text = "".join(f"{part}${i}" for i, part in enumerate(parts[:-1], 1)) + parts[-1]
    if len(_numbered_cache) > 2000:  # statements with variable IN (...) lists
        _numbered_cache.clear()
    _numbered_cache[query] = encoded = text.encode()
    return encoded
