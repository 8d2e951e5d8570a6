"""The worker: claims tasks from the store under a lease and runs them.

One asyncio loop per worker. Workflow tasks run on that loop (workflow code is
deterministic and never blocks); async activities run on it too, sync ones in a
thread pool. A lease renewer extends the leases of everything in flight; if the
store says a lease is gone (the run ended or was cancelled, or this worker was
paused past its lease and another took over), the work is cancelled and its
result would be refused by the fence anyway.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import json
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from ._activity_context import ActivityContext, reset_context, set_context
from ._attempts import _Plan, _StepTimeout, attempt_span
from ._batch_run import run_batch
from ._breaker import CircuitOpenError
from ._classify import classify, http_status, ratelimit_pause
from ._codec import MARKS, decode_text
from ._errors import (
    ConfigurationError,
    LeaseLostError,
    NonDeterminismError,
    NonRetryable,
    PayloadError,
    StoreError,
    TetherError,
)
from ._history import REPLAY_CHANGING, Event, EventType, Task
from ._host import WorkerApp
from ._periodic import Periodic
from ._policy import Retry
from ._queues import check_name
from ._redact import engine_note, is_engine_made, shown_error, task_error_text
from ._serde import JsonDict, encode
from ._switches import HOLD as SWITCH_HOLD
from ._switches import REFRESH as SWITCH_REFRESH
from ._switches import Switches, held_note
from ._telemetry import count, observe
from ._tracing import (
    mark_failed,
    mark_lease_lost,
    mark_ok,
    run_span,
    wait_spans,
    workflow_task_span,
)
from .blobs import BlobError
from .encryption import KeyringMismatchError, KeyUnavailableError
from .store.base import TASK_REJECTED
from .workflow._instance import WorkflowInstance

if TYPE_CHECKING:
    from ._definitions import Workflow
    from .store.base import Finished, StartResult, WorkflowTaskResult

log = logging.getLogger("tether.worker")

#: seconds an activity whose arguments this worker cannot read waits before its first
#: retry (its later waits double, up to UNREADABLE_MAX_HOLD)
KEY_HOLD = 30.0
#: the longest wait (seconds) before a task whose payload cannot be read (a key or blob
#: missing: restoring it heals the run) is tried again: its waits double from the first
#: (KEY_HOLD for a step, the worker's workflow_retry_delay for a workflow task) up to
#: this, and a destroyed key's (erased on purpose: no retry brings it back) is this at once
UNREADABLE_MAX_HOLD = 300.0
#: how many such tasks a worker counts the tries of (the oldest forgotten first)
UNREADABLE_REMEMBERED = 10_000
#: seconds a step of an activity this worker does not register waits before any worker
#: may claim it again (a deploy that forgot an import, or a rolling deploy's new code)
UNKNOWN_HOLD = 10.0
#: seconds a worker whose keyring does not match the store's stops claiming after a
#: task it could not record (KeyringMismatchError): its tasks go at once to other workers
KEYRING_PAUSE = 30.0
#: seconds between checks that a stable worker id is still held by this process
ID_CHECK_EVERY = 2.0
#: seconds a worker with a stable id waits at start before it takes back the leases
#: of its id's previous holder, and takes them back only if no one renewed them
#: meanwhile: a holder that lives (its hold on the id ended with a database session)
#: renews its leases at its next check of the id (ID_CHECK_EVERY), when it finds the
#: id taken. Three of its checks: a check that must reconnect can take a while
RECLAIM_WAIT = 6.0
#: a worker logs an activity it does not register at most once per this many seconds
UNKNOWN_LOG_EVERY = 60.0
#: how often a worker folds the run counters' appended changes (``store/_counters.py``)
FOLD_EVERY = 10.0
#: seconds a workflow task whose history a store blip kept from being read waits before
#: it may be claimed again: soon, but a store that keeps failing is not asked in a loop
STORE_BLIP_DELAY = 1.0
#: the longest wait (seconds) of a step whose run tenant could not be read before its
#: attempt: its waits double from STORE_BLIP_DELAY with each failed read up to this
TENANT_BLIP_MAX_HOLD = 60.0
#: seconds between the first offers of an activity's outcome (or a workflow task's
#: commit) that the store failed to record (a dropped connection): the fence makes a
#: repeated completion safe
COMPLETE_RETRY_PAUSES = (0.2, 0.5, 1.0)
#: seconds between the later offers of an activity's outcome, made while this worker's
#: lease on the step lasts (a store outage longer than the pauses above)
COMPLETE_RETRY_MAX_PAUSE = 2.0
#: an outcome is offered until this share of the lease (at least LEASE_MARGIN_MIN
#: seconds, at most half the lease) before this worker's lease on the step would end,
#: counted from its last claim or renewal: then the step is given back
LEASE_MARGIN = 0.2
LEASE_MARGIN_MIN = 1.0
#: the most tasks one worker may hold at once (a bound its claims' LIMIT can carry)
MAX_CONCURRENCY = 100_000


class _StoreBlip(Exception):
    """The store failed to read a run's history (not the workflow code's failure)."""

    def __init__(self, error: StoreError) -> None:
        super().__init__(str(error))
        self.error = error


def _sealed(task: Task) -> str | None:
    """The task's payload or heartbeat if it is still sealed (the claim could not open it)."""
    for text in (task.payload, task.heartbeat):
        if text and text.startswith(MARKS):
            return text
    return None


#: commands that end a run, with the status they end it in
_RUN_ENDINGS = {
    EventType.WORKFLOW_COMPLETED: "completed",
    EventType.WORKFLOW_FAILED: "failed",
    EventType.WORKFLOW_TIMED_OUT: "timed_out",
    EventType.CONTINUED_AS_NEW: "continued_as_new",
    EventType.WORKFLOW_NEEDS_INTERVENTION: "needs_intervention",
}
#: no value given (a default that no real value is)
_UNSET: Any = object()


def _beats_only(task: Task) -> float | None:
    """The heartbeat timeout of a step that has one (only heartbeats extend its lease)."""
    if task.kind != "activity" or not task.options:
        return None
    hb = task.options.get("heartbeat_timeout")
    return float(hb) if hb else None


