"""Signals and updates with an id (``signal_id=``, ``update_id=``, an HTTP
``Idempotency-Key``): a retry is recorded once, along a continue-as-new chain and
under concurrency, on both stores; over HTTP against ``tether serve``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import tether
from helpers import eventually
from test_http_api import Server
from tether import EventType, RunStatus


async def _signals(app: tether.App, run_id: str, follow: bool = False) -> list[tether.Event]:
    return [
        e for e in await app.history(run_id, follow=follow) if e.type is EventType.SIGNAL_RECEIVED
    ]


# -- the API, as a client meets it ------------------------------------------------------


@pytest.fixture
def server(store_url: str) -> Iterator[Server]:
    s = Server(store_url, "--workers", "1", "--no-auth")
    yield s
    s.stop()


def _result(server: Server, run_id: str) -> Any:
    done = server.http.get(f"/v1/runs/{run_id}/result?wait=20")
    assert done.status_code == 200, done.text
    return done.json()["result"]


def test_a_retried_signal_with_the_same_idempotency_key_is_delivered_once(
    server: Server,
) -> None:
    r = server.http.post("/v1/workflows/cart/runs", json={"input": {}, "run_id": "cart-1"})
    assert r.status_code == 202, r.text
    headers = {"Idempotency-Key": "add-A-once"}
    first = server.http.post("/v1/runs/cart-1/signals/add", json={"sku": "A"}, headers=headers)
    again = server.http.post("/v1/runs/cart-1/signals/add", json={"sku": "A"}, headers=headers)
    assert first.status_code == 202 and first.json()["duplicate"] is False
    assert again.status_code == 200 and again.json()["duplicate"] is True
    other = server.http.post(
        "/v1/runs/cart-1/signals/add", json={"sku": "B"}, headers={"Idempotency-Key": "add-B"}
    )
    assert other.status_code == 202
    assert server.http.post("/v1/runs/cart-1/signals/add", json=None).status_code == 202
    assert _result(server, "cart-1") == [{"sku": "A"}, {"sku": "B"}]
    # the run has ended: a retry of a signal it got is still answered as a duplicate,
    # one it never got is refused as before
    late = server.http.post("/v1/runs/cart-1/signals/add", json={"sku": "A"}, headers=headers)
    assert late.status_code == 200 and late.json()["duplicate"] is True
    new = server.http.post(
        "/v1/runs/cart-1/signals/add", json={"sku": "C"}, headers={"Idempotency-Key": "add-C"}
    )
    assert new.status_code == 409
    history = server.http.get("/v1/runs/cart-1/history").json()["events"]
    ids = [e["data"].get("signal_id") for e in history if e["type"] == "SignalReceived"]
    assert ids == ["add-A-once", "add-B", None]


def test_concurrent_signals_with_one_idempotency_key_are_delivered_once(server: Server) -> None:
    assert (
        server.http.post(
            "/v1/workflows/cart/runs", json={"input": {}, "run_id": "cart-2"}
        ).status_code
        == 202
    )
    codes: list[int] = []

    def send() -> None:
        with httpx_client(server) as http:
            r = http.post(
                "/v1/runs/cart-2/signals/add", json="once", headers={"Idempotency-Key": "k"}
            )
            codes.append(r.status_code)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200] * 7 + [202]
    server.http.post("/v1/runs/cart-2/signals/add", json=None)
    assert _result(server, "cart-2") == ["once"]


def httpx_client(server: Server) -> Any:
    import httpx

    return httpx.Client(base_url=str(server.http.base_url), timeout=30)


def test_a_retried_signal_with_start_signals_once(server: Server) -> None:
    """The probe: the same Idempotency-Key and body return the run it started (200) with
    nothing changed; before, the run got the signal again on each retry."""
    body = {"input": {}, "if_running": "signal", "signal": {"name": "add", "payload": "A"}}
    headers = {"Idempotency-Key": "order-77"}
    first = server.http.post("/v1/workflows/cart/runs", json=body, headers=headers)
    again = server.http.post("/v1/workflows/cart/runs", json=body, headers=headers)
    assert (first.status_code, again.status_code) == (202, 200), again.text
    run_id = first.json()["id"]
    assert again.json()["id"] == run_id
    # another key signals the same run again: a request of its own
    more = server.http.post(
        "/v1/workflows/cart/runs",
        json={**body, "run_id": run_id, "signal": {"name": "add", "payload": "B"}},
        headers={"Idempotency-Key": "order-78"},
    )
    assert more.status_code == 200, more.text
    server.http.post(f"/v1/runs/{run_id}/signals/add", json=None)
    assert _result(server, run_id) == ["A", "B"]


def test_a_retried_update_with_the_same_idempotency_key_applies_once(server: Server) -> None:
    r = server.http.post("/v1/workflows/counter/runs", json={"input": {"start": 0}})
    run_id = r.json()["id"]
    headers = {"Idempotency-Key": "add-5"}
    url = f"/v1/runs/{run_id}/updates/add"
    first = server.http.post(url, json={"args": [5]}, headers=headers)
    assert first.status_code == 200, first.text
    assert first.json()["result"] == 5
    again = server.http.post(url, json={"args": [5]}, headers=headers)
    assert again.status_code == 200 and again.json()["result"] == 5  # the first's outcome
    assert server.http.post(url, json={"args": [1]}).json()["result"] == 6
    total = server.http.post(f"/v1/runs/{run_id}/queries/total", json={"args": []})
    assert total.json()["result"] == 6
    # an update refused by its validator records nothing: its id stays free
    refused = server.http.post(url, json={"args": [-1]}, headers={"Idempotency-Key": "bad"})
    assert refused.status_code in (400, 409, 422), refused.text
    ok = server.http.post(url, json={"args": [2]}, headers={"Idempotency-Key": "bad"})
    assert ok.json()["result"] == 8


def test_an_idempotency_key_used_by_a_signal_is_refused_for_an_update_and_back(
    server: Server,
) -> None:
    # signal ids and update ids share one namespace per run: reusing one across the two
    # used to wait for an update outcome that never came (202)
    run_id = server.http.post("/v1/workflows/counter/runs", json={"input": {"start": 0}}).json()[
        "id"
    ]
    signal = server.http.post(
        f"/v1/runs/{run_id}/signals/poke", json=None, headers={"Idempotency-Key": "k-1"}
    )
    assert signal.status_code in (200, 202), signal.text
    url = f"/v1/runs/{run_id}/updates/add"
    clash = server.http.post(url, json={"args": [5]}, headers={"Idempotency-Key": "k-1"})
    assert clash.status_code == 409, clash.text
    assert "k-1" in clash.json()["detail"] and "signal" in clash.json()["detail"]
    added = server.http.post(url, json={"args": [5]}, headers={"Idempotency-Key": "k-2"})
    assert added.status_code == 200, added.text
    back = server.http.post(
        f"/v1/runs/{run_id}/signals/poke", json=None, headers={"Idempotency-Key": "k-2"}
    )
    assert back.status_code == 409, back.text
    assert "k-2" in back.json()["detail"] and "update" in back.json()["detail"]


def test_a_retried_entity_operation_with_the_same_idempotency_key_applies_once(
    server: Server,
) -> None:
    url = "/v1/entities/Tally/t1/operations/add"
    headers = {"Idempotency-Key": "op-1"}
    assert server.http.post(url, json={"args": [3]}, headers=headers).json()["result"] == 3
    assert server.http.post(url, json={"args": [3]}, headers=headers).json()["result"] == 3
    assert server.http.post(url, json={"args": [4]}).json()["result"] == 7
    assert server.http.get("/v1/entities/Tally/t1").json() == {"n": 7}


def test_an_idempotency_key_reused_with_another_body_is_a_conflict(server: Server) -> None:
    """A key is one request: reused with another body it is refused (409, nothing
    recorded), as a start's key reused with other input is; the same body, its keys in
    another order, is still a repeat (200)."""
    assert (
        server.http.post(
            "/v1/workflows/cart/runs", json={"input": {}, "run_id": "cart-3"}
        ).status_code
        == 202
    )
    url = "/v1/runs/cart-3/signals/add"
    headers = {"Idempotency-Key": "add-once"}
    first = server.http.post(url, json={"sku": "A", "n": 1}, headers=headers)
    assert first.status_code == 202, first.text
    same = server.http.post(url, json={"n": 1.0, "sku": "A"}, headers=headers)
    assert same.status_code == 200 and same.json()["duplicate"] is True, same.text
    other = server.http.post(url, json={"sku": "B", "n": 1}, headers=headers)
    assert other.status_code == 409, other.text
    assert "add-once" in other.json()["detail"] and "payload" in other.json()["detail"]
    renamed = server.http.post("/v1/runs/cart-3/signals/remove", json={"sku": "A"}, headers=headers)
    assert renamed.status_code == 409, renamed.text
    assert "signal 'remove'" in renamed.json()["detail"]
    server.http.post("/v1/runs/cart-3/signals/add", json=None)
    assert _result(server, "cart-3") == [{"sku": "A", "n": 1}]
    # updates and entity operations alike
    run_id = server.http.post("/v1/workflows/counter/runs", json={"input": {"start": 0}}).json()[
        "id"
    ]
    update = f"/v1/runs/{run_id}/updates/add"
    assert server.http.post(update, json={"args": [5]}, headers=headers).json()["result"] == 5
    clash = server.http.post(update, json={"args": [6]}, headers=headers)
    assert clash.status_code == 409, clash.text
    assert "argument" in clash.json()["detail"]
    total = server.http.post(f"/v1/runs/{run_id}/queries/total", json={"args": []})
    assert total.json()["result"] == 5
    op = "/v1/entities/Tally/t2/operations/add"
    assert server.http.post(op, json={"args": [3]}, headers=headers).json()["result"] == 3
    assert server.http.post(op, json={"args": [4]}, headers=headers).status_code == 409
    assert server.http.get("/v1/entities/Tally/t2").json() == {"n": 3}


# -- the store: chains, ended runs, concurrency --------------------------------------------


async def test_an_id_is_one_signal_along_a_continue_as_new_chain(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def links(n: int) -> list[Any]:
        got = await tether.wait_event("add")
        if n == 0:
            tether.continue_as_new(1)
        return [got, await tether.wait_event("add")]

    run = await app.start(links, 0, run_id="ch")
    assert await app.signal("ch", "add", "a", signal_id="s1") is True
    await eventually(lambda: _live(app, "ch~1"), what="the next run")
    # the id went to the first run: a retry to the chain's first id or its live run's id
    # is recognised there, and the live run gets nothing
    assert await app.signal("ch", "add", "a", signal_id="s1") is False
    assert await app.signal("ch~1", "add", "a", signal_id="s1") is False
    assert await app.signal("ch", "add", "b", signal_id="s2") is True
    assert await app.signal("ch", "add", "c", signal_id="s3") is True
    assert await run.result(timeout=10) == ["b", "c"]
    assert [e.data.get("signal_id") for e in await _signals(app, "ch~1")] == ["s2", "s3"]
    # ended: a known id is a duplicate, an unknown one is refused as before
    assert await app.signal("ch", "add", "b", signal_id="s2") is False
    with pytest.raises(tether.RunFinishedError):
        await app.signal("ch", "add", "d", signal_id="s4")


async def _live(app: tether.App, run_id: str) -> bool:
    try:
        return (await app.get(run_id, follow=False)).status is RunStatus.RUNNING
    except tether.RunNotFoundError:
        return False


async def test_update_ids_apply_an_update_once_and_answer_retries_with_its_outcome(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def account() -> int:
        balance = {"n": 0}

        def _positive(k: int) -> None:
            if balance["n"] + k < 0:
                raise ValueError("overdrawn")

        @tether.on_update("add", validate=_positive)
        def add(k: int) -> int:
            balance["n"] += k
            return balance["n"]

        await tether.wait_event("stop")
        return balance["n"]

    run = await app.start(account, run_id="acct")
    assert await app.update("acct", "add", 10, update_id="u1") == 10
    assert await app.update("acct", "add", -10, update_id="u2") == 0
    # the retry of u2 would now be refused by the validator (0 - 10 < 0): it is not
    # validated again, and answers with the first one's outcome
    assert await app.update("acct", "add", -10, update_id="u2") == 0
    # two at once, one id: applied once, both told its outcome
    both = await asyncio.gather(
        app.update("acct", "add", 5, update_id="u3"),
        app.update("acct", "add", 5, update_id="u3"),
    )
    assert both == [5, 5]
    await app.signal("acct", "stop")
    assert await run.result(timeout=10) == 5
    assert len(await _signals(app, "acct")) == 4  # three updates and the stop


async def test_a_retried_update_joining_as_the_run_ends_gets_its_outcome(
    app: tether.App, worker: tether.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One reader of the run's history serves every caller: a retry that joins while that
    reader reads the stretch where the run ends is still answered from its earlier marker,
    not refused as if the run had ended before it handled the update."""

    @app.workflow
    async def cart() -> int:
        n = {"v": 0}

        @tether.on_update("add")
        def add(k: int) -> int:
            n["v"] += k
            return n["v"]

        await tether.wait_event("end")
        return n["v"]

    run = await app.start(cart, run_id="cart")
    assert await app.update("cart", "add", 5, update_id="u1") == 5
    # another caller keeps the run's reader alive (an outcome that never comes)
    other = asyncio.create_task(app._updates.wait("cart", "never", "add", 30, 0))
    loop = asyncio.get_running_loop()

    async def reader() -> Any:
        found = app._updates._followers.get((loop, "cart"))
        return found if found is not None and found._after is not None else None

    follower = await eventually(reader)  # it read the history, past u1's marker
    inside, release = asyncio.Event(), asyncio.Event()
    read_history = app.store.read_history

    async def held(run_id: str, after: int, *args: Any, **kwargs: Any) -> Any:
        events = await read_history(run_id, after, *args, **kwargs)
        task = asyncio.current_task()
        if (
            task is not None
            and task.get_name().startswith("tether-updates-")
            and any(e.type is EventType.WORKFLOW_COMPLETED for e in events)
        ):
            inside.set()
            await release.wait()  # the reader is inside the read that reaches the end
        return events

    monkeypatch.setattr(app.store, "read_history", held)
    await app.signal("cart", "end")
    assert await run.result(timeout=10) == 5
    await asyncio.wait_for(inside.wait(), 10)
    retry = asyncio.create_task(app.update("cart", "add", 5, update_id="u1"))

    async def joined() -> bool:
        return follower._rewind is not None

    await eventually(joined)  # the retry joined the reader, from before its end
    release.set()
    assert await asyncio.wait_for(retry, 10) == 5  # u1's outcome, not "the run ended"
    with pytest.raises(tether.UpdateRejectedError, match="run ended"):
        await other


