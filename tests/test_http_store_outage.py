"""``tether serve`` through a PostgreSQL outage, against a real server process: an
event stream open when the store goes away ends with a message to reconnect (never a
cut response or a traceback), and a server started while the database is down serves
503s until it can open the store, then everything, without a restart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from conftest import PG_URL, PgProxy, require_pg, with_schema
from test_http_api import Server
from test_http_shutdown import _Follower, _wait

HERE = Path(__file__).parent


def _proxied(schema: str) -> tuple[PgProxy, str]:
    """A proxy to the test PostgreSQL and the store URL that goes through it."""
    up = urlsplit(PG_URL)
    proxy = PgProxy(up.hostname or "127.0.0.1", up.port or 5432)
    url = PG_URL.replace(up.netloc, f"{up.username}@127.0.0.1:{proxy.port}")
    return proxy, with_schema(url, schema)


def _err(server: Server) -> str:
    server.proc.terminate()
    server.proc.wait(60)
    return server.all_stderr()


def _ok(server: Server, path: str, seconds: float = 30) -> httpx.Response:
    """``path``'s first answer other than a 503 (the store reconnects), within ``seconds``."""

    def answered() -> httpx.Response | None:
        r = server.http.get(path)
        return r if r.status_code != 503 else None

    answer: httpx.Response = _wait(answered, seconds, f"{path} to answer without a 503")
    return answer


def test_an_event_stream_open_when_the_store_goes_away_ends_cleanly_and_resumes(
    pg_schema: str,
) -> None:
    proxy, url = _proxied(pg_schema)
    server = Server(url, "--workers", "1", "--no-auth")
    base = f"http://127.0.0.1:{server.port}"
    try:
        r = server.http.post("/v1/workflows/approve/runs", json={"input": {"doc": "memo"}})
        assert r.status_code == 202, r.text
        run_id = r.json()["id"]
        events = _Follower(f"{base}/v1/runs/{run_id}/events")
        _wait(lambda: any(m.get("event") == "StatusSet" for m in events.messages()), 20, "events")
        proxy.down()  # the database goes away under the open stream
        assert events.ended.wait(30), events.lines[-6:]
        # the stream ended with a message saying why and when to come back, not cut off
        assert events.error is None, events.error
        assert events.status == 200
        last = events.messages()[-1]
        assert last.get("event") == "closing", events.lines[-6:]
        assert last.get("retry") == "2000", events.lines[-6:]
        reason = json.loads(last["data"])["reason"]
        assert reason.startswith("store unavailable") and "Last-Event-ID" in reason, reason
        assert "postgresql" not in "\n".join(events.lines)  # never the store's URL
        seqs = [int(m["id"]) for m in events.messages() if "id" in m]
        assert seqs and seqs == sorted(set(seqs))

        proxy.back()  # the database is back: the client reconnects where it was
        _ok(server, f"/v1/runs/{run_id}")
        resumed = _Follower(f"{base}/v1/runs/{run_id}/events", {"Last-Event-ID": str(seqs[-1])})
        _wait(lambda: resumed.lines, 20, "the resumed stream")
        r = server.http.post(f"/v1/runs/{run_id}/signals/review", json={"verdict": "approved"})
        assert r.status_code == 202, r.text
        assert resumed.ended.wait(30), resumed.lines[-6:]
        assert resumed.error is None and resumed.status == 200, (resumed.error, resumed.status)
        more = [int(m["id"]) for m in resumed.messages() if "id" in m]
        # no gap, no event twice
        assert more and more[0] == seqs[-1] + 1 and more == list(range(more[0], more[-1] + 1))
        assert "WorkflowCompleted" in [m.get("event") for m in resumed.messages()]
    finally:
        err = _err(server)
        proxy.shut()
    assert "Exception in ASGI application" not in err, err
    assert "Traceback" not in err, err
    # one warning for the stream, naming the run, with the store's whole message
    ended = [line for line in err.splitlines() if "event stream" in line]
    assert len(ended) == 1 and run_id in ended[0] and "127.0.0.1" in ended[0], err


