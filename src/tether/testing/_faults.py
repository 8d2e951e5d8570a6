"""Fault injection: make a registered activity misbehave for the length of a test.

    from tether.testing import Env, Fail, RateLimit, inject

    with inject(app, "classify", Fail(times=2, exc=ConnectionError("blip"))) as fault:
        async with Env(app):
            run = await app.start(pipeline, "text")
            assert await run.result(timeout=5) == "positive"
    assert fault.injected == 2 and fault.passed == 1

``inject`` swaps the App's registry entry for the activity (the worker looks
activities up by name, so every attempt goes through the fault) and restores it on
exit. Several faults on one activity act in order: the first with budget left
handles the call. Every fault counts what it did (``calls``, ``injected``,
``passed``) for assertions.

Kinds: ``Fail`` (raise N times, then succeed), ``RateLimit`` (an HTTP 429 with
Retry-After, as an SDK would raise), ``Hang`` (block until the attempt timeout),
``Malformed`` (replace the result), ``Duplicate`` (deliver the task twice: run the
real function twice in one attempt, to prove it idempotent). ``crash_after_writes``
kills an in-process worker's store after its Nth write; ``exit_after_writes`` (or
the ``TETHER_CRASH_AFTER_WRITES`` environment variable read by
``install_crash_from_env``) makes a worker *process* exit with status 137 instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .._app import App
from .._definitions import Activity
from .._errors import ConfigurationError
from ._crash import _HOUSEKEEPING
from ._env import Env, SimulatedCrash

#: the environment variable ``install_crash_from_env`` reads
CRASH_ENV = "TETHER_CRASH_AFTER_WRITES"


class _Call:
    """One call of the wrapped activity: the real function and its arguments."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.is_async = inspect.iscoroutinefunction(fn)

    async def real(self) -> Any:
        if self.is_async:
            return await self.fn(*self.args, **self.kwargs)
        return self.fn(*self.args, **self.kwargs)


@dataclass
class Fault:
    """Base of every fault: acts on the first ``times`` calls (None: on every call)."""

    times: int | None = 1
    #: calls that reached this fault
    calls: int = field(default=0, init=False)
    #: calls on which the fault acted
    injected: int = field(default=0, init=False)
    #: calls passed to the real function untouched
    passed: int = field(default=0, init=False)
    _released: threading.Event = field(default_factory=threading.Event, init=False, repr=False)

    def __post_init__(self) -> None:
        times = self.times
        if times is not None and (
            isinstance(times, bool) or not isinstance(times, int) or times < 0
        ):
            raise ConfigurationError(
                f"times= of {type(self).__name__} must be a whole number, 0 or more, or None "
                f"for every call (got {times!r})"
            )

    @property
    def exhausted(self) -> bool:
        """Whether the fault has acted ``times`` times already."""
        return self.times is not None and self.injected >= self.times

    async def act(self, call: _Call) -> Any:
        """Misbehave on one call (runs in the activity's thread for sync activities)."""
        raise NotImplementedError

    def act_sync(self, call: _Call) -> Any:
        """The sync version of ``act`` (sync activities run in the worker's thread pool)."""
        return asyncio.run(self.act(call))


def _default_exc() -> BaseException:
    return ConnectionError("injected fault: connection reset")


@dataclass
class Fail(Fault):
    """Raise ``exc`` (an exception, or a function making one) ``times`` times, then succeed."""

    exc: BaseException | Callable[[], BaseException] = field(default_factory=_default_exc)

    def _make(self) -> BaseException:
        exc = self.exc
        made = exc if isinstance(exc, BaseException) else exc()
        # a fresh copy each time: a raised exception carries its traceback along
        try:
            return copy.copy(made)
        except Exception:
            return made

    async def act(self, call: _Call) -> Any:
        raise self._make()

    def act_sync(self, call: _Call) -> Any:
        raise self._make()


class _Response:
    def __init__(self, status_code: int, headers: dict[str, str]) -> None:
        self.status_code = status_code
        self.headers = headers


class InjectedHTTPError(Exception):
    """What ``RateLimit`` raises: shaped like an httpx/SDK error (``status_code``, ``response``)."""

    def __init__(self, status_code: int, headers: dict[str, str], message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.response = _Response(status_code, headers)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status_code, self.response.headers, str(self)))


