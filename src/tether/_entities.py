"""Durable entities: one object per key whose operations run one at a time.

``@app.entity`` turns a class into a workflow ``entity:<Name>``; each key is one run
(``entity:<Name>:<key>``, a continue-as-new chain) that holds the object and applies
each operation as an update: the operation's arguments are recorded when it is asked
for, and the object's new state and the operation's result are recorded in the same
commit, so an operation is applied exactly once, in the order the store received it,
however many workers, crashes and callers there are. ``call`` waits for the result,
``signal`` does not; the first operation on a key creates its run (signal-with-start,
so concurrent first calls make one entity). Every ``ops_per_run`` operations the run
continues as new with the object's state, so histories stay short.

Operations are plain (synchronous) methods: deterministic code on the object's state.
An operation that raises changes nothing: the state goes back to exactly what it was
before it (a copy made by the walk that checks the state after each operation), and
its error is its recorded outcome. Operations recorded before the run's code first ran
are applied in the order they arrived. To start work from one, start a workflow without
waiting: ``some_workflow.options(parent_close="abandon", run_id=...)(args)``. The limit: an
entity serialises its own operations, not the effects they cause elsewhere (a
workflow it starts, a payment a caller makes after reading it); those still need
idempotency keys or a destination that rejects stale writes.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import math
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from ._definitions import CHAIN_SEPARATOR, chain_of, check_signal_id, dot_parts, dot_parts_error
from ._errors import (
    NOT_RUN_YET,
    ConfigurationError,
    PayloadError,
    QueryError,
    RunNotFoundError,
    UpdateRejectedError,
)
from ._history import UPDATE_SIGNAL, RunInfo
from ._serde import encode
from .workflow._api import continue_as_new, on_query, on_update
from .workflow._instance import WorkflowInstance, current_instance

C = TypeVar("C", bound=type)

#: the prefix of an entity's workflow name; its runs are ``<prefix><Name>:<key>``
PREFIX = "entity:"
#: keys are at most this long
MAX_KEY = 150
#: the patch marker a run records the first time one of its operations raises (its
#: changes are undone); runs whose history passed such a failure without it replay the
#: old way (the failed operation's changes kept) until they continue as new
ATOMIC_OPERATIONS = "tether.entity-rollback"


def _rolls_back(inst: WorkflowInstance | None) -> bool:
    """Whether an operation that raised in this run is undone (see ATOMIC_OPERATIONS)."""
    return inst is None or inst.patched(ATOMIC_OPERATIONS)


def operations(cls: type) -> dict[str, Callable[..., Any]]:
    """An entity class's operations: its public, synchronous methods. The class must be
    made with no arguments (its first operation makes it so)."""
    try:
        inspect.signature(cls).bind()
    except TypeError as exc:
        raise ConfigurationError(
            f"entity {cls.__name__}: __init__ must take no arguments (an entity is made "
            f"with none at its first operation; {exc}): give its parameters defaults, or "
            "set them with an operation"
        ) from None
    except ValueError:  # no signature to read (a builtin base): made at run time
        pass
    ops: dict[str, Callable[..., Any]] = {}
    for name in dir(cls):
        kind = inspect.getattr_static(cls, name, None)
        if not name.startswith("_") and isinstance(kind, staticmethod | classmethod):
            raise ConfigurationError(
                f"entity {cls.__name__}: {name!r} is a {type(kind).__name__}; operations "
                "are plain methods of the object: make it one, or a private helper "
                "(a name starting with '_')"
            )
    for name, member in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_"):
            continue
        if inspect.iscoroutinefunction(member):
            raise ConfigurationError(
                f"entity {cls.__name__}: operation {name!r} is async; operations are plain "
                "methods (deterministic changes of the state); start a workflow from one "
                "to do I/O"
            )
        ops[name] = member
    if not ops:
        raise ConfigurationError(f"entity {cls.__name__} has no public methods (operations)")
    return ops


def entity_workflow(cls: type, ops_per_run: int) -> Callable[..., Any]:
    """The workflow function that holds one object of ``cls`` and applies operations."""
    ops = operations(cls)

    async def entity(state: dict[str, Any] | None = None) -> None:
        inst = current_instance()
        if inst is not None:
            inst.hot = True  # kept in a worker's cache between operations: no replays
        obj: Any = object.__new__(cls)
        if state is None:
            obj.__init__()
        else:
            obj.__dict__.update(state)
        # the state before the next operation, put back if it raises: a copy, as nested
        # lists and dicts are changed in place (plain JSON values: made by the walk that
        # checks them after each operation; anything else, as __init__ may leave: deep)
        saved = _snapshot(obj.__dict__)
        applied = 0
        full = asyncio.get_running_loop().create_future()

        def bind(name: str) -> Callable[..., Any]:
            method = ops[name]

            def apply(*args: Any) -> Any:
                nonlocal applied, saved
                try:
                    out = method(obj, *args)
                    after = _plain_copy(obj.__dict__)
                    if after is None:
                        check_state(cls.__name__, name, obj.__dict__)  # raises, naming it
                        after = copy.deepcopy(obj.__dict__)  # (not reached)
                except Exception:
                    if _rolls_back(inst):
                        obj.__dict__.clear()
                        obj.__dict__.update(_snapshot(saved))  # saved stays apart
                    else:  # a run recorded before operations were undone: kept
                        saved = _snapshot(obj.__dict__)
                    raise
                saved = after
                applied += 1
                if applied >= ops_per_run and not full.done():
                    full.set_result(None)
                return out

            return apply

        handlers = {name: bind(name) for name in ops}
        if inst is not None:  # operations that came first: applied in arrival order
            inst.register_updates(handlers)
        else:
            for name, handler in handlers.items():
                on_update(name, handler)
        on_query("state", lambda: dict(obj.__dict__))
        await full
        # every update that came with the last ones was applied (synchronously) first
        continue_as_new(dict(obj.__dict__))

    entity.__name__ = entity.__qualname__ = f"entity_{cls.__name__}"
    entity.__doc__ = cls.__doc__
    return entity


#: the types an entity's state may hold: they come back as themselves from JSON
_PLAIN = (str, int, float, bool, type(None))


class _NotPlain(Exception):
    """A value JSON would not give back as itself (``_plain_copy``)."""


def _copy(value: Any) -> Any:
    kind = type(value)
    if kind is dict:
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise _NotPlain
            out[k] = _copy(v)
        return out
    if kind is list:
        return [_copy(v) for v in value]
    if kind is float:
        if math.isfinite(value):
            return value
        raise _NotPlain
    if kind in _PLAIN:
        return value  # immutable: shared
    raise _NotPlain


def _plain_copy(state: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of ``state`` (new dicts and lists, the same immutable leaves) when it holds
    only values JSON gives back as themselves, else None: the check of ``check_state``
    and the copy in one walk, cheaper than that check alone (it names no paths)."""
    try:
        copied: dict[str, Any] = _copy(state)
    except _NotPlain:
        return None
    return copied


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` that its owner's changes cannot reach."""
    plain = _plain_copy(state)
    return plain if plain is not None else copy.deepcopy(state)


def _not_plain(value: Any, path: str) -> tuple[str, str] | None:
    """The path and type name of the first part of ``value`` that JSON would not give
    back as itself (a set or tuple comes back a list, an int key a str...), or None."""
    kind = type(value)
    if kind is dict:
        for k, v in value.items():
            if type(k) is not str:
                return f"{path} (key {k!r})", f"{type(k).__name__} key"
            found = _not_plain(v, f"{path}[{k!r}]")
            if found:
                return found
        return None
    if kind is list:
        for i, v in enumerate(value):
            found = _not_plain(v, f"{path}[{i}]")
            if found:
                return found
        return None
    if kind in _PLAIN:
        if kind is float and not math.isfinite(value):
            return path, f"non-finite float {value!r}"
        return None
    return path, kind.__name__


def check_state(entity: str, op: str, state: dict[str, Any]) -> None:
    """Refuse a state that would not come back as itself when the run continues as new
    (its input is JSON): the operation that left it fails, naming the attribute."""
    for attr, value in state.items():
        found = _not_plain(value, attr)
        if found is not None:
            where, kind = found
            raise PayloadError(
                f"entity {entity}: operation {op!r} left attribute {attr!r} holding a {kind} "
                f"(at {where}), which would not come back as itself from the stored state; "
                "keep only JSON values in an entity (dict with str keys, list, str, int, "
                "float, bool, None), e.g. a sorted list for a set"
            )


def check_key(key: str) -> None:
    """Entity keys name runs: short, printable, and without the continue-as-new chain
    separator (``k~1`` names key ``k``'s next run)."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY or not key.isprintable():
        raise ConfigurationError(f"entity key must be 1-{MAX_KEY} printable characters")
    if CHAIN_SEPARATOR in key:
        raise ConfigurationError(
            f"entity key {key!r} contains {CHAIN_SEPARATOR!r}, which tether reserves for the "
            f"runs of a continue-as-new chain (an entity's next run): choose a key without it"
        )


class EntityRef:
    """One entity (a class and a key): call or signal its operations, read its state."""

    def __init__(self, app: Any, name: str, ops: frozenset[str], key: str) -> None:
        check_key(key)
        self.app = app  #: the App (typed loosely: that module imports this one)
        self.name = name
        self.key = key
        self.ops = ops
        self.run_id = f"{PREFIX}{name}:{key}"

    async def call(
        self, op: str, *args: Any, timeout: float | None = 60.0, update_id: str | None = None
    ) -> Any:
        """Apply ``op(*args)`` and return its result (``UpdateFailedError`` if it raised).
        With an ``update_id`` that already arrived for this entity, nothing is applied
        again: this waits for the first one's outcome (``App.update``)."""
        return await self._call(op, args, timeout, update_id)

    async def _call(
        self,
        op: str,
        args: tuple[Any, ...],
        timeout: float | None,
        update_id: str | None,
        recorded: Callable[[], None] | None = None,
    ) -> Any:
        """``call``; ``recorded`` is called once the operation is recorded (``App._update``)."""
        uid, (target, seq), _new = await self._send(op, args, update_id)
        if recorded is not None:
            recorded()
        return await self.app._update_outcome(target, uid, op, timeout, seq)

    async def signal(self, op: str, *args: Any, update_id: str | None = None) -> bool:
        """Ask for ``op(*args)`` without waiting: recorded when this returns, applied in
        order with the entity's other operations. False (nothing recorded) when an
        operation with this ``update_id`` already arrived for this entity."""
        return (await self._send(op, args, update_id))[2]

    async def state(self) -> dict[str, Any]:
        """The entity's state now (its object's attributes), from its replayed history."""
        try:
            answer: dict[str, Any] = await self.app.query(self.run_id, "state")
            return answer
        except QueryError as exc:
            if not exc.problem.startswith(NOT_RUN_YET):
                raise
            # its live run has not run its code yet: the state is what it continued with
            info = await self.app.get(self.run_id)
            args, kwargs = self.app.get_workflow(info.workflow).sig.decode_args(info.input)
            state = args[0] if args else kwargs.get("state")
            if state is None:  # the first run, before its first operation
                raise
            return dict(state)

    async def _send(
        self, op: str, args: tuple[Any, ...], given: str | None
    ) -> tuple[str, tuple[str, int], bool]:
        if op not in self.ops:
            known = ", ".join(sorted(self.ops))
            raise UpdateRejectedError(self.run_id, op, f"no such operation (known: {known})")
        if given is not None:
            check_signal_id(given, "update_id")
        if dot_parts(self.run_id):
            await self._check_dots()
        update_id = given or uuid.uuid4().hex
        payload = encode({"id": update_id, "args": list(args)}, f"arguments of {op!r}")
        wf = self.app.get_workflow(PREFIX + self.name)
        res = await self.app.store.create_run(
            run_id=self.run_id,
            workflow=wf.name,
            queue=wf.queue,
            input=wf.sig.encode_args((), {}),
            if_exists="return",
            signal=(UPDATE_SIGNAL + op, payload),
            signal_id=given,
        )
        assert res.signalled is not None  # create_run signals in the same commit
        if given is not None and not res.signal_new:
            target, seq = res.signalled
            await self.app._id_kind(
                target,
                seq,
                given,
                f"operation {op!r}",
                update=True,
                name=UPDATE_SIGNAL + op,
                value=json.loads(payload)["args"],
            )
        return update_id, res.signalled, res.signal_new

    async def _check_dots(self) -> None:
        """Refuse to make an entity whose run id has an empty, '.' or '..' part between
        slashes (a start refuses such ids); one an older version made is used as itself."""
        try:
            await self.app.get(self.run_id)
        except RunNotFoundError:
            raise dot_parts_error(
                f"entity key {self.key!r} (its run id {self.run_id!r})", "a key"
            ) from None


async def list_entities(app: Any, name: str, limit: int) -> list[str]:
    """Keys of the live entities of one class, newest first: up to ``limit`` of them
    (pages of runs are read until that many live ones, past finished chain links)."""
    keys: list[str] = []
    prefix = f"{PREFIX}{name}:"
    page = min(max(limit, 100), 1000)
    before: tuple[float, str] | None = None
    while len(keys) < limit:
        runs: list[RunInfo] = await app.list(workflow=PREFIX + name, limit=page, before=before)
        for r in runs:
            if r.is_finished:  # ended, or continued as new (its live run is listed)
                continue
            first, _n = chain_of(r.run_id)  # a continued run: its chain's first id
            keys.append(first[len(prefix) :] if first.startswith(prefix) else first)
            if len(keys) == limit:
                break
        if len(runs) < page:
            break
        before = (runs[-1].created_at, runs[-1].run_id)
    return keys
