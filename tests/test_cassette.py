"""tether.testing.Cassette: a finished run's activity calls as a regression test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import cassette_app
import tether
from tether.testing import Cassette, CassetteMismatch, Env

EXPECTED = {
    "label": "shipping",
    "paged": "failed: ValueError: pager quota exceeded",
    "approved_by": "ada",
}


async def _record(app: tether.App) -> tuple[str, list[tether.Event]]:
    """Run triage(42, urgent=True) to completion (approved by ada) and return its history."""
    async with Env(app):
        run = await app.start("triage", 42, kwargs={"urgent": True})
        await run.signal("approve", "ada")
        assert await run.result(timeout=10) == EXPECTED
    return run.run_id, await app.history(run.run_id)


@pytest.fixture
async def recorded() -> Cassette:
    app = cassette_app.make_app()
    _, events = await _record(app)
    await app.close()
    return Cassette.from_history(events)


async def test_from_history_captures_calls_results_failures_and_input(
    recorded: Cassette,
) -> None:
    c = recorded
    assert c.workflow == "triage"
    assert c.input == {"args": [42], "kwargs": {"urgent": True}}
    assert c.status == "completed" and c.result == EXPECTED
    # step 3 is the sleep's timer (the signal was already there: the wait needed none)
    assert [(x.step, x.name) for x in c.calls] == [
        (1, "fetch_ticket"),
        (2, "classify"),
        (4, "notify"),
    ]
    fetch, classify, notify = c.calls
    assert fetch.args == {"args": [42], "kwargs": {}}
    assert fetch.result == {"id": "42", "text": "my order 42 never arrived"}
    assert classify.args == {"args": ["my order 42 never arrived"], "kwargs": {"model": "small"}}
    assert classify.result == "shipping" and classify.error is None
    assert notify.error is not None and notify.error["type"] == "ValueError"
    assert c.signals == [{"name": "approve", "payload": "ada"}]


async def test_save_and_load_round_trip(recorded: Cassette, tmp_path: Path) -> None:
    path = tmp_path / "case.json"
    recorded.save(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "tether-cassette/1"
    again = Cassette.load(path)
    assert again == recorded


async def test_replay_answers_from_the_cassette_without_running_activities(
    recorded: Cassette,
) -> None:
    before = dict(cassette_app.CALLS)
    app = cassette_app.make_app()
    assert await recorded.replay(app, require_all=True) == EXPECTED
    assert before == cassette_app.CALLS  # nothing real ran: every answer came from the tape
    await app.close()


async def test_replay_reports_a_call_the_cassette_does_not_have(recorded: Cassette) -> None:
    app = cassette_app.make_app(variant="extra")
    with pytest.raises(CassetteMismatch, match=r"'summarise'.*no unused recorded call"):
        await recorded.replay(app)


async def test_replay_reports_other_arguments_unless_told_not_to(recorded: Cassette) -> None:
    app = cassette_app.make_app(variant="other-args")
    with pytest.raises(CassetteMismatch, match=r"'classify' was called with .*'large'"):
        await recorded.replay(app)
    assert await recorded.replay(app, check_args=False) == EXPECTED


async def test_replay_require_all_reports_unused_calls(recorded: Cassette) -> None:
    app = cassette_app.make_app(variant="skip")
    assert await recorded.replay(app) == {"label": "unknown", "paged": "no"}
    with pytest.raises(CassetteMismatch, match=r"did not make these recorded calls.*classify"):
        await recorded.replay(app, require_all=True)


async def test_cassette_from_history_export_json(tmp_path: Path) -> None:
    app = cassette_app.make_app()
    run_id, events = await _record(app)
    info = await app.get(run_id)
    await app.close()
    doc: dict[str, Any] = {
        "run": {"run_id": info.run_id},
        "events": [e.to_json() for e in events],
    }
    path = tmp_path / "history.json"
    path.write_text(json.dumps(doc))
    c = Cassette.load(path)  # a history export works as a cassette too
    assert c.run_id == run_id and [x.name for x in c.calls][:2] == ["fetch_ticket", "classify"]
    assert await c.replay(cassette_app.make_app()) == EXPECTED


def test_from_history_refuses_a_history_without_its_start() -> None:
    with pytest.raises(tether.TetherError, match="WorkflowStarted"):
        Cassette.from_history([])
    with pytest.raises(tether.TetherError, match="not a tether cassette"):
        Cassette.from_json({"format": "something-else"})


def test_cli_cassette_export_turns_a_stored_run_into_a_replayable_case(tmp_path: Path) -> None:
    import asyncio

    db = tmp_path / "prod.db"

    async def produce() -> str:
        app = cassette_app.make_app(f"sqlite:///{db}")
        run_id, _ = await _record(app)
        await app.close()
        return run_id

    run_id = asyncio.run(produce())
    res = subprocess.run(
        [sys.executable, "-m", "tether.cli", "cassette", "export", run_id, "--store", str(db)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    c = Cassette.from_json(json.loads(res.stdout))
    assert c.run_id == run_id and c.status == "completed"
    assert [x.name for x in c.calls] == ["fetch_ticket", "classify", "notify"]

    async def replay() -> Any:
        app = cassette_app.make_app()
        try:
            return await c.replay(app)
        finally:
            await app.close()

    assert asyncio.run(replay()) == EXPECTED

    missing = subprocess.run(
        [sys.executable, "-m", "tether.cli", "cassette", "export", "nope", "--store", str(db)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert missing.returncode == 1 and missing.stderr.startswith("error: ")
