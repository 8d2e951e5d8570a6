"""The console in a real browser (Playwright driving Debian's Chromium) against a real
``tether serve`` process, when things change under it: a run page stays live across a
server restart (and says when it is not), and actions on a page gone stale answer with
a message on the run's page, not an error document."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from test_console import CHROMIUM, _sign_in, _start, pytestmark  # noqa: F401 (skip mark)
from test_http_api import Server, _create_key


@pytest.fixture
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert CHROMIUM is not None, "CI needs chromium: ./scripts/setup-browser installs it"
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def admin_served(tmp_path: Path) -> Iterator[tuple[Server, str]]:
    store = f"sqlite:///{tmp_path / 't.db'}"
    import tether

    tether.App(store=store).store.close_sync()  # type: ignore[attr-defined]
    admin = _create_key(store, "--role", "admin")
    server = Server(store, "--workers", "1")
    yield server, admin
    server.stop()


def _restart(server: Server) -> Server:
    """Kill ``server`` (SIGKILL: connections drop) and start it again on the same port."""
    server.proc.send_signal(signal.SIGKILL)
    server.stop()
    return Server(server.store, "--workers", "1", port=server.port)


def test_a_run_page_says_it_is_not_live_and_follows_the_run_again_after_a_restart(
    admin_served: tuple[Server, str], browser: Any
) -> None:
    server, admin = admin_served
    base = f"http://127.0.0.1:{server.port}"
    run = _start(server, admin, "approve", {"input": {"doc": "memo"}})
    page = browser.new_page()
    _sign_in(page, base, admin)
    with page.expect_response(lambda r: r.url.endswith("/events")):  # the page follows
        page.goto(f"{base}/runs/{run['id']}")
    assert page.locator("#live-state").is_hidden()
    server = _restart(server)
    try:
        # while the server was away the page said so; it is live again once it is back
        # (the browser reconnects by itself, or the page makes a new stream)
        page.wait_for_selector("#live-state", state="visible", timeout=20_000)
        page.wait_for_selector("#live-state", state="hidden", timeout=30_000)
        r = server.http.post(
            f"/v1/runs/{run['id']}/signals/review",
            json={"verdict": "approved"},
            headers={"Authorization": f"Bearer {admin}"},
        )
        assert r.status_code == 202, r.text
        page.wait_for_selector("#status.completed", timeout=20_000)  # followed, not reloaded
        assert "memo: approved" in page.inner_text("#live")
    finally:
        server.stop()


def test_an_action_on_a_run_that_ended_since_its_page_was_shown_says_why_on_the_page(
    admin_served: tuple[Server, str], browser: Any
) -> None:
    server, admin = admin_served
    base = f"http://127.0.0.1:{server.port}"
    auth = {"Authorization": f"Bearer {admin}"}
    page = browser.new_page()
    page.on("dialog", lambda d: d.accept())
    _sign_in(page, base, admin)
    page.route("**/events*", lambda route: route.abort())  # pages that do not follow
    for button in ("Cancel", "Terminate", "Suspend", "Send signal"):
        run = _start(server, admin, "approve", {"input": {"doc": button}})
        page.goto(f"{base}/runs/{run['id']}")
        page.fill("form.signal input[name=name]", "review")
        ended = {"verdict": "ok"}
        server.http.post(f"/v1/runs/{run['id']}/signals/review", json=ended, headers=auth)
        done = server.http.get(f"/v1/runs/{run['id']}/result?wait=20", headers=auth).json()
        assert done["status"] == "completed"
        with page.expect_navigation() as nav:
            page.click(f"form button:has-text('{button}')")
        assert nav.value.status == 200 and "text/html" in nav.value.headers["content-type"]
        message = page.inner_text(".message")
        assert "not done" in message or "not sent" in message, message
        assert "completed" in message, message  # why: the run has ended
        assert page.inner_text("#status") == "completed"


def _started_by_an_older_version(store: str, run_id: str) -> None:
    """A run of ``approve`` whose id an older tether accepted ('.' and '..' parts)."""
    import asyncio
    import concurrent.futures

    import tether
    import tether._app

    old = tether.App(store=store)

    @old.workflow(name="approve")
    async def approve(doc: str) -> str:
        return doc

    async def go() -> None:
        await old.start(approve, "legacy", run_id=run_id)
        await old.close()

    unchecked = pytest.MonkeyPatch()
    unchecked.setattr(tether._app, "check_run_id", lambda _run_id: None)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # (Playwright runs a loop)
            pool.submit(asyncio.run, go()).result()
    finally:
        unchecked.undo()


def test_run_ids_with_dot_parts_are_refused_and_older_ones_are_linked_to_themselves(
    tmp_path: Path, browser: Any
) -> None:
    store = f"sqlite:///{tmp_path / 't.db'}"
    import tether

    tether.App(store=store).store.close_sync()  # type: ignore[attr-defined]
    admin = _create_key(store, "--role", "admin")
    _started_by_an_older_version(store, "a/../b")
    server = Server(store, "--workers", "1")
    try:
        base = f"http://127.0.0.1:{server.port}"
        auth = {"Authorization": f"Bearer {admin}"}
        other = {"input": {"doc": "b"}, "run_id": "b"}
        assert server.http.post("/v1/workflows/approve/runs", json=other, headers=auth).is_success
        for bad in ("c/../d", "..", "./x", "a//b", "a/", "/a"):
            body = {"input": {"doc": "x"}, "run_id": bad}
            r = server.http.post("/v1/workflows/approve/runs", json=body, headers=auth)
            assert r.status_code == 400, (bad, r.status_code, r.text)
            assert "'..'" in r.json()["detail"] and repr(bad) in r.json()["detail"], r.text
        # the run an older version accepted is still read, linked and steered as itself
        r = server.http.get("/v1/runs", headers=auth)
        (legacy,) = [x for x in r.json()["runs"] if x["id"] == "a/../b"]
        r = server.http.get(legacy["links"]["self"], headers=auth)
        assert r.status_code == 200 and r.json()["id"] == "a/../b"
        page = browser.new_page()
        page.on("dialog", lambda d: d.accept())
        _sign_in(page, base, admin)
        page.goto(f"{base}/runs")
        page.click("#runs a:text-is('a/../b')")
        assert page.inner_text("h1 code") == "a/../b"
        page.click("form[action$='/act'] button:has-text('Cancel')")
        assert "cancel requested" in page.inner_text(".message")
        assert page.inner_text("h1 code") == "a/../b"
        got = server.http.get("/v1/runs?limit=50", headers=auth).json()["runs"]
        status = {x["id"]: x["status"] for x in got}
        assert status["b"] in ("pending", "running"), status  # not the one cancelled
        history = server.http.get(f"{legacy['links']['history']}", headers=auth).json()
        assert "CancelRequested" in [e["type"] for e in history["events"]]
    finally:
        server.stop()


def _cli(store: str, *args: str) -> str:
    import os
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "tether.cli", *args, "--store", store],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_a_continuation_links_back_and_a_purged_run_says_so_to_an_admin(
    admin_served: tuple[Server, str], browser: Any, tmp_path: Path
) -> None:
    server, admin = admin_served
    base = f"http://127.0.0.1:{server.port}"
    auth = {"Authorization": f"Bearer {admin}"}
    body = {"input": {"left": 2}, "run_id": "loop"}
    assert server.http.post("/v1/workflows/again/runs", json=body, headers=auth).is_success
    done = server.http.get("/v1/runs/loop/result?wait=20", headers=auth).json()
    assert done["status"] == "completed", done
    page = browser.new_page()
    _sign_in(page, base, admin)
    page.goto(f"{base}/runs/loop~2")  # the chain's last run: back to the one it continues
    page.click("a:text-is('loop~1')")
    assert page.inner_text("h1 code") == "loop~1"
    assert page.locator("a:text-is('loop~2')").count() == 1  # and on, both ways
    page.click("a:text-is('loop')")
    assert page.inner_text("h1 code") == "loop"
    assert page.locator("text=Continues").count() == 0  # the first run continues none
    # purged: the admin is told so, as the API says (410), not "there is no run"
    _cli(server.store, "purge", "--older-than", "0s")
    assert server.http.get("/v1/runs/loop~1", headers=auth).status_code == 410
    page.goto(f"{base}/runs/loop~1")
    assert page.inner_text("h1") == "Purged"
    assert "was purged at" in page.inner_text("main"), page.inner_text("main")


def test_a_list_refreshed_after_its_key_was_revoked_goes_to_the_login_page(
    admin_served: tuple[Server, str], browser: Any
) -> None:
    server, admin = admin_served
    base = f"http://127.0.0.1:{server.port}"
    operate = _create_key(server.store, "--role", "operate", "--tenant", "acme")
    page = browser.new_page()
    _sign_in(page, base, operate)
    page.goto(f"{base}/runs?status=running")
    page.wait_for_function("document.getElementById('runs').changes?.readyState === 1")
    key_id = operate.split("_", 1)[1].split(".")[0]
    _cli(server.store, "keys", "revoke", key_id)
    _start(server, admin, "approve", {"input": {"doc": "wakes the list"}, "tenant": "acme"})
    page.wait_for_url(f"{base}/login?*", timeout=20_000)  # not a login form in the table
    assert "next=%2Fruns%3Fstatus%3Drunning" in page.url
    assert page.locator("#runs").count() == 0 and page.locator("input[name=key]").count() == 1


def _history(server: Server, run_id: str, auth: dict[str, str]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = server.http.get(
        f"/v1/runs/{run_id}/history", headers=auth
    ).json()["events"]
    return events


def test_an_admin_completes_a_failed_step_from_the_run_page(
    admin_served: tuple[Server, str], browser: Any, tmp_path: Path
) -> None:
    """The run page offers "Complete step" where ``complete_step`` takes one (the failed
    step of a failed run): a result that is not JSON is refused on the page with the
    reason and nothing changes; an operate key is refused (admin, as the API); a JSON
    result completes the step, the run reopens and finishes with it."""
    server, admin = admin_served
    base = f"http://127.0.0.1:{server.port}"
    auth = {"Authorization": f"Bearer {admin}"}
    flag = tmp_path / "broken"
    flag.write_text("up")  # the step fails while it exists (never removed)
    run = _start(server, admin, "fragile", {"input": {"flag": str(flag)}, "tenant": "acme"})
    done = server.http.get(f"/v1/runs/{run['id']}/result?wait=20", headers=auth).json()
    assert done["status"] == "failed", done
    before = _history(server, run["id"], auth)
    asked: list[str] = []
    page = browser.new_page()
    page.on("dialog", lambda d: (asked.append(d.message), d.accept()))
    _sign_in(page, base, admin)
    page.goto(f"{base}/runs/{run['id']}")
    forms = page.locator("#actions form.complete")
    assert forms.count() == 1 and forms.get_attribute("data-step") == "1"
    assert "flaky" in forms.inner_text() and "RuntimeError" in forms.inner_text()
    # not JSON (a text without its quotes): said on the page, nothing recorded
    page.fill("form.complete textarea[name=result]", "done by hand")
    page.fill("form.complete input[name=reason]", "checked at the provider")
    with page.expect_navigation() as nav:
        page.click("form.complete button[type=submit]")
    assert nav.value.status == 200 and "text/html" in nav.value.headers["content-type"]
    assert asked and "step 1 (flaky)" in asked[-1]  # confirmed first
    message = page.inner_text(".message")
    assert "step 1 not completed: the result is not JSON" in message, message
    assert '"re_9"' in message, message  # how to write a text
    assert "Traceback" not in message and page.inner_text("h1").startswith("Run ")
    assert page.inner_text("#status") == "failed"
    assert _history(server, run["id"], auth) == before
    # JSON, but not what the activity returns (a str): refused with the reason too
    page.fill("form.complete textarea[name=result]", "42")
    page.fill("form.complete input[name=reason]", "checked at the provider")
    page.click("form.complete button[type=submit]")
    message = page.inner_text(".message")
    assert "step 1 not completed: result of step 1 (flaky)" in message, message
    assert _history(server, run["id"], auth) == before
    trail = server.http.get(f"/v1/runs/{run['id']}/audit", headers=auth).json()
    assert not [e for e in trail if e["action"] == "complete step"]
    # an operate key may not (an admin's act, as over the API): the step is shown to
    # it, not the form, and a form posted anyway is refused
    operate = _create_key(server.store, "--role", "operate", "--tenant", "acme")
    other = browser.new_page()
    other.on("dialog", lambda d: d.accept())
    _sign_in(other, base, operate)
    other.goto(f"{base}/runs/{run['id']}")
    assert other.locator("#actions form.complete").count() == 0
    assert "flaky" in other.inner_text("#actions .complete-info")
    assert "admin key" in other.inner_text("#actions .role-note")
    csrf = other.get_attribute("form[action='/logout'] input[name=csrf]", "value")
    form = {"csrf": csrf, "step": "1", "result": '"done by hand"', "reason": "checked"}
    assert other.request.post(f"{base}/runs/{run['id']}/complete", form=form).status == 403
    assert _history(server, run["id"], auth) == before
    # the result as JSON: the step is completed, the run reopens and ends with it
    page.fill("form.complete textarea[name=result]", '"done by hand"')
    page.fill("form.complete input[name=reason]", "checked at the provider")
    page.click("form.complete button[type=submit]")
    assert "step 1 completed by key" in page.inner_text(".message")
    page.wait_for_selector("#status.completed", timeout=20_000)  # followed, not reloaded
    assert "done by hand" in page.inner_text("#live")
    assert page.locator("#actions form.complete").count() == 0  # nothing more to complete
    completed = [
        e
        for e in _history(server, run["id"], auth)
        if e["type"] == "ActivityCompleted" and e["step"] == 1
    ]
    assert len(completed) == 1 and completed[0]["data"]["operator"].startswith("key ")
    trail = server.http.get(f"/v1/runs/{run['id']}/audit", headers=auth).json()
    (entry,) = [e for e in trail if e["action"] == "complete step"]
    assert entry["detail"]["reason"] == "checked at the provider"


def test_the_actions_follow_the_run_state_without_a_reload(
    admin_served: tuple[Server, str], browser: Any, tmp_path: Path
) -> None:
    """The Actions section changes with the run, as the rest of the page does: Resume
    once suspended, Complete step once a step waits for its next retry, nothing but
    fork once the run ended; an event that changes no action keeps what the operator is
    typing."""
    server, admin = admin_served
    base = f"http://127.0.0.1:{server.port}"
    auth = {"Authorization": f"Bearer {admin}"}
    flag = tmp_path / "broken"
    flag.write_text("up")
    run = _start(server, admin, "patient", {"input": {"flag": str(flag)}})
    page = browser.new_page()
    page.on("dialog", lambda d: d.accept())
    _sign_in(page, base, admin)
    page.goto(f"{base}/runs/{run['id']}")
    page.wait_for_function("document.getElementById('live').stream?.source.readyState === 1")
    actions = page.locator("#actions")
    assert actions.locator("button:text-is('Suspend')").count() == 1
    assert actions.locator("form.complete").count() == 0
    page.fill("form.signal input[name=name]", "half typed")
    # a signal nobody waits for: recorded, the page refreshes, the actions are the same
    r = server.http.post(f"/v1/runs/{run['id']}/signals/noise", json={}, headers=auth)
    assert r.status_code == 202, r.text
    page.wait_for_selector("#live >> text=SignalReceived", timeout=20_000)
    page.wait_for_timeout(500)
    assert page.input_value("form.signal input[name=name]") == "half typed"
    r = server.http.post(f"/v1/runs/{run['id']}/suspend", headers=auth)
    assert r.status_code == 202, r.text
    page.wait_for_selector("#actions button:text-is('Resume')", timeout=20_000)
    assert actions.locator("button:text-is('Suspend')").count() == 0
    r = server.http.post(f"/v1/runs/{run['id']}/resume", headers=auth)
    assert r.status_code == 202, r.text
    page.wait_for_selector("#actions button:text-is('Suspend')", timeout=20_000)
    # its step fails and waits an hour for its next try: it can be completed by hand
    r = server.http.post(f"/v1/runs/{run['id']}/signals/go", json={}, headers=auth)
    assert r.status_code == 202, r.text
    page.wait_for_selector("#actions form.complete", timeout=20_000)
    assert "Waiting for its next retry" in actions.locator("form.complete").inner_text()
    step = actions.locator("form.complete").get_attribute("data-step")
    # completed (over the API): the run ends, and its actions say so
    body = {"result": "by hand", "reason": "seen at the provider"}
    r = server.http.post(f"/v1/runs/{run['id']}/steps/{step}/complete", json=body, headers=auth)
    assert r.status_code == 202, r.text
    page.wait_for_selector("#status.completed", timeout=20_000)
    page.wait_for_selector("#actions >> text=The run has ended.", timeout=20_000)
    assert actions.locator("button:text-is('Cancel')").count() == 0
    assert actions.locator("form.complete").count() == 0
    done = server.http.get(f"/v1/runs/{run['id']}/result", headers=auth).json()
    assert done["result"] == "by hand"
