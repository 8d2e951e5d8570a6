"""OpenTelemetry: a run joins the trace it was started in; every activity attempt is a
span of that trace with the run, step, attempt, outcome and error type, on whichever
worker runs it, after any wait; replays make no spans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler

import tether


class _Switchable(Sampler):
    """Samples while a test traces; off otherwise (the provider is set once per process)."""

    on = False

    def should_sample(self, *args: Any, **kwargs: Any) -> Any:
        return (ALWAYS_ON if self.on else ALWAYS_OFF).should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return "switchable"


_SAMPLER = _Switchable()
_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider(sampler=_SAMPLER)
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    _SAMPLER.on = True
    try:
        yield _EXPORTER
    finally:
        _SAMPLER.on = False


def _attempts(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith("tether.activity")]


async def test_attempts_are_spans_of_the_trace_the_run_was_started_in(
    app: tether.App, spans: InMemorySpanExporter
) -> None:
    tries = {"n": 0}

    @app.activity(retry=tether.Retry(attempts=2, initial=0.05))
    async def flaky() -> str:
        tries["n"] += 1
        if tries["n"] == 1:
            raise ConnectionError("try again")
        return "ok"

    @app.activity
    async def after(x: str) -> str:
        return x + "!"

    @app.workflow
    async def traced() -> str:
        first = await flaky()
        await tether.wait_event("go")
        return await after(first)

    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("caller") as caller:
        run = await app.start(traced, run_id="traced-1")
    trace_id = caller.get_span_context().trace_id
    async with app.worker(poll_interval=0.05):

        async def waiting() -> bool:
            waiting = (await app.get(run.run_id)).waiting_on or []
            return any(w["kind"] == "signal" for w in waiting)

        from helpers import eventually

        await eventually(waiting, 10, "the run waiting for its signal")
    # a new worker (as after a restart) replays step 1 and runs step 2
    async with app.worker(poll_interval=0.05):
        await app.signal(run.run_id, "go")
        assert await run.result(timeout=20) == "ok!"
    attempts = _attempts(spans)
    assert [
        (s.name, s.attributes["tether.step"], s.attributes["tether.attempt"]) for s in attempts
    ] == [
        ("tether.activity flaky", 1, 1),
        ("tether.activity flaky", 1, 2),
        ("tether.activity after", 2, 1),
    ]  # the replay of step 1 made no span
    assert {s.context.trace_id for s in attempts} == {trace_id}  # one trace across workers
    assert all(
        s.parent is not None and s.parent.span_id == caller.get_span_context().span_id
        for s in attempts
    )
    failed, retried_ok, later = attempts
    assert failed.attributes["tether.outcome"] == "retry"
    assert failed.attributes["error.type"] == "ConnectionError"
    assert "try again" not in str(failed.attributes)  # the message may hold data: never sent
    assert retried_ok.attributes["tether.outcome"] == "ok"
    assert later.attributes["tether.run_id"] == "traced-1"
    assert (await app.get(run.run_id)).attrs["trace"]["traceparent"].split("-")[1] == format(
        trace_id, "032x"
    )
    # the workflow side: its tasks, the wait for the signal and the run's whole life
    others = [
        s
        for s in spans.get_finished_spans()
        if s.name.startswith("tether.") and not s.name.startswith("tether.activity")
    ]
    assert {s.context.trace_id for s in others} == {trace_id}
    assert all(
        s.parent is not None and s.parent.span_id == caller.get_span_context().span_id
        for s in others
    )
    waits = [s for s in others if s.name == "tether.wait signal"]
    assert len(waits) == 1 and waits[0].attributes["tether.wait.name"] == "go"
    assert waits[0].start_time < waits[0].end_time
    tasks = [s for s in others if s.name == "tether.workflow_task traced"]
    assert len(tasks) >= 2 and any(s.attributes["tether.replayed"] for s in tasks)
    (life,) = [s for s in others if s.name == "tether.lifetime traced"]
    assert life.attributes["tether.outcome"] == "completed"
    assert life.start_time <= attempts[0].start_time and life.end_time >= waits[0].end_time


async def test_a_child_run_continues_its_parents_trace(
    app: tether.App, spans: InMemorySpanExporter
) -> None:
    @app.activity
    async def leaf() -> int:
        return 2

    @app.workflow
    async def child() -> int:
        return await leaf()

    @app.workflow
    async def parent() -> int:
        return await child() + 1

    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("caller") as caller:
        run = await app.start(parent, tenant="acme")
    async with app.worker(poll_interval=0.05):
        assert await run.result(timeout=20) == 3
    names = {s.name: s for s in spans.get_finished_spans()}
    assert {"tether.activity leaf", "tether.lifetime child", "tether.lifetime parent"} <= set(names)
    assert {s.context.trace_id for s in names.values()} == {caller.get_span_context().trace_id}
    assert names["tether.workflow_task parent"].attributes["tether.tenant"] == "acme"


async def test_a_run_started_outside_any_span_gets_a_trace_of_its_own(
    app: tether.App, spans: InMemorySpanExporter
) -> None:
    @app.activity
    async def step() -> int:
        return 1

    @app.workflow
    async def alone() -> int:
        return await step()

    async with app.worker(poll_interval=0.05):
        assert await (await app.start(alone)).result(timeout=20) == 1
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert set(by_name) >= {"tether.run alone", "tether.activity step", "tether.lifetime alone"}
    run_span = by_name["tether.run alone"]
    assert {s.context.trace_id for s in by_name.values()} == {run_span.context.trace_id}


async def test_untraced_runs_carry_nothing(app: tether.App) -> None:
    @app.activity
    async def step() -> int:
        return 1

    @app.workflow
    async def plain() -> int:
        return await step()

    async with app.worker(poll_interval=0.05):
        run = await app.start(plain)
        assert await run.result(timeout=20) == 1
    assert not ((await app.get(run.run_id)).attrs or {}).get("trace")


def test_a_run_whose_worker_is_killed_resumes_in_one_trace(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    """SIGKILL mid-step; another worker process resumes: every span is in the caller's
    trace under its span, one per finished attempt, none for the replayed first step."""
    here = Path(__file__).parent
    db, out, marker = tmp_path / "t.db", tmp_path / "spans.jsonl", tmp_path / "in-flight"
    env = {**os.environ, "PYTHONPATH": f"{here.parent / 'src'}{os.pathsep}{here}"}
    sys.path.insert(0, str(here))
    try:
        argv = sys.argv
        sys.argv = ["trace_app", str(db), str(out), str(marker)]
        import trace_app  # the same App definition, for starting the run here
    finally:
        sys.argv = argv
        sys.path.remove(str(here))

    def worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(here / "trace_app.py"), str(db), str(out), str(marker)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    import asyncio

    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("caller") as caller:
        run_id = asyncio.run(_start(trace_app.app, trace_app.traced_three))
    first = worker()
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline, "step 2 never started"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    second = worker()
    try:
        result = asyncio.run(_result(trace_app.app, run_id))
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(30)
    assert result == 20
    got = [json.loads(line) for line in out.read_text().splitlines()]
    ctx = caller.get_span_context()
    assert {s["trace_id"] for s in got} == {format(ctx.trace_id, "032x")}
    assert {s["parent"] for s in got} == {format(ctx.span_id, "016x")}
    attempts = [
        (s["name"], s["attributes"]["tether.step"], s["attributes"]["tether.attempt"], s["pid"])
        for s in got
        if s["name"].startswith("tether.activity")
    ]
    # step 1 ran once (in the killed worker), its replay in the second made no span; the
    # killed attempt of step 2 never finished (no span), its retry did
    assert [a[:3] for a in attempts] == [
        ("tether.activity first", 1, 1),
        ("tether.activity second", 2, 2),
        ("tether.activity third", 3, 1),
    ]
    assert attempts[0][3] == first.pid and attempts[1][3] == attempts[2][3] == second.pid
    names = [s["name"] for s in got]
    assert names.count("tether.lifetime traced_three") == 1
    assert any(
        s["name"] == "tether.workflow_task traced_three"
        and s["attributes"]["tether.replayed"]
        and s["pid"] == second.pid
        for s in got
    )


async def _start(app: tether.App, wf: Any) -> str:
    run = await app.start(wf)
    await app.close()
    return run.run_id


async def _result(app: tether.App, run_id: str) -> Any:
    try:
        return await app.get_run(run_id).result(timeout=60)
    finally:
        await app.close()


async def test_with_a_threshold_only_slow_or_failed_attempts_get_a_span(
    app: tether.App, spans: InMemorySpanExporter
) -> None:
    """``TETHER_TRACE_MIN_ATTEMPT_MS``: a fast successful attempt makes no span; a slow
    one gets its span at its end with its real start and end; a fast failure gets one
    with its outcome; all in the run's trace."""
    from tether import _tracing

    tries = {"n": 0}

    @app.activity
    async def fast() -> int:
        return 1

    @app.activity
    async def slow() -> int:
        import asyncio

        await asyncio.sleep(0.08)
        return 2

    @app.activity(retry=tether.Retry(attempts=2, initial=0.01))
    async def flaky() -> int:
        tries["n"] += 1
        if tries["n"] == 1:
            raise ConnectionError("once")
        return 3

    @app.workflow
    async def mixed() -> int:
        return await fast() + await slow() + await flaky()

    tracer = trace.get_tracer("test")
    _tracing.set_min_attempt_ms(50)
    try:
        with tracer.start_as_current_span("request") as outer:
            run = await app.start(mixed)
        async with app.worker(poll_interval=0.05):
            assert await run.result(timeout=20) == 6
    finally:
        _tracing.set_min_attempt_ms(0)
    attempts = _attempts(spans)
    names = sorted((s.name, dict(s.attributes or {}).get("tether.outcome")) for s in attempts)
    assert names == [("tether.activity flaky", "retry"), ("tether.activity slow", "ok")]
    slow_span = next(s for s in attempts if s.name == "tether.activity slow")
    assert slow_span.end_time is not None and slow_span.start_time is not None
    assert slow_span.end_time - slow_span.start_time >= 80_000_000  # its real duration
    trace_id = outer.get_span_context().trace_id
    assert all(s.context is not None and s.context.trace_id == trace_id for s in attempts)
    with pytest.raises(ValueError):
        _tracing.set_min_attempt_ms(-1)


