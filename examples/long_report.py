"""Map-reduce summarisation of a long report with a hierarchical reduce.

The report is cut into chunks; each chunk is summarised by a model call (a recorded
step: a crash re-runs none that answered); the summaries are merged eight at a time,
level after level, always in the report's order, until one is left. A chunk the model
cannot handle (here: one full of binary junk) is left out and named, not silently
dropped; too many such chunks fail the run.

The model is offline and answers from the text (clearly not a real model): a chunk's
summary is its first sentence; a merge joins summaries.

    python examples/long_report.py     (TETHER_EXAMPLE_STORE: the store)
"""

from __future__ import annotations

import asyncio
import os
import tempfile

import tether
from tether import ai

STORE = os.environ.get("TETHER_EXAMPLE_STORE") or f"{tempfile.mkdtemp()}/report.db"
app = tether.App(store=STORE)


@app.activity(retry=tether.Retry(attempts=2, initial=0.05))
def summarise_chunk(chunk: str) -> str:
    """A model call on one chunk (offline: its first sentence, or a refusal)."""
    if "\x00" in chunk:
        raise tether.NonRetryable("the chunk is not text")
    return chunk.split(". ")[0].strip().rstrip(".") + "."


@app.activity
def merge(summaries: list[str]) -> str:
    """A model call merging summaries, in order (offline: joins them)."""
    return " ".join(summaries)


@app.workflow
async def summarise_report(report: str) -> dict[str, object]:
    chunks = ai.chunk_text(report, max_chars=200)  # a section each, here
    result = await ai.map_reduce(
        chunks, map=summarise_chunk, reduce=merge, concurrency=8, fan_in=8, min_success=0.9
    )
    return {
        "chunks": len(chunks),
        "levels": result.levels,
        "left_out": [f.index for f in result.failed],
        "summary": result.value,
    }


def report(sections: int = 70, junk_at: int = 13) -> str:
    """A long report: numbered sections, one of them junk."""
    parts = []
    for i in range(sections):
        if i == junk_at:
            parts.append("\x00\x01 corrupted scan " * 10)
        else:
            parts.append(
                f"Section {i} finds that cost {i} fell. The rest of section {i} gives the "
                f"details of how and why, over several sentences of analysis."
            )
    return "\n\n".join(parts)


async def main() -> dict[str, object]:
    async with app.worker(poll_interval=0.05):
        run = await app.start(summarise_report, report())
        out: dict[str, object] = await run.result(timeout=120)
    return out


if __name__ == "__main__":
    result = asyncio.run(main())
    summary = str(result.pop("summary"))
    print(result)
    print(f"summary starts: {summary[:120]}...")
    numbers = [int(part.split()[0]) for part in summary.split("Section ")[1:]]
    print(f"summary has {len(numbers)} sections, in order: {numbers == sorted(numbers)}")
