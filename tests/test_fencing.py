"""Lease fencing: a worker that lost its lease cannot commit anything."""

from __future__ import annotations

import pytest

import tether
from tether.store.base import WorkflowTaskResult


async def test_store_stale_fence_rejects_activity_completion(app: tether.App) -> None:
    @app.activity
    def step(x: int) -> int:
        return x

    @app.workflow
    async def wf() -> int:
        return await step(1)

    store = app.store
    await app.start(wf, run_id="r1")
    # worker A runs the first workflow task, scheduling the activity
    (wt,) = await store.claim(worker_id="A", queues=["default"], limit=10, lease=30)
    from tether.workflow._instance import WorkflowInstance

    inst = WorkflowInstance("r1", app.get_workflow("wf"))
    result = inst.advance(await store.read_history("r1"), store.clock())
    await store.complete_workflow_task(wt, result)
    # A claims the activity with a lease that has already run out ...
    (stale,) = await store.claim(worker_id="A", queues=["default"], limit=10, lease=-1)
    # ... so B claims it again, bumping the fence
    (fresh,) = await store.claim(worker_id="B", queues=["default"], limit=10, lease=30)
    assert fresh.task_id == stale.task_id and fresh.fence == stale.fence + 1
    before = await store.read_history("r1")

    with pytest.raises(tether.LeaseLostError):
        await store.complete_activity(stale, "1")
    with pytest.raises(tether.LeaseLostError):
        await store.fail_activity(stale, {"type": "X", "message": "late"}, None)
    with pytest.raises(tether.LeaseLostError):
        await store.heartbeat(stale, 30, None)
    assert await store.renew([stale], 30) == {}
    assert await store.read_history("r1") == before  # nothing was written

    await store.complete_activity(fresh, "1")
    history = await store.read_history("r1")
    assert [e.type for e in history][-1] is tether.EventType.ACTIVITY_COMPLETED


async def test_store_stale_workflow_task_cannot_commit(app: tether.App) -> None:
    @app.workflow
    async def wf() -> int:
        return 1

    store = app.store
    await app.start(wf, run_id="r2")
    (stale,) = await store.claim(worker_id="A", queues=["default"], limit=1, lease=-1)
    (fresh,) = await store.claim(worker_id="B", queues=["default"], limit=1, lease=30)
    empty = WorkflowTaskResult(commands=[], through=1, time=store.clock())
    with pytest.raises(tether.LeaseLostError):
        await store.complete_workflow_task(stale, empty)
    with pytest.raises(tether.LeaseLostError):
        await store.fail_workflow_task(stale, "boom", store.clock())
    assert len(await store.read_history("r2")) == 1
    await store.complete_workflow_task(fresh, empty)
    assert len(await store.read_history("r2")) == 2


async def test_store_takes_back_only_leases_no_one_renewed(app: tether.App) -> None:
    """``reclaim`` (a worker restarted under a stable id) compares the id's leases with
    what ``leases`` read a few seconds earlier: one renewed since shows that its holder
    lives (holding the id proves only that the previous hold ended), so none is taken
    back; unrenewed ones are claimable at once; leases that only heartbeats extend tell
    nothing, and are left to expire."""

    @app.workflow
    async def wf() -> int:
        return 1

    store = app.store
    for rid in ("a", "b"):
        await app.start(wf, run_id=rid)
    held = await store.claim(worker_id="X", queues=["default"], limit=10, lease=600)
    seen = await store.leases("X")
    assert sorted(seen) == sorted(t.task_id for t in held) and len(held) == 2
    assert not any(beats for _, _, beats in seen.values())
    await store.renew(held[:1], 900)  # the holder lives: it renewed one
    assert await store.reclaim("X", seen) is None
    assert await store.claim(worker_id="Y", queues=["default"], limit=10, lease=30) == []

    seen = await store.leases("X")  # the holder died since
    beats_only = {task_id: (fence, at, True) for task_id, (fence, at, _) in seen.items()}
    assert await store.reclaim("X", beats_only) is None
    assert await store.reclaim("X", seen) == 2
    taken = await store.claim(worker_id="Y", queues=["default"], limit=10, lease=30)
    assert sorted((t.task_id, t.fence) for t in taken) == sorted(
        (t.task_id, t.fence + 1) for t in held
    )
    assert await store.leases("X") == {}


