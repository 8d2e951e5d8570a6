"""tether.approval on both stores, on a virtual clock moved by hand (deadlines are hours).

What is proved: a decision must name the proposal and its fingerprint and come from an
approver (others are recorded and refused); an edit is validated against the proposal's
type before the run continues with it; no decision by the last deadline fails closed;
reminders and escalation happen on time; a decision recorded before the deadline wins;
open reviews are listed (by approver) and a review of an ended run reads closed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import tether
from tether import EventType
from tether.testing import Env
from tether.workflow._approval import fingerprint_of

HOUR = 3600.0
HERE = Path(__file__).parent
#: polls of 0.02 s: 20 s for what takes several commits on a loaded PostgreSQL (CI's
#: 2-core VM at half speed); a poll returns as soon as its condition holds
POLLS = 1000


class Post(BaseModel):
    title: str
    words: int


def markers(history: list[tether.Event], name: str) -> list[dict[str, Any]]:
    return [
        e.data["value"]
        for e in history
        if e.type is EventType.MARKER and e.data.get("marker") == name
    ]


async def open_review(app: tether.App, run_id: str) -> tether.Approval:
    for _ in range(POLLS):
        reviews = await app.approvals(run_id=run_id)
        if reviews:
            return reviews[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"run {run_id} opened no review")


async def waits(app: tether.App, run_id: str, marker: str, n: int = 1) -> list[dict[str, Any]]:
    for _ in range(POLLS):
        found = markers(await app.history(run_id), marker)
        if len(found) >= n:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"run {run_id} recorded no {marker} (x{n})")


def register(app: tether.App) -> tether.Workflow[[Post], str]:
    notes: list[dict[str, Any]] = []

    @app.activity
    async def notify(review: dict[str, Any]) -> None:
        notes.append(review)

    @app.workflow
    async def publish(post: Post) -> str:
        d = await tether.approval(
            post,
            approvers=["alice"],
            deadline=HOUR,
            remind_before=600,
            escalate_to=[(["bob"], 2 * HOUR)],
            allow_edit=True,
            notify=notify,
        )
        if not d.approved:
            return f"rejected ({'timeout' if d.timed_out else d.by})"
        assert d.value is not None
        return f"published {d.value.title} ({d.value.words}) by {d.by}"

    publish.notes = notes  # type: ignore[attr-defined]
    return publish


async def test_a_decision_must_name_the_proposal_and_come_from_an_approver(
    app: tether.App,
) -> None:
    publish = register(app)
    async with Env(app, skip_time=False):
        run = await app.start(publish, Post(title="Q3", words=900), run_id="post-1")
        review = await open_review(app, "post-1")
        assert review.status == "open" and review.approvers == ["alice"]
        assert review.proposal == {"title": "Q3", "words": 900}
        assert [r.approval_id for r in await app.approvals(approver="alice")] == [
            review.approval_id
        ]
        assert await app.approvals(approver="mallory") == []
        # another fingerprint: recorded, refused, and the caller is told
        with pytest.raises(tether.ApprovalError, match="fingerprint does not match"):
            await app.decide(review.approval_id, approve=True, by="alice", fingerprint="0" * 32)
        # the right fingerprint from someone not asked: recorded, refused, and the
        # caller is told (before, it was accepted silently: HTTP 202 "accepted")
        with pytest.raises(tether.ApprovalError, match="'mallory' is not among its approvers"):
            await app.decide(
                review.approval_id, approve=True, by="mallory", fingerprint=review.fingerprint
            )
        refused = await waits(app, "post-1", "approval_refused", 2)
        assert "fingerprint" in refused[0]["reason"]
        assert "'mallory' is not an approver" in refused[1]["reason"]
        assert (await app.get("post-1")).status is tether.RunStatus.RUNNING
        await app.decide(
            review.approval_id, approve=True, by="alice", fingerprint=review.fingerprint
        )
        assert await run.result(timeout=10) == "published Q3 (900) by alice"
    done = await app.get_approval(review.approval_id)
    assert (done.status, done.decided_by) == ("approved", "alice")
    assert await app.approvals() == []  # nothing open
    decided = markers(await app.history("post-1"), "approval_decided")
    assert decided[0]["by"] == "alice" and decided[0]["approved"] is True
    with pytest.raises(tether.ApprovalError, match="no longer open"):
        await app.decide(review.approval_id, approve=False, by="alice", fingerprint="x")
    with pytest.raises(tether.ApprovalError, match="no such review"):
        await app.get_approval("nope:1")


async def test_an_edit_is_validated_then_the_run_continues_with_it(app: tether.App) -> None:
    publish = register(app)
    async with Env(app, skip_time=False):
        run = await app.start(publish, Post(title="draft", words=10), run_id="post-2")
        review = await open_review(app, "post-2")
        fp = review.fingerprint
        await app.decide(
            review.approval_id,
            approve=True,
            by="alice",
            fingerprint=fp,
            value={"title": "Final", "words": "many"},
        )
        refused = await waits(app, "post-2", "approval_refused")
        assert "edited proposal is invalid" in refused[0]["reason"]
        assert "words" in refused[0]["reason"]
        await app.decide(
            review.approval_id,
            approve=True,
            by="alice",
            fingerprint=fp,
            value={"title": "Final", "words": 12},
            reason="tightened the title",
        )
        assert await run.result(timeout=10) == "published Final (12) by alice"
    history = await app.history("post-2")
    assert markers(history, "approval_requested")[0]["proposal"] == {"title": "draft", "words": 10}
    decided = markers(history, "approval_decided")[0]
    assert decided["edited"] is True and decided["value"] == {"title": "Final", "words": 12}
    assert decided["reason"] == "tightened the title"


async def test_an_edit_not_of_the_proposals_shape_is_refused_at_once(app: tether.App) -> None:
    """An edit that lacks a field of the proposal's type (or is no object) is refused by
    ``App.decide`` itself, recording nothing, and the review stays open; one of the right
    shape with a wrong value is still the run's to refuse (the previous test)."""
    publish = register(app)
    async with Env(app, skip_time=False):
        run = await app.start(publish, Post(title="draft", words=10), run_id="post-9")
        review = await open_review(app, "post-9")
        for value, why in (({"words": 12}, "lacks 'title'"), (["Final"], "must be an object")):
            with pytest.raises(tether.ApprovalEditError, match=why) as refused:
                await app.decide(
                    review.approval_id,
                    approve=True,
                    by="alice",
                    fingerprint=review.fingerprint,
                    value=value,
                )
            assert 'it must be {"title": ..., "words": ...}' in str(refused.value)
            assert (await app.get_approval(review.approval_id)).status == "open"
        await app.decide(
            review.approval_id,
            approve=True,
            by="alice",
            fingerprint=review.fingerprint,
            value={"title": "Final", "words": 12},
        )
        assert await run.result(timeout=10) == "published Final (12) by alice"
    history = await app.history("post-9")
    assert not markers(history, "approval_refused")
    assert markers(history, "approval_requested")[0]["edit_schema"]["required"] == [
        "title",
        "words",
    ]


