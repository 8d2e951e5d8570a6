"""The objects ``@app.activity`` and ``@app.workflow`` turn functions into."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from ._errors import ConfigurationError
from ._policy import DEFAULT_RETRY, Retry, seconds
from ._serde import Signature

if TYPE_CHECKING:
    from .workflow._instance import WorkflowInstance

P = ParamSpec("P")
R = TypeVar("R")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivityOptions:
    """Per-activity settings; ``Activity.options`` overrides them per call."""

    retry: Retry = DEFAULT_RETRY
    timeout: float | None = None  #: seconds per attempt (start to close)
    queue: str = "default"

    def to_json(self) -> dict[str, Any]:
        """The options as stored with an activity task."""
        r = self.retry
        return {
            "timeout": self.timeout,
            "retry": {
                "attempts": r.attempts,
                "initial": seconds(r.initial, "initial"),
                "backoff": r.backoff,
                "max_interval": seconds(r.max_interval, "max_interval"),
                "jitter": r.jitter,
            },
        }


def _current() -> WorkflowInstance | None:
    from .workflow._instance import current_instance

    return current_instance()


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
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def options(
        self,
        *,
        retry: Retry | None = None,
        timeout: float | timedelta | None = None,
        queue: str | None = None,
    ) -> Activity[P, R]:
        """A copy of this activity with some options changed, for one call site."""
        opts = self.opts
        if retry is not None:
            opts = dataclasses.replace(opts, retry=retry)
        if timeout is not None:
            t = seconds(timeout, f"timeout of activity {self.name!r}")
            if not t:
                raise ConfigurationError(f"timeout of activity {self.name!r} must be positive")
            opts = dataclasses.replace(opts, timeout=t)
        if queue is not None:
            opts = dataclasses.replace(opts, queue=queue)
        copy: Activity[P, R] = Activity(self.fn, name=self.name, options=opts)
        return copy

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R]:
        inst = _current()
        if inst is None:
            return self.fn(*args, **kwargs)  # type: ignore[no-any-return]
        return inst.schedule_activity(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<tether activity {self.name}>"


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
    ) -> None:
        if not inspect.iscoroutinefunction(fn):
            raise ConfigurationError(
                f"@workflow needs an 'async def' function; {name!r} is not a coroutine function"
            )
        self.fn = fn
        self.name = name
        self.queue = queue
        self.version = version
        self.sig = Signature(fn)
        self._child_run_id = child_run_id
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def options(self, *, run_id: str | None = None, queue: str | None = None) -> Workflow[P, R]:
        """A copy for starting a child with a chosen run id or queue."""
        return Workflow(
            self.fn,
            name=self.name,
            queue=queue or self.queue,
            version=self.version,
            child_run_id=run_id,
        )

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R]:
        inst = _current()
        if inst is None:
            return self.fn(*args, **kwargs)
        return inst.start_child(self, args, kwargs, self._child_run_id)

    def __repr__(self) -> str:
        return f"<tether workflow {self.name}>"
