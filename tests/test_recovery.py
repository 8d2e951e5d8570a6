"""Recovery: dead letters, ``app.retry``, ``replay_dead_letter``, ``app.fork``, ``tether.map``
with poison items, and idempotency keys that survive replay."""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from typing import Any

import pytest

import tether
from helpers import eventually
from tether import EventType, RunStatus


def fast(attempts: int) -> tether.Retry:
    return tether.Retry(attempts=attempts, initial=0.01, max_interval=0.02, jitter=0)


# -- dead letters and app.retry ------------------------------------------------------------------


async def test_dead_letter_records_exhausted_step_and_failed_run_then_retry_reruns_only_it(
    app: tether.App, worker: tether.Worker
) -> None:
    ran: collections.Counter[str] = collections.Counter()
    broken = {"enrich": True}

    @app.activity(retry=fast(3))
    def fetch(doc: str) -> str:
        ran["fetch"] += 1
        return f"text of {doc}"

    @app.activity(retry=fast(3))
    def enrich(text: str, model: str) -> str:
        ran["enrich"] += 1
        if broken["enrich"]:
            raise ConnectionError("model endpoint unreachable")
        return f"{text} +entities({model})"

    @app.activity(retry=fast(3))
    def store(text: str) -> str:
        ran["store"] += 1
        return f"stored: {text}"

    @app.workflow
    async def pipeline(doc: str) -> str:
        text = await fetch(doc)
        rich = await enrich(text, model="small")
        return await store(rich)

    run = await app.start(pipeline, "d1")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    assert ran == {"fetch": 1, "enrich": 3}

    letters = await app.dead_letters(run_id=run.run_id)
    assert [d.kind for d in letters] == ["activity", "run"]
    step, whole = letters
    assert step.name == "enrich"
    assert step.step == 2
    assert step.attempts == 3
    assert json.loads(step.input or "{}") == {"args": ["text of d1"], "kwargs": {"model": "small"}}
    assert step.error is not None
    assert step.error["type"] == "ConnectionError"
    assert step.error["message"] == "model endpoint unreachable"
    assert step.reason == "gave up after 3 attempt(s): ConnectionError"
    assert whole.name == "pipeline"
    assert whole.reason == "failed"
    assert whole.error is not None
    assert "ActivityError" in whole.error["type"] + whole.error["message"]

    broken["enrich"] = False  # the fix is deployed
    retried = await app.retry(run.run_id)
    assert await retried.result(timeout=10) == "stored: text of d1 +entities(small)"
    assert ran == {"fetch": 1, "enrich": 4, "store": 1}  # only the failed step ran again
    assert await app.dead_letters(run_id=run.run_id) == []
    resolved = await app.dead_letters(run_id=run.run_id, include_resolved=True)
    assert len(resolved) == 2
    assert all(d.resolution == {"state": "retried"} for d in resolved)
    assert (await app.get(run.run_id)).status is RunStatus.COMPLETED
    with pytest.raises(tether.RecoveryError):
        await app.retry(run.run_id)  # completed runs are not retried


async def test_attempt_starts_again_at_one_after_an_operator_retry_with_the_same_key(
    app: tether.App, worker: tether.Worker
) -> None:
    """As docs/activities.md says: ``attempt`` is not a "did an earlier try happen?" test
    (a retry gives the step a fresh round of its policy); the idempotency key is."""
    seen: list[tuple[int, str]] = []
    broken = {"now": True}

    @app.activity(retry=fast(2))
    def charge(order: str) -> str:
        ctx = tether.activity_context()
        seen.append((ctx.attempt, ctx.idempotency_key))
        if broken["now"]:
            raise TimeoutError("provider timed out")
        return "ch_1"

    @app.workflow
    async def pay(order: str) -> str:
        return await charge(order)

    run = await app.start(pay, "o-1")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    broken["now"] = False
    assert await (await app.retry(run.run_id)).result(timeout=10) == "ch_1"
    key = f"{run.run_id}:1"
    assert seen == [(1, key), (2, key), (1, key)]


async def test_retry_rejects_running_run(app: tether.App, worker: tether.Worker) -> None:
    @app.workflow
    async def waits() -> None:
        await tether.wait_event("never")

    run = await app.start(waits)
    with pytest.raises(tether.RecoveryError):
        await app.retry(run.run_id)
    await app.terminate(run.run_id)


async def test_refusals_name_the_cli_and_http_ways_as_well_as_python(
    app: tether.App, worker: tether.Worker
) -> None:
    """`tether start` with a run id in use said "fetch the existing run with
    app.get_run(run_id)", and HTTP /retry of a finished run answered 409 "use app.fork":
    Python calls, to someone at a shell or an HTTP client. Each now names the Python
    call and the CLI command or HTTP route that do the same."""

    @app.workflow
    async def done(x: int) -> int:
        return x

    run = await app.start(done, 1, run_id="r1")
    assert await run.result(timeout=10) == 1
    with pytest.raises(tether.RecoveryError) as refused:
        await app.retry("r1")
    assert "app.fork" in str(refused.value), refused.value
    assert "POST /v1/runs/{id}/fork" in str(refused.value), refused.value
    with pytest.raises(tether.RunIdConflictError) as conflict:
        await app.start(done, 2, run_id="r1")
    text = str(conflict.value)
    for way in ("app.get_run(run_id)", "tether get RUN_ID", "GET /v1/runs/{id}"):
        assert way in text, text


# -- replaying a poison item ---------------------------------------------------------------------


