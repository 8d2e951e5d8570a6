"""The App the HTTP API tests serve: ``tether serve serve_app:app`` with TETHER_TEST_STORE."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from typing import Any

from pydantic import BaseModel

import tether

app = tether.App(store=os.environ["TETHER_TEST_STORE"])


class Invoice(BaseModel):
    number: str
    cents: int


@app.activity
def total(invoice: Invoice, vat: float) -> int:
    logging.getLogger("serve_app").info("pricing invoice", extra={"invoice": invoice.number})
    return round(invoice.cents * (1 + vat))


@app.activity
def slow_step(seconds: float) -> str:
    time.sleep(seconds)
    return "slow done"


@app.workflow
async def bill(invoice: Invoice, vat: float = 0.2) -> dict[str, int | str]:
    """Price an invoice."""
    return {"number": invoice.number, "total": await total(invoice, vat)}


@app.workflow
async def approve(doc: str) -> str:
    tether.set_status({"stage": "waiting for review"})
    decision = await tether.wait_event("review", timeout=3600)
    return f"{doc}: {decision['verdict'] if decision else 'rejected'}"


@app.activity(retry=tether.Retry(attempts=1))
def flaky(flag: str) -> str:
    """Fails while the file ``flag`` exists (the test removes it to "fix" the step)."""
    if os.path.exists(flag):
        raise RuntimeError(f"flag {flag} is up")
    return "fixed"


@app.workflow
async def fragile(flag: str) -> str:
    return await flaky(flag)


@app.activity(retry=tether.Retry(attempts=3, initial=3600, max_interval=3600))
def flaky_later(flag: str) -> str:
    """Fails while the file ``flag`` exists, and waits an hour before its next try."""
    if os.path.exists(flag):
        raise RuntimeError(f"flag {flag} is up")
    return "fixed"


@app.workflow
async def patient(flag: str) -> str:
    """Waits for ``go``, then calls a step whose retries wait an hour."""
    await tether.wait_event("go")
    return await flaky_later(flag)


@app.workflow
async def batch(number: str) -> dict[str, int | str]:
    """Bills one invoice in a child run (its id: ``<this run's id>/1``)."""
    return await bill(Invoice(number=number, cents=100), 0.0)


@app.workflow
async def counted(items: int) -> int:
    """Reports progress by item."""
    for i in range(items):
        tether.set_progress(i, items, unit="items")
        await total(Invoice(number=str(i), cents=100), 0.0)
    tether.set_progress(items, items, unit="items")
    return items


@app.workflow
async def slow(seconds: float) -> str:
    return await slow_step(seconds)


@app.activity
def hold_room(title: str) -> str:
    return f"room for {title}"


@app.activity(retry=tether.Retry(attempts=1))
def release_room(hold: str, flag: str) -> None:
    """The compensation: fails while the file ``flag`` exists."""
    if os.path.exists(flag):
        raise RuntimeError(f"flag {flag} is up")


@app.workflow
async def booking(title: str, flag: str) -> str:
    """Approved, then waits to ship; a cancel releases the room (which may fail)."""
    await tether.approval({"title": title}, approvers=["ann"], deadline=3600, name="booking")
    async with tether.saga() as saga:
        await saga.step(hold_room(title), undo=lambda hold: release_room(hold, flag))
        await tether.wait_event("ship")
    return "shipped"


@app.entity
class Tally:
    """An entity: one counter per key."""

    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n


def _positive(k: int) -> None:
    if k <= 0:
        raise ValueError("k must be > 0")


@app.workflow
async def counter(start: int) -> int:
    """Counts what updates add until told to stop; its total is a query."""
    total = {"n": start}
    tether.on_query("total", lambda: total["n"])

    @tether.on_update("add", validate=_positive)
    def add(k: int) -> int:
        total["n"] += k
        return total["n"]

    await tether.wait_event("stop")
    return total["n"]


@app.workflow
async def review(title: str) -> str:
    """Ask a person to approve a title (editable)."""
    d = await tether.approval(
        {"title": title}, approvers=["ann"], deadline=3600, allow_edit=True, name="title"
    )
    return f"{d.value['title']} approved by {d.by}" if d.approved and d.value else "rejected"


if os.environ.get("TETHER_TEST_MODEL_URL"):  # a scripted model server the test started
    from tether import ai

    gateway = ai.Gateway(
        app,
        retry=tether.Retry(attempts=2, initial=0.1),
        timeout=float(os.environ.get("TETHER_TEST_MODEL_TIMEOUT", "10")),
    )
    storyteller = gateway.model(
        "storyteller",
        ai.openai_compatible(
            "gpt-4o-mini", base_url=os.environ["TETHER_TEST_MODEL_URL"], api_key="sk-test"
        ),
    )

    @app.workflow
    async def tell(topic: str) -> str:
        """A streamed model step: tokens on the event stream, the answer in history."""
        await tether.wait_event("go")  # the test follows the stream first
        return await ai.complete(storyteller, f"tell me about {topic}", stream=True)

    write = gateway.prompt(
        "write", {"v1": "write it from: {first}", "v2": "write an essay from: {first}"}
    )

    @app.workflow
    async def two_answers(topic: str) -> str:
        """Two model steps, the second building on the first (forked in the tests)."""
        first = await ai.complete(storyteller, f"outline {topic}")
        return await ai.complete(storyteller, write.render(first=first))


@app.activity
async def hold(flag: str, log: str) -> str:
    """Waits (cancellably) while the file ``flag`` exists; notes each attempt in ``log``.

    Only a log in the temp directory is written: the API fuzzing tests start this
    workflow with made-up paths, which once left stray files in tests/."""
    if os.path.realpath(log).startswith(os.path.realpath(tempfile.gettempdir()) + os.sep):
        with open(log, "a") as f:
            f.write(f"{tether.activity_context().attempt}\n")
    while os.path.exists(flag):
        await asyncio.sleep(0.05)
    return "held"


@app.workflow
async def holding(flag: str, log: str) -> str:
    return await hold(flag, log)


@app.workflow
async def again(left: int) -> int:
    """Continues as new ``left`` times (a chain: ``<id>``, ``<id>~1``, ...)."""
    if left > 0:
        return tether.continue_as_new(left - 1)
    return 0


@app.workflow
async def careful(flag: str) -> str:
    """Catches its step's failure and goes on: that step's dead letter is not replayed."""
    try:
        return await flaky(flag)
    except tether.ActivityError:
        return "handled"


@app.workflow
async def cart() -> list[Any]:
    """Collects the payloads of ``add`` signals until one is null."""
    items: list[Any] = []
    while (item := await tether.wait_event("add")) is not None:
        items.append(item)
    return items


if os.environ.get("TETHER_TEST_STRUCTURED"):  # the structured-replay test's deploy
    from tether import ai as _ai

    class Person(BaseModel):  # this deploy removed ``age``
        name: str

    class People(BaseModel):
        people: dict[str, Person]

    _census = _ai.Gateway(app, name="census", retry=tether.Retry(attempts=1))
    _reader = _census.model("reader", _ai.ScriptedModel([]))

    @app.workflow
    async def census(text: str) -> str:
        got = await _ai.structured(_reader, text, output=People)
        await tether.wait_event("go", timeout=3600)
        return ",".join(got.people)