@dataclass
class RateLimit(Fault):
    """Answer HTTP 429 with ``Retry-After: retry_after`` (seconds) ``times`` times."""

    retry_after: float = 2.0
    status_code: int = 429

    def _make(self) -> InjectedHTTPError:
        value = f"{self.retry_after:g}"
        return InjectedHTTPError(
            self.status_code,
            {"retry-after": value},
            f"injected fault: HTTP {self.status_code} (retry after {value}s)",
        )

    async def act(self, call: _Call) -> Any:
        raise self._make()

    def act_sync(self, call: _Call) -> Any:
        raise self._make()


@dataclass
class Hang(Fault):
    """Never answer (for at most ``seconds``): the activity's attempt timeout must end it.

    An async activity sleeps and is cancelled by the timeout. A sync one blocks its
    thread (Python cannot kill threads), bounded by ``seconds`` and released as soon
    as the injection ends, so a test never leaks a stuck thread for long.
    """

    seconds: float = 60.0

    async def act(self, call: _Call) -> Any:
        await asyncio.sleep(self.seconds)
        raise TimeoutError(f"injected hang of {self.seconds}s ended without a timeout")

    def act_sync(self, call: _Call) -> Any:
        self._released.wait(self.seconds)
        raise TimeoutError(f"injected hang of {self.seconds}s ended without a timeout")


@dataclass
class Malformed(Fault):
    """Run the real function, then return ``value`` instead of its result ``times`` times.

    ``value`` may be a function of the real result (``lambda r: r[:3]``) to corrupt
    it rather than replace it.
    """

    value: Any = None

    def _replace(self, result: Any) -> Any:
        return self.value(result) if callable(self.value) else copy.deepcopy(self.value)

    async def act(self, call: _Call) -> Any:
        return self._replace(await call.real())

    def act_sync(self, call: _Call) -> Any:
        return self._replace(call.fn(*call.args, **call.kwargs))


@dataclass
class Duplicate(Fault):
    """Deliver the task twice: run the real function twice in one attempt, return the second.

    An idempotent activity (one that uses its idempotency key) applies its effect once.
    """

    async def act(self, call: _Call) -> Any:
        await call.real()
        return await call.real()

    def act_sync(self, call: _Call) -> Any:
        call.fn(*call.args, **call.kwargs)
        return call.fn(*call.args, **call.kwargs)


@dataclass
class Injection:
    """Faults injected into one activity; counts summed over its faults."""

    name: str
    faults: list[Fault]
    #: every call of the activity while injected
    calls: int = 0

    @property
    def injected(self) -> int:
        """Calls on which some fault acted."""
        return sum(f.injected for f in self.faults)

    @property
    def passed(self) -> int:
        """Calls that ran the real function untouched."""
        return self.calls - self.injected


def _pick(inj: Injection) -> Fault | None:
    for f in inj.faults:
        if not f.exhausted:
            f.calls += 1
            f.injected += 1
            return f
    for f in inj.faults:
        f.calls += 1
        f.passed += 1
    return None


def _wrap(act: Activity[Any, Any], inj: Injection, lock: threading.Lock) -> Activity[Any, Any]:
    real = act.fn
    if act.is_async:

        async def afn(*args: Any, **kwargs: Any) -> Any:
            with lock:
                inj.calls += 1
                fault = _pick(inj)
            call = _Call(real, args, kwargs)
            if fault is None:
                return await call.real()
            return await fault.act(call)

        fn: Callable[..., Any] = afn
    else:

        def sfn(*args: Any, **kwargs: Any) -> Any:
            with lock:
                inj.calls += 1
                fault = _pick(inj)
            call = _Call(real, args, kwargs)
            if fault is None:
                return real(*args, **kwargs)
            return fault.act_sync(call)

        fn = sfn
    wrapped = copy.copy(act)  # same name, options and signature; only the function differs
    wrapped.fn = fn
    return wrapped


