"""Inline SVG plots for report.html, drawn from the summary alone (no plotting library)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Any, Callable

from ..analysis.compare import GRADIENTS_DIFFER, RUN_ENDED
from .sections import ROLE_RANK, epoch_starts, map_rows

WIDTH = 1120
MAX_POINTS = 1500  # points per line before thinning
MAX_MARKERS = 400  # steps before dots are left out
MAX_MODULES = 150  # rows of the divergence map
COLORS = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#1b7c83", "#bf3989", "#6e7781")
ROLE_COLORS = {"origin": "#cf222e", "contains-origin": "#fb8f44", "propagated": "#9ec5fe",
               GRADIENTS_DIFFER: "#8250df"}


@dataclass
class Frame:
    """A plot area: data ranges mapped onto pixels, y optionally log10."""

    left: float
    top: float
    width: float
    height: float
    x: tuple[float, float]
    y: tuple[float, float]
    log: bool = False

    @property
    def bottom(self) -> float:
        return self.top + self.height

    def px(self, x: float) -> float:
        """Pixel column of data x."""
        lo, hi = self.x
        return self.left + (x - lo) / ((hi - lo) or 1) * self.width

    def py(self, y: float) -> float:
        """Pixel row of data y."""
        lo, hi = (math.log10(v) for v in self.y) if self.log else self.y
        value = math.log10(y) if self.log else y
        return self.bottom - (value - lo) / ((hi - lo) or 1) * self.height


def figure(kind: str, summary: dict[str, Any]) -> str:
    """The SVG of one figure kind (loss, drift, map); '' when there is nothing to draw."""
    draw: dict[str, Callable[[dict[str, Any]], str]] = {
        "loss": loss_curves, "drift": drift, "map": divergence_map,
    }
    return draw[kind](summary)


def loss_curves(summary: dict[str, Any]) -> str:
    """The loss of every repeat per step; repeats that agree lie on top of each other."""
    curves = {  # NaN, inf and losses so large that the axis padding would overflow: not drawn
        r: _thin([(p["step"], p["loss"]) for p in c if abs(p["loss"]) <= 1e300])
        for r, c in summary["loss"].get("curves", {}).items()
    }
    points = [p for c in curves.values() for p in c]
    if not points:
        return ""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    pad = (max(ys) - min(ys)) * 0.05 or abs(ys[0]) * 0.05 or 1.0
    f = Frame(70, 30, WIDTH - 90, 250, (min(xs), max(xs)), (min(ys) - pad, max(ys) + pad))
    body = [_axes(f, _ticks(*f.y), "loss"), _epochs(f, summary), _drift_marks(f, summary)]
    for i, (repeat, pts) in enumerate(curves.items()):
        color = COLORS[i % len(COLORS)]
        width = 5.0 if i == 0 else max(1.2, 3.0 - 0.6 * i)
        body.append(_polyline(f, pts, color, width, 0.55 if i == 0 else 0.9))
        lx = f.left + 10 + 110 * i
        body.append(
            f'<line x1="{lx}" y1="12" x2="{lx + 22}" y2="12" stroke="{color}" stroke-width="3"/>'
            f'<text x="{lx + 28}" y="16">repeat {escape(str(repeat))}</text>'
        )
    return _svg(f.bottom + 45, "loss per step of every repeat", body)


def drift(summary: dict[str, Any]) -> str:
    """Relative |Δloss| per step on a log scale; exact zeros on their own strip below."""
    per = _bucket([(p["step"], p["rel_diff"]) for p in summary["loss"].get("per_step", [])])
    if not per:
        return ""
    finite = [v for _, v in per if 0 < v < math.inf]
    lo = 10 ** math.floor(math.log10(min(finite))) if finite else 1e-8
    hi = max(10 ** math.ceil(math.log10(max(finite))) if finite else 1.0, lo * 10)
    xs = [s for s, _ in per]
    f = Frame(70, 44, WIDTH - 90, 200, (min(xs), max(xs)), (lo, hi), log=True)
    ticks = [10.0 ** e for e in range(round(math.log10(lo)), round(math.log10(hi)) + 1)]
    zero_y = f.bottom + 16
    body = [
        _axes(f, ticks, "relative |Δloss|", x_offset=24),
        f'<text x="{f.left - 8}" y="{zero_y + 4}" text-anchor="end">= 0</text>',
        f'<line x1="{f.left}" y1="{zero_y}" x2="{f.left + f.width}" y2="{zero_y}" '
        + 'stroke="#d1d9e0"/>',
        _epochs(f, summary, bottom=zero_y + 6), _drift_marks(f, summary, bottom=zero_y + 6),
    ]
    for segment in _segments(per):
        body.append(_polyline(f, segment, "#cf222e", 1.8, 1.0))
    dots = len(per) <= MAX_MARKERS
    for step, value in per:
        x = f.px(step)
        if value == 0:
            body.append(
                f'<rect x="{x - 1.5:.1f}" y="{zero_y - 3}" width="3" height="6" fill="#8c959f"/>'
            )
        elif math.isinf(value):
            body.append(
                f'<text x="{x:.1f}" y="{f.top - 4}" text-anchor="middle" fill="#cf222e">▲</text>'
            )
        elif dots:
            body.append(f'<circle cx="{x:.1f}" cy="{f.py(value):.1f}" r="2.5" fill="#cf222e"/>')
    if not finite:
        body.append(
            f'<text x="{f.left + f.width / 2}" y="{f.top + f.height / 2}" text-anchor="middle" '
            'fill="#59636e">the loss was bit-identical in every step shown</text>'
        )
    return _svg(zero_y + 45, "relative loss difference per step, log scale", body)


def divergence_map(summary: dict[str, Any]) -> str:
    """Modules × steps: where records differ, origin distinct from propagated."""
    grid = map_rows(summary)
    if not grid:
        return ""
    modules = list(grid)[:MAX_MODULES]
    used = sorted({step for m in modules for step in grid[m]})
    columns = list(range(used[0], used[-1] + 1)) if used[-1] - used[0] < 300 else used
    label_w, row_h, top = 300, 16, 40
    cell_w = min(24.0, (WIDTH - label_w - 20) / len(columns))
    col = {step: label_w + i * cell_w for i, step in enumerate(columns)}
    scanned = any(GRADIENTS_DIFFER in phases.values() for m in modules
                  for phases in grid[m].values())
    body = [_legend(scanned)]
    every = max(1, math.ceil(len(columns) * 40 / (WIDTH - label_w)))
    for step in columns[::every]:
        x = col[step] + cell_w / 2
        body.append(f'<text x="{x:.1f}" y="{top - 6}" text-anchor="middle">{step}</text>')
    for r, module in enumerate(modules):
        y = top + r * row_h
        if r % 2:
            body.append(
                f'<rect x="{label_w}" y="{y}" width="{cell_w * len(columns):.1f}" '
                f'height="{row_h}" fill="#f6f8fa"/>'
            )
        shown = module if len(module) <= 44 else "…" + module[-43:]
        body.append(
            f'<text x="{label_w - 8}" y="{y + 12}" text-anchor="end">{escape(shown)}'
            f"<title>{escape(module)}</title></text>"
        )
        for step, phases in grid[module].items():
            role = max(phases.values(), key=lambda v: ROLE_RANK.get(v, 0))
            tip = "; ".join(f"{phase}: {v}" for phase, v in phases.items())
            body.append(
                f'<rect x="{col[step]:.1f}" y="{y + 1}" width="{max(cell_w - 1, 0.8):.1f}" '
                f'height="{row_h - 2}" fill="{ROLE_COLORS.get(role, "#8c959f")}">'
                f"<title>{escape(f'{module}, step {step}: {tip}')}</title></rect>"
            )
    height = top + len(modules) * row_h + 10
    if len(grid) > len(modules):
        body.append(
            f'<text x="{label_w}" y="{height + 4}">… {len(grid) - len(modules)} more modules '
            "not drawn</text>"
        )
        height += 14
    return _svg(height, "modules by steps: where records diverge", body)


# -- pieces --------------------------------------------------------------------------------


def _svg(height: float, label: str, body: list[str]) -> str:
    return (
        f'<svg viewBox="0 0 {WIDTH} {height:.0f}" role="img" aria-label="{escape(label)}">'
        + "".join(body) + "</svg>"
    )


def _axes(f: Frame, yticks: list[float], ylabel: str, x_offset: float = 0) -> str:
    """Frame, y ticks with grid lines, x ticks (steps) and axis labels."""
    out = [
        f'<rect x="{f.left}" y="{f.top}" width="{f.width}" height="{f.height}" fill="none" '
        + 'stroke="#d1d9e0"/>'
    ]
    for t in yticks:
        y = f.py(t)
        out.append(
            f'<line x1="{f.left}" y1="{y:.1f}" x2="{f.left + f.width}" y2="{y:.1f}" '
            'stroke="#eaeef2"/>'
            f'<text x="{f.left - 8}" y="{y + 4:.1f}" text-anchor="end">{t:.3g}</text>'
        )
    base = f.bottom + x_offset
    for t in _ticks(*f.x, integer=True):
        x = f.px(t)
        out.append(f'<text x="{x:.1f}" y="{base + 18}" text-anchor="middle">{t:g}</text>')
    out.append(
        f'<text x="{f.left + f.width / 2}" y="{base + 36}" text-anchor="middle">step</text>'
        f'<text x="14" y="{f.top + f.height / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {f.top + f.height / 2})">{escape(ylabel)}</text>'
    )
    return "".join(out)


def _epochs(f: Frame, summary: dict[str, Any], bottom: float | None = None) -> str:
    """Dashed lines at the start of every epoch after the first."""
    out = []
    for epoch, step in epoch_starts(summary)[1:]:
        x = f.px(step - 0.5)
        out.append(
            f'<line x1="{x:.1f}" y1="{f.top}" x2="{x:.1f}" y2="{bottom or f.bottom}" '
            'stroke="#8c959f" stroke-dasharray="4 3"/>'
            f'<text x="{x + 4:.1f}" y="{f.top + 12}" fill="#59636e">epoch {epoch}</text>'
        )
    return "".join(out)


def _drift_marks(f: Frame, summary: dict[str, Any], bottom: float | None = None) -> str:
    """Lines at the first step whose records differ and the first whose loss differs."""
    first = summary.get("first_divergence") or {}
    marks = [
        (first.get("step"), "#bc4c00",
         RUN_ENDED if first.get("role") == RUN_ENDED else "records first differ"),
        (summary["loss"].get("first_step"), "#cf222e", "loss first differs"),
    ]
    out = []
    for i, (step, color, text) in enumerate(marks):
        if step is None:
            continue
        x = f.px(step)
        out.append(
            f'<line x1="{x:.1f}" y1="{f.top}" x2="{x:.1f}" y2="{bottom or f.bottom}" '
            f'stroke="{color}" stroke-width="1.5"/>'
            f'<text x="{x + 4:.1f}" y="{f.top + 26 + 14 * i}" fill="{color}">'
            f"{text}: step {step}</text>"
        )
    return "".join(out)


def _legend(scanned: bool = False) -> str:
    """The map's colours; the scanned-step colour only where the map has such cells."""
    out = []
    shown = [(r, c) for r, c in ROLE_COLORS.items() if scanned or r != GRADIENTS_DIFFER]
    for i, (role, color) in enumerate(shown):
        x = 300 + 170 * i
        out.append(
            f'<rect x="{x}" y="4" width="12" height="12" fill="{color}"/>'
            f'<text x="{x + 18}" y="14">{role}</text>'
        )
    return "".join(out)


