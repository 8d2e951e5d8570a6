"""``tether.approval``: a human decision as a durable, audited step that fails closed.

The proposal is recorded with a stable id (``run_id:step``) and a fingerprint (a
hash of its canonical JSON). A decision is a signal that must name both; one that
names another proposal or fingerprint, comes from someone not asked, or edits
when editing is not allowed is recorded as refused and changes nothing. The wait
is durable: reminders, escalation along a chain of approvers, and at the end of
the chain the declared default (reject, unless told otherwise). A decision
recorded before the deadline wins over it; ``App.decide`` refuses one after it, even
before a worker has processed the deadline's timer. Every step is a ``Marker``
event (``approval_requested``, ``approval_reminder``, ``approval_escalated``,
``approval_refused``, ``approval_decided``), which the store also keeps in its
``approvals`` table so open reviews can be listed and decided from outside.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter, ValidationError

from .._definitions import Activity
from .._errors import ConfigurationError
from .._history import APPROVAL_SIGNAL
from .._policy import seconds
from .._serde import encode
from ._api import _instance, signal_until

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Decision(Generic[T]):
    """How an approval ended."""

    approved: bool
    #: what the run continues with: the proposal, or the reviewer's edit of it (None if
    #: rejected)
    value: T | None
    by: str | None  #: who decided (None when the deadline did)
    reason: str | None
    edited: bool
    timed_out: bool  #: no decision by the last deadline: the default applied
    approval_id: str
    fingerprint: str


def fingerprint_of(value: Any) -> str:
    """The fingerprint of a proposal: SHA-256 of its canonical JSON (sorted keys)."""
    canonical = json.dumps(json.loads(encode(value, "proposal")), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _level(spec: Any, what: str) -> tuple[list[str], float]:
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ConfigurationError(
            f"{what}: each escalation level is (approvers, duration), e.g. "
            "(['lead@x'], timedelta(hours=4))"
        )
    who, dur = spec
    people = [who] if isinstance(who, str) else list(who)
    limit = seconds(dur, what)
    if not limit:
        raise ConfigurationError(f"{what}: the duration must be positive")
    return people, limit


#: the patch marker of a run that reminds late when its reminder fell due while
#: ``notify`` (the opened or escalated message) still ran; older runs skipped it
LATE_REMINDER = "tether.approval-late-reminder"


async def approval(
    proposal: T,
    *,
    deadline: float | timedelta,
    approvers: Sequence[str] | str = (),
    remind_before: float | timedelta | None = None,
    escalate_to: Sequence[tuple[Sequence[str] | str, float | timedelta]] = (),
    allow_edit: bool = False,
    default: str = "reject",
    name: str = "approval",
    notify: Activity[..., Any] | None = None,
) -> Decision[T]:
    """Ask a person to approve ``proposal``; wait durably; fail closed.

    ``approvers`` may decide during ``deadline`` (anyone may when empty); then
    each ``escalate_to`` level ``(approvers, duration)`` in turn; then ``default``
    (``"reject"`` or ``"approve"``) decides. ``remind_before`` records a reminder
    that long before each level's deadline. ``notify``, an activity, is called
    with the review (a dict with the kind of event ``opened``, ``reminder`` or
    ``escalated``) so a message can go out. With ``allow_edit`` the reviewer may
    approve an edited proposal, validated against the proposal's type first.
    """
    inst = _instance("approval")
    if default not in ("reject", "approve"):
        raise ConfigurationError(f'default of approval {name!r} is "reject" or "approve"')
    first = seconds(deadline, f"deadline of approval {name!r}")
    if not first:
        raise ConfigurationError(f"deadline of approval {name!r} must be positive")
    levels = [([approvers] if isinstance(approvers, str) else list(approvers), first)]
    levels += [_level(spec, f"escalate_to of approval {name!r}") for spec in escalate_to]
    remind = seconds(remind_before, f"remind_before of approval {name!r}")
    kind = type(proposal)
    adapter: TypeAdapter[Any] = TypeAdapter(kind)
    proposal_json = json.loads(encode(proposal, f"proposal of approval {name!r}"))
    approval_id = f"{inst.run_id}:{inst.step + 1}"
    fp = fingerprint_of(proposal)
    signal = f"{APPROVAL_SIGNAL}{approval_id}"
    requested_at = inst.now
    deadline_at = requested_at + levels[0][1]
    review = {
        "approval_id": approval_id,
        "name": name,
        "fingerprint": fp,
        "proposal": proposal_json,
        "approvers": levels[0][0],
        "deadline_at": deadline_at,
        "allow_edit": allow_edit,
        "default": default,
        "level": 0,
    }
    # the shape an edit must have, for ``App.decide`` to refuse a malformed one at once
    # (stored with the marker only: ``notify``'s argument, replay-checked, is as before)
    shape = edit_schema(adapter) if allow_edit else None
    inst.record("approval_requested", review if shape is None else {**review, EDIT_SCHEMA: shape})
    if notify is not None:
        await notify({**review, "event": "opened"})

    async def announce(event: str, level: int, people: list[str], until: float) -> None:
        """Record a reminder or an escalation, and tell ``notify``."""
        inst.record(
            f"approval_{event}",
            {"approval_id": approval_id, "level": level, "approvers": people, "deadline_at": until},
        )
        if notify is not None:
            await notify(
                {
                    **review,
                    "approvers": people,
                    "deadline_at": until,
                    "level": level,
                    "event": event,
                }
            )

    for level, (people, duration) in enumerate(levels):
        opened_at = inst.now if level else requested_at
        until = opened_at + duration
        if level:
            await announce("escalated", level, people, until)
        reminded = remind is None or until - remind <= inst.now
        if not reminded or remind is None or until - remind <= opened_at:
            pass  # due later, or never (the level is shorter than remind_before)
        elif inst.patched(LATE_REMINDER):
            reminded = False  # its moment passed while ``notify`` ran: remind now, late
        while True:
            wake = until if reminded else until - (remind or 0.0)
            payload = await _next_decision(inst, signal, wake)
            if payload is None:
                if inst.now < until - 1e-6 and not reminded:
                    reminded = True
                    await announce("reminder", level, people, until)
                    continue
                break  # this level's deadline passed
            verdict = _judge(payload, approval_id, fp, people, allow_edit, adapter)
            if isinstance(verdict, str):
                refusal = {
                    "approval_id": approval_id,
                    "by": payload.get("by"),
                    "reason": verdict,
                    "level": level,
                }
                if payload.get("held") is True:
                    refusal["held"] = True  # the store reopens the review it held
                inst.record("approval_refused", refusal)
                continue
            approved, value, edited = verdict
            if approved and not edited:
                value = proposal
            inst.record(
                "approval_decided",
                {
                    "approval_id": approval_id,
                    "approved": approved,
                    "by": payload.get("by"),
                    "reason": payload.get("reason"),
                    "edited": edited,
                    "timed_out": False,
                    "level": level,
                    "value": json.loads(encode(value, "decision")) if edited else None,
                },
            )
            return Decision(
                approved=approved,
                value=value if approved else None,
                by=payload.get("by"),
                reason=payload.get("reason"),
                edited=edited,
                timed_out=False,
                approval_id=approval_id,
                fingerprint=fp,
            )
    approved = default == "approve"
    inst.record(
        "approval_decided",
        {
            "approval_id": approval_id,
            "approved": approved,
            "by": None,
            "reason": "no decision before the deadline",
            "edited": False,
            "timed_out": True,
            "level": len(levels) - 1,
            "value": None,
        },
    )
    return Decision(
        approved=approved,
        value=proposal if approved else None,
        by=None,
        reason="no decision before the deadline",
        edited=False,
        timed_out=True,
        approval_id=approval_id,
        fingerprint=fp,
    )


#: the key of an ``approval_requested`` marker's value holding the JSON Schema of the
#: proposal's type (reviews that allow edits, recorded since decide checks edits)
EDIT_SCHEMA = "edit_schema"


def edit_schema(adapter: TypeAdapter[Any]) -> dict[str, Any] | None:
    """The JSON Schema an edit is checked against by ``App.decide`` (None: none can be
    made for the proposal's type, or its fields have aliases, and only the run
    validates edits)."""
    try:
        schema = adapter.json_schema()
        json.dumps(schema)
        # a field with an alias may be given by its name too (``populate_by_name``), which
        # the schema cannot say: such a type's edits are left to the run alone
        if adapter.json_schema(by_alias=False) != schema:
            return None
    except Exception:
        return None
    return schema if isinstance(schema, dict) else None


def edit_problems(schema: dict[str, Any], value: Any) -> list[str]:
    """What rules ``value`` out as an edit of a proposal of JSON Schema ``schema``.

    Only what the run's validation refuses for sure is checked (an object where one is
    required, its required keys, keys it forbids, a fixed value: a tool's name), so an
    edit refused here would be refused by the run; anything else is left to the run,
    which validates the edit against the proposal's type in full."""
    problems: list[str] = []
    defs = schema.get("$defs")
    _check_shape(schema, value, "", defs if isinstance(defs, dict) else {}, problems, 0)
    return problems


