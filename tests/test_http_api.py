"""The HTTP service, as clients meet it: ``tether serve`` in a subprocess, httpx over
a real socket, on both stores."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: the line ``tether serve`` prints once its socket is bound
_LISTENING = re.compile(r" on http://127\.0\.0\.1:(\d+) ")


class Server:
    """A ``tether serve serve_app:app`` subprocess and a client for it.

    It listens on a port the OS chooses as it binds (``--port 0``; the port is read
    from the line ``tether serve`` prints once bound), so two test processes can never
    race for one: a port found free here and passed down could be taken before the
    server bound it, and a readiness probe could then reach another test's server.
    ``port`` asks for one port (a restart on the port a page still follows).
    """

    def __init__(
        self,
        store: str,
        *args: str,
        env: dict[str, str] | None = None,
        port: int = 0,
    ) -> None:
        self.store = store
        env = {
            **os.environ,
            **(env or {}),
            "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}",
            "TETHER_TEST_STORE": store,
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tether.cli",
                "serve",
                "serve_app:app",
                "--port",
                str(port),
                *args,
            ],
            cwd=HERE,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        # stderr is read as it comes (a full pipe would stall the server) and kept
        self._err: list[str] = []
        self._bound = threading.Event()
        self.port = 0
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        if not self._bound.wait(30) or not self.port:
            self.stop()
            raise AssertionError(f"tether serve did not start:\n{self.stderr}")
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.http.get("/v1/workflows")
                return
            except httpx.TransportError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"tether serve did not start:\n{self.stderr}") from None
                time.sleep(0.1)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._err.append(line)
            found = _LISTENING.search(line)
            if found and not self._bound.is_set():
                self.port = int(found.group(1))
                self._bound.set()
        self._bound.set()  # the server exited (before it bound, if no port was read)

    @property
    def stderr(self) -> str:
        """What the server has written to stderr so far."""
        return "".join(self._err)

    def all_stderr(self) -> str:
        """Everything the server wrote to stderr (call once it has exited)."""
        self._reader.join(10)
        return self.stderr

    def stop(self) -> int:
        if hasattr(self, "http"):
            self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)
        finally:
            self._reader.join(10)  # the pipe's end came with the exit
            if self.proc.stderr is not None:
                self.proc.stderr.close()


@pytest.fixture
def server(store_url: str) -> Iterator[Server]:
    s = Server(store_url, "--workers", "1", "--no-auth")
    yield s
    s.stop()


INVOICE: dict[str, Any] = {"input": {"invoice": {"number": "A-1", "cents": 1000}, "vat": 0.1}}


def test_start_answers_202_with_location_and_the_run_completes(server: Server) -> None:
    r = server.http.post("/v1/workflows/bill/runs", json=INVOICE)
    assert r.status_code == 202, r.text
    body = r.json()
    assert r.headers["location"] == f"/v1/runs/{body['id']}" == body["links"]["self"]
    done = server.http.get(f"{body['links']['result']}?wait=20")
    assert done.status_code == 200
    assert done.json()["result"] == {"number": "A-1", "total": 1100}
    run = server.http.get(r.headers["location"]).json()
    assert run["status"] == "completed" and run["workflow"] == "bill"
    history = server.http.get(f"{body['links']['history']}?limit=2").json()
    assert [e["type"] for e in history["events"]][:1] == ["WorkflowStarted"]
    rest = server.http.get(f"{body['links']['history']}?after={history['next_after']}").json()
    assert rest["events"][0]["seq"] == 3 and rest["next_after"] is None


def test_idempotency_key_same_body_same_run_other_body_409(server: Server) -> None:
    headers = {"Idempotency-Key": "order-77"}
    first = server.http.post("/v1/workflows/bill/runs", json=INVOICE, headers=headers)
    again = server.http.post("/v1/workflows/bill/runs", json=INVOICE, headers=headers)
    assert first.status_code == 202 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    other = {"input": {"invoice": {"number": "A-2", "cents": 5}}}
    clash = server.http.post("/v1/workflows/bill/runs", json=other, headers=headers)
    assert clash.status_code == 409
    assert clash.headers["content-type"].startswith("application/problem+json")
    assert "order-77" in clash.json()["detail"]
    assert clash.json()["title"] == "Idempotency-Key reused with another body"
    assert "other input" in clash.json()["detail"]
    # the same input with another deadline: a conflict too (it was 200, the deadline
    # silently dropped), naming the field that differs
    later = server.http.post(
        "/v1/workflows/bill/runs", json={**INVOICE, "deadline": 30}, headers=headers
    )
    assert later.status_code == 409, later.text
    assert "other deadline" in later.json()["detail"]
    # the same body with if_running=reject: refused for that, not for "other input"
    rejected = server.http.post(
        "/v1/workflows/bill/runs", json={**INVOICE, "if_running": "reject"}, headers=headers
    )
    assert rejected.status_code == 409
    assert rejected.json()["title"] == "Idempotency-Key already used"
    assert "if_running='reject'" in rejected.json()["detail"]
    chosen = server.http.post("/v1/workflows/bill/runs", json={**INVOICE, "run_id": "inv-a1"})
    assert chosen.status_code == 202 and chosen.json()["id"] == "inv-a1"


def test_bad_input_is_a_problem_document_naming_the_field(server: Server) -> None:
    r = server.http.post(
        "/v1/workflows/bill/runs", json={"input": {"invoice": {"number": "A-1", "cents": "x"}}}
    )
    assert r.status_code == 422
    problem = r.json()
    assert r.headers["content-type"].startswith("application/problem+json")
    assert "invoice.cents" in problem["detail"]
    missing = server.http.get("/v1/runs/no-such-run")
    assert missing.status_code == 404 and "no-such-run" in missing.json()["detail"]
    unknown = server.http.post("/v1/workflows/nope/runs", json={"input": {}})
    assert unknown.status_code in (404, 405)


def test_an_id_or_sequence_too_large_for_the_store_is_a_422_not_a_500(server: Server) -> None:
    """Integers the store cannot hold (above 2**63 - 1) are refused at the edge, naming
    the field; before, they reached the store and came back as a 500."""
    huge = 10**23
    r = server.http.post("/v1/workflows/bill/runs", json=INVOICE)
    run = r.json()["id"]
    for method, url, body in (
        ("GET", f"/v1/dead-letters/{huge}", None),
        ("POST", f"/v1/dead-letters/{huge}/replay", None),
        ("GET", f"/v1/runs/{run}/history?after={huge}", None),
        ("GET", f"/v1/runs/{run}/events?after={huge}", None),
        ("POST", f"/v1/runs/{run}/fork", {"at_step": huge}),
    ):
        res = server.http.request(method, url, json=body)
        assert res.status_code == 422, (url, res.status_code, res.text)
        assert res.headers["content-type"].startswith("application/problem+json")
        assert ("letter_id" if "dead" in url else "after" if "after" in url else "at_step") in (
            res.json()["detail"]
        )
    assert server.http.get("/v1/dead-letters/7").status_code == 404  # in range: not found
    # a resumed event stream with a Last-Event-ID past any seq just waits for newer events
    with server.http.stream(
        "GET", f"/v1/runs/{run}/events", headers={"Last-Event-ID": str(huge)}, timeout=5
    ) as stream:
        assert stream.status_code == 200


def test_a_handled_steps_letter_is_not_replayed_but_resolved_with_a_note(
    server: Server, tmp_path: Path
) -> None:
    """A step whose run caught its failure and completed: replay answers 409 (it would
    repeat the step's side effect) naming the way out; resolve closes it with a note,
    recorded in the run's audit trail; ``?force=true`` runs it anyway."""
    flag = tmp_path / "flag"
    flag.write_text("up")
    letters = []
    for _ in range(2):
        run = server.http.post("/v1/workflows/careful/runs", json={"input": {"flag": str(flag)}})
        done = server.http.get(f"{run.json()['links']['result']}?wait=20").json()
        assert done["result"] == "handled"
        letters += server.http.get(f"/v1/dead-letters?run_id={run.json()['id']}").json()
    first, second = letters
    refused = server.http.post(f"/v1/dead-letters/{first['id']}/replay")
    assert refused.status_code == 409, refused.text
    assert "resolve" in refused.json()["detail"] and "force=True" in refused.json()["detail"]
    assert server.http.post(f"/v1/dead-letters/{first['id']}/resolve", json={}).status_code == 422
    closed = server.http.post(
        f"/v1/dead-letters/{first['id']}/resolve", json={"note": "refunded by hand"}
    )
    assert closed.status_code == 200, closed.text
    assert closed.json()["resolution"] == {
        "state": "resolved",
        "note": "refunded by hand",
        "by": "api (no auth)",
    }
    assert closed.json()["resolved_at"] is not None
    again = server.http.post(f"/v1/dead-letters/{first['id']}/resolve", json={"note": "x"})
    assert again.status_code == 409
    trail = server.http.get(f"/v1/runs/{first['run_id']}/audit").json()
    assert [e["detail"] for e in trail if e["action"] == "resolve dead letter"] == [
        {"letter": first["id"], "note": "refunded by hand"}
    ]
    missing = server.http.post("/v1/dead-letters/999999/resolve", json={"note": "x"})
    assert missing.status_code == 404
    flag.unlink()
    forced = server.http.post(f"/v1/dead-letters/{second['id']}/replay?force=true")
    assert forced.status_code == 200, forced.text
    assert forced.json()["outcome"] == "fixed"
    assert server.http.get("/v1/dead-letters").json() == []


def test_openapi_shows_each_workflows_input_schema(server: Server) -> None:
    doc = server.http.get("/openapi.json").json()
    assert "/v1/workflows/bill/runs" in doc["paths"]
    schemas = doc["components"]["schemas"]
    assert schemas["BillInput"]["required"] == ["invoice"]
    assert "cents" in schemas["Invoice"]["properties"]
    listed = server.http.get("/v1/workflows").json()
    assert {w["name"] for w in listed} == {
        "bill",
        "batch",
        "approve",
        "slow",
        "review",
        "fragile",
        "patient",
        "counted",
        "booking",
        "counter",
        "holding",
        "again",
        "careful",
        "cart",
    }  # the entity's workflow (entity:Tally) is reached through /v1/entities


def test_signal_result_wait_and_run_control(server: Server) -> None:
    r = server.http.post("/v1/workflows/approve/runs", json={"input": {"doc": "contract"}})
    run = r.json()
    waiting = server.http.get(f"{run['links']['result']}?wait=0.2")
    assert waiting.status_code == 202 and waiting.headers["retry-after"]
    deadline = time.monotonic() + 20
    while not server.http.get(run["links"]["self"]).json()["waiting_on"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    view = server.http.get(run["links"]["self"]).json()
    assert view["custom_status"] == {"stage": "waiting for review"}
    assert view["waiting_on"][0]["kind"] == "signal"
    sent = server.http.post(f"/v1/runs/{run['id']}/signals/review", json={"verdict": "approved"})
    assert sent.status_code == 202
    assert server.http.get(f"{run['links']['result']}?wait=20").json()["result"] == (
        "contract: approved"
    )
    again = server.http.post(f"/v1/runs/{run['id']}/signals/review", json={})
    assert again.status_code == 409  # finished: refused, clearly

    other = server.http.post("/v1/workflows/approve/runs", json={"input": {"doc": "x"}}).json()
    cancelled = server.http.post(f"/v1/runs/{other['id']}/cancel", json={"reason": "no"})
    assert cancelled.status_code == 202
    result = server.http.get(f"{other['links']['result']}?wait=20").json()
    assert result["status"] == "cancelled"

    # fork the completed bill run after its first step: the new run reuses that step
    done = server.http.post("/v1/workflows/bill/runs", json=INVOICE).json()
    assert server.http.get(f"{done['links']['result']}?wait=20").status_code == 200
    forked = server.http.post(f"/v1/runs/{done['id']}/fork", json={"at_step": 1, "run_id": "f1"})
    assert forked.status_code == 202, forked.text
    assert forked.headers["location"] == "/v1/runs/f1"
    again_result = server.http.get("/v1/runs/f1/result?wait=20").json()
    assert again_result["result"] == {"number": "A-1", "total": 1100}
    history = server.http.get("/v1/runs/f1/history").json()["events"]
    started = next(e for e in history if e["type"] == "WorkflowStarted")
    assert started["data"]["forked_from"] == {"run_id": done["id"], "at_step": 1}
    steps = [e for e in history if e["type"] == "ActivityScheduled"]
    assert len(steps) == 1  # the reused step, not run again
    bad = server.http.post(f"/v1/runs/{done['id']}/fork", json={"at_step": -1})
    assert bad.status_code == 422
    # a prompt version for a run no model gateway pinned: refused, saying why
    no_prompts = server.http.post(
        f"/v1/runs/{done['id']}/fork", json={"at_step": 1, "prompts": {"write": "v1"}}
    )
    assert no_prompts.status_code == 400 and "gateway" in no_prompts.json()["detail"]


def test_list_pages_by_cursor_stable_while_runs_are_added(server: Server) -> None:
    for i in range(5):
        server.http.post("/v1/workflows/approve/runs", json={"input": {"doc": f"d{i}"}})
    page = server.http.get("/v1/runs?workflow=approve&limit=2").json()
    seen = [r["id"] for r in page["runs"]]
    server.http.post("/v1/workflows/approve/runs", json={"input": {"doc": "late"}})  # newer
    while page["next_cursor"]:
        page = server.http.get(
            f"/v1/runs?workflow=approve&limit=2&cursor={page['next_cursor']}"
        ).json()
        seen += [r["id"] for r in page["runs"]]
    assert len(seen) == len(set(seen)) == 5  # none twice, none skipped, the late one not
    bad = server.http.get("/v1/runs?cursor=garbage")
    assert bad.status_code == 400


def test_sigterm_stops_gracefully_and_loses_nothing(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 't.db'}"
    first = Server(store, "--workers", "1", "--grace", "10", "--no-auth")
    r = first.http.post("/v1/workflows/slow/runs", json={"input": {"seconds": 1.0}})
    rid = r.json()["id"]
    time.sleep(0.3)  # the step is running
    assert first.stop() == 0  # SIGTERM: the in-flight step finishes, the server exits 0
    second = Server(store, "--workers", "1", "--no-auth")
    try:
        got = second.http.get(f"/v1/runs/{rid}/result?wait=20").json()
        assert got["result"] == "slow done"
    finally:
        second.stop()


def _read_sse(lines: Any, until: str) -> list[tuple[int, str]]:
    """(id, event) of SSE messages read from ``lines`` until an event named ``until``."""
    out: list[tuple[int, str]] = []
    msg: dict[str, str] = {}
    for line in lines:
        if line == "":
            if "event" in msg and "id" in msg:
                out.append((int(msg["id"]), msg["event"]))
                if msg["event"] == until:
                    return out
            msg = {}
        elif not line.startswith(":"):
            field, _, value = line.partition(": ")
            msg[field] = value
    return out


def test_events_stream_as_sse_and_resume_from_last_event_id(server: Server) -> None:
    run = server.http.post("/v1/workflows/approve/runs", json={"input": {"doc": "d"}}).json()
    url = f"/v1/runs/{run['id']}/events"
    with server.http.stream("GET", url) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        first = _read_sse(lines, "WorkflowTaskCompleted")
        assert first[0] == (1, "WorkflowStarted")
        server.http.post(f"/v1/runs/{run['id']}/signals/review", json={"verdict": "ok"})
        rest = _read_sse(lines, "WorkflowCompleted")
    seen = first + rest
    assert [s for s, _ in seen] == sorted({s for s, _ in seen})  # in order, once each
    assert ("SignalReceived" in {e for _, e in rest}) and rest[-1][1] == "WorkflowCompleted"
    # reconnecting with Last-Event-ID sends only what came after it, and ends with the run
    last = first[-1][0]
    again = server.http.get(url, headers={"Last-Event-ID": str(last)})
    ids = [int(line[4:]) for line in again.text.splitlines() if line.startswith("id: ")]
    assert ids and min(ids) == last + 1
    missing = server.http.get("/v1/runs/nope/events")
    assert missing.status_code == 404


def _create_key(store: str, *args: str) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "tether.cli", "keys", "create", "--store", store, *args],
        env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "shown once" in res.stderr
    return res.stdout.strip()


def test_approvals_are_listed_and_decided_over_http(server: Server) -> None:
    http = server.http
    run = http.post("/v1/workflows/review/runs", json={"input": {"title": "Q3"}}).json()
    deadline = time.monotonic() + 20
    while not (listed := http.get("/v1/approvals", params={"approver": "ann"}).json()):
        assert time.monotonic() < deadline, "the review never opened"
        time.sleep(0.05)
    review = listed[0]
    assert review["run_id"] == run["id"] and review["proposal"] == {"title": "Q3"}
    assert http.get("/v1/approvals", params={"approver": "bo"}).json() == []
    bogus = http.get("/v1/approvals", params={"status": "bogus"})
    assert bogus.status_code == 400 and "expired_rejected" in bogus.json()["detail"]
    # a review with a decision on its way to the run reads "deciding": listed by it too
    assert http.get("/v1/approvals", params={"status": "deciding"}).json() == []
    one = http.get(f"/v1/approvals/{review['approval_id']}").json()
    assert one["fingerprint"] == review["fingerprint"]
    assert http.get("/v1/approvals/nope:1").status_code == 404
    decide = f"/v1/approvals/{review['approval_id']}/decision"
    wrong = http.post(decide, json={"approve": True, "by": "ann", "fingerprint": "x"})
    assert wrong.status_code == 409 and "fingerprint" in wrong.json()["detail"]
    missing = http.post(decide, json={"approve": True, "fingerprint": review["fingerprint"]})
    assert missing.status_code == 422 and "by" in str(missing.json())
    stranger = {"approve": True, "by": "mallory", "fingerprint": review["fingerprint"]}
    refused = http.post(decide, json=stranger)  # recorded and refused: the caller is told
    assert refused.status_code == 409 and "not among its approvers" in refused.json()["detail"]
    # an edit not of the proposal's shape (an object): refused at once, nothing recorded
    shape = {"approve": True, "by": "ann", "fingerprint": review["fingerprint"], "value": "Q3"}
    malformed = http.post(decide, json=shape)
    assert malformed.status_code == 422, malformed.text
    assert "must be an object" in malformed.json()["detail"]
    assert http.get(f"/v1/approvals/{review['approval_id']}").json()["status"] == "open"
    ok = http.post(
        decide,
        json={
            "approve": True,
            "by": "ann",
            "fingerprint": review["fingerprint"],
            "value": {"title": "Q3 final"},
        },
    )
    assert ok.status_code == 202, ok.text
    result = http.get(f"{run['links']['result']}?wait=20").json()
    assert result["result"] == "Q3 final approved by ann"
    assert http.get(f"/v1/approvals/{review['approval_id']}").json()["status"] == "approved"
    again = http.post(decide, json={"approve": False, "by": "ann", "fingerprint": "x"})
    assert again.status_code == 409 and "no longer open" in again.json()["detail"]


def test_api_keys_scope_a_client_to_its_tenant(store_url: str) -> None:
    import tether

    tether.App(store=store_url).store.close_sync()  # type: ignore[attr-defined]  # the store
    acme = _create_key(store_url, "--role", "operate", "--tenant", "acme", "--name", "acme app")
    globex = _create_key(store_url, "--role", "operate", "--tenant", "globex")
    admin = _create_key(store_url, "--role", "admin")
    viewer = _create_key(store_url, "--role", "read", "--tenant", "acme")
    monitor = _create_key(store_url, "--role", "monitor", "--tenant", "acme")
    watcher = _create_key(store_url, "--role", "monitor")  # scrapes the metrics
    server = Server(store_url, "--workers", "1")  # keys exist: required from start-up
    try:
        http = server.http
        anonymous = http.post("/v1/workflows/bill/runs", json=INVOICE)
        assert anonymous.status_code == 401
        assert anonymous.headers["www-authenticate"] == "Bearer"
        assert "tether keys create" in anonymous.json()["detail"]
        wrong = http.get("/v1/runs", headers={"Authorization": f"Bearer {acme}x"})
        assert wrong.status_code == 401

        def as_(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        mine = http.post("/v1/workflows/bill/runs", json=INVOICE, headers=as_(acme)).json()
        got = http.get(f"{mine['links']['result']}?wait=20", headers=as_(acme)).json()
        assert got["result"]["total"] == 1100
        assert http.get(mine["links"]["self"], headers=as_(acme)).json()["tenant"] == "acme"
        # a monitor key sees the run, its steps and times, never what it carries
        seen = http.get(mine["links"]["self"], headers=as_(monitor)).json()
        assert seen["status"] == "completed" and seen["result"] == "[withheld]"
        for path in ("history", "events"):
            full = http.get(f"{mine['links']['self']}/{path}", headers=as_(viewer)).text
            bare = http.get(f"{mine['links']['self']}/{path}", headers=as_(monitor)).text
            assert "A-1" in full and "1100" in full
            assert "A-1" not in bare and "1100" not in bare and "[withheld]" in bare
            assert "ActivityCompleted" in bare  # the steps are there
        listed = http.get("/v1/runs", headers=as_(monitor)).json()["runs"]
        assert [r["result"] for r in listed] == ["[withheld]"]
        got_bare = http.get(mine["links"]["result"], headers=as_(monitor)).json()
        assert got_bare["status"] == "completed" and got_bare["result"] == "[withheld]"
        assert (
            http.post("/v1/workflows/bill/runs", json=INVOICE, headers=as_(monitor)).status_code
            == 403
        )
        console = http.post("/login", data={"key": monitor, "next": "/"})
        assert console.status_code == 401 and "monitor key" in console.text.lower()
        # another tenant's key does not see it, cannot signal it, does not list it
        assert http.get(mine["links"]["self"], headers=as_(globex)).status_code == 404
        sig = http.post(f"/v1/runs/{mine['id']}/signals/x", json={}, headers=as_(globex))
        assert sig.status_code == 404
        assert http.get("/v1/runs", headers=as_(globex)).json()["runs"] == []
        assert [r["id"] for r in http.get("/v1/runs", headers=as_(acme)).json()["runs"]] == [
            mine["id"]
        ]
        other = {**INVOICE, "tenant": "globex"}
        assert (
            http.post("/v1/workflows/bill/runs", json=other, headers=as_(acme)).status_code == 403
        )
        # roles: a read key looks but cannot act; operate cannot terminate; admin can
        waiting = http.post(
            "/v1/workflows/approve/runs", json={"input": {"doc": "d"}}, headers=as_(acme)
        ).json()
        run_url = f"/v1/runs/{waiting['id']}"
        assert http.get(run_url, headers=as_(viewer)).status_code == 200
        for action in ("cancel", "suspend", "signals/review"):
            refused = http.post(f"{run_url}/{action}", json={}, headers=as_(viewer))
            assert refused.status_code == 403, (action, refused.text)
        assert "role operate" in refused.json()["detail"]
        started = http.post("/v1/workflows/bill/runs", json=INVOICE, headers=as_(viewer))
        assert started.status_code == 403
        assert http.post(f"{run_url}/suspend", headers=as_(acme)).status_code == 202
        assert http.post(f"{run_url}/resume", headers=as_(acme)).status_code == 202
        assert http.post(f"{run_url}/terminate", headers=as_(acme)).status_code == 403
        assert http.post(f"{run_url}/terminate", headers=as_(admin)).status_code == 202
        # another tenant cannot stream, cancel or see the history either
        assert http.get(f"{run_url}/events", headers=as_(globex)).status_code == 404
        assert http.get(f"{run_url}/history", headers=as_(globex)).status_code == 404
        assert http.post(f"{run_url}/cancel", headers=as_(globex)).status_code == 404
        assert len(http.get("/v1/runs", headers=as_(admin)).json()["runs"]) == 2
        assert http.get("/v1/runs?tenant=globex", headers=as_(acme)).json()["runs"] == []
        # the metrics name every tenant (runs, model spend): a tenant's keys may not scrape
        for key in (monitor, acme):
            scrape = http.get("/metrics", headers=as_(key))
            assert scrape.status_code == 403, scrape.text
            assert "bound to no tenant" in scrape.json()["detail"]
        for key in (watcher, admin):  # any role, bound to no tenant
            scrape = http.get("/metrics", headers=as_(key))
            assert scrape.status_code == 200 and "tether_runs" in scrape.text
        # a monitor key for every tenant sees every run, never what it carries
        overview = http.get("/v1/runs", headers=as_(watcher)).json()["runs"]
        assert len(overview) == 2 and {r["result"] for r in overview} == {"[withheld]", None}
        assert http.post(f"{run_url}/cancel", headers=as_(watcher)).status_code == 403
        # a revoked key is refused at once
        key_id = acme[len("tether_") :].split(".")[0]
        res = subprocess.run(
            [sys.executable, "-m", "tether.cli", "keys", "revoke", key_id, "--store", store_url],
            env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        revoked = http.get("/v1/runs", headers=as_(acme))
        assert revoked.status_code == 401 and "revoked" in revoked.json()["detail"]
    finally:
        server.stop()


def test_the_audit_trail_names_who_started_approved_cancelled_and_retried(
    store_url: str, tmp_path: Path
) -> None:
    import tether

    tether.App(store=store_url).store.close_sync()  # type: ignore[attr-defined]  # the store
    intake = _create_key(store_url, "--role", "operate", "--tenant", "acme", "--name", "intake")
    desk = _create_key(store_url, "--role", "operate", "--tenant", "acme", "--name", "desk")
    admin = _create_key(store_url, "--role", "admin", "--name", "oncall")
    flag = tmp_path / "release-broken"
    flag.write_text("up")
    server = Server(store_url, "--workers", "1")
    try:
        http = server.http

        def as_(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        run = http.post(
            "/v1/workflows/booking/runs",
            json={"input": {"title": "Q3 offsite", "flag": str(flag)}},
            headers=as_(intake),
        ).json()
        deadline = time.monotonic() + 20
        while not (reviews := http.get("/v1/approvals", headers=as_(desk)).json()):
            assert time.monotonic() < deadline, "the review never opened"
            time.sleep(0.05)
        decided = http.post(
            f"/v1/approvals/{reviews[0]['approval_id']}/decision",
            json={"approve": True, "by": "ann", "fingerprint": reviews[0]["fingerprint"]},
            headers=as_(desk),
        )
        assert decided.status_code == 202, decided.text

        def waiting_to_ship() -> bool:
            info = http.get(run["links"]["self"], headers=as_(desk)).json()
            return any(w.get("name") == "ship" for w in info.get("waiting_on") or [])

        while not waiting_to_ship():
            assert time.monotonic() < deadline, "the run never waited to ship"
            time.sleep(0.05)
        cancel = http.post(
            f"/v1/runs/{run['id']}/cancel", json={"reason": "offsite moved"}, headers=as_(desk)
        )
        assert cancel.status_code == 202, cancel.text
        # the release (compensation) fails: the run needs an operator
        ended = http.get(f"{run['links']['result']}?wait=20", headers=as_(desk)).json()
        assert ended["status"] == "needs_intervention", ended
        flag.unlink()
        retried = http.post(f"/v1/runs/{run['id']}/retry", headers=as_(admin))
        assert retried.status_code == 202, retried.text
        final = http.get(f"{run['links']['result']}?wait=20", headers=as_(desk)).json()
        assert final["status"] == "cancelled", final
        trail = http.get(f"/v1/runs/{run['id']}/audit", headers=as_(desk)).json()
    finally:
        server.stop()
    # the operator was told the run needed one (logged: the served app has no hook)
    (told,) = [t for t in trail if t["action"] == "alerted"]
    assert told["actor"] == "log" and told["detail"] == {"alert": "needs_intervention"}
    trail = [t for t in trail if t is not told]
    actions = [(t["action"], t["actor"].split(" (")[0]) for t in trail]
    keys = {t["actor"] for t in trail}
    assert [a for a, _ in actions] == ["start", "decide", "cancel", "retry"], trail
    assert len(keys) == 3  # intake started, desk decided and cancelled, oncall retried
    assert actions[1][1] == actions[2][1] != actions[0][1] != actions[3][1]
    assert all(t["actor"].startswith("key ") for t in trail)
    assert trail[1]["detail"]["by"] == "ann" and trail[2]["detail"] == {"reason": "offsite moved"}


async def test_a_stream_sends_the_events_committed_between_its_read_and_the_run_s_end() -> None:
    """The race a fresh-clone run caught on PostgreSQL: the stream read nothing new, the
    run ended (its last events committed) before the stream looked at its status, and
    the stream closed without sending them. It reads once more before it ends."""
    import types

    from tether import EventType
    from tether._history import Event
    from tether.server._stream import EventHub

    last = [
        Event(
            run_id="r",
            seq=7,
            type=EventType.ACTIVITY_COMPLETED,
            step=3,
            data={"attempt": 1, "result": 1},
            created_at=0.0,
        ),
        Event(
            run_id="r",
            seq=8,
            type=EventType.WORKFLOW_COMPLETED,
            step=None,
            data={"result": 1},
            created_at=0.0,
        ),
    ]
    reads: list[int] = []

    async def read_history(run_id: str, after: int) -> list[Event]:
        reads.append(after)
        return [] if len(reads) == 1 else [e for e in last if e.seq > after]

    async def get(run_id: str, follow: bool = True) -> Any:
        return types.SimpleNamespace(is_finished=True, continued_to=None)  # ended meanwhile

    async def is_disconnected() -> bool:
        return False

    app = types.SimpleNamespace(
        store=types.SimpleNamespace(read_history=read_history), get=get, _peek=get
    )
    hub = EventHub(app)  # type: ignore[arg-type]
    request = types.SimpleNamespace(is_disconnected=is_disconnected)
    sent = [m async for m in hub.stream("r", 6, request)]  # type: ignore[arg-type]
    assert [m.split("\n")[1] for m in sent] == [
        "event: ActivityCompleted",
        "event: WorkflowCompleted",
    ]


async def test_a_stream_ends_each_streamed_step_the_run_s_end_cut_off() -> None:
    """A hedge's loser (or a step of a run cancelled) ends after the commit that ends
    its run: the stream ended at once, dropping what came meanwhile, and its followers
    never heard that step end. They now get what came, then ``failed: StepCancelled``
    for each step that sent text and neither ``done`` nor ``failed``."""
    import json
    import types

    from tether import EventType
    from tether._history import Event
    from tether.server._stream import _CUT, EventHub

    end = Event(
        run_id="r",
        seq=8,
        type=EventType.WORKFLOW_COMPLETED,
        step=None,
        data={"result": "b"},
        created_at=0.0,
    )
    reads: list[int] = []
    peeks: list[int] = []
    slow = {"run_id": "r", "step": 2, "model": "slow", "attempt": 1}
    fast = {"run_id": "r", "step": 3, "model": "fast", "attempt": 1}

    async def read_history(run_id: str, after: int) -> list[Event]:
        reads.append(after)
        return [end] if len(reads) == 3 else []

    async def get(run_id: str, follow: bool = True) -> Any:
        peeks.append(1)
        if len(peeks) == 1:  # both calls stream; the fast one answers
            hub._hand("r", {**slow, "offset": 0, "delta": "a"})
            hub._hand("r", {**fast, "offset": 0, "delta": "b"})
            hub._hand("r", {**fast, "done": True})
            return types.SimpleNamespace(is_finished=False, continued_to=None)
        hub._hand("r", {**slow, "offset": 1, "delta": "c"})  # as the run's end commits
        return types.SimpleNamespace(is_finished=True, continued_to=None)

    async def is_disconnected() -> bool:
        return False

    app = types.SimpleNamespace(
        store=types.SimpleNamespace(read_history=read_history), get=get, _peek=get
    )
    hub = EventHub(app)  # type: ignore[arg-type]
    request = types.SimpleNamespace(is_disconnected=is_disconnected)
    sent = [m async for m in hub.stream("r", 7, request)]  # type: ignore[arg-type]
    kinds = [m.split("\n")[1] if m.startswith("id:") else m.split("\n")[0] for m in sent]
    assert kinds == ["event: token"] * 3 + ["event: WorkflowCompleted"] + ["event: token"] * 2
    tokens = [json.loads(m.split("data: ")[1]) for m in sent if m.startswith("event: token")]
    assert tokens[3] == {**slow, "offset": 1, "delta": "c"}  # sent, not dropped
    assert tokens[4] == {**slow, "failed": "StepCancelled", "error": _CUT}  # fast: done


class Tenants:
    """A ``tether serve`` with keys: acme (operate, read, monitor), globex (operate, and
    an admin bound to globex), and an unbound admin."""

    def __init__(self, store: str) -> None:
        import tether

        tether.App(store=store).store.close_sync()  # type: ignore[attr-defined]  # the store
        self.store = store
        self.keys = {
            "acme": _create_key(store, "--role", "operate", "--tenant", "acme"),
            "acme_read": _create_key(store, "--role", "read", "--tenant", "acme"),
            "acme_monitor": _create_key(store, "--role", "monitor", "--tenant", "acme"),
            "globex": _create_key(store, "--role", "operate", "--tenant", "globex"),
            "globex_admin": _create_key(store, "--role", "admin", "--tenant", "globex"),
            "admin": _create_key(store, "--role", "admin"),
        }
        self.server = Server(store, "--workers", "1")
        self.http = self.server.http

    def as_(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}

    def start(self, who: str, workflow: str, body: dict[str, Any], **headers: str) -> Any:
        return self.http.post(
            f"/v1/workflows/{workflow}/runs", json=body, headers={**self.as_(who), **headers}
        )


@pytest.fixture
def tenants(store_url: str) -> Iterator[Tenants]:
    t = Tenants(store_url)
    yield t
    t.server.stop()


def test_a_start_naming_a_purged_run_id_tells_a_tenant_key_nothing(tenants: Tenants) -> None:
    """A tenant's key starting with the id of a purged run (another tenant's, say) is
    answered like a live run of another tenant: an opaque 409, not 410 "was purged at
    <time>" (which told it that run existed and when it went). An unbound key still
    learns it was purged."""
    import asyncio

    import tether

    t = tenants
    theirs = t.start("globex", "bill", {**INVOICE, "run_id": "secret-deal-42"})
    assert theirs.status_code == 202, theirs.text
    done = t.http.get("/v1/runs/secret-deal-42/result?wait=20", headers=t.as_("globex"))
    assert done.status_code == 200, done.text
    app = tether.App(store=t.store)
    try:
        asyncio.run(app.purge(0, tenant="globex"))
    finally:
        app.store.close_sync()  # type: ignore[attr-defined]
    for who in ("acme", "globex"):
        clash = t.start(who, "bill", {**INVOICE, "run_id": "secret-deal-42"})
        assert clash.status_code == 409, clash.text
        detail = clash.json()["detail"]
        assert "purged" not in detail and "retention" not in detail and "globex" not in detail
        assert "secret-deal-42" in detail
    admin = t.start("admin", "bill", {**INVOICE, "run_id": "secret-deal-42"})
    assert admin.status_code == 410 and "purged" in admin.json()["detail"]


def test_a_start_never_reaches_or_reveals_another_tenants_run(tenants: Tenants) -> None:
    """A tenant's key starting with another tenant's run id (or Idempotency-Key) neither
    signals that run nor learns its status, tenant or workflow; before, signal-with-start
    delivered the signal and answered 200 with the run's status."""
    t = tenants
    acme = t.start("acme", "approve", {"input": {"doc": "private"}, "run_id": "job-1"})
    assert acme.status_code == 202, acme.text
    for extra in (
        {"if_running": "signal", "signal": {"name": "review", "payload": {"verdict": "x"}}},
        {"if_running": "return"},
        {"if_running": "reject"},
        {},
    ):
        body = {"input": {"doc": "private"}, "run_id": "job-1", **extra}
        clash = t.start("globex", "approve", body)
        assert clash.status_code == 409, (extra, clash.text)
        detail = clash.json()["detail"]
        assert "acme" not in detail and "approve" not in detail and "private" not in detail
        assert "job-1" in detail
        other_wf = t.start("globex", "bill", {**INVOICE, "run_id": "job-1", **extra})
        if other_wf.status_code != 422:  # bill has no signal named review: still a clash
            assert other_wf.status_code == 409, other_wf.text
            assert "approve" not in other_wf.json()["detail"]
            assert "acme" not in other_wf.json()["detail"]
    # nothing reached acme's run: it still waits for its review
    history = t.http.get("/v1/runs/job-1/history", headers=t.as_("acme")).json()["events"]
    assert not any(e["type"] == "SignalReceived" for e in history), history
    assert t.http.get("/v1/runs/job-1", headers=t.as_("acme")).json()["status"] != "completed"
    # acme's own signal-with-start still reaches it; the admin still learns what clashed
    own = t.start(
        "acme",
        "approve",
        {
            "input": {"doc": "private"},
            "run_id": "job-1",
            "if_running": "signal",
            "signal": {"name": "review", "payload": {"verdict": "ok"}},
        },
    )
    assert own.status_code == 200, own.text
    done = t.http.get("/v1/runs/job-1/result?wait=20", headers=t.as_("acme")).json()
    assert done["result"] == "private: ok"
    admin = t.start("admin", "bill", {**INVOICE, "run_id": "job-1"})
    assert admin.status_code == 409 and "approve" in admin.json()["detail"]
    # Idempotency-Keys are per tenant: the same key makes each tenant its own run
    key = {"Idempotency-Key": "order-9"}
    first = t.start("acme", "bill", INVOICE, **key)
    again = t.start("acme", "bill", INVOICE, **key)
    assert first.status_code == 202 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    theirs = t.start("globex", "bill", INVOICE, **key)
    assert theirs.status_code == 202, theirs.text
    assert theirs.json()["id"] != first.json()["id"]
    other = t.start("globex", "bill", {"input": {"invoice": {"number": "B", "cents": 1}}}, **key)
    assert other.status_code == 409 and first.json()["id"] not in other.json()["detail"]
    assert "acme" not in other.json()["detail"]
    # a run without a tenant keeps the id its key always gave (runs started before)
    from tether.server import _idempotent_run_id

    untenanted = t.start("admin", "bill", INVOICE, **key)
    assert untenanted.json()["id"] == _idempotent_run_id("bill", "order-9", None)
    assert (
        untenanted.json()["id"]
        == "idem-" + __import__("hashlib").sha256(b"bill\0order-9").hexdigest()[:32]
    )


def _wait_until(check: Any, what: str, seconds: float = 20) -> Any:
    deadline = time.monotonic() + seconds
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_tenant_keys_see_only_their_own_letters_switches_audit_schedules_and_reasons(
    tenants: Tenants, tmp_path: Path
) -> None:
    """What belongs to no tenant (switches, the global audit log, schedules, entities) is
    for admin keys bound to no tenant; another tenant's dead letter is as missing as one
    that never was; a monitor key never sees a review's free-text reason. Before, tenant
    keys read the global audit log and every tenant's switch reasons, steered schedules,
    and learnt another tenant's run id from a dead letter's 404."""
    t, http = tenants, tenants.http
    flag = tmp_path / "flag"
    flag.write_text("up")
    run = t.start("acme", "fragile", {"input": {"flag": str(flag)}}).json()
    failed = http.get(f"{run['links']['result']}?wait=20", headers=t.as_("acme")).json()
    assert failed["status"] == "failed"
    letter = http.get(f"/v1/dead-letters?run_id={run['id']}", headers=t.as_("acme")).json()[0]
    missing = http.get("/v1/dead-letters/999999", headers=t.as_("globex"))
    for r in (
        http.get(f"/v1/dead-letters/{letter['id']}", headers=t.as_("globex")),
        http.post(f"/v1/dead-letters/{letter['id']}/replay", headers=t.as_("globex")),
        http.post(
            f"/v1/dead-letters/{letter['id']}/resolve", json={"note": "x"}, headers=t.as_("globex")
        ),
    ):
        assert r.status_code == 404 and r.json()["title"] == missing.json()["title"]
        assert run["id"] not in r.text
        assert r.json()["detail"] == missing.json()["detail"].replace("999999", str(letter["id"]))
    assert http.get(f"/v1/dead-letters/{letter['id']}", headers=t.as_("acme")).status_code == 200
    read_only = http.post(
        f"/v1/dead-letters/{letter['id']}/resolve", json={"note": "x"}, headers=t.as_("acme_read")
    )
    assert read_only.status_code == 403  # resolving is for operate keys and above
    # switches: each tenant's key sees its own tenant's switch only; flipping is global
    for tenant in ("acme", "initech"):
        off = http.put(
            f"/v1/switches/tenant/{tenant}",
            json={"reason": f"{tenant} unpaid invoice"},
            headers=t.as_("admin"),
        )
        assert off.status_code == 200, off.text
    assert {s["name"] for s in http.get("/v1/switches", headers=t.as_("admin")).json()} == {
        "acme",
        "initech",
    }
    seen = http.get("/v1/switches", headers=t.as_("acme_read")).json()
    assert [(s["name"], s["reason"]) for s in seen] == [("acme", "acme unpaid invoice")]
    bare = http.get("/v1/switches", headers=t.as_("acme_monitor")).json()
    assert [(s["name"], s["reason"]) for s in bare] == [("acme", "[withheld]")]
    assert http.get("/v1/switches", headers=t.as_("globex")).json() == []
    for who in ("acme", "globex_admin"):
        for method, path in (
            ("PUT", "/v1/switches/tenant/acme"),
            ("DELETE", "/v1/switches/tenant/initech"),
            ("PUT", "/v1/switches/tenant/globex"),
            ("GET", "/v1/audit"),
        ):
            refused = http.request(method, path, json={}, headers=t.as_(who))
            assert refused.status_code == 403, (who, path, refused.text)
    assert "not bound to a tenant" in refused.json()["detail"]
    audit = http.get("/v1/audit", headers=t.as_("admin"))
    assert audit.status_code == 200 and "unpaid" in audit.text
    for tenant in ("acme", "initech"):
        http.delete(f"/v1/switches/tenant/{tenant}", headers=t.as_("admin"))
    # the console's switches page: the same rule (no global audit log for a tenant key)
    with httpx.Client(base_url=str(http.base_url), timeout=30) as console:
        assert console.post("/login", data={"key": t.keys["acme"]}).status_code in (200, 303)
        page = console.get("/switches")
        assert page.status_code == 200 and "initech" not in page.text
    # schedules belong to no tenant: admin keys bound to no tenant
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
            '{"number": "S-1", "cents": 5}',
            "0.1",
            "--cron",
            "0 2 * * *",
        ],
        cwd=HERE,
        env={
            **os.environ,
            "TETHER_TEST_STORE": t.store,
            "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert created.returncode == 0, created.stderr
    for who in ("acme_read", "acme", "globex_admin"):
        for method, path in (
            ("GET", "/v1/schedules"),
            ("GET", "/v1/schedules/nightly"),
            ("POST", "/v1/schedules/nightly/pause"),
            ("POST", "/v1/schedules/nightly/trigger"),
            ("GET", "/v1/entities/Tally"),
        ):
            refused = http.request(method, path, headers=t.as_(who))
            assert refused.status_code == 403, (who, path, refused.text)
            assert "S-1" not in refused.text
    assert http.get("/v1/schedules/nightly", headers=t.as_("admin")).json()["paused"] is False
    assert http.post("/v1/schedules/nightly/pause", headers=t.as_("admin")).status_code == 200
    # a review's free-text reason is withheld from a monitor key, like its proposal
    review = t.start("acme", "review", {"input": {"title": "Q3"}}).json()
    opened = _wait_until(
        lambda: http.get("/v1/approvals", headers=t.as_("acme")).json(), "the review"
    )[0]
    # another tenant deciding it in the console learns nothing of it (before: a 404
    # naming acme's run id)
    with httpx.Client(base_url=str(http.base_url), timeout=30) as console:
        console.post("/login", data={"key": t.keys["globex"]})
        token = re.search(r'name="csrf" value="([^"]+)"', console.get("/").text)
        assert token is not None
        foreign = console.post(
            f"/approvals/{opened['approval_id']}",
            data={"csrf": token.group(1), "decision": "approve", "by": "ann"},
        )
        assert foreign.status_code == 404
        # as for a review that never was (its id is the caller's own words)
        assert foreign.json()["title"] == "No such review"
        assert foreign.json()["detail"] == f"approval {opened['approval_id']!r}: no such review"
    decided = http.post(
        f"/v1/approvals/{opened['approval_id']}/decision",
        json={
            "approve": False,
            "by": "ann",
            "fingerprint": opened["fingerprint"],
            "reason": "private: budget cut",
        },
        headers=t.as_("acme"),
    )
    assert decided.status_code == 202, decided.text
    http.get(f"{review['links']['result']}?wait=20", headers=t.as_("acme"))
    one = f"/v1/approvals/{opened['approval_id']}"
    assert http.get(one, headers=t.as_("acme_read")).json()["reason"] == "private: budget cut"
    assert http.get(one, headers=t.as_("acme_monitor")).json()["reason"] == "[withheld]"
    listed = http.get("/v1/approvals?status=all", headers=t.as_("acme_monitor")).json()
    assert [r["reason"] for r in listed] == ["[withheld]"]


def test_a_child_run_is_reached_by_its_links_in_the_api_and_the_console(server: Server) -> None:
    """A child's id holds a slash (``parent/1``); before, every route of such a run was a
    route 404 (its own ``links.self`` too) and the console's link to it 404ed."""
    http = server.http
    parent = http.post("/v1/workflows/batch/runs", json={"input": {"number": "C-1"}}).json()
    done = http.get(f"{parent['links']['result']}?wait=20").json()
    assert done["result"] == {"number": "C-1", "total": 100}, done
    history = http.get(parent["links"]["history"]).json()["events"]
    child_id = next(e["data"]["child_run_id"] for e in history if e["type"] == "ChildStarted")
    assert child_id == f"{parent['id']}/1"
    listed = http.get("/v1/runs", params={"workflow": "bill"}).json()["runs"]
    child = next(r for r in listed if r["id"] == child_id)
    for url in (child["links"]["self"], f"/v1/runs/{child_id}"):  # %2F or a plain slash
        got = http.get(url)
        assert got.status_code == 200, (url, got.text)
        assert got.json()["id"] == child_id and got.json()["parent_run_id"] == parent["id"]
    result = http.get(child["links"]["result"]).json()
    assert result["id"] == child_id and result["result"] == {"number": "C-1", "total": 100}
    assert http.get(child["links"]["history"]).json()["run_id"] == child_id
    assert "WorkflowCompleted" in http.get(child["links"]["events"]).text
    assert http.get(f"/v1/runs/{child_id}/audit").status_code == 200
    assert http.get(f"/v1/runs/{child_id}/webhooks").json() == []
    # a suffix route still wins over a longer run id: a signal to the (ended) child
    ended = http.post(f"/v1/runs/{child_id}/signals/go", json={})
    assert ended.status_code == 409 and "finished" in ended.json()["detail"], ended.text
    cancel = http.post(f"{child['links']['self']}/cancel", json={})
    assert cancel.status_code in (202, 409) and child_id in cancel.text, cancel.text
    assert http.get(f"/v1/runs/{child_id}/nope").status_code == 404
    # the console: the parent's page links the child, whose page shows it
    page = http.get(f"/runs/{parent['id']}")
    assert page.status_code == 200 and f'href="/runs/{child_id}"' in page.text
    child_page = http.get(f"/runs/{child_id}")
    assert child_page.status_code == 200 and "C-1" in child_page.text
    assert f'Parent: <a href="/runs/{parent["id"]}">' in child_page.text
    csrf = re.search(r'name="csrf" value="([^"]+)"', child_page.text)
    assert csrf is not None
    acted = http.post(
        f"/runs/{child_id}/act",
        data={"csrf": csrf.group(1), "action": "cancel"},
        follow_redirects=False,
    )
    assert acted.status_code in (303, 409), acted.text  # the child's action, not a miss
    if acted.status_code == 303:
        assert acted.headers["location"].startswith(f"/runs/{child_id}?")
    else:
        assert child_id in acted.json()["detail"]


def test_odd_headers_cursors_and_form_bodies_are_4xx_not_500(server: Server) -> None:
    """A Last-Event-ID that str.isdigit() takes but int() refuses, a console cursor that
    is not one it gave out, and a sign-in or sign-out form that is not UTF-8 were 500s."""
    http = server.http
    run = http.post("/v1/workflows/bill/runs", json=INVOICE).json()
    http.get(f"{run['links']['result']}?wait=20")
    odd = http.get(run["links"]["events"], headers={"Last-Event-ID": b"\xb2"})  # ² in Latin-1
    assert odd.status_code == 400, odd.text
    assert "Last-Event-ID" in odd.json()["detail"]
    page = http.get("/runs", params={"cursor": "garbage"})
    assert page.status_code == 200 and "not one this page gave out" in page.text
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    for path in ("/login", "/logout"):
        bad = http.post(path, content=b"key=\xff\xfe", headers=form)
        assert bad.status_code == 400, (path, bad.status_code, bad.text)
        assert "UTF-8" in bad.text


def test_a_body_that_is_not_utf8_json_is_refused_clearly_and_records_nothing(
    server: Server,
) -> None:
    """``curl -d '{...}'`` sends JSON as a form: a signal recorded the raw bytes' failure
    as "does not match the workflow's parameters"; a non-UTF-8 body got "There was an
    error parsing the body". Both now name what to send; nothing is recorded."""
    http = server.http
    run = http.post("/v1/workflows/approve/runs", json={"input": {"doc": "memo"}}).json()
    deadline = time.monotonic() + 20
    while not http.get(run["links"]["self"]).json()["waiting_on"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    signal_path = f"/v1/runs/{run['id']}/signals/review"
    recorded = len(http.get(f"/v1/runs/{run['id']}/history").json()["events"])
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    as_form = http.post(signal_path, content=b'{"verdict": "approved"}', headers=form)
    assert as_form.status_code == 415, as_form.text
    assert "Content-Type: application/json" in as_form.json()["detail"]
    start_as_form = http.post(
        "/v1/workflows/approve/runs", content=b'{"input": {"doc": "x"}}', headers=form
    )
    assert start_as_form.status_code == 415, start_as_form.text
    not_utf8 = http.post(
        signal_path, content=b'{"verdict": "\xff"}', headers={"Content-Type": "application/json"}
    )
    assert not_utf8.status_code == 400, not_utf8.text
    assert "UTF-8" in not_utf8.json()["detail"]
    assert len(http.get(f"/v1/runs/{run['id']}/history").json()["events"]) == recorded
    typed = {"Content-Type": "application/merge-patch+json; charset=utf-8"}
    sent = http.post(signal_path, content=b'{"verdict": "approved"}', headers=typed)
    assert sent.status_code == 202, sent.text
    done = http.get(f"{run['links']['result']}?wait=20").json()
    assert done["result"] == "memo: approved"


def _waiting_under_old_code(store: str, run_id: str, tenant: str | None = None) -> None:
    """A run of ``approve`` (serve_app's) started by an older deploy whose code ran a step
    before waiting for the review: today's code (no such step) cannot replay it."""
    import asyncio
    import concurrent.futures

    import tether

    old = tether.App(store=store)

    @old.activity
    def precheck(doc: str) -> str:
        return doc

    @old.workflow(name="approve")
    async def approve(doc: str) -> str:
        await precheck(doc)
        await tether.wait_event("review", timeout=3600)
        return doc

    async def go() -> None:
        async with old.worker(poll_interval=0.05):
            await old.start(approve, "contract", run_id=run_id, tenant=tenant)
            for _ in range(1000):
                if (await old.get(run_id)).waiting_on:
                    break
                await asyncio.sleep(0.02)
        await old.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # callers may run a loop
        pool.submit(asyncio.run, go()).result()


def test_a_run_stuck_on_non_determinism_shows_its_task_error_and_is_listed(
    store_url: str,
) -> None:
    """GET /v1/runs/{id} carries the run's task_error (a monitor key sees an engine-made
    one, never a payload), and ?stuck=true lists the live runs that have one."""
    import tether

    tether.App(store=store_url).store.close_sync()  # type: ignore[attr-defined]  # the store
    admin = _create_key(store_url, "--role", "admin")
    monitor = _create_key(store_url, "--role", "monitor", "--tenant", "acme")
    _waiting_under_old_code(store_url, "stuck-1", tenant="acme")
    server = Server(store_url, "--workers", "1")
    try:
        http = server.http

        def as_(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        body = {**INVOICE, "tenant": "acme"}
        fine = http.post("/v1/workflows/bill/runs", json=body, headers=as_(admin)).json()
        assert http.get(f"{fine['links']['result']}?wait=20", headers=as_(admin)).status_code == 200
        sent = http.post(
            "/v1/runs/stuck-1/signals/review", json={"verdict": "ok"}, headers=as_(admin)
        )
        assert sent.status_code == 202, sent.text
        deadline = time.monotonic() + 20
        while not (seen := http.get("/v1/runs/stuck-1", headers=as_(admin)).json()).get(
            "task_error"
        ):
            assert time.monotonic() < deadline, f"no task_error shown: {seen}"
            time.sleep(0.1)
        assert seen["status"] == "running"
        assert seen["task_error"].startswith("NonDeterminismError: ")
        assert "history recorded ActivityScheduled('precheck')" in seen["task_error"]
        bare = http.get("/v1/runs/stuck-1", headers=as_(monitor)).json()
        assert bare["task_error"] == seen["task_error"]  # names only: shown to a monitor key
        assert http.get(fine["links"]["self"], headers=as_(admin)).json()["task_error"] is None
        stuck = http.get("/v1/runs?stuck=true", headers=as_(monitor)).json()["runs"]
        assert [r["id"] for r in stuck] == ["stuck-1"]
        every = http.get("/v1/runs", headers=as_(admin)).json()["runs"]
        assert {r["id"] for r in every} == {"stuck-1", fine["id"]}
    finally:
        server.stop()


def test_a_task_error_that_may_hold_a_payload_is_withheld_from_a_monitor_key() -> None:
    import dataclasses

    from tether._history import RunInfo, RunStatus
    from tether.server._models import run_view

    info = RunInfo(
        run_id="r",
        workflow="w",
        status=RunStatus.RUNNING,
        queue="default",
        input="{}",
        output=None,
        error=None,
        custom_status=None,
        parent_run_id=None,
        continued_to=None,
        task_error="PayloadError: input does not match: 'ssn-078-05-1120' is not an int",
        created_at=1.0,
        updated_at=1.0,
        completed_at=None,
    )
    assert run_view(info).task_error == info.task_error
    assert run_view(info, payloads=False).task_error == "PayloadError: [withheld]"
    nd = dataclasses.replace(info, task_error=None)
    assert run_view(nd, payloads=False).task_error is None


@pytest.mark.parametrize(
    "error",
    ["purged", "key"],
)
async def test_a_stream_whose_run_is_purged_or_unreadable_ends_with_an_error_message(
    error: str,
) -> None:
    """A run purged while followed (retention, tenant erasure), or a payload the server
    cannot open (its keyring lacks the key), raised out of the event stream once its
    headers were sent: uvicorn logged a traceback and cut the response. The stream now
    ends with an ``error`` message holding the problem the route would answer."""
    import asyncio
    import json
    import types

    from tether import EventType
    from tether._errors import RunPurgedError
    from tether._history import Event
    from tether.encryption import KeyUnavailableError
    from tether.server._stream import EventHub

    first = Event(
        run_id="r", seq=1, type=EventType.WORKFLOW_STARTED, step=None, data={}, created_at=0.0
    )
    reads: list[int] = []

    async def read_history(run_id: str, after: int) -> list[Event]:
        reads.append(after)
        if len(reads) == 1:
            return [first]
        if error == "purged":
            raise RunPurgedError("r", "retention", 5.0)
        raise KeyUnavailableError("k-1", "this keyring has no key of that id", "run 'r'")

    async def get(run_id: str, follow: bool = True) -> Any:
        return types.SimpleNamespace(is_finished=False, continued_to=None)

    async def is_disconnected() -> bool:
        return False

    app = types.SimpleNamespace(
        store=types.SimpleNamespace(read_history=read_history), get=get, _peek=get
    )
    hub = EventHub(app)  # type: ignore[arg-type]

    def wake() -> None:  # a commit of the run
        for ev in hub._following.get("r", ()):
            ev.set()

    hub_wake = asyncio.get_running_loop().call_later(0.05, wake)
    request = types.SimpleNamespace(is_disconnected=is_disconnected)
    try:
        sent = [m async for m in hub.stream("r", 0, request)]  # type: ignore[arg-type]
    finally:
        hub_wake.cancel()
    assert sent[0].startswith("id: 1\n")
    assert sent[-1].startswith("event: error\n"), sent
    problem = json.loads(sent[-1].split("data: ", 1)[1])
    if error == "purged":
        assert problem["status"] == 410 and "purged" in problem["detail"], problem
    else:
        assert problem["status"] == 503 and "k-1" in problem["detail"], problem


def test_a_divergence_naming_a_model_answers_keys_is_withheld_from_a_monitor_key(
    store_url: str,
) -> None:
    """A structured step's recorded answer that today's output type reads lossily is a
    divergence naming the fields dropped: paths into the answer, whose dict keys are
    the model's output (here a person's name and SSN). The message was marked the
    engine's, so a key without payloads saw it whole and the worker logged it whole.
    The keys of a dict (and a list's indices) are now ``[key]`` (``[i]``), and a message
    naming a field the type does not have is not the engine's: withheld, redacted."""
    import asyncio
    import concurrent.futures

    from pydantic import BaseModel

    import tether
    from tether import ai

    secret = "Alice Smith, SSN 078-05-1120"

    class Person(BaseModel):  # the older deploy's type
        name: str
        age: int

    class People(BaseModel):
        people: dict[str, Person]

    tether.App(store=store_url).store.close_sync()  # type: ignore[attr-defined]  # the store
    admin = _create_key(store_url, "--role", "admin")
    monitor = _create_key(store_url, "--role", "monitor", "--tenant", "acme")
    old = tether.App(store=store_url)
    gateway = ai.Gateway(old, name="census", retry=tether.Retry(attempts=1))
    reader = gateway.model(
        "reader", ai.ScriptedModel([{"people": {secret: {"name": "A", "age": 41}}}])
    )

    @old.workflow(name="census")
    async def census(text: str) -> str:
        got = await ai.structured(reader, text, output=People)
        await tether.wait_event("go", timeout=3600)
        return ",".join(got.people)

    async def go() -> None:
        async with old.worker(poll_interval=0.05):
            await old.start(census, "read them", run_id="census-1", tenant="acme")
            for _ in range(1000):
                if await old.list(waiting_for="signal:go"):
                    break
                await asyncio.sleep(0.02)
            assert await old.list(waiting_for="signal:go"), await old.get("census-1")
        await old.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, go()).result()
    server = Server(store_url, "--workers", "1", env={"TETHER_TEST_STRUCTURED": "1"})
    try:
        http = server.http

        def as_(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        sent = http.post("/v1/runs/census-1/signals/go", json=True, headers=as_(admin))
        assert sent.status_code == 202, sent.text
        deadline = time.monotonic() + 20
        while not (seen := http.get("/v1/runs/census-1", headers=as_(admin)).json()).get(
            "task_error"
        ):
            assert time.monotonic() < deadline, f"no task_error shown: {seen}"
            time.sleep(0.1)
        error = seen["task_error"]
        assert error.startswith("NonDeterminismError: "), error
        assert "'people.[key].age'" in error and secret not in error, error
        bare = http.get("/v1/runs/census-1", headers=as_(monitor)).json()
        assert bare["task_error"] == "NonDeterminismError: [withheld]", bare
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        logged = server.all_stderr()
        server.stop()
    assert "workflow task for run 'census-1' failed: NonDeterminismError: <" in logged, logged
    assert secret not in logged and "SSN" not in logged


def test_a_key_without_the_role_learns_nothing_of_another_tenants_run(
    tenants: Tenants, tmp_path: Path
) -> None:
    """A tenant's key that lacks an action's role gets 404 for another tenant's run,
    review or dead letter, as it does for one that never was, and 403 only for what its
    own tenant holds. Before, the role was checked first: a read key posting to any run
    id learnt from the 403 that the run existed."""
    t, http = tenants, tenants.http
    waiting = t.start("globex", "approve", {"input": {"doc": "secret"}}).json()
    reviewed = t.start("globex", "review", {"input": {"title": "secret"}}).json()
    flag = tmp_path / "flag"
    flag.write_text("up")
    failing = t.start("globex", "fragile", {"input": {"flag": str(flag)}}).json()
    failed = http.get(f"{failing['links']['result']}?wait=20", headers=t.as_("globex")).json()
    assert failed["status"] == "failed"
    letter = http.get(f"/v1/dead-letters?run_id={failing['id']}", headers=t.as_("globex")).json()[0]
    review: dict[str, Any] = {}
    for _ in range(100):
        open_ = http.get(f"/v1/approvals?run_id={reviewed['id']}", headers=t.as_("globex"))
        open_ = open_.json()
        if open_:
            review = open_[0]
            break
        time.sleep(0.1)
    assert review, "the review did not open"
    mine = t.start("acme", "approve", {"input": {"doc": "mine"}}).json()

    def posts(run_id: str) -> list[tuple[str, dict[str, Any] | None]]:
        url = f"/v1/runs/{run_id}"
        return [
            (f"{url}/cancel", {}),
            (f"{url}/suspend", None),
            (f"{url}/resume", None),
            (f"{url}/terminate", {}),
            (f"{url}/signals/review", {}),
            (f"{url}/retry", None),
            (f"{url}/fork", {"at_step": 1}),
            (f"{url}/steps/1/complete", {"result": 1, "reason": "x"}),
            (f"{url}/updates/x", {"args": []}),
        ]

    for who in ("acme_read", "acme_monitor"):
        for path, body in posts(waiting["id"]):
            r = http.post(path, json=body, headers=t.as_(who))
            assert r.status_code == 404, (who, path, r.status_code, r.text)
            assert "role" not in r.json()["detail"], (who, path, r.text)
        for path, body in posts(mine["id"]):
            if path.endswith(("/retry", "/resume")):
                continue  # (their own checks may answer first: a run not failed, ...)
            r = http.post(path, json=body, headers=t.as_(who))
            assert r.status_code == 403, (who, path, r.status_code, r.text)
        for path, body in (
            (f"/v1/dead-letters/{letter['id']}/replay", None),
            (f"/v1/dead-letters/{letter['id']}/resolve", {"note": "x"}),
            (
                f"/v1/approvals/{review['approval_id']}/decision",
                {"approve": True, "by": "x", "fingerprint": review["fingerprint"]},
            ),
        ):
            r = http.post(path, json=body, headers=t.as_(who))
            assert r.status_code == 404, (who, path, r.status_code, r.text)
    audit = http.get(f"/v1/runs/{waiting['id']}/audit", headers=t.as_("acme_monitor"))
    assert audit.status_code == 404, audit.text
