"""Failure policies: backoff delays, classification, Retry-After, elapsed/schedule limits,
per-attempt timeouts, run deadlines, heartbeats and cancellation (breakers: test_breaker.py)."""

from __future__ import annotations

import asyncio
import email.utils
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pydantic
import pytest

import tether
from helpers import eventually
from tether import EventType, RunStatus


def holds(predicate: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    """An ``eventually`` check for plain in-memory state."""

    async def check() -> Any:
        return predicate()

    return check


async def events_of(app: tether.App, run_id: str, type_: EventType) -> list[tether.Event]:
    return [e for e in await app.history(run_id) if e.type is type_]


class FakeClock:
    """A store clock that only moves when the test says so.

    ``_record_failure`` computes ``retry_at = store.clock() + delay`` and the store then
    stamps the ``ActivityAttemptFailed`` event with its own ``store.clock()`` call inside
    the transaction. On the real clock those two calls differ by a few (non-deterministic)
    microseconds to milliseconds; on this clock they return the same value as long as the
    test does not advance it while a failure is being recorded. The test only advances it
    after it has read the event, when the step is parked waiting for ``retry_at``, so
    ``retry_at - created_at`` is exactly the delay the policy chose (float rounding aside).
    Starts on a whole second so an HTTP date (1 s resolution) converts exactly.
    """

    def __init__(self) -> None:
        self.t = float(int(time.time()))

    def __call__(self) -> float:
        return self.t

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)


async def drive_retries(app: tether.App, clock: FakeClock, run_id: str) -> list[tether.Event]:
    """Advance ``clock`` to each recorded ``retry_at`` until the run ends; return the
    ``ActivityAttemptFailed`` events."""
    deadline = time.monotonic() + 15
    while True:
        failed = await events_of(app, run_id, EventType.ACTIVITY_ATTEMPT_FAILED)
        for ev in failed:
            clock.advance_to(ev.data["retry_at"])
        if (await app.get(run_id)).is_finished:
            return failed
        assert time.monotonic() < deadline, "run did not finish"
        await asyncio.sleep(0.02)


class HTTPError(Exception):
    """Like ``httpx.HTTPStatusError``: carries the response with its status and headers."""

    def __init__(self, status: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"HTTP error {status}")
        self.response = SimpleNamespace(status_code=status, headers=headers or {})


class StatusError(Exception):
    """Like an SDK's APIStatusError: ``status_code`` on the exception itself."""

    def __init__(self, status: int, retry_after: Any = None) -> None:
        super().__init__(f"status {status}")
        self.status_code = status
        if retry_after is not None:
            self.retry_after = retry_after


class ContentFilterError(Exception):
    """A model refusing the prompt (code as OpenAI reports it)."""

    code = "content_filter"


class Model(pydantic.BaseModel):
    n: int


def validation_error() -> pydantic.ValidationError:
    try:
        Model.model_validate({"n": "not a number"})
    except pydantic.ValidationError as exc:
        return exc
    raise AssertionError("pydantic accepted bad input")


class Poison(tether.NonRetryable):
    pass


# -- classify --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "retryable", "reason"),
    [
        pytest.param(HTTPError(408), True, "HTTP 408", id="408"),
        pytest.param(HTTPError(429), True, "HTTP 429", id="429"),
        pytest.param(HTTPError(500), True, "HTTP 500", id="500"),
        pytest.param(StatusError(502), True, "HTTP 502", id="502-attr"),
        pytest.param(HTTPError(503), True, "HTTP 503", id="503"),
        pytest.param(StatusError(599), True, "HTTP 599", id="599"),
        pytest.param(HTTPError(400), False, "HTTP 400", id="400"),
        pytest.param(StatusError(401), False, "HTTP 401", id="401-attr"),
        pytest.param(HTTPError(403), False, "HTTP 403", id="403"),
        pytest.param(HTTPError(404), False, "HTTP 404", id="404"),
        pytest.param(StatusError(422), False, "HTTP 422", id="422-attr"),
        pytest.param(TimeoutError("slow"), True, "TimeoutError", id="timeout"),
        pytest.param(ConnectionError("reset"), True, "ConnectionError", id="connection"),
        pytest.param(ConnectionRefusedError(), True, None, id="connection-refused"),
        pytest.param(validation_error(), False, "validation error", id="pydantic"),
        pytest.param(ContentFilterError("blocked"), False, "content-policy refusal", id="refusal"),
        pytest.param(
            RuntimeError("rejected: content_policy_violation"), False, None, id="refusal-text"
        ),
        pytest.param(Poison("bad row"), False, "non-retryable", id="non-retryable"),
        pytest.param(tether.RetryAfter(3), True, None, id="retry-after"),
        pytest.param(ValueError("unknown"), True, "ValueError", id="unknown-transient"),
    ],
)
def test_classify_table(exc: BaseException, retryable: bool, reason: str | None) -> None:
    verdict = tether.classify(exc)
    assert verdict.retryable is retryable
    if reason is not None:
        assert verdict.reason == reason