def describe_shape(schema: dict[str, Any]) -> str | None:
    """A short picture of an object ``schema`` (``{"tool": "refund", "args": {...}}``),
    or None for any other."""
    defs = schema.get("$defs")
    return _picture(schema, defs if isinstance(defs, dict) else {}, 0, top=True)


def _picture(schema: Any, defs: dict[str, Any], depth: int, *, top: bool = False) -> str | None:
    if not isinstance(schema, dict) or depth > 3:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return _picture(defs.get(ref[len("#/$defs/") :]), defs, depth + 1, top=top)
    if "const" in schema:
        return json.dumps(schema["const"])
    if schema.get("type") != "object":
        return None
    props = schema.get("properties")
    if not isinstance(props, dict) or not props:
        return None if top else "{...}"
    inner = ", ".join(
        f"{json.dumps(k)}: {_picture(v, defs, depth + 1) or '...'}" for k, v in props.items()
    )
    return "{" + inner + "}"


def _check_shape(
    schema: Any, value: Any, where: str, defs: dict[str, Any], out: list[str], depth: int
) -> None:
    if not isinstance(schema, dict) or depth > 32:
        return
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        _check_shape(defs.get(ref[len("#/$defs/") :]), value, where, defs, out, depth + 1)
        return
    at = where or "the edit"
    fixed = schema["enum"] if isinstance(schema.get("enum"), list) else None
    if "const" in schema:
        fixed = [schema["const"]]
    if fixed is not None and all(isinstance(f, str) for f in fixed):
        if not isinstance(value, str) or value not in fixed:
            choices = " or ".join(json.dumps(f) for f in fixed)
            out.append(f"{at} must be {choices}, not {json.dumps(value, default=str)}")
        return
    if schema.get("type") != "object":
        return
    if not isinstance(value, dict):
        out.append(f"{at} must be an object, not {type(value).__name__}")
        return
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    required = schema.get("required")
    missing = [k for k in required if k not in value] if isinstance(required, list) else []
    if missing:
        out.append(f"{at} lacks {', '.join(repr(k) for k in missing)}")
    if schema.get("additionalProperties") is False and props:
        extra = [k for k in value if k not in props]
        if extra:
            out.append(
                f"{at} may not have {', '.join(repr(k) for k in extra)} "
                f"(its keys: {', '.join(repr(k) for k in props)})"
            )
    for key, sub in props.items():
        if key in value:
            _check_shape(sub, value[key], f"{where}.{key}" if where else key, defs, out, depth + 1)


