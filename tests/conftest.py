"""Shared fixtures: an App on a fresh store per test (SQLite and PostgreSQL), and a worker.

The ``app`` fixture runs every test that uses it twice: on a fresh SQLite file
and on a fresh PostgreSQL schema (``TETHER_TEST_PG_URL``, default
``postgresql://postgres@127.0.0.1:5432/test``), dropped afterwards. Without a
reachable server the PostgreSQL variants are skipped, or fail when ``CI`` is set.
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import hypothesis  # noqa: F401  (see below)
import pytest

import tether

# hypothesis is imported here, at collection, not by its plugin's end-of-session summary:
# pytest rewrites hypothesis' modules with ast.parse, and CPython 3.11 can fail that with
# "AST constructor recursion depth mismatch" when a garbage collection runs finalizers in
# the middle of it, which is likely at the end of a session (a run of one test file that
# does not use hypothesis then ends with a SystemError although every test passed)

PG_URL = os.environ.get("TETHER_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
PG_START = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
_pg_problem: list[str | None] = []  # cached result of the first reachability check


def _pg_unreachable() -> str | None:
    """Why PostgreSQL cannot be used for tests, or None when it can."""
    if not _pg_problem:
        try:
            import psycopg
        except ImportError as exc:
            _pg_problem.append(f"psycopg is not installed ({exc}); pip install 'tether[postgres]'")
        else:
            try:
                with psycopg.connect(PG_URL, connect_timeout=3):
                    pass
                _pg_problem.append(None)
            except psycopg.Error as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                _pg_problem.append(
                    f"PostgreSQL at {PG_URL} is not reachable ({first}); start it with "
                    f"`{PG_START}` or set TETHER_TEST_PG_URL"
                )
    return _pg_problem[0]


def require_pg() -> str:
    """The test PostgreSQL URL; skips the test (fails it under CI) when unreachable."""
    problem = _pg_unreachable()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem, pytrace=False)
        pytest.skip(problem)
    return PG_URL


def drop_schema(schema: str) -> None:
    """Remove a test schema and everything in it: sessions a test left on it (a frozen or
    killed worker process's) ended first, and a deadlock with another test process's
    drop tried again (the tests run in several processes)."""
    import time

    import psycopg
    from psycopg import sql

    with psycopg.connect(PG_URL, autocommit=True) as conn:
        for attempt in range(5):
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s AND pid <> pg_backend_pid()",
                (f"tether:{schema}",),
            )
            try:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )
                return
            except psycopg.errors.DeadlockDetected:
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))


def with_schema(url: str, schema: str) -> str:
    """``url`` with tether's ``schema`` query parameter added."""
    return f"{url}{'&' if '?' in url else '?'}schema={schema}"


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """A fresh SQLite file for this test."""
    return tmp_path / "tether.db"


@pytest.fixture
def pg_schema() -> Iterator[str]:
    """A fresh PostgreSQL schema name for this test, dropped afterwards."""
    require_pg()
    schema = f"t_{uuid.uuid4().hex}"
    yield schema
    drop_schema(schema)


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store URL for a fresh, empty store: a SQLite file, or a PostgreSQL schema.

    Open more Apps on the same URL to act as other processes (or a restart).
    """
    if request.param == "sqlite":
        yield f"sqlite:///{request.getfixturevalue('db_path')}"
        return
    yield with_schema(require_pg(), request.getfixturevalue("pg_schema"))


@pytest.fixture
def app(store_url: str) -> Iterator[tether.App]:
    """An App on its own fresh store (once per backend); tests register workflows on it."""
    a = tether.App(store=store_url)
    yield a
    store = a._store
    if store is not None:
        store.close_sync()  # type: ignore[attr-defined]


@pytest.fixture
async def worker(app: tether.App) -> AsyncIterator[tether.Worker]:
    """A worker serving every queue of ``app`` while the test runs.

    Register workflows and activities on ``app`` before requesting this fixture
    only if they use queues other than the default; the worker serves
    ``app.queues()`` as they are when it starts.
    """
    w = app.worker(lease=5.0, poll_interval=0.05)
    await w.start()
    yield w
    await w.stop(grace=2.0)


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Collect each test's abandoned workflow coroutines in its own teardown."""
    yield
    gc.collect()


class PgProxy:
    """A TCP proxy to PostgreSQL whose connections a test can cut (``cut``: as a server
    restart or a proxy dropping its sessions does) or shut for good (``shut``: its
    connections cut, new ones refused)."""

    def __init__(self, host: str, port: int) -> None:
        import socket
        import threading

        self.up = (host, port)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[Any] = []
        self.open = True
        self.refusing = False  #: new connections closed at once (``down``)
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, url: str) -> str:
        """``url`` (a PostgreSQL URL) through this proxy."""
        from urllib.parse import urlsplit

        netloc = urlsplit(url).netloc
        user = netloc.rsplit("@", 1)[0] + "@" if "@" in netloc else ""
        return url.replace(netloc, f"{user}127.0.0.1:{self.port}", 1)

    def _accept(self) -> None:
        import socket
        import threading

        while self.open:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                return
            if self.refusing:
                client.close()
                continue
            upstream = socket.create_connection(self.up)
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: Any, dst: Any) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass

    def cut(self) -> None:
        """Close every connection made so far; new ones are still let through."""
        import socket

        conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def down(self) -> None:
        """An outage (a server restarting): connections cut, new ones refused until ``back``."""
        self.refusing = True
        self.cut()

    def back(self) -> None:
        """The outage is over: new connections are let through again."""
        self.refusing = False

    def shut(self) -> None:
        import socket

        self.open = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        except OSError:
            pass
        self.sock.close()
        self.cut()


def parse_quietly(source: str) -> Any:
    """``ast.parse`` with the garbage collector off: on CPython 3.11 a collection that
    runs finalizers inside it can fail the parse with "AST constructor recursion depth
    mismatch" (a SystemError; seen in test_layers under a parallel run)."""
    import ast

    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        if enabled:
            gc.enable()
