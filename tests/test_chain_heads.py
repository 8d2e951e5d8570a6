"""A continue-as-new chain answers to any of its ids at a cost that does not grow with
its length: operations read the chain's head from ``chains`` instead of walking (and,
on PostgreSQL, locking) every link. Counted in statements, not timed."""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import tether
from conftest import PG_URL, with_schema
from helpers import eventually
from tether import RunStatus
from tether.store.ops._tx import _Tx

HOPS = 300


@contextmanager
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every statement store operations send while the block runs."""
    sent: list[str] = []
    original = _Tx.execute

    def execute(self: _Tx, sql: str, params: Any = ()) -> Any:
        sent.append(sql)
        return original(self, sql, params)

    with monkeypatch.context() as m:
        m.setattr(_Tx, "execute", execute)
        yield sent


async def statements(monkeypatch: pytest.MonkeyPatch, op: Callable[[], Awaitable[Any]]) -> int:
    with counted(monkeypatch) as sent:
        await op()
    return len(sent)


def _loop(app: tether.App, hops: int) -> tether.Workflow[[int], Any]:
    @app.workflow
    async def loop(n: int) -> Any:
        if n < hops:
            tether.continue_as_new(n + 1)
        return await tether.wait_event("stop")

    return loop


async def _chain(app: tether.App, hops: int) -> None:
    """``c`` continued ``hops`` times (its live run ``c~hops``) and a plain run ``p``,
    both waiting; no worker left running (its polls would be counted too)."""
    loop = _loop(app, hops)
    async with app.worker(concurrency=4, poll_interval=0.01):
        await app.start(loop, 0, run_id="c")
        await app.start(loop, hops, run_id="p")

        async def at_head() -> bool:
            info = await app.get("c")
            return info.run_id == f"c~{hops}" and info.status is RunStatus.RUNNING

        await eventually(at_head, timeout=240, what="the chain's last run")


async def test_operations_on_a_long_chains_ids_send_as_few_statements_as_on_a_run(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _chain(app, HOPS)
    plain_get = await statements(monkeypatch, lambda: app.get("p"))
    plain_signal = await statements(monkeypatch, lambda: app.signal("p", "noise", 1))
    for rid in ("c", "c~1", f"c~{HOPS // 2}"):
        got = await statements(monkeypatch, lambda rid=rid: app.get(rid))
        assert got <= plain_get + 3, (rid, got, plain_get)
        sent = await statements(monkeypatch, lambda rid=rid: app.signal(rid, "noise", 1))
        assert sent <= plain_signal + 3, (rid, sent, plain_signal)
        assert (await app.get(rid)).run_id == f"c~{HOPS}"
    noise = [e for e in await app.history(f"c~{HOPS}") if e.data.get("name") == "noise"]
    assert len(noise) == 3  # every signal reached the live run
    assert (await app.get(f"c~{HOPS}")).run_id == f"c~{HOPS}"
    with pytest.raises(tether.RunNotFoundError):
        await app.get(f"c~{HOPS + 1}")
    async with app.worker(poll_interval=0.01):
        await app.signal("c", "stop", "done")
        assert await app.get_run("c").result(timeout=30) == "done"
    sent = await statements(monkeypatch, lambda: app.get_run("c").result(timeout=5))
    assert sent <= 10, sent  # not a read per link
    with pytest.raises(tether.RunFinishedError):  # the chain's end is seen from its first id
        await app.signal("c", "late", 1)


async def test_a_chain_still_answers_when_its_head_row_is_missing(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose ``chains`` lacks a chain (or names a head that is gone) follows the
    links one by one, as before the table existed."""
    await _chain(app, 3)
    store: Any = app.store
    await store._do(lambda tx: tx.execute("DELETE FROM chains"))
    assert (await app.get("c")).run_id == "c~3"
    await store._do(lambda tx: tx.execute("INSERT INTO chains VALUES ('c', 'c~9')"))
    assert (await app.get("c~1")).run_id == "c~3"
    assert (await app.store.signal("c", "noise", "1"))[0] == "c~3"
    # a head that is not the latest (as one that continued after it was read): the
    # run found continued once locked sends the lookup on
    await store._do(lambda tx: tx.execute("UPDATE chains SET head_run_id = 'c~1'"))
    assert (await app.store.signal("c", "noise", "2"))[0] == "c~3"
    assert (await app.get("c")).run_id == "c~3"


async def _head_rows(app: tether.App) -> list[tuple[str, str]]:
    store: Any = app.store
    rows = await store._do(
        lambda tx: tx.execute("SELECT chain_id, head_run_id FROM chains ORDER BY 1").fetchall(),
        write=False,
    )
    return [tuple(r) for r in rows]


async def test_a_version_13_sqlite_store_gets_its_chains_heads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "old.db"
    app = tether.App(store=f"sqlite:///{db}")
    await _chain(app, 40)
    await app.close()
    conn = sqlite3.connect(db)
    conn.execute("DROP TABLE chains")  # as version 13 made it
    conn.execute("PRAGMA user_version = 13")
    conn.commit()
    conn.close()
    app = tether.App(store=f"sqlite:///{db}")
    _loop(app, 40)
    assert (await app.get("c")).run_id == "c~40"
    assert await _head_rows(app) == [("c", "c~40")]
    got = await statements(monkeypatch, lambda: app.get("c"))
    assert got <= 4
    await app.close()


async def test_a_version_13_postgres_store_gets_its_chains_heads(
    pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    url = with_schema(PG_URL, pg_schema)
    app = tether.App(store=url)
    await _chain(app, 40)
    await app.close()
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{pg_schema}"')
        conn.execute("DROP TABLE chains")
        conn.execute("DELETE FROM tether_meta")
        conn.execute("INSERT INTO tether_meta (version, applied_at) VALUES (13, 0)")
    app = tether.App(store=url)
    _loop(app, 40)
    assert (await app.get("c")).run_id == "c~40"
    assert await _head_rows(app) == [("c", "c~40")]
    got = await statements(monkeypatch, lambda: app.get("c"))
    assert got <= 4
    await app.close()