async def test_no_decision_reminds_escalates_then_fails_closed(app: tether.App) -> None:
    publish = register(app)
    async with Env(app, skip_time=False) as env:
        run = await app.start(publish, Post(title="t", words=1), run_id="post-3")
        review = await open_review(app, "post-3")
        await env.advance(HOUR - 600 + 1)  # the reminder is due 10 minutes before
        await waits(app, "post-3", "approval_reminder")
        assert (await app.get_approval(review.approval_id)).reminded_at is not None
        await env.advance(600)  # alice's hour is over: bob's turn
        escalated = await waits(app, "post-3", "approval_escalated")
        assert escalated[0]["approvers"] == ["bob"]
        now = await app.get_approval(review.approval_id)
        assert (now.level, now.approvers) == (1, ["bob"])
        with pytest.raises(tether.ApprovalError, match="'alice' is not among its approvers"):
            await app.decide(
                review.approval_id, approve=True, by="alice", fingerprint=now.fingerprint
            )
        await waits(app, "post-3", "approval_refused")  # alice may no longer decide
        await env.advance(2 * HOUR - 600 + 1)
        await waits(app, "post-3", "approval_reminder", 2)
        await env.advance(600)
        assert await run.result(timeout=10) == "rejected (timeout)"
    assert (await app.get_approval(review.approval_id)).status == "expired_rejected"
    events = [n["event"] for n in publish.notes]  # type: ignore[attr-defined]
    assert events == ["opened", "reminder", "escalated", "reminder"]


