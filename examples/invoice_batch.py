"""An invoice batch: a child run per invoice; a large one waits for finance's approval
with a deadline while the others post; no decision by the deadline rejects it.

Posting to the ledger is keyed by an idempotency key (the step's own), so a crash
between the ledger's answer and tether's record of it never posts twice: the ledger
here is a dict keyed like a real one would be. ``tests/test_examples.py`` crashes an
invoice's run at every store write and checks each invoice is posted exactly once.

    python examples/invoice_batch.py [--approve]     (TETHER_EXAMPLE_STORE: the store)
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from dataclasses import dataclass

import tether
import tether.testing

STORE = os.environ.get("TETHER_EXAMPLE_STORE") or f"{tempfile.mkdtemp()}/invoices.db"
app = tether.App(store=STORE)

LEDGER: dict[str, dict[str, object]] = {}  # idempotency key -> posting (a real ledger API)
POSTS: dict[str, int] = {}  # how many times each key was applied (for the tests)
REVIEW_ABOVE = 10_000  # cents: larger invoices need finance's approval


@dataclass
class Invoice:
    """One invoice of the batch."""

    number: str
    customer: str
    cents: int


@app.activity(retry=tether.Retry(attempts=5, initial=0.1))
def post_to_ledger(invoice: Invoice) -> str:
    """Post once per idempotency key: the ledger ignores a repeat of a key it knows."""
    key = tether.activity_context().idempotency_key
    POSTS[key] = POSTS.get(key, 0) + (0 if key in LEDGER else 1)
    LEDGER.setdefault(key, {"invoice": invoice.number, "cents": invoice.cents})
    return key


@app.workflow
async def post_invoice(invoice: Invoice) -> str:
    """Post one invoice; a large one first needs finance's approval (fails closed)."""
    if invoice.cents > REVIEW_ABOVE:
        decision = await tether.approval(
            {"invoice": invoice.number, "customer": invoice.customer, "cents": invoice.cents},
            approvers=["finance"],
            deadline=3600,
            name="large-invoice",
        )
        if not decision.approved:
            return (
                "rejected: no decision by the deadline"
                if decision.timed_out
                else (f"rejected by {decision.by}")
            )
    await post_to_ledger(invoice)
    return "posted"


@app.workflow
async def invoice_batch(invoices: list[Invoice]) -> dict[str, str]:
    """A child run per invoice, in parallel: a wait for review holds up nobody else."""
    outcomes = await tether.gather(
        *(post_invoice.options(run_id=f"{tether.info().run_id}/{i.number}")(i) for i in invoices)
    )
    return {i.number: o for i, o in zip(invoices, outcomes, strict=True)}


BATCH = [
    Invoice("INV-1", "acme", 1_200),
    Invoice("INV-2", "globex", 48_000),  # needs review
    Invoice("INV-3", "initech", 3_400),
]


async def main(approve: bool) -> dict[str, str]:
    """Run the batch on a time-skipping clock: the review's hour passes at once unless
    ``approve``, in which case finance approves it as soon as it opens."""
    # when finance will answer, time stands still until it has; else it skips ahead
    async with tether.testing.Env(app, skip_time=not approve) as env:
        run = await app.start(invoice_batch, BATCH, run_id="batch-2026-12")
        if approve:
            open_: list[tether.Approval] = []
            for _ in range(1000):
                open_ = await app.approvals(status="open")
                if open_:
                    break
                await asyncio.sleep(0.01)
            review = open_[0]
            await app.decide(
                review.approval_id, approve=True, by="finance", fingerprint=review.fingerprint
            )
        result: dict[str, str] = await run.result(timeout=30)
        print(f"virtual time skipped: {env.skipped:.0f} s")
    return result


if __name__ == "__main__":
    outcome = asyncio.run(main(approve="--approve" in sys.argv))
    for number, status in outcome.items():
        print(f"{number}: {status}")
    print(f"ledger: {sorted(v['invoice'] for v in LEDGER.values())}")