def test_classify_policy_non_retryable_types_are_permanent() -> None:
    assert tether.classify(KeyError("k")).retryable
    verdict = tether.classify(KeyError("k"), (KeyError,))
    assert not verdict.retryable
    assert "KeyError" in verdict.reason


@pytest.mark.parametrize(
    ("exc", "after"),
    [
        pytest.param(HTTPError(429, {"Retry-After": "7"}), 7.0, id="header-seconds"),
        pytest.param(HTTPError(503, {"retry-after": "2.5"}), 2.5, id="header-lowercase"),
        pytest.param(
            HTTPError(503, {"Retry-After": email.utils.formatdate(1_000_030, usegmt=True)}),
            30.0,
            id="header-http-date",
        ),
        pytest.param(StatusError(429, retry_after=12), 12.0, id="attribute"),
        pytest.param(tether.RetryAfter(4.5), 4.5, id="RetryAfter"),
        pytest.param(HTTPError(503), None, id="no-header"),
    ],
)
def test_classify_retry_after_sets_delay(exc: BaseException, after: float | None) -> None:
    verdict = tether.classify(exc, now=1_000_000.0)
    assert verdict.retryable
    assert verdict.retry_after == after


# -- backoff delays ----------------------------------------------------------------------------


async def test_retry_delays_follow_capped_exponential_backoff(
    app: tether.App, worker: tether.Worker
) -> None:
    clock = FakeClock()
    app.store.clock = clock  # type: ignore[misc]
    attempts: list[int] = []

    @app.activity(retry=tether.Retry(attempts=6, initial=1, backoff=2, max_interval=5, jitter=0))
    def flaky() -> None:
        attempts.append(tether.activity_context().attempt)
        raise ConnectionError(f"down #{len(attempts)}")

    @app.workflow
    async def wf() -> None:
        await flaky()

    run = await app.start(wf)
    first = await eventually(
        lambda: events_of(app, run.run_id, EventType.ACTIVITY_ATTEMPT_FAILED), what="attempt 1"
    )
    # the clock has not reached retry_at: attempt 2 must not start
    await asyncio.sleep(0.2)
    assert attempts == [1]
    assert first[0].data["retry_at"] > clock()
    failed = await drive_retries(app, clock, run.run_id)
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=5)
    assert attempts == [1, 2, 3, 4, 5, 6]
    assert [e.data["attempt"] for e in failed] == [1, 2, 3, 4, 5]
    delays = [e.data["retry_at"] - e.created_at for e in failed]
    assert delays == pytest.approx([1, 2, 4, 5, 5], abs=1e-6)
    assert all(e.data["error"]["retryable"] for e in failed)
    assert failed[0].data["error"]["reason"] == "ConnectionError"
    (final,) = await events_of(app, run.run_id, EventType.ACTIVITY_FAILED)
    assert final.data["attempt"] == 6
    assert final.data["error"]["retryable"] is False
    assert final.data["error"]["reason"].startswith("gave up after 6 attempt(s)")