def _polyline(
    f: Frame, pts: list[tuple[float, float]], color: str, width: float, alpha: float
) -> str:
    coords = " ".join(f"{f.px(x):.1f},{f.py(y):.1f}" for x, y in pts)
    return (
        f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="{width}" '
        f'stroke-opacity="{alpha}" stroke-linejoin="round"/>'
    )


def _segments(per: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """Runs of consecutive finite nonzero values (a log scale cannot draw 0)."""
    out: list[list[tuple[float, float]]] = [[]]
    for step, value in per:
        if 0 < value < math.inf:
            out[-1].append((step, value))
        elif out[-1]:
            out.append([])
    return [s for s in out if len(s) > 1]


def _thin(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    stride = math.ceil(len(pts) / MAX_POINTS) or 1
    return pts[::stride]


def _bucket(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """At most MAX_POINTS points, each the largest value of its bucket."""
    size = math.ceil(len(pts) / MAX_POINTS) or 1
    return [(pts[i][0], max(v for _, v in pts[i:i + size])) for i in range(0, len(pts), size)]


def _ticks(lo: float, hi: float, integer: bool = False) -> list[float]:
    """About five round tick values within [lo, hi]."""
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / 5
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if step * m >= raw)
    if integer:
        step = max(1, round(step))
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]
