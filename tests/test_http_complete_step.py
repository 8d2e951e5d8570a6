"""``POST /v1/runs/{id}/steps/{step}/complete`` over a real socket (``tether serve`` in a
subprocess), on both stores: an operator records an in-doubt step's result."""

from __future__ import annotations

import time
from pathlib import Path

from test_http_api import Server, _create_key


def test_an_operator_completes_the_failed_step_of_a_run_which_then_finishes(
    store_url: str, tmp_path: Path
) -> None:
    import tether

    tether.App(store=store_url).store.close_sync()  # type: ignore[attr-defined]  # the store
    operator = _create_key(store_url, "--role", "operate", "--tenant", "acme", "--name", "desk")
    admin = _create_key(store_url, "--role", "admin", "--name", "oncall")
    flag = tmp_path / "broken"
    flag.write_text("up")  # the step fails while it exists (and it is never removed)
    server = Server(store_url, "--workers", "1")
    try:
        http = server.http

        def as_(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        started = http.post(
            "/v1/workflows/fragile/runs", json={"input": {"flag": str(flag)}}, headers=as_(operator)
        )
        run_id = started.json()["id"]
        done = http.get(f"/v1/runs/{run_id}/result?wait=20", headers=as_(admin)).json()
        assert done["status"] == "failed", done
        url = f"/v1/runs/{run_id}/steps/1/complete"
        body = {"result": "done by hand", "reason": "checked at the provider"}

        refused = http.post(url, json=body, headers=as_(operator))
        assert refused.status_code == 403, refused.text  # an admin's act, not its tenant's
        assert refused.headers["content-type"] == "application/problem+json"
        no_reason = http.post(url, json={"result": "x"}, headers=as_(admin))
        assert no_reason.status_code == 422, no_reason.text
        assert no_reason.headers["content-type"] == "application/problem+json"
        no_step = http.post(f"/v1/runs/{run_id}/steps/7/complete", json=body, headers=as_(admin))
        assert no_step.status_code == 409, no_step.text
        assert "has no step 7" in no_step.json()["detail"]
        missing = http.post("/v1/runs/nope/steps/1/complete", json=body, headers=as_(admin))
        assert missing.status_code == 404, missing.text

        wrong = http.post(url, json={**body, "result": 42}, headers=as_(admin))
        assert wrong.status_code == 400, wrong.text  # flaky returns a str
        assert "result of step 1 (flaky)" in wrong.json()["detail"]

        accepted = http.post(url, json=body, headers=as_(admin))
        assert accepted.status_code == 202, accepted.text
        assert accepted.json()["id"] == run_id
        deadline = time.monotonic() + 20
        while (out := http.get(f"/v1/runs/{run_id}/result?wait=5", headers=as_(admin)).json()).get(
            "status"
        ) != "completed":
            assert time.monotonic() < deadline, out
        assert out["result"] == "done by hand"  # the step did not run (its flag is up)

        again = http.post(url, json=body, headers=as_(admin))
        assert again.status_code == 409, again.text
        assert again.headers["content-type"] == "application/problem+json"
        assert "already completed by key" in again.json()["detail"]

        history = http.get(f"/v1/runs/{run_id}/history", headers=as_(admin)).json()
        events = history["events"] if isinstance(history, dict) else history
        completed = [e for e in events if e["type"] == "ActivityCompleted" and e.get("step") == 1]
        assert len(completed) == 1
        assert completed[0]["data"]["operator"].startswith("key ")
        assert completed[0]["data"]["reason"] == "checked at the provider"
        trail = http.get(f"/v1/runs/{run_id}/audit", headers=as_(admin)).json()
        (entry,) = [e for e in trail if e["action"] == "complete step"]
        assert entry["actor"].startswith("key ")
        assert entry["detail"] == {
            "step": 1,
            "activity": "flaky",
            "reason": "checked at the provider",
            "reopened": True,
        }
    finally:
        server.stop()