async def test_with_a_threshold_spans_made_in_fast_attempts_hang_from_the_run(
    app: tether.App, spans: InMemorySpanExporter
) -> None:
    """An attempt without a span of its own (faster than the threshold) runs with the
    run's stored context current: a span its code makes (async or in a thread) is in the
    run's trace, a child of the caller, not the root of a new trace."""
    from tether import _tracing

    tracer = trace.get_tracer("test")

    @app.activity
    async def in_loop() -> int:
        with tracer.start_as_current_span("user async"):
            pass
        return 1

    @app.activity
    def in_thread() -> int:
        with tracer.start_as_current_span("user sync"):
            pass
        return 2

    @app.workflow
    async def quick() -> int:
        return await in_loop() + await in_thread()

    _tracing.set_min_attempt_ms(50)
    try:
        with tracer.start_as_current_span("caller") as caller:
            run = await app.start(quick)
        async with app.worker(poll_interval=0.05):
            assert await run.result(timeout=20) == 3
    finally:
        _tracing.set_min_attempt_ms(0)
    assert _attempts(spans) == []  # both fast: no attempt span
    mine = {s.name: s for s in spans.get_finished_spans() if s.name.startswith("user ")}
    assert set(mine) == {"user async", "user sync"}
    for s in mine.values():
        assert s.context is not None and s.context.trace_id == caller.get_span_context().trace_id
        assert s.parent is not None and s.parent.span_id == caller.get_span_context().span_id


