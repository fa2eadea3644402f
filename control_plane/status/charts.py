"""Line charts as inline SVG for the status pages: axes with round-number ticks, axis titles, the last
value written beside the line, and every point's value on hover (an SVG ``<title>``). No script, no
network: the page opens as it is.

    line_chart([Series("loss", ((1, 2.31), (2, 2.05)))], x_label="step", y_label="loss")

Several series get a legend (a row above the plot); a :class:`Marker` is a dashed vertical line at an x with its
label (where a job's attempt began: "attempt 2 from step 200"). NaN and infinite values are left out of the line (a caption says how many); a chart with no finite
point says so in words instead of drawing empty axes.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
MAX_MARKS = 200  # hover marks per series; a longer series gets every k-th point marked
MAX_POINTS = 1000  # points of a drawn line; a longer series is thinned to about this many
Scale = Callable[[float], float]  # a data value to a pixel coordinate
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 58, 64, 12, 38
LEGEND_ROW = 14  # px above the plot for the legend of a chart of several series
CHAR_PX = 6.5  # about the width of a character of the charts' 11 px sans-serif


@dataclass(frozen=True)
class Series:
    """One line: its name (the legend and the hover text) and its (x, y) points, in x order."""

    name: str
    points: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Marker:
    """A dashed vertical line at ``x``, labelled (its hover text too)."""

    x: float
    label: str


def nice_ticks(lo: float, hi: float, want: int = 5) -> list[float]:
    """Round-number ticks (1, 2 or 5 times a power of ten apart) covering ``lo .. hi``."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"ticks need finite bounds, got {lo} .. {hi}")
    if hi - lo <= 1e-12 * max(1.0, abs(lo), abs(hi)):  # one value (or as good as): a band around it
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(want, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    digits = max(0, 3 - math.floor(math.log10(step)))  # round away float noise (0.30000000000000004)
    first = math.floor(lo / step) * step
    ticks = [round(first + k * step, digits) for k in range(int((hi - first) / step + 1e-9) + 1)]
    if ticks[-1] < hi:
        ticks.append(round(ticks[-1] + step, digits))
    return ticks


def fmt(x: float) -> str:
    """A number short enough for a tick or a label: 0.00123, 2.31, 1.2e+04."""
    if x == 0:
        return "0"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e5 else f"{x:.2g}"


def line_chart(
    series: Sequence[Series],
    *,
    x_label: str,
    y_label: str,
    width: int = 560,
    height: int = 220,
    title: str = "",
    markers: Sequence[Marker] = (),
) -> str:
    """An SVG line chart of ``series`` on shared axes, with ``markers`` (a ``<p>`` saying why, when
    nothing is finite)."""
    esc = html.escape
    finite = [[(x, y) for x, y in s.points if math.isfinite(x) and math.isfinite(y)] for s in series]
    dropped = sum(len(s.points) for s in series) - sum(map(len, finite))
    if not any(finite):
        why = "no finite values" if dropped else "no data yet"
        return f"<p class='nodata'>{esc(title or y_label)}: {why}</p>"
    xs = [x for pts in finite for x, _ in pts] + [m.x for m in markers if math.isfinite(m.x)]
    ys = [y for pts in finite for _, y in pts]
    want = max(2, (height - PAD_TOP - PAD_BOTTOM - LEGEND_ROW) // 36)  # a tick label every ~36 px at most
    xt, yt = nice_ticks(min(xs), max(xs)), nice_ticks(min(ys), max(ys), want)
    legend = len(series) > 1  # a row above the plot
    x0, x1, y0, y1 = PAD_LEFT, width - PAD_RIGHT, height - PAD_BOTTOM, PAD_TOP + LEGEND_ROW * legend

    def px(x: float) -> float:
        return x0 + (x - xt[0]) / (xt[-1] - xt[0]) * (x1 - x0)

    def py(y: float) -> float:
        return y0 - (y - yt[0]) / (yt[-1] - yt[0]) * (y0 - y1)

    out = [
        f"<svg class='chart' width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img' "
        f"font-family='sans-serif' font-size='11'><title>{esc(title or y_label)}</title>",
        _axes(xt, yt, px, py, x0, x1, y0, y1),
        f"<text x='{(x0 + x1) / 2}' y='{height - 4}' text-anchor='middle'>{esc(x_label)}</text>",
        f"<text transform='translate(12,{(y0 + y1) / 2}) rotate(-90)' text-anchor='middle'>{esc(y_label)}</text>",
    ]
    out += [_marker(m, px(m.x), y0, y1) for m in markers if math.isfinite(m.x)]
    for i, (s, pts) in enumerate(zip(series, finite, strict=True)):
        if pts:
            out.append(_line(s.name, pts, COLORS[i % len(COLORS)], px, py, x_label))
    if legend:
        out.append(_legend([s.name for s in series], x0))
    if dropped:
        out.append(
            f"<text x='{x0 + 4}' y='{y1 + 10}' fill='#a00'>{dropped} non-finite value(s) left out</text>"
        )
    out.append("</svg>")
    return "".join(out)


def _axes(
    xt: list[float], yt: list[float], px: Scale, py: Scale, x0: float, x1: float, y0: float, y1: float
) -> str:
    parts = [f"<path d='M{x0},{y1} V{y0} H{x1}' fill='none' stroke='#444'/>"]
    for t in xt:
        x = px(t)
        parts.append(
            f"<line x1='{x:.1f}' y1='{y0}' x2='{x:.1f}' y2='{y0 + 4}' stroke='#444'/>"
            f"<text x='{x:.1f}' y='{y0 + 15}' text-anchor='middle'>{fmt(t)}</text>"
        )
    for t in yt:
        y = py(t)
        parts.append(
            f"<line x1='{x0}' y1='{y:.1f}' x2='{x1}' y2='{y:.1f}' stroke='#e4e4e4'/>"
            f"<text x='{x0 - 5}' y='{y + 4:.1f}' text-anchor='end'>{fmt(t)}</text>"
        )
    return "".join(parts)


def _line(name: str, pts: list[tuple[float, float]], color: str, px: Scale, py: Scale, x_label: str) -> str:
    esc = html.escape
    stride = max(1, math.ceil(len(pts) / MAX_POINTS))  # a long run: every k-th point, and the last
    line = pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else [])
    xy = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in line)
    every = max(1, math.ceil(len(pts) / MAX_MARKS))
    marks = "".join(
        f"<circle cx='{px(x):.1f}' cy='{py(y):.1f}' r='2.5' fill='{color}'>"
        f"<title>{esc(name)} {fmt(y)} at {esc(x_label)} {fmt(x)}</title></circle>"
        for x, y in pts[::every]
    )
    lx, ly = pts[-1]
    last = (
        f"<text class='last' x='{px(lx) + 5:.1f}' y='{py(ly) + 4:.1f}' fill='{color}'>{esc(fmt(ly))}</text>"
    )
    return (
        f"<g class='series' data-name='{esc(name)}'><polyline fill='none' stroke='{color}' "
        f"stroke-width='1.5' points='{xy}'/>{marks}{last}</g>"
    )


def _marker(m: Marker, x: float, y0: float, y1: float) -> str:
    label = html.escape(m.label)
    return (
        f"<g class='marker' data-label='{label}'><title>{label}</title>"
        f"<line x1='{x:.1f}' y1='{y1}' x2='{x:.1f}' y2='{y0}' stroke='#666' stroke-dasharray='4 3'/>"
        f"<text x='{x + 3:.1f}' y='{y0 - 5}' fill='#444' stroke='#fff' stroke-width='3' "
        f"paint-order='stroke'>{label}</text></g>"
    )


def _legend(names: Sequence[str], x0: float) -> str:
    """Each series' colour and name, in a row above the plot from its left edge."""
    parts, x = [], x0
    for i, name in enumerate(names):
        color = COLORS[i % len(COLORS)]
        parts.append(
            f"<line x1='{x:.1f}' y1='{PAD_TOP}' x2='{x + 16:.1f}' y2='{PAD_TOP}' stroke='{color}' "
            f"stroke-width='2'/><text x='{x + 20:.1f}' y='{PAD_TOP + 4}'>{html.escape(name)}</text>"
        )
        x += 20 + CHAR_PX * len(name) + 14
    return f"<g class='legend'>{''.join(parts)}</g>"
