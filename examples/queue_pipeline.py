"""A queue-based pipeline: stages on their own queues with their own limits, fed by a
burst of 2,000 items; one poison item dead-letters and is replayed after a fix.

- ``extract`` runs at most 8 at a time (a CPU-bound parser); ``enrich`` is held to 400
  calls a second (a rate-limited API), shared by every worker of the store;
- each item is one run; its two steps are recorded, so a crash anywhere resumes it;
- one item is malformed: ``enrich`` refuses it (a non-retryable error), its run fails
  and lands in the dead letters while the other 1,999 go on; after the "fix" (here a
  flag; in life a deploy) the letter is replayed, and that run completes from its
  failed step (``extract`` is not run again).

    python examples/queue_pipeline.py     (TETHER_EXAMPLE_STORE: the store)
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

import tether

STORE = os.environ.get("TETHER_EXAMPLE_STORE") or f"{tempfile.mkdtemp()}/queues.db"
app = tether.App(store=STORE)
app.configure_queue("extract", max_concurrency=8)
app.configure_queue("enrich", rate=400, per=1.0, burst=50)

POISON = "item-1337"
FIXED = {"enrich": False}  # the "deploy" that makes enrich accept the poison item
EXTRACTED: dict[str, int] = {}  # how many times each item was extracted (the tests look)


@app.activity(queue="extract")
async def extract(item: str) -> dict[str, str]:
    """Parse an item (at most 8 at once, on every worker together)."""
    EXTRACTED[item] = EXTRACTED.get(item, 0) + 1
    await asyncio.sleep(0.001)
    return {"id": item, "text": item.replace("-", " ")}


@app.activity(queue="enrich", retry=tether.Retry(attempts=3, initial=0.05))
async def enrich(record: dict[str, str]) -> dict[str, str]:
    """Call a rate-limited API (400 a second); the poison item is refused for good."""
    if record["id"] == POISON and not FIXED["enrich"]:
        raise tether.NonRetryable(f"cannot enrich {record['id']}: unparseable record")
    return {**record, "topic": "news" if int(record["id"].split("-")[1]) % 2 else "sport"}


@app.workflow
async def pipeline(item: str) -> str:
    """One item through both stages."""
    return (await enrich(await extract(item)))["topic"]


async def main(items: int = 2_000) -> dict[str, object]:
    """Feed the burst, wait for every run, replay the dead letter after the fix."""
    t0 = time.perf_counter()
    async with app.worker(concurrency=200, poll_interval=0.05):
        runs = await asyncio.gather(
            *(app.start(pipeline, f"item-{i}", run_id=f"item-{i}") for i in range(items))
        )
        failed: list[str] = []
        for run in runs:
            try:
                await run.result(timeout=300)
            except tether.WorkflowFailedError:
                failed.append(run.run_id)
        burst_s = time.perf_counter() - t0
        letters = await app.dead_letters()
        FIXED["enrich"] = True  # the fix is deployed
        for letter in letters:
            if letter.kind == "run":
                await app.replay_dead_letter(letter.id)
        replayed = await app.get_run(POISON).result(timeout=60)
    return {
        "items": items,
        "failed_first": failed,
        "dead_letters": len(letters),
        "replayed": replayed,
        "burst_s": burst_s,
        "extracted_twice": [k for k, n in EXTRACTED.items() if n > 1],
    }


if __name__ == "__main__":
    out = asyncio.run(main())
    print(f"{out['items']} items in {out['burst_s']:.1f} s; failed at first: {out['failed_first']}")
    print(f"dead letters: {out['dead_letters']}; after the fix {POISON} is {out['replayed']!r}")
    print(f"steps extracted twice: {out['extracted_twice']}")
