"""``App``: the registry of workflows and activities, and the client for runs."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import contextvars
import dataclasses
import datetime as _dt
import inspect
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from datetime import timedelta
from typing import Any, Generic, ParamSpec, TypeVar, overload

from ._activity_context import ActivityContext, set_context
from ._alert_rules import AlertRules
from ._batch import BatchActivity, BatchDecorator
from ._batching import Batch
from ._breaker import CircuitBreaker
from ._codec import OFFLOAD_ABOVE, Codec
from ._definitions import (
    CHAIN_SEPARATOR,
    Activity,
    ActivityOptions,
    Workflow,
    chain_of,
    check_run_id,
    check_signal_id,
    check_signal_name,
    dot_parts,
    dot_parts_error,
)
from ._entities import PREFIX as ENTITY_PREFIX
from ._entities import EntityRef, entity_workflow, list_entities
from ._entities import operations as entity_operations
from ._errors import (
    NOT_RUN_YET,
    ApprovalEditError,
    ApprovalError,
    ApprovalNotFoundError,
    ConfigurationError,
    PayloadError,
    QueryError,
    ResultTimeoutError,
    RunCancelledError,
    RunFinishedError,
    RunNeedsInterventionError,
    RunNotFoundError,
    RunPurgedError,
    RunTerminatedError,
    RunTimedOutError,
    ScheduleNotFoundError,
    SignalIdConflictError,
    StoreError,
    UnknownActivityError,
    UnknownWorkflowError,
    UpdateRejectedError,
    WorkflowFailedError,
)
from ._history import (
    INT64_MAX,
    UPDATE_SIGNAL,
    Approval,
    DeadLetter,
    Event,
    EventType,
    RunEnd,
    RunInfo,
    RunStatus,
)
from ._paging import check_cursor, check_limit, check_offset, check_time
from ._policy import DEFAULT_RETRY, Retry, seconds
from ._queues import Dependency, QueueLimits, QueueStats, check_name
from ._redact import redact_error
from ._schedules import ScheduleInfo, check_schedule_id, make_spec
from ._serde import convert, decode_raw, encode, json_equal
from ._telemetry import count
from ._tracing import available as tracing_available
from ._tracing import start_carrier
from ._update_wait import UpdateOutcomes
from ._usage import Budget, Usage, usage_of
from ._worker import Worker
from .blobs import SEALED as SEALED_BLOB
from .blobs import SHARED_ROOT, Blob, BlobError, BlobStore, default_root
from .encryption import Keyring, KeyUnavailableError
from .store._open import open_store
from .store.base import WAITING_KINDS, Finished, Store, start_event_data
from .store.ops import recovery as _recovery
from .store.ops.admission import _configure_admission
from .store.ops.queues import _configure_queue
from .store.ops.recovery import RecoveryError, _NotRetried
from .store.ops.switches import SWITCH_KINDS
from .webhooks import check_webhook_url
from .workflow import _approval
from .workflow._instance import WorkflowInstance

log = logging.getLogger("tether")
_seconds = seconds  # pause_queue has a parameter named ``seconds``

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
C = TypeVar("C", bound=type)

#: seconds a blob put again is spared by purge: an attempt that put it (blobs are shared
#: by content) may still be working before the commit that refers to it. The same as
#: gc_blobs' default grace; gc collects what purge spared once nothing refers to it.
PURGE_BLOB_GRACE = 3600.0
#: seconds ``erase_tenant`` waits beyond the keyring's ``seen_within`` after making the
#: tenant a fresh key, for writes sealed under its old key just before to be committed
#: (and so erased with the rest)
KEY_SETTLE = 0.5
#: seconds ``App.close`` waits for alert hooks still running before it abandons them
ALERT_CLOSE_WAIT = 10.0


class Run(Generic[R]):
    """A handle on one run: await its result, read its state, signal or cancel it."""

    def __init__(self, app: App, run_id: str, workflow: Workflow[Any, R] | None) -> None:
        self.app = app
        self.run_id = run_id
        self.workflow = workflow
        self._may_not_exist = False  #: a debounced start: the run appears when it is due
        #: from ``app.start``: the run as the start found or made it, and whether it made it
        self.started: RunInfo | None = None
        self.created: bool | None = None

    def __repr__(self) -> str:
        return f"<Run {self.run_id}>"

    async def _chain_head(self, run_id: str) -> str:
        """The latest run of the chain ``run_id`` belongs to (one read, whatever the
        chain's length), or ``run_id`` itself when that read fails: waited for next."""
        try:
            head = await self.app.store.get_run(run_id, follow=True, lenient=True)
        except StoreError:  # an outage: waiting on the next link waits it out
            return run_id
        return run_id if head is None else head.run_id

    async def info(self) -> RunInfo:
        """The run's current state."""
        return await self.app.get(self.run_id)

    async def result(self, timeout: float | timedelta | None = None) -> R:
        """Wait for the run to finish and return its result (decoded to the return type).

        Follows continue-as-new to the final run. Raises ``WorkflowFailedError``
        (or its ``RunCancelledError``/``RunTerminatedError`` subclasses) when the
        run did not complete, and ``ResultTimeoutError`` if ``timeout`` passes first.
        """
        limit = seconds(timeout, "timeout")
        loop = asyncio.get_running_loop()
        deadline = None if limit is None else loop.time() + limit
        run_id = self.run_id
        while True:
            info = await self.app._wait_finished(run_id, deadline, self._may_not_exist)
            if info.status is RunStatus.CONTINUED_AS_NEW and info.continued_to:
                run_id = await self._chain_head(info.continued_to)
                continue
            break
        if info.status is RunStatus.COMPLETED:
            wf = self.workflow or self.app._workflows.get(info.workflow)
            if wf is None:
                from ._serde import decode_raw

                value: R = decode_raw(info.output)
                return value
            decoded: R = wf.sig.decode_result(info.output)
            return decoded
        err = info.error or {}
        msg = f"{err.get('type', 'Error')}: {err.get('message', '')}" if err else None
        if info.status is RunStatus.CANCELLED:
            raise RunCancelledError(run_id, info.status.value, msg or "cancelled")
        if info.status is RunStatus.TERMINATED:
            raise RunTerminatedError(run_id, info.status.value, msg)
        if info.status is RunStatus.TIMED_OUT:
            raise RunTimedOutError(run_id, info.status.value, msg)
        if info.status is RunStatus.NEEDS_INTERVENTION:
            raise RunNeedsInterventionError(run_id, info.status.value, msg)
        raise WorkflowFailedError(run_id, info.status.value, msg)

    async def signal(self, name: str, payload: Any = None, *, signal_id: str | None = None) -> bool:
        """Send the signal ``name`` to this run (``App.signal``)."""
        return await self.app.signal(self.run_id, name, payload, signal_id=signal_id)

    async def cancel(self, reason: str | None = None) -> None:
        """Ask this run to cancel."""
        await self.app.cancel(self.run_id, reason)


class App:
    """Workflows, activities and the store they run on.

    ``App()`` stores runs in ``./tether.db``; ``App(store="sqlite:///path.db")``
    picks a file, ``App(store=":memory:")`` keeps everything in memory (tests).
    The store is opened on first use.
    """

    def __init__(
        self,
        store: str | Store | None = None,
        *,
        queue: str = "default",
        on_alert: Callable[[str, dict[str, Any]], Any] | None = None,
        alert_rules: AlertRules | None = None,
        blobs: str | None = None,
        encryption: Keyring | None = None,
        offload_above: int | None = OFFLOAD_ABOVE,
    ) -> None:
        #: called as ``on_alert(subject, details)`` (sync: in a thread of its own; or
        #: async: as a task), never holding up work: when a run needs an operator
        #: (subject: its id; details: its error; told again by ``tether.alerts`` until
        #: the hook returns) and for the conditions of ``tether.alerts``
        #: (``details["alert"]`` names which)
        self.on_alert = on_alert
        #: thresholds of the alert watcher (``tether.alerts``; None: its defaults)
        self.alert_rules = alert_rules
        #: where large payloads go (``tether.blobs``): a directory or an fsspec URL;
        #: None: ``TETHER_BLOBS`` if set (so the CLI and ``tether serve`` find them
        #: too), else beside a SQLite file (``<file>.blobs``), else ``./tether-blobs``
        self._blobs_spec = blobs
        #: seals every payload the store keeps (``tether.encryption``); None: the keyring
        #: ``TETHER_KEYRING`` or ``TETHER_ENCRYPTION_KEYS`` names, if any
        self._keyring = encryption
        #: payloads larger than this many bytes go to the blob store, the history keeping
        #: a reference (``_codec``); None: always inline
        self._offload_above = offload_above
        self._store_spec = store
        self._store: Store | None = None
        self._store_lock = threading.Lock()
        self.default_queue = check_name(queue, "default queue of the App")
        self._workflows: dict[str, Workflow[Any, Any]] = {}
        #: callers waiting on update outcomes, one history reader per run
        self._updates = UpdateOutcomes(self)
        #: entity classes by name: their operations (``entity``)
        self._entities: dict[str, frozenset[str]] = {}
        #: what runs are pinned to at their start, by source (``tether.ai`` gateways)
        self._pin_sources: dict[str, Callable[[], dict[str, Any]]] = {}
        #: the versions of each prompt registered by a ``tether.ai`` gateway (fork checks)
        self._prompt_versions: dict[str, tuple[str, ...]] = {}
        self._activities: dict[str, Activity[Any, Any]] = {}
        self._waiters: dict[str, list[_Waiter]] = {}
        self._waiters_lock = threading.Lock()
        #: runs this process started and runs in an in-process worker, not yet seen ending:
        #: their end will be announced here, so ``result()`` need not read them first
        self._running_here: set[str] = set()
        #: alert hooks being told (``_alert``), with their subjects; and of them, those
        #: telling that a run needs an operator, by run id (the watcher leaves those be)
        self._alerts: dict[asyncio.Future[Any], str] = {}
        self._telling: dict[str, asyncio.Future[Any]] = {}
        #: runs whose operator this process failed to tell (the hook raised or was
        #: abandoned): the watcher tells them again without waiting its grace
        self._untold: set[str] = set()
        #: workers running in this process, which app.start may hand a new run to
        self._local_workers: list[Worker] = []
        #: starts other threads run on a worker's loop, not yet done (``_borrow_worker``)
        self._loans: dict[Worker, int] = {}
        self._loans_done: dict[Worker, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self._loans_lock = threading.Lock()
        self._queue_limits: dict[str, QueueLimits] = {}
        self._admission: dict[str, int | None] = {}  #: tenant ('' = default) -> max_running
        self._limits_dirty = False
        #: tenants whose key this process has seen made (``_tenant_key_ready``)
        self._keyed_tenants: set[str] = set()
        #: tenant -> the look for its key in flight (``_tenant_key_ready``)
        self._keying: dict[str, asyncio.Task[str]] = {}

    # -- store -------------------------------------------------------------

    @property
    def store(self) -> Store:
        """The store, opened on first use."""
        if self._store is None:
            with self._store_lock:
                if self._store is None:
                    store = open_store(self._store_spec, keyring=self._keyring)
                    named = self._blobs_spec or os.environ.get("TETHER_BLOBS")
                    path = getattr(store, "path", None)
                    blobs = BlobStore(named or default_root(path))
                    sealer = store.codec.sealer if store.codec is not None else None
                    blobs.sealer = sealer
                    blobs.shared = not named and path is None  # SHARED_ROOT
                    store.blobs = blobs
                    store.codec = Codec(sealer, blobs, self._offload_above)
                    store.add_listener(self._on_commit)
                    self._store = store
                    self._write_queue_limits_sync(store)
        return self._store

    def _write_queue_limits_sync(self, store: Store) -> None:
        """Write configured queue limits as the store opens (if it can run ops sync)."""
        call = getattr(store, "call_sync", None)
        if not (self._queue_limits or self._admission) or call is None:
            return

        try:
            for name, limits in list(self._queue_limits.items()):
                call(_configure_queue, name, limits.to_json())
            for tenant, cap in list(self._admission.items()):
                call(_configure_admission, tenant, cap)
            self._limits_dirty = False
        except Exception as exc:  # retried by the next start, worker or queue call
            log.warning("could not write queue limits on opening the store: %s", exc)

    async def _tenant_key_ready(self, tenant: str) -> None:
        """Have the tenant's key made before its run is stored (per-tenant keys): made in
        the store's write transaction instead, the keyring file's write and fsync would
        hold every other write of the process (tens of ms a new tenant). Once a key is
        seen, later starts of the tenant skip this; a key shredded since is made again
        where it is needed, as before."""
        codec = self.store.codec
        if codec is None or not codec.per_tenant or tenant in self._keyed_tenants:
            return
        sealer = codec.sealer
        if sealer is None:
            return
        # starts of one tenant at once share one look (a burst of a new tenant's starts
        # would each take a thread for the same key)
        loop = asyncio.get_running_loop()
        pending = self._keying.get(tenant)
        if pending is None or pending.get_loop() is not loop:
            pending = self._keying[tenant] = loop.create_task(
                asyncio.to_thread(sealer.keyring.current, tenant)
            )
            pending.add_done_callback(lambda done: self._forget_keying(tenant, done))
        await asyncio.shield(pending)
        if len(self._keyed_tenants) > 100_000:
            self._keyed_tenants.clear()
        self._keyed_tenants.add(tenant)

    def _forget_keying(self, tenant: str, done: asyncio.Task[str]) -> None:
        with contextlib.suppress(KeyError):  # (another loop's start may have replaced it)
            if self._keying[tenant] is done:
                del self._keying[tenant]
        if not done.cancelled():
            done.exception()  # seen (each start awaiting it raises it)

    async def _write_queue_limits(self, *, force: bool = False) -> None:
        """Write configured queue limits to the store (all of them when ``force``)."""
        if not (force or self._limits_dirty) or not (self._queue_limits or self._admission):
            return
        self._limits_dirty = False
        try:
            for name, limits in list(self._queue_limits.items()):
                await self.store.configure_queue(name, limits.to_json())
            for tenant, cap in list(self._admission.items()):
                await self.store.configure_admission(tenant, cap)
        except BaseException:
            self._limits_dirty = True
            raise

    def _on_commit(self, ready: set[str], finished: Finished) -> None:
        if not finished:
            return
        hits: list[_Waiter] = []
        with self._waiters_lock:
            for rid, end in finished.items():
                if end is not None:  # ended by a commit of this process: counted here
                    labels = (end.workflow, end.status.value)
                    count("tether_runs_ended", labels)
                    if end.status in _DEAD_LETTERED:
                        count("tether_runs_dead_lettered", labels)
                self._running_here.discard(rid)
                for w in self._waiters.get(rid, ()):
                    w.end = end  # None: read the run (another process ended it, or a retry)
                    hits.append(w)
        for w in hits:
            if not w.loop.is_closed():
                w.loop.call_soon_threadsafe(w.event.set)

    async def close(self) -> None:
        """Close the store (waits for pending writes), after the alert hooks still
        running (up to ``ALERT_CLOSE_WAIT`` seconds: those still running then are
        cancelled and logged; a run they were telling about is told again by an
        ``AlertWatcher``)."""
        await self._settle_alerts(ALERT_CLOSE_WAIT)
        if self._store is not None:
            await self._store.close()
            self._store = None

    # -- registration --------------------------------------------------------

    @overload
    def workflow(self, fn: Callable[P, Awaitable[R]], /) -> Workflow[P, R]: ...

    @overload
    def workflow(
        self,
        *,
        name: str | None = None,
        queue: str | None = None,
        version: str | None = None,
        retention: float | timedelta | None = None,
    ) -> Callable[[Callable[P, Awaitable[R]]], Workflow[P, R]]: ...

    def workflow(  # type: ignore[misc]
        self,
        fn: Callable[P, Awaitable[R]] | None = None,
        /,
        *,
        name: str | None = None,
        queue: str | None = None,
        version: str | None = None,
        retention: float | timedelta | None = None,
    ) -> Workflow[P, R] | Callable[[Callable[P, Awaitable[R]]], Workflow[P, R]]:
        """Register an ``async def`` as a durable workflow (bare or with options).

        ``retention``: how long an ended run of it is kept; workers purge older ones in
        the background (``Worker(retention_every=)``), as ``app.purge`` would."""
        keep = seconds(retention, "retention")
        if keep is not None and keep <= 0:
            raise ConfigurationError(f"retention must be a duration > 0 (got {retention!r})")

        if name is not None:
            check_name(name, "workflow name")

        def wrap(f: Callable[P, Awaitable[R]]) -> Workflow[P, R]:
            wname = name or f.__name__
            if queue is not None:
                check_name(queue, f"queue of workflow {wname!r}")
            if wname in self._workflows and self._workflows[wname].fn is not f:
                raise ConfigurationError(f"a workflow named {wname!r} is already registered")
            wf = Workflow(
                f, name=wname, queue=queue or self.default_queue, version=version, retention=keep
            )
            self._workflows[wname] = wf
            return wf

        return wrap(fn) if fn is not None else wrap

    @overload
    def activity(self, fn: Callable[P, Awaitable[R]], /) -> Activity[P, R]: ...

    @overload
    def activity(self, fn: Callable[P, R], /) -> Activity[P, R]: ...

    @overload
    def activity(
        self,
        *,
        name: str | None = None,
        retry: Retry | None = None,
        timeout: float | timedelta | None = None,
        schedule_timeout: float | timedelta | None = None,
        heartbeat_timeout: float | timedelta | None = None,
        queue: str | None = None,
        breaker: CircuitBreaker | None = None,
        priority: int | None = None,
        limit_key: Callable[..., str] | None = None,
        dependency: Dependency | None = None,
        batch: None = None,
    ) -> Callable[[Callable[P, Any]], Activity[P, Any]]: ...

    @overload
    def activity(
        self,
        *,
        batch: Batch,
        name: str | None = None,
        retry: Retry | None = None,
        timeout: float | timedelta | None = None,
        schedule_timeout: float | timedelta | None = None,
        heartbeat_timeout: float | timedelta | None = None,
        queue: str | None = None,
        breaker: CircuitBreaker | None = None,
    ) -> BatchDecorator: ...

    def activity(  # type: ignore[misc]
        self,
        fn: Callable[P, Any] | None = None,
        /,
        *,
        name: str | None = None,
        retry: Retry | None = None,
        timeout: float | timedelta | None = None,
        schedule_timeout: float | timedelta | None = None,
        heartbeat_timeout: float | timedelta | None = None,
        queue: str | None = None,
        breaker: CircuitBreaker | None = None,
        priority: int | None = None,
        limit_key: Callable[..., str] | None = None,
        dependency: Dependency | None = None,
        batch: Batch | None = None,
    ) -> Activity[P, Any] | Callable[[Callable[P, Any]], Activity[P, Any]] | BatchDecorator:
        """Register a sync or async function as an activity: a recorded, retried step.

        Options are checked here, so a nonsensical policy fails at import time.
        ``priority`` (higher first) orders work within its queue; ``limit_key``
        (a function of the call's arguments returning a string, e.g. a tenant) is
        what the queue's ``key_concurrency`` and ``fair`` apply to. ``dependency`` (a
        ``tether.Dependency``) puts the step under that dependency's shared limiter.
        ``batch`` (a ``tether.Batch``) makes the function take a list of items and
        return a list of results, while workflows call it with one item each.
        """
        if batch is not None and not isinstance(batch, Batch):
            raise ConfigurationError(
                f"batch= of activity {name or getattr(fn, '__name__', '')!r} takes a "
                f"tether.Batch, got {type(batch).__name__}"
            )
        base = ActivityOptions(retry=DEFAULT_RETRY, queue=self.default_queue)
        if name is not None:
            check_name(name, "activity name")

        def wrap(f: Callable[P, Any]) -> Activity[P, Any]:
            aname = name or f.__name__
            if aname in self._activities and self._activities[aname].__wrapped__ is not f:
                raise ConfigurationError(f"an activity named {aname!r} is already registered")
            opts = base.replace(
                what=f"activity {aname!r}",
                retry=retry,
                timeout=timeout,
                schedule_timeout=schedule_timeout,
                heartbeat_timeout=heartbeat_timeout,
                queue=queue,
                breaker=breaker,
                priority=priority,
                limit_key=limit_key,
                dependency=dependency,
            )
            act: Activity[P, Any]
            if batch is not None:
                opts = dataclasses.replace(opts, batch=batch)
                act = BatchActivity(f, name=aname, options=opts)  # type: ignore[arg-type,assignment]
            else:
                act = Activity(f, name=aname, options=opts)
            self._activities[aname] = act
            return act

        return wrap(fn) if fn is not None else wrap

    def workflows(self) -> builtins.list[Workflow[Any, Any]]:
        """Every workflow registered on this App."""
        return list(self._workflows.values())

    def get_workflow(self, name: str) -> Workflow[Any, Any]:
        """The workflow registered as ``name``."""
        try:
            return self._workflows[name]
        except KeyError:
            raise UnknownWorkflowError(name, list(self._workflows)) from None

    def _workflow_of(self, workflow: Any) -> Workflow[Any, Any]:
        """``workflow`` as given to ``start`` (a Workflow, or its registered name); a plain
        function (``@app.workflow`` forgotten) or anything else is refused by name."""
        if isinstance(workflow, str):
            return self.get_workflow(workflow)
        if isinstance(workflow, Workflow):
            return workflow
        name = getattr(workflow, "__qualname__", None) or type(workflow).__name__
        raise ConfigurationError(
            f"{name!r} is not a workflow of this App: decorate it with @app.workflow (or "
            "pass the name it is registered under)"
        )

    def get_activity(self, name: str) -> Activity[Any, Any]:
        """The activity registered as ``name``."""
        try:
            return self._activities[name]
        except KeyError:
            raise UnknownActivityError(
                f"no activity named {name!r} is registered with this App; the worker "
                "serving this queue must import the module that defines it"
            ) from None

    def queues(self) -> list[str]:
        """Every queue a registered workflow or activity uses."""
        qs = {self.default_queue}
        qs.update(w.queue for w in self._workflows.values())
        qs.update(a.opts.queue for a in self._activities.values())
        return sorted(qs)

    # -- queues ------------------------------------------------------------------

    def configure_queue(
        self,
        name: str,
        *,
        max_concurrency: int | None = None,
        rate: float | None = None,
        per: float | timedelta = 1.0,
        burst: float | None = None,
        key_concurrency: int | None = None,
        fair: bool = False,
        pause_on_429: bool = True,
    ) -> None:
        """Limit how the activities of queue ``name`` are claimed, by every worker.

        ``max_concurrency`` caps activities running at once; ``rate`` per ``per``
        seconds is a token bucket of ``burst`` tokens (default: one second's worth,
        at least 1); ``key_concurrency`` caps running activities per ``limit_key``;
        ``fair`` interleaves limit keys so a small tenant is not stuck behind a large
        one; ``pause_on_429`` pauses the whole queue for a Retry-After of an HTTP 429.
        The limits are kept in the store (written when it opens and when a worker
        starts), so they hold across processes. Validated here.
        """
        limits = QueueLimits.build(
            name,
            max_concurrency=max_concurrency,
            rate=rate,
            per=per,
            burst=burst,
            key_concurrency=key_concurrency,
            fair=fair,
            pause_on_429=pause_on_429,
        )
        self._queue_limits[name] = limits
        self._limits_dirty = True

    def configure_admission(self, tenant: str | None = None, *, max_running: int) -> None:
        """Limit runs in flight (not finished) per tenant, across every process.

        ``tenant=None`` sets the default for every tenant without a limit of its own.
        Applies to ``app.start(..., tenant=...)``: at the limit the start raises
        ``AdmissionLimitError`` or (``on_limit="queue"``) creates the run ``queued``,
        admitted first-in first-out when a run of that tenant finishes. Kept in the
        store, so every process shares it; raising a limit admits queued runs at once.
        """
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ConfigurationError(f"tenant must be a non-empty string (got {tenant!r})")
        what = "the default admission limit" if tenant is None else f"tenant {tenant!r}"
        if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
            raise ConfigurationError(
                f"max_running of {what} must be a positive integer (got {max_running!r})"
            )
        self._admission[tenant or ""] = max_running
        self._limits_dirty = True

    async def pause_queue(self, name: str, seconds: float | timedelta) -> None:
        """Stop every worker from claiming activities of queue ``name`` for ``seconds``."""
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"queue name must be a non-empty string (got {name!r})")
        s = _seconds(seconds, f"seconds of pause_queue({name!r})")
        if not s:
            raise ConfigurationError(f"seconds of pause_queue({name!r}) must be positive")
        await self._write_queue_limits()
        await self.store.pause_queue(name, self.store.clock() + s)

    async def resume_queue(self, name: str) -> None:
        """End a pause of queue ``name`` (set by ``pause_queue`` or an HTTP 429) now."""
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"queue name must be a non-empty string (got {name!r})")
        await self._write_queue_limits()
        await self.store.pause_queue(name, None)

    async def queue_stats(self) -> builtins.list[QueueStats]:
        """Per queue: ready depth, age of the oldest ready task, running work (per
        limit key), pause and rate-limit tokens, with the configured limits."""
        await self._write_queue_limits()
        return await self.store.queue_stats()

    # -- client ----------------------------------------------------------------

    async def start(
        self,
        workflow: Workflow[P, R] | str,
        *args: Any,
        run_id: str | None = None,
        kwargs: dict[str, Any] | None = None,
        deadline: float | timedelta | None = None,
        tenant: str | None = None,
        on_limit: str = "raise",
        budget: Budget | None = None,
        webhook: str | None = None,
        by: str | None = None,
        if_running: str | None = None,
        signal: tuple[str, Any] | None = None,
        signal_id: str | None = None,
        _trace: dict[str, str] | None = None,
    ) -> Run[R]:
        """Start a run and return its handle; durable when this returns.

        Idempotent by ``run_id``: starting again with the same workflow, input,
        ``deadline``, ``webhook`` and ``budget`` returns the existing run; any of them
        different raises ``RunIdConflictError`` (its ``fields`` name which).
        ``deadline`` (seconds or a timedelta from now) bounds the whole run: when it
        passes, the code sees CancelledError (so saga compensations run) and the run
        ends ``timed_out``. ``tenant`` puts the run under that tenant's admission
        limit (``configure_admission``): at the limit, ``on_limit="raise"`` raises
        ``AdmissionLimitError`` and creates nothing; ``on_limit="queue"`` creates the
        run ``queued``, started when one of the tenant's runs finishes (oldest first).
        ``budget`` bounds the tokens and cost of the run's model calls (``tether.ai``),
        recorded with the run so it replays as it was. ``webhook``: an http(s) URL that
        gets the run's outcome when it ends (queued in the commit that ends it, posted
        at least once and signed by ``tether serve``'s relay: see ``tether.webhooks``).
        With OpenTelemetry configured the run joins the current trace (``_tracing.py``).
        ``by`` names who starts it (an API key, a CLI user), kept with the run for
        ``audit``; children name their parent run without it.

        Singletons: with a ``run_id``, ``if_running`` says what a start does when that run
        exists: ``"return"`` it whatever its input, ``"reject"`` (``RunIdConflictError``),
        or ``"signal"``: signal-with-start, with ``signal=(name, payload)``: the signal
        goes to the existing run (its live run if it continued as new), or the run is
        created and gets the signal before its code first runs; one commit either way,
        so concurrent starts make one run and every signal arrives, in one order. By
        default a start with the same input returns the existing run and other input is
        a conflict. A run id names one run ever: a signal-with-start to a run that ended
        raises ``RunFinishedError``. ``signal_id`` gives the signal an id (see ``signal``):
        a retried signal-with-start with the same one signals once.
        """
        if if_running not in (None, "return", "reject", "signal"):
            raise ConfigurationError(
                f"if_running= must be 'return', 'reject' or 'signal' (got {if_running!r})"
            )
        if if_running == "signal" and signal is None:
            raise ConfigurationError("if_running='signal' needs signal=(name, payload)")
        if signal is not None and if_running not in (None, "signal"):
            raise ConfigurationError("signal= is a signal-with-start: if_running='signal'")
        if (if_running is not None or signal is not None) and run_id is None:
            raise ConfigurationError("if_running= and signal= need the run's id: run_id=")
        if signal_id is not None:
            if signal is None:
                raise ConfigurationError("signal_id= is the id of signal=: give both")
            check_signal_id(signal_id)
        signal_wire = None
        if signal is not None:
            if not (isinstance(signal, tuple) and len(signal) == 2 and isinstance(signal[0], str)):
                raise ConfigurationError("signal= takes a (name, payload) tuple")
            signal_wire = (signal[0], encode(signal[1], f"payload of signal {signal[0]!r}"))
        if_exists = "same_input" if if_running in (None, "signal") else if_running
        if budget is not None and not isinstance(budget, Budget):
            raise ConfigurationError(
                f"budget= takes a tether.Budget(tokens=..., cost=...), got {type(budget).__name__}"
            )
        attrs: dict[str, Any] | None = None
        if budget is not None:
            attrs = {"budget": budget.to_json()}
        if self._pin_sources:
            pins = {name: source() for name, source in self._pin_sources.items()}
            attrs = {**(attrs or {}), "pins": pins}
        if webhook is not None:
            attrs = {**(attrs or {}), "webhook": check_webhook_url(webhook)}
        if by is not None:
            attrs = {**(attrs or {}), "started_by": str(by)[:200]}
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ConfigurationError(f"tenant must be a non-empty string (got {tenant!r})")
        if on_limit not in ("raise", "queue"):
            raise ConfigurationError(f'on_limit must be "raise" or "queue" (got {on_limit!r})')
        if run_id is not None:
            check_run_id(run_id)
        limit = seconds(deadline, "deadline")
        if deadline is not None and not limit:
            raise ConfigurationError("deadline must be positive")
        if limit is not None:  # as asked (a repeated start must ask for the same)
            attrs = {**(attrs or {}), "deadline": limit}
        wf = self._workflow_of(workflow)
        if wf.name not in self._workflows:
            raise UnknownWorkflowError(wf.name, list(self._workflows))
        rid = run_id or uuid.uuid4().hex
        carrier = _trace
        if carrier is None and tracing_available():
            carrier = start_carrier(wf.name, rid) or {}
        if carrier:
            attrs = {**(attrs or {}), "trace": carrier}
        loan = self._borrow_worker(wf.queue)
        if loan is not None:
            # an in-process worker serves this queue on another loop (a web server's
            # thread, a sync client's caller): start there, so the run is stored with its
            # first step in one commit. The worker does not stop before the start is done
            # (``_loans_repaid``), so its loop cannot close with the start pending.
            lender, loop = loan

            async def lent() -> Run[R]:
                try:
                    return await self.start(
                        workflow,
                        *args,
                        run_id=rid,
                        kwargs=kwargs,
                        deadline=deadline,
                        tenant=tenant,
                        on_limit=on_limit,
                        budget=budget,
                        webhook=webhook,
                        by=by,
                        if_running=if_running,
                        signal=signal,
                        signal_id=signal_id,
                        _trace=carrier or {},  # this thread's trace context, not that loop's
                    )
                finally:
                    self._repay(lender)

            coro = lent()
            try:
                started = asyncio.run_coroutine_threadsafe(coro, loop)
            except RuntimeError:  # its loop closed (a worker torn down without stop())
                coro.close()  # never ran: start here instead
                self._repay(lender)
            else:
                try:
                    return await asyncio.wrap_future(started)
                except asyncio.CancelledError:
                    me = asyncio.current_task()
                    if not started.cancelled() or (me is not None and me.cancelling()):
                        raise  # this caller was cancelled
                    raise StoreError(
                        f"the start of run {rid!r} was handed to an in-process worker whose "
                        "event loop stopped before it finished: the run may or may not "
                        "exist; start it again with the same run_id (starts are idempotent)"
                    ) from None
        kw = kwargs or {}
        text = wf.sig.encode_args(args, kw)
        wf.sig.decode_args(text)  # wrong argument types fail here, not in the worker
        if self._limits_dirty:
            await self._write_queue_limits()
        if tenant is not None:
            await self._tenant_key_ready(tenant)
        local = self._local_worker(wf.queue)
        now = self.store.clock()
        deadline_at = None if limit is None else now + limit
        eager = None
        if local is not None and signal is None:
            # an in-process worker runs the first workflow task now, so the run and
            # that task's commands are stored in one commit (no claim, no second commit)
            data = start_event_data(wf.name, deadline_at, tenant, attrs=attrs)
            eager = local.eager_start(wf, rid, text, data, now)
        try:
            res = await self.store.create_run(
                run_id=rid,
                workflow=wf.name,
                queue=wf.queue,
                input=text,
                deadline_at=deadline_at,
                tenant=tenant,
                on_limit=on_limit,
                lease_to=local.id if local is not None else None,
                lease_queues=local.queues if local is not None else (),
                lease=local.lease if local is not None else 30.0,
                first=eager[1] if eager is not None else None,
                lease_limit=local.free_slots() if local is not None else 0,
                attrs=attrs,
                if_exists=if_exists,
                signal=signal_wire,
                signal_id=signal_id,
            )
        except BaseException:
            if eager is not None:
                eager[0].close()
            raise
        if local is not None:
            if eager is not None:
                if res.first_marker is not None and not res.run.is_finished:
                    self._note_running_here(res.run.run_id)
                local.adopt_start(eager, res)
            elif res.leased is not None:
                local._spawn(res.leased)  # no claim round trip for a run started in-process
        if (
            signal_id is not None
            and signal_wire is not None
            and res.signalled is not None
            and not res.signal_new
        ):  # a retry of a signal-with-start: the same signal, or a conflict
            await self._id_kind(
                *res.signalled,
                signal_id,
                f"signal {signal_wire[0]!r}",
                update=False,
                name=signal_wire[0],
                value=json.loads(signal_wire[1]),
            )
        if res.created:
            count("tether_runs_started", (wf.name,))
        run = Run(self, res.run.run_id, wf)
        run.started, run.created = res.run, res.created
        return run

    def _note_running_here(self, run_id: str) -> None:
        """Remember a run whose end this process's commits will announce."""
        with self._waiters_lock:
            if len(self._running_here) >= _MAX_RUNNING_HERE:
                # a hint only: runs ended by another process on SQLite are never announced
                # here, so the set is bounded by forgetting (their result() reads first)
                self._running_here.clear()
            self._running_here.add(run_id)

    def _borrow_worker(self, queue: str) -> tuple[Worker, asyncio.AbstractEventLoop] | None:
        """An in-process worker serving ``queue`` on a loop other than the caller's, to
        run a start on, lent until ``_repay``: its ``stop()`` waits for what it lent
        (``_loans_repaid``). None: there is none, or one serves the queue on this loop
        (``app.run`` in many threads: each start goes to its own thread's worker)."""
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        workers = list(self._local_workers)
        if here is not None and any(
            w.running_loop() is here and queue in w.queues for w in workers
        ):
            return None
        with self._loans_lock:
            # under the lock the stopping worker takes to see what it lent, after it is
            # marked stopping: either it sees this loan or this sees it stopping
            for w in workers:
                loop = w.running_loop()
                if (
                    loop is not None
                    and loop is not here
                    and loop.is_running()
                    and w.accepts_local_start(queue, loop)
                ):
                    self._loans[w] = self._loans.get(w, 0) + 1
                    return w, loop
        return None

    def _repay(self, worker: Worker) -> None:
        """A start run on ``worker``'s loop is done (on that loop, or it never ran)."""
        with self._loans_lock:
            left = self._loans.get(worker, 0) - 1
            if left > 0:
                self._loans[worker] = left
                return
            self._loans.pop(worker, None)
            done = self._loans_done.pop(worker, None)
        if done is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits
                done[0].call_soon_threadsafe(done[1].set)

    async def _loans_repaid(self, worker: Worker, grace: float) -> None:
        """Wait (on ``worker``'s loop, once it is stopping) for the starts it runs for
        other threads (``_borrow_worker``): at most ``grace`` seconds."""
        with self._loans_lock:
            if not self._loans.get(worker):
                return
            done = asyncio.Event()
            self._loans_done[worker] = (asyncio.get_running_loop(), done)
        try:
            async with asyncio.timeout(grace):
                await done.wait()
        except TimeoutError:
            log.warning("worker %s stops with a start of another thread unfinished", worker.id)
        finally:
            with self._loans_lock:
                entry = self._loans_done.get(worker)
                if entry is not None and entry[1] is done:
                    del self._loans_done[worker]

    def _local_worker(self, queue: str) -> Worker | None:
        """A running in-process worker on this loop that serves ``queue`` and has room."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        for w in self._local_workers:
            if w.accepts_local_start(queue, loop):
                return w
        return None

    async def start_debounced(
        self,
        workflow: Workflow[P, R] | str,
        *args: Any,
        key: str,
        window: float | timedelta,
        max_wait: float | timedelta | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> Run[R]:
        """Start ONE run per burst of triggers for ``key``, with the LAST trigger's input.

        Each call records its input as the pending input of ``key`` and moves the
        start to ``window`` seconds after this call (trailing edge); with
        ``max_wait``, no later than that long after the burst's first trigger. When
        the time comes a worker serving the workflow's queue starts the run. Every
        call of one burst returns the same handle (its run does not exist until
        then: ``result()`` waits for it). A trigger after the run started opens a new
        burst and a new run. The pending state is in the store, so triggers from any
        process collapse together and nothing is lost on a crash.
        """
        if not isinstance(key, str) or not key:
            raise ConfigurationError(f"debounce key must be a non-empty string (got {key!r})")
        win = seconds(window, "window")
        if not win:
            raise ConfigurationError(f"window of debounce {key!r} must be positive")
        cap = seconds(max_wait, "max_wait")
        if max_wait is not None and not cap:
            raise ConfigurationError(f"max_wait of debounce {key!r} must be positive")
        wf = self._workflow_of(workflow)
        if wf.name not in self._workflows:
            raise UnknownWorkflowError(wf.name, list(self._workflows))
        text = wf.sig.encode_args(args, kwargs or {})
        wf.sig.decode_args(text)
        if self._limits_dirty:
            await self._write_queue_limits()
        rid, _triggers, _due = await self.store.debounce(
            key=key,
            run_id=uuid.uuid4().hex,
            workflow=wf.name,
            queue=wf.queue,
            input=text,
            window=win,
            max_wait=cap,
        )
        run: Run[R] = Run(self, rid, wf)
        run._may_not_exist = True
        return run

    def get_run(self, run_id: str) -> Run[Any]:
        """A handle on an existing run (not checked until used)."""
        return Run(self, run_id, None)

    async def get(self, run_id: str, *, follow: bool = True) -> RunInfo:
        """The state of a run: status, custom status, timestamps, error.

        A run that continued as new answers to its first id: with ``follow`` (the
        default) this is the chain's latest run; ``follow=False`` reads that one run.
        """
        return await self._read(run_id, follow, lenient=False)

    async def _peek(self, run_id: str, *, follow: bool = True) -> RunInfo:
        """``get``, but a field that cannot be read (a missing blob, a destroyed key) is
        marked in ``RunInfo.unavailable`` instead of raised: for pages and actions that
        need only the run's id, status and tenant."""
        return await self._read(run_id, follow, lenient=True)

    async def _read(self, run_id: str, follow: bool, *, lenient: bool) -> RunInfo:
        info = await self.store.get_run(run_id, follow=follow, lenient=lenient)
        if info is None:
            purged = await self.store.purged_run(run_id)
            if purged is not None:
                raise RunPurgedError(run_id, *purged)
            raise RunNotFoundError(run_id)
        return info

    # -- blobs -----------------------------------------------------------------------

    def put_blob(
        self, data: bytes, media_type: str | None = None, *, tenant: str | None = None
    ) -> Blob:
        """Store bytes in the blob store (e.g. a document before starting its run).
        ``tenant``: the document is that tenant's (give it to the run you start with
        ``tenant=`` too): with per-tenant keys it is sealed under the tenant's key, kept
        apart from other tenants' copies and shredded with the tenant."""
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ConfigurationError(f"tenant must be a non-empty string (got {tenant!r})")
        assert self.store.blobs is not None
        return self.store.blobs.put(data, media_type, tenant=tenant)

    def read_blob(self, blob: Blob | dict[str, Any]) -> bytes:
        """The bytes of a blob (``BlobError`` if missing or damaged)."""
        assert self.store.blobs is not None
        return self.store.blobs.get(blob)

    async def gc_blobs(self, older_than: float | timedelta = 3600.0) -> dict[str, int]:
        """Remove blobs no payload refers to (written by attempts that crashed before
        their commit, or whose runs were purged) once older than ``older_than``, so the
        blobs of attempts still running stay, and blobs a killed process left half
        written (``.tmp-*``) as old. Returns how many were kept and removed."""
        grace = seconds(older_than, "older_than") or 0.0
        blobs = self.store.blobs
        assert blobs is not None
        if blobs.shared:
            raise ConfigurationError(
                f"this store's blob store is the default {SHARED_ROOT!r}, shared by every "
                "PostgreSQL store whose processes start in this folder: what this store's "
                "payloads do not refer to, another's may. Give each store its own: "
                "App(blobs=...) or TETHER_BLOBS"
            )
        # the deletions a killed purge or erasure left pending, read before the scan
        # below (so a ref recorded later is never judged on a scan made before)
        noted = await self.store.blob_deletions()
        stored = list(blobs.refs())  # listed first: a blob written after is not judged
        used = await self.store.blob_refs()
        removed = await self._carry_out(noted, used)
        cutoff = time.time() - grace
        for ref, mtime in stored:
            if ref not in used and mtime < cutoff:
                # read again: put since the listing (a reference about to be committed,
                # during the long scan above), a blob is young again and stays
                modified = blobs.modified(ref)
                if modified is not None and modified < cutoff:
                    blobs.delete(ref)
                    removed += 1
        kept = len(stored) - removed
        # and what a process killed inside a write left half written (maybe plaintext)
        for path, mtime in list(blobs.leftovers()):
            if mtime < cutoff:
                blobs.remove_leftover(path)
                removed += 1
        return {"kept": kept, "removed": removed}

    # -- retention and erasure -----------------------------------------------------

    async def reseal(self, *, batch: int = 500) -> dict[str, int]:
        """Seal every stored payload under the current keys: values sealed under an older
        key (so it can be retired) and values written before encryption was on. A batch
        per transaction, so workers go on meanwhile. An offloaded payload goes to a new
        blob; the old blobs nothing refers to then are deleted. Returns the values
        rewritten per table, and ``blobs`` deleted."""
        codec = self.store.codec
        if codec is None or codec.sealer is None:
            raise ConfigurationError(
                "reseal needs a keyring: App(encryption=...), TETHER_KEYRING or "
                "TETHER_ENCRYPTION_KEYS"
            )
        from .store.ops.reseal import TABLES

        started = time.time()
        before = await self.store.blob_refs() if self.store.blobs is not None else set()
        out: dict[str, int] = {}
        for table in TABLES:
            after: list[Any] | None = None
            out[table] = 0
            while True:
                n, after = await self.store.reseal_batch(table, after, batch)
                out[table] += n
                if after is None:
                    break
        if before:
            out["blobs"] = await self._drop_blobs(before, started)
        # then every blob stored: put_blob's are sealed again in place (and plain ones:
        # every offloaded payload is sealed by now). One nothing refers to that a pass
        # stopped before its end left goes: a sealed payload's, and a plain one older
        # than gc's grace (a younger one may be an attempt's, its commit in flight). Not
        # in the shared default, where other stores' keys and payloads may differ
        out["blobs_resealed"] = 0
        blobs = self.store.blobs
        if blobs is not None and not blobs.shared:
            used = await self.store.blob_refs()
            for ref, _ in list(blobs.refs()):
                with contextlib.suppress(BlobError):  # gone meanwhile, damaged
                    modified = blobs.modified(ref)
                    if ref not in used and modified is not None and modified < started:
                        plain = not blobs.head(ref, len(SEALED_BLOB)).startswith(SEALED_BLOB)
                        if (plain and modified < started - PURGE_BLOB_GRACE) or (
                            not plain and blobs.sealed_payload(ref)
                        ):
                            blobs.delete(ref)
                            out["blobs"] = out.get("blobs", 0) + 1
                            continue
                    out["blobs_resealed"] += blobs.reseal(ref)
        return out

    async def configure_retention(self, tenant: str, older_than: float | timedelta | None) -> None:
        """Keep ``tenant``'s ended runs for ``older_than`` (None: until purged by hand).

        Kept in the store, shared by every process: each worker purges the tenant's runs
        that ended longer ago in the background, as ``purge(older_than, tenant=)``
        would (``Worker(retention_every=)``), alongside workflows' own ``retention``.
        """
        if not isinstance(tenant, str) or not tenant:
            raise ConfigurationError(f"tenant must be a non-empty string (got {tenant!r})")
        age = seconds(older_than, "older_than")
        if age is not None and age <= 0:
            raise ConfigurationError(f"older_than must be a duration > 0 (got {older_than!r})")
        await self.store.configure_retention(tenant, age)

    async def retentions(self) -> dict[str, float]:
        """Every tenant's retention in seconds (``configure_retention``)."""
        return await self.store.tenant_retentions()

    async def purge(
        self,
        older_than: float | timedelta,
        *,
        workflow: str | None = None,
        tenant: str | None = None,
        dry_run: bool = False,
        batch: int = 500,
    ) -> dict[str, int]:
        """Remove runs that ended more than ``older_than`` ago (of one ``workflow`` or
        ``tenant`` if given): their history, tasks, dead letters, reviews, webhook
        deliveries and audit entries, in transactions of ``batch`` runs so workers are
        never held up; after each, the blobs only its runs referred to. Their ids answer
        ``RunPurgedError``. Live runs are never touched. Returns the rows removed per
        table, and ``blobs`` (``dry_run``: what the first batch would remove, nothing
        removed)."""
        age = seconds(older_than, "older_than")
        if age is None or age < 0:
            raise ConfigurationError(f"older_than must be a duration >= 0 (got {older_than!r})")
        if batch < 1:
            raise ConfigurationError(f"batch must be >= 1 (got {batch})")
        return await self._purge_before(
            self.store.clock() - age, workflow, tenant, dry_run=dry_run, batch=batch
        )

    async def _purge_before(
        self,
        cutoff: float,
        workflow: str | None,
        tenant: str | None,
        *,
        dry_run: bool = False,
        batch: int = 500,
        stopping: Callable[[], bool] = lambda: False,
        blobs: bool = True,
    ) -> dict[str, int]:
        """``purge`` by a cutoff time (workers' retention too): batches until one removes
        nothing, and (``blobs``) the blobs the removed runs referred to that nothing else
        refers to. Each batch's transaction records its runs' blobs as pending deletions
        (``blob_deletions``), carried out after its commit, and at the start of the next
        purge, erasure or gc-blobs when a process was killed first. Telling which are
        unused reads every stored payload, as ``gc_blobs`` does, so it is done after a
        batch only once the time since the last check is at least twice what that one
        took (after every batch on a small store, rarely on a large one), and at the end.
        Workers' periodic retention leaves blobs to ``gc_blobs``."""
        total: dict[str, int] = {"runs": 0}
        own = self._own_blobs() and blobs and not dry_run
        # a blob put again in the last hour may be about to be referred to by a commit
        # still in flight (blobs are shared by content): gc_blobs judges it
        spare_from = time.time() - PURGE_BLOB_GRACE if own else None
        if own:  # what a purge killed before left pending
            total["blobs"] = await self._drop_pending()
        due = False
        checked_at, check_took = time.monotonic(), 0.0

        async def drop() -> None:
            nonlocal checked_at, check_took, due
            t0 = time.monotonic()
            total["blobs"] = total.get("blobs", 0) + await self._drop_pending()
            due = False
            checked_at = time.monotonic()
            check_took = checked_at - t0

        while True:
            counts, theirs = await self.store.purge(
                cutoff,
                workflow=workflow,
                tenant=tenant,
                limit=batch,
                dry_run=dry_run,
                spare_from=spare_from,
            )
            for table, n in counts.items():
                total[table] = total.get(table, 0) + n
            if theirs and own:
                due = True
                if time.monotonic() - checked_at >= 2 * check_took:
                    await drop()
            # counts["runs"] is what the batch removed: fewer than it found when another
            # purge or an erasure removed some first, so only an empty batch ends it
            if dry_run or counts["runs"] == 0 or stopping():
                break
        if due:
            await drop()
        return total

    def _own_blobs(self) -> bool:
        """Whether this store's blobs may be deleted: it has a blob store that is its
        own (the shared default may hold other stores' blobs: nothing is deleted)."""
        blobs = self.store.blobs
        return blobs is not None and not blobs.shared

    async def _drop_pending(self) -> int:
        """Carry out the pending blob deletions (``blob_deletions``): how many blobs went."""
        if not self._own_blobs():
            return 0
        noted = await self.store.blob_deletions()  # read before the scan of what is used
        if not noted:
            return 0
        return await self._carry_out(noted, await self.store.blob_refs())

    async def _carry_out(self, noted: dict[str, float], used: set[str]) -> int:
        """Delete each blob of ``noted`` no payload refers to (``used``, scanned after
        ``noted`` was read) and not written since its ``spare_from``, then forget them
        all: one in use again (another run put the same bytes) or put again since is
        kept, and left to ``gc_blobs`` once unused. How many blobs went."""
        blobs = self.store.blobs
        if not noted or blobs is None or blobs.shared:
            return 0
        removed = 0
        for ref, spare_from in noted.items():
            if ref in used:
                continue
            modified = blobs.modified(ref)
            if modified is not None and modified < spare_from:
                blobs.delete(ref)
                removed += 1
        # forgotten only once its blob is gone: a process killed before leaves it listed
        await self.store.forget_blob_deletions(sorted(noted))
        return removed

    async def _drop_blobs(self, refs: set[str], written_before: float) -> int:
        """Delete the blobs of ``refs`` that no stored payload refers to any more (the
        rows that did were just removed) and that were not put since ``written_before``;
        how many went."""
        blobs = self.store.blobs
        if blobs is None or blobs.shared:  # (another store's runs may refer to them)
            return 0
        removed = 0
        for ref in refs - await self.store.blob_refs():
            modified = blobs.modified(ref)
            if modified is not None and modified < written_before:
                blobs.delete(ref)
                removed += 1
        return removed

    async def erase_tenant(
        self, tenant: str, *, dry_run: bool = False, batch: int = 500
    ) -> dict[str, int]:
        """Erase a tenant: terminate its live runs, then remove every run of it with all
        their rows, and its own rows (admission limit, API keys, switch, model budgets
        and spend). Its run ids answer ``RunPurgedError`` ("tenant erased"). With
        per-tenant encryption keys (``tether.encryption``), once its runs are ended a
        fresh key is made current for the tenant, and the erasure waits until every
        process sharing the keyring seals under it (``Keyring.seen_within``, a little over
        a second for a keyring file) before rows go; then once more under a second fresh
        key, and every key but that last one is destroyed: any copy of its data left
        elsewhere (a backup, even one taken during the erasure) is unreadable, while a run
        started after the last pass (under the last key, which is kept) stays readable.
        Returns the rows removed per table, ``blobs`` deleted and
        ``keys_destroyed`` (``dry_run``: what the first batch would remove, nothing
        changed); ``blobs_left``: the tenant's blobs kept because the blob store is the
        default shared by PostgreSQL stores (``SHARED_ROOT``), where another store's
        payloads may refer to the same bytes: give the store its own
        (``App(blobs=...)``, ``TETHER_BLOBS``)."""
        if not tenant:
            raise ConfigurationError("erase_tenant needs the tenant's name")
        codec = self.store.codec
        keyring = codec.sealer.keyring if codec is not None and codec.sealer is not None else None
        rotate = not dry_run and keyring is not None and keyring.per_tenant
        older = keyring.tenant_keys(tenant) if rotate and keyring is not None else None
        total: dict[str, int] = {"runs": 0}
        if not dry_run:
            # first, so its runs stop writing (under any key) before a fresh key is made
            await self._end_tenant_runs(tenant, batch)
        if older and keyring is not None:
            # other processes keep sealing the tenant's new data under the key they last
            # read until they see the keyring change: a fresh key, seen by all before
            # any row goes, keeps what they start during the erasure readable
            keyring.rotate(tenant)
            await asyncio.sleep(keyring.seen_within + KEY_SETTLE)
            await self._end_tenant_runs(tenant, batch)  # those started while it settled
        if not dry_run:  # what a purge or erasure killed before left pending
            total["blobs"] = await self._drop_pending()
        await self._erase_tenant_rows(tenant, batch, dry_run, total)
        if older and keyring is not None:
            # what was written under that fresh key meanwhile (runs started during the
            # erasure, removed above) must not stay readable in a copy (a backup): a
            # second fresh key, seen by all, one more pass, then every other key goes
            between = keyring.tenant_keys(tenant) or []
            keyring.rotate(tenant)
            await asyncio.sleep(keyring.seen_within + KEY_SETTLE)
            await self._end_tenant_runs(tenant, batch)  # those started meanwhile
            await self._erase_tenant_rows(tenant, batch, dry_run, total)
            older = between
        if not dry_run and keyring is not None:
            gone = keyring.shred(tenant) if older is None else keyring.shred(tenant, older)
            total["keys_destroyed"] = len(gone)
        return total

    async def _end_tenant_runs(self, tenant: str, batch: int) -> None:
        """Terminate every live run of ``tenant`` ("tenant erased")."""
        while True:
            live = [
                r
                for status in (
                    RunStatus.PENDING,
                    RunStatus.RUNNING,
                    RunStatus.SUSPENDED,
                    RunStatus.QUEUED,
                )
                for r in await self.list(status=status, tenant=tenant, limit=batch)
            ]
            if not live:
                return
            for r in live:
                with contextlib.suppress(RunFinishedError, RunNotFoundError):
                    await self.store.terminate(r.run_id, "tenant erased")

    async def _erase_tenant_rows(
        self, tenant: str, batch: int, dry_run: bool, total: dict[str, int]
    ) -> None:
        """One pass of ``erase_tenant`` (the caller ended its live runs just before): its
        blobs, then its rows in batches until one removes nothing; counts added to
        ``total``."""
        started = time.time()
        blobs = self.store.blobs
        if not dry_run and blobs is not None:
            # the blobs its payloads refer to (or were offloaded to), unless another
            # tenant's payload refers to the same bytes: removed first, while every row
            # that names them is there, so an erasure stopped half way and run again
            # still finds them all (its rows go next)
            mine = await self.store.blob_refs(tenant)
            if mine:
                mine -= await self.store.blob_refs(other_than=tenant)
            if blobs.shared:
                # the shared default: another store's payloads may name the same bytes,
                # so they stay; counted, so the erasure does not pass for a whole one
                left = sum(1 for ref in mine if blobs.modified(ref) is not None)
                if left:
                    total["blobs_left"] = total.get("blobs_left", 0) + left
            else:
                total.setdefault("blobs", 0)
                for ref in mine:
                    modified = blobs.modified(ref)
                    if modified is not None and modified < started:
                        blobs.delete(ref)
                        total["blobs"] += 1
        # the blobs of the rows removed below (runs started since the scan above, a blob
        # put again meanwhile) are recorded as pending deletions with them, and carried
        # out after: a process killed in between leaves them to the next one
        spare_from = started if not dry_run and self._own_blobs() else None
        due = False
        while True:
            counts, theirs = await self.store.erase_tenant_batch(
                tenant, limit=batch, dry_run=dry_run, spare_from=spare_from
            )
            due = due or bool(theirs)
            for table, n in counts.items():
                total[table] = total.get(table, 0) + n
            if dry_run or counts["runs"] == 0:
                break
        if due and spare_from is not None:
            total["blobs"] = total.get("blobs", 0) + await self._drop_pending()

    async def list(
        self,
        *,
        status: RunStatus | str | None = None,
        workflow: str | None = None,
        limit: int = 100,
        offset: int = 0,
        waiting_for: str | None = None,
        before: tuple[float, str] | None = None,
        tenant: str | None = None,
        since: float | _dt.datetime | None = None,
        error_type: str | None = None,
        search: str | None = None,
        stuck: bool = False,
    ) -> builtins.list[RunInfo]:
        """Runs, newest first, filtered by status, workflow name and what they wait for.

        ``waiting_for`` is a kind of ``RunInfo.waiting_on``: ``"signal"`` (or
        ``"signal:review"`` for one signal), ``"timer"``, ``"activity"``, ``"child"``,
        or ``"admission"`` (queued for a tenant's slot). ``before`` pages by keyset:
        pass the ``(created_at, run_id)`` of the previous page's last run. ``tenant``
        keeps one tenant's runs; ``since`` (epoch seconds or an aware datetime) runs
        created since then; ``error_type`` runs whose error, or its cause, is of that
        type (class name); ``search`` runs whose id contains that text; ``stuck`` live
        runs that cannot move on: their ``task_error`` is set (their workflow task fails,
        e.g. non-determinism after a deploy, or a step waits for a worker that registers
        its activity).
        """
        if waiting_for is not None and waiting_for.partition(":")[0] not in WAITING_KINDS:
            raise ConfigurationError(
                f"waiting_for={waiting_for!r}: name one of {', '.join(WAITING_KINDS)} "
                "(a signal may be named: 'signal:review')"
            )
        st = RunStatus(status) if status is not None else None
        return await self.store.list_runs(
            status=st,
            workflow=workflow,
            limit=check_limit(limit),
            offset=check_offset(offset),
            waiting_for=waiting_for,
            before=check_cursor(before),
            tenant=tenant,
            since=check_time(since, "since"),
            error_type=error_type,
            search=search,
            stuck=stuck,
        )

    async def history(self, run_id: str, *, follow: bool = True) -> builtins.list[Event]:
        """The run's full history (of the chain's latest run, unless ``follow=False``)."""
        info = await self._peek(run_id, follow=follow)
        return await self.store.read_history(info.run_id, 0)

    async def usage(
        self,
        run_id: str | None = None,
        *,
        tenant: str | None = None,
        workflow: str | None = None,
        since: float | _dt.datetime | None = None,
    ) -> Usage:
        """Tokens and cost of the model calls recorded by ``tether.ai``.

        With ``run_id``: that run's, its whole continue-as-new chain included.
        Otherwise the sum over the runs created since ``since`` (a timestamp or an
        aware datetime; all runs if None), kept to one ``tenant`` and/or ``workflow``.
        Totals come from the recorded results, so they are exact and count every
        attempt and repair. Reads each run's history: O(events) per run.
        """
        floor = check_time(since, "since")
        if run_id is not None:
            latest = await self._peek(run_id)
            first, n = chain_of(latest.run_id)
            ids = [first] + [f"{first}{CHAIN_SEPARATOR}{k}" for k in range(1, n + 1)]
            total = Usage()
            for rid in ids:
                total = total + usage_of(await self.store.read_history(rid, 0))
            return total
        total = Usage()
        before: tuple[float, str] | None = None
        while True:
            page = await self.list(tenant=tenant, workflow=workflow, limit=200, before=before)
            for info in page:
                if floor is not None and info.created_at < floor:
                    return total
                total = total + usage_of(await self.store.read_history(info.run_id, 0))
            if len(page) < 200:
                return total
            before = (page[-1].created_at, page[-1].run_id)

    async def approvals(
        self,
        *,
        status: str | None = "open",
        approver: str | None = None,
        run_id: str | None = None,
        tenant: str | None = None,
        limit: int = 100,
    ) -> builtins.list[Approval]:
        """Reviews opened by ``tether.approval``, oldest first.

        ``status="open"`` (the default) keeps the undecided reviews of live runs;
        None lists all; or name one (``approved``, ``rejected``, ``expired_rejected``...).
        ``approver`` keeps the reviews that person may decide now (reviews open to
        anyone included).
        """
        rows = await self.store.list_approvals(
            status=status, run_id=run_id, tenant=tenant, limit=check_limit(limit)
        )
        out = [Approval.from_row(r) for r in rows]
        if approver is not None:
            out = [a for a in out if not a.approvers or approver in a.approvers]
        return out

    async def get_approval(self, approval_id: str) -> Approval:
        """One review (``ApprovalError`` when there is none by that id)."""
        row = await self.store.get_approval(approval_id)
        if row is None:
            raise ApprovalNotFoundError(approval_id, "no such review (ids look like 'run-id:step')")
        return Approval.from_row(row)

    async def decide(
        self,
        approval_id: str,
        *,
        approve: bool,
        by: str,
        fingerprint: str,
        value: Any = None,
        reason: str | None = None,
    ) -> None:
        """Decide an open review as ``by``, naming the proposal's ``fingerprint``.

        ``value`` is an edited proposal (when the review allows edits), validated
        by the run before it continues with it. The run records every decision it
        receives; one it refuses (another fingerprint, someone not asked, an
        invalid edit) changes nothing. A fingerprint that does not match the
        review's, a ``by`` not among its approvers, or an edit where edits are not
        allowed, is delivered (so the attempt is on record) and then raises
        ``ApprovalError``, as does a review that is no longer open or is past its
        deadline (the deadline decides, even before a worker has processed its timer:
        such a decision is not delivered), and an edit that is not of the proposal's
        shape (checked against the JSON Schema the run recorded with the review: an
        object, its required fields, no field its type forbids, a fixed value such as a
        tool call's tool), which raises ``ApprovalEditError`` naming the shape expected
        and records nothing. A decision delivered holds the review
        (``deciding``) until the run takes it, or refuses it (an invalid edit: the
        review opens again); a second decision meanwhile (two operators at once)
        raises ``ApprovalError`` and never reaches the run.
        """
        if not isinstance(by, str) or not by:
            raise ConfigurationError("a decision needs by= (who decides)")
        review = await self.get_approval(approval_id)
        if review.status != "open":
            raise ApprovalError(approval_id, _not_open(review.status, review.decided_by))
        problem = None
        if fingerprint != review.fingerprint:
            problem = (
                "the fingerprint does not match the proposal under review (the proposal "
                "changed, or another review was meant); the attempt is recorded and refused"
            )
        elif review.approvers and by not in review.approvers:
            problem = (
                f"{by!r} is not among its approvers now ({', '.join(review.approvers)}); "
                "the attempt is recorded and refused"
            )
        elif approve and value is not None and not review.allow_edit:
            problem = "this review does not allow edits; the attempt is recorded and refused"
        if problem is None and approve and value is not None:
            wrong = await self._edit_problems(review, value)
            if wrong:
                raise ApprovalEditError(approval_id, wrong)
        payload: dict[str, Any] = {
            "approval_id": approval_id,
            "fingerprint": fingerprint,
            "decision": "approve" if approve else "reject",
            "by": by,
            "reason": reason,
            "value": value,
        }
        if problem is None:
            payload["held"] = True  # holds the review until the run takes or refuses it
        refused = await self.store.deliver_decision(
            approval_id,
            encode(payload, f"decision of approval {approval_id!r}"),
            by,
            problem is None,
        )
        if refused is not None:
            if refused[0] == "missing":
                raise ApprovalNotFoundError(approval_id, "no such review (it was purged)")
            raise ApprovalError(approval_id, _not_open(*refused))
        if problem is not None:
            raise ApprovalError(approval_id, problem)

    async def _edit_problems(self, review: Approval, value: Any) -> str | None:
        """Why ``value`` cannot be an edit of ``review``'s proposal, checked against the
        JSON Schema its run recorded with the review (None: it may be; the run then
        validates it in full, as it does for a review recorded without one)."""
        step = review.approval_id.rpartition(":")[2]
        try:
            events = await self.store.read_history(review.run_id, 0)
        except (KeyUnavailableError, BlobError):  # the run checks it instead
            return None
        requested = next(
            (
                e.data.get("value")
                for e in events
                if e.type is EventType.MARKER
                and str(e.step) == step
                and e.data.get("marker") == "approval_requested"
            ),
            None,
        )
        shape = requested.get(_approval.EDIT_SCHEMA) if isinstance(requested, dict) else None
        if not isinstance(shape, dict):
            return None
        try:
            edit = json.loads(encode(value, f"edit of approval {review.approval_id!r}"))
        except PayloadError:
            return None  # refused by the store's encoding below, as before
        problems = _approval.edit_problems(shape, edit)
        if not problems:
            return None
        expected = _approval.describe_shape(shape)
        return (
            f"the edit is not of the shape this review takes ({'; '.join(problems)})"
            + (f": it must be {expected}" if expected else "")
            + "; nothing was recorded and the review stays open"
        )

    async def signal(
        self, run_id: str, name: str, payload: Any = None, *, signal_id: str | None = None
    ) -> bool:
        """Deliver the signal ``name``; durable when this returns, buffered until waited for.

        ``signal_id`` makes a retry safe: a signal whose id already arrived in the run
        (or its continue-as-new chain, even if it has ended since) is not recorded
        again, and this returns False; True when the signal was recorded. One id is one
        signal: concurrent sends record it once, and one that arrived with another name
        or payload (compared as values) raises ``SignalIdConflictError``."""
        check_signal_name(name)
        if signal_id is not None:
            check_signal_id(signal_id)
        wire = encode(payload, f"payload of signal {name!r}")
        target, seq, new = await self.store.signal(run_id, name, wire, signal_id)
        if not new and signal_id is not None:
            await self._id_kind(
                target,
                seq,
                signal_id,
                f"signal {name!r}",
                update=False,
                name=name,
                value=json.loads(wire),
            )
        return new

    # -- queries and updates -----------------------------------------------------

    async def query(self, run_id: str, name: str, *args: Any) -> Any:
        """Answer the run's query ``name`` (``tether.on_query``) from its state, rebuilt
        here by replaying its history (the workflow must be registered on this App). No
        event is recorded and no worker is asked; a finished run answers from its final
        state. ``QueryError`` if the run has no such handler or it raised."""
        inst = await self._replayed(run_id, name)
        try:
            handler = inst.queries.get(name)
            if handler is None:
                known = ", ".join(sorted(inst.queries)) or "none"
                raise QueryError(inst.run_id, name, f"no such query handler (known: {known})")
            try:
                out = handler(*args)
            except Exception as exc:
                raise QueryError(inst.run_id, name, f"{type(exc).__name__}: {exc}") from exc
            if asyncio.iscoroutine(out):
                out.close()
                raise QueryError(inst.run_id, name, "a query handler must not be async")
            return json.loads(encode(out, f"answer of query {name!r}"))
        finally:
            inst.close()

    async def update(
        self,
        run_id: str,
        name: str,
        *args: Any,
        timeout: float | None = 60.0,
        update_id: str | None = None,
    ) -> Any:
        """Run the update ``name`` (``tether.on_update``) in the run and return its result.

        Its validator runs here first against the replayed state: a refusal raises
        ``UpdateRejectedError`` and records nothing. An accepted update is recorded (a
        request, then a Marker with its outcome) and applied when the run reaches it;
        ``UpdateFailedError`` if its handler raised. Waits up to ``timeout`` seconds for
        the outcome (``ResultTimeoutError``; the update still applies). Sent before
        the run's code first ran, it is recorded unchecked: the run checks it (its
        validator, whether it has such a handler) when its code gets there.

        ``update_id`` makes a retry safe (after that timeout, a lost connection): an
        update whose id already arrived in the run's continue-as-new chain is not
        recorded or validated again; this waits for the first one's outcome instead.
        One id is one update: one that arrived with another name or arguments (compared
        as values) raises ``SignalIdConflictError``."""
        return await self._update(run_id, name, args, timeout, update_id)

    async def _update(
        self,
        run_id: str,
        name: str,
        args: tuple[Any, ...],
        timeout: float | None,
        update_id: str | None,
        recorded: Callable[[], None] | None = None,
    ) -> Any:
        """``update``; ``recorded`` is called once the update is in the run's history
        (or its id was found there), before its outcome is waited for: the HTTP API
        answers ``202`` from then on if the server stops."""
        if update_id is not None:
            check_signal_id(update_id, "update_id")
            seen = await self.store.signal_arrived(run_id, update_id)
            if seen is not None:
                await self._id_kind(
                    *seen,
                    update_id,
                    f"update {name!r}",
                    update=True,
                    name=UPDATE_SIGNAL + name,
                    value=json.loads(encode(list(args), f"arguments of update {name!r}")),
                )
                if recorded is not None:
                    recorded()
                return await self._update_outcome(seen[0], update_id, name, timeout, seen[1])
        try:
            inst = await self._replayed(run_id, f"update {name!r}")
        except QueryError as exc:
            if not exc.problem.startswith(NOT_RUN_YET):
                raise
            return await self._send_update(exc.run_id, name, args, timeout, update_id, recorded)
        try:
            entry = inst.updates.get(name)
            if entry is None:
                known = ", ".join(sorted(inst.updates)) or "none"
                raise UpdateRejectedError(
                    inst.run_id, name, f"no such update handler (known: {known})"
                )
            if entry[1] is not None:
                try:
                    entry[1](*args)
                except Exception as exc:
                    raise UpdateRejectedError(inst.run_id, name, str(exc)) from None
            live = inst.run_id
        finally:
            inst.close()
        return await self._send_update(live, name, args, timeout, update_id, recorded)

    async def _send_update(
        self,
        run_id: str,
        name: str,
        args: tuple[Any, ...],
        timeout: float | None,
        update_id: str | None = None,
        recorded: Callable[[], None] | None = None,
    ) -> Any:
        """Record the update request in the run's history and wait for its outcome (with
        an ``update_id`` that arrived meanwhile: the first request's)."""
        uid = update_id or uuid.uuid4().hex
        payload = encode({"id": uid, "args": list(args)}, f"arguments of update {name!r}")
        target, seq, new = await self.store.signal(run_id, UPDATE_SIGNAL + name, payload, update_id)
        if not new and update_id is not None:  # it arrived meanwhile
            await self._id_kind(
                target,
                seq,
                update_id,
                f"update {name!r}",
                update=True,
                name=UPDATE_SIGNAL + name,
                value=json.loads(payload)["args"],
            )
        if recorded is not None:
            recorded()
        return await self._update_outcome(target, uid, name, timeout, seq)

    async def _id_kind(
        self,
        run_id: str,
        seq: int,
        given: str,
        sent: str,
        *,
        update: bool,
        name: str,
        value: Any,
    ) -> None:
        """Refuse ``given``, the id of ``sent`` (signal ``name``, or the update's
        ``UPDATE_SIGNAL`` name), unless it arrived (as event ``seq`` of ``run_id``) as the
        same request: ``SignalIdConflictError`` if it arrived as the other kind (a plain
        signal for an update, or the other way: one would wait for an outcome that never
        comes, the other be dropped as a retry), with another name, or with another
        payload (``value``: an update's arguments) compared as values, as a repeated
        start's input is. The recorded event is the reference, so ids recorded before
        payloads were compared need nothing more; one whose payload cannot be read here
        is taken as a repeat."""
        events = await self.store.read_history(run_id, seq - 1)
        event = next((e for e in events if e.seq == seq), None)
        if event is None or event.type is not EventType.SIGNAL_RECEIVED:
            return
        arrived = str(event.data.get("name", ""))
        what = (
            f"update {arrived[len(UPDATE_SIGNAL) :]!r}"
            if arrived.startswith(UPDATE_SIGNAL)
            else f"signal {arrived!r}"
        )
        if arrived.startswith(UPDATE_SIGNAL) != update:
            raise SignalIdConflictError(run_id, given, what, sent)
        if arrived != name:
            raise SignalIdConflictError(run_id, given, what, sent, "name")
        if "payload" not in event.data:
            return
        stored = event.data["payload"]
        if update:
            if not isinstance(stored, dict) or "args" not in stored:
                return
            stored = stored["args"]
        if not json_equal(stored, value):
            differs = "arguments" if update else "payload"
            raise SignalIdConflictError(run_id, given, what, sent, differs)

    async def _replayed(self, run_id: str, what: str) -> WorkflowInstance:
        """The run's live instance rebuilt from its history, through its last task."""
        info = await self.get(run_id)
        events = await self.store.read_history(info.run_id, 0)
        last = max(
            (i for i, e in enumerate(events) if e.type is EventType.WORKFLOW_TASK_COMPLETED),
            default=None,
        )
        if last is None:
            raise QueryError(info.run_id, what, f"{NOT_RUN_YET}: try again shortly")
        inst = WorkflowInstance(info.run_id, self.get_workflow(info.workflow))
        try:
            inst.advance(events[: last + 1], self.store.clock())
        except BaseException:
            inst.close()
            raise
        return inst

    async def _update_outcome(
        self, run_id: str, update_id: str, name: str, timeout: float | None, after: int = 0
    ) -> Any:
        """Wait for the Marker that records the update's outcome (``_update_wait``: one
        reader of the run's history for every caller waiting on it)."""
        return await self._updates.wait(run_id, update_id, name, timeout, after)

    async def cancel(self, run_id: str, reason: str | None = None) -> None:
        """Ask a run to cancel: its code sees CancelledError at the next await and may clean up."""
        await self.store.cancel(run_id, reason)

    async def terminate(self, run_id: str, reason: str | None = None) -> None:
        """End a run now, running none of its code (its running children too)."""
        await self.store.terminate(run_id, reason)

    async def suspend(self, run_id: str) -> None:
        """Pause a run: no new steps are dispatched until ``resume``."""
        await self.store.suspend(run_id)

    async def resume(self, run_id: str) -> None:
        """Continue a suspended run."""
        await self.store.resume(run_id)

    # -- recovery ---------------------------------------------------------------

    # -- entities ---------------------------------------------------------------------

    def entity(
        self,
        cls: C | None = None,
        /,
        *,
        name: str | None = None,
        queue: str | None = None,
        ops_per_run: int = 500,
    ) -> Any:
        """Register a class as a durable entity (``@app.entity``): one object per key,
        its public methods its operations, applied one at a time and recorded with the
        state they leave (``tether._entities``). ``app.entity_ref(Cls, key)`` calls them."""

        def wrap(c: C) -> C:
            ename = name or c.__name__
            if ops_per_run < 1:
                raise ConfigurationError(f"ops_per_run must be >= 1 (got {ops_per_run})")
            fn = entity_workflow(c, ops_per_run)
            self.workflow(name=ENTITY_PREFIX + ename, queue=queue)(fn)
            self._entities[ename] = frozenset(entity_operations(c))
            return c

        return wrap if cls is None else wrap(cls)

    def entity_ref(self, entity: type | str, key: str) -> EntityRef:
        """The entity of class (or name) ``entity`` with this key: ``call``, ``signal``,
        ``state``. It exists once an operation was asked of it."""
        ename = entity if isinstance(entity, str) else entity.__name__
        ops = self._entities.get(ename)
        if ops is None:
            raise ConfigurationError(
                f"no entity {ename!r} is registered on this App (known: "
                f"{', '.join(sorted(self._entities)) or 'none'}); decorate it with @app.entity"
            )
        return EntityRef(self, ename, ops, key)

    async def entities(self, entity: type | str, *, limit: int = 1000) -> builtins.list[str]:
        """The keys of the live entities of a class, newest first."""
        ename = self.entity_ref(entity, "-").name  # an unknown class: ConfigurationError
        return await list_entities(self, ename, check_limit(limit))

    # -- schedules --------------------------------------------------------------------

    async def schedule(
        self,
        schedule_id: str,
        workflow: Workflow[P, R] | str,
        *args: Any,
        cron: str | None = None,
        every: float | timedelta | None = None,
        tz: str | None = None,
        jitter: float | timedelta | None = None,
        overlap: str = "skip",
        catchup_window: float | timedelta | None = None,
        start_at: float | _dt.datetime | None = None,
        end_at: float | _dt.datetime | None = None,
        kwargs: dict[str, Any] | None = None,
        paused: bool = False,
        note: str | None = None,
    ) -> ScheduleInfo:
        """Create (or change) the schedule ``schedule_id``: runs of ``workflow(*args)`` on a
        five-field ``cron`` expression in time zone ``tz``, or ``every`` N seconds.

        Each tick starts one run, id ``<schedule_id>@<tick in UTC>``, on whichever worker
        serves the workflow's queue (the store decides: never two runs for a tick).
        ``overlap`` is what a tick does while the previous run still runs: ``skip`` it,
        ``buffer_one`` (start it when that run ends; later ticks skipped meanwhile),
        ``allow_all``, or ``cancel_previous``. Ticks missed (no worker, downtime) fire late
        while within ``catchup_window`` (a day by default), else are skipped. ``jitter``
        delays each tick by up to that much (fixed per tick). Declaring the same schedule
        again (each deploy) changes nothing; another spec replaces it from now on.
        Time zones and clock changes: see ``tether._schedules``.
        """
        check_schedule_id(schedule_id)
        if dot_parts(f"{schedule_id}@"):  # its runs' ids would have one: a new one is refused
            try:
                await self.store.get_schedule(schedule_id)  # an older version's: kept
            except ScheduleNotFoundError:
                raise dot_parts_error(
                    f"schedule id {schedule_id!r} (its runs' ids {schedule_id + '@<tick>'!r})",
                    "an id",
                ) from None
        wf = self._workflow_of(workflow)
        if wf.name not in self._workflows:
            raise UnknownWorkflowError(wf.name, list(self._workflows))
        spec = make_spec(
            cron=cron,
            every=every,
            tz=tz,
            jitter=jitter,
            overlap=overlap,
            catchup_window=catchup_window,
            start_at=start_at,
            end_at=end_at,
        )
        text = wf.sig.encode_args(args, kwargs or {})
        wf.sig.decode_args(text)  # wrong argument types fail here, not at the first tick
        info, _changed = await self.store.put_schedule(
            schedule_id, wf.name, wf.queue, text, spec, paused=paused, note=note
        )
        return info

    async def schedules(self, *, limit: int = 1000) -> builtins.list[ScheduleInfo]:
        """Every schedule, by id: its spec, next tick, last run, runs fired and skipped."""
        return await self.store.list_schedules(check_limit(limit))

    async def get_schedule(self, schedule_id: str) -> ScheduleInfo:
        """One schedule (``ScheduleNotFoundError`` if there is none)."""
        return await self.store.get_schedule(schedule_id)

    async def pause_schedule(self, schedule_id: str, note: str | None = None) -> bool:
        """Stop firing (ticks passed while paused never fire); True if it was running."""
        return await self.store.pause_schedule(schedule_id, True, note)

    async def resume_schedule(self, schedule_id: str) -> bool:
        """Fire again, from the first tick after now; True if it was paused."""
        return await self.store.pause_schedule(schedule_id, False, None)

    async def trigger_schedule(self, schedule_id: str) -> Run[Any]:
        """Start the schedule's run now (id ``<schedule_id>@trigger-<now>``), whatever its
        ticks and overlap policy say."""
        run_id = await self.store.trigger_schedule(schedule_id)
        return self.get_run(run_id)

    async def delete_schedule(self, schedule_id: str) -> None:
        """Delete a schedule; the runs it started stay."""
        await self.store.delete_schedule(schedule_id)

    # -- kill switches and the audit log -------------------------------------------

    async def disable(
        self, kind: str, name: str, *, reason: str | None = None, by: str | None = None
    ) -> bool:
        """Switch ``kind`` ("workflow", "activity", "model" or "tenant") ``name`` off for
        every worker on the store: its tasks are held back (a model's calls, a
        workflow's workflow tasks, an activity's attempts), a tenant's new runs are
        refused; work in flight finishes. True if it was on. Recorded in the audit log.

        A name this App does not register is refused (``ConfigurationError``: a switch
        on it would stop nothing) when the App registers any of that kind: a workflow
        or activity, a model of a ``tether.ai`` gateway. A blank name is refused."""
        _check_switch(kind, name)
        self._refuse_unknown_switch(kind, name)
        changed = await self.store.set_switch(kind, name, True, by, reason)
        await self._refresh_switches()
        if changed:
            await self.store.audit(by or "app", "switch off", f"{kind}:{name}", {"reason": reason})
        return changed

    def _refuse_unknown_switch(self, kind: str, name: str) -> None:
        """Refuse switching off a name that would stop nothing (see ``disable``)."""
        if not name.strip():
            raise ConfigurationError(f"a {kind} switch needs a name (got {name!r})")
        known: Iterable[str]
        if kind == "workflow":
            known = self._workflows
        elif kind == "activity":
            known = self._activities
        elif kind == "model":
            known = {
                model
                for source in self._pin_sources.values()
                for model in source().get("models") or {}
            }
        else:
            return  # a tenant is any name runs are started with
        if known and name not in known:
            raise ConfigurationError(
                f"this app has no {kind} {name!r} (a switch on it would stop nothing); its "
                f"{kind} names: {', '.join(sorted(known))}"
            )

    async def enable(self, kind: str, name: str, *, by: str | None = None) -> bool:
        """Switch ``kind`` ``name`` back on; held tasks go within a few seconds. True if
        it was off."""
        _check_switch(kind, name)
        changed = await self.store.set_switch(kind, name, False, by, None)
        await self._refresh_switches()
        if changed:
            await self.store.audit(by or "app", "switch on", f"{kind}:{name}", None)
        return changed

    async def _refresh_switches(self) -> None:
        """This process's workers see a flip at once (others within their refresh)."""
        for w in list(self._local_workers):
            await w._read_switches()

    async def switches(self) -> builtins.list[dict[str, Any]]:
        """The switches that are off: kind, name, by, reason, since."""
        return [
            {"kind": k, "name": n, "by": b, "reason": r, "since": at}
            for k, n, b, r, at in await self.store.switches()
        ]

    async def audit_log(
        self, *, target: str | None = None, limit: int = 100
    ) -> builtins.list[dict[str, Any]]:
        """Who did what (newest first); ``target`` like ``run:<id>`` or ``workflow:<name>``."""
        return [
            {
                "id": i,
                "at": at,
                "actor": actor,
                "action": action,
                "target": tgt,
                "detail": json.loads(detail) if detail else None,
            }
            for i, at, actor, action, tgt, detail in await self.store.audit_log(
                target=target, limit=check_limit(limit)
            )
        ]

    async def audit(self, run_id: str) -> builtins.list[dict[str, Any]]:
        """Who or what acted on a run, oldest first: who started it (``start(by=)``, its
        parent run, or code that named no one), then every recorded action on it
        (signals, decisions, cancels, retries, forks... from the API, console and CLI)."""
        info = await self._peek(run_id, follow=False)
        attrs = info.attrs or {}
        starter = (
            attrs.get("started_by")
            or (f"run {info.parent_run_id}" if info.parent_run_id else None)
            or "code (app.start without by=)"
        )
        trail: builtins.list[dict[str, Any]] = [
            {
                "id": None,
                "at": info.created_at,
                "actor": starter,
                "action": "start",
                "target": f"run:{run_id}",
                "detail": {"workflow": info.workflow},
            }
        ]
        trail.extend(reversed(await self.audit_log(target=f"run:{run_id}", limit=1000)))
        return trail

    async def dead_letters(
        self,
        *,
        include_resolved: bool = False,
        run_id: str | None = None,
        limit: int = 100,
        letter_id: int | None = None,
        tenant: str | None = None,
    ) -> builtins.list[DeadLetter]:
        """Steps and runs that exhausted their failure policy, oldest first; ``letter_id``
        picks one, ``tenant`` keeps those of that tenant's runs."""
        return await self.store.dead_letters(
            include_resolved=include_resolved,
            run_id=run_id,
            limit=check_limit(limit),
            letter_id=letter_id,
            tenant=tenant,
        )

    async def retry(self, run_id: str) -> Run[Any]:
        """Resume a failed (or needs_intervention) run from its failed step.

        Every recorded outcome is kept, so no successful step runs again; the failed
        step runs anew (same idempotency key) and the code continues with today's
        deploy. The open dead letters whose work runs again are marked retried: the
        run's own and its failed step's (a failed child's, by the child's retry). Letters
        of steps its code handled (``tether.map`` items, caught failures) stay open.
        """
        await self.store.retry_run(run_id)
        return self.get_run(run_id)

    async def fork(
        self,
        run_id: str,
        *,
        at_step: int,
        new_run_id: str | None = None,
        models: dict[str, str] | None = None,
        prompts: dict[str, str] | None = None,
    ) -> Run[Any]:
        """Start a new run that reuses the first ``at_step`` recorded outcomes of ``run_id``
        and runs the rest with today's code (try a fix or a new prompt on a real run).

        ``models`` maps a model's name (as registered with a ``tether.ai`` gateway) to
        the ``"provider:name"`` the fork calls instead, and ``prompts`` a prompt's name
        (``gateway.prompt``) to the version its later steps render, to compare models
        and prompts on a real run. The fork keeps the run's tenant and its other pins
        and budget."""
        if at_step < 0:
            raise ConfigurationError("at_step must be 0 or more")
        if new_run_id is not None:
            check_run_id(new_run_id)
        for name, version in (prompts or {}).items():
            known = self._prompt_versions.get(name)
            if not isinstance(version, str) or not version:
                raise ConfigurationError(f"prompts[{name!r}] must be a version name")
            if known is not None and version not in known:
                raise ConfigurationError(
                    f"prompt {name!r} has no version {version!r} (known: {', '.join(known)})"
                )
        rid = new_run_id or f"{run_id}@fork-{uuid.uuid4().hex[:8]}"
        attrs = None
        if models or prompts:
            attrs = dict((await self.get(run_id, follow=False)).attrs or {})
            pins = {gw: dict(p) for gw, p in (attrs.get("pins") or {}).items()}
            if prompts and not (set(pins) | set(self._pin_sources)):
                raise ConfigurationError(
                    f"run {run_id!r} has no tether.ai gateway to pin prompts on (it was "
                    "started by an app without one, and this app has none either)"
                )
            for gw in set(pins) | set(self._pin_sources):
                pinned = dict((pins.get(gw) or {}).get("models") or {})
                for name, spec in (models or {}).items():
                    if not isinstance(spec, str) or not spec:
                        raise ConfigurationError(
                            f"models[{name!r}] must be a 'provider:name' string (got {spec!r})"
                        )
                    # a version no deploy has: the gateway calls the spec instead
                    pinned[name] = {"version": f"fork:{spec}", "spec": spec}
                texts = {**((pins.get(gw) or {}).get("prompts") or {}), **(prompts or {})}
                pins[gw] = {**(pins.get(gw) or {}), "models": pinned}
                if texts:
                    pins[gw]["prompts"] = texts
            attrs["pins"] = pins
        await self.store.fork_run(run_id, rid, at_step, attrs)
        return self.get_run(rid)

    async def replay_dead_letter(self, letter_id: int, *, force: bool = False) -> Any:
        """Replay one dead letter once, after a fix.

        A failed (or needs_intervention) run's letter, or its failed step's, retries the
        run (``app.retry``), in one transaction with the letter's mark. A failed child
        run's letter whose parent caught its failure (``ChildWorkflowError``) and went on
        is refused like a handled step's: the child would repeat its effects for an
        outcome no one reads. A poison item of ``tether.map`` (its run went on without
        it) is run again here with its recorded input and original idempotency key; its
        result is stored on the letter and returned. A replay that fails again reopens
        the letter and raises.

        Any other step's letter is refused with a ``RecoveryError`` naming what its run
        did: its code caught the failure and went on (a cancelled order, a fallback), so
        running the step outside the run would repeat its side effect for a result no
        one reads. Close such a letter with ``resolve_dead_letter``; ``force=True`` runs
        the step again anyway (it re-executes its side effect, once more). A replay
        running a step claims the letter (``replaying``) and renews the claim while it
        runs: a claim left by a process that died mid-replay is taken over by the next
        replay or resolve once ``CLAIM_TTL`` (300 s) passes unrenewed.
        """
        found = await self.store.dead_letters(letter_id=letter_id, limit=1)
        if not found:
            raise RecoveryError(
                f"dead letter {letter_id} does not exist or was already replayed or "
                "resolved; list open ones with app.dead_letters()"
            )
        letter = found[0]
        info = await self._peek(letter.run_id)  # its status: a lost payload is no matter
        if letter.kind == "run" or info.status in (
            RunStatus.FAILED,
            RunStatus.NEEDS_INTERVENTION,
        ):
            if not force:
                await self._check_parent(letter, info)
            try:
                # one transaction: the run is retried and the letter marked, or neither
                await self.store.retry_run(letter.run_id, letter_id=letter.id)
                return None
            except _NotRetried:  # a step the retry would not run again: handled by the code
                pass
        claim = uuid.uuid4().hex
        letter = await self.store.claim_dead_letter(letter_id, claim)
        try:
            if letter.unavailable and "input" in letter.unavailable:
                raise RecoveryError(
                    f"dead letter {letter.id} (step {letter.step}, {letter.name}, run "
                    f"{letter.run_id!r}) cannot be replayed: its input cannot be read "
                    f"({letter.unavailable['input']}). The letter stays open; close it with "
                    f"app.resolve_dead_letter({letter.id}, note=...)"
                )
            if not force:
                await self._check_replayable(letter, info)
            act = self._replayer(letter)
        except BaseException:  # a cancelled replay reopens the letter too
            await asyncio.shield(self.store.resolve_dead_letter(letter_id, None, claim))
            raise
        ctx = ActivityContext(
            run_id=letter.run_id,
            step=letter.step or 0,
            name=act.name,
            attempt=(letter.attempts or 0) + 1,
            idempotency_key=f"{letter.run_id}:{letter.step}",
            task=None,
            _store=None,
            _loop=None,
        )
        # the claim is renewed while the step runs: one left by a process that died
        # mid-replay goes stale (CLAIM_TTL) and the next replay or resolve takes it
        renew = asyncio.create_task(self._renew_claim(letter_id, claim))
        try:
            args, kwargs = act.sig.decode_args(letter.input or "{}")
            cv = contextvars.copy_context()
            cv.run(set_context, ctx)
            if act.is_async:
                value = await asyncio.get_running_loop().create_task(
                    act.fn(*args, **kwargs), context=cv
                )
            else:
                value = await asyncio.to_thread(cv.run, act.fn, *args, **kwargs)
            encoded = encode(value, f"result of activity {act.name!r}")
        except BaseException:
            renew.cancel()
            await asyncio.shield(self.store.resolve_dead_letter(letter_id, None, claim))
            raise
        renew.cancel()
        done = {"state": "replayed", "result": decode_raw(encoded)}
        if force:
            done["forced"] = True
        await self.store.resolve_dead_letter(letter_id, done, claim)
        return value

    async def _renew_claim(self, letter_id: int, claim: str) -> None:
        """Renew a replay's claim on its letter every fifth of ``CLAIM_TTL``."""
        while True:
            await asyncio.sleep(_recovery.CLAIM_TTL / 5)
            try:
                await self.store.renew_dead_letter_claim(letter_id, claim)
            except Exception:  # a store blip: the next renewal tries again
                log.warning("could not renew the claim on dead letter %s", letter_id)

    async def _check_parent(self, letter: DeadLetter, info: RunInfo) -> None:
        """Refuse a letter that would retry a child run whose parent caught its failure
        and went on (or has yet to handle it): the child would repeat its effects for an
        outcome its parent no longer reads. A parent that failed for it is retried later
        (``app.retry``), and finds the child's new outcome."""
        parent_id = info.parent_run_id
        if parent_id is None:
            return
        events = await self.store.read_history(parent_id, 0)
        children = {letter.run_id, info.run_id}
        failed = next(
            (
                e
                for e in reversed(events)
                if e.type is EventType.CHILD_FAILED and e.data.get("child_run_id") in children
            ),
            None,
        )
        if failed is None:  # the parent ended before the child: nothing reads it either way
            return
        parent = await self._peek(parent_id)
        voided = {
            s for e in events if e.type is EventType.RUN_RETRIED for s in e.data.get("voided", [])
        }
        live = [e for e in events if e.seq not in voided and e.type is not EventType.RUN_RETRIED]
        last = _recovery._retried_failure(live)  # None: the parent's code failed by itself
        if parent.status in (RunStatus.FAILED, RunStatus.NEEDS_INTERVENTION) and (
            last is not None and last.seq == failed.seq
        ):
            return  # the parent failed for it: its retry takes the child's new outcome
        seen = any(
            e.seq > failed.seq and e.type is EventType.WORKFLOW_TASK_COMPLETED for e in events
        )
        state = (
            f"is still {parent.status.value}"
            if not parent.status.is_terminal
            else f"ended {parent.status.value}"
        )
        what = (
            f"dead letter {letter.id} ({letter.kind} {letter.name}) would retry run "
            f"{letter.run_id!r}, a child of run {parent_id!r}"
        )
        if not seen and not parent.status.is_terminal:
            raise RecoveryError(
                f"{what}, which {state} and has not yet handled the child's failure: if the "
                "parent fails for it, retry the parent (app.retry), which retries the "
                "child; if its code handles it, there is nothing to replay (resolve the "
                f"letter: app.resolve_dead_letter({letter.id}, note=...))"
            )
        later: builtins.list[str] = []
        for e in events:
            if e.seq > failed.seq and e.type in (
                EventType.ACTIVITY_SCHEDULED,
                EventType.CHILD_STARTED,
            ):
                name = str(e.data.get("name") or e.data.get("workflow"))
                if name not in later:
                    later.append(name)
        did = (
            f"it then called {', '.join(later[:3])}{' and more' if len(later) > 3 else ''}"
            if later
            else "it called no other step"
        )
        raise RecoveryError(
            f"{what}, whose code caught the child's failure (ChildWorkflowError) and went "
            f"on: {did}, and the parent {state}. A replay would run the child again for an "
            "outcome no one reads, repeating its side effects. If nothing is left to do, "
            f"close the letter: app.resolve_dead_letter({letter.id}, note=...); to retry "
            f"the child anyway: app.replay_dead_letter({letter.id}, force=True)"
        )

    def _replayer(self, letter: DeadLetter) -> Activity[Any, Any]:
        """The activity that replays ``letter`` here, or an error saying this App lacks it."""
        try:
            return self.get_activity(letter.name)
        except UnknownActivityError:
            raise UnknownActivityError(
                f"dead letter {letter.id} is step {letter.step} of activity {letter.name!r}, "
                "which this App does not register, so it cannot replay it; the letter stays "
                "open. Replay it from an App (tether serve --app, the worker's module) that "
                "imports the module defining the activity, or close it with "
                f"app.resolve_dead_letter({letter.id}, note=...)"
            ) from None

    async def _check_replayable(self, letter: DeadLetter, info: RunInfo) -> None:
        """Refuse the replay of a step whose run handled its failure (see
        ``replay_dead_letter``): only a ``tether.map`` item is replayed on its own."""
        events = await self.store.read_history(letter.run_id, 0)
        scheduled = next(
            (e for e in events if e.type is EventType.ACTIVITY_SCHEDULED and e.step == letter.step),
            None,
        )
        if scheduled is not None and scheduled.data.get("map_item"):
            return
        failed = next(
            (
                e.seq
                for e in events
                if e.type is EventType.ACTIVITY_FAILED and e.step == letter.step
            ),
            0,
        )
        seen = any(e.seq > failed and e.type is EventType.WORKFLOW_TASK_COMPLETED for e in events)
        later: builtins.list[str] = []
        for e in events:
            if e.seq > failed and e.type in (EventType.ACTIVITY_SCHEDULED, EventType.CHILD_STARTED):
                what = str(e.data.get("name") or e.data.get("workflow"))
                if what not in later:
                    later.append(what)
        did = (
            f"it then called {', '.join(later[:3])}{' and more' if len(later) > 3 else ''}"
            if later
            else "it called no other step"
        )
        state = (
            f"is still {info.status.value}"
            if not info.status.is_terminal
            else f"ended {info.status.value}"
        )
        if info.run_id != letter.run_id:
            state = f"continued as new (its latest run {info.run_id!r} {state})"
        if not seen and not info.status.is_terminal:
            raise RecoveryError(
                f"dead letter {letter.id} is step {letter.step} ({letter.name}) of run "
                f"{letter.run_id!r}, which {state} and has not yet handled the failure: if "
                "the run fails for it, replaying the letter then retries the run; if its code "
                "handles it, there is nothing to replay (resolve the letter)"
            )
        raise RecoveryError(
            f"dead letter {letter.id} is step {letter.step} ({letter.name}) of run "
            f"{letter.run_id!r}, whose code caught the failure and went on: {did}, and the "
            f"run {state}. A replay would run {letter.name} again outside the run (its "
            "result reaches no one), repeating its side effect. If nothing is left to do, "
            f"close the letter: app.resolve_dead_letter({letter.id}, note=...); to run the "
            f"step again anyway: app.replay_dead_letter({letter.id}, force=True)"
        )

    async def resolve_dead_letter(
        self, letter_id: int, *, note: str, by: str | None = None
    ) -> DeadLetter:
        """Close an open dead letter without running anything: the operator dealt with
        it (checked the provider, the run's code handled the failure, the item is junk).
        ``note`` says what was done; it and ``by`` are stored on the letter as its
        resolution and written to the audit log (actor ``by``, or ``app``)."""
        if not isinstance(note, str) or not note.strip():
            raise ConfigurationError("resolve_dead_letter needs a note: what was done about it")
        # one write: the letter is resolved with its audit entry, or neither is
        return await self.store.close_dead_letter(
            letter_id,
            {"state": "resolved", "note": note, "by": by},
            by or "app",
            {"letter": letter_id, "note": note},
        )

    async def complete_step(
        self, run_id: str, step: int, result: Any, *, reason: str, by: str | None = None
    ) -> Run[Any]:
        """Record ``result`` as the outcome of activity step ``step``, without running it:
        the operator checked the provider by the step's idempotency key and the work was
        done (the in-doubt protocol, docs/failure-handling.md).

        Taken by a step waiting for its next retry (or queued), and by the failed step
        of a ``failed`` (or ``needs_intervention``) run: the run is reopened as
        ``retry`` would, with the step completed instead of run again, and its letter
        closed (``{"state": "completed", ...}``). The run's code continues with
        ``result`` as the step's return value (checked against the activity's return
        type when this App registers it, and encoded and sealed like any result).
        Refused with a ``RecoveryError``: a step that completed, an attempt running
        now (its result would race this one), a step whose failure the code handled,
        a step that is not an activity, a run that ended otherwise. The event
        (``ActivityCompleted`` with ``operator`` and ``reason``) and its audit entry
        (``complete step``, actor ``by`` or ``app``) are one write."""
        if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= INT64_MAX:
            raise ConfigurationError(f"step must be a step number, 1 or more (got {step!r})")
        if not isinstance(reason, str) or not reason.strip():
            raise ConfigurationError("complete_step needs a reason: how the result was confirmed")
        info = await self._peek(run_id, follow=False)
        scheduled = next(
            (
                e
                for e in await self.store.read_history(info.run_id, 0)
                if e.step == step and e.type is EventType.ACTIVITY_SCHEDULED
            ),
            None,
        )
        name = scheduled.data.get("name") if scheduled is not None else None
        what = f"result of step {step} ({name})" if name else f"result of step {step}"
        act = self._activities.get(name) if isinstance(name, str) else None
        if act is not None:  # what the code will read it as: refused now, not on replay
            result = convert(result, act.sig.return_type, what)
        encoded = encode(result, what)
        await self.store.complete_step(info.run_id, step, encoded, by or "app", reason)
        return self.get_run(info.run_id)

    def _alert(self, subject: str, details: dict[str, Any]) -> asyncio.Future[Any]:
        """Tell the alert hook (or the log): ``subject`` is a run id for a run that needs
        an operator (``details`` is its error), else what the alert is about
        (``queue:<name>``, ``workflow:<name>``, ``dead_letters``, ``process``).

        Never blocks the calling loop: an async hook runs as a task, a sync one in a
        thread of its own. Returns the task telling it, done with an exception if the
        hook raised (logged here, sync or async alike). For a run, being told is then
        recorded in the store (an ``alerted`` audit entry), which is how the alert
        watcher knows whom nobody told (``tether.alerts``); ``close`` waits a while for
        the tasks still running."""
        details = {"alert": "needs_intervention", **details}
        run = details["alert"] == "needs_intervention"
        task = asyncio.ensure_future(self._tell(self.on_alert, subject, details, run))
        self._alerts[task] = subject
        if run:
            self._telling[subject] = task

        def done(t: asyncio.Future[Any]) -> None:
            self._alerts.pop(t, None)
            exc = None if t.cancelled() else t.exception()  # retrieved: logged here
            if self._telling.get(subject) is t:
                del self._telling[subject]
                if exc is None and not t.cancelled():
                    self._untold.discard(subject)
                else:  # the watcher need not give this process's hook time: it is over
                    self._untold.add(subject)
            if exc is not None:
                log.error("the on_alert hook failed for %r", subject, exc_info=exc)

        task.add_done_callback(done)
        return task

    async def _tell(
        self,
        hook: Callable[[str, dict[str, Any]], Any] | None,
        subject: str,
        details: dict[str, Any],
        run: bool,
    ) -> None:
        if hook is None:
            if run:
                kind, message = details.get("type"), str(details.get("message") or "")
                # an error the engine made (names and ids only) whole; a user's redacted
                log.error(
                    "run %r needs intervention: %s: %s",
                    subject,
                    kind,
                    redact_error(str(kind), message),
                )
            else:  # the watcher's own words: names and figures, no payload
                log.warning("alert %s on %s: %s", details["alert"], subject, details["message"])
        elif _is_async(hook):
            await hook(subject, details)
        else:
            out = await _in_thread(hook, subject, details)
            if inspect.isawaitable(out):  # a sync callable that returned a coroutine
                await out
        if not run or self._store is None:  # closed meanwhile: a watcher tells it again
            return
        try:
            await self._store.audit(
                "on_alert" if hook is not None else "log",
                "alerted",
                f"run:{subject}",
                {"alert": "needs_intervention"},
            )
        except Exception as exc:
            log.warning(
                "run %r: its operator was told, but that could not be recorded (%s: %s); "
                "an alert watcher may tell it again",
                subject,
                type(exc).__name__,
                exc,
            )

    async def _settle_alerts(self, wait: float) -> None:
        """Wait up to ``wait`` seconds for the alert hooks still running on this loop;
        cancel (and log) those that do not finish by then."""
        loop = asyncio.get_running_loop()
        pending = [t for t in self._alerts if not t.done() and t.get_loop() is loop]
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=wait)
        for task in late:
            subject = self._alerts.get(task, "?")
            log.warning(
                "the on_alert hook for %r did not finish within %gs of the App closing: "
                "abandoned%s",
                subject,
                wait,
                " (not told: an alert watcher tells the run again)"
                if subject in self._telling
                else "",
            )
            task.cancel()
        if late:  # let them take their cancellation (a sync hook's thread runs on)
            await asyncio.wait(late, timeout=1.0)

    async def _wait_finished(
        self, run_id: str, deadline: float | None, may_not_exist: bool = False
    ) -> RunInfo | RunEnd:
        """The run's end: announced by a commit in this process, else read (and polled)."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop)
        with self._waiters_lock:
            self._waiters.setdefault(run_id, []).append(waiter)
            # its end is announced to this waiter (the check and the registration are
            # atomic against _on_commit): nothing to read before it comes
            skip_read = run_id in self._running_here
        try:
            # in-process commits wake us at once; polling covers other processes
            poll = 0.25
            #: read once: later reads poll its status alone (nothing to open, nothing
            #: to decode: thousands of results waited on poll often)
            polled = False
            status: RunStatus | None = None  #: as last read
            failed: StoreError | None = None  #: the last read's store failure
            failing_since = 0.0
            said = -math.inf  #: when a failing store was last logged
            while True:
                waiter.event.clear()  # before the read: a commit during it must still wake us
                end, waiter.end = waiter.end, None
                if end is not None and end.status.is_terminal:
                    return end
                read, skip_read = not skip_read, False
                found = None
                if read:
                    try:
                        if polled:  # a run seen live: its status first, its payloads at its end
                            status = await self.store.run_status(run_id)
                            if status is not None and status.is_terminal:
                                found = await self.store.get_run(run_id)
                                # as read now (purged, or retried, since its status was)
                                status = found.status if found is not None else None
                        else:
                            found = await self.store.get_run(run_id)
                            status = found.status if found is not None else None
                        purged = None if status else await self.store.purged_run(run_id)
                    except StoreError as exc:
                        # it only reads: a store outage (a restart, a dropped connection)
                        # is waited out like the run itself, within the timeout
                        now = loop.time()
                        if failed is None:
                            failing_since = now
                        failed = exc
                        if now - said >= RESULT_STORE_LOG_EVERY:
                            said = now
                            log.warning(
                                "waiting for run %r: the store could not be read "
                                "(failing for %.1f s, still trying): %s",
                                run_id,
                                now - failing_since,
                                exc,
                                extra={"run_id": run_id},
                            )
                    else:
                        failed = None
                        polled = True
                        if status is None:
                            if purged is not None:  # purged while waited on, or before
                                raise RunPurgedError(run_id, *purged)
                            if not may_not_exist:
                                raise RunNotFoundError(run_id)
                if found is not None and found.is_finished:
                    return found
                wait = poll
                if failed is not None:  # back off, but not past the poll's pace for long
                    wait = min(RESULT_STORE_MAX_PAUSE, max(0.1, loop.time() - failing_since))
                if deadline is not None:
                    left = deadline - loop.time()
                    if left <= 0 and read:
                        if failed is not None:
                            raise ResultTimeoutError(
                                f"run {run_id!r}: could not read it before the timeout, "
                                f"the store failing for {loop.time() - failing_since:.1f} s "
                                f"({failed}); it goes on running: call result() again to "
                                "keep waiting"
                            )
                        state = "not started" if status is None else status.value
                        raise ResultTimeoutError(
                            f"run {run_id!r} is still {state} after the timeout; "
                            "it goes on running: call result() again to keep waiting"
                        )
                    wait = max(0.0, min(wait, left))  # not read yet: read before giving up
                try:
                    async with asyncio.timeout(wait):  # no second task, unlike wait_for
                        await waiter.event.wait()
                except TimeoutError:
                    poll = min(1.0, poll * 2)
        finally:
            with self._waiters_lock:
                self._running_here.discard(run_id)
                lst = self._waiters.get(run_id, [])
                if waiter in lst:
                    lst.remove(waiter)
                if not lst:
                    self._waiters.pop(run_id, None)

    # -- workers and the sync facade -------------------------------------------

    def worker(self, **options: Any) -> Worker:
        """A worker for this app; options as for ``tether.Worker``."""
        return Worker(self, **options)

    def run(
        self,
        workflow: Workflow[P, R] | str,
        *args: Any,
        run_id: str | None = None,
        timeout: float | timedelta | None = None,
        **worker_options: Any,
    ) -> R:
        """Run a workflow to completion from synchronous code (scripts, notebooks).

        Starts an in-process worker, starts (or rejoins, by ``run_id``) the run,
        waits for its result and stops the worker.
        """

        async def main() -> R:
            async with self.worker(**worker_options):
                run = await self.start(workflow, *args, run_id=run_id)
                return await run.result(timeout)

        return run_sync(main())


#: a ``result()`` waiting through a store outage logs it at most this often (seconds)
RESULT_STORE_LOG_EVERY = 5.0
#: the longest pause between a ``result()``'s reads while the store fails (seconds)
RESULT_STORE_MAX_PAUSE = 2.0
_MAX_RUNNING_HERE = 10_000  #: runs remembered as running here (a hint, see _wait_finished)
#: the statuses a run ends in that write it to the dead letters (``_finish``)
_DEAD_LETTERED = frozenset({RunStatus.FAILED, RunStatus.NEEDS_INTERVENTION, RunStatus.TIMED_OUT})


class _Waiter:
    """One ``result()`` waiting for a run's end: woken by commits, or by polling."""

    __slots__ = ("end", "event", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.end: RunEnd | None = None  #: set (from the store's thread) before the event


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even under a running loop (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # no loop: run it here, after the except (its errors are not chained to this)
    else:
        return _in_a_thread(coro)
    return asyncio.run(coro)


def _in_a_thread(coro: Coroutine[Any, Any, T]) -> T:
    """``coro`` run to completion on a loop of its own in another thread (this one runs a
    loop already)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    th = threading.Thread(target=target, name="tether-sync")
    th.start()
    th.join()
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def _is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` gives a coroutine (an async function, or an object whose
    ``__call__`` is one, also behind ``functools.partial``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        type(fn).__call__  # an object whose __call__ is async
    )


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a daemon thread of its own (in a copy of this context): the loop
    goes on meanwhile, and a call that never returns holds up neither the default
    executor's threads nor the interpreter's exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()
    ctx = contextvars.copy_context()

    def settle(value: Any, exc: BaseException | None) -> None:
        if fut.done():  # cancelled meanwhile (the App closing)
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    def call() -> None:
        try:
            value, exc = ctx.run(fn, *args), None
        except Exception as e:
            value, exc = None, e
        except BaseException as e:  # SystemExit and the like: not the loop's to raise
            value, exc = None, RuntimeError(f"{type(e).__name__} raised: {e}")
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    name = getattr(fn, "__name__", "hook")
    threading.Thread(target=call, name=f"tether-alert-{name}", daemon=True).start()
    return await fut


def _check_switch(kind: str, name: str) -> None:
    if kind not in SWITCH_KINDS:
        raise ConfigurationError(f"a switch is one of {', '.join(SWITCH_KINDS)} (got {kind!r})")
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"a {kind} switch needs a name (got {name!r})")


def _not_open(status: str, decided_by: str | None) -> str:
    """Why a review takes no decision now (its status says)."""
    if status == "past_deadline":
        return (
            "it is past its deadline (the deadline decides: escalation or the default); "
            "a decision after it is refused and not recorded"
        )
    if status == "deciding":
        return (
            f"another decision was recorded first (by {decided_by!r}) and is on its way to "
            "the run; this one is refused (read the review again: it is decided, or open "
            "again if the run refused that decision)"
        )
    return f"it is {status}, no longer open"