def test_a_server_started_while_the_database_is_down_serves_once_it_is_up(
    pg_schema: str,
) -> None:
    proxy, url = _proxied(pg_schema)
    proxy.down()  # the database is down (connections refused) when the server starts
    began = time.monotonic()
    server = Server(url, "--workers", "1", "--no-auth")
    try:
        assert server.proc.poll() is None
        assert server.http.get("/healthz").status_code == 200
        r = server.http.get("/readyz")
        assert r.status_code == 503 and r.json()["title"] == "Store not ready", r.text
        assert r.headers["retry-after"] == "2"
        assert "postgresql" not in r.text and str(proxy.port) not in r.text, r.text
        for path in ("/v1/runs/nope", "/v1/runs", "/v1/approvals"):
            r = server.http.get(path)
            assert r.status_code == 503, (path, r.text)
            assert r.headers["content-type"] == "application/problem+json"
            assert r.headers["retry-after"] == "2" and r.json()["title"] == "Store unavailable"
            assert "postgresql" not in r.text and str(proxy.port) not in r.text, r.text
        r = server.http.post("/v1/workflows/bill/runs", json=_INVOICE)
        assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
        time.sleep(3)  # a few attempts more

        proxy.back()  # the database is up: no restart needed
        assert _ok(server, "/readyz", 30).json()["status"] == "ready"
        r = server.http.post("/v1/workflows/bill/runs", json=_INVOICE)
        assert r.status_code == 202, r.text
        # the in-process worker started once the store opened: the run completes
        done = server.http.get(f"/v1/runs/{r.json()['id']}/result", params={"wait": 30})
        assert done.status_code == 200 and done.json()["result"]["total"] == 1100, done.text
    finally:
        err = _err(server)
        proxy.shut()
    elapsed = time.monotonic() - began
    assert "Traceback" not in err and "Application startup failed" not in err, err
    tries = [line for line in err.splitlines() if "cannot open the store" in line]
    # one line per attempt, attempts a second or more apart (backing off)
    assert 2 <= len(tries) <= elapsed + 1, err
    assert "store opened" in err, err
    # nothing tried to open the store on the server's loop: each 503 said it is not open
    # (logged at most every few seconds, the rest counted)
    logged = [line for line in err.splitlines() if "store unavailable (" in line]
    assert logged and all("the store is not open yet" in line for line in logged), err


_INVOICE: dict[str, Any] = {"input": {"invoice": {"number": "A-1", "cents": 1000}, "vat": 0.1}}


@pytest.mark.parametrize("where", ["a-directory", "in-a-missing-directory"])
def test_a_server_on_a_sqlite_path_it_cannot_open_still_fails_at_once(
    tmp_path: Path, where: str
) -> None:
    # not an outage: a SQLite path that cannot be opened (a directory, or a file in a
    # directory that does not exist) is the setup's fault, and waiting would not mend it;
    # said in the one line `tether worker` says it in, before the server starts
    path = tmp_path if where == "a-directory" else tmp_path / "missing" / "t.db"
    code, err, _ = _serve(f"sqlite:///{path}")
    assert code == 3, err
    assert err.strip() == _worker_says(f"sqlite:///{path}"), err


def _worker_says(store: str) -> str:
    """What ``tether worker`` says (one line) on a store it cannot open."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}",
        "TETHER_TEST_STORE": store,
    }
    done = subprocess.run(
        [sys.executable, "-m", "tether.cli", "worker", "serve_app:app"],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and done.stderr.startswith("error: "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr.strip()


async def test_a_changes_stream_whose_look_up_fails_ends_with_a_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import tether
    from tether._errors import StoreError
    from tether.server._stream import STORE_UNAVAILABLE, EventHub

    hub = EventHub(tether.App(store=":memory:"))

    class _Request:
        async def is_disconnected(self) -> bool:
            return False

    async def sees(_runs: set[str]) -> bool:
        raise StoreError("lost the connection to postgresql://db.internal/tether")

    stream = hub.changes(_Request(), sees)  # type: ignore[arg-type]
    assert await anext(stream) == ": following\n\n"
    hub._wake({"r1"})  # a commit touched a run: the follower's look-up fails
    assert await anext(stream) == STORE_UNAVAILABLE
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert not hub._watching
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "db.internal" in warned[0].getMessage()
    data = json.loads(STORE_UNAVAILABLE.split("data: ", 1)[1])
    assert STORE_UNAVAILABLE.startswith("retry: 2000\nevent: closing\n")
    assert data == {"reason": "store unavailable: reconnect (with Last-Event-ID) to resume"}


def _serve(store: str, seconds: float = 20) -> tuple[int | None, str, float]:
    """``tether serve`` on ``store``: its exit code (None if it still ran after
    ``seconds``: then stopped), its stderr and how long it ran."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}",
        "TETHER_TEST_STORE": store,
    }
    began = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.cli", "serve", "serve_app:app", "--port", "0", "--no-auth"],
        cwd=HERE,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        code: int | None = proc.wait(seconds)
    except subprocess.TimeoutExpired:
        code = None
        proc.terminate()
    _, err = proc.communicate(timeout=60)
    return code, str(err), time.monotonic() - began


