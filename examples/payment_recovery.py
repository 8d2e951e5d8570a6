"""Subscription payment recovery, one billing cycle per run (continue-as-new).

- A charge that times out is *not* a decline: the money may have moved. The run asks
  the payment provider's ledger by the charge's idempotency key before trying again,
  and never charges a card twice.
- The provider's callback ("payment succeeded") is a hint, not the truth: on a
  callback the run looks the charge up in the ledger before believing it.
- A declined card gets one reminder and a grace period (3 days, on a durable timer);
  a card updated within it is charged again; no update by then suspends the account.
- Each cycle continues as new, so a subscription's history never grows without bound.

    python examples/payment_recovery.py     (TETHER_EXAMPLE_STORE: the store)
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any

import tether
import tether.testing

STORE = os.environ.get("TETHER_EXAMPLE_STORE") or f"{tempfile.mkdtemp()}/billing.db"
app = tether.App(store=STORE)

#: the payment provider: its ledger by idempotency key, and how each call behaves
LEDGER: dict[str, dict[str, Any]] = {}
SCRIPT: dict[str, list[str]] = {}  # cycle -> outcomes of successive charge attempts
NOTICES: list[str] = []


@app.activity(retry=tether.Retry(attempts=1))
def charge(customer: str, cycle: int, cents: int, key: str) -> str:
    """Charge the card. The provider applies a key once; a timeout may have applied it."""
    script = SCRIPT.get(f"{customer}:{cycle}")
    outcome = script.pop(0) if script else "ok"
    if outcome in ("ok", "timeout"):
        LEDGER.setdefault(key, {"cents": cents, "status": "captured"})
    if outcome == "timeout":
        raise TimeoutError("no answer from the provider in 30 s")  # but it went through
    if outcome == "declined":
        LEDGER.setdefault(key, {"cents": cents, "status": "declined"})
        return "declined"
    return "captured"


@app.activity
def ledger_status(key: str) -> str | None:
    """The provider's record of a charge by its key: the truth after a timeout."""
    entry = LEDGER.get(key)
    return None if entry is None else str(entry["status"])


#: customers who update their card as soon as they are told (the simulation)
PROMPT_PAYERS = {"ann"}


@app.activity
async def notify(customer: str, message: str) -> None:
    """Send the customer a message; a prompt payer updates the card at once (a signal
    to the subscription's live run, buffered until the run waits for it)."""
    NOTICES.append(f"{customer}: {message}")
    if customer in PROMPT_PAYERS and "declined" in message:
        await app.signal(f"sub-{customer}", "card_updated", {"last4": "4242"})


async def collect(customer: str, cycle: int, cents: int, attempt: int) -> str:
    """One charge attempt, reconciled by key when the answer is lost."""
    key = f"{customer}:{cycle}:{attempt}"  # one key per attempt: a retry is a new charge
    try:
        return await charge(customer, cycle, cents, key)
    except tether.ActivityError as exc:
        if exc.error_type != "TimeoutError":
            raise
        known = await ledger_status(key)  # in doubt: ask, do not guess, do not charge again
        return known or "not charged"


@app.workflow
async def subscription(customer: str, cycle: int = 1, cents: int = 1_900) -> str:
    outcome = await collect(customer, cycle, cents, attempt=1)
    hint = await tether.wait_event("provider_callback", timeout=60)
    if hint is not None and outcome != "captured":  # a callback claims success: check it
        outcome = await ledger_status(f"{customer}:{cycle}:1") or outcome
    if outcome != "captured":
        await notify(customer, "your card was declined: update it within 3 days")
        updated = await tether.wait_event("card_updated", timeout=3 * 86_400)
        if updated is None:
            await notify(customer, "account suspended: no payment")
            return f"cycle {cycle}: suspended"
        outcome = await collect(customer, cycle, cents, attempt=2)
        if outcome != "captured":
            return f"cycle {cycle}: suspended (declined again)"
    if cycle < 3:  # the next billing cycle, afresh
        await tether.sleep(30 * 86_400)
        tether.continue_as_new(customer, cycle + 1, cents)
    return f"cycle {cycle}: paid"


async def main() -> dict[str, Any]:
    SCRIPT.update(
        {
            "ann:1": ["timeout"],  # the answer is lost, but the charge went through
            "ann:2": ["declined", "ok"],  # declined, card updated, paid
            "bo:1": ["declined"],  # declined, never updated: suspended
        }
    )
    async with tether.testing.Env(app) as env:
        ann = await app.start(subscription, "ann", run_id="sub-ann")
        bo = await app.start(subscription, "bo", run_id="sub-bo")
        # a forged or confused callback claims bo paid: the ledger says otherwise
        await app.signal("sub-bo", "provider_callback", {"status": "succeeded"})
        results = {"ann": await ann.result(timeout=60), "bo": await bo.result(timeout=60)}
        results["virtual_days"] = round(env.skipped / 86_400)
    results["charges"] = {k: v["status"] for k, v in sorted(LEDGER.items())}
    results["notices"] = list(NOTICES)
    return results


if __name__ == "__main__":
    for key, value in asyncio.run(main()).items():
        print(f"{key}: {value}")
