"""The demo's App: a document pipeline built on tether.ai.

extract -> classify (validated structured output, an allow-listed route with a
safe default) -> analyse by kind (fields of an invoice or a contract, triage of a
ticket, a map-reduce summary of a long report) -> validate -> a person approves
anything unsure -> publish once, by idempotency key.

Configured by environment, so the worker processes ``tether demo`` starts (``python
-m tether.demo.pipeline``) build the same App: ``TETHER_DEMO_STORE`` (the SQLite
file), ``TETHER_DEMO_PACE`` (1 paces the steps for a person to watch; 0.05 is the
fast mode), ``TETHER_DEMO_MODEL`` / ``TETHER_DEMO_BASE_URL`` (a real model instead
of the offline one). Every execution of a step is logged in a side table
(``<store>.side.db``) so the demo can prove no recorded step ran again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

import tether
from tether import ai

from ._offline import OFFLINE_MODEL_NAME, offline_model
from .documents import Document

STORE = Path(os.environ.get("TETHER_DEMO_STORE", "tether-demo.db"))
SIDE = Path(f"{STORE}.side.db")
PACE = float(os.environ.get("TETHER_DEMO_PACE", "1.0"))
MODEL = os.environ.get("TETHER_DEMO_MODEL") or None
BASE_URL = os.environ.get("TETHER_DEMO_BASE_URL") or None

#: the kinds of document the pipeline has an analysis for; anything else goes to review
KINDS = {"invoice", "contract", "ticket", "report"}
STAGES = ("extract", "classify", "analyse", "validate", "review", "publish")
REVIEWER = "reviewer"

app = tether.App(store=f"sqlite:///{STORE}")
gateway = ai.Gateway(
    app,
    retry=tether.Retry(attempts=4, initial=0.2, max_interval=2.0),
    timeout=120,
    # the offline model is priced like a small hosted model, so the cost column means
    # something; a real model is priced by genai-prices
    prices={OFFLINE_MODEL_NAME: ai.Price(input_per_mtok="0.15", output_per_mtok="0.60")},
)


def _model_spec() -> Any:
    if BASE_URL:
        return lambda: ai.openai_compatible(MODEL or "default", base_url=BASE_URL)
    if MODEL:
        return MODEL
    return lambda: offline_model(PACE, log_execution)


model = gateway.model("demo", _model_spec())


# the side table: what actually ran (the proof), and what was published -------------


@contextlib.contextmanager
def side_table() -> Iterator[sqlite3.Connection]:
    """The demo's own ledger beside the store (never touched by tether itself)."""
    conn = sqlite3.connect(SIDE, timeout=30, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS executions "
            "(run_id TEXT, step INTEGER, attempt INTEGER, name TEXT, at REAL)"
        )
        conn.execute(
            "CREATE TABLE IF NOT EXISTS published "
            "(key TEXT PRIMARY KEY, doc_id TEXT, body TEXT, deliveries INTEGER)"
        )
        yield conn
    finally:
        conn.close()


def log_execution(name: str) -> None:
    """Note that the current step is executing now (called at the start of each step)."""
    ctx = tether.activity_context()
    with side_table() as conn:
        conn.execute(
            "INSERT INTO executions VALUES (?, ?, ?, ?, ?)",
            (ctx.run_id, ctx.step, ctx.attempt, name, time.time()),
        )


# what the model returns, validated before anything trusts it -------------------------


class Classification(BaseModel):
    """The model's verdict on what a document is."""

    kind: str
    confidence: float = Field(ge=0, le=1)
    reason: str = ""


class InvoiceFields(BaseModel):
    number: str
    vendor: str
    currency: str
    lines: list[float]
    total: float


class ContractTerms(BaseModel):
    parties: list[str]
    term_months: int
    notice_days: int | None = None
    governing_law: str


class TicketTriage(BaseModel):
    team: str
    priority: int = Field(ge=1, le=4)
    customer: str


class Proposal(BaseModel):
    """What a reviewer sees and may edit before it is published."""

    doc_id: str
    kind: str
    summary: str
    details: dict[str, Any] = Field(default_factory=dict)


class Outcome(BaseModel):
    """What the pipeline returns for a document."""

    doc_id: str
    kind: str
    status: str
    confidence: float
    summary: str = ""
    reviewed_by: str | None = None
    problems: list[str] = Field(default_factory=list)


def _invoice_adds_up(inv: InvoiceFields) -> str | None:
    """A validation gate: the lines must add up to the total."""
    if abs(sum(inv.lines) - inv.total) > 0.005:
        return f"total {inv.total:.2f} is not the sum of the lines ({sum(inv.lines):.2f})"
    return None


# activities: the real work, recorded once done -----------------------------------------


@app.activity(retry=tether.Retry(attempts=4, initial=0.2, max_interval=2.0), timeout=30)
async def extract(doc: Document) -> str:
    """Stand-in OCR: normalise the text. The scanner times out once on ctr-0002."""
    log_execution("extract")
    await asyncio.sleep(0.5 * PACE)
    if doc.doc_id == "ctr-0002" and tether.activity_context().attempt == 1:
        raise TimeoutError("scanner timed out (transient: retried)")
    return "\n".join(" ".join(line.split()) for line in doc.text.splitlines())


