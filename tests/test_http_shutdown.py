"""``tether serve`` stopping on SIGTERM against a real server process: open event streams
(an open console tab is enough) end with a message to reconnect instead of holding the
process, in-flight work gets ``--grace`` seconds and is released, and the process exits 0;
the streams' clients resume where they were on the next server with Last-Event-ID."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from test_http_api import Server


class _Follower:
    """Reads one SSE stream in a thread: its lines, then ``ended`` when it closes."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.headers = headers or {}
        self.lines: list[str] = []
        self.status: int | None = None
        self.error: str | None = None
        self.ended = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            timeout = httpx.Timeout(10, read=120)
            with httpx.stream("GET", self.url, headers=self.headers, timeout=timeout) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    self.lines.append(line)
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.ended.set()

    def messages(self) -> list[dict[str, str]]:
        """The SSE messages read so far (field -> value; comments left out)."""
        out: list[dict[str, str]] = []
        current: dict[str, str] = {}
        for line in list(self.lines):
            if not line:
                if current:
                    out.append(current)
                current = {}
            elif not line.startswith(":"):
                field, _, value = line.partition(":")
                current[field] = value.removeprefix(" ")
        return out


def _wait(check: Any, seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}")


def test_sigterm_ends_open_streams_releases_work_and_exits_0_within_grace(
    tmp_path: Path,
) -> None:
    store = f"sqlite:///{tmp_path / 't.db'}"
    flag, log = tmp_path / "flag", tmp_path / "attempts"
    flag.touch()
    server = Server(store, "--workers", "1", "--grace", "2", "--no-auth")
    base = f"http://127.0.0.1:{server.port}"
    try:
        r = server.http.post("/v1/workflows/approve/runs", json={"input": {"doc": "memo"}})
        waiting = r.json()["id"]
        r = server.http.post(
            "/v1/workflows/holding/runs", json={"input": {"flag": str(flag), "log": str(log)}}
        )
        held = r.json()["id"]
        _wait(lambda: log.exists() and log.read_text() == "1\n", 20, "the step to start")
        events = _Follower(f"{base}/v1/runs/{waiting}/events")
        changes = _Follower(f"{base}/changes")  # the console's runs list
        _wait(lambda: any(m.get("event") == "StatusSet" for m in events.messages()), 20, "events")
        _wait(lambda: changes.lines, 20, "the changes stream to open")
        # a long poll on the waiting run, sent on its own connection; a request on a
        # later connection answered means the server has read it (accepted in order)
        poll = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        poll.sendall(
            f"GET /v1/runs/{waiting}/result?wait=60 HTTP/1.1\r\n"
            f"Host: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
        )
        assert httpx.get(f"{base}/healthz").status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        try:
            rc = server.proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError("tether serve still runs 30 s after SIGTERM (--grace 2)") from None
        assert rc == 0
        assert events.ended.wait(10) and changes.ended.wait(10)
        # the long poll open then is answered "not yet, ask again", not cut off
        answer = b""
        while chunk := poll.recv(65536):
            answer += chunk
        poll.close()
        head = answer.decode().split("\r\n\r\n")[0].lower()
        assert head.startswith("http/1.1 202") and "retry-after: 2" in head, answer
        # each stream ended with a message saying why, not by a dropped connection
        for follower in (events, changes):
            assert follower.error is None, follower.error
            last = follower.messages()[-1]
            assert last.get("event") == "closing", follower.lines[-6:]
            assert "reconnect" in json.loads(last["data"])["reason"]
    finally:
        server.stop()
    seqs = [int(m["id"]) for m in events.messages() if "id" in m]
    # the next server: the stream resumes after the last event received, the held step
    # was handed back (its attempt given back, not used up) and runs again there
    server = Server(store, "--workers", "1", "--grace", "2", "--no-auth")
    base = f"http://127.0.0.1:{server.port}"
    try:
        resumed = _Follower(f"{base}/v1/runs/{waiting}/events", {"Last-Event-ID": str(seqs[-1])})
        _wait(lambda: resumed.lines, 20, "the resumed stream")
        r = server.http.post(f"/v1/runs/{waiting}/signals/review", json={"verdict": "approved"})
        assert r.status_code == 202, r.text
        assert resumed.ended.wait(30), resumed.lines[-6:]
        more = [int(m["id"]) for m in resumed.messages() if "id" in m]
        assert more and more[0] == seqs[-1] + 1 and more == sorted(set(more))
        assert "WorkflowCompleted" in [m.get("event") for m in resumed.messages()]
        flag.unlink()
        r = server.http.get(f"/v1/runs/{held}/result?wait=30")
        assert r.status_code == 200 and r.json()["result"] == "held", r.text
        assert log.read_text() == "1\n1\n"  # released by the stop, not lost to a lease
    finally:
        assert server.stop() == 0


