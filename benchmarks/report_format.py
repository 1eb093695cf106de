"""The building blocks of docs/benchmarks.md's sections: where the results live, a markdown table,
a percentage, an SVG line chart.

benchmarks/report.py assembles the document; the section renderers that live in their own files
(agent_quality_report.py, agent_fidelity_report.py) import these from here, so nothing imports the
report back.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def percent(x: float | None) -> str | None:
    """A fraction as a whole percentage (``0.25`` -> ``25%``); None stays None (a table shows ``-``)."""
    return None if x is None else f"{100 * x:.0f}%"


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    out = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(k)) for k, _ in cols) + " |")
    return "\n".join(out)


def line_chart_svg(
    series: dict[str, list[float]], title: str, xlabel: str, ylabel: str, xticks: list | None = None
) -> str:
    """A small dependency-free SVG line chart (one line per series, x = 0, 1, 2, ... or ``xticks``)."""
    w, h, left, right, top, bottom = 640, 360, 64, 150, 36, 48
    n = max(len(v) for v in series.values())
    ymax = max(max(v) for v in series.values()) * 1.1 or 1.0
    px = lambda i: left + (w - left - right) * (i / max(1, n - 1))  # noqa: E731
    py = lambda y: h - bottom - (h - top - bottom) * (y / ymax)  # noqa: E731
    colors = ["#555", "#2a7", "#27c", "#c72", "#a3a", "#c33", "#7a2", "#0aa", "#a60", "#66f", "#e4a", "#4a4", "#940"]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="13">{title}</text>',
        f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>',
        f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">{xlabel}</text>',
        f'<text x="16" y="{(top + h - bottom) / 2}" text-anchor="middle" transform="rotate(-90 16 {(top + h - bottom) / 2})">{ylabel}</text>',
    ]
    for k in range(5):
        y = ymax * k / 4
        out.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.3g}</text>')
        out.append(f'<line x1="{left}" y1="{py(y):.1f}" x2="{w - right}" y2="{py(y):.1f}" stroke="#ddd"/>')
    for i in range(n):
        out.append(
            f'<text x="{px(i):.1f}" y="{h - bottom + 16}" text-anchor="middle">{i if xticks is None else xticks[i]}</text>'
        )
    for j, (name, ys) in enumerate(series.items()):
        c = colors[j % len(colors)]
        pts = " ".join(f"{px(i):.1f},{py(y):.1f}" for i, y in enumerate(ys))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{w - right + 10}" y="{top + 16 * j + 10}" fill="{c}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)