async def test_a_reminder_due_while_notify_still_ran_is_sent_late(app: tether.App) -> None:
    """A slow ``notify`` (here: the "opened" message retried after 51 minutes) used to
    swallow the reminder that fell due meanwhile; the reviewer is now reminded late."""
    notes: list[str] = []
    failed: list[str] = []

    @app.activity(retry=tether.Retry(attempts=2, initial=3060, max_interval=3060, jitter=0))
    async def notify(review: dict[str, Any]) -> None:
        if review["event"] == "opened" and not failed:
            failed.append("once")
            raise ConnectionError("mail server down")
        notes.append(review["event"])

    @app.workflow
    async def ask(post: Post) -> bool:
        d = await tether.approval(
            post, approvers=["alice"], deadline=HOUR, remind_before=600, notify=notify
        )
        return d.approved

    async with Env(app, skip_time=False) as env:
        run = await app.start(ask, Post(title="t", words=5), run_id="post-late")
        review = await open_review(app, "post-late")
        # the first "opened" message failed and its retry is due in 51 minutes: moving
        # the clock before the failure was recorded would put the retry 51 minutes
        # after the new time (seen by the history's ActivityAttemptFailed, not by the
        # activity's own ``failed``, which is set before the worker records anything)
        for _ in range(POLLS):
            history = await app.history("post-late")
            if any(e.type is EventType.ACTIVITY_ATTEMPT_FAILED for e in history):
                break
            await asyncio.sleep(0.02)
        assert failed
        await env.advance(3060 + 1)  # past the reminder's moment, before the deadline
        reminded = await waits(app, "post-late", "approval_reminder")
        assert reminded[0]["level"] == 0
        await app.decide(
            review.approval_id, approve=True, by="alice", fingerprint=review.fingerprint
        )
        assert await run.result(timeout=10) is True
    assert notes == ["opened", "reminder"]
    history = await app.history("post-late")
    assert [e.data["patch_id"] for e in history if e.type is EventType.PATCH_MARKER] == [
        "tether.approval-late-reminder"
    ]


async def test_a_decision_recorded_before_the_deadline_wins(app: tether.App) -> None:
    publish = register(app)
    async with Env(app, skip_time=False) as env:
        run = await app.start(publish, Post(title="t", words=2), run_id="post-4")
        review = await open_review(app, "post-4")
        await env.advance(HOUR - 1)
        await waits(app, "post-4", "approval_reminder")
        await app.decide(
            review.approval_id, approve=False, by="alice", fingerprint=review.fingerprint
        )
        await env.advance(2)  # the deadline passes right after the decision arrived
        assert await run.result(timeout=10) == "rejected (alice)"
    history = await app.history("post-4")
    assert markers(history, "approval_escalated") == []
    assert markers(history, "approval_decided")[0]["timed_out"] is False


async def test_a_review_of_an_ended_run_is_closed(app: tether.App) -> None:
    publish = register(app)
    async with Env(app, skip_time=False):
        await app.start(publish, Post(title="t", words=3), run_id="post-5")
        review = await open_review(app, "post-5")
        await app.terminate("post-5", "withdrawn")
        closed = await app.get_approval(review.approval_id)
        assert closed.status == "closed"
        assert await app.approvals() == []
        with pytest.raises(tether.ApprovalError, match="closed"):
            await app.decide(
                review.approval_id, approve=True, by="alice", fingerprint=review.fingerprint
            )


async def test_two_decisions_at_once_one_is_taken_the_other_refused(
    app: tether.App, store_url: str
) -> None:
    """Two operators (two processes) decide one review at the same moment: the first
    one recorded is taken; the other is refused (ApprovalError, 409 over HTTP) and
    never reaches the run, so the run, the audit log and the caller all agree."""
    publish = register(app)
    other = tether.App(store=store_url)
    worker = app.worker(lease=5.0, poll_interval=0.05)  # polls: sees other's commits
    await worker.start()
    try:
        for trial in range(3):
            run = await app.start(publish, Post(title="t", words=trial), run_id=f"race-{trial}")
            review = await open_review(app, run.run_id)
            got = await asyncio.gather(
                app.decide(
                    review.approval_id, approve=True, by="alice", fingerprint=review.fingerprint
                ),
                other.decide(
                    review.approval_id,
                    approve=False,
                    by="alice",
                    fingerprint=review.fingerprint,
                ),
                return_exceptions=True,
            )
            refused = [g for g in got if isinstance(g, BaseException)]
            assert len(refused) == 1, got
            assert isinstance(refused[0], tether.ApprovalError), refused
            # refused while the first is on its way, or once the run took it
            assert "another decision was recorded first" in str(
                refused[0]
            ) or "no longer open" in str(refused[0])
            approved = got[0] is None
            result = await run.result(timeout=10)
            assert result == (f"published t ({trial}) by alice" if approved else "rejected (alice)")
            signals = [
                e for e in await app.history(run.run_id) if e.type is EventType.SIGNAL_RECEIVED
            ]
            assert len(signals) == 1
            done = await app.get_approval(review.approval_id)
            assert done.status == ("approved" if approved else "rejected")
    finally:
        await worker.stop(grace=2.0)
        if other._store is not None:
            other._store.close_sync()  # type: ignore[attr-defined]


