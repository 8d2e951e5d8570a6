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
    model: only a misconfigured call (a default outside ``allowed``) raises.
    """
    choices = list(allowed)
    if default not in choices:
        choices.append(default)
    if min_confidence is not None and not 0.0 <= min_confidence <= 1.0:
        raise ConfigurationError(f"min_confidence of {name!r} must be within 0..1")
    try:
        known = value in choices
    except TypeError:  # unhashable or incomparable: a model answered something odd
        known = False
    if not known:
        chosen, reason = default, "not allowed" if value is not None else "missing"
    elif min_confidence is not None and (confidence is None or confidence < min_confidence):
        chosen = default
        reason = "no confidence given" if confidence is None else "low confidence"
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
                "confidence": confidence,
                "min_confidence": min_confidence,
                "evidence": evidence,
            },
        )
        # bounded labels: the chosen value is one of the allow-list or the default
        inst.count(
            "tether_routes", (inst.workflow.name, str(name), str(_plain(chosen))[:64], reason)
        )
    return chosen


def _plain(value: Any) -> Any:
    """A JSON-safe form of a label (enum members by value, others by str)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    inner = getattr(value, "value", None)
    if isinstance(inner, str | int | float | bool):
        return inner
    return str(value)