@pytest.mark.parametrize(
    ("make", "delay"),
    [
        pytest.param(lambda now: HTTPError(503, {"Retry-After": "7"}), 7.0, id="seconds"),
        pytest.param(
            lambda now: HTTPError(
                429, {"Retry-After": email.utils.formatdate(now + 30, usegmt=True)}
            ),
            30.0,
            id="http-date",
        ),
        pytest.param(lambda now: tether.RetryAfter(11), 11.0, id="RetryAfter"),
        pytest.param(lambda now: StatusError(429, retry_after=3), 3.0, id="attribute"),
    ],
)
async def test_retry_after_replaces_backoff_delay(
    app: tether.App,
    worker: tether.Worker,
    make: Callable[[float], BaseException],
    delay: float,
) -> None:
    clock = FakeClock()
    app.store.clock = clock  # type: ignore[misc]
    attempts: list[int] = []

    @app.activity(retry=tether.Retry(attempts=3, initial=1, backoff=2, jitter=0))
    def rate_limited() -> str:
        attempts.append(tether.activity_context().attempt)
        if len(attempts) == 1:
            raise make(clock())
        return "ok"

    @app.workflow
    async def wf() -> str:
        return await rate_limited()

    run = await app.start(wf)
    failed = await drive_retries(app, clock, run.run_id)
    assert await run.result(timeout=5) == "ok"
    assert attempts == [1, 2]
    (ev,) = failed
    assert ev.data["retry_at"] - ev.created_at == pytest.approx(delay, abs=1e-6)
    assert ev.data["error"]["retry_after"] == pytest.approx(delay, abs=1e-6)


# -- permanent errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        pytest.param(HTTPError(400), None, id="http-400"),
        pytest.param(StatusError(401), None, id="http-401"),
        pytest.param(HTTPError(403), None, id="http-403"),
        pytest.param(HTTPError(404), None, id="http-404"),
        pytest.param(StatusError(422), None, id="http-422"),
        pytest.param(validation_error(), None, id="validation-error"),
        pytest.param(ContentFilterError("refused"), None, id="content-refusal"),
        pytest.param(Poison("bad"), None, id="NonRetryable"),
        pytest.param(
            LookupError("gone"),
            tether.Retry(attempts=5, initial=0.01, jitter=0, non_retryable=(LookupError,)),
            id="policy-non-retryable",
        ),
    ],
)
async def test_permanent_errors_fail_after_one_attempt(
    app: tether.App, worker: tether.Worker, exc: BaseException, retry: tether.Retry | None
) -> None:
    calls: list[int] = []

    @app.activity(retry=retry or tether.Retry(attempts=5, initial=0.01, jitter=0))
    async def call_api() -> None:
        calls.append(tether.activity_context().attempt)
        raise exc

    @app.workflow
    async def wf() -> dict[str, Any]:
        try:
            await call_api()
        except tether.ActivityError as err:
            return {"type": err.error_type, "attempts": err.attempts}
        return {}

    run = await app.start(wf)
    assert await run.result(timeout=10) == {"type": type(exc).__name__, "attempts": 1}
    await asyncio.sleep(0.1)  # a retry (0.01 s later) would have happened by now
    assert calls == [1]
    assert await events_of(app, run.run_id, EventType.ACTIVITY_ATTEMPT_FAILED) == []
    (failed,) = await events_of(app, run.run_id, EventType.ACTIVITY_FAILED)
    assert failed.data["attempt"] == 1
    assert failed.data["error"]["retryable"] is False


# -- elapsed limits ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("retry", "schedule_timeout", "reason"),
    [
        pytest.param(
            tether.Retry(
                attempts=50, initial=1, backoff=1, max_interval=1, max_elapsed=3.5, jitter=0
            ),
            None,
            "max_elapsed",
            id="max_elapsed",
        ),
        pytest.param(
            # no jitter: with the default 20%, four delays could sum to under 3.5 s and
            # let a fifth attempt in (it did, about once in a hundred runs)
            tether.Retry(attempts=50, initial=1, backoff=1, max_interval=1, jitter=0),
            3.5,
            "schedule-to-close",
        ),
    ],
)
async def test_retry_stops_when_elapsed_limit_would_pass(
    app: tether.App,
    worker: tether.Worker,
    retry: tether.Retry,
    schedule_timeout: float | None,
    reason: str,
) -> None:
    # attempts at t0, t0+1, t0+2, t0+3 (fake clock); a 5th at t0+4 would be past t0+3.5
    clock = FakeClock()
    app.store.clock = clock  # type: ignore[misc]
    attempts: list[int] = []

    @app.activity(retry=retry, schedule_timeout=schedule_timeout)
    def flaky() -> None:
        attempts.append(tether.activity_context().attempt)
        raise ConnectionError("down")

    @app.workflow
    async def wf() -> int:
        try:
            await flaky()
        except tether.ActivityError as exc:
            return exc.attempts
        return 0

    run = await app.start(wf)
    failed = await drive_retries(app, clock, run.run_id)
    assert await run.result(timeout=5) == 4
    assert attempts == [1, 2, 3, 4]
    assert len(failed) == 3
    (final,) = await events_of(app, run.run_id, EventType.ACTIVITY_FAILED)
    assert reason in final.data["error"]["reason"]


