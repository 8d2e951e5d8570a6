"""The examples run as a user runs them, and prove what they claim."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _example(name: str, store: Path, *args: str, timeout: float = 120) -> str:
    """Run ``examples/<name>.py ARGS`` on ``store`` as a user would; its stdout."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{name}.py"), *args],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "TETHER_EXAMPLE_STORE": str(store)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_breaking_news_out_of_order_duplicated_webhooks(tmp_path: Path) -> None:
    """Three articles, revisions 1-20 each delivered twice, shuffled, concurrently: each
    page ends at revision 20, no older revision is ever written after a newer one, and
    one controller per article counted all 40 webhooks."""
    store = tmp_path / "news.db"
    stdout = _example("breaking_news", store, str(store), timeout=300)
    lines = [line for line in stdout.splitlines() if line.startswith("story-")]
    assert len(lines) == 3
    for line in lines:
        assert "40 webhooks, page at revision 20" in line, line
        ignored = int(re.search(r"(\d+) stale or duplicate ignored", line).group(1))  # type: ignore[union-attr]
        assert ignored >= 20  # every duplicate, at least
    with sqlite3.connect(f"{store}.site.db") as conn:
        for article in ("story-0", "story-1", "story-2"):
            writes = [
                r
                for (r,) in conn.execute(
                    "SELECT revision FROM writes WHERE article = ? ORDER BY rowid", (article,)
                )
            ]
            assert writes == sorted(set(writes)) and writes[-1] == 20  # never backwards


def _invoice_batch(tmp_path: Path, *flags: str) -> str:
    return _example("invoice_batch", tmp_path / f"invoices{'-'.join(flags)}.db", *flags)


def test_invoice_batch_waits_for_review_fails_closed_and_posts_the_rest(tmp_path: Path) -> None:
    skipped = _invoice_batch(tmp_path)
    assert "INV-2: rejected: no decision by the deadline" in skipped
    assert "virtual time skipped: 3600 s" in skipped  # the hour passed on a virtual clock
    assert "ledger: ['INV-1', 'INV-3']" in skipped
    approved = _invoice_batch(tmp_path, "--approve")
    assert "INV-2: posted" in approved and "ledger: ['INV-1', 'INV-2', 'INV-3']" in approved


async def test_an_invoice_is_posted_once_whatever_the_crash_point(tmp_path: Path) -> None:
    os.environ["TETHER_EXAMPLE_STORE"] = str(tmp_path / "crash.db")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import importlib

        import invoice_batch

        invoice_batch = importlib.reload(invoice_batch)
    finally:
        sys.path.remove(str(ROOT / "examples"))
        del os.environ["TETHER_EXAMPLE_STORE"]
    from tether.testing import crash_at_every_step

    def reset() -> None:
        invoice_batch.LEDGER.clear()
        invoice_batch.POSTS.clear()

    report = await crash_at_every_step(
        invoice_batch.app,
        invoice_batch.post_invoice,
        invoice_batch.Invoice("INV-9", "umbrella", 2_500),
        effects=lambda: dict(invoice_batch.POSTS),
        reset=reset,
    )
    assert report.ok and report.crash_points >= 1, report  # before and after every write
    await invoice_batch.app.close()


def test_queue_pipeline_burst_poison_item_and_replay(tmp_path: Path) -> None:
    """2,000 items through two limited queues: the rate limit holds (the burst takes at
    least 2,000 / 400 s), the poison item dead-letters while the rest complete, and its
    replay after the fix completes it without extracting anything twice."""
    stdout = _example("queue_pipeline", tmp_path / "queues.db", timeout=300)
    first = stdout.splitlines()[0]
    seconds = float(re.search(r"in ([\d.]+) s", first).group(1))  # type: ignore[union-attr]
    assert seconds >= 4.5  # 2,000 enrich calls at 400 a second, less the burst of 50
    assert "failed at first: ['item-1337']" in first
    assert "after the fix item-1337 is 'news'" in stdout
    assert "steps extracted twice: []" in stdout


def test_parallel_analysis_degrades_on_optional_branches_only(tmp_path: Path) -> None:
    up, down, slow, required = _example("parallel_analysis", tmp_path / "a.db").splitlines()
    assert "'sentiment': -0.3" in up and "gaps" not in up
    assert "'gaps': ['sentiment: ActivityError']" in down and "'risk': 0.8" in down
    assert "no answer within 1 s" in slow
    assert required.startswith("failed:") and "required branch risk failed" in required