async def _next_decision(inst: Any, signal: str, until: float) -> dict[str, Any] | None:
    """The next decision signal, or None when ``until`` passes first (a signal wins a tie)."""
    got, payload = await signal_until(inst, signal, until)
    if not got:
        return None
    return payload if isinstance(payload, dict) else {"invalid": payload}


def _judge(
    payload: dict[str, Any],
    approval_id: str,
    fp: str,
    people: list[str],
    allow_edit: bool,
    adapter: TypeAdapter[Any],
) -> str | tuple[bool, Any, bool]:
    """Why a decision is refused, or (approved, value, edited)."""
    if "invalid" in payload:
        return "a decision must be an object with approval_id, fingerprint and decision"
    if payload.get("approval_id") != approval_id:
        return f"it names approval {payload.get('approval_id')!r}, not {approval_id!r}"
    if payload.get("fingerprint") != fp:
        return "its fingerprint does not match the proposal under review"
    decision = payload.get("decision")
    if decision not in ("approve", "reject"):
        return f'decision must be "approve" or "reject", got {decision!r}'
    by = payload.get("by")
    if not isinstance(by, str) or not by:
        return "a decision must say who made it (by)"
    if people and by not in people:
        return f"{by!r} is not an approver at this level ({', '.join(people)})"
    if decision == "reject":
        return (False, None, False)
    if "value" in payload and payload["value"] is not None:
        if not allow_edit:
            return "this approval does not allow edits"
        try:
            return (True, adapter.validate_python(payload["value"]), True)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}"
                for e in exc.errors(include_url=False)
            )
            return f"the edited proposal is invalid: {problems}"
    return (True, None, False)
