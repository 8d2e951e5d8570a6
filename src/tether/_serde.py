"""Payload encoding: JSON on the way in, the annotated type on the way out.

Values are encoded with pydantic-core (JSON scalars, lists, dicts, dataclasses,
pydantic models, datetimes, UUIDs...) and decoded with a cached ``TypeAdapter``
for the parameter or return annotation. Nothing is ever unpickled.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, get_type_hints

import pydantic
import pydantic_core

from ._errors import PayloadError


def _find_offender(value: Any, path: str) -> tuple[str, Any] | None:
    """Return the path and value of the first leaf that pydantic cannot serialise."""
    if isinstance(value, dict):
        for k, v in value.items():
            found = _find_offender(v, f"{path}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(value, list | tuple | set | frozenset):
        for i, v in enumerate(value):
            found = _find_offender(v, f"{path}[{i}]")
            if found:
                return found
        return None
    try:
        pydantic_core.to_json(value)
    except Exception:
        return path, value
    return None


def encode(value: Any, what: str = "value") -> str:
    """Encode ``value`` as JSON text, or raise PayloadError naming the offending part."""
    try:
        return pydantic_core.to_json(value).decode()
    except Exception as exc:
        found = _find_offender(value, what)
        where, bad = found if found else (what, value)
        raise PayloadError(
            f"cannot serialise {where} = {bad!r} (type {type(bad).__name__}): tether stores "
            "JSON values, dataclasses and pydantic models; convert it to one of those "
            "(or store a reference such as a file path or URL instead)"
        ) from exc


class JsonDict(dict[str, Any]):
    """A result whose contents are JSON values already, as ``json.loads`` gives them
    (str keys, lists, str, int, float, bool, None): a worker records it without
    decoding its encoded text again to learn what replay will read."""


def dumps(data: Any) -> str:
    """Compact JSON text of tether's own records (event data, options, errors).

    pydantic-core's encoder is several times faster than ``json.dumps`` and writes
    the same JSON (non-ASCII text as UTF-8 rather than escapes); ``json.dumps``
    takes what it refuses, such as a lone surrogate in an error message.
    """
    try:
        return pydantic_core.to_json(data, inf_nan_mode="constants").decode()
    except Exception:
        return json.dumps(data, separators=(",", ":"))


def json_equal(a: Any, b: Any) -> bool:
    """JSON values equal as values: objects whatever their key order, ``1`` and ``1.0``
    alike, NaN the same NaN, but never ``true`` for ``1`` (Python's ``==`` says
    ``True == 1``). How a repeated start's input, a repeated signal's payload and a
    replayed step's arguments are compared."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(json_equal, a, b))
    return bool(a == b) or (a != a and b != b)  # NaN is the same NaN


def decode_raw(text: str | None) -> Any:
    """Decode JSON text to plain Python values."""
    if text is None:
        return None
    return json.loads(text)


@lru_cache(maxsize=1024)
def _adapter(tp: Any) -> pydantic.TypeAdapter[Any]:
    return pydantic.TypeAdapter(tp)


def convert(value: Any, tp: Any, what: str = "value") -> Any:
    """Validate a plain decoded value into type ``tp`` (no-op for ``Any``/missing)."""
    if tp is inspect.Parameter.empty or tp is Any or tp is None:
        return value
    if tp in _SCALARS and type(value) is tp:
        return value  # already the exact type: nothing for validation to do
    if type(value) is dict and tp in _OBJECTS and all(type(k) is str for k in value):
        # a JSON object as it is: validation would only copy it (a model step's request
        # and result, each step); copied at the top, as validation did, so code that
        # changes it in place never changes the recorded event it came from
        return dict(value)
    try:
        return _adapter(tp).validate_python(value)
    except pydantic.ValidationError as exc:
        raise PayloadError(f"{what} does not match its annotated type {tp!r}: {exc}") from exc
    except pydantic.PydanticSchemaGenerationError:
        return value


_SCALARS = (str, int, float, bool)
#: annotations a decoded JSON object (a dict of str keys) satisfies as it is
_OBJECTS = (dict, dict[str, Any])


class Signature:
    """The annotated parameter and return types of a workflow or activity function."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.name = getattr(fn, "__qualname__", repr(fn))
        self.sig = inspect.signature(fn)
        try:
            hints = get_type_hints(fn)
        except Exception:
            hints = {}
        self.return_type: Any = hints.get("return", inspect.Parameter.empty)
        self.params = list(self.sig.parameters.values())
        self.param_types = [hints.get(p.name, inspect.Parameter.empty) for p in self.params]
        #: the parameters positional arguments bind to, with their types
        self._positional = [
            (p, tp)
            for p, tp in zip(self.params, self.param_types, strict=True)
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
        self._types_by_name = {
            p.name: tp for p, tp in zip(self.params, self.param_types, strict=True)
        }
        #: positional call with exactly this many arguments always binds (no kwargs,
        #: defaults or *args to consider); None when the signature is not that simple
        self._plain_arity: int | None = (
            len(self.params)
            if all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in self.params)
            else None
        )

    def check_args(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Raise PayloadError (a TypeError) naming the function if the arguments do not bind."""
        if not kwargs and len(args) == self._plain_arity:
            return
        try:
            self.sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise PayloadError(f"{self.name}(): {exc}") from None

    def encode_args(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        """Check that the arguments bind, then encode them as JSON."""
        self.check_args(args, kwargs)
        return encode({"args": list(args), "kwargs": kwargs}, f"arguments of {self.name}")

    def decode_args(self, text: str) -> tuple[list[Any], dict[str, Any]]:
        """Decode stored arguments back into the annotated parameter types."""
        return self.decode_args_obj(decode_raw(text))

    def decode_args_obj(self, raw: Any) -> tuple[list[Any], dict[str, Any]]:
        """Convert already-parsed stored arguments into the annotated parameter types."""
        raw = raw or {}
        args: list[Any] = raw.get("args") or []
        kwargs: dict[str, Any] = raw.get("kwargs") or {}
        out_args: list[Any] = []
        positional = self._positional
        for i, value in enumerate(args):
            if i >= len(positional):
                out_args.append(value)
                continue
            p, tp = positional[i]
            if p.kind is p.VAR_POSITIONAL:
                out_args.extend(
                    convert(v, tp, f"argument *{p.name} of {self.name}") for v in args[i:]
                )
                break
            if type(value) is tp and tp in _SCALARS:  # the common case, without a message
                out_args.append(value)
            else:
                out_args.append(convert(value, tp, f"argument {p.name!r} of {self.name}"))
        if not kwargs:
            return out_args, {}
        by_name = self._types_by_name
        out_kwargs = {
            k: convert(v, by_name.get(k, inspect.Parameter.empty), f"argument {k!r}")
            for k, v in kwargs.items()
        }
        return out_args, out_kwargs

    def decode_result(self, text: str | None) -> Any:
        """Decode a stored result into the annotated return type."""
        return convert(decode_raw(text), self.return_type, f"result of {self.name}")
