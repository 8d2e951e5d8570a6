"""The objects ``@app.activity`` and ``@app.workflow`` turn functions into."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

from ._batching import Batch
from ._breaker import CircuitBreaker
from ._errors import ConfigurationError
from ._policy import DEFAULT_RETRY, Retry, seconds
from ._queues import Dependency, check_name, check_priority
from ._serde import Signature
from ._usage import Budget

P = ParamSpec("P")
R = TypeVar("R")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivityOptions:
    """Per-activity settings; ``Activity.options`` overrides them per call.

    Timeouts are layered: ``timeout`` bounds one attempt (start to close),
    ``schedule_timeout`` bounds the whole step including retries and time spent
    queued (schedule to close), and a run deadline (``app.start(deadline=)``)
    bounds the run. ``heartbeat_timeout`` declares that the activity heartbeats:
    if no heartbeat arrives within it, the attempt is presumed dead and retried
    elsewhere, long before a lease would expire.
    """

    retry: Retry = DEFAULT_RETRY
    timeout: float | None = None
    schedule_timeout: float | None = None
    heartbeat_timeout: float | None = None
    queue: str = "default"
    breaker: CircuitBreaker | None = None
    #: higher is claimed first within its queue
    priority: int = 0
    #: the key (e.g. a tenant) for the queue's key_concurrency and fairness, computed
    #: from the call's arguments when the step is scheduled: ``lambda tenant, *a, **k: tenant``
    limit_key: Callable[..., str] | None = None
    #: a shared limiter keyed by e.g. (provider, model, api key): ``tether.Dependency``
    dependency: Dependency | None = None
    #: calls are collected into batches (``tether.Batch``); set at decoration only
    batch: Batch | None = None

    def to_json(self, name: str = "") -> dict[str, Any]:
        """The options as stored with an activity task."""
        return {
            "breaker": self.breaker.to_json(name) if self.breaker else None,
            "timeout": self.timeout,
            "schedule_timeout": self.schedule_timeout,
            "heartbeat_timeout": self.heartbeat_timeout,
            "retry": self.retry.to_json(),
        }

    def scheduling(self, name: str, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``priority`` and ``limit_key`` for one call, as recorded in ActivityScheduled."""
        out: dict[str, Any] = {}
        if self.priority:
            out["priority"] = self.priority
        if self.limit_key is not None:
            try:
                key = self.limit_key(*args, **kwargs)
            except Exception as exc:
                raise ConfigurationError(
                    f"limit_key of activity {name!r} failed on this call's arguments: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(key, str):
                raise ConfigurationError(
                    f"limit_key of activity {name!r} must return a string, "
                    f"got {type(key).__name__} ({key!r})"
                )
            out["limit_key"] = key
        if self.dependency is not None:
            out["dependency"] = self.dependency.limiter(name, args, kwargs)
            out["dependency_limits"] = self.dependency.limits.to_json()
        if self.batch is not None:
            out["batch"] = self.batch.scheduling(name, args, kwargs)
        return out

    def replace(
        self,
        *,
        what: str,
        retry: Retry | None = None,
        timeout: float | timedelta | None = None,
        schedule_timeout: float | timedelta | None = None,
        heartbeat_timeout: float | timedelta | None = None,
        queue: str | None = None,
        breaker: CircuitBreaker | None = None,
        priority: int | None = None,
        limit_key: Callable[..., str] | None = None,
        dependency: Dependency | None = None,
    ) -> ActivityOptions:
        """A copy with the given options changed, each validated."""
        changes: dict[str, Any] = {}
        if dependency is not None:
            if not isinstance(dependency, Dependency):
                raise ConfigurationError(
                    f"dependency= of {what} takes a tether.Dependency, "
                    f"got {type(dependency).__name__}"
                )
            changes["dependency"] = dependency
        if priority is not None:
            changes["priority"] = check_priority(priority, what)
        if limit_key is not None:
            if not callable(limit_key):
                raise ConfigurationError(
                    f"limit_key of {what} takes a function of the activity's arguments "
                    f"returning a string (e.g. lambda tenant, *a, **k: tenant), "
                    f"got {type(limit_key).__name__}"
                )
            changes["limit_key"] = limit_key
        if breaker is not None:
            if not isinstance(breaker, CircuitBreaker):
                raise ConfigurationError(
                    f"breaker= of {what} takes a tether.CircuitBreaker, "
                    f"got {type(breaker).__name__}"
                )
            changes["breaker"] = breaker
        if retry is not None:
            if not isinstance(retry, Retry):
                raise ConfigurationError(
                    f"retry= of {what} takes a tether.Retry, got {type(retry).__name__}"
                )
            changes["retry"] = retry
        for field, value in (
            ("timeout", timeout),
            ("schedule_timeout", schedule_timeout),
            ("heartbeat_timeout", heartbeat_timeout),
        ):
            if value is not None:
                s = seconds(value, f"{field} of {what}")
                if not s:
                    raise ConfigurationError(f"{field} of {what} must be positive")
                changes[field] = s
        if queue is not None:
            changes["queue"] = check_name(queue, f"queue of {what}")
        return dataclasses.replace(self, **changes)


class WorkflowSide(Protocol):
    """What definitions ask of the workflow instance running them (its commands)."""

    def schedule_activity(
        self, activity: Activity[Any, Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> asyncio.Future[Any]: ...

    def start_child(
        self,
        workflow: Workflow[Any, Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        run_id: str | None,
        parent_close: str = "terminate",
        budget: Budget | None = None,
    ) -> asyncio.Future[Any]: ...


#: the workflow instance whose code runs now (set by the workflow side while it runs
#: that code); definitions read it here, so they never import the workflow side
running: contextvars.ContextVar[WorkflowSide | None] = contextvars.ContextVar(
    "tether_workflow_instance", default=None
)


def _current() -> WorkflowSide | None:
    """The workflow instance running now, if any."""
    return running.get()


class Activity(Generic[P, R]):
    """A function whose calls inside a workflow become recorded steps.

    Inside a workflow, calling it schedules the step and returns an awaitable of
    its recorded result; on replay the recorded result comes back at once.
    Outside a workflow it simply runs the function (handy in unit tests).
    """

    def __init__(self, fn: Callable[P, Any], *, name: str, options: ActivityOptions) -> None:
        self.fn = fn
        self.name = name
        self.opts = options
        self.sig = Signature(fn)
        self.is_async = inspect.iscoroutinefunction(fn)
        #: ``options.to_json(name)``, made once: recorded with every call (never mutated)
        self.options_json: dict[str, Any] = options.to_json(name)
        #: parameters replay does not compare with the recorded call (context a wrapped
        #: library makes anew on every run, such as an agent framework's run context);
        #: every other argument must equal the recorded one
        self.replay_unchecked: frozenset[str] = frozenset()
        self.__doc__ = fn.__doc__
        self.__wrapped__: Callable[..., Any] = fn  #: the registered function

    def options(
        self,
        *,
        retry: Retry | None = None,
        timeout: float | timedelta | None = None,
        schedule_timeout: float | timedelta | None = None,
        heartbeat_timeout: float | timedelta | None = None,
        queue: str | None = None,
        priority: int | None = None,
        limit_key: Callable[..., str] | None = None,
        dependency: Dependency | None = None,
    ) -> Activity[P, R]:
        """A copy of this activity with some options changed, for one call site."""
        opts = self.opts.replace(
            what=f"activity {self.name!r}",
            retry=retry,
            timeout=timeout,
            schedule_timeout=schedule_timeout,
            heartbeat_timeout=heartbeat_timeout,
            queue=queue,
            priority=priority,
            limit_key=limit_key,
            dependency=dependency,
        )
        copy: Activity[P, R] = Activity(self.fn, name=self.name, options=opts)
        copy.replay_unchecked = self.replay_unchecked
        return copy

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R]:
        inst = _current()
        if inst is None:
            return self.fn(*args, **kwargs)  # type: ignore[no-any-return]
        return inst.schedule_activity(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<tether activity {self.name}>"


#: what happens to a running child when its parent run ends first
PARENT_CLOSE = ("terminate", "cancel", "abandon")
#: joins a continue-as-new chain's first id and a run's number in it (``nightly~3``);
#: reserved, so a user's run id never collides with a chain's
CHAIN_SEPARATOR = "~"


def chain_of(run_id: str) -> tuple[str, int]:
    """The first id of ``run_id``'s continue-as-new chain and its place in it (0: first)."""
    base, sep, n = run_id.rpartition(CHAIN_SEPARATOR)
    return (base, int(n)) if sep and n.isdigit() else (run_id, 0)


#: the longest run id a user may choose (chains and forks append to it)
MAX_RUN_ID = 200


def check_signal_name(name: str) -> None:
    """Refuse a signal name no workflow could wait for (``check_name``'s rules)."""
    check_name(name, "signal name")


#: the longest id a signal or update may carry (``check_signal_id``)
MAX_SIGNAL_ID = 255


def check_signal_id(signal_id: str, what: str = "signal_id") -> None:
    """Refuse an id a signal or update cannot carry: 1-255 printable characters."""
    if (
        not isinstance(signal_id, str)
        or not signal_id
        or len(signal_id) > MAX_SIGNAL_ID
        or not signal_id.isprintable()
    ):
        raise ConfigurationError(
            f"{what} must be 1-{MAX_SIGNAL_ID} printable characters (got {signal_id!r:.80})"
        )


def dot_parts_error(what: str, choose: str) -> ConfigurationError:
    """The error for ``what`` (a run id, or what makes one) with a dot part."""
    return ConfigurationError(
        f"{what} has an empty, '.' or '..' part between slashes, which URLs resolve away "
        f"(/runs/a/../b is /runs/b, another run): choose {choose} without one (dots "
        "inside a part, as in 'a/v1.2', are fine)"
    )


def dot_parts(run_id: str) -> bool:
    """Whether ``run_id`` has a part between slashes that is empty, '.' or '..': new
    runs may not (entity keys and schedule ids make run ids too)."""
    return any(part in ("", ".", "..") for part in run_id.split("/"))


def check_run_id(run_id: str) -> None:
    """Refuse a run id a user may not choose (empty, in the chains' namespace, or with a
    part between slashes that URLs resolve away). Only new ids are checked: runs an
    older version accepted are read and steered as before."""
    check_name(run_id, "run id", MAX_RUN_ID)
    if dot_parts(run_id):
        raise dot_parts_error(f"run id {run_id!r}", "an id")
    if CHAIN_SEPARATOR in run_id:
        raise ConfigurationError(
            f"run id {run_id!r} contains {CHAIN_SEPARATOR!r}, which tether reserves for the "
            f"runs of a continue-as-new chain ({run_id.split(CHAIN_SEPARATOR)[0]}"
            f"{CHAIN_SEPARATOR}1, ...): choose an id without it"
        )


class Workflow(Generic[P, R]):
    """An async function run durably: replayed from its history after any crash.

    Called inside another workflow it starts a child run and returns an awaitable
    of the child's result. Called outside, it returns the plain coroutine.
    """

    def __init__(
        self,
        fn: Callable[P, Awaitable[R]],
        *,
        name: str,
        queue: str,
        version: str | None = None,
        child_run_id: str | None = None,
        parent_close: str = "terminate",
        retention: float | None = None,
        child_budget: Budget | None = None,
    ) -> None:
        if not inspect.iscoroutinefunction(fn):
            raise ConfigurationError(
                f"@workflow needs an 'async def' function; {name!r} is not a coroutine function"
            )
        self.fn = fn
        self.name = name
        self.queue = queue
        self.version = version
        #: seconds an ended run is kept before workers purge it (None: kept until purged)
        self.retention = retention
        self.sig = Signature(fn)
        self._child_run_id = child_run_id
        self._parent_close = parent_close
        self._child_budget = child_budget
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def options(
        self,
        *,
        run_id: str | None = None,
        queue: str | None = None,
        parent_close: str | None = None,
        budget: Budget | None = None,
    ) -> Workflow[P, R]:
        """A copy for starting a child with a chosen run id, queue, parent-close policy
        or model budget.

        ``parent_close`` says what happens to the child when its parent run ends first:
        ``"terminate"`` (the default: it ends at once, running none of its code),
        ``"cancel"`` (it sees CancelledError and may clean up) or ``"abandon"`` (it runs
        on by itself). ``budget`` (a ``tether.Budget``) bounds the child's model calls;
        a parent with a budget gives its child what it has left, or ``budget`` when
        that is less, and counts what the child spent.
        """
        if run_id is not None:
            check_run_id(run_id)
        if budget is not None and not isinstance(budget, Budget):
            raise ConfigurationError(
                f"budget must be a tether.Budget(tokens=, cost=) (got {type(budget).__name__})"
            )
        if parent_close is not None and parent_close not in PARENT_CLOSE:
            raise ConfigurationError(
                f"parent_close must be one of {', '.join(map(repr, PARENT_CLOSE))} "
                f"(got {parent_close!r})"
            )
        return Workflow(
            self.fn,
            name=self.name,
            queue=queue or self.queue,
            version=self.version,
            child_run_id=run_id,
            parent_close=parent_close or self._parent_close,
            retention=self.retention,
            child_budget=budget or self._child_budget,
        )

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R]:
        inst = _current()
        if inst is None:
            return self.fn(*args, **kwargs)
        return inst.start_child(
            self, args, kwargs, self._child_run_id, self._parent_close, self._child_budget
        )

    def __repr__(self) -> str:
        return f"<tether workflow {self.name}>"
