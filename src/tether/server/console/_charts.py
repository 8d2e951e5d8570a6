"""The overview's chart: runs ended per hour, completed over failed, as inline SVG."""

from __future__ import annotations

from html import escape

_BAD = ("failed", "needs_intervention", "timed_out", "terminated")


def outcomes_svg(buckets: list[tuple[int, str, int]], hours: int, start: float) -> str:
    """Stacked bars, one per hour: completed (green) under failed (red), others grey."""
    per: list[dict[str, int]] = [{} for _ in range(hours)]
    for b, status, n in buckets:
        if 0 <= b < hours:
            per[b][status] = per[b].get(status, 0) + n
    top = max([sum(p.values()) for p in per] + [1])
    width, height, pad = 720, 140, 20
    bw = (width - pad) / hours
    parts = [
        f'<svg class="outcomes" role="img" aria-label="runs ended per hour" viewBox="0 0 '
        f'{width} {height + 18}" width="100%" xmlns="http://www.w3.org/2000/svg">'
    ]
    for i, p in enumerate(per):
        x = pad + i * bw
        y = float(height)
        ok = p.get("completed", 0)
        bad = sum(n for s, n in p.items() if s in _BAD)
        other = sum(p.values()) - ok - bad
        for n, color in ((ok, "#2f855a"), (bad, "#c53030"), (other, "#a0aec0")):
            if n:
                h = n / top * (height - 10)
                y -= h
                parts.append(
                    f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{bw - 2:.1f}" height="{h:.1f}" '
                    f'fill="{color}"><title>{escape(_tip(i, ok, bad, other))}</title></rect>'
                )
    parts.append(
        f'<text x="{pad}" y="{height + 14}" font-size="11">{hours} h ago</text>'
        f'<text x="{width - 40}" y="{height + 14}" font-size="11">now</text>'
        f'<text x="0" y="12" font-size="11">{top}</text></svg>'
    )
    return "".join(parts)


def _tip(i: int, ok: int, bad: int, other: int) -> str:
    return f"hour {i + 1}: {ok} completed, {bad} failed, {other} other"
