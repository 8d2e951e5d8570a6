"""The benchmark harness runs in its short mode (figures are not asserted, only that
every workload works and reports what it should)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_bench_quick_mode_runs_every_workload(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    results = doc["results"]
    assert set(results) >= {"limit", "w1", "w2", "w3", "w4", "w5", "w6"}
    assert results["limit"]["commits_per_s"] > 0
    assert results["w1"]["steps_per_s"] > 0
    assert results["w3"]["p50_ms"] > 0
    assert results["w2"]["steps_per_s"] > 0
    w4 = results["w4"]
    runs = [v for v in w4.values() if isinstance(v, dict)]
    assert runs and all(r["recorded_steps_rerun"] == 0 for r in runs), w4
    assert results["w5"]["runs"] > 0
    assert "W1" in proc.stdout and "steps/s" in proc.stdout


@pytest.mark.slow
def test_postgres_bench_short_mode_runs_every_workload(tmp_path: Path) -> None:
    from conftest import require_pg

    url = require_pg()
    out = tmp_path / "pg.json"
    cmd = [sys.executable, str(ROOT / "bench" / "pg_scaling.py"), "--postgres", url]
    cmd += ["--runs", "20", "--w3-runs", "20", "--limit-seconds", "0.3", "--procs", "1"]
    proc = subprocess.run(
        [*cmd, "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["limit"]["1"] > 0 and doc["limit"]["8"] > 0
    assert doc["w1_inproc"]["steps_per_s"] > 0 and doc["w1_inproc"]["retries"] >= 0
    assert doc["w3_inproc"]["p50_ms"] > 0
    assert [e["procs"] for e in doc["engine"]] == [1] and doc["engine"][0]["steps_per_s"] > 0
    assert doc["cpu_before_ms"] > 0
    assert "W3-PG tether in-process" in proc.stdout


@pytest.mark.slow
def test_observability_bench_quick_mode_runs_every_mode() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "observability.py"), "--quick", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mode in ("bare", "metrics", "api", "sdk", "sdk10"):
        assert f"\n{mode} " in proc.stdout, proc.stdout
    # the sdk mode traced every attempt (600), and the runs and their first tasks too
    sdk = re.search(r"\nround \d+ sdk +.* spans=(\d+)", proc.stdout)
    assert sdk is not None and int(sdk.group(1)) >= 600, proc.stdout


ALTERNATE = ("--alternate", "2", "--turn-runs", "50")


@pytest.mark.slow
def test_encryption_bench_alternating_mode_runs_its_pairs() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "encryption.py"), *ALTERNATE],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for pair in ("sealed / plain", "known-tenants / tenants"):
        assert pair in proc.stdout, proc.stdout
