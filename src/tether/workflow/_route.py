"""``tether.route``: pick a branch from an allow-list, with a safe default.

A model proposes a label; code decides where the run goes. An unknown label or
a confidence under the bar goes to the default and never raises, and inside a
workflow the decision is recorded (a ``Marker`` event named ``route``) with
what was proposed, the allowed set and the evidence, for audit and for scoring
a router (``tether.testing.evaluate``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, TypeVar

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
    """The branch to take: ``value`` if allowed (and confident enough), else ``default``.

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
    score = _score(confidence)
    try:
        known = value in choices
    except TypeError:  # unhashable or incomparable: a model answered something odd
        known = False
    if not known:
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
        chosen, reason = value, "allowed"
    inst = current_instance()
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
