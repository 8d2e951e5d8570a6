"""Running a batch of activity calls on the worker (``tether.Batch``).

The store leases up to ``max_items`` ready tasks with the same batch key together;
``run_batch`` runs the activity's function once for all of them and records each
item's outcome against its own fence. The worker passes itself as the ``BatchHost``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, Protocol

from ._activity_context import ActivityContext, set_context
from ._attempts import _Plan, _StepTimeout, attempt_span
from ._batch import BatchActivity, split_results
from ._breaker import CircuitOpenError
from ._definitions import Activity
from ._errors import NonRetryable, PayloadError, StoreError, TetherError
from ._history import Task
from ._host import WorkerApp
from ._policy import Retry
from ._serde import encode
from ._telemetry import count, observe
from ._tracing import mark_ok

log = logging.getLogger("tether.worker")


class BatchHost(Protocol):
    """What a batch run uses of the worker that runs it."""

    app: WorkerApp
    lease: float
    stats: collections.Counter[str]
    _loop: asyncio.AbstractEventLoop | None
    _pool: concurrent.futures.ThreadPoolExecutor | None
    _stopping: bool
    _in_thread: set[asyncio.Task[Any]]

    async def _run_activity(self, task: Task, inline: bool = False) -> None: ...

    async def _record_result(
        self, task: Task, result: str, value: Any = ..., inline: bool = False
    ) -> None: ...

    async def _record_failure(
        self,
        task: Task,
        exc: BaseException,
        plan: _Plan,
        ctx: ActivityContext | None,
        began: float | None = None,
    ) -> None: ...

    async def _breaker_record(self, cfg: dict[str, Any], ok: bool) -> None: ...

    async def _activity_tenant(self, tasks: Sequence[Task]) -> str | None: ...

    async def _tenant_blip(self, tasks: Sequence[Task], exc: StoreError) -> None: ...


# -- the activity context of a batch --------------------------------------------


class BatchActivityContext(ActivityContext):
    """The context of a batched call: ``idempotency_keys`` has one key per item.

    The scalar fields (``run_id``, ``step``, ``attempt``, ``idempotency_key``)
    describe the first item. ``heartbeat()`` renews the lease of every item;
    ``is_cancelled`` turns true when every item was cancelled or lost.
    """

    _tasks: tuple[Task, ...] = ()

    def _beat(self, details: str | None) -> Coroutine[Any, Any, bool]:
        return self._beat_all(details)

    async def _beat_all(self, details: str | None) -> bool:
        assert self._store is not None
        store, lease = self._store, self._lease
        beats = await asyncio.gather(
            *(store.heartbeat(t, lease, details) for t in self._tasks), return_exceptions=True
        )
        return all(b is not False for b in beats)  # True: nothing of this batch is live


# -- running a batch (the worker side) -------------------------------------------


async def run_batch(w: BatchHost, tasks: list[Task]) -> None:
    """Run the activity once for ``tasks`` (leased together) and record each outcome.

    Items whose step is already out of time or attempts fail before the call;
    the rest go to the function as one list. Its exception fails every item
    (each by its own retry policy and attempt count); an Exception in the
    result list fails only that item. The outcomes are written concurrently, so
    the store's group commit puts them in one transaction, each with its own fence.
    """
    store = w.app.store
    assert w._loop is not None
    try:
        act: Activity[Any, Any] | None = w.app.get_activity(tasks[0].name or "")
    except TetherError:
        act = None
    if not isinstance(act, BatchActivity) or act.fn is not act.item_fn:
        # unknown here, no longer batched, or wrapped by a testing tool: one by one
        await asyncio.gather(*(w._run_activity(t) for t in tasks))
        return
    now = store.clock()
    outcomes: list[Awaitable[None]] = []
    live: list[tuple[Task, _Plan, Any]] = []
    for task in tasks:
        opts = task.options or {}
        plan = _Plan(Retry.from_json(opts.get("retry") or {}, act.opts.retry.non_retryable), opts)
        early: BaseException | None = None
        if plan.deadline is not None and now >= plan.deadline:
            early = _StepTimeout(plan.deadline_reason)
        elif task.attempt > plan.retry.attempts:
            early = TimeoutError(
                f"attempt {task.attempt} exceeds the {plan.retry.attempts} allowed: earlier "
                "attempts were lost (a worker was killed or lost its lease, or a heartbeat "
                "timed out)"
            )
        else:
            scheduled_at = opts.get("scheduled_at")
            if task.attempt == 1 and scheduled_at is not None:
                observe("tether_queue_wait", (task.queue, "activity"), max(0.0, now - scheduled_at))
            try:
                args, kwargs = act.sig.decode_args(task.payload or "{}")
                live.append((task, plan, args[0] if args else next(iter(kwargs.values()))))
                continue
            except PayloadError as exc:
                early = NonRetryable(str(exc))
        outcomes.append(_attempt(task, w._record_failure(task, early, plan, None)))
    if outcomes:
        await _settle(w, outcomes, tasks)  # recorded now: the batch may run a long time
        outcomes = []
    if not live:
        return
    try:
        # one tenant's runs: its put_blob documents are its (of several: the shared key).
        # Read before the breaker is asked: a half-open breaker's one trial is not spent
        # on a batch given back unstarted
        tenant = await w._activity_tenant([t for t, _, _ in live])
    except StoreError as exc:
        await w._tenant_blip([t for t, _, _ in live], exc)
        return
    breaker = (live[0][0].options or {}).get("breaker")
    if breaker:
        wait = await store.breaker_admit(breaker)
        if wait is not None:  # open: fail fast, never touching the dependency
            w.stats["breaker_rejections"] += len(live)
            count("tether_breaker_rejections", (act.name,), len(live))
            err = CircuitOpenError(breaker["name"], wait)
            await _settle(
                w, [_attempt(t, w._record_failure(t, err, p, None)) for t, p, _ in live], tasks
            )
            return
    first = live[0][0]
    ctx = BatchActivityContext(
        run_id=first.run_id,
        step=first.step or 0,
        name=act.name,
        attempt=first.attempt,
        idempotency_key=f"{first.run_id}:{first.step}",
        idempotency_keys=tuple(f"{t.run_id}:{t.step}" for t, _, _ in live),
        task=first,
        _store=store,
        _loop=w._loop,
        _lease=w.lease,
        _tenant=tenant,
    )
    ctx._tasks = tuple(t for t, _, _ in live)
    limits = [t for t in (p.attempt_timeout(now) for _, p, _ in live) if t]
    timeout = min(limits) if limits else None
    items = [item for _, _, item in live]
    error: BaseException | None = None
    results: list[Any] = []
    began, began_ns = time.perf_counter(), time.time_ns()  # every item's attempt begins
    try:
        cv = contextvars.copy_context()
        cv.run(set_context, ctx)
        fut: asyncio.Future[Any]
        if act.is_async:
            fut = asyncio.ensure_future(w._loop.create_task(act.batch_fn(items), context=cv))
        else:
            fut = w._loop.run_in_executor(w._pool, functools.partial(cv.run, act.batch_fn, items))
        me = asyncio.current_task()
        if me is not None and not act.is_async:
            w._in_thread.add(me)  # a graceful stop waits for the thread (Worker.stop)
        try:
            value = await asyncio.wait_for(fut, timeout) if timeout else await fut
        finally:
            if me is not None:
                w._in_thread.discard(me)
        ctx._returned = True
        results = split_results(act.name, value, len(items))
    except asyncio.CancelledError:
        if w._stopping:
            raise
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            # nothing cancels a batch for one run's sake: our asyncio task was cancelled
            # from outside (a loop torn down without stop()), so the items go back unfailed
            try:
                await store.release([t for t, _, _ in live], unstarted=True)
            except Exception as exc:  # their leases expire instead
                log.warning("could not release an interrupted batch: %s", exc)
            raise
        error = asyncio.CancelledError("activity cancelled")
    except TimeoutError as exc:
        error = TimeoutError(
            str(exc)
            or f"batch of {len(items)} item(s) of activity {act.name!r} timed out after {timeout}s"
        )
    except Exception as exc:
        error = exc
    ran = time.perf_counter() - began
    w.stats["batches"] += 1
    w.stats["batch_items"] += len(live)
    for i, (task, plan, _) in enumerate(live):
        outcome: BaseException | str
        if error is not None:
            outcome = error
        elif isinstance(results[i], BaseException):
            outcome = results[i]
        else:
            try:
                outcome = encode(results[i], f"result of activity {act.name!r}")
            except PayloadError as exc:
                outcome = NonRetryable(str(exc))
        if isinstance(outcome, str):
            w.stats["activities"] += 1
            observe("tether_activity_duration", (act.name, "ok"), ran)
            work = _complete(w, task, outcome, breaker)
        else:
            work = w._record_failure(task, outcome, plan, None, began)
        outcomes.append(_attempt(task, work, began_ns))
    await _settle(w, outcomes, tasks)


async def _attempt(task: Task, work: Awaitable[None], began: int | None = None) -> None:
    """Record one item's outcome as its own attempt: in a span of its run's trace (when
    the run is traced) from ``began`` (epoch ns; None: now) to its recording."""
    with attempt_span(task, began):
        await work


async def _complete(w: BatchHost, task: Task, result: str, breaker: dict[str, Any] | None) -> None:
    """Record one item's result (the one-commit path when the worker can take it)."""
    mark_ok()
    if breaker:
        await w._breaker_record(breaker, True)
    await w._record_result(task, result)


async def _settle(w: BatchHost, outcomes: list[Awaitable[None]], tasks: list[Task]) -> None:
    """Write the outcomes together; a store failure leaves that item to its lease."""
    done = await asyncio.gather(*outcomes, return_exceptions=True)
    for got in done:
        if isinstance(got, StoreError):
            log.warning("could not record an item of a batch of %r: %s", tasks[0].name, got)
        elif isinstance(got, BaseException):
            raise got
