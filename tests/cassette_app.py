"""An App for cassette tests: a support-ticket triage pipeline with a "model" step.

``make_app(store, variant)`` builds it; variants change the workflow code the way a
later deploy would (an extra call, other arguments, a skipped call).
"""

from __future__ import annotations

import tether

#: how many times each real activity ran (a replay must not add to it)
CALLS: dict[str, int] = {}


def make_app(store: str = ":memory:", variant: str = "v1") -> tether.App:
    app = tether.App(store=store)

    @app.activity
    def fetch_ticket(ticket_id: int) -> dict[str, str]:
        CALLS["fetch_ticket"] = CALLS.get("fetch_ticket", 0) + 1
        return {"id": str(ticket_id), "text": f"my order {ticket_id} never arrived"}

    @app.activity
    def classify(text: str, model: str = "small") -> str:
        CALLS["classify"] = CALLS.get("classify", 0) + 1
        return "shipping" if "arrived" in text else "other"

    @app.activity(retry=tether.Retry(attempts=2, initial=1.0, jitter=0))
    def notify(team: str) -> str:
        CALLS["notify"] = CALLS.get("notify", 0) + 1
        if team == "shipping":
            raise ValueError("pager quota exceeded")
        return f"paged {team}"

    @app.activity
    def summarise(text: str) -> str:
        CALLS["summarise"] = CALLS.get("summarise", 0) + 1
        return text[:10]

    @app.workflow
    async def triage(ticket_id: int, urgent: bool = False) -> dict[str, str]:
        ticket = await fetch_ticket(ticket_id)
        if variant == "skip":
            return {"label": "unknown", "paged": "no"}
        model = "large" if variant == "other-args" else "small"
        label = await classify(ticket["text"], model=model)
        if variant == "extra":
            await summarise(ticket["text"])
        await tether.sleep(3600)  # wait an hour before paging (skipped by the Env)
        approval = await tether.wait_event("approve", timeout=86400)
        try:
            paged = await notify(label)
        except tether.ActivityError as exc:
            paged = f"failed: {exc.error_type}: {exc.message}"
        return {"label": label, "paged": paged, "approved_by": str(approval)}

    return app