async def test_a_refused_edit_reopens_the_review_and_one_pending_blocks_others(
    app: tether.App,
) -> None:
    """A decision on its way to the run holds the review (``deciding``): a second one
    is refused meanwhile; if the run refuses the first (an invalid edit), the review
    opens again for a valid decision."""
    publish = register(app)
    async with Env(app, skip_time=False):
        run = await app.start(publish, Post(title="draft", words=10), run_id="post-6")
        review = await open_review(app, "post-6")
        await app.suspend("post-6")
        fp = review.fingerprint
        await app.decide(
            review.approval_id,
            approve=True,
            by="alice",
            fingerprint=fp,
            value={"title": "draft", "words": "x"},
        )
        pending = await app.get_approval(review.approval_id)
        assert (pending.status, pending.decided_by) == ("deciding", "alice")
        assert await app.approvals() == []  # no longer open to others
        with pytest.raises(tether.ApprovalError, match="another decision was recorded first"):
            await app.decide(review.approval_id, approve=False, by="alice", fingerprint=fp)
        await app.resume("post-6")
        refused = await waits(app, "post-6", "approval_refused")
        assert "edited proposal is invalid" in refused[0]["reason"]
        reopened = await app.get_approval(review.approval_id)
        assert (reopened.status, reopened.decided_by) == ("open", None)
        await app.decide(review.approval_id, approve=False, by="alice", fingerprint=fp)
        assert await run.result(timeout=10) == "rejected (alice)"


async def test_approval_outside_a_workflow_is_refused() -> None:
    with pytest.raises(tether.NotInWorkflowError):
        await tether.approval(Post(title="t", words=1), deadline=60)


async def test_invoice_review_one_of_eight_waits_while_the_others_finish(
    app: tether.App,
) -> None:
    """The guide's invoice case: only the doubtful invoice waits for a person; a stale
    decision (an older proposal's fingerprint) is refused; an approval just before the
    deadline wins, and without one the invoice fails closed."""

    @app.activity
    async def extract(doc: str) -> dict[str, Any]:
        return {"doc": doc, "total": 100 * len(doc), "confidence": 0.4 if "?" in doc else 0.95}

    @app.activity
    async def book(invoice: dict[str, Any]) -> str:
        return f"booked {invoice['doc']}"

    @app.workflow
    async def one_invoice(doc: str) -> str:
        invoice = await extract(doc)
        if invoice["confidence"] < 0.6:
            d = await tether.approval(invoice, approvers=["clerk"], deadline=HOUR)
            if not d.approved:
                return f"held {doc}"
        return await book(invoice)

    @app.workflow
    async def batch(docs: list[str]) -> list[str]:
        outcomes = await tether.map(one_invoice, docs, concurrency=8)
        return [o.value if o.ok else f"error {o.error}" for o in outcomes]

    docs = [f"inv-{i}" for i in range(7)] + ["inv-7?"]
    async with Env(app, skip_time=False) as env:
        for run_id in ("early", "late"):
            await app.start(batch, docs, run_id=run_id)
        for run_id in ("early", "late"):
            review = await open_review(app, f"{run_id}/8")
            # the seven others finish while the review is open
            for _ in range(POLLS):
                children = [await app.get(f"{run_id}/{k}") for k in range(1, 9)]
                done = [c for c in children if c.status is tether.RunStatus.COMPLETED]
                if len(done) == 7:
                    break
                await asyncio.sleep(0.02)
            assert len(done) == 7, [c.status for c in children]
            assert children[7].status is tether.RunStatus.RUNNING
            stale = fingerprint_of({**review.proposal, "total": 1})
            with pytest.raises(tether.ApprovalError, match="fingerprint"):
                await app.decide(review.approval_id, approve=True, by="clerk", fingerprint=stale)
        await env.advance(HOUR - 5)
        early = await open_review(app, "early/8")
        await app.decide(early.approval_id, approve=True, by="clerk", fingerprint=early.fingerprint)
        await waits(app, "early/8", "approval_decided")
        await env.advance(10)  # both deadlines pass
        assert (await (app.get_run("early")).result(timeout=10))[7] == "booked inv-7?"
        late = await app.get_run("late").result(timeout=10)
    assert late[:7] == [f"booked inv-{i}" for i in range(7)] and late[7] == "held inv-7?"
    for run_id in ("early", "late"):
        refused = markers(await app.history(f"{run_id}/8"), "approval_refused")
        assert len(refused) == 1 and "fingerprint" in refused[0]["reason"]