@app.activity(timeout=30)
async def check(kind: str, details: dict[str, Any]) -> list[str]:
    """Business rules a model cannot be trusted with."""
    log_execution("check")
    await asyncio.sleep(0.2 * PACE)
    problems: list[str] = []
    if kind == "invoice" and details.get("currency") not in {"EUR", "USD", "GBP"}:
        problems.append(f"currency {details.get('currency')!r} is not one we pay in")
    if kind == "contract" and int(details.get("term_months") or 0) > 36:
        problems.append("a term over 36 months needs legal review")
    return problems


@app.activity(timeout=30)
async def publish(proposal: Proposal) -> str:
    """Publish downstream, once per idempotency key however often this step runs."""
    log_execution("publish")
    await asyncio.sleep(0.3 * PACE)
    key = tether.activity_context().idempotency_key
    with side_table() as conn:
        conn.execute(
            "INSERT INTO published VALUES (?, ?, ?, 1) "
            "ON CONFLICT(key) DO UPDATE SET deliveries = deliveries + 1",
            (key, proposal.doc_id, proposal.model_dump_json()),
        )
    return key


# the workflow: the control flow is code; the model proposes, code disposes ------------


def _stage(index: int, name: str, **extra: Any) -> None:
    tether.set_status({"stage": name, **extra})
    tether.set_progress(index, len(STAGES), unit="stages")


async def _summarise(chunk: str) -> str:
    return await ai.complete(
        model, f"Summarise this section in one sentence:\n\n{chunk}", prompt_version="sum-v1"
    )


async def _merge(parts: list[str]) -> str:
    listed = "\n".join(f"- {p}" for p in parts)
    return await ai.complete(
        model,
        f"Merge these summaries, in order, into one paragraph:\n{listed}",
        prompt_version="merge-v1",
    )


async def _analyse(kind: str, text: str) -> tuple[str, dict[str, Any]]:
    """The branch for the document's kind: a summary line and the extracted details."""
    if kind == "invoice":
        inv: InvoiceFields = await ai.structured(
            model,
            f"Extract the invoice fields:\n\n{text}",
            output=InvoiceFields,
            validate=_invoice_adds_up,
            max_repairs=2,
            prompt_version="invoice-v1",
        )
        return (
            f"{inv.vendor} invoice {inv.number}: {inv.total:.2f} {inv.currency}",
            inv.model_dump(),
        )
    if kind == "contract":
        terms: ContractTerms = await ai.structured(
            model, f"Extract the contract terms:\n\n{text}", output=ContractTerms
        )
        parties = " and ".join(terms.parties)
        return (
            f"{parties}, {terms.term_months} months, {terms.governing_law} law",
            terms.model_dump(),
        )
    if kind == "ticket":
        triage: TicketTriage = await ai.structured(
            model, f"Triage this support ticket:\n\n{text}", output=TicketTriage
        )
        return f"to {triage.team}, priority {triage.priority}", triage.model_dump()
    if kind == "report":
        chunks = ai.chunk_text(text, max_chars=700)
        merged = await ai.map_reduce(chunks, map=_summarise, reduce=_merge, fan_in=3)
        details = {"chunks": len(chunks), "levels": merged.levels}
        return merged.value[:400], details
    return " ".join(text.split())[:120], {}


@app.workflow
async def process_document(doc: Document) -> Outcome:
    """One document through the pipeline; unsure results wait for a person."""
    _stage(0, "extract")
    text = await extract(doc)
    _stage(1, "classify")
    verdict: Classification = await ai.structured(
        model,
        f"What kind of document is this (invoice, contract, ticket, report)?\n\n{text}",
        output=Classification,
        max_repairs=1,
        default=Classification(kind="unknown", confidence=0.0, reason="no valid answer"),
        prompt_version="classify-v2",
    )
    kind = tether.route(
        verdict.kind,
        KINDS,
        default="review",
        confidence=verdict.confidence,
        min_confidence=0.6,
        name="doc_kind",
        evidence=verdict.reason,
    )
    _stage(2, "analyse", kind=kind)
    summary, details = await _analyse(kind, text)
    _stage(3, "validate", kind=kind)
    problems = await check(kind, details)
    proposal = Proposal(doc_id=doc.doc_id, kind=kind, summary=summary, details=details)
    reviewed_by: str | None = None
    if kind == "review" or verdict.confidence < 0.75 or problems:
        _stage(4, "review", kind=kind, problems=problems)
        decision = await tether.approval(
            proposal,
            approvers=[REVIEWER],
            deadline=timedelta(days=2),
            allow_edit=True,
            default="reject",
            name="publish",
        )
        if not decision.approved or decision.value is None:
            _stage(6, "rejected", kind=kind)
            return Outcome(
                doc_id=doc.doc_id,
                kind=kind,
                status="rejected",
                confidence=verdict.confidence,
                summary=summary,
                reviewed_by=decision.by,
                problems=problems,
            )
        proposal, reviewed_by = decision.value, decision.by
    _stage(5, "publish", kind=proposal.kind)
    await publish(proposal)
    _stage(6, "published", kind=proposal.kind)
    return Outcome(
        doc_id=doc.doc_id,
        kind=proposal.kind,
        status="published",
        confidence=verdict.confidence,
        summary=proposal.summary,
        reviewed_by=reviewed_by,
        problems=problems,
    )


async def _serve() -> None:
    """A worker process (``python -m tether.demo.pipeline``): a short lease, so the work
    of a killed worker is taken over within two seconds."""
    await app.worker(lease=2.0, poll_interval=0.05, concurrency=16).run()


if __name__ == "__main__":
    asyncio.run(_serve())
