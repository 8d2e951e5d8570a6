"""tether.testing.evaluate: accuracy, confusion, failures, latency, cost, thresholds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import eval_app
import tether
from tether.testing import EvaluationFailed, aevaluate, evaluate, load_cases

HERE = Path(__file__).parent

CASES: list[Any] = [
    ("a great film", "pos"),
    ("I love it", "pos"),
    ("terrible acting", "neg"),
    ("oh great, another sequel", "neg"),  # sarcasm: the keyword model says pos
    {"input": "", "expected": "neg", "id": "empty"},  # raises ValueError
]


def test_activity_accuracy_confusion_and_failures() -> None:
    report = evaluate(eval_app.sentiment, CASES)
    assert report.total == 5 and report.correct == 3
    assert report.accuracy == pytest.approx(0.6)
    assert report.confusion == {
        "pos": {"pos": 2},
        "neg": {"neg": 1, "pos": 1, "<error>": 1},
    }
    assert report.errors_by_type == {"ValueError": 1}
    (failure,) = report.failures
    assert failure.case.id == "empty" and failure.error == "ValueError: empty text"
    assert report.error_rate == pytest.approx(0.2)
    assert 0 <= report.p50_ms <= report.p95_ms < 30_000  # sane, not a speed claim
    assert report.total_cost is None
    text = report.table()
    assert "accuracy" in text and "0.600 (3/5)" in text
    assert "ValueError x1" in text and "expected \\ predicted" in text


def test_thresholds_raise_listing_everything_that_fell_short() -> None:
    with pytest.raises(EvaluationFailed) as info:
        evaluate(eval_app.sentiment, CASES, thresholds={"accuracy": 0.9, "error_rate": 0.1})
    msg = str(info.value)
    assert "accuracy 0.6 < 0.9 required" in msg
    assert "error_rate 0.2 > 0.1 allowed" in msg
    assert info.value.report.total == 5
    ok = evaluate(eval_app.sentiment, CASES[:3], thresholds={"accuracy": 1.0, "p95_ms": 1000})
    assert ok.ok and ok.accuracy == 1.0


def test_unknown_thresholds_and_bad_cases_are_refused() -> None:
    with pytest.raises(tether.ConfigurationError, match="unknown threshold 'acc'"):
        evaluate(eval_app.sentiment, CASES, thresholds={"acc": 0.5})
    with pytest.raises(tether.ConfigurationError, match="case 0"):
        evaluate(eval_app.sentiment, [("only input",)])
    # NaN compares false with everything: as a threshold it would pass any result
    for bad in (float("nan"), "0.9", True):
        with pytest.raises(tether.ConfigurationError, match="'accuracy' must be a number"):
            evaluate(eval_app.sentiment, CASES, thresholds={"accuracy": bad})


def test_costs_and_key_extract_the_prediction() -> None:
    report = evaluate(eval_app.priced, CASES[:4], key=lambda a: a.label)
    assert report.accuracy == pytest.approx(0.75)
    assert report.total_cost == pytest.approx(0.002 * (3 + 3 + 2 + 4))
    assert report.mean_cost == pytest.approx(0.002 * 12 / 4)
    with pytest.raises(EvaluationFailed, match="total_cost"):
        evaluate(eval_app.priced, CASES[:4], key=lambda a: a.label, thresholds={"total_cost": 0.01})


async def test_workflow_cases_run_through_a_time_skipping_env() -> None:
    report = await aevaluate(eval_app.review, CASES, app=eval_app.app)
    assert report.correct == 3 and report.total == 5
    # the hour-long sleep was skipped: every case took far less than the hour
    assert report.p95_ms < 60_000
    (failure,) = report.failures
    # the run failed with the ActivityError the code let through; the cause is in the text
    assert failure.error_type == "ActivityError"
    assert failure.error is not None and "ValueError: empty text" in failure.error
    assert report.confusion is not None and report.confusion["neg"]["<error>"] == 1


async def test_workflow_evaluation_needs_its_app() -> None:
    with pytest.raises(tether.ConfigurationError, match="needs app="):
        await aevaluate(eval_app.review, CASES)


def test_latency_p95_threshold_fails_a_slow_target() -> None:
    report = evaluate(eval_app.slow_sentiment, CASES[:3])
    assert report.p50_ms >= 15  # each call sleeps 20 ms
    with pytest.raises(EvaluationFailed, match="p95_ms"):
        evaluate(eval_app.slow_sentiment, CASES[:3], thresholds={"p95_ms": 5})


def test_load_cases_reads_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "cases.jsonl"
    path.write_text(
        '# comment\n{"input": "good", "expected": "pos"}\n\n'
        '{"args": ["bad"], "expected": "neg", "id": "b"}\n'
    )
    cases = load_cases(path)
    assert [(c.args, c.expected, c.id) for c in cases] == [
        (("good",), "pos", "line 2"),
        (("bad",), "neg", "b"),
    ]
    path.write_text("{oops\n")
    with pytest.raises(tether.ConfigurationError, match=":1 is not valid JSON"):
        load_cases(path)


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tether.cli", "eval", *args],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _write_cases(tmp_path: Path) -> Path:
    path = tmp_path / "cases.jsonl"
    lines = []
    for c in CASES:
        if isinstance(c, dict):
            lines.append(json.dumps(c))
        else:
            lines.append(json.dumps({"input": c[0], "expected": c[1]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_eval_exits_1_below_the_threshold(tmp_path: Path) -> None:
    cases = _write_cases(tmp_path)
    low = _cli(tmp_path, "eval_app:sentiment", str(cases), "--min-accuracy", "0.9")
    assert low.returncode == 1, (low.stdout, low.stderr)
    assert "accuracy 0.6 < 0.9 required" in low.stdout
    assert "0.600 (3/5)" in low.stdout
    ok = _cli(tmp_path, "eval_app:sentiment", str(cases), "--min-accuracy", "0.5", "--json")
    assert ok.returncode == 0, (ok.stdout, ok.stderr)
    doc = json.loads(ok.stdout)
    assert doc["accuracy"] == pytest.approx(0.6) and doc["errors_by_type"] == {"ValueError": 1}
    assert doc["shortfalls"] == []


def test_cli_eval_runs_a_workflow_target_and_reports_bad_specs(tmp_path: Path) -> None:
    cases = _write_cases(tmp_path)
    wf = _cli(tmp_path, "eval_app:review", str(cases), "--min-accuracy", "0.6")
    assert wf.returncode == 0, (wf.stdout, wf.stderr)
    assert "evaluation of review: 5 cases" in wf.stdout
    bad = _cli(tmp_path, "eval_app:nothing", str(cases))
    assert bad.returncode == 2 and "no activity, workflow or function named" in bad.stderr
    nofile = _cli(tmp_path, "eval_app:sentiment", str(tmp_path / "missing.jsonl"))
    assert nofile.returncode == 2 and "no cases file" in nofile.stderr


def test_evaluate_reports_repairs_validation_failures_and_groups() -> None:
    import pydantic

    from tether.testing import evaluate

    class Label(pydantic.BaseModel):
        label: str

    def route(text: str) -> dict[str, object]:
        if text == "broken":
            Label.model_validate({"label": 3})  # malformed model output
        return {"label": "spam" if "win" in text else "ham", "repairs": 1 if "!" in text else 0}

    cases = [
        {"input": "win now!", "expected": "spam", "group": "prompt-v2"},
        {"input": "hello", "expected": "ham", "group": "prompt-v2"},
        {"input": "win", "expected": "spam", "group": "prompt-v1"},
        {"input": "broken", "expected": "ham", "group": "prompt-v1"},
    ]
    report = evaluate(route, cases, key=lambda out: out["label"])
    assert report.repair_rate == pytest.approx(1 / 3)
    assert report.validation_failure_rate == pytest.approx(1 / 4)
    groups = report.by_group()
    assert groups["prompt-v2"]["accuracy"] == 1.0
    assert groups["prompt-v1"]["accuracy"] == 0.5
    assert "by group" in report.table() and "repair rate" in report.table()
    with pytest.raises(tether.testing.EvaluationFailed, match="repair_rate"):
        evaluate(route, cases, key=lambda out: out["label"], thresholds={"repair_rate": 0.1})
