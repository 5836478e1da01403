"""The run's timeline as an SVG drawn on the server: steps and tool calls as bars on a time axis,
coloured by status; costs, response events and approvals as marks. Every text goes through
`html.escape`, so a label holding markup stays text."""

from __future__ import annotations

from datetime import datetime
from html import escape
from typing import Any

from .data import RunView

WIDTH, LEFT, ROW, TOP = 900, 190, 22, 28
COLOURS = {
    "succeeded": "#2e7d32", "failed": "#c62828", "in_doubt": "#ef6c00", "running": "#1565c0",
    "claimed": "#42a5f5", "waiting_approval": "#8e24aa", "waiting_input": "#8e24aa", "paused": "#ef6c00",
    "rejected": "#6d4c41", "canceled": "#757575", "expired": "#757575", "skipped": "#9e9e9e",
    "queued": "#90a4ae", "preparing": "#64b5f6", "retrying": "#f9a825",
}
TERMINAL = frozenset({"succeeded", "failed", "canceled", "expired", "skipped"})
MARKS = {"cost": "#f9a825", "response": "#00897b", "approval": "#8e24aa"}


def _colour(status: str) -> str:
    return COLOURS.get(status, "#607d8b")


def timeline_svg(view: RunView) -> str:
    run = view.run
    start: datetime = run["started_at"] or run["created_at"]
    times = [start, run["ended_at"] or view.now]
    for s in view.steps:
        times += [t for t in (s["started_at"], s["created_at"], s["ended_at"]) if t]
    for c in view.tool_calls:
        times += [t for t in (c["created_at"], c["completed_at"]) if t]
    for m in view.costs + view.responses + view.approvals:
        times.append(m["created_at"])
    start = min(times)
    end = max(times)
    span = max((end - start).total_seconds(), 0.001)
    scale = (WIDTH - LEFT - 20) / span

    def x(t: datetime) -> float:
        return LEFT + (t - start).total_seconds() * scale

    bars: list[tuple[str, str, datetime, datetime, str]] = []  # label, status, from, to, tooltip
    for s in view.steps:
        begin = s["started_at"] or s["created_at"]
        finish = s["ended_at"] or (begin if s["status"] in TERMINAL else view.now)
        bars.append((f"step {s['step_no']} {s['step_type']}", s["status"], begin, finish,
                     f"step {s['step_no']} {s['step_type']} {s['step_key'] or ''}: {s['status']}"))
    for c in view.tool_calls:
        begin = c["outbound_started_at"] or c["created_at"]
        finish = c["completed_at"] or view.now
        bars.append((f"tool {c['tool_ref']}", c["status"], begin, finish,
                     f"tool call {c['tool_call_id']} ({c['tool_ref']}), attempt {c['attempt']}: {c['status']}"))

    marks_y = TOP + len(bars) * ROW + 8
    height = marks_y + 3 * ROW + 24
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" role="img" viewBox="0 0 {WIDTH} {height}"'
        f' aria-label="timeline of run {escape(run["id"])}">',
        f'<text x="{LEFT}" y="14" class="axis">0 s</text>',
        f'<text x="{WIDTH - 20}" y="14" class="axis" text-anchor="end">{span:.3f} s</text>',
        f'<line x1="{LEFT}" y1="20" x2="{WIDTH - 20}" y2="20" class="axis-line"/>',
    ]
    for i, (label, status, begin, finish, tip) in enumerate(bars):
        y = TOP + i * ROW
        x0 = x(begin)
        w = max(x(finish) - x0, 3)
        out.append(
            f'<g class="bar" data-status="{escape(status)}"><title>{escape(tip)}</title>'
            f'<text x="4" y="{y + 14}" class="label">{escape(label[:28])}</text>'
            f'<rect x="{x0:.1f}" y="{y + 2}" width="{w:.1f}" height="{ROW - 6}" rx="3" fill="{_colour(status)}"/></g>'
        )
    rows: list[tuple[str, list[tuple[datetime, str]]]] = [
        ("costs", [(m["created_at"], _cost_tip(m)) for m in view.costs]),
        ("responses", [(m["created_at"], f"response {m['event_type']}") for m in view.responses]),
        ("approvals", [(m["created_at"], f"approval {m['title'] or m['id']}: {m['status']}") for m in view.approvals]),
    ]
    for i, ((name, items), colour) in enumerate(zip(rows, MARKS.values(), strict=True)):
        y = marks_y + i * ROW
        out.append(f'<text x="4" y="{y + 14}" class="label">{name}</text>')
        for at, tip in items:
            cx = x(at)
            out.append(
                f'<g class="mark mark-{name}"><title>{escape(tip)}</title>'
                f'<path d="M{cx:.1f} {y + 2} l6 7 l-6 7 l-6 -7 z" fill="{colour}"/></g>'
            )
    out.append("</svg>")
    return "".join(out)


def _cost_tip(cost: dict[str, Any]) -> str:
    amount = f"{cost['amount']} {cost['currency']}" if cost["amount"] is not None else "no amount"
    return f"cost {cost['billing_basis']} x {cost['billed_quantity']}: {amount}"
