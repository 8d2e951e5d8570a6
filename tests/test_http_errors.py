"""Problem documents of a real ``tether serve`` that say what was wrong."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from test_http_api import Server


@pytest.fixture
def served(store_url: str) -> Iterator[Server]:
    s = Server(store_url, "--no-auth")
    yield s
    s.stop()


def test_a_start_of_a_workflow_the_service_does_not_have_names_it(served: Server) -> None:
    r = served.http.post("/v1/workflows/nope/runs", json={"input": {}})
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"
    detail = r.json()["detail"]
    assert "'nope'" in detail and "approve" in detail and "GET /v1/workflows" in detail, detail
    r = served.http.post("/v1/workflows/approve/runs", json={"input": {"doc": "d"}})
    assert r.status_code == 202, r.text  # the service's own workflows still start
    assert "/v1/workflows/{name}/runs" not in served.http.get("/openapi.json").json()["paths"]


def test_a_payload_the_service_cannot_open_is_a_503_naming_the_key_never_a_400(
    store_url: str, tmp_path: Path
) -> None:
    import tether
    from tether.encryption import FileKeyring

    ring = FileKeyring.create(tmp_path / "keys.json")
    key_id = ring.current(None)
    writer = tether.App(store=store_url, encryption=ring)
    _bill(writer)
    asyncio.run(writer.start("bill", {"number": "n1", "cents": 100}, run_id="r1"))
    writer.store.close_sync()  # type: ignore[attr-defined]
    key = json.loads((tmp_path / "keys.json").read_text())["keys"][key_id]["key"]
    other = FileKeyring.create(tmp_path / "other.json")
    for env in ({}, {"TETHER_KEYRING": str(tmp_path / "other.json")}):
        s = Server(store_url, "--no-auth", env=env)
        try:
            # the run itself is shown, with what cannot be read and why
            r = s.http.get("/v1/runs/r1")
            assert r.status_code == 200, (env, r.text)
            assert key_id in r.json()["unavailable"]["input"] and key not in r.text
            r = s.http.get("/v1/runs/r1/history")
            assert r.status_code == 503, (env, r.text)
            assert r.json()["title"] == "Payload unavailable"
            assert key_id in r.json()["detail"] and key not in r.text
            if not env:  # no keyring: a start is refused, nothing written in the clear
                r = s.http.post(
                    "/v1/workflows/bill/runs",
                    json={"input": {"invoice": {"number": "n2", "cents": 1}}},
                )
                assert r.status_code == 503, r.text
                assert "TETHER_KEYRING" in r.json()["detail"]
        finally:
            s.stop()
    assert other.current(None) != key_id


def test_a_missing_blob_is_a_503_naming_the_blob(store_url: str, tmp_path: Path) -> None:
    import tether

    blobs = tmp_path / "blobs"
    writer = tether.App(store=store_url, blobs=str(blobs), offload_above=1024)
    _bill(writer)
    number = "n" * 4000  # above offload_above: the input goes to a blob
    asyncio.run(writer.start("bill", {"number": number, "cents": 100}, run_id="r1"))
    writer.store.close_sync()  # type: ignore[attr-defined]
    for p in blobs.rglob("*"):
        if p.is_file():
            p.unlink()
    s = Server(store_url, "--no-auth", env={"TETHER_BLOBS": str(blobs)})
    try:
        r = s.http.get("/v1/runs/r1")
        assert r.status_code == 200 and "sha256:" in r.json()["unavailable"]["input"], r.text
        r = s.http.get("/v1/runs/r1/history")
        assert r.status_code == 503, r.text
        assert r.json()["title"] == "Payload unavailable"
        assert "sha256:" in r.json()["detail"]
    finally:
        s.stop()


def _bill(app: Any) -> None:
    @app.workflow
    async def bill(invoice: dict[str, Any], vat: float = 0.2) -> dict[str, Any]:
        return invoice


def test_a_result_poll_open_while_its_run_is_erased_answers_410(store_url: str) -> None:
    import threading

    import tether

    s = Server(store_url, "--no-auth")
    try:
        body = {"input": {"doc": "d"}, "run_id": "r1", "tenant": "gone"}
        assert s.http.post("/v1/workflows/approve/runs", json=body).status_code == 202
        got: list[Any] = []
        poll = threading.Thread(
            target=lambda: got.append(s.http.get("/v1/runs/r1/result", params={"wait": 20}))
        )
        poll.start()
        time.sleep(0.5)  # the poll is waiting
        other = tether.App(store=store_url)  # another process erases the tenant
        asyncio.run(other.erase_tenant("gone"))
        other.store.close_sync()  # type: ignore[attr-defined]
        poll.join(30)
        assert got, "the poll did not answer"
        answer = got[0]
        if answer.status_code == 200:  # woken by the termination first (PostgreSQL's notify)
            assert answer.json()["status"] == "terminated", answer.text
            assert answer.json()["error"]["message"] == "tenant erased", answer.text
        else:  # woken after the erasure: the run is gone
            assert answer.status_code == 410, answer.text
            assert "tenant erased" in answer.json()["detail"]
    finally:
        s.stop()


def test_a_store_that_stops_answering_is_a_503_with_retry_after_never_the_url(
    pg_schema: str,
) -> None:
    from urllib.parse import urlsplit

    from conftest import PG_URL, PgProxy, with_schema

    up = urlsplit(PG_URL)
    proxy = PgProxy(up.hostname or "127.0.0.1", up.port or 5432)
    url = with_schema(PG_URL.replace(up.netloc, f"{up.username}@127.0.0.1:{proxy.port}"), pg_schema)
    s = Server(url, "--no-auth")
    try:
        r = s.http.get("/v1/runs/nope")
        assert r.status_code == 404, r.text  # the store answers through the proxy
        proxy.shut()  # the network path to the database goes away
        for attempt in range(3):  # the connection lost, then connections refused
            r = s.http.get("/v1/runs/nope")
            assert r.status_code == 503, (attempt, r.text)
            assert r.headers["content-type"] == "application/problem+json"
            assert r.headers["retry-after"] == "2"
            assert r.json()["title"] == "Store unavailable"
            assert "postgresql" not in r.text and str(proxy.port) not in r.text, r.text
        r = s.http.get("/readyz")  # asked by anyone, without a key
        assert r.status_code == 503 and r.json()["title"] == "Store not ready", r.text
        assert r.headers["retry-after"] == "2"  # as every route's 503 says
        assert "postgresql" not in r.text and str(proxy.port) not in r.text, r.text
        s.proc.terminate()
        s.proc.wait(30)
        err = s.all_stderr()
    finally:
        s.stop()
        proxy.shut()
    # the operator's log has the whole story, the URL included
    assert "store unavailable" in err and f"127.0.0.1:{proxy.port}" in err, err


def test_requests_the_store_cannot_answer_are_logged_at_most_every_few_seconds(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """During an outage every request answered 503 logged a warning of its own, so a
    busy client flooded the log; now the first is logged at once, then one line per
    ``STORE_WARN_EVERY`` seconds counting the rest."""
    import logging

    from tether import StoreError
    from tether.server import _problems

    now = [1000.0]
    monkeypatch.setattr(_problems.time, "monotonic", lambda: now[0])
    warnings = _problems._StoreWarnings()
    with caplog.at_level(logging.WARNING, logger="tether.server"):
        for _ in range(50):  # 50 requests within a second
            warnings.warn("GET", "/v1/runs/r", StoreError("lost the connection"))
            now[0] += 0.02
        now[0] += _problems.STORE_WARN_EVERY
        warnings.warn("POST", "/v1/workflows/w/runs", StoreError("lost the connection"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("store unavailable (GET /v1/runs/r): lost the connection")
    assert "(and 49 more since the last line)" in lines[1] and "POST" in lines[1]