async def test_incident_proposal_survives_sigkill_and_only_the_approved_one_runs_once(
    tmp_path: Path,
) -> None:
    """SIGKILL the worker once the proposal is generated and the review open: the new
    worker never regenerates it, and the approved proposal is executed exactly once."""
    db, effects = tmp_path / "tether.db", tmp_path / "effects.db"
    sys.path.insert(0, str(HERE))
    try:
        import approval_app
    finally:
        sys.path.remove(str(HERE))
    client = tether.App(store=f"sqlite:///{db}")
    client._workflows["incident"] = approval_app.incident
    run = await client.start(approval_app.incident, "INC-7", run_id="inc-7")
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent / 'src'}{os.pathsep}{HERE}"}

    def worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(HERE / "approval_app.py"), str(db), str(effects)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    first = worker()
    try:
        review = await open_review(client, "inc-7")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    assert first.returncode == -signal.SIGKILL
    second = worker()
    try:
        await client.decide(
            review.approval_id, approve=True, by="lead", fingerprint=review.fingerprint
        )
        assert await run.result(timeout=60) == "done"
    finally:
        second.terminate()
        second.wait(10)
    conn = sqlite3.connect(effects)
    rows = conn.execute("SELECT what, detail FROM effects ORDER BY rowid").fetchall()
    conn.close()
    assert rows == [
        ("generated", "INC-7"),
        ("executed", "restart the payment service / lead"),
    ]
    decided = markers(await client.history("inc-7"), "approval_decided")
    assert decided[0]["by"] == "lead"
    await client.close()


async def test_a_decision_after_the_deadline_is_refused_even_while_no_worker_runs(
    app: tether.App,
) -> None:
    """A review fails closed at its deadline: a decision sent after it, while no worker
    has processed the deadline's timer yet, is refused (not delivered) and the default
    decides when a worker comes back."""

    @app.workflow
    async def late(title: str) -> str:
        d = await tether.approval({"title": title}, approvers=["ann"], deadline=1.0)
        return "timeout" if d.timed_out else ("approved" if d.approved else "rejected")

    async with app.worker(poll_interval=0.05):
        run = await app.start(late, "Q3", run_id="late-1")
        review = await open_review(app, "late-1")
    await asyncio.sleep(max(0.0, review.deadline_at - time.time()) + 0.3)
    with pytest.raises(tether.ApprovalError, match="past its deadline"):
        await app.decide(review.approval_id, approve=True, by="ann", fingerprint=review.fingerprint)
    assert not [e for e in await app.history("late-1") if e.type is EventType.SIGNAL_RECEIVED]
    async with app.worker(poll_interval=0.05):
        assert await run.result(timeout=30) == "timeout"
    assert (await app.get_approval(review.approval_id)).status == "expired_rejected"


async def test_an_edit_of_a_review_that_allows_none_is_refused_at_once(app: tether.App) -> None:
    """An edit where edits are not allowed is refused by ``decide`` (recorded, like a wrong
    fingerprint) and never holds the review: a valid decision goes through right after."""

    @app.workflow
    async def plain(title: str) -> str:
        d = await tether.approval({"title": title}, approvers=["ann"], deadline=HOUR)
        return f"{d.approved} {d.value}"

    async with app.worker(poll_interval=0.05):
        run = await app.start(plain, "Q3", run_id="noedit-1")
        review = await open_review(app, "noedit-1")
        with pytest.raises(tether.ApprovalError, match="does not allow edits"):
            await app.decide(
                review.approval_id,
                approve=True,
                by="ann",
                fingerprint=review.fingerprint,
                value={"title": "Q4"},
            )
        assert (await app.get_approval(review.approval_id)).status == "open"
        await app.decide(review.approval_id, approve=True, by="ann", fingerprint=review.fingerprint)
        assert await run.result(timeout=30) == "True {'title': 'Q3'}"
    (refused,) = markers(await app.history("noedit-1"), "approval_refused")
    assert "does not allow edits" in refused["reason"] and not refused.get("held")


def test_a_proposal_type_with_aliases_records_no_edit_schema() -> None:
    """A field with an alias may be sent by its name too (``populate_by_name``), which a
    JSON Schema cannot say: ``decide`` must not refuse such an edit the run accepts, so
    no schema is recorded for it (the run validates its edits)."""
    from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

    from tether.workflow import _approval

    class Aliased(BaseModel):
        model_config = ConfigDict(populate_by_name=True)
        title: str = Field(alias="Title")

    assert _approval.edit_schema(TypeAdapter(Aliased)) is None
    assert TypeAdapter(Aliased).validate_python({"title": "by name"}).title == "by name"
    assert _approval.edit_schema(TypeAdapter(Post)) is not None