class Worker:
    """Runs workflow tasks, activities and timers for the given queues.

    Use ``async with app.worker():`` in-process, ``await worker.run()`` to serve
    until ``stop()``, or ``tether worker module:app`` from a shell.
    """

    def __init__(
        self,
        app: WorkerApp,
        *,
        queues: Sequence[str] | None = None,
        concurrency: int = 100,
        lease: float = 15.0,
        poll_interval: float = 0.25,
        cache_size: int = 10_000,
        cache_waiting: bool = False,
        threads: int | None = None,
        workflow_retry_delay: float = 5.0,
        versions: Collection[str] | None = None,
        worker_id: str | None = None,
        retention_every: float = 300.0,
    ) -> None:
        if not 1 <= concurrency <= MAX_CONCURRENCY:
            raise ConfigurationError(
                f"concurrency must be a whole number from 1 to {MAX_CONCURRENCY:,} "
                f"(got {concurrency!r}): it is how many tasks this worker holds at once"
            )
        for what, value in (
            ("lease", lease),
            ("poll_interval", poll_interval),
            ("retention_every", retention_every),
        ):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                # a NaN lease made every claim fail; an infinite one never ends, so a
                # crashed worker's tasks would never be taken over
                raise ConfigurationError(f"{what} must be a finite number of seconds > 0")
        if not (math.isfinite(workflow_retry_delay) and workflow_retry_delay >= 0):
            raise ConfigurationError("workflow_retry_delay must be a finite number of seconds >= 0")
        if worker_id is not None and not (isinstance(worker_id, str) and worker_id.strip()):
            # "" took a random id yet counted as stable: a restart took nothing back
            raise ConfigurationError(
                f"worker_id needs a name (got {worker_id!r}); leave it out for a random id"
            )
        self.app = app
        if isinstance(queues, str):  # one name given as a string: not its letters
            raise ConfigurationError(f"queues takes a list of queue names (got {queues!r})")
        self.queues = tuple(check_name(q, "queue of the worker") for q in queues or app.queues())
        self.concurrency = concurrency
        self.lease = lease
        self.poll_interval = poll_interval
        self.cache_size = cache_size
        #: keep runs that wait only on timers or signals in the sticky cache too
        self.cache_waiting = cache_waiting
        self.workflow_retry_delay = workflow_retry_delay
        #: workflow code versions whose runs this worker continues (None: any); runs
        #: recorded by another version are handed back for a worker that serves it
        self.versions = None if versions is None else frozenset(versions)
        self.id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        #: a stable id (given by the operator) lets a restarted worker take back at once
        #: what its crashed predecessor held, instead of waiting for the leases to expire
        self._stable_id = worker_id is not None
        self._id_release: Callable[[], None] = _held_nothing  #: ends the hold on the id
        #: how often the workflows' ``retention`` is applied (purging ended runs)
        self.retention_every = retention_every
        self._retention: Periodic | None = None
        self._folding: Periodic | None = None
        self._id_watch: Periodic | None = None  #: keeps the stable id held
        #: another process holds this worker's stable id now: claim nothing, lease
        #: nothing back, renew what is held at every check (so it is left to us)
        self._id_taken = False
        #: takes back the id's leases its previous holder no longer renews
        self._taking_back: asyncio.Task[None] | None = None
        self._threads = threads or min(32, concurrency)
        #: items of running batches beyond the first of each: a batch takes one slot
        self._batch_extra = 0
        self._cache: collections.OrderedDict[str, WorkflowInstance] = collections.OrderedDict()
        self._inflight: dict[int, tuple[Task, asyncio.Task[None], ActivityContext | None]] = {}
        #: monotonic time from which each in-flight task's lease is known to run (it
        #: reached this worker, or a renewal sent then succeeded): see _lease_left
        self._leased_at: dict[int, float] = {}
        #: the activity a finished one leads to, run next in the same asyncio task
        self._follow: dict[int, Task] = {}
        #: asyncio tasks awaiting a sync activity's thread (which nothing can interrupt)
        self._in_thread: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._unstarted: list[Task] = []
        #: when this worker last logged each activity it does not register
        self._unknown_said: dict[str, float] = {}
        #: the tries so far of each task whose payload this worker could not read
        #: (("run", run_id) for a workflow task, ("step", task_id) for an activity's)
        self._unread_tries: dict[tuple[str, object], int] = {}
        #: monotonic time until which this worker claims nothing (its keyring does not
        #: match the store's); the key ids it has said so for (logged once each)
        self._claims_paused_until = 0.0
        self._mismatch_said: set[str | None] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._switcher: asyncio.Task[None] | None = None
        #: the kill switches that are off (``_switches.py``), read every REFRESH seconds
        self._switches = Switches()
        self._background: set[asyncio.Future[object]] = set()
        self._main: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._slot: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: counters for tests and benchmarks
        self.stats: collections.Counter[str] = collections.Counter()
        #: sync activities whose threads ``stop()`` left running after ``thread_grace``
        #: ("<activity> of run <id>"): the process exits only when they end
        self._left_threads: list[str] = []

    # -- lifecycle ---------------------------------------------------------

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start serving in the background of the running loop."""
        if self._main is not None:
            return
        # a store that cannot be opened (a SQLite folder that does not exist) fails the
        # start with its own error, not first as a failed read of the kill switches
        _ = self.app.store
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._slot = asyncio.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self._threads, thread_name_prefix="tether-activity"
        )
        # every worker process writes the queue limits it was configured with, so all
        # processes claiming from a queue share them through the store
        await self.app._write_queue_limits(force=True)
        if self._stable_id:  # refuse an id a live process holds: it would run tasks twice
            self._id_release = await asyncio.to_thread(self.app.store.hold_worker_id, self.id)
        await self._read_switches()  # before the first task, claimed or handed over
        self.app.store.add_listener(self._on_commit)
        if self._stable_id:
            # the id's previous holder's leases, taken back in a few seconds if it is gone
            seen = await self.app.store.leases(self.id)
            if seen:
                self._taking_back = asyncio.create_task(
                    self._take_back(seen), name=f"tether-take-back-{self.id}"
                )
        self._main = asyncio.create_task(self._serve(), name=f"tether-worker-{self.id}")
        self.app._local_workers.append(self)
        if self.retention_every > 0:  # workflows' retention, and tenants' (in the store)
            self._retention = Periodic(
                f"tether-retention-{self.id}",
                self._apply_retention,
                lambda: self.retention_every,
                log,
                "applying retention",
            )
            self._retention.start()
        # the run counters' appended changes, folded often enough to stay a few rows
        self._folding = Periodic(
            f"tether-counters-{self.id}",
            self.app.store.fold_run_counts,
            lambda: FOLD_EVERY,
            log,
            "folding the run counters",
        )
        self._folding.start()
        if self._stable_id:
            self._id_watch = Periodic(
                f"tether-id-{self.id}",
                self._check_id,
                lambda: ID_CHECK_EVERY,
                log,
                "checking the hold on the worker id",
            )
            self._id_watch.start()

    async def _take_back(self, seen: dict[int, tuple[int, float, bool]]) -> None:
        """Take back the leases of the id's previous holder that it no longer renews.

        Holding the id proves only that the previous holder's hold ended, not that the
        process did (a PostgreSQL session can end while its process lives), so wait a
        few checks of the id first: a live holder finds its id taken and renews its
        leases, and they are left to it (run once, by it) instead of run twice."""
        await asyncio.sleep(RECLAIM_WAIT)
        try:
            reclaimed = await self.app.store.reclaim(self.id, seen)
        except Exception as exc:  # their leases expire instead
            log.warning("worker %s: could not take back its predecessor's tasks: %s", self.id, exc)
            return
        if reclaimed is None:
            log.warning(
                "worker %s: %d task(s) leased to this worker id before it started are left "
                "to their leases: %s",
                self.id,
                len(seen),
                "only heartbeats extend them, so nothing tells whether their holder lives"
                if all(beats for _, _, beats in seen.values())
                else "a live process renews them (its hold on the id had ended, e.g. with "
                "its database session): it finishes them and claims nothing more; stop one",
            )
            return
        if reclaimed:
            count("tether_orphans_recovered", (), reclaimed)
            log.info("worker %s took back %d task(s) of its predecessor", self.id, reclaimed)
        beats = sum(1 for _, _, b in seen.values() if b)
        if beats:
            log.info(
                "worker %s: %d task(s) of its predecessor that only heartbeats extend are "
                "left to their heartbeat timeouts (nothing tells whether their holder lives)",
                self.id,
                beats,
            )

    async def _check_id(self) -> None:
        """Keep the stable id held (a database session holding it can end while this
        process lives). If another process took it meanwhile, claim nothing more and
        lease nothing back, and renew every lease held at once: the other process takes
        back only leases no one renews, so what this one runs is left to it (run once)."""
        if await asyncio.to_thread(self.app.store.check_worker_id, self.id):
            if self._id_taken:  # held again: the other process is gone
                self._id_taken = False
                log.warning("worker %s: this process holds its worker id again", self.id)
                if self._wake is not None:
                    self._wake.set()
            return
        if not self._id_taken:
            self._id_taken = True
            log.error(
                "worker %s: another process holds this worker id now (this process's hold "
                "on it ended, e.g. with its database session), so this worker finishes what "
                "it runs (its leases renewed, left to it) and claims nothing more; stop one "
                "of the two",
                self.id,
            )
        await self._renew_held()

    async def run(self) -> None:
        """Serve until ``stop()`` is called (or the task is cancelled)."""
        await self.start()
        assert self._main is not None
        await asyncio.shield(self._main)

    async def stop(self, grace: float = 10.0, thread_grace: float | None = 60.0) -> None:
        """Stop claiming, give in-flight work ``grace`` seconds to finish, then cancel it.

        What was cancelled is released with its attempt given back (the worker stopped
        it; it did not fail). A sync activity's thread cannot be cancelled: its task is
        kept, lease renewed, and this waits for the thread ``thread_grace`` seconds more
        (None: until it returns), recording its result. A thread still running then is
        left behind: this returns, logs a warning naming the activity and its run, and
        no longer renews the task's lease, so once the lease expires another worker
        retries the step (the attempt counts, as after a crash); what the thread returns
        later is refused by the fence. The process exits only when such a thread ends
        (Python joins it), or by ``os._exit`` (what ``tether worker`` does then)."""
        if thread_grace is not None and not thread_grace >= 0:
            raise ConfigurationError(f"thread_grace must be >= 0 or None (got {thread_grace!r})")
        if self._main is None:
            return
        self._stopping = True
        if self in self.app._local_workers:
            self.app._local_workers.remove(self)
        assert self._wake is not None and self._slot is not None
        self._wake.set()
        self._slot.set()
        await self.app._loans_repaid(self, max(1.0, grace))  # starts of other threads here
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        # first let the claim loop end, so nothing is claimed after we decide what to
        # hand back (a claim in progress lands in _unstarted and is released below)
        done, _ = await asyncio.wait([self._main], timeout=max(1.0, grace))
        if not done:
            self._main.cancel()
        while self._inflight and loop.time() < deadline:
            inflight = [t for _, t, _ in self._inflight.values()]
            await asyncio.wait(inflight, timeout=deadline - loop.time())
        leftover = list(self._inflight.values())
        # a sync activity's thread cannot be interrupted: its task stays ours (renewed)
        # until the thread ends, never handed to another worker under code still running
        threads = [e for e in leftover if e[1] in self._in_thread]
        leftover = [e for e in leftover if e[1] not in self._in_thread]
        for _, t, ctx in leftover:
            if ctx is not None:
                ctx._stopping = True  # what it says of its end: handed back, not failed
            t.cancel()
        if leftover:
            await asyncio.wait([t for _, t, _ in leftover], timeout=1.0)
        # hand back what this worker still holds so others need not wait for leases.
        # Work claimed but never started gives its attempt back, and so does work this
        # stop interrupted: the worker stopped it, the activity did not fail, so deploys
        # never use up a step's retries (its side effects may have happened: at least
        # once, as ever). A crash cannot tell, and its lost attempt still counts.
        unstarted, self._unstarted = self._unstarted, []
        tasks = unstarted + [task for task, _, _ in leftover]
        if tasks:
            try:
                await self.app.store.release(tasks, unstarted=True)
            except StoreError as exc:
                log.warning("could not release %d task(s) on stop: %s", len(tasks), exc)
        if threads:
            names = sorted({task.name or "?" for task, _, _ in threads})
            log.warning(
                "worker %s: waiting for %d sync activity thread(s) (%s) to end after the "
                "%gs grace: a thread cannot be interrupted, so its task stays leased to this "
                "worker (and its result is recorded) until it returns, for up to %s",
                self.id,
                len(threads),
                ", ".join(names),
                grace,
                "ever" if thread_grace is None else f"{thread_grace:g}s more (thread_grace)",
            )
            _, stuck = await asyncio.wait([t for _, t, _ in threads], timeout=thread_grace)
            if stuck:
                self._leave_threads(stuck, thread_grace or 0.0)
                await asyncio.wait(stuck, timeout=1.0)
            late, self._unstarted = self._unstarted, []
            if late:
                try:
                    await self.app.store.release(late, unstarted=True)
                except StoreError as exc:
                    log.warning("could not release %d task(s) on stop: %s", len(late), exc)
        self._main.cancel()
        try:
            await self._main
        except asyncio.CancelledError:
            pass
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None
        if self._switcher is not None:
            self._switcher.cancel()
            self._switcher = None
        if self._taking_back is not None:
            self._taking_back.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._taking_back
            self._taking_back = None
        for periodic in (self._retention, self._folding, self._id_watch):
            if periodic is not None:
                await periodic.stop()
        self._retention = self._folding = self._id_watch = None
        self.app.store.remove_listener(self._on_commit)
        while self._cache:
            _, inst = self._cache.popitem()
            inst.close()
        self._id_release()  # a killed process's hold ends with it too
        self._id_release = _held_nothing
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._main = None

    def _leave_threads(self, stuck: set[asyncio.Task[Any]], waited: float) -> None:
        """Stop waiting for sync activity threads still running after ``thread_grace``:
        their attempts are left to their leases (no longer renewed once stop returns)."""
        for task, t, ctx in list(self._inflight.values()):
            if t not in stuck:
                continue
            if ctx is not None:
                ctx._cancelled = True  # a thread that checks is_cancelled may still stop
            self._left_threads.append(f"{task.name or '?'} of run {task.run_id}")
            log.warning(
                "worker %s: sync activity %r of run %r (step %s, attempt %s) still runs "
                "after the %gs thread_grace: a thread cannot be killed, so the worker stops "
                "without it and leaves the attempt to its lease (%gs, no longer renewed): "
                "then another worker retries the step; whatever this thread returns is "
                "not recorded",
                self.id,
                task.name,
                task.run_id,
                task.step,
                task.attempt,
                waited,
                self.lease,
                extra={"run_id": task.run_id},
            )
        for t in stuck:
            t.cancel()  # while stopping it records nothing and releases nothing

    async def _apply_retention(self) -> None:
        """Purge the ended runs of each workflow with a ``retention``, and of each tenant
        with one (``app.configure_retention``), that are older than it, in batches
        (every worker may do it: a batch skips runs another one holds)."""
        for wf in self.app.workflows():
            if wf.retention is not None:
                await self._purge_older(wf.retention, wf.name, None)
        for tenant, keep in (await self.app.store.tenant_retentions()).items():
            await self._purge_older(keep, None, tenant)

    async def _purge_older(self, keep: float, workflow: str | None, tenant: str | None) -> None:
        if self._stopping:
            return
        # their blobs are left to gc_blobs: telling which are unused reads every payload
        counts = await self.app._purge_before(
            self.app.store.clock() - keep,
            workflow,
            tenant,
            stopping=lambda: self._stopping,
            blobs=False,
        )
        removed = counts["runs"]
        if removed:
            label = workflow if workflow is not None else f"tenant:{tenant}"
            count("tether_runs_purged", (label,), removed)
            log.info("retention: purged %d ended run(s) of %s", removed, label)

    async def kill(self) -> None:
        """Die like a SIGKILLed process (for tests): drop everything, tell the store nothing.

        In-flight work is cancelled, leases are left to expire, the sticky cache is
        discarded. Sync activities already running in threads cannot be stopped and
        finish on their own; whatever they try to record is refused by the fence
        once another worker has taken their task over.
        """
        if self._main is None:
            return
        self._stopping = True
        if self in self.app._local_workers:
            self.app._local_workers.remove(self)
        tasks = [t for _, t, _ in self._inflight.values()]
        if self._renewer is not None:
            tasks.append(self._renewer)
            self._renewer = None
        if self._switcher is not None:
            tasks.append(self._switcher)
            self._switcher = None
        if self._taking_back is not None:
            tasks.append(self._taking_back)
            self._taking_back = None
        for t in (*tasks, self._main):
            t.cancel()
        await asyncio.gather(*tasks, self._main, return_exceptions=True)
        for periodic in (self._retention, self._folding, self._id_watch):
            if periodic is not None:
                await periodic.stop()
        self._retention = self._folding = self._id_watch = None
        self._inflight.clear()
        self._leased_at.clear()
        self._unstarted = []
        self.app.store.remove_listener(self._on_commit)
        while self._cache:
            _, inst = self._cache.popitem()
            inst.close()
        self._id_release()  # a killed process's hold ends with it too
        self._id_release = _held_nothing
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._main = None

    def running_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this worker serves on, while it serves (None otherwise)."""
        main = self._main
        return self._loop if main is not None and not main.done() and not self._stopping else None

    def accepts_local_start(self, queue: str, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether a run started in this process on ``loop`` may be handed to us directly."""
        return (
            self._main is not None
            and not self._stopping
            and not self._id_taken
            and self._loop is loop
            and queue in self.queues
            and self.free_slots() > 0
        )

    def _lease_to(self) -> str | None:
        """Who a commit leases a run's next task to: this worker, unless it stops or
        another process holds its id (then any worker claims it)."""
        return None if self._stopping or self._id_taken else self.id

    def free_slots(self) -> int:
        """How many more tasks this worker may hold (tasks leased to it on commit)."""
        return max(0, self.concurrency - len(self._inflight) + self._batch_extra)

    def _on_commit(self, ready: set[str], finished: Finished) -> None:
        # called on the store's thread after each commit
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        if ready.intersection(self.queues):
            loop.call_soon_threadsafe(wake.set)

    # -- the claim loop ------------------------------------------------------

    async def _serve(self) -> None:
        assert self._wake is not None and self._slot is not None
        self._renewer = asyncio.create_task(self._renew_loop())
        self._switcher = asyncio.create_task(self._switch_loop())
        failures = 0
        while not self._stopping:
            free = self.free_slots()
            if free <= 0:
                self._slot.clear()
                await self._slot.wait()
                continue
            self._wake.clear()
            paused = math.inf if self._id_taken else self._claims_paused_until - time.monotonic()
            if paused > 0:  # a keyring that cannot record, or an id another process holds
                try:
                    await asyncio.wait_for(self._wake.wait(), min(paused, 60.0))
                except TimeoutError:
                    pass
                continue
            try:
                tasks, throttled_until = await self.app.store.claim_with_wake(
                    worker_id=self.id, queues=self.queues, limit=min(free, 64), lease=self.lease
                )
                failures = 0
            except StoreError as exc:
                failures += 1
                log.warning("claim failed (%s); retrying", exc)
                await asyncio.sleep(min(5.0, 0.1 * 2**failures))
                continue
            self._spawn_claimed(tasks)
            if tasks:
                continue
            timeout = self.poll_interval
            try:
                due = await self.app.store.next_due(self.queues)
            except StoreError:
                due = None
            if due is not None:
                wait = due - self.app.store.clock()
                # due already but not claimable (suspended run, queue limit): poll,
                # never spin; a commit that makes work claimable wakes us anyway
                if wait > 0:
                    timeout = min(timeout, wait)
                elif wait > -0.02:
                    timeout = 0.005  # became due just after our claim: look again soon
            if throttled_until is not None:
                # a queue is out of rate-limit tokens or paused: look again when it
                # may let work through, not a whole poll interval later
                timeout = min(timeout, max(0.001, throttled_until - self.app.store.clock()))
            if timeout > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass

    def _spawn_claimed(self, tasks: list[Task]) -> None:
        """Start what a claim returned: tasks of one batch together, the rest one by one."""
        batches: dict[int, list[Task]] = {}
        for task in tasks:
            if task.batch_id is None:
                self._spawn(task)
            else:
                batches.setdefault(task.batch_id, []).append(task)
        for batch in batches.values():
            self._spawn_batch(batch)

    def _spawn_batch(self, tasks: list[Task]) -> None:
        """Run a batched activity once for ``tasks``, in one slot; each task stays in
        flight (renewed, released on stop) under its own id until it is recorded."""
        if self._stopping:
            self._unstarted.extend(tasks)
            return
        tasks = [t for t in tasks if not self._held(t)]
        if not tasks:
            return
        for task in tasks:
            self._supersede(task)
        t = asyncio.create_task(run_batch(self, tasks))
        self._batch_extra += len(tasks) - 1
        t.add_done_callback(functools.partial(self._batch_done, len(tasks) - 1))
        for task in tasks:
            self._inflight[task.task_id] = (task, t, None)
            self._leased_at[task.task_id] = time.monotonic()
            t.add_done_callback(functools.partial(self._done, [task.task_id]))

    def _batch_done(self, extra: int, t: asyncio.Task[None]) -> None:
        self._batch_extra -= extra

    async def _read_switches(self) -> None:
        try:
            self._switches = Switches(await self.app.store.switches())
        except StoreError as exc:  # keep the last known state
            log.warning("reading the kill switches failed: %s", exc)

    async def _switch_loop(self) -> None:
        while True:
            await asyncio.sleep(SWITCH_REFRESH)
            await self._read_switches()

    def _held(self, task: Task) -> bool:
        """Give ``task`` back unstarted if a kill switch holds it (True)."""
        if not self._switches:
            return False
        switch = self._switches.holder(task)
        if switch is None:
            return False
        self.stats["held_by_switch"] += 1
        note = engine_note(held_note(task, switch))
        self._fire(self.app.store.release([task], delay=SWITCH_HOLD, unstarted=True, note=note))
        return True

    def _spawn(self, task: Task) -> None:
        if self._stopping:
            self._unstarted.append(task)  # leased to us while stopping: released in stop()
            return
        if self._held(task):
            return
        current = [task.task_id]  #: the task this asyncio task runs now (see _run_activities)
        if task.kind == "workflow":
            coro = self._run_workflow_task(task)
        elif task.kind == "activity":
            coro = self._run_activities(task, current)
        else:
            coro = self._fire_timer(task)
        if task.kind != "timer" and self._switches.off.get("tenant"):
            coro = self._tenant_gate(task, coro)  # only while some tenant is switched off
        self._supersede(task)  # first, so a stale attempt unwinds before this one starts
        t = asyncio.create_task(coro)
        self._inflight[task.task_id] = (task, t, None)
        self._leased_at[task.task_id] = time.monotonic()
        t.add_done_callback(functools.partial(self._done, current))

    def cancel_activity(self, run_id: str, step: int) -> None:
        """The run cancelled its ``step`` (committed): an async attempt of it running
        here sees ``CancelledError`` at its next await (its HTTP request aborted, say),
        its outcome recorded as for a cancel the lease renewal reports. A sync one (its
        thread cannot be stopped) sees ``ctx.is_cancelled`` and is left to the renewal,
        as is a batch, which runs on for its other items."""
        for task, atask, ctx in list(self._inflight.values()):
            if task.kind != "activity" or task.run_id != run_id or task.step != step:
                continue
            if ctx is None:  # not begun yet: the renewal (or its claim) finds it cancelled
                continue
            ctx._cancelled = True
            if task.batch_id is None and not ctx._returned and atask not in self._in_thread:
                atask.cancel()  # (a sync one's thread runs on: it sees ctx.is_cancelled)

    def _supersede(self, task: Task) -> None:
        """``task`` was claimed again (by us: our lease on it expired while an attempt
        still ran, e.g. renewals failed): the stale attempt can record nothing, so it is
        stopped like one whose lease was lost, and its entry is the new attempt's now."""
        entry = self._inflight.get(task.task_id)
        if entry is None or entry[0].fence == task.fence:
            return
        old, atask, ctx = entry
        if ctx is not None:
            ctx._cancelled = True
        if old.kind == "activity" and old.batch_id is None and not (ctx and ctx._returned):
            atask.cancel()

    async def _activity_tenant(self, tasks: Sequence[Task]) -> str | None:
        """With per-tenant keys, the tenant of these tasks' runs (their activity's
        ``put_blob`` seals for it), if they have one and the same; else None (the shared
        key). The claim brings it with each task; one it did not (``tenant_known``) is
        read now, before the attempt begins: a ``StoreError`` here spends no attempt
        (``_tenant_blip``), where one inside the user's code would."""
        codec = self.app.store.codec
        if codec is None or not codec.per_tenant:
            return None
        tenants: set[str | None] = set()
        unknown: list[str] = []
        for t in tasks:
            if t.tenant_known:
                tenants.add(t.tenant)
            elif t.run_id in codec.tenants:
                tenants.add(codec.tenants[t.run_id])
            else:
                unknown.append(t.run_id)
        if unknown:  # a batch's runs read together, not one after another
            found = await asyncio.gather(
                *(self.app.store.run_tenant(r) for r in dict.fromkeys(unknown))
            )
            tenants.update(found)
            if self._unread_tries:  # read: a wait of a failed read's starts over
                for t in tasks:
                    self._unread_tries.pop(("tenant", t.task_id), None)
        return tenants.pop() if len(tenants) == 1 else None

    async def _tenant_blip(self, tasks: Sequence[Task], exc: StoreError) -> None:
        """The tenant read before an attempt failed: the tasks go back unstarted (no
        attempt spent: their code never ran), to run again after a wait that doubles
        with each failed read of the same step (from STORE_BLIP_DELAY up to
        TENANT_BLIP_MAX_HOLD: a store that keeps failing is not asked in a loop), and
        the run says why (an engine note) until its step moves on."""
        first = tasks[0]
        longest = max(TENANT_BLIP_MAX_HOLD, STORE_BLIP_DELAY)
        delay, tries = self._unreadable_hold(("tenant", first.task_id), exc, STORE_BLIP_DELAY)
        delay = min(delay, longest)
        log.warning(
            "could not read the tenant of run %r before its step %s (try %d), so the step "
            "is given back to run in %g s: %s",
            first.run_id,
            first.step,
            tries,
            delay,
            shown_error(exc),
            extra={"run_id": first.run_id},
        )
        what = f"step {first.step}" if len(tasks) == 1 else f"a batch of {len(tasks)} steps"
        note = engine_note(
            f"StoreError: the run's tenant could not be read before the attempt of {what}: "
            "it waits (no attempt spent) and is tried again, each wait longer, up to "
            f"{longest:g} s" + (f" ({exc})" if is_engine_made(exc) else "")
        )
        try:
            await self.app.store.release(list(tasks), delay=delay, unstarted=True, note=note)
        except StoreError:  # its lease runs out instead
            pass

    async def _tenant_gate(self, task: Task, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` unless the run's tenant is switched off (then hold the task).
        The tenant comes with the task (per-tenant keys) or is read alone: the run's
        payloads are neither read nor opened for it, on every claim of a held task."""
        tenant = task.tenant if task.tenant_known else await self.app.store.run_tenant(task.run_id)
        if tenant is not None and tenant in self._switches.off.get("tenant", ()):
            coro.close()
            self.stats["held_by_switch"] += 1
            note = engine_note(held_note(task, f"tenant {tenant!r}"))
            await self.app.store.release([task], delay=SWITCH_HOLD, unstarted=True, note=note)
            return
        await coro

    def _done(self, current: list[int], t: asyncio.Task[None] | None = None) -> None:
        task_id = current[0]
        entry = self._inflight.get(task_id)
        if entry is not None and (t is None or entry[1] is t):
            del self._inflight[task_id]
            self._leased_at.pop(task_id, None)
        else:  # the task was claimed again meanwhile: that entry is the new attempt's
            entry = None
        if t is not None and not t.cancelled():
            exc = t.exception()  # retrieved, so it is never lost in a warning
            delay = 1.0
            if isinstance(exc, KeyringMismatchError):  # this process's setup: no traceback
                # every task would fail alike here: stop claiming for a while and give
                # the task back at once, so workers that can record it take it
                self.stats["keyring_mismatches"] += 1
                self._claims_paused_until = time.monotonic() + KEYRING_PAUSE
                delay = 0.0
                if exc.key_id not in self._mismatch_said:
                    self._mismatch_said.add(exc.key_id)
                    log.error(
                        "worker %s: task %d: nothing recorded: %s (this worker claims "
                        "nothing for %g s at a time, leaving its tasks to other workers, "
                        "until it is restarted with the right keyring)",
                        self.id,
                        task_id,
                        exc,
                        KEYRING_PAUSE,
                    )
                else:
                    log.debug("task %d: nothing recorded: %s", task_id, exc)
            elif isinstance(exc, Exception):
                log.error("task %d failed unexpectedly", task_id, exc_info=exc)
            if isinstance(exc, Exception) and entry is not None and not self._stopping:
                # give it back soon rather than sit on the lease until it expires
                self._fire(self.app.store.release([entry[0]], delay=delay))
        if self._slot is not None:
            self._slot.set()

    def _fire(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run a best-effort store call in the background, logging its failure."""

        def report(f: asyncio.Future[object]) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.warning("background store call failed: %s", f.exception())

        fut = asyncio.ensure_future(coro)
        self._background.add(fut)
        fut.add_done_callback(self._background.discard)
        fut.add_done_callback(report)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease / 3)
            await self._renew_held()

    async def _renew_held(self) -> None:
        """Renew the leases of everything in flight; stop what lost its lease."""
        held = [t for t, _, _ in self._inflight.values()]
        if not held:
            return
        sent = time.monotonic()
        try:
            alive = await self.app.store.renew(held, self.lease)
        except StoreError as exc:
            log.warning("lease renewal failed: %s", exc)
            return
        for t in held:
            entry = self._inflight.get(t.task_id)
            if entry is None or entry[0] is not t:  # ended, or claimed again since
                continue
            _, atask, ctx = entry
            cancelled = alive.get(t.task_id)
            if cancelled is not None and not _beats_only(t):
                # renewed: its lease runs from before the call (a heartbeat-only
                # lease was not extended: only heartbeats do, see _lease_left)
                self._leased_at[t.task_id] = sent
            if cancelled is None or cancelled:
                if ctx is not None:
                    ctx._cancelled = True
                if (
                    t.kind == "activity"
                    and t.batch_id is None  # a batch runs on for its other items
                    and not (ctx is not None and ctx._returned)
                ):
                    # lost the lease (nothing this attempt does can be committed) or
                    # the run was cancelled: async activities see CancelledError at
                    # their next await; sync ones see ctx.is_cancelled. One that has
                    # already returned is left to record its result.
                    atask.cancel()

    # -- workflow tasks ----------------------------------------------------

    async def _run_workflow_task(self, task: Task) -> None:
        inst = self._cache.pop(task.run_id, None)
        keep: list[WorkflowInstance] = []
        try:
            await self._advance_and_commit(task, inst, keep)
        finally:
            # an instance not kept is closed here, so its pending coroutines are unwound
            # inside the instance (issuing nothing), never by the garbage collector
            for candidate in (inst, *keep):
                if candidate is not None and candidate not in keep:
                    candidate.close()
            for kept in keep:
                self._keep(task.run_id, kept)

    def _keep(self, run_id: str, inst: WorkflowInstance) -> None:
        """Cache a committed instance so the run's next task costs O(new events)."""
        if inst.finished or (
            not self.cache_waiting and not inst.hot and inst.waits_only_on_time_or_events()
        ):
            # a run that waits for a timer or a signal costs no memory: its
            # history is its state, replayed (cheaply) when it wakes
            inst.close()
            return
        self._cache[run_id] = inst
        while len(self._cache) > self.cache_size:
            _, evicted = self._cache.popitem(last=False)
            evicted.close()

    # -- eager start: the first workflow task of a run started in this process ----

    def eager_start(
        self, wf: Workflow[Any, Any], run_id: str, input_text: str, data: dict[str, Any], now: float
    ) -> tuple[WorkflowInstance, WorkflowTaskResult, float] | None:
        """Run a new run's first workflow task before the run is stored.

        ``app.start`` then records the run and this task's commands in one commit
        (the activities it schedules leased to us), instead of one commit to create
        the run and another to complete its first task. ``data`` is the start
        event's data as the store will record it. Returns the instance, the task's
        result and when it began (for ``adopt_start``); None: take the ordinary path.
        """
        if self._stopping or wf.name in self._switches.off.get("workflow", ()):
            return None
        began = time.time()
        start = Event(
            run_id=run_id,
            seq=1,
            type=EventType.WORKFLOW_STARTED,
            step=None,
            data={**data, "input": json.loads(input_text)},
            created_at=now,
        )
        inst = WorkflowInstance(run_id, wf)
        try:
            result = inst.advance([start], now)
        except Exception:  # a bug in the code: the ordinary path records the failure
            inst.close()
            return None
        return inst, result, began

    def adopt_start(
        self, eager: tuple[WorkflowInstance, WorkflowTaskResult, float], res: StartResult
    ) -> None:
        """Take over what ``create_run`` did with an eager first task (or drop it): once
        committed, the task is followed up as any other (``_committed``: its counts,
        spans and, when it ended the run, the run's duration and lifetime span)."""
        inst, result, began = eager
        if res.first_marker is None:  # the run existed already or was queued
            inst.close()
            if res.leased is not None:
                self._spawn(res.leased)
            return
        self.stats["workflow_tasks"] += 1
        self.stats["eager_starts"] += 1
        observe("tether_queue_wait", (res.run.queue, "workflow"), 0.0)  # it never waited
        inst.committed(res.first_marker)
        self._committed(res.run.run_id, inst, result, began, False)
        self._keep(res.run.run_id, inst)
        for t in res.first_leased:
            self._spawn(t)

    async def _advance_and_commit(
        self, task: Task, inst: WorkflowInstance | None, keep: list[WorkflowInstance]
    ) -> None:
        store = self.app.store
        fresh: WorkflowInstance | None = None
        began = time.time()
        try:
            if task.prefetched is not None and task.prefetched_after == (
                inst.through if inst is not None else 0
            ):
                events = list(task.prefetched)  # read with the lease: no round trip
            else:
                events = await self._read_history(task.run_id, inst.through if inst else 0)
            if inst is not None and any(
                e.type in REPLAY_CHANGING and e.seq > inst.last_seq for e in events
            ):
                # another worker advanced this run: our copy is stale
                self.stats["cache_stale"] += 1
                inst = None
                events = await self._read_history(task.run_id, 0)
            if inst is None:
                self.stats["replays"] += 1
                wf = self.app.get_workflow(task.name or "")
                inst = fresh = WorkflowInstance(task.run_id, wf)
            else:
                self.stats["cache_hits"] += 1
            if fresh is not None and self.versions is not None:
                recorded = next(
                    (
                        e.data.get("version")
                        for e in events
                        if e.type is EventType.WORKFLOW_TASK_COMPLETED
                    ),
                    None,
                )
                if recorded is not None and recorded not in self.versions:
                    fresh.close()
                    self.stats["version_skipped"] += 1
                    await store.release([task], delay=1.0)
                    return
            now = store.clock()
            if fresh is not None and events and events[-1].seq == 1:
                # the run's first workflow task: how long the run was pending
                observe("tether_queue_wait", (task.queue, "workflow"), now - events[0].created_at)
            result = inst.advance(events, now)
            if self._unread_tries:  # it reads again: a later failure starts a new backoff
                self._unread_tries.pop(("run", task.run_id), None)
        except _StoreBlip as blip:
            # the store's failure, not the code's: no task_error, no retry delay
            if fresh is not None:
                fresh.close()
            log.warning(
                "could not read the history of run %r, so its workflow task is given back: %s",
                task.run_id,
                blip.error,
                extra={"run_id": task.run_id},
            )
            try:
                await store.release([task], delay=STORE_BLIP_DELAY)
            except StoreError:  # (LeaseLostError too) its lease runs out instead
                pass
            return
        except LeaseLostError:
            if fresh is not None:
                fresh.close()
            return
        except Exception as exc:
            if fresh is not None:
                fresh.close()
            wf_name = task.name or ""
            if isinstance(exc, NonDeterminismError):
                count("tether_nondeterminism_errors", (wf_name,))
            count("tether_workflow_task_failures", (wf_name, type(exc).__name__))
            delay = self.workflow_retry_delay
            then = ""
            if isinstance(exc, (KeyUnavailableError, BlobError)):
                # its payload cannot be read: restoring the key or blob heals it, so it is
                # tried again, but ever less often (not every workflow_retry_delay for ever)
                delay, tries = self._unreadable_hold(("run", task.run_id), exc, delay)
                then = f" (try {tries}: tried again in {delay:g} s; " + (
                    "the key was destroyed, so only a keyring from before brings it back)"
                    if isinstance(exc, KeyUnavailableError) and exc.destroyed
                    else "restoring the key or blob heals the run)"
                )
            # the message may hold the run's data: logged only as the redaction hook allows
            # (one the engine made and marked, from names, ids and hashes alone, is logged
            # whole: trusted by its mark, never by its wording)
            log.error(
                "workflow task for run %r failed: %s: %s%s",
                task.run_id,
                type(exc).__name__,
                shown_error(exc),
                then,
                extra={"run_id": task.run_id, "workflow": wf_name},
            )
            self.stats["workflow_task_failures"] += 1
            if inst is not None and inst.started is not None:
                workflow_task_span(
                    wf_name,
                    task.run_id,
                    inst.trace_context(),
                    began,
                    time.time(),
                    {"tether.replayed": fresh is not None},
                    type(exc).__name__,
                )
            text = task_error_text(exc)  # tagged when the engine made it
            try:
                await store.fail_workflow_task(task, text, store.clock() + delay)
            except (LeaseLostError, StoreError):
                pass
            except KeyUnavailableError:
                # the error cannot be sealed for the run's tenant (its key destroyed): the
                # task waits all the same, its error kept as it is when the engine made
                # it from ids alone (else unsaid)
                try:
                    await store.release(
                        [task], delay=delay, note=text if is_engine_made(exc) else None
                    )
                except StoreError:  # (LeaseLostError too) its lease runs out instead
                    pass
            return
        tries = 0
        since = store.clock()  # a lost commit could only lease tasks made from now
        while True:
            try:
                marker, leased = await store.complete_workflow_task(
                    task,
                    result,
                    lease_to=self._lease_to(),
                    lease_queues=self.queues,
                    lease=self.lease,
                    lease_limit=self.free_slots(),
                )
            except LeaseLostError:
                if fresh is not None:
                    fresh.close()
                if tries:  # the fence refused a retry: most likely the first had landed
                    log.info(
                        "workflow task of run %r: a retry was refused, so the commit lost "
                        "with the store's connection had been recorded (or the task's "
                        "lease had passed)",
                        task.run_id,
                        extra={"run_id": task.run_id},
                    )
                    # the steps it may have leased to this worker are given back now
                    await self._give_back_unknown(task, since)
                else:
                    self._lease_lost(attempt=False)  # a workflow task's
                return
            except StoreError as exc:
                if tries < len(COMPLETE_RETRY_PAUSES):  # fenced: a retry is safe
                    await asyncio.sleep(COMPLETE_RETRY_PAUSES[tries])
                    tries += 1
                    continue
                if fresh is not None:
                    fresh.close()
                log.warning(
                    "could not commit workflow task of %r (%d attempts), so it is given "
                    "back to run again in %g s: %s",
                    task.run_id,
                    tries + 1,
                    STORE_BLIP_DELAY,
                    exc,
                    extra={"run_id": task.run_id},
                )
                # soon, but a store that keeps failing is not asked in a loop
                try:
                    held = await store.release([task], delay=STORE_BLIP_DELAY)
                except StoreError:  # the store still fails: its lease runs out instead
                    return
                if held == 0:  # the task is gone or moved on: one of the offers landed,
                    # so the steps it leased to this worker are given back rather than
                    # left to their leases
                    await self._give_back_unknown(task, since)
                return
            break
        if marker == TASK_REJECTED:
            # the result would have ended the run while a signal, cancel or result
            # arrived: not applied; the task runs again (a fresh replay) with it
            self.stats["workflow_tasks_rejected"] += 1
            inst.close()
            return
        self.stats["workflow_tasks"] += 1
        inst.committed(marker)
        keep.append(inst)
        self._committed(task.run_id, inst, result, began, fresh is not None)
        for t in leased:
            self._spawn(t)

    async def _read_history(self, run_id: str, after: int) -> list[Event]:
        try:
            return await self.app.store.read_history(run_id, after)
        except LeaseLostError:
            raise
        except StoreError as exc:
            raise _StoreBlip(exc) from exc

    def _committed(
        self,
        run_id: str,
        inst: WorkflowInstance,
        result: WorkflowTaskResult,
        began: float | None,
        replayed: bool,
    ) -> None:
        """After a workflow task's commit: alerts, counters and metrics, and (when the
        run is traced) the spans of the task, the waits it ended and the run's end.

        ``began`` is when the task began (None: it rode on an activity's commit, the
        one-commit path, whose attempt span covers it)."""
        carrier = inst.trace_context()
        for cmd in result.commands:
            t = cmd.type
            if t is EventType.ACTIVITY_CANCEL_REQUESTED:
                # a step the run stopped waiting for (a hedge's loser, a cancelled run's
                # step): stopped now where it runs in this process, not at the next
                # lease renewal (other processes still learn it from theirs)
                for w in self.app._local_workers:
                    w.cancel_activity(run_id, int(cmd.data["activity_step"]))
            if t is EventType.WORKFLOW_NEEDS_INTERVENTION:
                self.app._alert(run_id, cmd.data.get("error") or {})
            if t is EventType.CHILD_STARTED:
                count("tether_runs_started", (cmd.data.get("workflow") or "",))
            elif t in _RUN_ENDINGS and inst.started is not None:
                status = _RUN_ENDINGS[t]
                started_at = inst.started.created_at
                observe(
                    "tether_run_duration",
                    (inst.workflow.name, status),
                    max(0.0, result.time - started_at),
                )
                if carrier is not None:
                    run_span(inst.workflow.name, run_id, carrier, started_at, result.time, status)
        for name, labels, n in inst.take_counts():
            count(name, labels, n)
        waits = inst.take_waits()
        if waits:
            for kind, name, since, ended in waits:
                observe("tether_wait_duration", (kind, name), max(0.0, ended - since))
            if carrier is not None:
                wait_spans(inst.workflow.name, run_id, carrier, waits)
        if began is not None and carrier is not None:
            workflow_task_span(
                inst.workflow.name,
                run_id,
                carrier,
                began,
                time.time(),
                {
                    "tether.replayed": replayed,
                    "tether.commands": len(result.commands),
                    "tether.workflow.version": result.version or "",
                    "tether.tenant": (inst.started.data.get("tenant") if inst.started else None)
                    or "",
                },
            )

    # -- activities ----------------------------------------------------------

    async def _run_activities(self, task: Task, current: list[int]) -> None:
        """Run an activity, then the run's next one in the same asyncio task when the
        one-commit path leased it back (no task to create and schedule per step)."""
        me = asyncio.current_task()
        assert me is not None
        while True:
            try:
                with attempt_span(task):  # a span of its run's trace, when traced
                    await self._run_activity(task, inline=True)
            except BaseException:
                left = self._follow.pop(task.task_id, None)
                if left is not None:
                    self._spawn(left)  # it must still run (or be released on stop)
                raise
            follow = self._follow.pop(task.task_id, None)
            if follow is None:
                return
            # the slot passes to the next step of the run: renewed and cancelled as its own
            entry = self._inflight.get(task.task_id)
            if entry is not None and entry[1] is me:
                del self._inflight[task.task_id]
                self._leased_at.pop(task.task_id, None)
            if self._stopping:
                self._unstarted.append(follow)
                return
            if self._held(follow):
                return
            if self._switches.off.get("tenant"):
                # some tenant is off: the step starts through the tenant gate (_spawn),
                # which reads its run's tenant
                self._spawn(follow)
                return
            current[0] = follow.task_id
            self._supersede(follow)
            self._inflight[follow.task_id] = (follow, me, None)
            self._leased_at[follow.task_id] = time.monotonic()
            task = follow

    async def _run_activity(self, task: Task, inline: bool = False) -> None:
        store = self.app.store
        assert self._loop is not None
        opts = task.options or {}
        try:
            act = self.app.get_activity(task.name or "")
        except TetherError:
            # another deploy may know it: the step waits for a worker that does, spending
            # no attempt (a bad deploy must not use up its retries), and the run says why
            await self._hold_unknown(task)
            return
        plan = _Plan(Retry.from_json(opts.get("retry") or {}, act.opts.retry.non_retryable), opts)
        unread = _sealed(task)
        if unread:
            # its arguments are sealed under a key this process lacks (or kept in a blob
            # it cannot read): the step waits for a worker that can read them, or for this
            # one to be given the key or blob; no attempt is spent
            delay = KEY_HOLD
            try:
                decode_text(store.codec, unread, f"run {task.run_id!r}, step {task.step}")
            except (KeyUnavailableError, BlobError) as exc:
                # tried again ever less often, each try logged once
                delay, tries = self._unreadable_hold(("step", task.task_id), exc, KEY_HOLD)
                log.error(
                    "activity %r of run %r waits (try %d: tried again in %g s): %s: %s",
                    act.name,
                    task.run_id,
                    tries,
                    delay,
                    type(exc).__name__,
                    shown_error(exc),  # a keyring of the user's words its own errors
                    extra={"run_id": task.run_id},
                )
            self.stats["held_unreadable"] += 1
            await store.release([task], delay=delay, unstarted=True)
            return
        if self._unread_tries:
            self._unread_tries.pop(("step", task.task_id), None)
        details = None
        if task.heartbeat is not None:
            details = json.loads(task.heartbeat)
        ctx = ActivityContext(
            run_id=task.run_id,
            step=task.step or 0,
            name=act.name,
            attempt=task.attempt,
            idempotency_key=f"{task.run_id}:{task.step}",
            heartbeat_details=details,
            task=task,
            _store=store,
            _loop=self._loop,
            _lease=self.lease,
        )
        entry = self._inflight.get(task.task_id)
        if entry is not None and entry[0] is task:  # (not a newer attempt's)
            self._inflight[task.task_id] = (entry[0], entry[1], ctx)
        now = store.clock()
        if plan.deadline is not None and now >= plan.deadline:
            await self._record_failure(task, _StepTimeout(plan.deadline_reason), plan, ctx)
            return
        if task.attempt > plan.retry.attempts:
            err = TimeoutError(
                f"attempt {task.attempt} exceeds the {plan.retry.attempts} allowed: earlier "
                "attempts were lost (a worker was killed or lost its lease, or a heartbeat "
                "timed out)"
            )
            await self._record_failure(task, err, plan, ctx)
            return
        codec = store.codec
        if codec is None or not codec.per_tenant:
            ctx._tenant = None  # (no per-tenant keys: what _activity_tenant says)
        elif task.tenant_known:
            ctx._tenant = task.tenant  # brought by the claim: no read, no await a step
        else:
            try:  # after the deadline's check: a read that keeps failing cannot outlive it
                ctx._tenant = await self._activity_tenant([task])
            except StoreError as exc:
                await self._tenant_blip([task], exc)
                return
        now = store.clock()  # (the read may have taken a while)
        timeout = plan.attempt_timeout(now)
        scheduled_at = opts.get("scheduled_at")
        if task.attempt == 1 and scheduled_at is not None:
            observe("tether_queue_wait", (task.queue, "activity"), max(0.0, now - scheduled_at))
        breaker = opts.get("breaker")
        if breaker:
            wait = await store.breaker_admit(breaker)
            if wait is not None:  # open: fail fast, never touching the dependency
                self.stats["breaker_rejections"] += 1
                count("tether_breaker_rejections", (act.name,))
                await self._record_failure(task, CircuitOpenError(breaker["name"], wait), plan, ctx)
                return
        ctx._began = time.perf_counter()
        try:
            args, kwargs = act.sig.decode_args(task.payload or "{}")
            if act.is_async:
                # awaited inline, in this task's own context: no second task per step
                token = set_context(ctx)
                try:
                    if timeout:
                        async with asyncio.timeout(timeout) as limit:
                            # what ran out, should it: an activity may say so in its
                            # own words (a model step names its model and what to do)
                            ctx._timeout, ctx._timeout_s = limit, timeout
                            per_attempt = timeout == plan.timeout
                            ctx._timeout_of = "" if per_attempt else plan.deadline_reason
                            value = await act.fn(*args, **kwargs)
                    else:
                        value = await act.fn(*args, **kwargs)
                finally:
                    reset_context(token)
            else:
                cv = contextvars.copy_context()
                cv.run(set_context, ctx)
                fut = self._loop.run_in_executor(
                    self._pool, functools.partial(cv.run, act.fn, *args, **kwargs)
                )
                me = asyncio.current_task()
                assert me is not None
                self._in_thread.add(me)  # a graceful stop waits for it (see stop)
                try:
                    value = await asyncio.wait_for(fut, timeout) if timeout else await fut
                finally:
                    self._in_thread.discard(me)
            ctx._returned = True
            result = encode(value, f"result of activity {act.name!r}")
        except asyncio.CancelledError:
            if self._stopping:
                raise
            me = asyncio.current_task()
            if not ctx._cancelled and me is not None and me.cancelling():
                # not a cancel of the run or step (the store said nothing: the renewer and
                # heartbeats set ctx._cancelled first) but of our own asyncio task, e.g. the
                # loop torn down without stop(): the attempt did not fail, it is handed back
                try:
                    await store.release([task], unstarted=True)
                except Exception as exc:  # its lease expires instead
                    log.warning("could not release interrupted task %d: %s", task.task_id, exc)
                raise
            ctx._cancelled = True
            await self._record_failure(
                task, asyncio.CancelledError("activity cancelled"), plan, ctx
            )
            return
        except TimeoutError as exc:
            err = TimeoutError(
                str(exc) or ctx._timeout_note or f"activity {act.name!r} timed out after {timeout}s"
            )
            await self._record_failure(task, err, plan, ctx)
            return
        except PayloadError as exc:
            await self._record_failure(task, NonRetryable(str(exc)), plan, ctx)
            return
        except Exception as exc:
            await self._record_failure(task, exc, plan, ctx)
            return
        self.stats["activities"] += 1
        observe("tether_activity_duration", (act.name, "ok"), time.perf_counter() - ctx._began)
        mark_ok()
        if breaker:
            await self._breaker_record(breaker, True)
        if task.dependency is not None:
            pause = ratelimit_pause(value)
            if pause is not None:  # it succeeded, but the budget it used is now empty
                try:
                    await store.dependency_feedback(task, pause)
                except StoreError as exc:
                    log.warning("could not pause dependency %r: %s", task.dependency, exc)
        await self._record_result(task, result, value, inline)

    def _unreadable_hold(
        self, key: tuple[str, object], exc: Exception, first: float
    ) -> tuple[float, int]:
        """How long a task whose payload cannot be read waits before its next try, and
        which try this was: the waits double from ``first`` up to UNREADABLE_MAX_HOLD,
        and a destroyed key's is the longest at once (erased on purpose)."""
        tries = self._unread_tries.pop(key, 0) + 1
        self._unread_tries[key] = tries  # (last: the oldest are forgotten first)
        while len(self._unread_tries) > UNREADABLE_REMEMBERED:
            del self._unread_tries[next(iter(self._unread_tries))]
        if isinstance(exc, KeyUnavailableError) and exc.destroyed:
            return UNREADABLE_MAX_HOLD, tries
        first = first or 1.0
        return min(max(UNREADABLE_MAX_HOLD, first), first * 2.0 ** min(tries - 1, 30)), tries

    async def _hold_unknown(self, task: Task) -> None:
        """Give back unstarted a step whose activity this worker does not register."""
        name = task.name or ""
        self.stats["held_unknown"] += 1
        now = time.monotonic()
        said = self._unknown_said.get(name)
        if said is None or now - said >= UNKNOWN_LOG_EVERY:
            self._unknown_said[name] = now
            log.error(
                "no activity named %r is registered with this worker's App: its steps (queue "
                "%r) are given back unstarted, spending no attempt, for a worker that "
                "imports the module defining it (logged at most every %.0f s)",
                name,
                task.queue,
                UNKNOWN_LOG_EVERY,
                extra={"run_id": task.run_id},
            )
        note = engine_note(
            f"UnknownActivityError: step {task.step} (activity {name!r}, queue "
            f"{task.queue!r}) waits for a worker that registers {name!r}; worker "
            f"{self.id} does not"
        )
        await self.app.store.release([task], delay=UNKNOWN_HOLD, unstarted=True, note=note)

    async def _record_result(
        self, task: Task, result: str, value: Any = _UNSET, inline: bool = False
    ) -> None:
        """Record an activity's result: the one-commit path when it applies, else
        ``complete_activity`` (and run the workflow task it leases back to us).

        ``result`` is the encoded ``value`` (when the caller still has it). With
        ``inline``, the run's next activity is left in ``_follow`` for the caller to run.
        """
        store = self.app.store
        since = store.clock()  # a lost commit could only lease tasks made from now
        fast = await self._complete_fast(task, result, value, inline)
        if fast:
            return
        if fast is None:  # the one-commit path's commit was lost: this is a retry
            await asyncio.sleep(COMPLETE_RETRY_PAUSES[0])
        await self._offer(
            task,
            "result",
            lambda: store.complete_activity(
                task,
                result,
                lease_to=self._lease_to(),
                lease_queues=self.queues,
                lease=self.lease,
                read_after=self._cached_through(task.run_id),
            ),
            tries=1 if fast is None else 0,
            since=since,
        )

    def _lease_left(self, task: Task) -> float:
        """Seconds this worker may still offer ``task``'s outcome: until a margin before
        its lease on the task ends, counted from when the lease was last known to start
        (the task reached this worker, or a renewal sent then succeeded; for a step
        with a heartbeat timeout, which renewals do not extend, a heartbeat)."""
        since = self._leased_at.get(task.task_id)
        if since is None:
            return 0.0
        entry = self._inflight.get(task.task_id)
        if entry is not None and entry[0] is task and entry[2] is not None:
            since = max(since, entry[2]._beat_at)
        return since + self._lease_span(task) - time.monotonic()

    def _lease_span(self, task: Task | None = None) -> float:
        """The lease less its safety margin: how long an outcome may be offered (the
        heartbeat timeout of a ``task`` that has one: only heartbeats extend it)."""
        hb = _beats_only(task) if task is not None else None
        lease = hb or self.lease
        margin = min(max(lease * LEASE_MARGIN, LEASE_MARGIN_MIN), lease / 2)
        return lease - margin

    async def _offer(
        self,
        task: Task,
        what: str,
        op: Callable[[], Awaitable[Task | None]],
        tries: int = 0,
        since: float | None = None,
    ) -> None:
        """Record an activity's outcome (``what``: its result or failure) with ``op``.

        A commit the store fails to record (a dropped connection, a restarting server)
        is offered again: at once after short pauses, then every COMPLETE_RETRY_MAX_PAUSE
        seconds while this worker's lease on the step lasts (renewals fail too in an
        outage; see _lease_left), so an outage shorter than the lease does not run the
        step (a paid call) again. The fence makes a repeated offer safe: refused, it
        says the lost one had landed. Past the lease the step is given back to run again.
        ``tries``: offers already made (the one-commit path's lost one); ``since``: the
        store's time when the first began."""
        store = self.app.store
        began = time.monotonic()
        if since is None:
            since = store.clock()
        while True:
            try:
                wt = await op()
            except LeaseLostError:
                if tries:  # the fence refused a retry: most likely the first had landed
                    log.info(
                        "%s of step %s of run %r: a retry was refused, so the commit lost "
                        "with the store's connection had been recorded (or the task's "
                        "lease had passed)",
                        what,
                        task.step,
                        task.run_id,
                        extra={"run_id": task.run_id},
                    )
                    # the lost commit may have leased the run's next tasks to this
                    # worker, which knows nothing of them: give them back now
                    await self._give_back_unknown(task, since)
                else:
                    self._lease_lost()
                    await self._discarded(task, what)
                return
            except StoreError as exc:
                if tries < len(COMPLETE_RETRY_PAUSES):
                    pause: float | None = COMPLETE_RETRY_PAUSES[tries]
                else:
                    # renewals that still succeed do not stretch it past one lease: a
                    # store that takes them but keeps refusing this commit is not waited
                    # on forever
                    left = min(
                        self._lease_left(task),
                        began + self._lease_span(task) - time.monotonic(),
                    )
                    pause = min(COMPLETE_RETRY_MAX_PAUSE, left) if left > 0 else None
                    if pause is not None and tries == len(COMPLETE_RETRY_PAUSES):
                        log.warning(
                            "could not record the %s of step %s of run %r: it is offered "
                            "again for up to %.1f s more, while this worker's lease on "
                            "the step lasts: %s",
                            what,
                            task.step,
                            task.run_id,
                            left,
                            exc,
                            extra={"run_id": task.run_id},
                        )
                if pause is not None:  # a completion is fenced: offering it again is safe
                    await asyncio.sleep(pause)
                    tries += 1
                    continue
                log.warning(
                    "could not record the %s of step %s of run %r (%d attempts in %.1f s), "
                    "so the step is given back and runs again: %s",
                    what,
                    task.step,
                    task.run_id,
                    tries + 1,
                    time.monotonic() - began,
                    exc,
                    extra={"run_id": task.run_id},
                )
                try:
                    held = await store.release([task])
                except StoreError:  # its lease runs out instead
                    return
                if held == 0:  # the task is gone or moved on: a lost offer had landed
                    await self._give_back_unknown(task, since)
                return
            if wt is not None:
                self._spawn(wt)
            return

    async def _give_back_unknown(self, task: Task, since: float) -> None:
        """A commit for ``task``, first offered at ``since`` (store clock), failed with its
        outcome unknown (the store's connection broke at ``COMMIT``): if it landed, it
        leased the run's next tasks to this worker, which does not know them, so they
        would wait out their lease. Make claimable now this worker's leases on the run
        that such a commit could have made (created leased from ``since`` on, never
        claimed since), but for the tasks it is running or about to run (``task``
        among them). Claiming bumps the fence, so nothing runs twice at once. If the
        store still fails, the leases run out as before. Nothing is given back while
        another process holds this worker's id: what the id holds may be its."""
        if self._id_taken:
            return
        run_id = task.run_id
        keep = sorted(
            {
                task.task_id,
                *(i for i, (t, _, _) in self._inflight.items() if t.run_id == run_id),
                *(t.task_id for t in self._follow.values() if t.run_id == run_id),
            }
        )
        try:
            n = await self.app.store.give_back(self.id, run_id, keep, since=since)
        except StoreError as exc:
            log.warning(
                "could not give back the tasks of run %r that a lost commit may have leased "
                "to this worker (they are claimable when their lease ends): %s",
                task.run_id,
                exc,
                extra={"run_id": task.run_id},
            )
            return
        if n:
            log.info(
                "gave back %d task(s) of run %r that a lost commit had leased to this worker",
                n,
                task.run_id,
                extra={"run_id": task.run_id},
            )

    def _lease_lost(self, attempt: bool = True) -> None:
        """A result (or failure) this worker offered was refused: its lease had passed.
        ``attempt``: an activity attempt's, marked on its span when it has one."""
        self.stats["lease_lost"] += 1
        count("tether_lease_lost")
        if attempt:
            mark_lease_lost()

    async def _discarded(self, task: Task, what: str) -> None:
        """Warn when an activity's result was refused because its run had ended (a
        cancel, the deadline): the step's effect happened and no history shows it, so
        an operator may have to undo it by hand. A failure refused so (most often the
        activity stopping as it was told: a ``first`` loser, a cancelled run) is noted
        at INFO: nothing says its effect happened."""
        try:
            info = await self.app.store.get_run(task.run_id, lenient=True)
        except StoreError:
            return
        if info is None or not info.status.is_terminal:
            return  # its lease had passed: the step runs again elsewhere
        log.log(
            logging.WARNING if what == "result" else logging.INFO,
            "the %s of activity %r (step %s, attempt %s) of run %r was discarded: the run "
            "had already ended %s, so nothing records that this step ran",
            what,
            task.name,
            task.step,
            task.attempt,
            task.run_id,
            info.status.value,
            extra={"run_id": task.run_id},
        )

    def _switched_off(self, inst: WorkflowInstance) -> bool:
        """Whether a kill switch stops ``inst``'s run: its workflow or tenant is off."""
        started = inst.started
        if started is None:  # its tenant unknown here: the ordinary path reads it
            return True
        return self._switches.stops_run(inst.workflow.name, started.data.get("tenant"))

    async def _complete_fast(
        self, task: Task, result: str, value: Any = _UNSET, inline: bool = False
    ) -> bool | None:
        """The one-commit path: record the result and the workflow task it unblocks together.

        Possible when this worker holds the run in its cache and serves its queue:
        the instance is advanced with the result first, then one transaction records
        both. Returns False when the fast path does not apply (nothing was written),
        None when the store failed to say whether its commit landed (offer the result
        again on the ordinary path: the fence refuses it if it had).
        """
        store = self.app.store
        fast_op = getattr(store, "complete_activity_fast", None)
        inst = self._cache.get(task.run_id)
        if (
            fast_op is None
            or inst is None
            or inst.finished
            or self._stopping
            or self._id_taken
            or task.step is None
            or inst.workflow.queue not in self.queues
            or not inst.only_waiting_on(task.step)
            or (self._switches and self._switched_off(inst))
        ):
            # with other steps in flight, results race each other and a lost race
            # would cost a full replay: take the ordinary path. So too when the run's
            # workflow or tenant is switched off: that path holds the workflow task
            return False
        del self._cache[task.run_id]  # ours alone while we speculate
        expected = inst.last_seq + 1
        now = store.clock()
        event = Event(
            run_id=task.run_id,
            seq=expected,
            type=EventType.ACTIVITY_COMPLETED,
            step=task.step,
            data={"attempt": task.attempt, "result": _as_recorded(value, result)},
            created_at=now,
        )
        try:
            wf_result = inst.advance([event], now)
        except Exception:
            inst.close()
            return False  # let the ordinary path (and a full replay) deal with it
        try:
            fast, marker, leased, slow_task = await fast_op(
                task,
                result,
                wf_result,
                expected,
                lease_to=self.id,
                lease_queues=self.queues,
                lease=self.lease,
                lease_limit=self.free_slots(),
            )
        except LeaseLostError:
            inst.close()
            self._lease_lost()
            await self._discarded(task, "result")
            return True
        except StoreError as exc:
            inst.close()
            log.warning(
                "could not record the result of step %s of run %r, so it is offered again: %s",
                task.step,
                task.run_id,
                exc,
                extra={"run_id": task.run_id},
            )
            return None
        if not fast:
            inst.close()  # something else happened to the run: replay from the store
            if slow_task is not None:
                self._spawn(slow_task)
            return True
        self.stats["fast_path"] += 1
        self.stats["workflow_tasks"] += 1
        inst.committed(marker)
        self._committed(task.run_id, inst, wf_result, None, False)
        if inst.finished or (
            not self.cache_waiting and not inst.hot and inst.waits_only_on_time_or_events()
        ):
            inst.close()
        else:
            self._cache[task.run_id] = inst
        for t in leased:
            if inline and t.kind == "activity" and task.task_id not in self._follow:
                self._follow[task.task_id] = t  # the caller runs it next, in its own task
            else:
                self._spawn(t)
        return True

    async def _record_failure(
        self,
        task: Task,
        exc: BaseException,
        plan: _Plan,
        ctx: ActivityContext | None,
        began: float | None = None,
    ) -> None:
        """Record a failed attempt (a retry or the step's end). ``began`` is when the
        attempt's call began (perf_counter) when ``ctx`` cannot say: a batch's items."""
        store = self.app.store
        now = store.clock()
        error, retry_at = plan.decide(task.attempt, exc, now, ctx is not None and ctx.is_cancelled)
        self.stats["activity_failures"] += 1
        error_type = type(exc).__name__
        mark_failed(error_type, retry_at is not None)
        name = task.name or ""
        if ctx is not None and ctx._began:
            began = ctx._began
        if began:
            outcome = "retry" if retry_at is not None else "failed"
            observe("tether_activity_duration", (name, outcome), time.perf_counter() - began)
        if isinstance(exc, TimeoutError):
            count("tether_activity_timeouts", (name,))
        elif http_status(exc) == 429:
            count("tether_rate_limited", (name,))
        if retry_at is not None:
            count("tether_activity_retries", (name, error_type))
        else:
            count("tether_activity_failures", (name, error_type))
        breaker = (task.options or {}).get("breaker")
        # only transient failures say the dependency is unhealthy; a 400 does not
        if (
            breaker
            and not isinstance(exc, CircuitOpenError | asyncio.CancelledError)
            and classify(exc, plan.retry.non_retryable, now).retryable
        ):
            await self._breaker_record(breaker, False)
        await self._offer(
            task,
            "failure",
            lambda: store.fail_activity(
                task,
                error,
                retry_at,
                lease_to=self._lease_to(),
                lease_queues=self.queues,
                lease=self.lease,
                read_after=self._cached_through(task.run_id),
            ),
        )

    def _cached_through(self, run_id: str) -> int | None:
        inst = self._cache.get(run_id)
        return None if inst is None else inst.through

    async def _breaker_record(self, cfg: dict[str, Any], ok: bool) -> None:
        try:
            if await self.app.store.breaker_record(cfg, ok):
                count("tether_breaker_opens", (str(cfg.get("name")),))
        except StoreError as exc:
            log.warning("could not update circuit breaker %r: %s", cfg.get("name"), exc)

    # -- timers --------------------------------------------------------------

    async def _fire_timer(self, task: Task) -> None:
        try:
            await self.app.store.fire_timer(task)
        except LeaseLostError:
            pass


def _as_recorded(value: Any, encoded: str) -> Any:
    """The result as replay will decode it from ``encoded``: ``value`` itself when it is
    a plain JSON scalar (the same value), a ``JsonDict``'s items (JSON values already),
    else the decoded text."""
    kind = type(value)
    if kind is int or kind is str or kind is bool or value is None:
        return value
    if isinstance(value, JsonDict):
        return dict(value)
    if kind is float and math.isfinite(value):
        return value
    return json.loads(encoded)


def _held_nothing() -> None:
    """No worker id is held."""
