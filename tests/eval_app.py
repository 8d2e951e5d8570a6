"""Targets for evaluation tests: a keyword "model" as an activity, a workflow, a function."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import tether

app = tether.App(store=":memory:")


@app.activity
def sentiment(text: str) -> str:
    """Right on obvious cases, wrong on sarcasm; raises on empty input."""
    if not text:
        raise ValueError("empty text")
    return "pos" if any(w in text for w in ("great", "love", "good")) else "neg"


@app.activity(retry=tether.Retry(attempts=2, initial=5.0, jitter=0))
async def slow_sentiment(text: str) -> str:
    await asyncio.sleep(0.02)
    return sentiment.fn(text)


@app.workflow
async def review(text: str) -> str:
    await tether.sleep(3600)  # skipped by the evaluation's Env
    return await slow_sentiment(text)


@dataclass
class Answer:
    label: str
    cost: float


def priced(text: str) -> Answer:
    return Answer(sentiment.fn(text), cost=0.002 * len(text.split()))
