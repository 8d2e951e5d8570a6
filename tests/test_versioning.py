"""Versioning: tether.patched lets new code take a new branch while runs in flight
replay the old one, and the replay checker catches unpatched changes before deploy."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tether
from tether.testing import check_history


def _v1(app: tether.App, calls: list[str]) -> None:
    @app.activity
    def a() -> str:
        calls.append("a")
        return "a"

    @app.activity
    def b() -> str:
        calls.append("b")
        return "b"

    @app.workflow
    async def flow() -> list[str]:
        out = [await a()]
        await tether.wait_event("go")
        out.append(await a())
        return out


def _v2(app: tether.App, calls: list[str], *, patch: bool) -> None:
    @app.activity
    def a() -> str:
        calls.append("a")
        return "a"

    @app.activity
    def b() -> str:
        calls.append("b")
        return "b"

    @app.workflow
    async def flow() -> list[str]:
        out = [await a()]
        if not patch or tether.patched("add-b"):
            out.append(await b())  # the change: a new step before the wait
        await tether.wait_event("go")
        out.append(await a())
        return out


async def _waiting_run(app: tether.App, run_id: str) -> None:
    """Start ``flow`` and return once it waits for its event (two workflow tasks done)."""
    async with app.worker(poll_interval=0.05):
        await app.start(app.get_workflow("flow"), run_id=run_id)
        for _ in range(1000):
            types = [e.type for e in await app.history(run_id)]
            if types.count(tether.EventType.WORKFLOW_TASK_COMPLETED) >= 2:
                return
            await asyncio.sleep(0.02)
    raise AssertionError("the run never reached its wait")


async def test_replay_check_unpatched_change_reports_diff(db_path: Path) -> None:
    calls: list[str] = []
    old = tether.App(store=f"sqlite:///{db_path}")
    _v1(old, calls)
    await _waiting_run(old, "r1")
    history = await old.history("r1")
    await old.close()

    unpatched = tether.App(store=f"sqlite:///{db_path}")
    _v2(unpatched, [], patch=False)
    report = check_history(unpatched, history)
    assert not report.ok
    assert "ActivityScheduled('b')" in report.diff()
    assert "step 2" in (report.error or "")

    patched = tether.App(store=f"sqlite:///{db_path}")
    _v2(patched, [], patch=True)
    assert check_history(patched, history).ok
    await unpatched.close()
    await patched.close()


async def test_patched_old_run_keeps_old_branch_new_run_takes_new(db_path: Path) -> None:
    calls: list[str] = []
    old = tether.App(store=f"sqlite:///{db_path}")
    _v1(old, calls)
    await _waiting_run(old, "old-run")
    await old.close()
    assert calls == ["a"]

    calls.clear()
    new = tether.App(store=f"sqlite:///{db_path}")
    _v2(new, calls, patch=True)
    async with new.worker(poll_interval=0.05):
        await new.signal("old-run", "go")
        assert await new.get_run("old-run").result(timeout=10) == ["a", "a"]
        assert calls == ["a"]  # the old run did not take the new branch
        calls.clear()
        run = await new.start(new.get_workflow("flow"), run_id="new-run")
        await new.signal("new-run", "go")
        assert await run.result(timeout=10) == ["a", "b", "a"]
        assert calls == ["a", "b", "a"]
        markers = [
            e for e in await new.history("new-run") if e.type is tether.EventType.PATCH_MARKER
        ]
        assert [m.data["patch_id"] for m in markers] == ["add-b"]
    await new.close()


def test_cli_replay_fails_on_unpatched_change_and_passes_patched(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    code = textwrap.dedent(
        f"""
        import tether
        app = tether.App(store={f"sqlite:///{db}"!r})

        @app.activity
        def a() -> str:
            return "a"

        @app.activity
        def b() -> str:
            return "b"

        @app.workflow
        async def flow() -> str:
            await a()
            if {{PATCH}}:
                await b()
            await tether.wait_event("go")
            return "done"
        """
    )
    (tmp_path / "v1.py").write_text(code.replace("{PATCH}", "False"))
    (tmp_path / "v2.py").write_text(code.replace("{PATCH}", "True"))
    (tmp_path / "v3.py").write_text(code.replace("{PATCH}", 'tether.patched("b")'))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tether.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    sys.path.insert(0, str(tmp_path))
    try:
        import v1  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))

    async def make_run() -> None:
        async with v1.app.worker(poll_interval=0.05):
            await v1.app.start(v1.flow, run_id="r")
            for _ in range(1000):
                hist = await v1.app.history("r")
                if [e.type for e in hist].count(tether.EventType.WORKFLOW_TASK_COMPLETED) >= 2:
                    break
                await asyncio.sleep(0.02)
        await v1.app.close()

    asyncio.run(make_run())
    exported = cli("history", "export", "r", "--store", str(db))
    assert exported.returncode == 0, exported.stderr
    (tmp_path / "h.json").write_text(exported.stdout)
    assert json.loads(exported.stdout)["events"]

    bad = cli("replay", "h.json", "--app", "v2:app")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL  r" in bad.stdout and "ActivityScheduled('b')" in bad.stdout
    good = cli("replay", "h.json", "--app", "v3:app")
    assert good.returncode == 0, good.stdout + good.stderr
    from_store = cli("replay", "--app", "v3:app", "--store", str(db), "--since", "1h")
    assert from_store.returncode == 0 and "ok    r" in from_store.stdout, from_store.stdout


def test_cli_replay_store_checks_every_unfinished_run_however_old(tmp_path: Path) -> None:
    """`tether replay --store` is the pre-deploy check of runs in flight: an old run
    waiting on a signal is replayed whatever --limit and --since say (they pick the
    finished runs), and finished runs are replayed only when asked."""
    db = tmp_path / "t.db"
    code = textwrap.dedent(
        f"""
        import tether
        app = tether.App(store={f"sqlite:///{db}"!r})

        @app.activity
        def a() -> str:
            return "a"

        @app.activity
        def b() -> str:
            return "b"

        @app.workflow
        async def flow() -> str:
            await a()
            if {{KEEP_B}}:
                await b()
            await tether.wait_event("go")
            return "done"

        @app.workflow
        async def ping() -> str:
            return "pong"
        """
    )
    (tmp_path / "before_deploy.py").write_text(code.replace("{KEEP_B}", "True"))
    (tmp_path / "after_deploy.py").write_text(code.replace("{KEEP_B}", "False"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tether.cli", "replay", "--store", str(db), *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    sys.path.insert(0, str(tmp_path))
    try:
        import before_deploy as v1  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))

    async def make_runs() -> None:
        async with v1.app.worker(poll_interval=0.05):
            await v1.app.start(v1.flow, run_id="old")
            for _ in range(1000):
                if (await v1.app.get("old")).waiting_on:
                    break
                await asyncio.sleep(0.02)
            for i in range(3):  # newer runs, finished
                await v1.app.start(v1.ping, run_id=f"ping-{i}")
                assert await v1.app.get_run(f"ping-{i}").result(timeout=10) == "pong"
        await v1.app.close()

    asyncio.run(make_runs())
    with sqlite3.connect(db) as conn:  # it has waited for a month
        conn.execute("UPDATE runs SET created_at = created_at - 30 * 86400 WHERE run_id = 'old'")
    for args in ([], ["--limit", "2"], ["--since", "7d"], ["--finished", "--limit", "1"]):
        out = cli("--app", "after_deploy:app", *args)
        assert out.returncode == 1, (args, out.stdout + out.stderr)
        assert "FAIL  old (flow)" in out.stdout, (args, out.stdout)
    plain = cli("--app", "before_deploy:app")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "ok    old" in plain.stdout and "ping-" not in plain.stdout, plain.stdout
    assert "1 passed, 0 failed" in plain.stdout
    some = cli("--app", "before_deploy:app", "--finished", "--limit", "2")
    assert some.returncode == 0, some.stdout + some.stderr
    assert "ok    ping-2" in some.stdout and "ok    ping-1" in some.stdout
    assert "ping-0" not in some.stdout and "3 passed, 0 failed" in some.stdout
    every = cli("--app", "before_deploy:app", "--finished")
    assert "4 passed, 0 failed" in every.stdout, every.stdout


async def test_worker_versions_serves_only_runs_recorded_by_its_versions(db_path: Path) -> None:
    def build(version: str, calls: list[str]) -> tether.App:
        app = tether.App(store=f"sqlite:///{db_path}")

        @app.activity
        def mark() -> str:
            calls.append(version)
            return version

        @app.workflow(name="flow", version=version)
        async def flow() -> str:
            await tether.wait_event("go")
            return await mark()

        return app

    v1_calls: list[str] = []
    v1 = build("v1", v1_calls)
    async with v1.worker(poll_interval=0.05):
        await v1.start(v1.get_workflow("flow"), run_id="old")
        for _ in range(1000):
            hist = await v1.history("old")
            if any(e.type is tether.EventType.WORKFLOW_TASK_COMPLETED for e in hist):
                break
            await asyncio.sleep(0.02)
    markers = [e for e in await v1.history("old") if e.type.value == "WorkflowTaskCompleted"]
    assert markers[0].data["version"] == "v1"
    await v1.close()

    v2_calls: list[str] = []
    v2 = build("v2", v2_calls)
    async with v2.worker(poll_interval=0.05, versions={"v2"}) as w:
        await v2.signal("old", "go")
        with pytest.raises(tether.ResultTimeoutError):
            await v2.get_run("old").result(timeout=1.0)  # a v2-only worker leaves it alone
        assert w.stats["version_skipped"] >= 1 and v2_calls == []
    await v2.close()

    v1 = build("v1", v1_calls)
    async with v1.worker(poll_interval=0.05, versions={"v1"}):
        assert await v1.get_run("old").result(timeout=10) == "v1"
    assert v1_calls == ["v1"]
    await v1.close()


async def test_a_deploy_missing_an_activity_spends_none_of_its_attempts(
    store_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that claims a step whose activity it does not register (a deploy that
    forgot an import) gives it back unstarted: the step waits, no attempt is spent, the
    run says why, and the fixed deploy runs it as its first attempt."""
    monkeypatch.setattr("tether._worker.UNKNOWN_HOLD", 0.05, raising=False)
    calls: list[int] = []

    def build(with_enrich: bool) -> tether.App:
        app = tether.App(store=store_url)
        if with_enrich:

            @app.activity(queue="enrich", retry=tether.Retry(attempts=2, initial=0.05))
            def enrich(x: int) -> int:
                calls.append(x)
                return x * 10

        @app.workflow
        async def flow(x: int) -> int:
            if with_enrich:
                return int(await app.get_activity("enrich")(x))
            return 0

        return app

    v1, v2 = build(True), build(False)
    async with v1.worker(queues=["default"], poll_interval=0.05):
        await v1.start(v1.get_workflow("flow"), 7, run_id="r")
        for _ in range(1000):
            types = [e.type for e in await v1.history("r")]
            if tether.EventType.ACTIVITY_SCHEDULED in types:
                break
            await asyncio.sleep(0.02)
    caplog.set_level("WARNING", logger="tether.worker")
    async with v2.worker(queues=["enrich"], poll_interval=0.02) as w:
        for _ in range(1000):
            if w.stats["held_unknown"] >= 4:
                break
            await asyncio.sleep(0.02)
    assert w.stats["held_unknown"] >= 4
    types = [e.type for e in await v1.history("r")]
    assert tether.EventType.ACTIVITY_ATTEMPT_FAILED not in types, types
    info = await v1.get("r")
    assert info.status is tether.RunStatus.RUNNING
    assert info.task_error is not None and "'enrich'" in info.task_error, info.task_error
    assert [r.run_id for r in await v1.list(stuck=True)] == ["r"]
    said = [r for r in caplog.records if "'enrich'" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]  # once per interval, not per claim
    async with v1.worker(poll_interval=0.05):
        assert await v1.get_run("r").result(timeout=15) == 70
    assert calls == [7]
    done = [e for e in await v1.history("r") if e.type is tether.EventType.ACTIVITY_COMPLETED]
    assert done[0].data["attempt"] == 1
    assert (await v1.get("r")).task_error is None
    for a in (v1, v2):
        await a.close()