async def test_a_result_refused_for_a_lost_lease_is_counted_and_marked(
    app: tether.App, spans: InMemorySpanExporter
) -> None:
    """Attempt 1's lease passes to attempt 2 while it runs (here: it gives its task back
    and the worker claims it again); attempt 1's late result, offered on the one-commit
    path, is refused: ``tether_lease_lost_total`` counts it and its span says so."""
    import asyncio

    from tether._telemetry import RECORDER

    second = asyncio.Event()

    @app.activity(retry=tether.Retry(attempts=3, initial=0.01))
    async def contested() -> str:
        ctx = tether.activity_context()
        if ctx.attempt == 1:
            assert ctx.task is not None
            await app.store.release([ctx.task])  # the lease passes on
            await asyncio.wait_for(second.wait(), 10)
            return "late"
        second.set()
        await asyncio.sleep(0.3)  # still running when attempt 1 offers its result
        return f"attempt {ctx.attempt}"

    @app.workflow
    async def alone() -> str:
        return await contested()

    before = RECORDER.counter("tether_lease_lost")
    with trace.get_tracer("test").start_as_current_span("caller"):
        run = await app.start(alone)
    async with app.worker(poll_interval=0.05) as w:
        assert await run.result(timeout=20) == "attempt 2"
    assert w.stats["lease_lost"] == 1
    assert RECORDER.counter("tether_lease_lost") - before == 1
    outcomes = sorted(
        (s.attributes["tether.attempt"], s.attributes["tether.outcome"]) for s in _attempts(spans)
    )
    assert outcomes == [(1, "lease_lost"), (2, "ok")]


