"""``tether.route``: pick a branch from an allow-list, with a safe default.

A model proposes a label; code decides where the run goes. An unknown label or
a confidence under the bar goes to the default and never raises, and inside a
workflow the decision is recorded (a ``Marker`` event named ``route``) with
what was proposed, the allowed set and the evidence, for audit and for scoring
a router (``tether.testing.evaluate``).
"""

from __future__ import annotations

from collections.abc import Collection
from enum import Enum
from typing import Any, TypeVar, cast

from .._errors import ConfigurationError
from ._instance import current_instance

T = TypeVar("T")


def route(
    value: Any,
    allowed: Collection[T],
    *,
    default: T,
    confidence: float | None = None,
    min_confidence: float | None = None,
    name: str = "route",
    evidence: Any = None,
) -> T:
    """The branch to take: the member of ``allowed`` equal to ``value`` (and confident
    enough), else ``default``. A replayed run follows the decision it recorded.

    ``confidence`` is the proposer's own score (e.g. a classifier's), compared
    with ``min_confidence``; a missing score passes only when no bar is set.
    ``name`` tells several routers of one run apart in history; ``evidence``
    (JSON) is recorded with the decision. Never raises on bad input from the
    model: a value outside ``allowed``, a missing score, or one that is not a number
    in 0..1 (NaN, text) go to ``default``; only a misconfigured ``min_confidence`` raises.
    """
    choices = list(allowed)
    if default not in choices:
        choices.append(default)
    if min_confidence is not None and not 0.0 <= min_confidence <= 1.0:
        raise ConfigurationError(f"min_confidence of {name!r} must be within 0..1")
    inst = current_instance()
    if inst is not None:
        replayed = _replayed(inst, name, choices)
        if replayed is not None:  # decided before this replay: follow the record
            inst.record("route", replayed[1])
            return cast(T, replayed[0])
    score = _score(confidence)
    member = _member(value, choices)
    if member is _NONE:
        chosen, reason = default, "not allowed" if value is not None else "missing"
    elif min_confidence is not None and (score is None or score < min_confidence):
        chosen = default
        if confidence is None:
            reason = "no confidence given"
        elif score is None:  # NaN, a string, a bool, out of 0..1: never passes a bar
            reason = "confidence not a score"
        else:
            reason = "low confidence"
    else:
        chosen, reason = member, "allowed"
    if inst is not None:
        inst.record(
            "route",
            {
                "name": name,
                "proposed": _plain(value),
                "chosen": _plain(chosen),
                "reason": reason,
                "allowed": sorted((_plain(c) for c in allowed), key=str),
                "default": _plain(default),
                # JSON-safe: a score as given, anything else as text (NaN is not JSON)
                "confidence": score if score is not None or confidence is None else str(confidence),
                "min_confidence": min_confidence,
                "evidence": evidence,
            },
        )
        # bounded labels: the chosen value is one of the allow-list or the default
        inst.count(
            "tether_routes", (inst.workflow.name, str(name), str(_plain(chosen))[:64], reason)
        )
    return chosen


_NONE: Any = object()  #: no member of the allow-list matched


def _member(value: Any, choices: list[Any]) -> Any:
    """The allow-list's own member equal to ``value`` (``_NONE`` if none is).

    The member, not the value: ``"invoice"`` proposed for ``[Kind.INVOICE]`` routes to
    the enum member the code compares with (an ``Enum`` member matches its value), and
    ``1.0`` for ``[1]`` to ``1``. A bool is never taken for the number it equals
    (``True == 1``): a model that answered ``true`` did not choose branch 1.
    """
    for choice in choices:
        if isinstance(choice, bool) != isinstance(value, bool):
            continue
        try:
            if choice == value or (isinstance(choice, Enum) and choice.value == value):
                return choice
        except Exception:  # an odd answer that cannot even be compared: not allowed
            continue
    return _NONE


def _replayed(inst: Any, name: str, choices: list[Any]) -> tuple[Any, dict[str, Any]] | None:
    """The member this run chose here before, and that decision as recorded, when its
    history holds one (a deploy that changed the allow-list or the bar since does not
    change where a run in flight went); None for a new decision."""
    recorded = inst.recorded_next()
    if recorded is None or recorded.data.get("marker") != "route":
        return None
    was = recorded.data.get("value")
    if not isinstance(was, dict) or was.get("name") != name:
        return None
    chosen = was.get("chosen")
    # the same kind first; then by equality alone, so a run recorded by a version that
    # took a bool for a number (``True`` for ``1``) replays down the branch it took
    for strict in (True, False):
        for choice in choices:
            plain = _plain(choice)
            same_kind = isinstance(plain, bool) == isinstance(chosen, bool)
            if (same_kind or not strict) and plain == chosen:
                return choice, was
    return None  # that branch is gone from the code: decide again (replay will tell)


def _score(confidence: Any) -> float | None:
    """``confidence`` as a score in 0..1, or None when it is not one (missing, NaN, a
    string, a bool, out of range): a proposer's odd score never passes a bar."""
    if isinstance(confidence, bool) or not isinstance(confidence, int | float):
        return None
    value = float(confidence)
    return value if 0.0 <= value <= 1.0 else None  # NaN fails both comparisons


def _plain(value: Any) -> Any:
    """A JSON-safe form of a label (enum members by value, others by str)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    inner = getattr(value, "value", None)
    if isinstance(inner, str | int | float | bool):
        return inner
    return str(value)