async def test_a_signal_id_is_not_an_update_id_nor_the_other_way(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def box() -> int:
        total = {"n": 0}

        @tether.on_update("add")
        def add(k: int) -> int:
            total["n"] += k
            return total["n"]

        await tether.wait_event("stop")
        return total["n"]

    await app.start(box, run_id="box")
    assert await app.signal("box", "poke", 1, signal_id="x1") is True
    await eventually(lambda: _waiting(app, "box"), what="the run to wait")
    with pytest.raises(tether.SignalIdConflictError, match=r"x1.*signal 'poke'") as err:
        await app.update("box", "add", 1, update_id="x1", timeout=5)
    assert isinstance(err.value, tether.ConfigurationError)
    assert await app.update("box", "add", 2, update_id="x2") == 2
    with pytest.raises(tether.SignalIdConflictError, match=r"x2.*update 'add'"):
        await app.signal("box", "poke", 1, signal_id="x2")
    assert await app.signal("box", "poke", 1, signal_id="x1") is False  # a retry, as before
    assert await app.update("box", "add", 2, update_id="x2", timeout=5) == 2


async def _waiting(app: tether.App, run_id: str) -> bool:
    return bool((await app.get(run_id)).waiting_on)


async def test_concurrent_sends_of_one_id_from_two_processes_record_it_once(
    store_url: str,
) -> None:
    """Two Apps (two connections: two processes, on PostgreSQL really concurrent) send
    one id many times at once: exactly one is recorded, and each repeat is told apart
    from another request by the payload of the one recorded."""
    a, b = tether.App(store=store_url), tether.App(store=store_url)
    for x in (a, b):

        @x.workflow(name="waits")
        async def waits() -> Any:
            return await tether.wait_event("go")

    try:
        await a.start("waits", run_id="w")
        sends = [x.signal("w", "go", "x", signal_id="once") for _ in range(10) for x in (a, b)]
        got = await asyncio.gather(*sends)
        assert sorted(got) == [False] * 19 + [True]
        assert len(await _signals(a, "w")) == 1
        # signal-with-start, concurrently, one id: one signal
        starts = [
            x.start("waits", run_id="w2", if_running="signal", signal=("go", 1), signal_id="sws")
            for _ in range(5)
            for x in (a, b)
        ]
        await asyncio.gather(*starts)
        assert len(await _signals(a, "w2")) == 1
    finally:
        for x in (a, b):
            await x.close()


async def test_a_signal_id_must_be_printable_and_short(app: tether.App) -> None:
    @app.workflow
    async def idle() -> None:
        await tether.wait_event("go")

    await app.start(idle, run_id="i")
    for bad in ("", "x" * 256, "a\nb"):
        with pytest.raises(tether.ConfigurationError):
            await app.signal("i", "go", signal_id=bad)
    with pytest.raises(tether.ConfigurationError):
        await app.start(idle, run_id="i", signal_id="s")  # no signal to give it to
    assert await _signals(app, "i") == []


async def test_signal_ids_are_copied_by_migrate_and_removed_with_their_runs(
    store_url: str, tmp_path: Any
) -> None:
    from tether.store.migrate import migrate

    app = tether.App(store=store_url)

    @app.workflow
    async def takes() -> Any:
        return await tether.wait_event("go")

    try:
        async with app.worker(poll_interval=0.05):
            run = await app.start(takes, run_id="t")
            assert await app.signal("t", "go", 1, signal_id="g") is True
            assert await run.result(timeout=10) == 1
        copy = f"sqlite:///{tmp_path / 'copy.db'}"
        report = await migrate(store_url, copy)
        assert not report.problems
        other = tether.App(store=copy)
        try:  # the copy knows the id: a retry against it records nothing
            assert await other.signal("t", "go", 1, signal_id="g") is False
        finally:
            await other.close()
        counts = await app.purge(0)
        assert counts["runs"] == 1 and counts["signal_ids"] == 1
        assert await app.store.signal_arrived("t", "g") is None
    finally:
        await app.close()


async def test_a_signal_id_reused_with_another_name_or_payload_is_a_conflict(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def pad() -> int:
        total = {"n": 0}

        @tether.on_update("add")
        def add(k: int) -> int:
            total["n"] += k
            return total["n"]

        await tether.wait_event("stop")
        return total["n"]

    run = await app.start(pad, run_id="pad")
    assert await app.signal("pad", "poke", {"a": 1, "b": [1, 2]}, signal_id="p1") is True
    # the same payload as a value (keys in another order, 1.0 for 1): a repeat
    assert await app.signal("pad", "poke", {"b": [1.0, 2], "a": 1}, signal_id="p1") is False
    with pytest.raises(tether.SignalIdConflictError, match=r"p1.*another payload") as err:
        await app.signal("pad", "poke", {"a": 2}, signal_id="p1")
    assert isinstance(err.value, tether.ConfigurationError)
    with pytest.raises(tether.SignalIdConflictError, match=r"p1.*signal 'poke'.*signal 'prod'"):
        await app.signal("pad", "prod", {"a": 1, "b": [1, 2]}, signal_id="p1")
    assert await app.signal("pad", "poke", True, signal_id="p2") is True
    with pytest.raises(tether.SignalIdConflictError, match=r"p2.*another payload"):
        await app.signal("pad", "poke", 1, signal_id="p2")  # 1 is not true
    await eventually(lambda: _waiting(app, "pad"), what="the run to wait")
    assert await app.update("pad", "add", 2, update_id="u1") == 2
    assert await app.update("pad", "add", 2.0, update_id="u1") == 2  # a retry
    with pytest.raises(tether.SignalIdConflictError, match=r"u1.*other arguments"):
        await app.update("pad", "add", 3, update_id="u1")
    await app.signal("pad", "stop")
    assert await run.result(timeout=10) == 2
    # the run has ended: a retry is still told apart from another request
    assert await app.signal("pad", "poke", {"a": 1, "b": [1, 2]}, signal_id="p1") is False
    with pytest.raises(tether.SignalIdConflictError):
        await app.signal("pad", "poke", {"a": 3}, signal_id="p1")
    # nothing of the refused ones was recorded
    assert len(await _signals(app, "pad")) == 4  # p1, p2, u1 and the stop


async def test_a_signal_with_start_retried_with_another_signal_is_a_conflict(
    app: tether.App,
) -> None:
    @app.workflow
    async def takes() -> Any:
        return await tether.wait_event("go")

    await app.start(takes, run_id="sw", if_running="signal", signal=("go", 1), signal_id="k")
    again = await app.start(
        takes, run_id="sw", if_running="signal", signal=("go", 1.0), signal_id="k"
    )
    assert again.created is False
    with pytest.raises(tether.SignalIdConflictError, match="another payload"):
        await app.start(takes, run_id="sw", if_running="signal", signal=("go", 2), signal_id="k")
    assert len(await _signals(app, "sw")) == 1


async def test_a_signal_carried_over_at_continue_as_new_keeps_its_id(
    app: tether.App, worker: tether.Worker
) -> None:
    """A signal the run never took goes on to the next run with its id in the event (the
    id still names one signal of the chain: a retry records nothing)."""

    @app.workflow
    async def hop(n: int) -> Any:
        if n == 0:
            await tether.wait_event("next")
            tether.continue_as_new(1)
        return [await tether.wait_event("keep"), await tether.wait_event("keep")]

    run = await app.start(hop, 0, run_id="hop")
    assert await app.signal("hop", "keep", "a", signal_id="k1") is True
    assert await app.signal("hop", "keep", "b") is True
    assert await app.signal("hop", "next", None, signal_id="n1") is True
    assert await run.result(timeout=10) == ["a", "b"]
    carried = await _signals(app, "hop~1")
    assert [(e.data.get("carried_from"), e.data.get("signal_id")) for e in carried] == [
        ("hop", "k1"),
        ("hop", None),
    ]
    assert await app.signal("hop", "keep", "a", signal_id="k1") is False
