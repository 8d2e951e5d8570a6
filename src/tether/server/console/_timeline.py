"""A run's timeline from its history: one bar per step (activities, timers, children,
approvals), with retries and failures marked, drawn server-side as SVG."""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import Any

from ..._history import Event, EventType
from ..._switches import model_of_args

#: what ends a bar, by the event that started it
_ENDS = {
    EventType.ACTIVITY_SCHEDULED: {
        EventType.ACTIVITY_COMPLETED: "ok",
        EventType.ACTIVITY_FAILED: "failed",
    },
    EventType.TIMER_STARTED: {EventType.TIMER_FIRED: "ok", EventType.TIMER_CANCELLED: "cancelled"},
    EventType.CHILD_STARTED: {EventType.CHILD_COMPLETED: "ok", EventType.CHILD_FAILED: "failed"},
}
_KIND = {
    EventType.ACTIVITY_SCHEDULED: "activity",
    EventType.TIMER_STARTED: "timer",
    EventType.CHILD_STARTED: "child",
}


@dataclass
class Bar:
    """One step on the timeline."""

    step: int | None
    kind: str  #: activity, timer, child, approval
    label: str
    start: float
    end: float | None = None  #: None: still open
    outcome: str = "open"  #: ok, failed, cancelled, open
    retries: list[float] = field(default_factory=list)  #: when attempts failed
    detail: dict[str, Any] = field(default_factory=dict)


def bars(history: list[Event]) -> list[Bar]:
    """The steps of ``history`` in the order they began."""
    open_: dict[tuple[str, Any], Bar] = {}
    out: list[Bar] = []
    for e in history:
        data = e.data
        if e.type in _KIND:
            kind = _KIND[e.type]
            name = data.get("name") or data.get("workflow") or kind
            if kind == "timer" and data.get("fire_at"):
                name = f"timer {float(data['fire_at']) - e.created_at:.3g} s"
            if name == "tether.ai.call":
                name = f"model {_model_of(data)}"
            bar = Bar(step=e.step, kind=kind, label=str(name), start=e.created_at)
            if kind == "child" and data.get("child_run_id"):
                bar.detail["run_id"] = data["child_run_id"]
            open_[(kind, e.step)] = bar
            out.append(bar)
        elif e.type is EventType.ACTIVITY_ATTEMPT_FAILED:
            bar_ = open_.get(("activity", e.step))
            if bar_ is not None:
                bar_.retries.append(e.created_at)
        elif e.type is EventType.MARKER and str(data.get("marker", "")).startswith("approval_"):
            _approval(data, e, open_, out)
        else:
            for start_type, ends in _ENDS.items():
                if e.type in ends:
                    bar_ = open_.pop((_KIND[start_type], e.step), None)
                    if bar_ is not None:
                        bar_.end, bar_.outcome = e.created_at, ends[e.type]
    return out


def _model_of(data: dict[str, Any]) -> str:
    """The model a ``tether.ai.call`` step asked for (its first argument)."""
    return model_of_args(data.get("args")) or "?"


def _approval(
    data: dict[str, Any], e: Event, open_: dict[tuple[str, Any], Bar], out: list[Bar]
) -> None:
    marker = data["marker"]
    raw = data.get("value")
    value: dict[str, Any] = raw if isinstance(raw, dict) else {}
    key = ("approval", value.get("approval_id"))
    if marker == "approval_requested":
        label = f"approval {value.get('name', '')}"
        bar = Bar(step=e.step, kind="approval", label=label, start=e.created_at)
        open_[key] = bar
        out.append(bar)
    elif marker == "approval_decided":
        bar_ = open_.pop(key, None)
        if bar_ is not None:
            bar_.end = e.created_at
            bar_.outcome = "ok" if value.get("approved") else "failed"


_COLORS = {"ok": "#2f855a", "failed": "#c53030", "cancelled": "#718096", "open": "#3182ce"}
_ROW, _LABEL_W, _WIDTH = 22, 220, 900


def svg(items: list[Bar], start: float, now: float) -> str:
    """The bars as an SVG Gantt chart from ``start`` to the last end (or ``now``)."""
    if not items:
        return ""
    last = max([b.end or now for b in items] + [start + 0.001])
    span = last - start
    scale = (_WIDTH - _LABEL_W - 10) / span
    height = _ROW * len(items) + 24
    parts = [
        f'<svg class="timeline" role="img" aria-label="run timeline" viewBox="0 0 {_WIDTH} '
        f'{height}" width="100%" xmlns="http://www.w3.org/2000/svg">'
    ]
    for i, b in enumerate(items):
        y = i * _ROW + 4
        x = _LABEL_W + (b.start - start) * scale
        w = max(2.0, ((b.end or now) - b.start) * scale)
        color = _COLORS[b.outcome]
        faint = ' fill-opacity="0.45"' if b.kind in ("timer", "approval") else ""
        took = f"{(b.end or now) - b.start:.3f} s" + ("" if b.end else " so far")
        tip = escape(f"step {b.step}: {b.label} — {b.outcome}, {took}, {len(b.retries)} retries")
        label = escape(f"{b.step if b.step is not None else ''} {b.label}"[:34])
        parts.append(
            f'<g class="bar {b.kind} {b.outcome}"><title>{tip}</title>'
            f'<text x="4" y="{y + 13}" font-size="12">{label}</text>'
            f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{_ROW - 8}" rx="3" '
            f'fill="{color}"{faint}/>'
        )
        for r in b.retries:
            rx = _LABEL_W + (r - start) * scale
            parts.append(
                f'<line x1="{rx:.1f}" x2="{rx:.1f}" y1="{y - 1}" y2="{y + _ROW - 7}" '
                'stroke="#dd6b20" stroke-width="2"/>'
            )
        parts.append("</g>")
    parts.append(
        f'<text x="{_LABEL_W}" y="{height - 4}" font-size="11">0 s</text>'
        f'<text x="{_WIDTH - 60}" y="{height - 4}" font-size="11">{span:.3f} s</text></svg>'
    )
    return "".join(parts)