async def test_replay_dead_letter_replays_poison_item_once_with_same_idempotency_key(
    app: tether.App, worker: tether.Worker
) -> None:
    keys: dict[int, list[str]] = collections.defaultdict(list)
    fixed = {"value": False}

    @app.activity(retry=fast(3))
    def score(item: int) -> int:
        keys[item].append(tether.activity_context().idempotency_key)
        if item == 3 and not fixed["value"]:
            raise tether.NonRetryable("cannot parse item 3")
        return item * 10

    @app.workflow
    async def batch(items: list[int]) -> list[Any]:
        outs = await tether.map(score, items, concurrency=2)
        return [(o.index, o.ok, o.value, o.error_type) for o in outs]

    run = await app.start(batch, [1, 2, 3, 4])
    out = await run.result(timeout=10)
    assert out == [
        [0, True, 10, None],
        [1, True, 20, None],
        [2, False, None, "ActivityError"],
        [3, True, 40, None],
    ]
    (letter,) = await app.dead_letters(run_id=run.run_id)
    assert letter.kind == "activity"
    assert letter.name == "score"
    assert letter.attempts == 1
    assert letter.reason == "non-retryable"

    fixed["value"] = True
    assert await app.replay_dead_letter(letter.id) == 30
    assert keys[3] == [keys[3][0]] * 2  # replayed with the original idempotency key
    with pytest.raises(tether.RecoveryError):
        await app.replay_dead_letter(letter.id)
    assert len(keys[3]) == 2  # the second replay ran nothing
    (resolved,) = await app.dead_letters(run_id=run.run_id, include_resolved=True)
    assert resolved.resolution == {"state": "replayed", "result": 30}
    assert resolved.resolved_at is not None


