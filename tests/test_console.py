"""The operator console in a real browser (Playwright driving Debian's Chromium) against a
real ``tether serve`` process: sign-in with a key, overview, runs, a run's timeline,
and actions (signal, approve, cancel, replay a dead letter) with CSRF and roles."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from test_http_api import INVOICE, Server, _create_key, _waiting_under_old_code

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: where the pages' screenshots go (test artefacts; docs/img keeps current ones)
ARTIFACTS = Path(os.environ.get("TETHER_ARTIFACTS") or Path(__file__).parent / "artifacts")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"),
    reason="Chromium is not installed (./scripts/setup-browser installs it as root)",
)


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
def served(tmp_path: Path) -> Iterator[tuple[Server, dict[str, str]]]:
    store = f"sqlite:///{tmp_path / 't.db'}"
    import tether

    tether.App(store=store).store.close_sync()  # type: ignore[attr-defined]
    keys = {
        "operate": _create_key(store, "--role", "operate", "--tenant", "acme"),
        "read": _create_key(store, "--role", "read", "--tenant", "acme"),
        "other": _create_key(store, "--role", "operate", "--tenant", "globex"),
        "admin": _create_key(store, "--role", "admin"),
    }
    server = Server(store, "--workers", "1")
    yield server, keys
    server.stop()


def _start(server: Server, key: str, workflow: str, body: dict[str, Any]) -> dict[str, Any]:
    r = server.http.post(
        f"/v1/workflows/{workflow}/runs", json=body, headers={"Authorization": f"Bearer {key}"}
    )
    assert r.status_code == 202, r.text
    out: dict[str, Any] = r.json()
    return out


def _sign_in(page: Any, base: str, key: str) -> None:
    page.goto(f"{base}/")
    assert "/login" in page.url  # no session: the sign-in page
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/")


def test_sign_in_overview_runs_and_a_signal_from_the_browser(
    served: tuple[Server, dict[str, str]], browser: Any
) -> None:
    server, keys = served
    base = f"http://127.0.0.1:{server.port}"
    billed = _start(server, keys["operate"], "bill", INVOICE)
    waiting = _start(server, keys["operate"], "approve", {"input": {"doc": "contract"}})
    theirs = _start(server, keys["other"], "bill", INVOICE)
    auth = {"Authorization": f"Bearer {keys['operate']}"}
    server.http.get(f"/v1/runs/{billed['id']}/result?wait=20", headers=auth)
    page = browser.new_page()
    page.on("dialog", lambda d: d.accept())  # every action asks first; the operator agrees
    page.goto(f"{base}/")
    page.fill("input[name=key]", "tether_nope.wrong")
    page.click("button[type=submit]")
    assert "does not exist" in page.inner_text(".error")
    page.fill("input[name=key]", keys["operate"])
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/")
    assert "bill" in page.inner_text("table.grid")
    assert page.locator("svg.outcomes").count() == 1
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "console-overview.png"), full_page=True)
    # runs: only this tenant's, live-refreshed list
    page.goto(f"{base}/runs")
    text = page.inner_text("#runs")
    assert billed["id"] in text and waiting["id"] in text and theirs["id"] not in text
    page.goto(f"{base}/runs/{theirs['id']}")
    assert "Not found" in page.inner_text("h1")  # another tenant's run does not exist
    # a run's page: timeline, then a signal sent from the form finishes it
    page.goto(f"{base}/runs/{billed['id']}")
    assert page.locator("svg.timeline g.bar.activity.ok").count() == 1
    page.screenshot(path=str(ARTIFACTS / "console-run.png"), full_page=True)
    assert "1100" in page.inner_text("section >> text=Result") or "1100" in page.content()
    page.goto(f"{base}/runs/{waiting['id']}")
    assert "waiting on" in page.inner_text("#live")
    page.fill("form.signal input[name=name]", "review")
    page.fill("form.signal textarea[name=payload]", '{"verdict": "approved"}')
    page.click("form.signal button[type=submit]")
    assert "signal 'review' sent by key" in page.inner_text(".message")
    page.wait_for_selector("#status.completed", timeout=20_000)  # the page follows the run
    done = server.http.get(f"/v1/runs/{waiting['id']}", headers=auth).json()
    assert done["result"] == "contract: approved"


def test_a_signal_sent_from_the_console_with_an_id_is_sent_once(
    served: tuple[Server, dict[str, str]], browser: Any
) -> None:
    """The signal form takes an optional id (the signal's ``signal_id``): a form sent
    again (a double submit, a reload) records nothing, another payload with that id is
    refused; without an id each send is a signal, as before."""
    server, keys = served
    base = f"http://127.0.0.1:{server.port}"
    run = _start(server, keys["operate"], "cart", {"input": {}})
    auth = {"Authorization": f"Bearer {keys['operate']}"}
    page = browser.new_page()
    page.on("dialog", lambda d: d.accept())
    _sign_in(page, base, keys["operate"])

    def send(payload: str, signal_id: str) -> str:
        page.goto(f"{base}/runs/{run['id']}")
        page.fill("form.signal input[name=name]", "add")
        page.fill("form.signal textarea[name=payload]", payload)
        page.fill("form.signal input[name=signal_id]", signal_id)
        page.click("form.signal button[type=submit]")
        return str(page.inner_text(".message"))

    assert "signal 'add' sent by key" in send('{"sku": "A"}', "add-A")
    again = send('{"sku": "A"}', "add-A")
    assert "already sent" in again and "not sent again" in again
    other = send('{"sku": "B"}', "add-A")
    assert "signal not sent" in other and "another payload" in other
    assert "signal 'add' sent by key" in send('{"sku": "C"}', "")
    server.http.post(f"/v1/runs/{run['id']}/signals/add", json=None, headers=auth)
    done = server.http.get(f"/v1/runs/{run['id']}/result?wait=20", headers=auth).json()
    assert done["result"] == [{"sku": "A"}, {"sku": "C"}]
    events = server.http.get(f"/v1/runs/{run['id']}/history", headers=auth).json()["events"]
    ids = [e["data"].get("signal_id") for e in events if e["type"] == "SignalReceived"]
    assert ids == ["add-A", None, None]


def test_the_runs_list_refreshes_when_a_run_it_shows_changes_not_on_others(
    served: tuple[Server, dict[str, str]], browser: Any
) -> None:
    server, keys = served
    base = f"http://127.0.0.1:{server.port}"
    page = browser.new_page()
    _sign_in(page, base, keys["operate"])
    refreshes: list[str] = []
    page.on("request", lambda r: refreshes.append(r.url) if "partial=1" in r.url else None)
    page.goto(f"{base}/runs")
    page.wait_for_function("document.getElementById('runs').changes?.readyState === 1")
    # another tenant's new run: nothing to show, no refresh (the list's poll is 10 s)
    theirs = _start(server, keys["other"], "approve", {"input": {"doc": "theirs"}})
    page.wait_for_timeout(1500)
    assert refreshes == []
    # one of this tenant's: the list shows it within moments, not at the next poll
    mine = _start(server, keys["operate"], "approve", {"input": {"doc": "mine"}})
    page.wait_for_function(
        f"document.getElementById('runs').innerText.includes({json.dumps(mine['id'])})",
        timeout=4000,
    )
    assert refreshes and theirs["id"] not in page.inner_text("#runs")


def test_approve_cancel_and_replay_from_the_browser_with_roles_and_csrf(
    served: tuple[Server, dict[str, str]], browser: Any, tmp_path: Path
) -> None:
    server, keys = served
    base = f"http://127.0.0.1:{server.port}"
    review = _start(server, keys["operate"], "review", {"input": {"title": "Q3 plan"}})
    doomed = _start(server, keys["operate"], "approve", {"input": {"doc": "d"}})
    flag = tmp_path / "flag"
    flag.write_text("up")
    fragile = _start(server, keys["operate"], "fragile", {"input": {"flag": str(flag)}})
    auth = {"Authorization": f"Bearer {keys['operate']}"}
    deadline = time.monotonic() + 20
    while not server.http.get(f"/v1/approvals?run_id={review['id']}", headers=auth).json():
        assert time.monotonic() < deadline, "the review never opened"
        time.sleep(0.1)
    server.http.get(f"/v1/runs/{fragile['id']}/result?wait=20", headers=auth)

    # a read key sees everything but is offered no action, and one posted is refused
    reader = browser.new_page()
    reader.on("dialog", lambda d: d.accept())
    _sign_in(reader, base, keys["read"])
    reader.goto(f"{base}/runs/{doomed['id']}")
    assert reader.locator("form[action$='/act']").count() == 0
    reader_csrf = reader.get_attribute("form[action='/logout'] input[name=csrf]", "value")
    refused = reader.request.post(
        f"{base}/runs/{doomed['id']}/act", form={"csrf": reader_csrf, "action": "cancel"}
    )
    assert refused.status == 403

    page = browser.new_page()
    page.on("dialog", lambda d: d.accept())
    _sign_in(page, base, keys["operate"])
    # approve the open review, shown with its fingerprint
    page.goto(f"{base}/approvals")
    assert "title" in page.inner_text("table.grid")
    page.goto(f"{base}/runs/{review['id']}")
    fingerprint = page.inner_text("code.fp")
    assert len(fingerprint) >= 16
    page.click("form.review button[value=approve]")
    assert "decided by key" in page.inner_text(".message")
    got = server.http.get(f"/v1/runs/{review['id']}/result?wait=20", headers=auth).json()
    assert got["result"] == "Q3 plan approved by ann"
    # cancel with a reason: the run records who did it
    page.goto(f"{base}/runs/{doomed['id']}")
    page.fill("form[action$='/act'] input[name=reason]", "duplicate")
    page.click("form[action$='/act'] button:has-text('Cancel')")
    assert "cancel requested by key" in page.inner_text(".message")
    got = server.http.get(f"/v1/runs/{doomed['id']}/result?wait=20", headers=auth).json()
    assert got["status"] == "cancelled"
    history = server.http.get(f"/v1/runs/{doomed['id']}/history", headers=auth).json()
    reasons = [e["data"].get("reason") for e in history["events"] if e["type"] == "CancelRequested"]
    assert reasons and "via console: duplicate" in reasons[0] and "key " in reasons[0]
    # the failed run shows its error and stack trace; replaying its dead letter after the
    # fix completes it
    page.goto(f"{base}/runs/{fragile['id']}")
    assert "RuntimeError" in page.inner_text(".error-box") or "ActivityError" in page.inner_text(
        ".error-box"
    )
    assert page.locator("svg.timeline g.bar.activity.failed").count() == 1
    # find it by filter, retry it from the failed step while the flag is still up: it
    # fails again; then fix it and replay its dead letter: it completes
    page.goto(f"{base}/runs?status=failed")
    page.click(f"a:has-text('{fragile['id']}')")
    page.click("button:has-text('Retry from the failed step')")
    assert "retry requested by key" in page.inner_text(".message")
    again = server.http.get(f"/v1/runs/{fragile['id']}/result?wait=20", headers=auth).json()
    assert again["status"] == "failed"
    flag.unlink()
    page.goto(f"{base}/dead-letters")
    row = page.locator("tr", has_text=fragile["id"]).filter(has_text="fragile")
    row.locator("button:has-text('Replay')").click()
    assert "replayed by key" in page.inner_text(".message")
    got = server.http.get(f"/v1/runs/{fragile['id']}/result?wait=20", headers=auth).json()
    assert got["status"] == "completed"
    # a step its run handled is not replayed (it would charge twice): it is resolved
    # with a note instead; a read key may not
    flag.write_text("up")
    careful = _start(server, keys["operate"], "careful", {"input": {"flag": str(flag)}})
    handled = server.http.get(f"/v1/runs/{careful['id']}/result?wait=20", headers=auth).json()
    assert handled["result"] == "handled"
    page.goto(f"{base}/dead-letters")
    row = page.locator("tr", has_text=careful["id"])
    row.locator("button:has-text('Replay')").click()
    assert "RecoveryError" in page.inner_text(".message")
    reader.goto(f"{base}/dead-letters")
    assert careful["id"] in reader.inner_text("table.grid")
    assert reader.locator("tr", has_text=careful["id"]).locator("form").count() == 0
    letter = reader.locator("tr", has_text=careful["id"]).locator("td").first.inner_text()
    refused = reader.request.post(
        f"{base}/dead-letters/{letter}/resolve", form={"csrf": reader_csrf, "note": "mine"}
    )
    assert refused.status == 403
    page.goto(f"{base}/dead-letters")
    row = page.locator("tr", has_text=careful["id"])
    row.locator("input[name=note]").fill("customer told, nothing charged")
    row.locator("button:has-text('Resolve')").click()
    assert "resolved by key" in page.inner_text(".message")
    assert careful["id"] not in page.inner_text("table.grid")
    trail = server.http.get(f"/v1/runs/{careful['id']}/audit", headers=auth).json()
    (entry,) = [e for e in trail if e["action"] == "resolve dead letter"]
    assert entry["actor"].startswith("key ")
    assert entry["detail"]["note"] == "customer told, nothing charged"
    # the run's page has the same button, and comes back to the run
    other = _start(server, keys["operate"], "careful", {"input": {"flag": str(flag)}})
    server.http.get(f"/v1/runs/{other['id']}/result?wait=20", headers=auth)
    page.goto(f"{base}/runs/{other['id']}")
    page.fill("form.resolve input[name=note]", "duplicate order")
    page.click("form.resolve button:has-text('Resolve')")
    assert "resolved by key" in page.inner_text(".message")
    assert f"/runs/{other['id']}" in page.url

    # a form posted without this session's CSRF token is refused, even with the cookie
    cookie = {c["name"]: c["value"] for c in page.context.cookies()}
    forged = httpx.post(
        f"{base}/runs/{doomed['id']}/act",
        data={"action": "suspend", "csrf": "0" * 40},
        cookies=cookie,
    )
    assert forged.status_code == 403 and "CSRF" in forged.json()["title"]


def _offered(page: Any) -> set[str]:
    """The actions a page offers: each button of a form in its main part, named by what
    the form posts to (``act``, ``signal``, ``complete``, ``approvals``, ...) and its text."""
    found = set()
    for form in page.locator("main form").all():
        parts = (form.get_attribute("action") or "").strip("/").split("/")
        to = parts[0] if parts[0] in ("approvals", "switches") else parts[-1]
        found |= {f"{to}:{b.inner_text().strip()}" for b in form.locator("button").all()}
    return found


def test_each_role_is_offered_only_the_actions_it_may_take(
    served: tuple[Server, dict[str, str]], browser: Any, tmp_path: Path
) -> None:
    """A read key sees runs, reviews (their proposals) and dead letters but is offered no
    action, and the page says why; an operate key is offered what it may do, not
    terminate, fork, complete step or switches (admin); an admin all of it. The server
    still refuses what a role may not do, whatever a page offered."""
    server, keys = served
    base = f"http://127.0.0.1:{server.port}"
    live = _start(server, keys["operate"], "review", {"input": {"title": "Q4 plan"}})
    flag = tmp_path / "flag"
    flag.write_text("up")
    failed = _start(server, keys["operate"], "fragile", {"input": {"flag": str(flag)}})
    auth = {"Authorization": f"Bearer {keys['operate']}"}
    deadline = time.monotonic() + 20
    while not server.http.get(f"/v1/approvals?run_id={live['id']}", headers=auth).json():
        assert time.monotonic() < deadline, "the review never opened"
        time.sleep(0.1)
    got = server.http.get(f"/v1/runs/{failed['id']}/result?wait=20", headers=auth).json()
    assert got["status"] == "failed", got
    pages, offered = {}, {}
    for role in ("read", "operate", "admin"):
        page = pages[role] = browser.new_page()
        _sign_in(page, base, keys[role])
        for name, path in (
            ("live", f"/runs/{live['id']}"),
            ("failed", f"/runs/{failed['id']}"),
            ("letters", "/dead-letters"),
            ("switches", "/switches"),
        ):
            page.goto(f"{base}{path}")
            offered[role, name] = _offered(page)

    on_live = {"act:Cancel", "act:Suspend", "signal:Send signal", "approvals:Approve"}
    on_failed = {"act:Retry from the failed step", "replay:Replay", "resolve:Resolve"}
    admin_only = {"act:Terminate", "fork:Fork and compare"}
    assert on_live | admin_only <= offered["admin", "live"], offered["admin", "live"]
    assert (
        on_failed | admin_only - {"act:Terminate"} | {"complete:Complete step 1"}
        <= offered["admin", "failed"]
    ), offered["admin", "failed"]
    assert offered["admin", "switches"] == {"switches:Switch off"}
    # an operate key: no terminate, fork, complete step or switches (an admin's)
    assert offered["operate", "live"] == on_live | {"approvals:Reject"}
    assert offered["operate", "failed"] == on_failed
    assert offered["operate", "letters"] >= {"replay:Replay", "resolve:Resolve"}
    assert offered["operate", "switches"] == set()
    # a read key: nothing to press anywhere
    for name in ("live", "failed", "letters", "switches"):
        assert offered["read", name] == set(), (name, offered["read", name])
    # ... but it sees what there is, and why it is not offered
    reader, operator = pages["read"], pages["operate"]
    reader.goto(f"{base}/runs/{live['id']}")
    assert "Q4 plan" in reader.inner_text("#actions")  # the review's proposal
    assert len(reader.inner_text("#actions code.fp")) >= 16
    note = reader.inner_text("#actions .role-note")
    assert "read" in note and "operate" in note, note
    reader.goto(f"{base}/runs/{failed['id']}")
    assert "flaky" in reader.inner_text("#actions")  # the step an admin could complete
    reader.goto(f"{base}/approvals")
    assert "operate key" in reader.inner_text(".role-note")
    operator.goto(f"{base}/runs/{failed['id']}")
    assert "admin" in operator.inner_text("#actions .role-note")
    operator.goto(f"{base}/switches")
    assert "admin" in operator.inner_text(".role-note")
    # what a page does not offer is still refused when posted
    for page, refused in (
        (
            reader,
            [
                (f"/runs/{live['id']}/act", {"action": "cancel"}),
                (f"/runs/{live['id']}/signal", {"name": "x", "payload": "{}"}),
            ],
        ),
        (
            operator,
            [
                (f"/runs/{failed['id']}/complete", {"step": "1", "result": '"x"', "reason": "r"}),
                (f"/runs/{live['id']}/act", {"action": "terminate"}),
                ("/switches", {"off": "1", "kind": "activity", "name": "total"}),
            ],
        ),
    ):
        csrf = page.get_attribute("form[action='/logout'] input[name=csrf]", "value")
        for path, fields in refused:
            r = page.request.post(f"{base}{path}", form={"csrf": csrf, **fields})
            assert r.status == 403, (path, r.status, r.text())
    r = server.http.get(f"/v1/runs/{live['id']}", headers=auth).json()
    assert r["status"] == "running", r


def test_an_admin_flips_a_kill_switch_in_the_browser(
    served: tuple[Server, dict[str, str]], browser: Any
) -> None:
    server, keys = served
    base = f"http://127.0.0.1:{server.port}"
    page = browser.new_page()
    page.on("dialog", lambda d: d.accept())
    _sign_in(page, base, keys["admin"])
    page.goto(f"{base}/switches")
    page.select_option("form.switch-off select[name=kind]", "activity")
    page.fill("form.switch-off input[name=name]", "total")
    page.fill("form.switch-off input[name=reason]", "bad deploy")
    page.click("form.switch-off button[type=submit]")
    assert "activity total switched off by key" in page.inner_text(".message")
    assert "bad deploy" in page.inner_text("table.switches")
    admin = {"Authorization": f"Bearer {keys['admin']}"}
    assert [s["name"] for s in server.http.get("/v1/switches", headers=admin).json()] == ["total"]
    run = _start(server, keys["operate"], "bill", INVOICE)
    time.sleep(3)
    assert server.http.get(f"/v1/runs/{run['id']}", headers=admin).json()["status"] == "running"
    page.click("table.switches button:has-text('Switch on')")
    assert "switched on" in page.inner_text(".message")
    assert "switch off" in page.inner_text("table.audit")  # who did it, listed
    got = server.http.get(f"/v1/runs/{run['id']}/result?wait=30", headers=admin).json()
    assert got["result"]["total"] == 1100
    # an operate key may not flip switches: not offered, and refused when posted
    other = browser.new_page()
    other.on("dialog", lambda d: d.accept())
    _sign_in(other, base, keys["operate"])
    other.goto(f"{base}/switches")
    assert other.locator("main form").count() == 0
    assert "admin key" in other.inner_text(".role-note")
    csrf = other.get_attribute("form[action='/logout'] input[name=csrf]", "value")
    form = {"csrf": csrf, "off": "1", "kind": "activity", "name": "total"}
    assert other.request.post(f"{base}/switches", form=form).status == 403


def test_fork_with_another_model_and_compare_side_by_side(tmp_path: Path, browser: Any) -> None:
    from tether.testing import ModelServer, model_reply

    with ModelServer() as models:
        models.script("gpt-4o-mini", model_reply("a short outline"), model_reply("the essay"))
        server = Server(
            f"sqlite:///{tmp_path / 't.db'}",
            "--workers",
            "1",
            "--no-auth",
            env={"TETHER_TEST_MODEL_URL": models.base_url},
        )
        try:
            base = f"http://127.0.0.1:{server.port}"
            run = server.http.post(
                "/v1/workflows/two_answers/runs", json={"input": {"topic": "foxes"}}
            ).json()
            done = server.http.get(f"{run['links']['result']}?wait=20").json()
            assert done["result"] == "the essay"
            page = browser.new_page()
            page.on("dialog", lambda d: d.accept())
            page.goto(f"{base}/runs/{run['id']}")
            assert page.locator("table.grid >> text=storyteller").count() >= 1  # model calls
            # fork after the first step, the second calling pydantic-ai's test model
            page.fill("form.fork input[name=at_step]", "1")
            page.fill("form.fork input[name=models]", "storyteller=test")
            page.fill("form.fork input[name=prompts]", "write=v1")
            page.click("form.fork button[type=submit]")
            page.wait_for_url(f"{base}/compare?*")
            assert models.count() == 2  # the fork reused step 1: no third request
            page.wait_for_timeout(200)
            fork_id = page.url.split("b=")[1]
            server.http.get(f"/v1/runs/{fork_id}/result?wait=20")
            page.reload()
            assert "1 of 2 steps differ" in page.inner_text("#differing")
            rows = page.locator("table.compare tbody tr")
            assert "same" in (rows.nth(0).get_attribute("class") or "")
            assert "differs" in (rows.nth(1).get_attribute("class") or "")
            assert "a short outline" in rows.nth(0).inner_text()
            assert "the essay" in rows.nth(1).inner_text()
            assert "success" in rows.nth(1).inner_text()  # what the test model answered
            # each side names the prompt version its step rendered
            assert rows.nth(1).locator("td").nth(1).locator(".prompt").inner_text() == (
                "prompt write@v2"
            )
            assert rows.nth(1).locator("td").nth(3).locator(".prompt").inner_text() == (
                "prompt write@v1"
            )
            page.screenshot(path=str(ARTIFACTS / "console-compare.png"), full_page=True)
            # the fork's own page says what it was forked from, and links there
            page.goto(f"{base}/runs/{fork_id}")
            forked = page.locator("p.forked")
            assert f"Forked from {run['id']} at step 1" in forked.inner_text()
            forked.locator("a").click()
            page.wait_for_url(f"{base}/runs/{run['id']}")
            # the overview's ledger: every model call of today, once (the fork's two
            # steps count one: its first was reused)
            page.goto(f"{base}/")
            usage = page.locator("table.usage tbody tr")
            assert usage.count() == 1 and "(no tenant)" in usage.nth(0).inner_text()
            assert usage.nth(0).locator("td").nth(1).inner_text() == "90"  # 15 + 15 + 60
        finally:
            server.stop()


def test_pages_read_with_javascript_off_with_landmarks_and_labels(
    served: tuple[Server, dict[str, str]], browser: Any
) -> None:
    server, keys = served
    base = f"http://127.0.0.1:{server.port}"
    run = _start(server, keys["operate"], "bill", INVOICE)
    auth = {"Authorization": f"Bearer {keys['operate']}"}
    server.http.get(f"/v1/runs/{run['id']}/result?wait=20", headers=auth)
    context = browser.new_context(java_script_enabled=False)
    page = context.new_page()
    _sign_in(page, base, keys["operate"])  # a plain form post: no script needed
    for path in ("/", "/runs", f"/runs/{run['id']}", "/approvals", "/dead-letters", "/switches"):
        page.goto(f"{base}{path}")
        assert page.locator("header nav a").count() >= 5 and page.locator("main h1").count() == 1
        # every form control has a label (wrapping it) or is a hidden field or a button
        unlabelled = page.evaluate(
            """() => [...document.querySelectorAll('main input, main select, main textarea')]
                .filter(e => e.type !== 'hidden' && !e.closest('label') && !e.labels?.length
                        && !e.getAttribute('aria-label'))
                .map(e => e.name)"""
        )
        assert unlabelled == [], (path, unlabelled)
    page.goto(f"{base}/runs/{run['id']}")
    assert '"total": 1100' in page.inner_text("#live")
    assert page.locator("svg.timeline").count() == 1
    page.goto(f"{base}/runs")
    assert run["id"] in page.inner_text("#runs")
    context.close()


def test_a_run_stuck_on_non_determinism_says_so_on_its_page_and_in_the_list(
    tmp_path: Path, browser: Any
) -> None:
    """A deploy that cannot replay a run: its page shows the task error at the top,
    the runs list marks it, and the "stuck only" filter finds it."""
    store = f"sqlite:///{tmp_path / 't.db'}"
    import tether

    tether.App(store=store).store.close_sync()  # type: ignore[attr-defined]
    key = _create_key(store, "--role", "operate", "--tenant", "acme")
    _waiting_under_old_code(store, "stuck-1", tenant="acme")
    server = Server(store, "--workers", "1")
    try:
        base = f"http://127.0.0.1:{server.port}"
        auth = {"Authorization": f"Bearer {key}"}
        fine = _start(server, key, "bill", INVOICE)
        server.http.get(f"/v1/runs/{fine['id']}/result?wait=20", headers=auth)
        sent = server.http.post(
            "/v1/runs/stuck-1/signals/review", json={"verdict": "ok"}, headers=auth
        )
        assert sent.status_code == 202, sent.text
        deadline = time.monotonic() + 20
        while not server.http.get("/v1/runs/stuck-1", headers=auth).json().get("task_error"):
            assert time.monotonic() < deadline, "the run never failed its workflow task"
            time.sleep(0.1)
        page = browser.new_page()
        _sign_in(page, base, key)
        page.goto(f"{base}/runs/stuck-1")
        box = page.locator("#task-error")
        assert box.count() == 1 and box.get_attribute("role") == "alert"
        text = box.inner_text()
        assert "NonDeterminismError" in text and "ActivityScheduled('precheck')" in text
        # it comes before the timeline, where an operator looks first
        assert page.evaluate(
            "document.getElementById('task-error').compareDocumentPosition("
            "document.querySelector('svg.timeline')) & Node.DOCUMENT_POSITION_FOLLOWING"
        )
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "console-run-stuck.png"), full_page=True)
        page.goto(f"{base}/runs/{fine['id']}")
        assert page.locator("#task-error").count() == 0
        page.goto(f"{base}/runs")
        row = page.locator("#runs tr", has_text="stuck-1")
        assert row.locator(".badge.stuck").count() == 1
        assert "NonDeterminismError" in (row.locator(".badge.stuck").get_attribute("title") or "")
        assert page.locator("#runs tr", has_text=fine["id"]).locator(".badge.stuck").count() == 0
        page.check("input[name=stuck]")
        page.click("form.filters button[type=submit]")
        page.wait_for_url("**stuck=1**")
        shown = page.inner_text("#runs")
        assert "stuck-1" in shown and fine["id"] not in shown
    finally:
        server.stop()


def test_a_shared_console_secret_makes_replicas_accept_each_others_forms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TETHER_CONSOLE_SECRET: two processes (two loads of the module) sign alike."""
    import importlib

    from starlette.requests import Request

    from tether.server.console import _session

    def token() -> str:
        scope = {"type": "http", "headers": [(b"cookie", b"tether_console=k1")]}
        return _session.csrf_token(Request(scope))

    try:
        monkeypatch.setenv("TETHER_CONSOLE_SECRET", "shared by every replica")
        first = token() if importlib.reload(_session) else ""
        second = token() if importlib.reload(_session) else ""
        assert first == second
        monkeypatch.delenv("TETHER_CONSOLE_SECRET")
        importlib.reload(_session)
        assert token() != first  # a per-process secret otherwise
    finally:
        importlib.reload(_session)


def test_a_console_form_for_another_tenants_run_finds_nothing_whatever_the_role(
    served: tuple[Server, dict[str, str]], browser: Any
) -> None:
    """A read key's forms posted to another tenant's run, review or dead letter get the
    404 of one that never was; only its own tenant's get the role's 403. Before, the
    role was checked first, and the 403 told the key that the run existed."""
    server, keys = served
    base = f"http://127.0.0.1:{server.port}"
    theirs = _start(server, keys["other"], "review", {"input": {"title": "secret"}})
    mine = _start(server, keys["operate"], "approve", {"input": {"doc": "mine"}})
    admin = {"Authorization": f"Bearer {keys['admin']}"}
    review: dict[str, Any] = {}
    for _ in range(100):
        got = server.http.get(f"/v1/approvals?run_id={theirs['id']}", headers=admin).json()
        if got:
            review = got[0]
            break
        time.sleep(0.1)
    assert review, "the review did not open"
    page = browser.new_page()
    _sign_in(page, base, keys["read"])
    csrf = page.get_attribute("form[action='/logout'] input[name=csrf]", "value")
    forms = {
        "act": {"action": "cancel", "reason": "x"},
        "signal": {"name": "review", "payload": "{}"},
        "complete": {"step": "1", "result": "1", "reason": "x"},
        "fork": {"at_step": "1"},
    }
    for run, expected in ((theirs, 404), (mine, 403)):
        for path, fields in forms.items():
            status = page.request.post(
                f"{base}/runs/{run['id']}/{path}", form={"csrf": csrf, **fields}
            ).status
            assert status == expected, (path, run["id"], status)
    fields = {"csrf": csrf, "approve": "1", "by": "x", "fingerprint": review["fingerprint"]}
    posted = page.request.post(f"{base}/approvals/{review['approval_id']}", form=fields)
    assert posted.status == 404, posted.status
    # purged, another tenant's run is as missing for this key as one that never was
    ended = server.http.post(f"/v1/runs/{theirs['id']}/terminate", json={}, headers=admin)
    assert ended.status_code == 202, ended.text
    cli = [sys.executable, "-m", "tether.cli", "purge", "--older-than", "0s"]
    purge = subprocess.run(
        [*cli, "--store", server.store],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert purge.returncode == 0, purge.stderr
    assert server.http.get(f"/v1/runs/{theirs['id']}", headers=admin).status_code == 410
    for path, fields in forms.items():
        status = page.request.post(
            f"{base}/runs/{theirs['id']}/{path}", form={"csrf": csrf, **fields}
        ).status
        assert status == 404, (path, "purged", status)