async def test_a_workflow_task_commit_refused_for_a_lost_lease_is_counted(
    app: tether.App,
) -> None:
    """A workflow task whose lease passed to another worker before its commit: the
    refused commit is counted in ``tether_lease_lost_total``, as an activity's is."""
    from tether._telemetry import RECORDER

    @app.workflow
    async def short() -> int:
        return 1

    store = app.store
    await app.start(short, run_id="lost-wt")
    (stale,) = await store.claim(worker_id="A", queues=["default"], limit=1, lease=-1)
    (fresh,) = await store.claim(worker_id="B", queues=["default"], limit=1, lease=30)
    assert fresh.fence == stale.fence + 1
    worker = app.worker(poll_interval=0.05)
    before = RECORDER.counter("tether_lease_lost")
    await worker._advance_and_commit(stale, None, [])
    assert worker.stats["lease_lost"] == 1
    assert RECORDER.counter("tether_lease_lost") - before == 1
    assert len(await store.read_history("lost-wt")) == 1  # nothing was written


def _histogram_count(name: str, labels: tuple[str, ...]) -> int:
    from tether._telemetry import RECORDER

    return sum(n for got, lbl, _, _, n in RECORDER.histograms() if (got, lbl) == (name, labels))


async def test_batched_attempts_get_spans_and_metrics_like_single_ones(
    app: tether.App, spans: InMemorySpanExporter
) -> None:
    """A batched call (``tether.Batch``) is an attempt of its own step: each item gets
    its span in its own run's trace with its outcome, its duration and queue wait are
    observed, and a breaker that refuses the batch counts each item as a rejection."""
    from tether._telemetry import RECORDER

    down = {"now": False}
    breaker = tether.CircuitBreaker("vec", failure_ratio=0.5, min_calls=2, window=60, cooldown=60)

    @app.activity(
        batch=tether.Batch(max_items=8, max_wait=0.05),
        retry=tether.Retry(attempts=1),
        breaker=breaker,
    )
    async def embed(texts: list[str]) -> list[int]:
        if down["now"]:
            raise ConnectionError("down")
        return [len(t) for t in texts]

    @app.workflow
    async def one(text: str) -> int:
        return await embed(text)

    tracer = trace.get_tracer("test")
    ok_wait = _histogram_count("tether_queue_wait", ("default", "activity"))
    durations = {
        o: _histogram_count("tether_activity_duration", ("embed", o)) for o in ("ok", "failed")
    }
    rejected = RECORDER.counter("tether_breaker_rejections", ("embed",))
    callers = []
    async with app.worker(poll_interval=0.05) as w:
        runs = []
        for text in ("a", "bb", "ccc"):
            with tracer.start_as_current_span("caller") as caller:
                runs.append(await app.start(one, text))
            callers.append(caller)
        assert [await r.result(timeout=20) for r in runs] == [1, 2, 3]
        down["now"] = True
        for _ in range(2):  # failures open the breaker, then it refuses the batch
            runs = [await app.start(one, "x") for _ in range(3)]
            for r in runs:
                with pytest.raises(tether.WorkflowFailedError):
                    await r.result(timeout=20)
    assert w.stats["batches"] >= 2 and w.stats["breaker_rejections"] == 3
    assert RECORDER.counter("tether_breaker_rejections", ("embed",)) - rejected == 3
    assert _histogram_count("tether_queue_wait", ("default", "activity")) - ok_wait == 9
    assert _histogram_count("tether_activity_duration", ("embed", "ok")) - durations["ok"] == 3
    assert (
        _histogram_count("tether_activity_duration", ("embed", "failed")) - durations["failed"] == 3
    )
    attempts = _attempts(spans)
    assert len(attempts) == 9  # one per item attempt, rejected ones too
    outcomes = sorted(str(s.attributes["tether.outcome"]) for s in attempts)
    assert outcomes == ["failed"] * 6 + ["ok"] * 3
    for caller in callers:  # each item's span is in its own run's trace
        (mine,) = [s for s in attempts if s.context.trace_id == caller.get_span_context().trace_id]
        assert mine.parent is not None and mine.parent.span_id == caller.get_span_context().span_id
        assert mine.attributes["tether.outcome"] == "ok"