def _pg_url(user: str, database: str) -> str:
    up = urlsplit(PG_URL)
    return f"postgresql://{user}@{up.hostname or '127.0.0.1'}:{up.port or 5432}/{database}"


@pytest.mark.parametrize(
    ("user", "database", "says"),
    [
        ("postgres", "no_such_db_tether", "database does not exist"),
        ("no_such_role_tether:s3cret", "test", "role"),
    ],
    ids=["no-such-database", "no-such-role"],
)
def test_a_server_on_a_database_that_can_never_work_stops_at_once_saying_why(
    user: str, database: str, says: str
) -> None:
    # the server answers, and refuses what the URL names: waiting will not mend it
    require_pg()
    code, err, took = _serve(_pg_url(user, database))
    assert code is not None, f"still retrying after {took:.0f} s:\n{err}"
    assert code == 3 and took < 25, (code, took, err)  # the start failed
    cannot = [line for line in err.splitlines() if "cannot open the store" in line]
    assert len(cannot) == 1, err  # said once, not once per attempt
    assert "ERROR" in cannot[0] and "the service does not start" in cannot[0], cannot
    line = cannot[0]
    assert says in line and "waiting will not mend" in line, line
    masked = user.split(":")[0] + (":***" if ":" in user else "")
    assert _pg_url(masked, database) in line, line  # the URL, its password masked
    assert "s3cret" not in err, err
    # no traceback: it ends with the line `tether worker` says it in
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == _worker_says(_pg_url(user, database)), err


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://postgres@127.0.0.1:notaport/test",
        "postgresql://postgres@127.0.0.1/test?bogus=1",
    ],
    ids=["bad-port", "unknown-option"],
)
def test_a_server_on_a_malformed_url_stops_at_once_saying_why(url: str) -> None:
    code, err, took = _serve(url)
    assert code is not None, f"still retrying after {took:.0f} s:\n{err}"
    assert code == 3 and took < 25, (code, took, err)
    cannot = [line for line in err.splitlines() if "cannot open the store" in line]
    assert len(cannot) == 1 and "invalid" in cannot[0], err
    assert "waiting will not mend" in cannot[0], err


def test_a_server_started_while_the_database_is_down_says_when_it_can_never_open() -> None:
    # the server is down at the start (retried), then answers that the database does
    # not exist: /readyz says so (not "opening"), and the log says it once
    require_pg()
    up = urlsplit(PG_URL)
    proxy = PgProxy(up.hostname or "127.0.0.1", up.port or 5432)
    proxy.down()
    server = Server(proxy.url(_pg_url("postgres", "no_such_db_tether")), "--no-auth")
    try:
        r = server.http.get("/readyz")
        assert r.status_code == 503 and r.json()["title"] == "Store not ready", r.text
        time.sleep(1.5)
        proxy.back()

        def refused() -> httpx.Response | None:
            r = server.http.get("/readyz")
            return r if r.json()["title"] != "Store not ready" else None

        r = _wait(refused, 20, "/readyz to say the store cannot be opened")
        assert r.status_code == 503 and r.json()["title"] == "Store cannot be opened", r.text
        detail = r.json()["detail"]
        assert "database does not exist" in detail and "3D000" in detail, detail
        assert "postgresql" not in r.text and str(proxy.port) not in r.text, r.text
        r = server.http.get("/v1/runs")
        assert r.status_code == 503 and "database does not exist" in r.json()["detail"], r.text
        time.sleep(3)  # no more attempts logged
        assert server.proc.poll() is None  # up, saying why it is not ready
    finally:
        err = _err(server)
        proxy.shut()
    assert "Traceback" not in err, err
    never = [line for line in err.splitlines() if "waiting will not mend" in line]
    assert len(never) == 1 and "does not exist" in never[0], err
    assert f"127.0.0.1:{proxy.port}/no_such_db_tether" in never[0], never[0]
    tries = [line for line in err.splitlines() if "cannot open the store (attempt" in line]
    after = err.split(never[0], 1)[1]
    assert tries and "cannot open the store (attempt" not in after, err
