"""The main example: a document-processing AI pipeline on the embedded SQLite store.

Each document is extracted, classified by a (scripted, offline) model, routed,
summarised and mined for entities in parallel, held for human review when the
model is unsure (failing closed if nobody answers), then published with an
idempotency key. Runs are stored in ./tether.db: kill this script at any point
and run it again, and every run continues from its last recorded step.

    python examples/document_pipeline.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time

import tether

app = tether.App()  # embedded default: SQLite file ./tether.db

PUBLISHED: dict[str, str] = {}  # stands in for a downstream system keyed by idempotency key


@dataclasses.dataclass
class Document:
    """What a caller submits."""

    doc_id: str
    text: str


@dataclasses.dataclass
class Classification:
    """The model's structured answer."""

    category: str
    confidence: float


@dataclasses.dataclass
class Outcome:
    """What the pipeline returns."""

    doc_id: str
    status: str
    category: str
    summary: str = ""
    entities: list[str] = dataclasses.field(default_factory=list)


@app.activity(retry=tether.Retry(attempts=4, initial=0.2, max_interval=2.0))
def extract_text(doc: Document) -> str:
    """Pretend OCR: normalise whitespace."""
    time.sleep(0.05)
    return " ".join(doc.text.split())


@app.activity(timeout=30)
async def classify(text: str) -> Classification:
    """A scripted model call: keywords decide, with a confidence."""
    await asyncio.sleep(0.05)
    lowered = text.lower()
    if "invoice" in lowered:
        return Classification("invoice", 0.93)
    if "agreement" in lowered or "contract" in lowered:
        return Classification("contract", 0.88)
    return Classification("generic", 0.41)


@app.activity
async def summarize(text: str) -> str:
    """A scripted summary: the first eight words."""
    await asyncio.sleep(0.05)
    return " ".join(text.split()[:8]) + "..."


@app.activity
async def extract_entities(text: str) -> list[str]:
    """Capitalised words stand in for named entities."""
    await asyncio.sleep(0.05)
    return sorted({w.strip(".,") for w in text.split() if w[:1].isupper()})


@app.activity
def publish(doc_id: str, summary: str) -> str:
    """Write once per idempotency key, however often the step is retried."""
    key = tether.activity_context().idempotency_key
    PUBLISHED.setdefault(key, f"{doc_id}: {summary}")
    return key


@app.workflow
async def process_document(doc: Document) -> Outcome:
    """Extract, classify, route, summarise, review if unsure, publish."""
    tether.set_status({"stage": "extracting"})
    text = await extract_text(doc)
    cls = await classify(text)
    category = cls.category if cls.category in {"invoice", "contract"} else "generic"
    tether.set_status({"stage": "analysing", "category": category})
    summary, entities = await tether.gather(summarize(text), extract_entities(text))
    if cls.confidence < 0.6:
        tether.set_status({"stage": "awaiting review", "category": category})
        tether.logger.info("low confidence %.2f: waiting for a reviewer", cls.confidence)
        decision = await tether.wait_event("review", timeout=3600)
        if decision is None or not decision.get("approved"):
            return Outcome(doc.doc_id, "rejected", category)  # no answer: fail closed
    await publish(doc.doc_id, summary)
    tether.set_status({"stage": "done", "category": category})
    return Outcome(doc.doc_id, "published", category, summary, entities)


DOCS = [
    Document("inv-001", "Invoice 4411 from Acme Corp to Globex for 12 widgets, due in 30 days."),
    Document("ctr-002", "Services Agreement between Initech and Umbrella, effective March."),
    Document("memo-003", "Team lunch moved to Friday at Luigi's, bring ideas for Q3."),
]


async def main() -> None:
    """Start one run per document, approve the one waiting for review, print outcomes."""
    async with app.worker():
        runs = [await app.start(process_document, d, run_id=f"doc-{d.doc_id}") for d in DOCS]
        for _ in range(200):  # a reviewer approves whatever is waiting
            info = await app.get("doc-memo-003")
            if info.is_finished:
                break
            if (info.custom_status or {}).get("stage") == "awaiting review":
                await app.signal("doc-memo-003", "review", {"approved": True})
                break
            await asyncio.sleep(0.05)
        for run in runs:
            out = await run.result(timeout=60)
            info = await run.info()
            print(
                f"{run.run_id:16} {info.status.value:10} {out.category:9} {out.status:10} "
                f"{out.summary}"
            )
        history = await app.history("doc-memo-003")
        print(f"\nhistory of doc-memo-003: {len(history)} events")
        for ev in history:
            print(f"  {ev.seq:3} {ev.type.value:24} step={ev.step}")
    await app.close()


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
