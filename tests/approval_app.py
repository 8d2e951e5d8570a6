"""A worker process for the approval crash test: ``python tests/approval_app.py DB EFFECTS``.

The incident workflow generates a remediation proposal (a step that counts itself in a
side table), asks for approval, and executes only an approved proposal (counted too).
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys

import tether
from helpers import shared_side_db

DB = sys.argv[1] if len(sys.argv) > 1 else "tether.db"
EFFECTS = sys.argv[2] if len(sys.argv) > 2 else "effects.db"

app = tether.App(store=f"sqlite:///{DB}")


def effects() -> sqlite3.Connection:
    return shared_side_db(EFFECTS, "CREATE TABLE IF NOT EXISTS effects (what TEXT, detail TEXT)")


@app.activity
def propose_fix(incident: str) -> dict[str, str]:
    """Generate a remediation (a model call in real life: never to be regenerated)."""
    effects().execute("INSERT INTO effects VALUES ('generated', ?)", (incident,))
    return {"incident": incident, "action": "restart the payment service"}


@app.activity
def execute_fix(action: str, approver: str) -> str:
    """Carry the approved remediation out (counted: it must happen exactly once)."""
    effects().execute("INSERT INTO effects VALUES ('executed', ?)", (f"{action} / {approver}",))
    return "done"


@app.workflow
async def incident(incident_id: str) -> str:
    """Propose, ask the on-call lead, execute only what was approved."""
    proposal = await propose_fix(incident_id)
    d = await tether.approval(proposal, approvers=["lead"], deadline=3600)
    if not d.approved or d.value is None or d.by is None:
        return "not executed"
    return await execute_fix(d.value["action"], d.by)


async def main() -> None:
    """Serve until killed (a 1 s lease, so a restarted worker takes over quickly)."""
    await app.worker(lease=1.0, poll_interval=0.05).run()


if __name__ == "__main__":
    asyncio.run(main())