async def test_ticket_triage_repairs_gates_and_routes(tmp_path: Path) -> None:
    import tether

    store = tmp_path / "tickets.db"
    lines = dict(line.split(": ", 1) for line in _example("ticket_triage", store).splitlines())
    assert "'queue': 'billing'" in lines["T-1"]
    assert "'queue': 'tech', 'priority': 1" in lines["T-2"]  # repaired from 9
    assert "'queue': 'human'" in lines["T-3"]  # unsure: the safe default
    assert all("guarantee" not in v for v in lines.values())  # the gate held
    app = tether.App(store=str(store))
    try:
        history = await app.history("T-2")
    finally:
        await app.close()
    markers = [e.data.get("marker") for e in history if e.type is tether.EventType.MARKER]
    assert markers.count("output_invalid") == 1 and "route" in markers
    calls = [e for e in history if e.type is tether.EventType.ACTIVITY_COMPLETED]
    assert len(calls) == 5  # classify, its repair, a refused draft, the redraft, filing


def _incident(tmp_path: Path, *flags: str) -> str:
    return _example("incident_assistant", tmp_path / f"incident{len(flags)}.db", *flags)


def test_incident_assistant_needs_the_fingerprint_and_fails_closed(tmp_path: Path) -> None:
    approved = _incident(tmp_path)
    assert "refused:" in approved and "fingerprint does not match" in approved
    assert "'executed': 'rollback checkout@2026.12.04-3" in approved
    assert "executions by key: [1]" in approved  # once
    silent = _incident(tmp_path, "--no-answer")
    assert "'executed': None, 'why': 'no decision in 15 min'" in silent
    assert "executions by key: []" in silent  # fails closed: nothing ran


def _provision(tmp_path: Path, *flags: str) -> str:
    return _example("tenant_provisioning", tmp_path / f"provision{len(flags)}.db", *flags)


def test_tenant_provisioning_waves_cleanup_and_intervention(tmp_path: Path) -> None:
    ok = _provision(tmp_path)
    assert "acme is live" in ok and "creations per key: [1]" in ok
    assert "virtual time: 240 s" in ok  # polled on durable timers, skipped in the test
    failed = _provision(tmp_path, "--fail", "storage")
    assert "the provider failed to create acme-storage" in failed
    assert "left at the provider: []" in failed  # everything built was torn down
    stuck = _provision(tmp_path, "--fail", "storage", "--stuck-teardown")
    assert "RunNeedsInterventionError" in stuck and "teardown acme-network" in stuck
    assert "left at the provider: ['acme-network']" in stuck  # said, not hidden


def test_payment_recovery_never_charges_twice_and_trusts_the_ledger(tmp_path: Path) -> None:
    stdout = _example("payment_recovery", tmp_path / "billing.db")
    lines = dict(line.split(": ", 1) for line in stdout.splitlines())
    assert lines["ann"] == "cycle 3: paid"  # three cycles, continued as new
    assert lines["bo"] == "cycle 1: suspended"  # the callback's claim was checked
    charges = lines["charges"]
    # the timed-out charge was found in the ledger, not charged again (no ann:1:2)
    assert "'ann:1:1': 'captured'" in charges and "ann:1:2" not in charges
    assert "'ann:2:2': 'captured'" in charges and "'bo:1:1': 'declined'" in charges
    assert int(lines["virtual_days"]) >= 60  # two 30-day cycles on a virtual clock


def test_long_report_map_reduce_in_order_with_a_poison_chunk(tmp_path: Path) -> None:
    stdout = _example("long_report", tmp_path / "report.db")
    assert "{'chunks': 70, 'levels': 3, 'left_out': [13]}" in stdout  # 70 -> 9 -> 2 -> 1
    assert "summary has 69 sections, in order: True" in stdout  # the junk one left out


def test_a_durable_agent_killed_mid_loop_resumes_without_repeating_a_step(
    tmp_path: Path,
) -> None:
    """Example 10: SIGKILL after two recorded tool calls; the new worker goes on from the
    agent's recorded requests and tool calls: every tool once, the room reserved once,
    no recorded step executed again, only the lost request made twice."""
    stdout = _example("durable_agent", tmp_path / "agent.db")
    assert "killed the worker (SIGKILL) after 2 recorded tool calls" in stdout
    assert (
        "tool executions: ['forecast Lisbon', 'exchange_rate EUR', 'reserve_room Lisbon 3']"
        in stdout
    )
    assert "recorded steps executed again: 0" in stdout
    made, recorded = map(
        int, re.search(r"model requests: (\d+) made for (\d+) recorded", stdout).groups()
    )  # type: ignore[union-attr]
    assert recorded == 4 and recorded <= made <= recorded + 1  # at most the one in flight
    assert "reserved for ana" in stdout
