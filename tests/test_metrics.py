"""The engine's counters match a scripted scenario exactly (retries, final failures, dead
letters, compensations, run ends), parsed from the Prometheus text exposition; latency
histograms count every attempt, run and wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import tether
from tether._telemetry import RECORDER
from tether.metrics import Metrics

SRC = Path(__file__).parent.parent / "src"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(samples: dict[Any, float], metric: str, /, **labels: str) -> float:
    return samples.get((metric, tuple(sorted(labels.items()))), 0.0)


async def test_counters_match_a_scripted_scenario(app: tether.App) -> None:
    tries = {"flaky": 0}

    @app.activity(retry=tether.Retry(attempts=5, initial=0.01, backoff=1.0))
    async def flaky() -> str:
        tries["flaky"] += 1
        if tries["flaky"] <= 2:
            raise ConnectionError("not yet")
        return "ok"

    @app.activity
    async def broken() -> None:
        raise tether.NonRetryable("no")

    @app.activity
    async def reserve() -> None:
        return None

    @app.activity
    async def release(_: None) -> None:
        return None

    @app.activity
    async def charge() -> None:
        return None

    @app.activity(retry=tether.Retry(attempts=1))
    async def refund(_: None) -> None:
        raise ValueError("refund refused")

    @app.workflow
    async def steady() -> str:
        await tether.sleep(0.05)
        return await flaky()

    @app.workflow
    async def doomed() -> None:
        await broken()

    @app.workflow
    async def booking() -> None:
        async with tether.saga() as saga:
            await saga.step(reserve(), undo=release)
            await saga.step(charge(), undo=refund)
            await broken()

    RECORDER.reset()
    async with app.worker(poll_interval=0.05):
        assert await (await app.start(steady)).result(timeout=20) == "ok"
        with pytest.raises(tether.WorkflowFailedError):
            await (await app.start(doomed)).result(timeout=20)
        with pytest.raises(tether.RunNeedsInterventionError):
            await (await app.start(booking)).result(timeout=20)
    metrics = Metrics(app)
    await metrics.update()
    s = _samples(metrics.exposition().decode())
    assert _get(s, "tether_runs_started_total", workflow="steady") == 1
    assert _get(s, "tether_runs_ended_total", workflow="steady", status="completed") == 1
    assert _get(s, "tether_runs_ended_total", workflow="doomed", status="failed") == 1
    assert _get(s, "tether_runs_ended_total", workflow="booking", status="needs_intervention") == 1
    assert _get(s, "tether_runs_dead_lettered_total", workflow="doomed", status="failed") == 1
    assert (
        _get(s, "tether_runs_dead_lettered_total", workflow="booking", status="needs_intervention")
        == 1
    )
    assert _get(s, "tether_dead_letters_open") == len(await app.dead_letters())
    assert (
        _get(s, "tether_activity_retries_total", activity="flaky", error_type="ConnectionError")
        == 2
    )
    assert (
        _get(s, "tether_activity_failures_total", activity="broken", error_type="NonRetryable") == 2
    )
    assert (
        _get(s, "tether_activity_failures_total", activity="refund", error_type="ValueError") == 1
    )
    assert (
        _get(s, "tether_compensations_total", workflow="booking", undo="refund", outcome="failed")
        == 1
    )
    assert (
        _get(s, "tether_compensations_total", workflow="booking", undo="release", outcome="ok") == 1
    )
    # histograms: every attempt, every run ended by its code, the timer
    assert _get(s, "tether_activity_duration_seconds_count", activity="flaky", outcome="retry") == 2
    assert _get(s, "tether_activity_duration_seconds_count", activity="flaky", outcome="ok") == 1
    assert _get(s, "tether_run_duration_seconds_count", workflow="steady", status="completed") == 1
    assert _get(s, "tether_wait_duration_seconds_count", kind="timer", name="timer") == 1
    assert _get(s, "tether_wait_duration_seconds_sum", kind="timer", name="timer") >= 0.04
    assert _get(s, "tether_queue_wait_seconds_count", queue="default", kind="activity") >= 6
    assert _get(s, "tether_queue_wait_seconds_count", queue="default", kind="workflow") == 3
    # no run id ever becomes a label
    assert not any(dict(labels).get("run_id") for _, labels in s)


def test_the_dashboard_and_alert_rules_name_only_metrics_that_exist() -> None:
    """docs/grafana/tether.json and the rules in docs/observability.md use real names."""
    import json
    import re
    from pathlib import Path

    from tether._telemetry import SPECS

    docs = Path(__file__).parent.parent / "docs"
    known = {f"{n}_total" if s.kind == "counter" else f"{n}_seconds" for n, s in SPECS.items()}
    known |= {f"{n}_seconds_bucket" for n, s in SPECS.items() if s.kind == "histogram"}
    known |= {
        "tether_queue_ready_tasks",
        "tether_queue_oldest_ready_seconds",
        "tether_queue_running_tasks",
        "tether_queue_scheduled_tasks",
        "tether_dead_letters_open",
        "tether_approvals_open",
        "tether_webhook_deliveries",
        "tether_switches_off",
        "tether_runs",
        "tether_worker_events_total",
        "tether_worker_inflight_tasks",
        "tether_worker_slots",
    }
    dashboard = json.loads((docs / "grafana" / "tether.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = re.findall(r"expr: (.+)", (docs / "observability.md").read_text())
    assert len(exprs) >= 10 and len(rules) >= 8
    used = {m for e in exprs + rules for m in re.findall(r"\btether_[a-z_]+", e)}
    assert used and used <= known, sorted(used - known)


async def test_the_same_figures_reach_opentelemetry_metrics(app: tether.App) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from tether.metrics import to_opentelemetry

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    before = list(RECORDER.sinks)
    to_opentelemetry(provider)
    to_opentelemetry(provider)  # a second call (a reloader, two Apps) counts nothing twice
    assert len(RECORDER.sinks) == len(before) + 1
    try:
        tries = {"n": 0}

        @app.activity(retry=tether.Retry(attempts=3, initial=0.01, backoff=1.0))
        async def wobbly() -> int:
            tries["n"] += 1
            if tries["n"] == 1:
                raise ConnectionError("again")
            return 7

        @app.workflow
        async def once() -> int:
            return await wobbly()

        async with app.worker(poll_interval=0.05):
            assert await (await app.start(once)).result(timeout=20) == 7
    finally:
        RECORDER.sinks[:] = before
    points: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points[metric.name] = list(metric.data.data_points)
    (retry,) = points["tether_activity_retries"]
    assert retry.value == 1
    assert dict(retry.attributes or {}) == {"activity": "wobbly", "error_type": "ConnectionError"}
    durations = points["tether_activity_duration_seconds"]
    assert sum(p.count for p in durations) == 2  # the failed attempt and the good one
    ended = points["tether_runs_ended"]
    assert [(dict(p.attributes or {}), p.value) for p in ended] == [
        ({"workflow": "once", "status": "completed"}, 1)
    ]


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-1", "0"])
def test_a_bad_interval_in_the_environment_is_one_clear_error(
    value: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``TETHER_METRICS_REFRESH=abc`` was a ValueError from ``float()`` and ``0`` made
    the metrics loop read the store without pause; a bad ``TETHER_TRACE_MIN_ATTEMPT_MS``
    failed ``import tether`` with a ValueError. Each is a ConfigurationError naming the
    variable; ``tether worker --metrics-port`` says so in one line before any work."""
    monkeypatch.setenv("TETHER_METRICS_REFRESH", value)
    app = tether.App(store=":memory:")
    with pytest.raises(tether.ConfigurationError, match="TETHER_METRICS_REFRESH="):
        Metrics(app, [])
    if value != "0":  # 0 ms is valid there: every attempt gets a span
        env = {**os.environ, "TETHER_TRACE_MIN_ATTEMPT_MS": value}
        got = subprocess.run(
            [sys.executable, "-c", "import tether"], env=env, capture_output=True, text=True
        )
        assert got.returncode != 0
        assert "ConfigurationError: TETHER_TRACE_MIN_ATTEMPT_MS=" in got.stderr.splitlines()[-1]
    (tmp_path / "flows.py").write_text("import tether\napp = tether.App(store='x.db')\n")
    got = subprocess.run(
        [sys.executable, "-m", "tether.cli", "worker", "flows:app", "--metrics-port", "0"],
        env={**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{tmp_path}"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode != 0
    assert got.stderr.strip().splitlines() == [
        f"error: TETHER_METRICS_REFRESH={value!r}: must be a number of seconds, at least 0.1 "
        "(unset it for the default, 5)"
    ]


def test_a_worker_serves_its_metrics_on_loopback_unless_told(tmp_path: Path) -> None:
    """The worker's metrics port asks for no key and names every tenant: it listened on
    every address. It now listens on 127.0.0.1 unless ``--metrics-host`` says otherwise,
    and an address it cannot listen on is one line, not a traceback."""
    (tmp_path / "flows.py").write_text("import tether\napp = tether.App(store='x.db')\n")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{tmp_path}"}
    cmd = [sys.executable, "-m", "tether.cli", "worker", "flows:app", "--metrics-port", "0"]
    bad = subprocess.run(
        [*cmd, "--metrics-host", "192.0.2.1"],  # TEST-NET-1: never this machine's
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0
    assert (
        bad.stderr.strip()
        .splitlines()[-1]
        .startswith("error: --metrics-host '192.0.2.1' --metrics-port 0: cannot listen there")
    )
    proc = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True, stdout=subprocess.DEVNULL
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.startswith("tether worker ") and "metrics on http://127.0.0.1:" in line
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        if proc.stderr is not None:
            proc.stderr.close()


def test_a_child_started_by_an_http_runs_first_task_is_counted(store_url: str) -> None:
    """``tether serve --workers 1`` runs an HTTP start's first workflow task in the
    request; a child run started there is counted in ``tether_runs_started_total``, so
    started minus ended never goes below zero."""
    from test_http_api import Server

    server = Server(store_url, "--workers", "1", "--no-auth")
    try:
        r = server.http.post("/v1/workflows/batch/runs", json={"input": {"number": "B-1"}})
        assert r.status_code == 202, r.text
        done = server.http.get(f"{r.json()['links']['result']}?wait=20")
        assert done.json()["status"] == "completed", done.text
        s = _samples(server.http.get("/metrics").text)
    finally:
        server.stop()
    for workflow in ("batch", "bill"):
        labels = (("workflow", workflow),)
        assert s[("tether_runs_started_total", labels)] == 1, workflow
        ended = (("status", "completed"), ("workflow", workflow))
        assert s[("tether_runs_ended_total", ended)] == 1, workflow