async def test_replay_dead_letter_failing_again_reopens_letter(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.activity(retry=fast(1))
    def poison(item: int) -> int:
        raise tether.NonRetryable(f"bad {item}")

    @app.workflow
    async def batch() -> int:
        outs = await tether.map(poison, [7])
        return sum(1 for o in outs if not o.ok)

    assert await (await app.start(batch)).result(timeout=10) == 1
    (letter,) = await app.dead_letters()
    with pytest.raises(tether.NonRetryable):
        await app.replay_dead_letter(letter.id)
    (again,) = await app.dead_letters()
    assert again.id == letter.id
    assert again.resolved_at is None


async def test_replay_refuses_a_step_the_workflow_handled_and_resolve_closes_it(
    app: tether.App, worker: tether.Worker
) -> None:
    """A charge that gave up in doubt, caught by the workflow (which cancelled the order),
    is not charged again by a replay: the replay is refused, naming what the run did;
    the operator closes the letter with a note instead (audited), or forces the replay."""
    charges: list[str] = []

    @app.activity(retry=fast(1))
    def charge(order: str) -> str:
        charges.append(tether.activity_context().idempotency_key)
        if len(charges) == 1:
            raise TimeoutError("provider timed out: outcome unknown")
        return "ch_1"

    @app.activity
    def notify(msg: str) -> None:
        pass

    @app.workflow
    async def checkout(order: str) -> str:
        try:
            await charge(order)
        except tether.ActivityError:
            await notify("payment failed; order cancelled")
            return "cancelled"
        return "paid"

    run = await app.start(checkout, "o-1")
    assert await run.result(timeout=10) == "cancelled"
    (letter,) = await app.dead_letters(run_id=run.run_id)
    with pytest.raises(tether.RecoveryError) as refused:
        await app.replay_dead_letter(letter.id)
    message = str(refused.value)
    assert "completed" in message and "notify" in message
    assert "resolve_dead_letter" in message and "force=True" in message
    assert charges == [f"{run.run_id}:1"]  # nothing ran again
    (still,) = await app.dead_letters(run_id=run.run_id)  # the letter stays open
    assert still.id == letter.id and still.resolved_at is None

    note = "checked with the provider: not charged"
    await app.resolve_dead_letter(letter.id, note=note, by="ann")
    assert await app.dead_letters(run_id=run.run_id) == []
    (closed,) = await app.dead_letters(run_id=run.run_id, include_resolved=True)
    assert closed.resolution == {"state": "resolved", "note": note, "by": "ann"}
    assert closed.resolved_at is not None
    (entry,) = [e for e in await app.audit(run.run_id) if e["action"] == "resolve dead letter"]
    assert entry["actor"] == "ann"
    assert entry["detail"] == {"letter": letter.id, "note": note}
    with pytest.raises(tether.RecoveryError):  # closed: neither resolved nor replayed again
        await app.resolve_dead_letter(letter.id, note="again")
    with pytest.raises(tether.RecoveryError):
        await app.replay_dead_letter(letter.id, force=True)
    assert (await app.get(run.run_id)).status is RunStatus.COMPLETED


async def test_replay_force_runs_a_handled_step_again(
    app: tether.App, worker: tether.Worker
) -> None:
    ran: list[int] = []

    @app.activity(retry=fast(1))
    def fragile(i: int) -> int:
        ran.append(i)
        if len(ran) == 1:
            raise tether.NonRetryable("bad")
        return i * 2

    @app.workflow
    async def caught() -> str:
        try:
            await fragile(4)
        except tether.ActivityError:
            await tether.sleep(3600)  # still running, long after it handled the failure
        return "done"

    run = await app.start(caught)
    (letter,) = await eventually(lambda: app.dead_letters(run_id=run.run_id))
    with pytest.raises(tether.RecoveryError, match="running"):
        await app.replay_dead_letter(letter.id)
    assert await app.replay_dead_letter(letter.id, force=True) == 8
    (closed,) = await app.dead_letters(run_id=run.run_id, include_resolved=True)
    assert closed.resolution == {"state": "replayed", "result": 8, "forced": True}
    await app.terminate(run.run_id)


async def test_resolve_dead_letter_needs_a_note_and_an_open_letter(
    app: tether.App, worker: tether.Worker
) -> None:
    @app.activity(retry=fast(1))
    def poison(item: int) -> int:
        raise tether.NonRetryable(f"bad {item}")

    @app.workflow
    async def batch() -> int:
        outs = await tether.map(poison, [7])
        return sum(1 for o in outs if not o.ok)

    assert await (await app.start(batch)).result(timeout=10) == 1
    (letter,) = await app.dead_letters()
    with pytest.raises(tether.ConfigurationError):
        await app.resolve_dead_letter(letter.id, note="  ")
    with pytest.raises(tether.RecoveryError):
        await app.resolve_dead_letter(letter.id + 1000, note="no such letter")
    await app.resolve_dead_letter(letter.id, note="item 7 is junk: dropped")
    (closed,) = await app.dead_letters(include_resolved=True)
    assert closed.resolution == {"state": "resolved", "note": "item 7 is junk: dropped", "by": None}
    (entry,) = await app.audit_log(target=f"run:{letter.run_id}")
    assert entry["actor"] == "app" and entry["action"] == "resolve dead letter"


# -- fork ----------------------------------------------------------------------------------------


async def test_fork_reuses_first_k_outcomes_and_runs_the_rest(
    app: tether.App, worker: tether.Worker
) -> None:
    ran: collections.Counter[int] = collections.Counter()
    deploy = {"version": "v1"}

    @app.activity
    def step(i: int) -> str:
        ran[i] += 1
        return f"{i}@{deploy['version']}"

    @app.workflow
    async def four() -> list[str]:
        return [await step(i) for i in range(1, 5)]

    run = await app.start(four)
    assert await run.result(timeout=10) == ["1@v1", "2@v1", "3@v1", "4@v1"]
    deploy["version"] = "v2"
    forked = await app.fork(run.run_id, at_step=2, new_run_id="forked")
    assert forked.run_id == "forked"
    assert await forked.result(timeout=10) == ["1@v1", "2@v1", "3@v2", "4@v2"]
    assert ran == {1: 1, 2: 1, 3: 2, 4: 2}
    # the original run is untouched
    assert await app.get_run(run.run_id).result(timeout=5) == ["1@v1", "2@v1", "3@v1", "4@v1"]
    started = (await app.history("forked"))[0]
    assert started.data["forked_from"] == {"run_id": run.run_id, "at_step": 2}


async def test_a_fork_keeps_its_tenant_for_the_child_it_starts_again(
    app: tether.App, worker: tether.Worker
) -> None:
    # a child in flight at the fork point is started again for the fork: with no
    # tenant, so the tenant's erasure, retention and key did not reach it
    @app.workflow
    async def kid(x: int) -> int:
        await tether.wait_event("go", timeout=60)
        return x

    @app.workflow
    async def parent() -> int:
        return await kid(7)

    run = await app.start(parent, tenant="acme")

    async def child_started() -> bool:
        return any(e.type is EventType.CHILD_STARTED for e in await app.history(run.run_id))

    await eventually(child_started, 15, "the child started")
    forked = await app.fork(run.run_id, at_step=1, new_run_id="forked-parent")
    child = f"{forked.run_id}/1"
    assert (await app.get(child)).tenant == "acme"
    await app.signal(child, "go")
    await app.signal(f"{run.run_id}/1", "go")
    assert await forked.result(timeout=30) == 7


async def test_fork_at_zero_reruns_everything(app: tether.App, worker: tether.Worker) -> None:
    ran: collections.Counter[int] = collections.Counter()

    @app.activity
    def step(i: int) -> int:
        ran[i] += 1
        return i

    @app.workflow
    async def two() -> int:
        return await step(1) + await step(2)

    run = await app.start(two)
    assert await run.result(timeout=10) == 3
    forked = await app.fork(run.run_id, at_step=0)
    assert await forked.result(timeout=10) == 3
    assert ran == {1: 2, 2: 2}


# -- map -----------------------------------------------------------------------------------------


async def test_map_thousand_items_with_poison_items_bounded_concurrency(
    app: tether.App, worker: tether.Worker
) -> None:
    poison = {i * 97 + 5 for i in range(10)}
    lock = threading.Lock()
    state = {"now": 0, "peak": 0}
    seen: collections.Counter[int] = collections.Counter()

    @app.activity(retry=fast(3))
    async def embed(i: int) -> int:
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            seen[i] += 1
        try:
            await asyncio.sleep(((i * 7919) % 7) / 1000)  # scramble completion order
            if i in poison:
                raise tether.NonRetryable(f"item {i} is malformed")
            return i * 2
        finally:
            with lock:
                state["now"] -= 1

    @app.workflow
    async def index(n: int) -> list[tuple[int, bool, int | None, str | None]]:
        outs = await tether.map(embed, range(n), concurrency=8)
        return [(o.index, o.ok, o.value, o.error) for o in outs]

    run = await app.start(index, 1000)
    out = await run.result(timeout=60)
    assert [o[0] for o in out] == list(range(1000))  # input order
    ok = [o for o in out if o[1]]
    bad = [o for o in out if not o[1]]
    assert len(ok) == 990
    assert all(value == i * 2 for i, _, value, _ in ok)
    assert [o[0] for o in bad] == sorted(poison)
    assert all(f"item {i} is malformed" in (err or "") for i, _, _, err in bad)
    assert 1 < state["peak"] <= 8
    assert all(n == 1 for n in seen.values()) and len(seen) == 1000  # poison not retried
    letters = await app.dead_letters(run_id=run.run_id, limit=1000)
    assert sorted(json.loads(d.input or "{}")["args"][0] for d in letters) == sorted(poison)


async def test_map_concurrency_must_be_positive(app: tether.App, worker: tether.Worker) -> None:
    @app.activity
    def f(x: int) -> int:
        return x

    @app.workflow
    async def wf() -> str:
        try:
            await tether.map(f, [1], concurrency=0)
        except ValueError as exc:
            return str(exc)
        return "accepted"

    assert "concurrency" in await (await app.start(wf)).result(timeout=10)


# -- idempotency keys ----------------------------------------------------------------------------


async def test_idempotency_key_stable_across_replay_in_fresh_worker(
    app: tether.App, store_url: str
) -> None:
    charged: list[str] = []

    @app.activity
    def charge(key: str) -> str:
        charged.append(key)
        return key

    @app.workflow
    async def pay() -> dict[str, str]:
        key = tether.idempotency_key("charge")
        used = await charge(key)
        await tether.wait_event("confirm")
        return {
            "before": used,
            "after": tether.idempotency_key("charge"),
            "other": tether.idempotency_key("refund"),
        }

    w1 = app.worker(lease=5.0, poll_interval=0.05)
    await w1.start()
    try:
        run = await app.start(pay, run_id="order-17")

        async def waiting() -> bool:
            return any(
                e.type is EventType.ACTIVITY_COMPLETED for e in await app.history(run.run_id)
            )

        await eventually(waiting, what="charge recorded")
        await asyncio.sleep(0.1)  # let the workflow task after it commit its wait
    finally:
        await w1.stop(grace=2.0)

    # a fresh App and worker (another process, after a restart) replays the run
    fresh = tether.App(store=store_url)
    fresh._workflows["pay"] = pay
    fresh._activities["charge"] = charge
    w2 = fresh.worker(lease=5.0, poll_interval=0.05)
    await w2.start()
    try:
        await fresh.signal(run.run_id, "confirm")
        out = await fresh.get_run(run.run_id).result(timeout=10)
        assert w2.stats["replays"] >= 1
    finally:
        await w2.stop(grace=2.0)
        await fresh.close()
    assert out["before"] == out["after"] == charged[0]
    assert "order-17" in out["before"]
    assert out["other"] != out["before"]
    assert charged == [out["before"]]  # the charge was not repeated by the replay


# -- two operators at once -----------------------------------------------------------------------


async def test_two_retries_of_one_failed_run_at_once_retry_it_once(
    app: tether.App, store_url: str, worker: tether.Worker
) -> None:
    """Two processes retry the same failed runs at the same moment: each run is retried
    once (one RunRetried, its failed step scheduled again once); the other call is
    refused with RecoveryError (the run is running again), never a second retry that
    deletes and re-creates the first one's tasks."""
    broken = {"on": True}

    @app.activity(retry=fast(1))
    def flaky(i: int) -> int:
        if broken["on"]:
            raise ConnectionError("down")
        return i

    @app.workflow
    async def one(i: int) -> int:
        return await flaky(i)

    runs = [await app.start(one, i) for i in range(6)]
    for run in runs:
        with pytest.raises(tether.WorkflowFailedError):
            await run.result(timeout=10)
    broken["on"] = False
    others = [tether.App(store=store_url) for _ in range(2)]
    try:
        for i, run in enumerate(runs):
            got = await asyncio.gather(
                *(a.retry(run.run_id) for a in (app, *others)), return_exceptions=True
            )
            refused = [g for g in got if isinstance(g, BaseException)]
            assert len(refused) == 2, got
            for exc in refused:
                assert isinstance(exc, tether.RecoveryError), refused
                assert "only failed or needs_intervention runs can be retried" in str(exc)
            assert await run.result(timeout=10) == i
            types = [e.type for e in await app.history(run.run_id)]
            assert types.count(EventType.RUN_RETRIED) == 1
            assert types.count(EventType.ACTIVITY_COMPLETED) == 1
    finally:
        for other in others:
            assert other._store is not None
            other._store.close_sync()  # type: ignore[attr-defined]


# -- dead letters that cannot be replayed here or read -------------------------------------------


async def test_replay_of_an_unregistered_activity_or_a_cancelled_replay_leaves_the_letter_open(
    store_url: str,
) -> None:
    """A replay from an app that does not register the letter's activity (``tether serve``
    loaded with another module) left the letter "replaying" for good: gone from the open
    list, refused by resolve. So did a replay cancelled while it ran. Both reopen it."""
    app = tether.App(store=store_url)
    release = asyncio.Event()
    hold = {"on": False}

    @app.activity(retry=fast(1))
    async def poison(item: int) -> int:
        if hold["on"]:
            await release.wait()
        raise tether.NonRetryable(f"bad {item}")

    @app.workflow
    async def batch() -> int:
        outs = await tether.map(poison, [7])
        return sum(1 for o in outs if not o.ok)

    w = app.worker(lease=5.0, poll_interval=0.05)
    await w.start()
    try:
        assert await (await app.start(batch)).result(timeout=10) == 1
    finally:
        await w.stop(grace=2.0)
    (letter,) = await app.dead_letters()

    other = tether.App(store=store_url)
    try:
        with pytest.raises(tether.UnknownActivityError, match="poison") as unknown:
            await other.replay_dead_letter(letter.id)
        assert "open" in str(unknown.value)
        (still,) = await other.dead_letters()
        assert still.id == letter.id and still.resolved_at is None
    finally:
        await other.close()
    from test_http_api import Server

    server = Server(store_url, "--workers", "0", "--no-auth")  # loads no module
    try:
        refused = server.http.post(f"/v1/dead-letters/{letter.id}/replay")
        assert refused.status_code == 409, refused.text
        assert "poison" in refused.json()["detail"]
        assert len(server.http.get("/v1/dead-letters").json()) == 1  # still open
    finally:
        server.stop()

    hold["on"] = True
    replay = asyncio.ensure_future(app.replay_dead_letter(letter.id))
    await eventually(lambda: _replaying(app))
    replay.cancel()
    with pytest.raises(asyncio.CancelledError):
        await replay
    (reopened,) = await app.dead_letters()
    assert reopened.id == letter.id and reopened.resolved_at is None
    await app.resolve_dead_letter(letter.id, note="dropped")
    assert await app.dead_letters() == []
    release.set()
    await app.close()


async def _replaying(app: tether.App) -> bool:
    return not await app.dead_letters()


async def test_a_dead_letter_whose_input_is_lost_never_breaks_listings_and_can_be_resolved(
    store_url: str, tmp_path: Any
) -> None:
    """One letter whose input blob is missing made every listing raise (GET
    /v1/dead-letters answered 503) and could not be resolved. It now lists with a null
    input named in ``unavailable``; resolve works; a replay is refused, saying why."""
    from test_http_api import Server

    blobs = tmp_path / "blobs"
    app = tether.App(store=store_url, blobs=str(blobs), offload_above=64)

    @app.activity(retry=fast(1))
    def charge(order: str) -> str:
        raise tether.NonRetryable("provider said no")

    @app.workflow
    async def checkout(order: str) -> str:
        outs = await tether.map(charge, [order])
        return "ok" if outs[0].ok else "failed"

    w = app.worker(lease=5.0, poll_interval=0.05)
    await w.start()
    try:
        lost = await app.start(checkout, "o" * 500)
        assert await lost.result(timeout=10) == "failed"
        for path in blobs.rglob("*"):
            if path.is_file():
                path.unlink()
        kept = await app.start(checkout, "small")
        assert await kept.result(timeout=10) == "failed"
    finally:
        await w.stop(grace=2.0)

    letters = {d.run_id: d for d in await app.dead_letters()}
    assert set(letters) == {lost.run_id, kept.run_id}
    broken = letters[lost.run_id]
    assert broken.input is None and broken.unavailable is not None
    assert "missing" in broken.unavailable["input"]
    assert letters[kept.run_id].unavailable is None and "small" in (
        letters[kept.run_id].input or ""
    )
    with pytest.raises(tether.RecoveryError, match="input"):
        await app.replay_dead_letter(broken.id)
    (still,) = await app.dead_letters(run_id=lost.run_id)
    assert still.resolved_at is None

    server = Server(store_url, "--workers", "0", "--no-auth", env={"TETHER_BLOBS": str(blobs)})
    try:
        page = server.http.get("/v1/dead-letters")
        assert page.status_code == 200, page.text
        one = server.http.get(f"/v1/dead-letters/{broken.id}")
        assert one.status_code == 200, one.text
        assert "missing" in one.json()["unavailable"]["input"]
        assert server.http.get("/dead-letters").status_code == 200
    finally:
        server.stop()

    closed = await app.resolve_dead_letter(broken.id, note="order re-placed by hand", by="ann")
    assert closed.resolution == {
        "state": "resolved",
        "note": "order re-placed by hand",
        "by": "ann",
    }
    assert [d.run_id for d in await app.dead_letters()] == [kept.run_id]
    await app.close()


def _fail_audit_writes(store_url: str) -> None:
    """Make every write to the audit log fail (its disk is full, say)."""
    if store_url.startswith("sqlite:///"):
        import sqlite3

        with sqlite3.connect(store_url.removeprefix("sqlite:///")) as conn:
            conn.execute(
                "CREATE TRIGGER no_audit BEFORE INSERT ON audit_log "
                "BEGIN SELECT RAISE(ABORT, 'audit log down'); END"
            )
        return
    import psycopg

    base, _, schema = store_url.rpartition("schema=")
    with psycopg.connect(base.rstrip("?&"), autocommit=True) as conn:
        conn.execute(
            f"CREATE FUNCTION {schema}.no_audit() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'audit log down'; END $$"
        )
        conn.execute(
            f"CREATE TRIGGER no_audit BEFORE INSERT ON {schema}.audit_log "
            f"FOR EACH ROW EXECUTE FUNCTION {schema}.no_audit()"
        )


async def test_resolving_a_dead_letter_and_its_audit_entry_are_one_write(store_url: str) -> None:
    """Resolve was three writes (claim, resolve, audit): a failure between them left the
    letter "replaying" for good, or resolved with no audit entry. Now both or neither."""
    app = tether.App(store=store_url)

    @app.activity(retry=fast(1))
    def poison(item: int) -> int:
        raise tether.NonRetryable(f"bad {item}")

    @app.workflow
    async def batch() -> int:
        outs = await tether.map(poison, [7])
        return sum(1 for o in outs if not o.ok)

    w = app.worker(lease=5.0, poll_interval=0.05)
    await w.start()
    try:
        assert await (await app.start(batch)).result(timeout=10) == 1
    finally:
        await w.stop(grace=2.0)
    (letter,) = await app.dead_letters()
    await app.close()

    _fail_audit_writes(store_url)
    again = tether.App(store=store_url)
    try:
        with pytest.raises(Exception, match="audit log down"):
            await again.resolve_dead_letter(letter.id, note="dropped", by="ann")
        (still,) = await again.dead_letters()  # still open, and still resolvable
        assert still.id == letter.id and still.resolved_at is None and still.resolution is None
        assert await again.audit_log(target=f"run:{letter.run_id}") == []
    finally:
        await again.close()


# -- a child run's letter, retry's letters, a replay killed mid-way ------------------------------


async def test_replay_refuses_a_failed_child_run_whose_parent_caught_it(
    app: tether.App, worker: tether.Worker, store_url: str
) -> None:
    """A child run failed, its parent caught ``ChildWorkflowError`` and went on (completed):
    replaying the child's run letter retried the child, repeating its effects although the
    parent had handled the failure. It is refused now, like a handled step's letter."""
    sent: list[str] = []

    @app.activity(retry=fast(1))
    def ship(order: str) -> str:
        sent.append(order)
        raise tether.NonRetryable("carrier refused the parcel")

    @app.activity
    def notify(msg: str) -> None:
        pass

    @app.workflow
    async def shipping(order: str) -> str:
        return await ship(order)

    @app.workflow
    async def checkout(order: str) -> str:
        try:
            await shipping(order)
        except tether.ChildWorkflowError:
            await notify("shipping failed; refunded")
            return "refunded"
        return "shipped"

    run = await app.start(checkout, "o-1")
    assert await run.result(timeout=10) == "refunded"
    letters = await app.dead_letters()
    (child_letter,) = [d for d in letters if d.kind == "run"]
    assert child_letter.run_id != run.run_id and child_letter.name == "shipping"
    with pytest.raises(tether.RecoveryError) as refused:
        await app.replay_dead_letter(child_letter.id)
    message = str(refused.value)
    assert run.run_id in message and "caught" in message and "completed" in message
    assert "resolve_dead_letter" in message and "force=True" in message
    assert sent == ["o-1"]  # the child did not run again
    assert (await app.get(child_letter.run_id)).status is RunStatus.FAILED
    (still,) = [d for d in await app.dead_letters() if d.kind == "run"]
    assert still.id == child_letter.id and still.resolved_at is None  # stays open
    # the step letter of the child's failed run is refused the same way (it would retry
    # the child, whose outcome the parent no longer reads)
    (step_letter,) = [d for d in letters if d.kind == "activity"]
    with pytest.raises(tether.RecoveryError, match="caught"):
        await app.replay_dead_letter(step_letter.id)
    assert sent == ["o-1"]
    from test_http_api import Server

    server = Server(store_url, "--workers", "0", "--no-auth")  # the same path over HTTP
    try:
        answer = server.http.post(f"/v1/dead-letters/{child_letter.id}/replay")
        assert answer.status_code == 409, answer.text
        assert "caught" in answer.json()["detail"] and run.run_id in answer.json()["detail"]
    finally:
        server.stop()
    assert sent == ["o-1"]
    await app.resolve_dead_letter(child_letter.id, note="refunded by the parent")
    assert (await app.get(run.run_id)).status is RunStatus.COMPLETED


async def test_retry_marks_retried_only_the_letters_whose_work_it_runs_again(
    app: tether.App, worker: tether.Worker
) -> None:
    """``app.retry`` marked every open letter of the run "retried": a map item's letter
    and a handled step's letter too, although the retry runs neither again. Only the
    run's letter and the failed step's letter are marked now; the others stay open."""
    broken = {"on": True}

    @app.activity(retry=fast(1))
    def poison(item: int) -> int:
        raise tether.NonRetryable(f"bad {item}")

    @app.activity(retry=fast(1))
    def optional(x: int) -> int:
        raise tether.NonRetryable("optional step down")

    @app.activity(retry=fast(1))
    def final(x: int) -> int:
        if broken["on"]:
            raise ConnectionError("down")
        return x

    @app.workflow
    async def pipeline() -> int:
        outs = await tether.map(poison, [7])
        try:
            await optional(1)
        except tether.ActivityError:
            pass
        return await final(len(outs))

    run = await app.start(pipeline)
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    letters = {(d.kind, d.name): d for d in await app.dead_letters(run_id=run.run_id)}
    assert set(letters) == {
        ("activity", "poison"),
        ("activity", "optional"),
        ("activity", "final"),
        ("run", "pipeline"),
    }
    broken["on"] = False
    assert await (await app.retry(run.run_id)).result(timeout=10) == 1
    still = {(d.kind, d.name) for d in await app.dead_letters(run_id=run.run_id)}
    assert still == {("activity", "poison"), ("activity", "optional")}
    closed = {
        (d.kind, d.name): d.resolution
        for d in await app.dead_letters(run_id=run.run_id, include_resolved=True)
        if d.resolved_at is not None
    }
    assert closed == {
        ("activity", "final"): {"state": "retried"},
        ("run", "pipeline"): {"state": "retried"},
    }
    # the map item's letter still replays on its own (the run completed)
    with pytest.raises(tether.NonRetryable):
        await app.replay_dead_letter(letters[("activity", "poison")].id)


async def test_replaying_a_handled_steps_letter_in_a_failed_run_is_refused(
    app: tether.App, worker: tether.Worker
) -> None:
    """A step letter of a failed run retried the run although the retry does not run that
    step again (its code had caught it; the run failed later for another step), and the
    letter was marked "retried". Now only the failed step's letter retries the run."""
    ran: collections.Counter[str] = collections.Counter()

    @app.activity(retry=fast(1))
    def optional(x: int) -> int:
        ran["optional"] += 1
        raise tether.NonRetryable("optional step down")

    @app.activity(retry=fast(1))
    def final(x: int) -> int:
        ran["final"] += 1
        raise ConnectionError("down")

    @app.workflow
    async def pipeline() -> int:
        try:
            await optional(1)
        except tether.ActivityError:
            pass
        return await final(1)

    run = await app.start(pipeline)
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    letters = {d.name: d for d in await app.dead_letters(run_id=run.run_id)}
    with pytest.raises(tether.RecoveryError, match="caught the failure"):
        await app.replay_dead_letter(letters["optional"].id)
    assert (await app.get(run.run_id)).status is RunStatus.FAILED  # not retried
    assert ran == {"optional": 1, "final": 1}
    assert len(await app.dead_letters(run_id=run.run_id)) == 3


_REPLAYER = """
import asyncio, os, pathlib, sys, time
import tether
from tether.store.ops import recovery

url, mode, marker = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
app = tether.App(store=url)


@app.activity
def poison(item: int) -> int:
    marker.write_text("running")  # the claim is committed: die here
    time.sleep(3600)
    return item


@app.activity
def flaky(i: int) -> int:
    return i


if mode == "run":  # die inside the retry's transaction, before its commit
    def die(*args, **kwargs):
        marker.write_text("retrying")
        os._exit(9)

    recovery._ensure_workflow_task = die
asyncio.run(app.replay_dead_letter(int(sys.argv[4])))
"""


def _replay_in_a_process_killed_mid_way(
    tmp_path: Any, store_url: str, mode: str, letter_id: int
) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "replayer.py"
    script.write_text(_REPLAYER)
    marker = tmp_path / f"marker-{mode}"
    env = {**os.environ, "PYTHONPATH": str(Path(tether.__file__).parent.parent)}
    proc = subprocess.Popen(
        [sys.executable, str(script), store_url, mode, str(marker), str(letter_id)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert proc.poll() is None or mode == "run", proc.stderr and proc.stderr.read()
            assert time.monotonic() < deadline, "the replayer never got there"
            time.sleep(0.05)
        if mode == "step":
            os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


async def test_a_replay_killed_after_its_claim_leaves_no_letter_replaying_for_good(
    store_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed between a replay's claim (the letter "replaying") and its outcome
    left the letter "replaying" for good: gone from the open list, refused by replay and
    resolve. A failed run's letter is now retried in one transaction with the letter's
    mark (killed in it, nothing is written); a map item's claim is renewed while its step
    runs, so one left by a dead process goes stale and the next replay takes it over."""
    import time

    from tether.store.ops import recovery

    app = tether.App(store=store_url)
    broken = {"on": True}

    @app.activity(retry=fast(1))
    def poison(item: int) -> int:
        if broken["on"]:
            raise tether.NonRetryable(f"bad {item}")
        return item * 10

    @app.activity(retry=fast(1))
    def flaky(i: int) -> int:
        if broken["on"]:
            raise ConnectionError("down")
        return i

    @app.workflow
    async def batch() -> int:
        outs = await tether.map(poison, [7])
        return sum(1 for o in outs if not o.ok)

    @app.workflow
    async def one(i: int) -> int:
        return await flaky(i)

    w = app.worker(lease=5.0, poll_interval=0.05)
    await w.start()
    try:
        assert await (await app.start(batch, run_id="b")).result(timeout=10) == 1
        with pytest.raises(tether.WorkflowFailedError):
            await (await app.start(one, 3, run_id="r")).result(timeout=10)
    finally:
        await w.stop(grace=2.0)
    (item,) = await app.dead_letters(run_id="b")
    run_letter = next(d for d in await app.dead_letters(run_id="r") if d.kind == "run")

    # the run's letter: killed inside the retry's transaction, nothing was written
    _replay_in_a_process_killed_mid_way(tmp_path, store_url, "run", run_letter.id)
    assert (tmp_path / "marker-run").read_text() == "retrying"
    assert {d.id for d in await app.dead_letters(run_id="r")} >= {run_letter.id}
    (again,) = [d for d in await app.dead_letters(run_id="r") if d.id == run_letter.id]
    assert again.resolved_at is None and again.resolution is None
    assert (await app.get("r")).status is RunStatus.FAILED
    assert EventType.RUN_RETRIED not in [e.type for e in await app.history("r")]

    # the map item's letter: killed while its step runs, after the claim was committed
    _replay_in_a_process_killed_mid_way(tmp_path, store_url, "step", item.id)
    assert await app.dead_letters(run_id="b") == []  # claimed: "replaying"
    (claimed,) = await app.dead_letters(run_id="b", include_resolved=True)
    assert claimed.resolution is not None and claimed.resolution["state"] == "replaying"
    with pytest.raises(tether.RecoveryError, match="already replayed"):
        await app.replay_dead_letter(item.id)  # a live claim holds
    assert (await app.store.open_counts())["dead_letters"] == 2  # the run's, its step's
    monkeypatch.setattr(recovery, "CLAIM_TTL", 0.5)
    await asyncio.sleep(1.0)  # ... until it goes stale: its process renews it no more
    (reopened,) = await app.dead_letters(run_id="b")
    assert reopened.id == item.id
    assert (await app.store.open_counts())["dead_letters"] == 3  # counted open again
    broken["on"] = False
    assert await app.replay_dead_letter(item.id) == 70
    (done,) = await app.dead_letters(run_id="b", include_resolved=True)
    assert done.resolution == {"state": "replayed", "result": 70}
    assert await app.replay_dead_letter(run_letter.id) is None  # retried now
    assert EventType.RUN_RETRIED in [e.type for e in await app.history("r")]

    # a letter left "replaying" by an earlier version (its claim never renewed) is taken
    # by a replay or resolve of its id once stale
    _set_letter(store_url, item.id, '{"state": "replaying"}', time.time() - 3600)
    assert [d.id for d in await app.dead_letters(run_id="b")] == [item.id]
    closed = await app.resolve_dead_letter(item.id, note="left replaying by v1: dropped")
    assert closed.resolution == {
        "state": "resolved",
        "note": "left replaying by v1: dropped",
        "by": None,
    }
    await app.close()


def _set_letter(store_url: str, letter_id: int, resolution: str, resolved_at: float) -> None:
    """Write a letter's resolution as another version would have."""
    sql = "UPDATE {}dead_letters SET resolution = %s, resolved_at = %s WHERE id = %s"
    if store_url.startswith("sqlite:///"):
        import sqlite3

        with sqlite3.connect(store_url.removeprefix("sqlite:///")) as conn:
            conn.execute(sql.format("").replace("%s", "?"), (resolution, resolved_at, letter_id))
        return
    import psycopg

    base, _, schema = store_url.rpartition("schema=")
    with psycopg.connect(base.rstrip("?&"), autocommit=True) as conn:
        conn.execute(sql.format(f"{schema}."), (resolution, resolved_at, letter_id))


async def test_two_replays_of_a_run_letter_at_once_retry_the_run_once(
    app: tether.App, store_url: str, worker: tether.Worker
) -> None:
    """A run's letter is checked, the run retried and the letter marked in one
    transaction: of two replays at once, one retries the run and the other is told the
    letter was already replayed."""
    broken = {"on": True}

    @app.activity(retry=fast(1))
    def flaky(i: int) -> int:
        if broken["on"]:
            raise ConnectionError("down")
        return i

    @app.workflow
    async def one(i: int) -> int:
        return await flaky(i)

    run = await app.start(one, 5)
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    (letter,) = [d for d in await app.dead_letters(run_id=run.run_id) if d.kind == "run"]
    broken["on"] = False
    other = tether.App(store=store_url)
    try:
        got = await asyncio.gather(
            app.replay_dead_letter(letter.id),
            other.replay_dead_letter(letter.id),
            return_exceptions=True,
        )
    finally:
        await other.close()
    assert sorted(map(str, got)).count("None") == 1, got
    (refused,) = [g for g in got if isinstance(g, BaseException)]
    assert isinstance(refused, tether.RecoveryError), refused
    assert await run.result(timeout=10) == 5
    types = [e.type for e in await app.history(run.run_id)]
    assert types.count(EventType.RUN_RETRIED) == 1
    assert await app.dead_letters(run_id=run.run_id) == []


async def test_a_step_the_code_caught_before_failing_by_itself_is_not_run_again(
    app: tether.App, worker: tether.Worker
) -> None:
    """The code caught a step's failure (a charge, a child), refunded, then failed by
    itself: the step's letter (and the child's) retried the run from that step, charging
    (or running the child) again after the refund, and ``app.retry`` did the same. The
    letters are refused now, as a caught failure's. ``app.retry``, an operator's
    explicit retry of the whole run, still runs its last failed step again (the
    refund, called again with the same arguments, is reused, not repeated)."""
    ran: collections.Counter[str] = collections.Counter()
    give_up = {"raise": True}

    @app.activity(retry=fast(1))
    def charge(x: int) -> str:
        ran["charge"] += 1
        raise tether.NonRetryable("in doubt")

    @app.activity(retry=fast(1))
    def refund(x: int) -> str:
        ran["refund"] += 1
        return "refunded"

    @app.workflow
    async def paying(x: int) -> str:
        return await charge(x)

    @app.workflow
    async def order(x: int, child: bool) -> str:
        try:
            c = await (paying(x) if child else charge(x))
        except (tether.ActivityError, tether.ChildWorkflowError):
            await refund(x)
            if give_up["raise"]:
                raise ValueError("order abandoned after refund") from None
            return "abandoned"
        return c

    for run_id, child in (("o1", False), ("o2", True)):
        run = await app.start(order, 1, child, run_id=run_id)
        with pytest.raises(tether.WorkflowFailedError):
            await run.result(timeout=10)
    letters = await app.dead_letters()
    step_letter = next(d for d in letters if d.run_id == "o1" and d.kind == "activity")
    child_letters = [d for d in letters if d.run_id == "o2/1"]
    assert {d.kind for d in child_letters} == {"activity", "run"}
    for letter in (step_letter, *child_letters):
        with pytest.raises(tether.RecoveryError, match="caught"):
            await app.replay_dead_letter(letter.id)
    assert ran == {"charge": 2, "refund": 2}
    assert (await app.get("o1")).status is RunStatus.FAILED
    assert (await app.get("o2")).status is RunStatus.FAILED
    assert (await app.get("o2/1")).status is RunStatus.FAILED
    # an operator's retry of the run runs the failed step again (fixed meanwhile)
    give_up["raise"] = False
    for run_id in ("o1", "o2"):
        assert await (await app.retry(run_id)).result(timeout=10) == "abandoned"
    assert ran == {"charge": 4, "refund": 2}  # charged again; the refund reused


async def test_a_failure_re_raised_after_a_notice_is_still_the_runs(
    app: tether.App, worker: tether.Worker
) -> None:
    """The code caught a child's failure, sent a notice, then raised it again: the parent
    failed for the child, so the child's letter still retries the child (and
    ``app.retry`` of the parent then takes its new outcome)."""
    broken = {"on": True}
    notices: list[str] = []

    @app.activity(retry=fast(1))
    def charge(x: int) -> str:
        if broken["on"]:
            raise tether.NonRetryable("down")
        return "ch_1"

    @app.activity
    def notify(msg: str) -> None:
        notices.append(msg)

    @app.workflow
    async def paying(x: int) -> str:
        return await charge(x)

    @app.workflow
    async def order(x: int) -> str:
        try:
            return await paying(x)
        except tether.ChildWorkflowError:
            await notify("payment failed")
            raise

    run = await app.start(order, 1, run_id="p")
    with pytest.raises(tether.WorkflowFailedError):
        await run.result(timeout=10)
    (child_letter,) = [d for d in await app.dead_letters(run_id="p/1") if d.kind == "run"]
    broken["on"] = False
    assert await app.replay_dead_letter(child_letter.id) is None  # the child is retried
    assert await app.get_run("p/1").result(timeout=10) == "ch_1"
    assert await (await app.retry("p")).result(timeout=10) == "ch_1"
    assert notices == ["payment failed"]
