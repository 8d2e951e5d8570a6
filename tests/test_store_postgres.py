"""PostgreSQL-specific store behaviour: concurrent set-up, SKIP LOCKED claims across
processes, LISTEN/NOTIFY wake-ups, fencing across instances, deadlock retries, errors.

Every test runs on a fresh schema (``pg_schema``) and is skipped (failed under CI)
when the test server is unreachable; see ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tether
from conftest import PG_URL, with_schema

psycopg = pytest.importorskip("psycopg")

from tether.store.postgres import _SCHEMA_VERSION as SCHEMA_VERSION  # noqa: E402
from tether.store.postgres import PostgresStore  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def open_stores(pg_schema: str) -> Iterator[list[PostgresStore]]:
    """Stores opened by a test; closed at the end (before the schema is dropped)."""
    stores: list[PostgresStore] = []
    yield stores
    for s in stores:
        s.close_sync()


def _store(stores: list[PostgresStore], schema: str, **options: Any) -> PostgresStore:
    s = PostgresStore(PG_URL, schema=schema, **options)
    stores.append(s)
    return s


def _query(schema: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        cur = conn.execute(sql, params)
        return list(cur.fetchall()) if cur.description is not None else []


# -- schema set-up ---------------------------------------------------------------


def test_concurrent_migration_from_four_threads_is_safe(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def open_one() -> None:
        barrier.wait()
        try:
            s = PostgresStore(PG_URL, schema=pg_schema, writers=1)
        except BaseException as exc:
            errors.append(exc)
            return
        with lock:
            open_stores.append(s)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(open_stores) == 4
    assert _query(pg_schema, "SELECT version FROM tether_meta") == [(SCHEMA_VERSION,)]
    tables = {
        r[0]
        for r in _query(
            pg_schema,
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
            pg_schema,
        )
    }
    assert {"runs", "events", "tasks", "tether_meta"} <= tables


def test_concurrent_migration_from_four_processes_is_safe(pg_schema: str) -> None:
    url = with_schema(PG_URL, pg_schema)
    code = (
        "import sys, time; from tether.store import open_store\n"
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"
        "s = open_store(sys.argv[1]); s.close_sync(); print('ok')\n"
    )
    start_at = time.time() + 1.5  # after every interpreter has imported tether
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, url, str(start_at)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    assert all(out.strip() == "ok" for out, _ in outs), outs
    assert _query(pg_schema, "SELECT version FROM tether_meta") == [(SCHEMA_VERSION,)]


def test_newer_schema_version_is_refused(pg_schema: str, open_stores: list[PostgresStore]) -> None:
    _store(open_stores, pg_schema)
    _query(pg_schema, "INSERT INTO tether_meta (version, applied_at) VALUES (99, 0)")
    with pytest.raises(tether.StoreError, match=r"schema version 99.*upgrade tether") as got:
        PostgresStore(PG_URL, schema=pg_schema)
    assert got.value.permanent and "upgrade tether" in got.value.permanent


def test_schema_from_an_older_build_is_refused_untouched(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    _store(open_stores, pg_schema).close_sync()
    _query(pg_schema, "ALTER TABLE tasks DROP COLUMN batch_key")
    with pytest.raises(tether.StoreError, match=r"older development build.*tasks\.batch_key"):
        PostgresStore(PG_URL, schema=pg_schema)
    # nothing was changed: the column is still missing, the version row is intact
    cols = _query(
        pg_schema,
        "SELECT column_name FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND table_name = 'tasks'",
    )
    assert ("batch_key",) not in cols
    assert _query(pg_schema, "SELECT version FROM tether_meta") == [(SCHEMA_VERSION,)]


def test_postgres_schema_has_the_same_columns_as_sqlite(
    pg_schema: str, open_stores: list[PostgresStore], db_path: Path
) -> None:
    """The shared operations need both schemas to agree; this catches one being forgotten."""
    tether.App(store=f"sqlite:///{db_path}").store.close_sync()  # type: ignore[attr-defined]
    lite = sqlite3.connect(db_path)
    names = [
        r[0]
        for r in lite.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        )
    ]
    sqlite_cols = {t: {r[1] for r in lite.execute(f"PRAGMA table_info({t})")} for t in names}
    lite.close()
    _store(open_stores, pg_schema)
    pg_cols: dict[str, set[str]] = {}
    for table, column in _query(
        pg_schema,
        "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = %s",
        pg_schema,
    ):
        pg_cols.setdefault(table, set()).add(column)
    pg_cols.pop("tether_meta")  # SQLite keeps the version in PRAGMA user_version
    assert pg_cols == sqlite_cols


# -- two instances ("processes") on one database --------------------------------


async def test_two_instances_never_claim_the_same_task(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    a = _store(open_stores, pg_schema)
    b = _store(open_stores, pg_schema)
    n = 300
    await asyncio.gather(
        *(a.create_run(run_id=f"r{i}", workflow="wf", queue="q", input="[]") for i in range(n))
    )
    claimed: dict[str, list[int]] = {"A": [], "B": []}

    async def drain(store: PostgresStore, name: str) -> None:
        while True:
            batch = await asyncio.gather(
                *(store.claim(worker_id=name, queues=["q"], limit=7, lease=60) for _ in range(4))
            )
            got = [t.task_id for tasks in batch for t in tasks]
            if not got:
                return
            claimed[name].extend(got)

    await asyncio.gather(drain(a, "A"), drain(b, "B"))
    both = claimed["A"] + claimed["B"]
    assert len(both) == n
    assert len(set(both)) == n  # no task was handed out twice
    assert claimed["A"] and claimed["B"]  # both instances really competed


async def test_notify_wakes_the_other_instance_within_a_second(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    a = _store(open_stores, pg_schema)
    b = _store(open_stores, pg_schema)
    seen: list[tuple[set[str], set[str], float]] = []
    got = threading.Event()

    def on_commit(ready: set[str], finished: set[str]) -> None:
        seen.append((ready, finished, time.monotonic()))
        got.set()

    b.add_listener(on_commit)
    t0 = time.monotonic()
    await a.create_run(run_id="r1", workflow="wf", queue="wake-q", input="[]")
    assert await asyncio.to_thread(got.wait, 1.0), "no wake-up reached the other instance"
    assert seen[0][0] == {"wake-q"} and seen[0][2] - t0 < 1.0

    got.clear()
    t0 = time.monotonic()
    await a.terminate("r1", "done")
    assert await asyncio.to_thread(got.wait, 1.0)
    assert any("r1" in finished for _, finished, _ in seen)
    assert b.stats()["commits"] == 0  # b only heard about a's commits


async def test_notify_does_not_cross_schemas(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    other = f"{pg_schema}_other"
    a = _store(open_stores, pg_schema)
    b = PostgresStore(PG_URL, schema=other)
    try:
        seen: list[set[str]] = []
        b.add_listener(lambda ready, finished: seen.append(ready))
        await a.create_run(run_id="r1", workflow="wf", queue="q", input="[]")
        await asyncio.sleep(0.3)
        assert seen == []
    finally:
        b.close_sync()
        _query(pg_schema, f'DROP SCHEMA "{other}" CASCADE')


def _register(app: tether.App) -> tether.Workflow[[int], int]:
    """The same code registered on any App, as each process imports it."""

    @app.activity
    def double(x: int) -> int:
        return 2 * x

    @app.workflow
    async def wf(x: int) -> int:
        return await double(x)

    return wf


async def test_result_in_another_process_returns_promptly(pg_schema: str) -> None:
    """A worker polling only every 30 s is woken by NOTIFY; so is the waiting client."""
    url = with_schema(PG_URL, pg_schema)
    server = tether.App(store=url)
    client = tether.App(store=url)
    _register(server)
    wf = _register(client)
    w = server.worker(lease=5.0, poll_interval=30.0)
    await w.start()
    try:
        await asyncio.sleep(0.3)  # the worker is idle, waiting for a wake-up
        t0 = time.monotonic()
        run = await client.start(wf, 21)
        assert await run.result(timeout=20) == 42
        elapsed = time.monotonic() - t0
        # well under a second when idle; a poll would take up to 30 s (loaded CI is slow)
        assert elapsed < 15.0, f"took {elapsed:.2f}s"
    finally:
        await w.stop(grace=2.0)
        await server.close()
        await client.close()


async def test_stale_fence_from_another_instance_is_rejected(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    from tether.store.base import WorkflowTaskResult

    a = _store(open_stores, pg_schema)
    b = _store(open_stores, pg_schema)
    await a.create_run(run_id="r1", workflow="wf", queue="q", input="[]")
    (stale,) = await a.claim(worker_id="A", queues=["q"], limit=1, lease=-1)  # expired at once
    (fresh,) = await b.claim(worker_id="B", queues=["q"], limit=1, lease=30)
    assert fresh.task_id == stale.task_id and fresh.fence == stale.fence + 1
    empty = WorkflowTaskResult(commands=[], through=1, time=a.clock())
    with pytest.raises(tether.LeaseLostError):
        await a.complete_workflow_task(stale, empty)
    with pytest.raises(tether.LeaseLostError):
        await a.fail_workflow_task(stale, "boom", a.clock())
    assert await a.renew([stale], 30) == {}
    assert len(await a.read_history("r1")) == 1  # nothing was written
    await b.complete_workflow_task(fresh, empty)
    assert len(await a.read_history("r1")) == 2


async def test_concurrent_stale_and_fresh_completions_only_fresh_commit(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    """Two instances complete the same tasks at once: only the current fences commit."""
    from tether.store.base import WorkflowTaskResult

    a = _store(open_stores, pg_schema)
    b = _store(open_stores, pg_schema)
    for i in range(20):
        await a.create_run(run_id=f"r{i}", workflow="wf", queue="q", input="[]")
    tasks = await a.claim(worker_id="A", queues=["q"], limit=20, lease=-1)
    again = await b.claim(worker_id="B", queues=["q"], limit=20, lease=30)
    assert len(tasks) == len(again) == 20
    empty = WorkflowTaskResult(commands=[], through=1, time=a.clock())
    outcomes = await asyncio.gather(
        *(a.complete_workflow_task(t, empty) for t in tasks),
        *(b.complete_workflow_task(t, empty) for t in again),
        return_exceptions=True,
    )
    lost = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(lost) == 20 and all(isinstance(o, tether.LeaseLostError) for o in lost)
    for i in range(20):
        assert len(await a.read_history(f"r{i}")) == 2  # exactly one marker each


# -- retries and errors ------------------------------------------------------------


def test_deadlocked_batch_is_rolled_back_and_retried(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    s = _store(open_stores, pg_schema, writers=1)
    _query(pg_schema, "CREATE TABLE dl (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)")
    _query(pg_schema, "INSERT INTO dl VALUES (1, 0), (2, 0)")
    other_has_1 = threading.Event()
    op_has_2 = threading.Event()
    attempts: list[int] = []
    failures: list[BaseException] = []

    def op(tx: Any) -> int:
        attempts.append(1)
        tx.execute("UPDATE dl SET n = n + 1 WHERE id = 2")
        if len(attempts) == 1:
            assert other_has_1.wait(5)
            op_has_2.set()
        # waits for the other transaction first, so PostgreSQL picks this one as the victim
        tx.execute("UPDATE dl SET n = n + 1 WHERE id = 1")
        return len(attempts)

    def other() -> None:
        try:
            with psycopg.connect(PG_URL) as conn:
                conn.execute(f'SET search_path TO "{pg_schema}"')
                conn.execute("UPDATE dl SET n = n + 10 WHERE id = 1")
                other_has_1.set()
                assert op_has_2.wait(5)
                time.sleep(0.3)
                conn.execute("UPDATE dl SET n = n + 10 WHERE id = 2")
                conn.commit()
        except BaseException as exc:
            failures.append(exc)

    t = threading.Thread(target=other)
    t.start()
    try:
        result = s.call_sync(op)
    finally:
        t.join()
    assert failures == []
    # the whole batch ran again after the deadlock (on a loaded machine the retry may
    # meet the other transaction's locks once more: more attempts, never a partial one)
    assert result >= 2 and s.stats()["retries"] >= 1
    # one attempt of each committed, whole: the rolled-back ones left nothing
    assert sorted(_query(pg_schema, "SELECT id, n FROM dl")) == [(1, 11), (2, 11)]


def test_failing_operation_fails_alone_and_the_rest_of_its_batch_commits(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    """The fast path (pipeline, no savepoints) falls back to one savepoint per operation."""
    s = _store(open_stores, pg_schema, writers=1)
    _query(pg_schema, "CREATE TABLE fb (id INTEGER PRIMARY KEY)")
    _query(pg_schema, "INSERT INTO fb VALUES (0)")
    holding = threading.Event()

    def hold(tx: Any) -> str:
        holding.set()
        time.sleep(0.3)  # the next operations queue up meanwhile: one batch
        return "held"

    def insert(tx: Any, i: int) -> int:
        tx.execute("INSERT INTO fb VALUES (?)", (i,))
        return i

    def insert_then_fail(tx: Any, i: int) -> int:
        tx.execute("INSERT INTO fb VALUES (?)", (i,))
        raise ValueError("refused")

    first = s._submit(hold)
    assert holding.wait(5)
    futs = [
        s._submit(insert, 1),
        s._submit(insert_then_fail, 2),
        s._submit(insert, 0),  # a duplicate key: the server refuses it
        s._submit(insert, 3),
    ]
    assert first.result(5) == "held"
    assert futs[0].result(5) == 1
    with pytest.raises(ValueError, match="refused"):
        futs[1].result(5)
    with pytest.raises(tether.StoreError, match="duplicate key"):
        futs[2].result(5)
    assert futs[3].result(5) == 3
    assert sorted(_query(pg_schema, "SELECT id FROM fb")) == [(0,), (1,), (3,)]
    assert s.stats()["fallbacks"] == 1


def test_rows_of_a_statement_taken_for_a_plain_write_are_still_read(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    """A statement the pipeline did not wait for is run again on the safe path."""
    s = _store(open_stores, pg_schema, writers=1)

    def op(tx: Any) -> int:
        row = tx.execute("/* not recognised as a read */ SELECT 41 + ?", (1,)).fetchone()
        return int(row[0])

    assert s.call_sync(op) == 42
    assert s.stats()["fallbacks"] == 1


def test_a_statement_whose_prepare_a_failed_pipeline_skipped_is_prepared_again(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    """After an error, a pipeline skips what follows it, PREPAREs included."""
    s = _store(open_stores, pg_schema, writers=1)
    _query(pg_schema, "CREATE TABLE pp (id INTEGER)")

    def op(tx: Any, fail: bool) -> bool:
        if fail and tx.optimistic:
            tx.guard("SELECT 1 / (SELECT count(*) FROM pp WHERE id < 0)::int")  # fails
        for i in range(3):  # the statement is prepared on its second use
            tx.execute("INSERT INTO pp VALUES (?)", (i,))
        return bool(tx.optimistic)

    assert s.call_sync(op, True) is False  # fell back: the safe path ran it
    assert s.call_sync(op, False) is True  # the fast path again: the statement is usable
    assert s.stats()["fallbacks"] == 1
    assert _query(pg_schema, "SELECT count(*) FROM pp") == [(6,)]


def test_unreachable_server_raises_clear_store_error() -> None:
    with pytest.raises(tether.StoreError) as info:
        PostgresStore("postgresql://postgres:s3cret@127.0.0.1:1/test", connect_timeout=2)
    msg = str(info.value)
    assert "127.0.0.1:1" in msg and "s3cret" not in msg
    assert "server is running" in msg


def test_open_store_accepts_postgres_urls_and_schema(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    from tether.store import open_store

    for url, kwargs in [
        (with_schema(PG_URL, pg_schema), {}),
        (PG_URL.replace("postgresql://", "postgres://", 1), {"schema": pg_schema}),
    ]:
        s = open_store(url, **kwargs)
        assert isinstance(s, PostgresStore) and s.schema == pg_schema
        open_stores.append(s)
    with pytest.raises(tether.ConfigurationError, match="PostgreSQL"):
        open_store(":memory:", schema="x")


def _tcp_settings(store: PostgresStore) -> tuple[dict[str, str], dict[str, str]]:
    """What one of the store's connections asked libpq for, and what the server set."""
    conn = store._connect()
    try:
        client = {
            k: v
            for k, v in conn.info.get_parameters().items()
            if k.startswith("keepalives") or k == "tcp_user_timeout"
        }
        rows = conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name LIKE 'tcp%'"
        ).fetchall()
        return client, dict(rows)
    finally:
        conn.close()