PLAIN_APP = """
import os
import sys

import tether
from tether.server import create_api

app = tether.App(store=os.environ["TETHER_TEST_STORE"])


@app.workflow
async def waiter() -> str:
    return await tether.wait_event("go")


api = create_api(app, workers=1, auth=False, grace=1)
_close = app.close


async def close() -> None:
    await _close()
    print(f"app closed, store {app._store}", file=sys.stderr, flush=True)


app.close = close  # type: ignore[method-assign]
"""


def test_create_api_under_plain_uvicorn_ends_streams_and_closes_the_store_on_sigterm(
    store_url: str, tmp_path: Path
) -> None:
    """``create_api(...)`` served by plain ``uvicorn module:api`` (not ``tether serve``):
    uvicorn waits for open connections before it runs the API's shutdown, and nothing
    told the event streams to end, so one open stream (a console tab) held the process
    on SIGTERM until the client left or the run ended, the workers ran on and the
    store was never closed. The API now sees uvicorn begin to stop: streams end with a
    message to reconnect, the workers stop, the App and its store are closed."""
    import os
    import sys

    (tmp_path / "plain_app.py").write_text(PLAIN_APP)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    src = Path(__file__).parent.parent / "src"
    env = {
        **os.environ,
        "PYTHONPATH": f"{src}{os.pathsep}{tmp_path}",
        "TETHER_TEST_STORE": store_url,
    }
    proc = subprocess.Popen(
        [sys.executable, "-W", "always", "-m", "uvicorn", "plain_app:api", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=30) as http:

            def up() -> bool:
                try:
                    return http.get("/healthz").status_code == 200
                except httpx.TransportError:
                    assert proc.poll() is None, "uvicorn exited"
                    return False

            _wait(up, 30, "uvicorn")
            r = http.post("/v1/workflows/waiter/runs", json={"input": {}, "run_id": "w"})
            assert r.status_code == 202, r.text
        stream = _Follower(f"{base}/v1/runs/w/events")
        _wait(lambda: stream.lines, 20, "the event stream")
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(20)
        assert time.monotonic() - began < 15
        err = proc.stderr.read() if proc.stderr else ""
        assert code == -signal.SIGTERM, (code, err)  # uvicorn raises the signal again
        assert "app closed, store None" in err, err
        assert "Application shutdown complete" in err, err
        for bad in ("Traceback", "Warning", "Exception ignored", "Task was destroyed"):
            assert bad not in err, err
        assert stream.ended.wait(10) and stream.error is None, stream.error
        assert stream.messages()[-1].get("event") == "closing", stream.lines[-6:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def test_tether_serve_exits_after_thread_grace_with_a_stuck_sync_activity(
    store_url: str,
) -> None:
    """``tether serve --workers`` on SIGTERM waited for a sync activity's thread for as
    long as it ran (its in-process workers' stop, then Python joining the thread at
    exit). After ``--thread-grace`` it exits (0) without it, naming it; the step's
    attempt is left to its lease for another worker."""
    server = Server(
        store_url, "--workers", "1", "--grace", "0.5", "--thread-grace", "0.5", "--no-auth"
    )
    try:
        r = server.http.post(
            "/v1/workflows/slow/runs", json={"input": {"seconds": 3600}, "run_id": "stuck"}
        )
        assert r.status_code == 202, r.text
        _wait(lambda: server.http.get("/v1/runs/stuck").json()["waiting_on"], 20, "the activity")
        time.sleep(1.0)  # its thread runs
        began = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(30)
        assert time.monotonic() - began < 20
        err = server.all_stderr()
    finally:
        server.stop()
    assert code == 0, err
    assert "sync activity 'slow_step' of run 'stuck'" in err, err
    assert "exiting with 1 sync activity thread(s) still running (slow_step of run stuck)" in err


def _send_raw(port: int, method: str, path: str, body: dict[str, Any], **headers: str) -> Any:
    """A request on a connection of its own, its answer read later (``_answer``)."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    text = json.dumps(body)
    extra = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    conn.sendall(
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(text)}\r\n"
        f"{extra}\r\n{text}".encode()
    )
    return conn


def _answer(conn: Any) -> tuple[str, str]:
    answer = b""
    while chunk := conn.recv(65536):
        answer += chunk
    conn.close()
    head, _, body = answer.decode().partition("\r\n\r\n")
    return head.lower(), body


def test_an_update_waiting_when_the_server_stops_is_answered_202_and_applies_once(
    tmp_path: Path,
) -> None:
    """The update was recorded; the server stopped before it applied (its workers went):
    the waiting request is told so (202, as for a wait that ran out), not a bare 500, and
    a retry with its Idempotency-Key on the next server applies it once."""
    store = f"sqlite:///{tmp_path / 't.db'}"
    server = Server(store, "--workers", "0", "--grace", "5", "--no-auth")
    try:
        run_id = server.http.post(
            "/v1/workflows/counter/runs", json={"input": {"start": 0}}
        ).json()["id"]
        url = f"/v1/runs/{run_id}/updates/add"
        waiting = _send_raw(
            server.port, "POST", url, {"args": [5], "timeout": 60}, Idempotency_Key="add-5"
        )
        op = "/v1/entities/Tally/t9/operations/add"
        operation = _send_raw(
            server.port, "POST", op, {"args": [3], "timeout": 60}, Idempotency_Key="op-3"
        )

        def recorded(run: str, key: str) -> bool:
            r = server.http.get(f"/v1/runs/{run}/history")
            events = r.json()["events"] if r.status_code == 200 else []
            return any(e["data"].get("signal_id") == key for e in events)

        _wait(lambda: recorded(run_id, "add-5"), 20, "the update to be recorded")
        _wait(lambda: recorded("entity:Tally:t9", "op-3"), 20, "the operation to be recorded")
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        for conn, what in ((waiting, "id"), (operation, "entity")):
            head, body = _answer(conn)
            assert head.startswith("http/1.1 202"), (head, body)
            assert "retry-after" in head
            answer = json.loads(body)
            assert what in answer and answer["status"] == "accepted"
            assert "stopping" in answer["detail"]
    finally:
        server.stop()
    again = Server(store, "--workers", "1", "--no-auth")
    try:
        retry = again.http.post(url, json={"args": [5]}, headers={"Idempotency-Key": "add-5"})
        assert retry.status_code == 200, retry.text
        assert retry.json()["result"] == 5
        total = again.http.post(f"/v1/runs/{run_id}/queries/total", json={"args": []})
        assert total.json()["result"] == 5  # applied once
        events = again.http.get(f"/v1/runs/{run_id}/history").json()["events"]
        assert [e["data"].get("signal_id") for e in events if e["type"] == "SignalReceived"] == [
            "add-5"
        ]
        same = again.http.post(op, json={"args": [3]}, headers={"Idempotency-Key": "op-3"})
        assert same.status_code == 200 and same.json()["result"] == 3, same.text
        assert again.http.get("/v1/entities/Tally/t9").json() == {"n": 3}
    finally:
        again.stop()


def test_an_update_whose_store_write_outlasts_grace_is_answered_503_with_retry_after(
    tmp_path: Path,
) -> None:
    """The update's write waits for the store (another process holds SQLite's write
    lock) past ``--grace``: uvicorn cancels the request, which answered its bare
    ``500 Internal Server Error``. It is now a ``503`` problem with Retry-After, as
    other store failures are (it may or may not have taken effect: send it again with
    its Idempotency-Key)."""
    import sqlite3

    db = tmp_path / "t.db"
    store = f"sqlite:///{db}"
    server = Server(store, "--workers", "0", "--grace", "1", "--no-auth")
    lock = None
    try:
        run_id = server.http.post(
            "/v1/workflows/counter/runs", json={"input": {"start": 0}}
        ).json()["id"]
        lock = sqlite3.connect(db, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # the store's writes wait (its busy timeout: 30 s)
        url = f"/v1/runs/{run_id}/updates/add"
        waiting = _send_raw(
            server.port, "POST", url, {"args": [5], "timeout": 60}, Idempotency_Key="add-5"
        )
        time.sleep(1.0)  # the request is read and waits on the write
        server.proc.send_signal(signal.SIGTERM)
        head, body = _answer(waiting)  # answered when the grace is over
        lock.rollback()
        lock.close()
        lock = None
        assert server.proc.wait(30) == 0
        assert head.startswith("http/1.1 503"), (head, body)
        assert "retry-after: 2" in head, head
        assert "application/problem+json" in head, head
        answer = json.loads(body)
        assert answer["status"] == 503
        assert "Idempotency-Key" in answer["detail"], answer
    finally:
        if lock is not None:
            lock.rollback()
            lock.close()
        server.stop()
