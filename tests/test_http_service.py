"""The HTTP service's edges, against a real ``tether serve`` process: signed webhooks
through the outbox (receiver down, server killed), SIGKILL with in-process workers,
concurrent idempotent starts, limits (413, 429, malformed JSON), health, dead letters,
progress, and a schemathesis run against the served OpenAPI document."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

import tether
import tether._app
from test_http_api import INVOICE, Server, _create_key, _free_port
from tether import ConfigurationError
from tether.server._relay import WebhookRelay
from tether.webhooks import WebhookError, new_secret, verify

HERE = Path(__file__).parent


class Receiver:
    """A webhook receiver on ``port`` that records every post and answers 200.

    Posts to ``/drip-head`` get a status line and then a header line every 0.3 s; posts
    to ``/drip-body`` get a 200 and then one byte of the body every 0.3 s (receivers too
    slow to ever end their answer), until ``close``."""

    def __init__(self, port: int) -> None:
        self.posts: list[tuple[dict[str, str], bytes]] = []
        self.paths: list[str] = []
        posts, paths = self.posts, self.paths
        self.closing = closing = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                posts.append(({k.lower(): v for k, v in self.headers.items()}, body))
                paths.append(self.path)
                try:
                    if self.path == "/drip-head":
                        self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                        while not closing.wait(0.3):
                            self.wfile.write(b"x-drip: 1\r\n")
                            self.wfile.flush()
                    elif self.path == "/drip-body":
                        self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
                        while not closing.wait(0.3):
                            self.wfile.write(b"x")
                            self.wfile.flush()
                    else:
                        self.send_response(200)
                        self.end_headers()
                except OSError:  # the relay hung up
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closing.set()
        self.http.shutdown()
        self.http.server_close()


def _worker_process(
    store_url: str, env: dict[str, str] | None = None, *args: str, stderr: Any = None
) -> subprocess.Popen[str]:
    """A ``tether worker serve_app:app`` process on ``store_url``."""
    return subprocess.Popen(
        [sys.executable, "-m", "tether.cli", "worker", "serve_app:app", *args],
        cwd=HERE,
        env={
            **os.environ,
            **(env or {}),
            "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}",
            "TETHER_TEST_STORE": store_url,
        },
        stdout=subprocess.DEVNULL,
        stderr=stderr if stderr is not None else subprocess.DEVNULL,
        text=True,
    )


def _wait_for(check: Any, seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_webhooks_are_signed_delivered_once_and_outlast_a_receiver_that_is_down(
    store_url: str, tmp_path: Path
) -> None:
    secret = new_secret()
    port = _free_port()
    hook = f"http://127.0.0.1:{port}/hook"
    flag = tmp_path / "flag"
    flag.write_text("up")  # the fragile run fails: failures are delivered too
    server = Server(
        store_url,
        "--workers",
        "1",
        "--no-auth",
        "--webhook-secret",
        secret,
        "--webhook-max-backoff",
        "2",
    )
    receiver: Receiver | None = None
    try:
        http = server.http
        ok = http.post("/v1/workflows/bill/runs", json={**INVOICE, "callback_url": hook}).json()
        bad = http.post(
            "/v1/workflows/fragile/runs",
            json={"input": {"flag": str(flag)}, "callback_url": hook},
        ).json()
        quiet = http.post("/v1/workflows/bill/runs", json=INVOICE).json()  # no callback
        for run in (ok, bad, quiet):
            assert http.get(f"{run['links']['result']}?wait=20").json()["status"] != "running"
        # the receiver is down: the relay keeps the deliveries and tries again
        downtime = 30 if store_url.startswith("sqlite") else 5
        time.sleep(downtime)
        pending = http.get(f"/v1/runs/{ok['id']}/webhooks").json()
        assert len(pending) == 1 and pending[0]["state"] == "pending", pending
        assert pending[0]["attempts"] >= 2 and "Connect" in pending[0]["last_error"]
        receiver = Receiver(port)

        def delivered() -> bool:
            rows = [http.get(f"/v1/runs/{r['id']}/webhooks").json() for r in (ok, bad)]
            return all(len(r) == 1 and r[0]["state"] == "delivered" for r in rows)

        _wait_for(delivered, 20, "both deliveries")
        assert http.get(f"/v1/runs/{quiet['id']}/webhooks").json() == []
        time.sleep(1.0)  # nothing more arrives
        assert len(receiver.posts) == 2  # exactly one post per ended run with a callback
        outcomes = {}
        for headers, body in receiver.posts:
            outcome = verify(secret, body, headers)
            assert headers["webhook-id"].startswith(outcome["run"]["id"] + ":")
            outcomes[outcome["run"]["id"]] = outcome
        assert outcomes[ok["id"]]["run"]["status"] == "completed"
        assert outcomes[ok["id"]]["run"]["result"] == {"number": "A-1", "total": 1100}
        assert outcomes[bad["id"]]["run"]["status"] == "failed"
        assert "flag" in outcomes[bad["id"]]["run"]["error"]["message"]
        headers, body = receiver.posts[0]
        with pytest.raises(WebhookError, match="tampered"):
            verify(secret, body.replace(b'"status"', b'"Status"'), headers)
        with pytest.raises(WebhookError, match="tampered"):
            verify(new_secret(), body, headers)
        with pytest.raises(WebhookError, match="stale"):
            verify(secret, body, headers, now=int(headers["webhook-timestamp"]) + 3600)
        with pytest.raises(WebhookError, match="missing"):
            verify(secret, body, {})
    finally:
        if receiver is not None:
            receiver.close()
        server.stop()


def test_a_callback_url_without_a_signing_secret_is_refused(store_url: str) -> None:
    server = Server(store_url, "--no-auth")
    try:
        r = server.http.post(
            "/v1/workflows/bill/runs", json={**INVOICE, "callback_url": "http://x.example/h"}
        )
        assert r.status_code == 422 and "--webhook-secret" in r.json()["detail"]
        bad = server.http.post(
            "/v1/workflows/bill/runs", json={**INVOICE, "callback_url": "ftp://x.example/h"}
        )
        assert bad.status_code in (400, 422)
    finally:
        server.stop()


async def _deliveries(app: tether.App, run_id: str) -> list[tuple[Any, ...]]:
    return await app.store.webhook_deliveries(run_id=run_id)


async def _until(check: Any, seconds: float, what: str) -> Any:
    """``check()``'s answer once it is truthy (``check`` is a coroutine function)."""
    deadline = time.monotonic() + seconds
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_delivery_that_cannot_be_posted_fails_alone_and_the_relay_goes_on(
    app: tether.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run id that is not ASCII went into the webhook-id header as is (the post raised
    UnicodeEncodeError), a port above 65535 raised OverflowError: either ended the relay,
    and every restarted relay on the same row, so no webhook was posted again."""

    @app.workflow
    async def echo(x: str) -> str:
        return x

    secret = new_secret()
    port = _free_port()
    hook = f"http://127.0.0.1:{port}/hook"
    receiver = Receiver(port)
    relays: list[WebhookRelay] = []
    try:
        async with app.worker(poll_interval=0.05):
            # a URL queued before start checked ports (the check is bypassed here)
            monkeypatch.setattr(tether._app, "check_webhook_url", lambda url: url)
            odd = await app.start(
                echo, "p", run_id="bad-port", webhook="http://127.0.0.1:99999/hook"
            )
            monkeypatch.undo()
            accented = await app.start(echo, "u", run_id="facture-é 1", webhook=hook)
            for run in (odd, accented):
                await run.result(timeout=20)
            for attempt in range(2):  # a relay, then a restarted one
                relay = WebhookRelay(app, secret, backoff=0.1, max_backoff=0.2, poll=0.05)
                relays.append(relay)
                relay.start()
                plain = await app.start(echo, "g", run_id=f"good-{attempt}", webhook=hook)
                await plain.result(timeout=20)

                async def delivered(rid: str = plain.run_id) -> bool:
                    rows = await _deliveries(app, rid)
                    return bool(rows) and rows[0][10] == "delivered"

                await _until(delivered, 20, "the later run's delivery")
                assert relay._task is not None and not relay._task.done()
                await relay.stop()
        rows = await _deliveries(app, accented.run_id)
        assert rows[0][10] == "delivered", rows
        # a URL no retry can post to is given up at once, saying why
        (bad,) = await _deliveries(app, odd.run_id)
        assert bad[10] == "failed" and bad[9] == 1 and "port" in bad[11], bad
        ids = {}
        for headers, body in receiver.posts:
            outcome = verify(secret, body, headers)  # the id as sent is the id signed
            ids[outcome["run"]["id"]] = headers["webhook-id"]
        assert ids["facture-é 1"] == f"facture-%C3%A9%201:{rows[0][0]}"
        assert set(ids) == {"facture-é 1", "good-0", "good-1"}
        # and start refuses such a URL now
        for url in (
            "http://127.0.0.1:99999/h",
            "http://127.0.0.1:0/h",
            "http://h:x/",
            "http://a/\n",
        ):
            with pytest.raises(ConfigurationError, match="webhook"):
                await app.start(echo, "x", webhook=url)
    finally:
        for relay in relays:
            await relay.stop()
        receiver.close()


async def test_a_delivery_whose_output_cannot_be_read_fails_alone(
    store_url: str, tmp_path: Path
) -> None:
    """A pending delivery whose run's output was offloaded to a blob that is gone made
    every claim fail: no webhook was posted, no attempt counted, none given up."""
    app = tether.App(store=store_url, blobs=str(tmp_path / "blobs"), offload_above=1000)

    @app.workflow
    async def big(n: int) -> str:
        return "y" * n

    secret = new_secret()
    port = _free_port()
    hook = f"http://127.0.0.1:{port}/hook"
    receiver = Receiver(port)
    relay = WebhookRelay(app, secret, backoff=0.1, max_backoff=0.2, poll=0.05, give_up_after=1)
    try:
        async with app.worker(poll_interval=0.05):
            lost = await app.start(big, 5000, run_id="lost", webhook=hook)
            await lost.result(timeout=20)
            blobs = [f for f in (tmp_path / "blobs").rglob("*") if f.is_file()]
            assert blobs
            for f in blobs:  # the disk lost it, or a careless cleanup
                f.unlink()
            small = await app.start(big, 10, run_id="small", webhook=hook)
            await small.result(timeout=20)
            relay.start()

            async def settled() -> bool:
                rows = [await _deliveries(app, rid) for rid in ("lost", "small")]
                return rows[0][0][10] == "failed" and rows[1][0][10] == "delivered"

            await _until(settled, 20, "one delivery given up, the other delivered")
            assert relay._task is not None and not relay._task.done()
        (row,) = await _deliveries(app, "lost")
        assert row[9] >= 2 and "output" in row[11] and "lost" in row[11], row
        assert [json.loads(b)["run"]["id"] for _, b in receiver.posts] == ["small"]
    finally:
        await relay.stop()
        receiver.close()
        app.store.close_sync()  # type: ignore[attr-defined]


async def test_a_slow_receiver_holds_up_no_other_delivery(app: tether.App) -> None:
    """A receiver that sent its answer a line or a byte at a time (never idle as long as
    httpx's read timeout) held the relay's whole batch: no other webhook was posted, and
    the lease ran out meanwhile (another replica could post it again)."""

    @app.workflow
    async def echo(x: str) -> str:
        return x

    secret = new_secret()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    receiver = Receiver(port)
    # the endless answer is cut at 5 s: long enough that, even on a loaded machine, the
    # fast post can only be done before it if the slow ones hold nothing up
    relay = WebhookRelay(app, secret, timeout=5, backoff=60, poll=0.05)

    async def state(rid: str) -> tuple[Any, ...]:
        return (await _deliveries(app, rid))[0]

    try:
        async with app.worker(poll_interval=0.05):
            for rid in ("drip-head", "drip-body"):
                run = await app.start(echo, rid, run_id=rid, webhook=f"{base}/{rid}")
                await run.result(timeout=20)
            relay.start()

            async def both_posted() -> bool:
                return {"/drip-head", "/drip-body"} <= set(receiver.paths)

            await _until(both_posted, 10, "both slow posts")
            fast = await app.start(echo, "fast", run_id="fast", webhook=f"{base}/hook")
            await fast.result(timeout=20)

            async def fast_delivered() -> bool:
                return bool((await state("fast"))[10] == "delivered")

            await _until(fast_delivered, 20, "the fast receiver's delivery")
            # not after the slow ones: the endless answer is still being read
            assert not (await state("drip-head"))[11], "the fast post waited for the slow one"
            # a 200 counts once its status line and headers are in: the body is not read
            assert (await state("drip-body"))[10] == "delivered"

            async def head_failed() -> bool:
                return bool((await state("drip-head"))[11])

            # the whole post has a deadline (5 s here), shorter than the lease
            await _until(head_failed, 20, "the endless answer's deadline")
            row = await state("drip-head")
            assert row[10] == "pending" and row[9] == 1 and "5 s" in row[11], row
        assert receiver.paths.count("/drip-head") == 1
        assert receiver.paths.count("/drip-body") == 1
    finally:
        await relay.stop()
        receiver.close()


def test_sigkill_with_in_process_workers_loses_no_accepted_run_or_delivery(
    tmp_path: Path,
) -> None:
    store = f"sqlite:///{tmp_path / 't.db'}"
    secret = new_secret()
    port = _free_port()
    hook = f"http://127.0.0.1:{port}/hook"
    args = ("--workers", "1", "--no-auth", "--webhook-secret", secret)
    first = Server(store, *args, "--webhook-max-backoff", "1")
    ids = []
    for i in range(8):
        body = {"input": {"seconds": 0.3}, "callback_url": hook, "run_id": f"kill-{i}"}
        r = first.http.post("/v1/workflows/slow/runs", json=body)
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    first.proc.send_signal(signal.SIGKILL)  # no shutdown, no lease released
    first.proc.wait(10)
    first.http.close()
    receiver = Receiver(port)
    second = Server(store, *args)
    try:
        for rid in ids:
            got = second.http.get(f"/v1/runs/{rid}/result?wait=60").json()
            assert got["status"] == "completed" and got["result"] == "slow done", got
        _wait_for(lambda: len({h["webhook-id"] for h, _ in receiver.posts}) == 8, 30, "posts")
        for headers, body in receiver.posts:
            verify(secret, body, headers)
        assert {json.loads(b)["run"]["id"] for _, b in receiver.posts} == set(ids)
    finally:
        receiver.close()
        second.stop()


def test_twenty_concurrent_identical_starts_make_one_run(store_url: str) -> None:
    server = Server(store_url, "--workers", "1", "--no-auth")
    try:
        port = server.port

        def post(_: int) -> tuple[int, str]:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
                r = c.post(
                    "/v1/workflows/bill/runs", json=INVOICE, headers={"Idempotency-Key": "k-20"}
                )
                return r.status_code, r.json()["id"]

        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(post, range(20)))
        assert {code for code, _ in answers} <= {200, 202}, answers
        assert len({rid for _, rid in answers}) == 1
        runs = server.http.get("/v1/runs?workflow=bill").json()["runs"]
        assert len(runs) == 1
    finally:
        server.stop()


def test_limits_health_and_problem_documents(store_url: str) -> None:
    server = Server(
        store_url, "--workers", "1", "--no-auth", "--max-body", "2000", "--rate-limit", "5"
    )
    try:
        http = server.http
        assert http.get("/healthz").json() == {"status": "ok"}
        assert http.get("/readyz").json()["status"] == "ready"
        big = {"input": {"invoice": {"number": "x" * 5000, "cents": 1}, "vat": 0.1}}
        r = http.post("/v1/workflows/bill/runs", json=big)
        assert r.status_code == 413, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert "2000 bytes" in r.json()["detail"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
            yield b'{"input": {"invoice": {"number": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'", "cents": 1}}}'

        r = http.post(
            "/v1/workflows/bill/runs",
            content=chunks(),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 413, r.text
        time.sleep(1.2)  # the bucket refills
        r = http.post(
            "/v1/workflows/bill/runs",
            content=b'{"input": {',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["title"] == "Malformed JSON", r.text
        r = http.get("/v1/nothing-here")
        assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"
        codes = [http.get("/v1/runs?limit=1") for _ in range(12)]
        limited = [c for c in codes if c.status_code == 429]
        assert limited, [c.status_code for c in codes]
        assert int(limited[0].headers["retry-after"]) >= 1
        assert "requests/s" in limited[0].json()["detail"]
        assert http.get("/healthz").status_code == 200  # health is not rate limited
    finally:
        server.stop()


def test_failed_authentications_are_rate_limited_per_address(store_url: str) -> None:
    server = Server(store_url, "--rate-limit", "1")  # keys required, none valid here
    try:
        http = server.http
        wrong = {"Authorization": "Bearer tether_nokey.guess"}
        time.sleep(1.2)  # (the fixture's keyless wait for the server took the token)
        codes = [http.get("/v1/runs", headers=wrong) for _ in range(4)]
        assert codes[0].status_code == 401, codes[0].text
        limited = [c for c in codes if c.status_code == 429]
        assert len(limited) >= 2, [c.status_code for c in codes]
        assert int(limited[0].headers["retry-after"]) >= 1
        assert "wrong or missing keys" in limited[0].json()["detail"]
        assert http.get("/v1/runs").status_code == 429  # no key at all: the same bucket
        assert http.get("/healthz").status_code == 200
        # the console's sign-in shares it: a refused one is answered 429 too
        signin = http.post("/login", data={"key": "tether_nokey.guess2", "next": "/"})
        assert signin.status_code == 429 and signin.headers["retry-after"], signin.status_code
        time.sleep(1.2)  # the bucket refills
        assert http.get("/v1/runs", headers=wrong).status_code == 401
        signin = http.post("/login", data={"key": "tether_nokey.guess3", "next": "/"})
        assert signin.status_code == 429  # the last 401 took the token
    finally:
        server.stop()


def test_a_valid_key_is_never_refused_for_another_clients_wrong_keys(store_url: str) -> None:
    # behind a proxy or NAT every client shares one address: one client's wrong key
    # must not lock out the others' valid keys
    server = Server(store_url, "--rate-limit", "1")
    try:
        good = {"Authorization": f"Bearer {_create_key(store_url, '--role', 'admin')}"}
        http = server.http
        wrong = {"Authorization": "Bearer tether_nokey.guess"}
        time.sleep(1.2)
        codes = [http.get("/v1/runs", headers=wrong).status_code for _ in range(4)]
        assert codes[0] == 401 and codes[-1] == 429, codes
        r = http.get("/v1/runs", headers=good)
        assert r.status_code == 200, r.text
        assert http.get("/v1/runs", headers=wrong).status_code == 429  # still limited
        signin = http.post("/login", data={"key": good["Authorization"][7:], "next": "/"})
        assert signin.status_code == 303, signin.text  # the console's sign-in too
        signin = http.post("/login", data={"key": "tether_nokey.guess2", "next": "/"})
        assert signin.status_code == 429
    finally:
        server.stop()


def test_dead_letters_are_listed_inspected_and_replayed(store_url: str, tmp_path: Path) -> None:
    flag = tmp_path / "flag"
    flag.write_text("up")
    server = Server(store_url, "--workers", "1", "--no-auth")
    try:
        http = server.http
        run = http.post("/v1/workflows/fragile/runs", json={"input": {"flag": str(flag)}}).json()
        failed = http.get(f"{run['links']['result']}?wait=20").json()
        assert failed["status"] == "failed"
        letters = http.get(f"/v1/dead-letters?run_id={run['id']}").json()
        assert sorted(d["kind"] for d in letters) == ["activity", "run"]  # the step, the run
        letter = next(d for d in letters if d["kind"] == "run")
        one = http.get(f"/v1/dead-letters/{letter['id']}").json()
        assert one["run_id"] == run["id"] and "flag" in one["error"]["message"]
        assert http.get("/v1/dead-letters/999999").status_code == 404
        by_type = http.get("/v1/runs?error_type=RuntimeError").json()["runs"]
        assert run["id"] in {r["id"] for r in by_type}
        assert http.get("/v1/runs?error_type=KeyError").json()["runs"] == []
        flag.unlink()  # the fix
        replay = http.post(f"/v1/dead-letters/{letter['id']}/replay")
        assert replay.status_code == 200, replay.text
        fixed = http.get(f"{run['links']['result']}?wait=20").json()
        assert fixed["status"] == "completed" and fixed["result"] == "fixed"
        still = http.get(f"/v1/dead-letters?run_id={run['id']}").json()
        assert letter["id"] not in {d["id"] for d in still}
        again = http.post(f"/v1/dead-letters/{letter['id']}/replay")
        assert again.status_code == 409
    finally:
        server.stop()


def test_progress_by_units_of_work(store_url: str) -> None:
    server = Server(store_url, "--workers", "1", "--no-auth")
    try:
        run = server.http.post("/v1/workflows/counted/runs", json={"input": {"items": 3}}).json()
        assert server.http.get(f"{run['links']['result']}?wait=20").json()["result"] == 3
        view = server.http.get(run["links"]["self"]).json()
        assert view["progress"] == {"done": 3, "total": 3, "unit": "items"}
        recent = server.http.get("/v1/runs?age=3600").json()["runs"]
        assert run["id"] in {r["id"] for r in recent}
    finally:
        server.stop()


ST = Path(sys.executable).parent / "st"


@pytest.mark.skipif(
    not ST.exists() and not os.environ.get("CI"),
    reason="schemathesis is not installed (pip install -e '.[dev]')",
)
def test_schemathesis_finds_no_server_error_and_no_schema_violation(tmp_path: Path) -> None:
    server = Server(
        f"sqlite:///{tmp_path / 't.db'}", "--workers", "1", "--no-auth", "--max-wait", "2"
    )
    try:
        res = subprocess.run(
            [
                str(ST),
                "run",
                f"http://127.0.0.1:{server.port}/openapi.json",
                "--checks",
                "not_a_server_error,response_schema_conformance",
                "--max-examples",
                "15",
                "--seed",
                "1",
                "--exclude-path-regex",
                "/events$",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
        assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    finally:
        server.stop()


def test_streamed_model_tokens_reach_the_event_stream(store_url: str) -> None:
    """Tokens of a streamed model step arrive as SSE ``token`` events while the step
    runs; on PostgreSQL from a worker in another process (NOTIFY), on SQLite from the
    server's own worker."""
    from tether.testing import ModelServer, model_reply

    with ModelServer() as models:
        models.script("gpt-4o-mini", model_reply("once upon a time, a fox", chunk_delay=0.15))
        env = {"TETHER_TEST_MODEL_URL": models.base_url}
        apart = not store_url.startswith("sqlite")
        worker = _worker_process(store_url, env) if apart else None
        server = Server(store_url, *(() if apart else ("--workers", "1")), "--no-auth", env=env)
        try:
            body = {"input": {"topic": "foxes"}, "run_id": "tale"}
            assert server.http.post("/v1/workflows/tell/runs", json=body).status_code == 202
            tokens: list[dict[str, Any]] = []
            kinds: list[str] = []
            with server.http.stream("GET", "/v1/runs/tale/events") as stream:
                # the run waits for "go": the stream follows before any token is made
                server.http.post("/v1/runs/tale/signals/go", json={})
                kind = ""
                for line in stream.iter_lines():
                    if line.startswith("event: "):
                        kind = line[7:]
                        kinds.append(kind)
                    elif line.startswith("data: ") and kind == "token":
                        tokens.append(json.loads(line[6:]))
            text = "".join(t.get("delta", "") for t in tokens)
            assert text == "once upon a time, a fox", tokens
            assert tokens[-1].get("done") is True and tokens[0]["run_id"] == "tale"
            assert len([t for t in tokens if "delta" in t]) >= 2  # in pieces, as they came
            # the tokens came before the step's recorded answer, which ends the run
            assert "ActivityCompleted" in kinds, kinds
            assert kinds.index("token") < kinds.index("ActivityCompleted")
            assert "WorkflowCompleted" in kinds
        finally:
            server.stop()
            if worker is not None:
                worker.terminate()
                worker.wait(30)


def _tokens_until(lines: Any, done: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """The ``token`` events' data and every event's name read from an SSE stream's
    ``lines`` until ``done(tokens)`` holds or the stream ends."""
    tokens: list[dict[str, Any]] = []
    kinds: list[str] = []
    kind = ""
    for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
            kinds.append(kind)
        elif line.startswith("data: ") and kind == "token":
            tokens.append(json.loads(line[6:]))
            if done(tokens):
                break
    return tokens, kinds


def test_a_streamed_step_that_times_out_says_so_on_the_event_stream(store_url: str) -> None:
    """A streamed step whose timeout ran out mid-answer: its ``token`` events ended
    each attempt with ``failed: CancelledError`` and nothing else. They now say
    ``TimeoutError`` with what happened (model, step, after how long, what to do), as
    does the run's error the CLI and the console show."""
    from tether.testing import ModelServer, model_reply

    words = " ".join(f"w{i}" for i in range(40))  # 2 s an answer
    with ModelServer() as models:
        slow = model_reply(words, chunk_delay=0.05)
        models.script("gpt-4o-mini", slow, slow)
        env = {"TETHER_TEST_MODEL_URL": models.base_url, "TETHER_TEST_MODEL_TIMEOUT": "0.8"}
        apart = not store_url.startswith("sqlite")
        worker = _worker_process(store_url, env) if apart else None
        server = Server(store_url, *(() if apart else ("--workers", "1")), "--no-auth", env=env)
        try:
            body = {"input": {"topic": "foxes"}, "run_id": "late-tale"}
            assert server.http.post("/v1/workflows/tell/runs", json=body).status_code == 202
            with server.http.stream("GET", "/v1/runs/late-tale/events") as stream:
                server.http.post("/v1/runs/late-tale/signals/go", json={})
                tokens, kinds = _tokens_until(stream.iter_lines(), lambda t: False)
            assert "WorkflowFailed" in kinds, kinds
            ends = [t for t in tokens if "delta" not in t]
            assert [(t["attempt"], t["failed"]) for t in ends] == [
                (1, "TimeoutError"),
                (2, "TimeoutError"),
            ], ends
            for t in ends:
                assert t["error"].startswith("model 'storyteller' (gpt-4o-mini), step 1, ")
                assert "timed out after 0.8 s (its timeout per attempt)" in t["error"], t
                assert "raise the model's timeout" in t["error"], t
            run = server.http.get("/v1/runs/late-tale").json()
            assert "timed out after 0.8 s (its timeout per attempt)" in run["error"]["message"]
            assert "model 'storyteller'" in run["error"]["message"], run["error"]
        finally:
            server.stop()
            if worker is not None:
                worker.terminate()
                worker.wait(30)


def test_a_streamed_step_its_worker_stopped_says_so_on_the_event_stream(pg_schema: str) -> None:
    """A worker process stopped (SIGTERM, ``--grace 0.3``) while its step streamed: the
    event stream heard ``failed: CancelledError``. It now hears ``WorkerStopped``, with
    what happens next (handed back, retried), and the next worker's answer."""
    from conftest import require_pg, with_schema
    from tether.testing import ModelServer, model_reply

    pg_url = with_schema(require_pg(), pg_schema)  # another process hears it: NOTIFY
    words = " ".join(f"w{i}" for i in range(100))
    with ModelServer() as models:
        models.script("gpt-4o-mini", model_reply(words, chunk_delay=0.05), model_reply("all of it"))
        env = {"TETHER_TEST_MODEL_URL": models.base_url}
        worker = _worker_process(pg_url, env, "--grace", "0.3")
        server = Server(pg_url, "--no-auth", env=env)
        second = None
        try:
            body = {"input": {"topic": "foxes"}, "run_id": "cut-tale"}
            assert server.http.post("/v1/workflows/tell/runs", json=body).status_code == 202
            with server.http.stream("GET", "/v1/runs/cut-tale/events") as stream:
                server.http.post("/v1/runs/cut-tale/signals/go", json={})
                lines = stream.iter_lines()
                tokens, _ = _tokens_until(lines, lambda t: "delta" in t[-1])
                worker.send_signal(signal.SIGTERM)  # a deploy, mid-answer
                more, _ = _tokens_until(lines, lambda t: "failed" in t[-1])
                assert worker.wait(30) == 0
                second = _worker_process(pg_url, env)
                rest, kinds = _tokens_until(lines, lambda t: False)
            (stopped,) = [t for t in tokens + more if "failed" in t]
            assert stopped["failed"] == "WorkerStopped" and stopped["attempt"] == 1, stopped
            error = stopped["error"]
            assert error.startswith("model 'storyteller' (gpt-4o-mini), step 1, attempt 1: ")
            assert "its worker stopped (a deploy, a restart) while it streamed" in error, error
            assert "retried" in error and "CancelledError" not in error, error
            assert "".join(t.get("delta", "") for t in rest) == "all of it", rest
            assert rest[-1].get("done") is True and "WorkflowCompleted" in kinds
        finally:
            server.stop()
            for w in (worker, second):
                if w is not None and w.poll() is None:
                    w.terminate()
                    w.wait(30)


def test_a_kill_switch_flipped_over_http_holds_work_on_a_worker_in_another_process(
    store_url: str,
) -> None:
    server = Server(store_url, "--no-auth")  # no worker in the server: it runs apart
    worker = _worker_process(store_url)
    try:
        http = server.http
        off = http.put("/v1/switches/activity/total", json={"reason": "bad deploy"})
        assert off.status_code == 200 and off.json()["changed"] is True
        assert http.put("/v1/switches/queue/x").status_code == 400  # not a kind of switch
        assert [s["name"] for s in http.get("/v1/switches").json()] == ["total"]
        run = http.post("/v1/workflows/bill/runs", json=INVOICE).json()
        time.sleep(4)  # the worker has seen the step (and held it) by now
        assert http.get(f"{run['links']['result']}?wait=0").status_code == 202
        events = http.get(f"/v1/runs/{run['id']}/history").json()["events"]
        assert "ActivityCompleted" not in {e["type"] for e in events}
        assert http.delete("/v1/switches/activity/total").json()["changed"] is True
        done = http.get(f"{run['links']['result']}?wait=30").json()
        assert done["result"] == {"number": "A-1", "total": 1100}
        log = http.get("/v1/audit?target=activity:total").json()
        assert [(e["action"], e["actor"]) for e in log] == [
            ("switch on", "api (no auth)"),
            ("switch off", "api (no auth)"),
        ]
    finally:
        server.stop()
        worker.terminate()
        worker.wait(30)


def test_a_switch_on_a_name_the_app_lacks_is_refused_and_names_may_hold_slashes(
    store_url: str,
) -> None:
    server = Server(store_url, "--no-auth")
    try:
        http = server.http
        for path in ("workflow/nope", "activity/nope", "workflow/%20", "tenant/%20"):
            r = http.put(f"/v1/switches/{path}", json={"reason": "typo"})
            assert r.status_code == 400, (path, r.text)
            assert r.headers["content-type"] == "application/problem+json"
        detail = http.put("/v1/switches/workflow/nope").json()["detail"]
        assert "no workflow 'nope'" in detail and "bill" in detail  # the names it has
        assert http.get("/v1/switches").json() == []  # nothing was switched off
        # a model's name may hold a slash (no gateway here: any model name goes)
        off = http.put("/v1/switches/model/meta-llama/llama-3", json={"reason": "outage"})
        assert off.status_code == 200 and off.json()["name"] == "meta-llama/llama-3", off.text
        assert [s["name"] for s in http.get("/v1/switches").json()] == ["meta-llama/llama-3"]
        on = http.delete("/v1/switches/model/meta-llama/llama-3")
        assert on.status_code == 200 and on.json()["changed"] is True
        assert http.put("/v1/switches/workflow/bill").json()["changed"] is True  # known
    finally:
        server.stop()


def test_a_start_at_the_admission_limit_says_when_to_retry_or_queues(store_url: str) -> None:
    admin = tether.App(store=store_url)
    admin.configure_admission("acme", max_running=1)
    admin.store.close_sync()  # type: ignore[attr-defined]  # (written as it opened)
    server = Server(store_url, "--no-auth")  # no worker: the first run stays in flight
    try:
        http = server.http
        body = {**INVOICE, "tenant": "acme"}
        assert http.post("/v1/workflows/bill/runs", json=body).status_code == 202
        refused = http.post("/v1/workflows/bill/runs", json=body)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert "admission limit" in refused.json()["detail"]
        queued = http.post("/v1/workflows/bill/runs", json={**body, "on_limit": "queue"})
        assert queued.status_code == 202 and queued.json()["status"] == "queued", queued.text
        bad = http.post("/v1/workflows/bill/runs", json={**body, "on_limit": "wait"})
        assert bad.status_code == 422
    finally:
        server.stop()


def test_prometheus_metrics_from_the_server_and_from_a_worker(store_url: str) -> None:
    fast = {"TETHER_METRICS_REFRESH": "0.25"}  # runs by status every 3 s
    server = Server(store_url, "--workers", "1", "--no-auth", env=fast)
    port = _free_port()
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tether.cli",
            "worker",
            "serve_app:app",
            "--metrics-port",
            str(port),
        ],
        cwd=HERE,
        env={
            **os.environ,
            "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}",
            "TETHER_TEST_STORE": store_url,
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        http = server.http
        run = http.post("/v1/workflows/bill/runs", json=INVOICE).json()
        assert http.get(f"{run['links']['result']}?wait=20").json()["status"] == "completed"
        waiting = http.post("/v1/workflows/review/runs", json={"input": {"title": "t"}}).json()
        _wait_for(
            lambda: http.get(f"/v1/approvals?run_id={waiting['id']}").json(), 20, "the review"
        )
        http.put("/v1/switches/model/big", json={"reason": "x"})

        def scraped() -> str | None:
            text = http.get("/metrics").text
            ok = 'tether_runs{status="completed",workflow="bill"} 1.0' in text
            return text if ok and "tether_approvals_open 1.0" in text else None

        text = _wait_for(scraped, 20, "metrics that show the runs")
        assert 'tether_queue_ready_tasks{queue="default"}' in text
        assert 'tether_switches_off{kind="model"} 1.0' in text
        assert 'event="activities"' in text and "tether_worker_slots" in text
        # the worker process serves its own on --metrics-port
        body = _wait_for(
            lambda: _get_text(f"http://127.0.0.1:{port}/metrics"), 30, "the worker's metrics"
        )
        assert (
            "tether_worker_inflight_tasks" in body and "tether_queue_oldest_ready_seconds" in body
        )
        # both parse as Prometheus text; the run's end is counted once, by the process
        # that committed it, whichever of the two ran it
        from prometheus_client.parser import text_string_to_metric_families

        ended = [
            s.value
            for exposition in (text, body)
            for family in text_string_to_metric_families(exposition)
            for s in family.samples
            if s.name == "tether_runs_ended_total"
            and s.labels == {"workflow": "bill", "status": "completed"}
        ]
        assert sum(ended) == 1
        assert "tether_activity_duration_seconds_bucket" in text + body
    finally:
        server.stop()
        worker.terminate()
        worker.wait(30)


def _get_text(url: str) -> str | None:
    try:
        r = httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None
    return r.text if r.status_code == 200 else None


def test_json_logs_carry_the_run_and_step(store_url: str) -> None:
    server = Server(store_url, "--no-auth")
    worker = _worker_process(store_url, None, "--log-format", "json", stderr=subprocess.PIPE)
    try:
        run = server.http.post("/v1/workflows/bill/runs", json=INVOICE).json()
        done = server.http.get(f"{run['links']['result']}?wait=30").json()
        assert done["status"] == "completed"
    finally:
        server.stop()
        worker.terminate()
        _out, err = worker.communicate(timeout=30)
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert records and all("time" in r and "level" in r for r in records)
    (priced,) = [r for r in records if r["message"] == "pricing invoice"]
    assert priced["run_id"] == run["id"] and priced["activity"] == "total"
    assert priced["step"] == 1 and priced["attempt"] == 1 and priced["invoice"] == "A-1"


def test_a_start_with_a_traceparent_joins_the_callers_trace(store_url: str) -> None:
    server = Server(store_url, "--no-auth")
    try:
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        r = server.http.post(
            "/v1/workflows/bill/runs",
            json=INVOICE,
            headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        )
        attrs = server.http.get(r.json()["links"]["self"]).json()["attrs"]
        assert attrs["trace"]["traceparent"].split("-")[1] == trace_id
        plain = server.http.post("/v1/workflows/bill/runs", json=INVOICE).json()
        assert not (server.http.get(plain["links"]["self"]).json()["attrs"] or {}).get("trace")
    finally:
        server.stop()


def test_an_entity_operation_not_applied_within_the_wait_is_a_202(store_url: str) -> None:
    """No worker runs: the operation is recorded and still applies later, so the answer
    is 202 with Retry-After (as for an update), not the 500 a client would retry (and so
    apply the operation twice)."""
    server = Server(store_url, "--no-auth", "--max-wait", "1")
    try:
        got = server.http.post(
            "/v1/entities/Tally/t9/operations/add", json={"args": [1], "timeout": 0.3}
        )
        assert got.status_code == 202, got.text
        assert got.headers["Retry-After"] == "1"
        assert got.json()["status"] == "accepted" and "still applies" in got.json()["detail"]
    finally:
        server.stop()


def test_queries_updates_signal_with_start_entities_and_schedules_over_http(
    store_url: str,
) -> None:
    server = Server(store_url, "--workers", "1", "--no-auth")
    try:
        http = server.http
        # signal-with-start: the run is created with the signal waiting for it
        body = {
            "input": {"doc": "d"},
            "run_id": "doc-1",
            "if_running": "signal",
            "signal": {"name": "review", "payload": {"verdict": "ok"}},
        }
        started = http.post("/v1/workflows/approve/runs", json=body)
        assert started.status_code == 202, started.text
        done = http.get("/v1/runs/doc-1/result?wait=20").json()
        assert done["result"] == "d: ok"
        again = http.post("/v1/workflows/approve/runs", json=body)  # it has ended
        assert again.status_code == 409 and "finished" in again.json()["detail"]
        refused = http.post(
            "/v1/workflows/approve/runs",
            json={"input": {"doc": "d"}, "run_id": "doc-1", "if_running": "reject"},
        )
        assert refused.status_code == 409
        # queries and updates
        run = http.post("/v1/workflows/counter/runs", json={"input": {"start": 10}}).json()
        rid = run["id"]
        base = f"/v1/runs/{rid}"
        deadline = time.monotonic() + 20
        while http.post(f"{base}/queries/total", json={}).status_code != 200:
            assert time.monotonic() < deadline, "the run never ran"
            time.sleep(0.05)
        assert http.post(f"{base}/queries/total", json={}).json()["result"] == 10
        added = http.post(f"{base}/updates/add", json={"args": [5]})
        assert added.status_code == 200 and added.json()["result"] == 15
        before = len(http.get(f"{base}/history").json()["events"])
        bad = http.post(f"{base}/updates/add", json={"args": [-1]})
        assert bad.status_code == 422 and "k must be > 0" in bad.json()["detail"]
        assert len(http.get(f"{base}/history").json()["events"]) == before
        unknown = http.post(f"{base}/queries/nope", json={})
        assert unknown.status_code == 422 and "known: total" in unknown.json()["detail"]
        http.post(f"{base}/signals/stop")
        assert http.get(f"{base}/result?wait=20").json()["result"] == 15
        # entities
        for k in (1, 2, 3):
            got = http.post("/v1/entities/Tally/t1/operations/add", json={"args": [k]})
            assert got.status_code == 200, got.text
        assert got.json()["result"] == 6
        assert http.get("/v1/entities/Tally/t1").json() == {"n": 6}
        assert http.get("/v1/entities/Tally").json() == ["t1"]
        nope = http.post("/v1/entities/Tally/t1/operations/reset", json={})
        assert nope.status_code == 422 and "known: add" in nope.json()["detail"]
        names = {w["name"] for w in http.get("/v1/workflows").json()}
        assert "counter" in names and not any(n.startswith("entity:") for n in names)
        # schedules (declared with the CLI; listed and steered over HTTP)
        created = subprocess.run(
            [
                sys.executable,
                "-m",
                "tether.cli",
                "schedules",
                "create",
                "nightly",
                "serve_app:app",
                "bill",
                json.dumps(INVOICE["input"]["invoice"]),
                "0.1",
                "--cron",
                "0 2 * * *",
                "--tz",
                "Europe/Paris",
            ],
            cwd=Path(__file__).parent,
            env={
                **os.environ,
                "TETHER_TEST_STORE": store_url,
                "PYTHONPATH": f"{Path(__file__).parent.parent / 'src'}{os.pathsep}"
                f"{Path(__file__).parent}",
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert created.returncode == 0, created.stderr
        listed = http.get("/v1/schedules").json()
        assert [s["id"] for s in listed] == ["nightly"]
        assert listed[0]["spec"]["tz"] == "Europe/Paris"
        assert http.post("/v1/schedules/nightly/pause").json()["paused"] is True
        fired = http.post("/v1/schedules/nightly/trigger")
        assert fired.status_code == 202 and fired.json()["id"].startswith("nightly@trigger-")
        result = http.get(f"{fired.headers['location']}/result?wait=20").json()
        assert result["result"]["total"] == 1100
        assert http.post("/v1/schedules/nightly/explode").status_code == 404
        assert http.delete("/v1/schedules/nightly").json()["deleted"] is True
        assert http.get("/v1/schedules/nightly").status_code == 404
    finally:
        server.stop()


def test_a_restarted_serve_with_a_worker_id_takes_back_its_predecessors_task_at_once(
    store_url: str,
) -> None:
    """``tether serve --workers N`` had no stable id for its workers (``tether worker
    --id``): after a crash its work waited a whole lease. A restart under the same
    ``--worker-id`` now takes back what its predecessor held at once."""
    args = ("--workers", "1", "--no-auth", "--worker-id", "api-1", "--lease", "60")
    first = Server(store_url, *args)
    try:
        body = {"input": {"seconds": 1.0}, "run_id": "held"}
        assert first.http.post("/v1/workflows/slow/runs", json=body).status_code == 202

        async def leased() -> int:
            probe = tether.App(store=store_url)
            try:
                held, _until = await probe.store.foreign_leases(["default"], "someone-else")
                return held
            finally:
                await probe.close()

        deadline = time.monotonic() + 20
        while not asyncio.run(leased()):  # its step is claimed (leased to api-1)
            assert time.monotonic() < deadline, "the step was never claimed"
            time.sleep(0.1)
        first.proc.kill()  # a crash: the step's lease runs for 60 s more
        first.proc.wait(10)
    finally:
        first.stop()
    second = Server(store_url, *args)
    try:
        began = time.monotonic()
        done = second.http.get("/v1/runs/held/result?wait=30")
        assert done.status_code == 200, done.text
        assert done.json()["result"] == "slow done"
        assert time.monotonic() - began < 30  # at once, not after the 60 s lease
    finally:
        second.stop()


async def test_the_in_process_workers_of_an_api_get_one_stable_id_each(store_url: str) -> None:
    from tether.server import create_api

    app = tether.App(store=store_url)
    for workers, ids in ((1, ["api"]), (2, ["api-1", "api-2"])):
        api = create_api(
            app, workers=workers, auth=False, worker_options={"worker_id": "api", "lease": 5.0}
        )
        async with api.router.lifespan_context(api):
            assert [w.id for w in app._local_workers] == ids
            assert {w.lease for w in app._local_workers} == {5.0}