async def test_a_first_task_run_by_app_start_gets_its_spans_and_metrics(
    app: tether.App, spans: InMemorySpanExporter
) -> None:
    """With an in-process worker, ``app.start`` runs the first workflow task itself (as
    every HTTP start of ``tether serve --workers N``). A run that ends in that task gets
    its lifetime span and run duration, the task its span, and a child it starts is
    counted as started, as on the ordinary path."""
    from tether._telemetry import RECORDER

    @app.workflow
    async def quick(x: int) -> int:
        return x * 2

    @app.workflow
    async def broken(x: int) -> int:
        raise ValueError("bad")

    @app.workflow
    async def kid() -> int:
        return 5

    @app.workflow
    async def parent() -> int:
        return await kid()

    names = ("quick", "broken", "parent", "kid")
    durations = {
        (n, s): _histogram_count("tether_run_duration", (n, s))
        for n in names
        for s in ("completed", "failed")
    }
    started = {n: RECORDER.counter("tether_runs_started", (n,)) for n in names}
    tracer = trace.get_tracer("test")
    async with app.worker(poll_interval=0.05) as w:
        with tracer.start_as_current_span("caller") as caller:
            runs = [await app.start(quick, 1), await app.start(broken, 1), await app.start(parent)]
        assert w.stats["eager_starts"] == 3  # each first task ran in app.start
        assert await runs[0].result(timeout=20) == 2
        with pytest.raises(tether.WorkflowFailedError):
            await runs[1].result(timeout=20)
        assert await runs[2].result(timeout=20) == 5
    got = {
        (n, s): _histogram_count("tether_run_duration", (n, s)) - durations[(n, s)]
        for n, s in durations
    }
    assert {k: v for k, v in got.items() if v} == {
        ("quick", "completed"): 1,
        ("broken", "failed"): 1,
        ("parent", "completed"): 1,
        ("kid", "completed"): 1,
    }
    assert {n: RECORDER.counter("tether_runs_started", (n,)) - started[n] for n in names} == {
        n: 1 for n in names
    }
    mine = [
        s
        for s in spans.get_finished_spans()
        if s.context is not None and s.context.trace_id == caller.get_span_context().trace_id
    ]
    lifetimes = sorted(
        (s.name, s.attributes["tether.outcome"])
        for s in mine
        if s.name.startswith("tether.lifetime")
    )
    assert lifetimes == [
        ("tether.lifetime broken", "failed"),
        ("tether.lifetime kid", "completed"),
        ("tether.lifetime parent", "completed"),
        ("tether.lifetime quick", "completed"),
    ]
    tasks = [s.name for s in mine if s.name.startswith("tether.workflow_task")]
    for n in ("quick", "broken", "parent"):  # the first (eager) task has its span
        assert f"tether.workflow_task {n}" in tasks