class Faults:
    """Inject faults into several activities of an App; restores them all on exit.

    with Faults(app) as faults:
        flaky = faults.inject("fetch", Fail(times=2))
        slow = faults.inject("summarise", Hang())
        ...
    """

    def __init__(self, app: App) -> None:
        self.app = app
        self.injections: dict[str, Injection] = {}
        self._originals: dict[str, Activity[Any, Any]] = {}
        self._lock = threading.Lock()

    def inject(self, activity: str | Activity[Any, Any], *faults: Fault) -> Injection:
        """Make ``activity`` (a name or the activity) go through ``faults``, in order."""
        if not faults:
            raise ConfigurationError("inject() needs at least one fault (Fail(), Hang(), ...)")
        for f in faults:
            if not isinstance(f, Fault):
                raise ConfigurationError(
                    f"inject() takes faults such as Fail() or RateLimit(), got {f!r}"
                )
        name = activity if isinstance(activity, str) else activity.name
        if name in self.injections:
            raise ConfigurationError(f"activity {name!r} already has faults injected")
        original = self.app.get_activity(name)
        inj = Injection(name, list(faults))
        self._originals[name] = original
        self.injections[name] = inj
        self.app._activities[name] = _wrap(original, inj, self._lock)
        return inj

    def restore(self) -> None:
        """Put every original activity back and release hung sync faults."""
        for name, original in self._originals.items():
            self.app._activities[name] = original
            for f in self.injections[name].faults:
                f._released.set()
        self._originals.clear()

    def __enter__(self) -> Faults:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


@contextlib.contextmanager
def inject(app: App, activity: str | Activity[Any, Any], *faults: Fault) -> Iterator[Injection]:
    """Inject ``faults`` into one activity of ``app`` for the ``with`` block."""
    with Faults(app) as f:
        yield f.inject(activity, *faults)


# -- crashes ---------------------------------------------------------------------------


def _counts(fn: Any, write: bool) -> bool:
    name = getattr(fn, "__name__", "")
    return write and name not in _HOUSEKEEPING and not name.startswith("_claim")


class StoreCrash:
    """The store of an in-process worker dies after its Nth state-changing write.

    Made by ``crash_after_writes``. Write N commits; from then on every store call
    raises ``SimulatedCrash`` (claims and lease renewals are not counted, as in
    ``crash_at_every_step``). ``await crash.recover(env)`` kills the Env's worker
    like a SIGKILL, revives the store, moves the clock past every lease and starts
    a new worker, which must finish the run.
    """

    def __init__(self, app: App, writes: int) -> None:
        if writes < 1:
            raise ConfigurationError("crash_after_writes needs writes >= 1")
        self.app = app
        self.after = writes
        #: state-changing writes seen so far
        self.writes = 0
        #: whether the store has 'died'
        self.crashed = False
        self._event = asyncio.Event()
        store: Any = app.store
        self._store = store
        self._original = store._do

        async def do(fn: Any, *args: Any, write: bool = True) -> Any:
            if self.crashed:
                raise SimulatedCrash()
            result = await self._original(fn, *args, write=write)
            if _counts(fn, write):
                self.writes += 1
                if self.writes >= self.after:
                    self.crashed = True
                    self._event.set()
            return result

        store._do = do

    async def wait(self, timeout: float = 10.0) -> bool:
        """Wait (real time) until the crash happened; False if it did not in time."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
        return self.crashed

    def disarm(self) -> None:
        """Revive the store (the process 'restarted')."""
        self._store._do = self._original

    async def recover(self, env: Env, *, lease_expiry: float = 60.0) -> None:
        """Kill the Env's dead worker, revive the store and start a fresh worker."""
        if env.worker is not None:
            await env.worker.kill()
        self.disarm()
        env.clock.advance(lease_expiry)  # past every lease the dead worker held
        env.worker = self.app.worker(**env._worker_options)
        await env.worker.start()
        env._wake()


def crash_after_writes(app: App, writes: int) -> StoreCrash:
    """Kill ``app``'s store (in-process) right after its ``writes``-th state-changing write."""
    return StoreCrash(app, writes)


def exit_after_writes(app: App, writes: int, code: int = 137) -> None:
    """Make this *process* exit (``os._exit(code)``, no cleanup) after write ``writes``.

    For subprocess tests: a worker module calls it (or ``install_crash_from_env``)
    before serving, the test waits for the exit status, then starts a clean worker.
    """
    if writes < 1:
        raise ConfigurationError("exit_after_writes needs writes >= 1")
    store: Any = app.store
    original = store._do
    seen = [0]

    async def do(fn: Any, *args: Any, write: bool = True) -> Any:
        result = await original(fn, *args, write=write)
        if _counts(fn, write):
            seen[0] += 1
            if seen[0] >= writes:
                os._exit(code)
        return result

    store._do = do


def install_crash_from_env(app: App, var: str = CRASH_ENV) -> int | None:
    """``exit_after_writes(app, N)`` when the environment sets ``var`` to N; returns N."""
    raw = os.environ.get(var)
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ConfigurationError(f"{var} must be a number of store writes, got {raw!r}") from None
    exit_after_writes(app, n)
    return n
