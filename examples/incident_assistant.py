"""An incident assistant: collect evidence in parallel, propose a remediation, wait for
the on-call engineer's approval with a deadline, then execute it exactly once.

- evidence (metrics, logs, recent deploys) is gathered in parallel, each a recorded
  step;
- the proposal is saved with a stable id and a fingerprint (a hash of its content):
  an approval must name that fingerprint, so nobody approves a proposal that changed
  under their eyes; an approval for another fingerprint is refused and recorded;
- no decision within the deadline fails closed: nothing is executed;
- the remediation runs under an execution key (the step's idempotency key): the
  runbook system applies a key once, whatever retries and crashes happen.

    python examples/incident_assistant.py     (TETHER_EXAMPLE_STORE: the store)
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any

import tether
import tether.testing

STORE = os.environ.get("TETHER_EXAMPLE_STORE") or f"{tempfile.mkdtemp()}/incidents.db"
app = tether.App(store=STORE)

EXECUTED: dict[str, int] = {}  # the runbook system: executions by execution key


@app.activity
async def error_rate(service: str) -> float:
    return 0.31


@app.activity
async def recent_logs(service: str) -> list[str]:
    return ["OOMKilled x12 in 10 min", "heap at 98%"]


@app.activity
async def last_deploy(service: str) -> dict[str, str]:
    return {"version": "2026.12.04-3", "at": "09:12"}


@app.activity(retry=tether.Retry(attempts=5, initial=0.05))
def execute(action: dict[str, Any]) -> str:
    """Apply a remediation once per execution key (a repeat is acknowledged, not redone)."""
    key = tether.activity_context().idempotency_key
    EXECUTED[key] = EXECUTED.get(key, 0) + (0 if key in EXECUTED else 1)
    return f"{action['action']} {action['target']} (key {key})"


@app.workflow
async def incident(service: str) -> dict[str, Any]:
    rate, logs, deploy = await tether.gather(
        error_rate(service), recent_logs(service), last_deploy(service)
    )
    proposal = {
        "action": "rollback",
        "target": f"{service}@{deploy['version']}",
        "because": f"error rate {rate:.0%} since the {deploy['at']} deploy; {logs[0]}",
    }
    decision = await tether.approval(
        proposal, approvers=["ann", "bo"], deadline=900, name="remediation"
    )
    if not decision.approved:
        return {
            "executed": None,
            "why": "no decision in 15 min" if decision.timed_out else f"rejected by {decision.by}",
        }
    return {"executed": await execute(decision.value), "approved_by": decision.by}


async def main(answer: str) -> dict[str, Any]:
    """``answer``: "approve" (first with a stale fingerprint, refused), or "none"."""
    async with tether.testing.Env(app, skip_time=answer == "none"):
        run = await app.start(incident, "checkout")
        if answer == "approve":
            review = None
            for _ in range(1000):
                if opened := await app.approvals(status="open"):
                    review = opened[0]
                    break
                await asyncio.sleep(0.01)
            assert review is not None
            try:  # approving what the engineer saw an hour ago: another fingerprint
                await app.decide(review.approval_id, approve=True, by="ann", fingerprint="0" * 16)
            except tether.ApprovalError as exc:
                print(f"refused: {exc}")
            await app.decide(
                review.approval_id, approve=True, by="ann", fingerprint=review.fingerprint
            )
        result: dict[str, Any] = await run.result(timeout=30)
    return result


if __name__ == "__main__":
    import sys

    print(asyncio.run(main("none" if "--no-answer" in sys.argv else "approve")))
    print(f"executions by key: {list(EXECUTED.values())}")