async def test_reclaim_never_takes_back_a_heartbeat_only_lease(app: tether.App) -> None:
    """A live predecessor holding a heartbeat-extended step and another task that it
    finished meanwhile: nothing it holds was renewed (renewals skip heartbeat leases,
    its heartbeats come on their own schedule), but the heartbeat step is not taken
    back: such leases tell nothing, so they are left to their heartbeat timeouts."""
    from tether.workflow._instance import WorkflowInstance

    @app.activity(heartbeat_timeout=300)
    def slow(x: int) -> int:
        return x

    @app.workflow
    async def wf() -> int:
        return await slow(1)

    @app.workflow
    async def other() -> int:
        return 1

    store = app.store
    await app.start(wf, run_id="r1")
    (wt,) = await store.claim(worker_id="X", queues=["default"], limit=1, lease=30)
    inst = WorkflowInstance("r1", app.get_workflow("wf"))
    await store.complete_workflow_task(
        wt, inst.advance(await store.read_history("r1"), store.clock())
    )
    await app.start(other, run_id="r2")
    held = await store.claim(worker_id="X", queues=["default"], limit=10, lease=30)
    assert sorted(t.kind for t in held) == ["activity", "workflow"]
    seen = await store.leases("X")  # a second process starts under the id
    (n,) = [t for t in held if t.kind == "workflow"]
    await store.complete_workflow_task(
        n, WorkflowTaskResult(commands=[], through=1, time=store.clock())
    )
    assert await store.reclaim("X", seen) == 0  # the unrenewed one had finished
    assert await store.claim(worker_id="Y", queues=["default"], limit=10, lease=30) == []

    # an unrenewed ordinary lease beside it is still taken back; the heartbeat one is not
    await app.start(other, run_id="r3")
    (n3,) = await store.claim(worker_id="X", queues=["default"], limit=10, lease=30)
    seen = await store.leases("X")
    assert len(seen) == 2
    assert await store.reclaim("X", seen) == 1
    taken = await store.claim(worker_id="Y", queues=["default"], limit=10, lease=30)
    assert [(t.task_id, t.fence) for t in taken] == [(n3.task_id, n3.fence + 1)]


async def test_give_back_takes_only_what_the_lost_commit_could_have_leased(
    app: tether.App,
) -> None:
    """``give_back`` after a lost commit makes claimable only the run's tasks leased to
    the worker by a commit at or after ``since`` and never claimed since (fence 1): a
    task of the run that the id holds from a claim (another process sharing the id, or
    one claimed and not yet started) is left alone, as are those in ``keep``."""
    import asyncio

    from tether.workflow._instance import WorkflowInstance

    @app.activity
    def a(x: int) -> int:
        return x

    @app.workflow
    async def wf() -> list[int]:
        return list(await asyncio.gather(a(1), a(2)))

    store = app.store
    await app.start(wf, run_id="r1")
    (wt,) = await store.claim(worker_id="X", queues=["default"], limit=1, lease=30)
    inst = WorkflowInstance("r1", app.get_workflow("wf"))
    await store.complete_workflow_task(
        wt, inst.advance(await store.read_history("r1"), store.clock())
    )
    (t_old,) = await store.claim(worker_id="X", queues=["default"], limit=1, lease=30)
    (t_new,) = await store.claim(worker_id="X", queues=["default"], limit=1, lease=30)
    since = store.clock()
    assert await store.give_back("X", "r1", [t_new.task_id], since=since) == 0
    assert await store.claim(worker_id="Y", queues=["default"], limit=10, lease=30) == []

    # a commit after ``since`` leases the run's next tasks to X: those are given back
    await store.complete_activity(t_old, "1")
    await store.complete_activity(t_new, "2")
    (wt2,) = await store.claim(worker_id="X", queues=["default"], limit=1, lease=30)
    since = store.clock()
    result = inst.advance(await store.read_history("r1"), store.clock())
    _, leased = await store.complete_workflow_task(
        wt2, result, lease_to="X", lease_queues=["default"], lease=30, lease_limit=5
    )
    assert leased == []  # the run ended: nothing leased; a fresh run's task instead
    await app.start(wf, run_id="r2")
    since = store.clock()
    (w2,) = await store.claim(worker_id="Z", queues=["default"], limit=1, lease=30)
    inst2 = WorkflowInstance("r2", app.get_workflow("wf"))
    _, leased = await store.complete_workflow_task(
        w2,
        inst2.advance(await store.read_history("r2"), store.clock()),
        lease_to="X",
        lease_queues=["default"],
        lease=30,
        lease_limit=5,
    )
    assert len(leased) == 2 and all(t.fence == 1 for t in leased)
    keep = [leased[0].task_id]
    assert await store.give_back("X", "r2", keep, since=since) == 1
    taken = await store.claim(worker_id="Y", queues=["default"], limit=10, lease=30)
    assert [t.task_id for t in taken] == [leased[1].task_id]
    # ... but not when they were leased before the lost offer began
    assert await store.give_back("X", "r2", (), since=store.clock() + 1) == 0