async def test_schedule_timeout_bounds_a_hanging_attempt(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.activity(retry=tether.Retry(attempts=10, initial=0.01, jitter=0), schedule_timeout=0.3)
    async def hangs() -> None:
        await asyncio.sleep(30)

    @app.workflow
    async def wf() -> dict[str, Any]:
        try:
            await hangs()
        except tether.ActivityError as exc:
            return {"type": exc.error_type, "attempts": exc.attempts}
        return {}

    t0 = time.monotonic()
    run = await app.start(wf)
    out = await run.result(timeout=20)
    assert time.monotonic() - t0 < 15  # bounded at 0.3 s, not the 30 s hang (loaded CI)
    assert out["attempts"] == 1
    (final,) = await events_of(app, run.run_id, EventType.ACTIVITY_FAILED)
    assert "schedule-to-close" in final.data["error"]["reason"]


# -- per-attempt timeout -----------------------------------------------------------------------


async def test_timeout_sync_activity_attempt_times_out_and_is_retried(
    app: tether.App, worker: tether.Worker
) -> None:
    release = threading.Event()
    attempts: list[int] = []

    @app.activity(retry=tether.Retry(attempts=3, initial=0.01, jitter=0), timeout=0.2)
    def slow_first() -> int:
        attempt = tether.activity_context().attempt
        attempts.append(attempt)
        if attempt == 1:
            release.wait(5)  # a thread cannot be interrupted: the attempt is abandoned
        return attempt

    @app.workflow
    async def wf() -> int:
        return await slow_first()

    try:
        run = await app.start(wf)
        assert await run.result(timeout=10) == 2
    finally:
        release.set()
    assert attempts == [1, 2]
    (timed_out,) = await events_of(app, run.run_id, EventType.ACTIVITY_ATTEMPT_FAILED)
    assert timed_out.data["error"]["type"] == "TimeoutError"
    (done,) = await events_of(app, run.run_id, EventType.ACTIVITY_COMPLETED)
    assert done.data["attempt"] == 2


async def test_timeout_async_activity_attempt_times_out_and_is_retried(
    app: tether.App, worker: tether.Worker
) -> None:
    cancelled: list[int] = []

    @app.activity(retry=tether.Retry(attempts=3, initial=0.01, jitter=0), timeout=0.2)
    async def slow_first() -> int:
        attempt = tether.activity_context().attempt
        if attempt == 1:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(attempt)
                raise
        return attempt

    @app.workflow
    async def wf() -> int:
        return await slow_first()

    run = await app.start(wf)
    assert await run.result(timeout=10) == 2
    assert cancelled == [1]
    (timed_out,) = await events_of(app, run.run_id, EventType.ACTIVITY_ATTEMPT_FAILED)
    assert timed_out.data["error"]["type"] == "TimeoutError"


# -- run deadline ------------------------------------------------------------------------------


async def test_deadline_ends_run_timed_out_after_saga_compensation(
    app: tether.App, worker: tether.Worker
) -> None:
    log: list[str] = []

    @app.activity
    def act(what: str) -> str:
        log.append(what)
        return what

    @app.workflow
    async def trip() -> str:
        try:
            async with tether.saga() as saga:
                await saga.step(act("reserve"), undo=lambda r: act(f"release {r}"))
                await saga.step(act("charge"), undo=lambda r: act(f"refund {r}"))
                await tether.wait_event("never-sent")
        except asyncio.CancelledError:
            await act("saw cancellation")
            raise
        return "unreachable"

    t0 = time.monotonic()
    run = await app.start(trip, deadline=0.5)
    with pytest.raises(tether.RunTimedOutError) as ei:
        await run.result(timeout=20)
    assert 0.4 < time.monotonic() - t0 < 15  # the 0.5 s deadline; loaded CI is slow
    assert ei.value.status == "timed_out"
    assert log == ["reserve", "charge", "refund charge", "release reserve", "saw cancellation"]
    info = await app.get(run.run_id)
    assert info.status is RunStatus.TIMED_OUT
    assert await events_of(app, run.run_id, EventType.DEADLINE_EXCEEDED)


async def test_deadline_not_reached_run_completes_normally(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.workflow
    async def quick() -> str:
        await tether.sleep(0.05)
        return "done"

    run = await app.start(quick, deadline=5)
    assert await run.result(timeout=10) == "done"
    await asyncio.sleep(0.1)
    assert (await app.get(run.run_id)).status is RunStatus.COMPLETED


async def test_first_timer_wins_and_late_step_outcome_changes_nothing(
    app: tether.App, worker: tether.Worker
) -> None:
    finished: list[str] = []

    @app.activity(retry=tether.Retry(attempts=1))
    async def slow() -> str:
        await asyncio.sleep(0.5)
        finished.append("slow")
        return "late"

    @app.workflow
    async def race() -> list[Any]:
        winner = await tether.first(slow(), tether.sleep(0.1))
        await tether.wait_event("go")
        return [winner, "after"]

    run = await app.start(race)

    async def loser_outcome() -> bool:
        types = {EventType.ACTIVITY_COMPLETED, EventType.ACTIVITY_FAILED}
        return any(e.type in types and e.step == 1 for e in await app.history(run.run_id))

    # the loser either finishes (recorded late) or is cancelled; both are outcomes of step 1
    await eventually(loser_outcome, what="loser's late outcome")
    await app.signal(run.run_id, "go")
    assert await run.result(timeout=10) == [None, "after"]
    history = await app.history(run.run_id)
    fired = next(e.seq for e in history if e.type is EventType.TIMER_FIRED)
    late = next(
        e.seq for e in history if e.step == 1 and e.type is not EventType.ACTIVITY_SCHEDULED
    )
    assert late > fired


# -- heartbeats --------------------------------------------------------------------------------


async def test_heartbeat_details_let_next_attempt_resume(
    app: tether.App, worker: tether.Worker
) -> None:
    seen: list[tuple[int, Any]] = []
    processed: list[int] = []

    @app.activity(retry=tether.Retry(attempts=3, initial=0.01, jitter=0), heartbeat_timeout=5)
    def export(pages: int) -> dict[str, int]:
        ctx = tether.activity_context()
        seen.append((ctx.attempt, ctx.heartbeat_details))
        start = (ctx.heartbeat_details or {"page": 0})["page"] + 1
        for page in range(start, pages + 1):
            processed.append(page)
            if page % 26 == 0:
                ctx.heartbeat({"page": page})
            if ctx.attempt == 1 and page == 320:
                raise ConnectionError("connection reset at page 320")
        return {"first": start, "last": pages}

    @app.workflow
    async def wf() -> dict[str, int]:
        return await export(400)

    run = await app.start(wf)
    assert await run.result(timeout=15) == {"first": 313, "last": 400}
    assert seen == [(1, None), (2, {"page": 312})]
    assert processed == list(range(1, 321)) + list(range(313, 401))


async def test_heartbeat_cancellation_reaches_sync_activity_which_cleans_up(
    app: tether.App, worker: tether.Worker
) -> None:
    started = threading.Event()
    cleaned: list[int] = []

    @app.activity(retry=tether.Retry(attempts=1), heartbeat_timeout=5)
    def crunch() -> str:
        ctx = tether.activity_context()
        started.set()
        i = 0
        deadline = time.monotonic() + 60
        while not ctx.is_cancelled and time.monotonic() < deadline:
            i += 1
            ctx.heartbeat({"i": i})
            time.sleep(0.02)
        cleaned.append(i)  # release resources, delete temp files...
        return "stopped" if ctx.is_cancelled else "ran to the end"

    @app.workflow
    async def wf() -> str:
        return await crunch()

    run = await app.start(wf)
    await eventually(holds(started.is_set), what="activity started")
    t0 = time.monotonic()
    await run.cancel("user asked")
    with pytest.raises(tether.RunCancelledError):
        await run.result(timeout=10)
    await eventually(holds(lambda: cleaned), what="activity cleaned up")
    assert time.monotonic() - t0 < 20  # it saw the cancellation, not its 60 s deadline
    assert (await app.get(run.run_id)).status is RunStatus.CANCELLED


# -- heartbeat timeout vs a frozen worker process ----------------------------------------------

HERE = Path(__file__).parent


def spawn_worker(store_url: str, effects: Path, poll: float, log: Path) -> subprocess.Popen[bytes]:
    """A worker process (15 s lease) running ``tests/failure_app.py`` (stderr to ``log``)."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    args = [store_url, str(effects), "15", str(poll)]
    with log.open("ab") as err:
        return subprocess.Popen(
            [sys.executable, str(HERE / "failure_app.py"), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def side_effects(effects: Path, kind: str) -> list[tuple[Any, ...]]:
    """Rows ``(name, key, attempt, pid, detail)`` of the side table of the given kind."""
    if not effects.exists():
        return []
    conn = sqlite3.connect(effects, timeout=30)
    try:
        return conn.execute(
            "SELECT name, key, attempt, pid, detail FROM effects WHERE kind = ? ORDER BY rowid",
            (kind,),
        ).fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        conn.close()


def process_state(pid: int) -> str:
    """The one-letter state of a process from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def test_heartbeat_timeout_reclaims_step_from_frozen_worker_process(
    app: tether.App, store_url: str, tmp_path: Path
) -> None:
    effects, log = tmp_path / "effects.db", tmp_path / "workers.log"

    @app.workflow(name="frozen_flow")
    async def frozen_flow() -> dict[str, int]:
        raise AssertionError("runs in the worker processes only")

    run = await app.start(frozen_flow)
    # the first worker polls slowly so that, frozen, it is very unlikely to hold a store
    # transaction (a frozen SQLite writer would block every process)
    frozen = spawn_worker(store_url, effects, 1.0, log)
    rescuer: subprocess.Popen[bytes] | None = None
    try:
        await eventually(
            holds(lambda: side_effects(effects, "freeze")), timeout=20, what="attempt 1 froze"
        )
        frozen.send_signal(signal.SIGSTOP)
        await eventually(holds(lambda: process_state(frozen.pid) == "T"), what="SIGSTOP")
        t_frozen = time.monotonic()
        rescuer = spawn_worker(store_url, effects, 0.05, log)
        out = await run.result(timeout=12)
        took = time.monotonic() - t_frozen
        assert took < 10, f"reclaimed only after {took:.1f}s: not by the 1 s heartbeat timeout"
        assert process_state(frozen.pid) == "T"  # still frozen: the rescuer did it alone
        assert out == {"attempt": 2, "pid": rescuer.pid, "start": 3}  # resumed after chunk 2
        # thaw the first worker: its attempt must not be recorded
        frozen.send_signal(signal.SIGCONT)
        returned = await eventually(
            holds(lambda: [r for r in side_effects(effects, "return") if r[3] == frozen.pid]),
            what="frozen attempt finished",
        )
        assert returned[0][4] == "True"  # its heartbeat told it the work was taken over
        await asyncio.sleep(0.5)  # time for its (refused) completion to reach the store
        assert frozen.poll() is None, log.read_text()
        history = await app.history(run.run_id)
        completed = [e for e in history if e.type is EventType.ACTIVITY_COMPLETED]
        assert len(completed) == 1
        assert completed[0].data["attempt"] == 2
        assert (await app.get(run.run_id)).status is RunStatus.COMPLETED
        assert [r[2] for r in side_effects(effects, "start")] == [1, 2]
    finally:
        for proc in (frozen, rescuer):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)