def test_connections_detect_a_silently_cut_network_on_both_ends(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    # a path cut without a reset: the client and the server each give up on the other
    # (and the server rolls back its transaction, releasing its row locks) in seconds
    client, server = _tcp_settings(_store(open_stores, pg_schema))
    assert client == {
        "keepalives": "1",
        "keepalives_idle": "10",
        "keepalives_interval": "5",
        "keepalives_count": "3",
        "tcp_user_timeout": "30000",
    }
    assert server == {
        "tcp_keepalives_idle": "10",
        "tcp_keepalives_interval": "5",
        "tcp_keepalives_count": "3",
        "tcp_user_timeout": "30000",
    }
    # the URL's own settings win, on both ends; what it does not set gets the defaults
    url = with_schema(f"{PG_URL}?keepalives_idle=60&tcp_user_timeout=45000", pg_schema)
    s = PostgresStore(url)
    open_stores.append(s)
    client, server = _tcp_settings(s)
    assert client["keepalives_idle"] == "60" and client["tcp_user_timeout"] == "45000"
    assert client["keepalives_count"] == "3"
    assert server["tcp_keepalives_idle"] == "60" and server["tcp_user_timeout"] == "45000"
    assert server["tcp_keepalives_count"] == "3"


async def test_recovers_after_server_drops_connections(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    """Killed backends fail at most the operations in flight; the store reconnects."""
    a = _store(open_stores, pg_schema, writers=2)
    b = _store(open_stores, pg_schema, writers=1)
    await a.create_run(run_id="r1", workflow="wf", queue="q", input="[]")
    woke = threading.Event()
    b.add_listener(lambda ready, finished: woke.set() if "q2" in ready else None)
    killed = _query(
        pg_schema,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
        f"tether:{pg_schema}",
    )
    assert len(killed) >= 3  # a's writer and both listeners at least
    errors = 0

    async def attempt(op: Any) -> None:
        # The backends are not waited for here: a writer may send a batch in the
        # moment before its backend's goodbye arrives, and lose it if the break
        # shows only at COMMIT (at most one per writer; once the goodbye is there the
        # connection is replaced before the batch: see the tests below).
        nonlocal errors
        try:
            await op
        except tether.StoreError as exc:
            assert "lost the connection" in str(exc) and "reconnects" in str(exc)
            errors += 1

    for _ in range(6):
        await attempt(a.get_run("r1"))
    assert errors <= 2
    deadline = time.monotonic() + 5
    while not woke.is_set() and time.monotonic() < deadline:  # b's listener reconnects
        await attempt(
            a.create_run(run_id=f"r2-{time.monotonic()}", workflow="wf", queue="q2", input="[]")
        )
        await asyncio.sleep(0.2)
    assert woke.is_set()
    assert errors <= 2
    for _ in range(4):  # by now both writers have reconnected
        assert (await a.get_run("r1")) is not None


def _terminate(pids: list[int]) -> None:
    """End these backends and wait until they are gone (their sockets closed)."""
    with psycopg.connect(PG_URL, autocommit=True) as admin:
        for pid in pids:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 10
        while admin.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
        ).fetchone():
            assert time.monotonic() < deadline, "the backends did not end"
            time.sleep(0.01)


def _writer_pids(store: PostgresStore) -> list[int]:
    with store._lock:
        return sorted(store._own_pids)


async def test_connections_the_server_ended_while_idle_fail_no_operation(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    """A restart, ``pg_terminate_backend`` or a cut proxy ends idle writer connections:
    the next operations run on new connections instead of failing one per writer."""
    s = _store(open_stores, pg_schema, writers=3)
    await s.create_run(run_id="r1", workflow="wf", queue="q", input="[]")
    for _ in range(3):  # every writer opens its connection
        await asyncio.gather(*(s.get_run("r1") for _ in range(12)))
    before = _writer_pids(s)
    _terminate(before)
    for i in range(9):  # reads and writes, one at a time and together
        assert await s.get_run("r1") is not None
        await s.create_run(run_id=f"r2-{i}", workflow="wf", queue="q", input="[]")
        await asyncio.gather(*(s.get_run("r1") for _ in range(6)))
    assert not set(before) & set(_writer_pids(s))


async def test_connections_a_proxy_cut_while_idle_fail_no_operation(pg_schema: str) -> None:
    """The same when the connections end without a word from the server (a proxy or a
    load balancer drops them): the closed socket is found before the next batch."""
    from conftest import PgProxy

    proxy = PgProxy("127.0.0.1", 5432)
    s = PostgresStore(with_schema(proxy.url(PG_URL), pg_schema), writers=2)
    try:
        await s.create_run(run_id="r1", workflow="wf", queue="q", input="[]")
        for _ in range(3):  # every writer opens its connection
            await asyncio.gather(*(s.get_run("r1") for _ in range(12)))
        for round in range(2):
            proxy.cut()
            time.sleep(0.05)  # the sockets' ends arrive
            for i in range(6):
                assert await s.get_run("r1") is not None
                await s.create_run(run_id=f"r2-{round}-{i}", workflow="wf", queue="q", input="[]")
                await asyncio.gather(*(s.get_run("r1") for _ in range(4)))
    finally:
        await s.close()
        proxy.shut()


async def test_a_connection_lost_before_commit_runs_the_batch_again(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    """The connection breaks in the middle of a batch, before its COMMIT was sent: the
    transaction cannot have committed, so the batch runs again on a new connection."""
    s = _store(open_stores, pg_schema, writers=1)
    pids: list[int] = []

    def dies_once(tx: Any) -> int:
        pid = tx.conn.conn.info.backend_pid
        pids.append(pid)
        if len(pids) == 1:
            _terminate([pid])
        tx.execute("SELECT 1").fetchone()
        tx.execute("UPDATE runs SET attrs = attrs WHERE run_id = 'none'")
        return pid

    assert await s._do(dies_once) == pids[1] != pids[0]  # a write (the fast path)
    pids.clear()
    assert await s._do(dies_once, write=False) == pids[1] != pids[0]  # a read
    assert s.stats()["reconnects"] == 2


async def test_a_connection_lost_once_commit_was_sent_is_not_run_again(
    pg_schema: str, open_stores: list[PostgresStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once COMMIT may have reached the server, the outcome is unknown: the batch
    fails ("may or may not have been committed") and is not run a second time."""
    from tether.store import _pg_session

    s = _store(open_stores, pg_schema, writers=1)
    calls: list[int] = []
    send = _pg_session._Session.send

    def cut_at_commit(session: Any, query: str) -> None:
        if query == "COMMIT" and calls:
            _terminate([session.conn.info.backend_pid])
        send(session, query)

    def op(tx: Any) -> None:
        calls.append(1)
        tx.execute("SELECT 1").fetchone()
        tx.execute("UPDATE runs SET attrs = attrs WHERE run_id = 'none'")

    monkeypatch.setattr(_pg_session._Session, "send", cut_at_commit)
    with pytest.raises(tether.StoreError, match="may or may not have been committed"):
        await s._do(op)
    assert calls == [1]
    monkeypatch.setattr(_pg_session._Session, "send", send)
    calls.clear()
    await s._do(op)  # the next batch has a new connection
    assert calls == [1]


async def test_a_statement_timeout_in_the_url_bounds_a_stuck_statement(
    pg_schema: str, open_stores: list[PostgresStore]
) -> None:
    """The deploy guide's bound on a server that keeps the connection but does not
    answer: ``options=-c statement_timeout=...`` fails the operation with a clear
    StoreError, nothing committed, and the connection serves the next one."""
    url = with_schema(f"{PG_URL}?options=-c%20statement_timeout%3D200", pg_schema)
    s = PostgresStore(url, writers=1)
    open_stores.append(s)

    def stuck(tx: Any) -> None:
        tx.execute("UPDATE runs SET attrs = attrs WHERE run_id = 'none'")
        tx.execute("SELECT pg_sleep(5)").fetchone()

    began = time.monotonic()
    with pytest.raises(tether.StoreError, match="statement timeout"):
        await s._do(stuck)
    assert time.monotonic() - began < 3
    await s.create_run(run_id="r1", workflow="wf", queue="q", input="[]")
    assert s.stats()["reconnects"] == 0


# -- the optimistic fast path: guesses instead of reads ------------------------------


class _Waits:
    """Counts, per batch, the answers a writer waited for before its COMMIT."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from tether.store import postgres

        self.batches: list[tuple[tuple[str, ...], int]] = []
        mine = threading.local()  # each writer thread counts its own batch
        drain, commit = postgres._Session._drain, postgres.PostgresStore._commit
        waits = self

        def counting_drain(session: Any, *, sync: bool) -> Any:
            if not sync:
                mine.n = getattr(mine, "n", 0) + 1
            return drain(session, sync=sync)

        def counting_commit(store: Any, session: Any, batch: list[Any], solo: bool) -> Any:
            mine.n = 0
            out = commit(store, session, batch, solo)
            waits.batches.append((tuple(item[0].__name__ for item in batch), mine.n))
            return out

        monkeypatch.setattr(postgres._Session, "_drain", counting_drain)
        monkeypatch.setattr(postgres.PostgresStore, "_commit", counting_commit)


def _one_step_app(url: str, concurrency: list[int] | None = None) -> tether.App:
    app = tether.App(store=url)
    running = [0]

    @app.activity
    async def double(x: int) -> int:
        running[0] += 1
        if concurrency is not None:
            concurrency.append(running[0])
        await asyncio.sleep(0.01)
        running[0] -= 1
        return 2 * x

    @app.workflow
    async def one_step(x: int) -> int:
        return await double(x)

    return app


async def test_an_eager_start_waits_for_nothing_and_a_step_for_one_answer(
    pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _one_step_app(with_schema(PG_URL, pg_schema))
    try:
        async with app.worker(lease=10.0, poll_interval=60):  # no polling claims meanwhile
            await (await app.start("one_step", 0, run_id="warm-up")).result(timeout=10)
            waits = _Waits(monkeypatch)
            fallbacks = app.store.stats()["fallbacks"]  # type: ignore[attr-defined]
            for i in range(5):
                assert await (await app.start("one_step", i, run_id=f"r{i}")).result(10) == 2 * i
            assert app.store.stats()["fallbacks"] == fallbacks  # type: ignore[attr-defined]
            batches = list(waits.batches)
    finally:
        await app.close()
    by_op: dict[tuple[str, ...], set[int]] = {}
    for ops, n in batches:
        by_op.setdefault(ops, set()).add(n)
    # the run, its first task's commands and its leased activity: guesses and no reads
    assert by_op.pop(("_create_run",)) == {0}
    # the activity's result and the run's end: only the run row is read
    assert by_op.pop(("_complete_activity_fast",)) == {1}
    assert not by_op, f"unexpected batches: {by_op}"
    assert [r[0] for r in _query(pg_schema, "SELECT status FROM runs")] == ["completed"] * 6


async def test_wrong_guesses_fall_back_and_give_the_exact_answers(pg_schema: str) -> None:
    app = _one_step_app(with_schema(PG_URL, pg_schema), concurrency := [])
    try:
        async with app.worker(lease=10.0, poll_interval=0.05):
            first = await app.start("one_step", 1, run_id="same")
            stats = app.store.stats  # type: ignore[attr-defined]
            before = stats()["fallbacks"]
            # the run exists: inserting it fails, and the safe path finds it unchanged
            again = await app.start("one_step", 1, run_id="same")
            assert again.run_id == "same" and stats()["fallbacks"] == before + 1
            with pytest.raises(tether.RunIdConflictError):
                await app.start("one_step", 2, run_id="same")
            assert await first.result(timeout=10) == 2
            # a queue with limits: the guess "no limits" fails once, then the store knows
            app.configure_queue("default", max_concurrency=1)
            before = stats()["fallbacks"]
            runs = [await app.start("one_step", i, run_id=f"capped-{i}") for i in range(4)]
            assert [await r.result(timeout=10) for r in runs] == [0, 2, 4, 6]
            assert stats()["fallbacks"] - before == 1  # one wrong guess, then it knows
            assert max(concurrency[-4:]) == 1  # the cap held: the work went through claims
    finally:
        await app.close()
    assert len(_query(pg_schema, "SELECT 1 FROM events WHERE run_id = 'same'")) == 6
    assert _query(pg_schema, "SELECT count(*) FROM tasks") == [(0,)]


async def test_a_step_that_ends_during_an_outage_is_recorded_not_run_again(
    pg_schema: str,
) -> None:
    """PostgreSQL is unreachable for 3 s when an activity returns (a restart): its
    result is offered until the server is back, within the worker's lease, so the step
    does not run a second time and the run does not wait out a lease."""
    from conftest import PgProxy

    proxy = PgProxy("127.0.0.1", 5432)
    app = tether.App(store=with_schema(proxy.url(PG_URL), pg_schema))
    ran: list[int] = []

    @app.activity
    async def charge(order: str) -> str:
        ran.append(1)
        if len(ran) == 1:  # the outage begins while it runs
            proxy.down()
            asyncio.get_running_loop().call_later(3.0, proxy.back)
        await asyncio.sleep(0.3)
        return "charged " + order

    @app.workflow
    async def pay(order: str) -> str:
        return await charge(order)

    try:
        async with app.worker(lease=15.0, poll_interval=0.05):
            run = await app.start(pay, "o-1", run_id="p1")
            assert await run.result(timeout=12) == "charged o-1"
        assert ran == [1]
    finally:
        await app.close()
        proxy.shut()


async def test_close_does_not_hang_on_a_writer_stuck_on_a_frozen_server(
    pg_schema: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer waiting on a server that does not answer keeps its thread busy: close
    waits for it a bounded time, then says so and returns (the thread is a daemon)."""
    import logging

    from tether.store import postgres

    monkeypatch.setattr(postgres, "CLOSE_WAIT", 0.5)
    s = PostgresStore(PG_URL, schema=pg_schema, writers=1)
    frozen = threading.Event()

    def stuck(tx: Any) -> None:
        frozen.wait(10)  # (as a statement on a frozen server would)

    pending = asyncio.ensure_future(s._do(stuck))
    await asyncio.sleep(0.2)
    caplog.set_level(logging.WARNING, logger="tether")
    began = time.monotonic()
    try:
        await s.close()
        assert time.monotonic() - began < 3.0
        assert "did not finish within 0.5 s" in caplog.text
    finally:
        frozen.set()
        await asyncio.wait([pending], timeout=5)
        if pending.done() and not pending.cancelled():
            pending.exception()


def test_a_refusal_waiting_will_not_mend_is_told_by_its_sqlstate(
    pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the server answers, and refuses what the URL names (psycopg's error has no
    # sqlstate for a failed connection: the store reads it from the server's answer)
    import socket
    from urllib.parse import urlsplit

    up = urlsplit(PG_URL)
    where = f"{up.hostname or '127.0.0.1'}:{up.port or 5432}"
    for url, sqlstate, says in [
        (f"postgresql://postgres@{where}/no_such_db_tether", "3D000", "does not exist"),
        (f"postgresql://no_such_role_tether:pw@{where}/test", "28000", "role"),
        (f"postgresql://postgres@{where}/test?options=-cstatement_timeout%3Dx", "22023", "invalid"),
    ]:
        with pytest.raises(tether.StoreError) as got:
            PostgresStore(url, schema=pg_schema, connect_timeout=5)
        assert got.value.permanent is not None, (url, got.value)
        assert f"SQLSTATE {sqlstate}" in got.value.permanent and says in got.value.permanent
        assert where not in got.value.permanent and where in str(got.value)
        assert ":pw@" not in str(got.value)
    for url in ("postgresql://postgres@127.0.0.1:notaport/test", f"postgresql://{where}/t?x=1"):
        with pytest.raises(tether.StoreError, match="invalid store URL") as got:
            PostgresStore(url, schema=pg_schema)
        assert got.value.permanent is not None and "invalid" in got.value.permanent
    # nothing listens: a transient failure, retried by whoever waits for the store
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(tether.StoreError, match="cannot connect") as got:
        PostgresStore(f"postgresql://postgres@127.0.0.1:{port}/test", schema=pg_schema)
    assert got.value.permanent is None
    # tried again (a server waiting for its store), the same failure is not asked again
    from tether.store import postgres

    asked: list[str] = []
    monkeypatch.setattr(postgres, "_refusal", lambda c, t: asked.append(c))
    for _ in range(3):
        with pytest.raises(tether.StoreError, match="cannot connect"):
            PostgresStore(f"postgresql://postgres@127.0.0.1:{port}/test", schema=pg_schema)
    assert asked == []


def test_a_key_value_connection_string_s_password_never_shows(pg_schema: str) -> None:
    """Passwords in URLs were masked in every message; one in a key=value connection
    string (``host=... password=...``) was shown as written."""
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens: the connection is refused
    for conninfo, secret in [
        (f"host=127.0.0.1 port={port} user=postgres password=s3cr3tpw dbname=test", "s3cr3tpw"),
        (f"host=127.0.0.1 port={port} password='an0ther pw' dbname=test", "an0ther"),
    ]:
        with pytest.raises(tether.StoreError) as got:
            PostgresStore(conninfo, schema=pg_schema, connect_timeout=2)
        said = f"{got.value} {got.value.permanent or ''}"
        assert secret not in said and "password=***" in said, said
