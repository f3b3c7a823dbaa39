"""Hand-drawn inline SVG plots for the evaluation report (no plotting library, no scripts): bars of
trained − base deltas with their CI whiskers (`svg_delta_bars`) and overlaid per-image score histograms
(`svg_histogram`), plus the small helpers the report shares with them (`escape`, `finite`,
`cell_significance`) and the colours (`COLORS` per label, `SIG_COLOR` per significance).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from chunkgrpo.eval.stats import significance

COLORS = {"base": "#4e79a7", "trained": "#f28e2b"}
SIG_COLOR = {1: "#0a7d28", -1: "#b00020", 0: "#9e9e9e"}


def escape(x: Any) -> str:
    """HTML-escaped text (quotes too: safe inside attributes)."""
    return html.escape(str(x), quote=True)


def finite(*xs: Any) -> bool:
    """True when every value is a finite real number (bools are not numbers here)."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in xs)


def cell_significance(cell: Mapping | None) -> int:
    """+1 / −1 / 0: the significance of a statistics cell (`stats.significance` of its CI)."""
    if not cell:
        return 0
    return significance(cell.get("ci_low"), cell.get("ci_high"))


def _nice(x: float) -> str:
    """An axis tick label: signed, 3 significant digits, plain 0."""
    return f"{x:+.3g}" if x else "0"


def svg_delta_bars(rows: Sequence[tuple[str, Mapping]], *, title: str = "", shared_axis: bool = True,
                   width: int = 720) -> str:
    """Horizontal bars of trained − base per row with CI whiskers (inline SVG). Grey when the CI
    contains 0. `shared_axis=False` gives every row its own symmetric axis (metrics on different scales)."""
    rows = [(n, c) for n, c in rows if c and finite(c.get("delta"), c.get("ci_low"), c.get("ci_high"))]
    if not rows:
        return ""
    lw, rw, rh, top = 130, 270, 26, 22
    pw = width - lw - rw
    height = top + rh * len(rows) + 18

    def extent(cs):
        """Half-width of an axis holding every delta and CI bound of `cs` (10% margin)."""
        m = max(max(abs(c["ci_low"]), abs(c["ci_high"]), abs(c["delta"])) for c in cs)
        return m * 1.1 if m > 0 else 1.0

    shared = extent([c for _, c in rows])
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             f"font-family='sans-serif' font-size='11'>",
             f"<text x='{lw}' y='13' font-size='12' font-weight='bold'>{escape(title)}</text>"]
    x0 = lw + pw / 2
    parts.append(f"<line x1='{x0}' y1='{top - 4}' x2='{x0}' y2='{top + rh * len(rows)}' stroke='#444'/>")
    if shared_axis:
        parts.append(
            f"<text x='{lw}' y='{height - 4}' fill='#666'>{_nice(-shared)}</text>"
            f"<text x='{lw + pw}' y='{height - 4}' fill='#666' text-anchor='end'>{_nice(shared)}</text>"
            f"<text x='{x0}' y='{height - 4}' fill='#666' text-anchor='middle'>0</text>"
        )
    for i, (name, c) in enumerate(rows):
        ext = shared if shared_axis else extent([c])

        def x(v, ext=ext):
            """Pixel x of value `v` on this row's axis."""
            return x0 + v / ext * (pw / 2)

        y = top + i * rh
        col = SIG_COLOR[cell_significance(c)]
        d = c["delta"]
        parts.append(f"<text x='{lw - 6}' y='{y + 15}' text-anchor='end'>{escape(name)}</text>")
        parts.append(
            f"<rect x='{min(x(0), x(d)):.1f}' y='{y + 5}' width='{abs(x(d) - x(0)):.1f}' height='{rh - 10}' "
            f"fill='{col}' fill-opacity='0.55'/>"
        )
        lo, hi = x(c["ci_low"]), x(c["ci_high"])
        ym = y + rh / 2
        parts.append(
            f"<line x1='{lo:.1f}' y1='{ym}' x2='{hi:.1f}' y2='{ym}' stroke='{col}' stroke-width='1.5'/>"
            f"<line x1='{lo:.1f}' y1='{ym - 5}' x2='{lo:.1f}' y2='{ym + 5}' "
            f"stroke='{col}' stroke-width='1.5'/>"
            f"<line x1='{hi:.1f}' y1='{ym - 5}' x2='{hi:.1f}' y2='{ym + 5}' "
            f"stroke='{col}' stroke-width='1.5'/>"
        )
        note = f"{d:+.3g} [{c['ci_low']:+.2g}, {c['ci_high']:+.2g}]"
        if not shared_axis:
            note += f" (axis ±{ext:.2g})"
        parts.append(f"<text x='{lw + pw + 6}' y='{y + 15}' fill='{col}'>{escape(note)}</text>")
    parts.append("</svg>")
    return "<div class=plot>" + "".join(parts) + "</div>"


def svg_histogram(series: Mapping[str, Sequence[float]], *, title: str = "", bins: int | Sequence[float] = 20,
                  width: int = 360, height: int = 170) -> str:
    """Overlaid histograms (base vs trained) of per-image scores, inline SVG with a legend."""
    import numpy as np

    data = {lb: np.asarray([v for v in vals if finite(v)], dtype=float) for lb, vals in series.items()}
    data = {lb: v for lb, v in data.items() if v.size}
    if not data:
        return ""
    allv = np.concatenate(list(data.values()))
    if isinstance(bins, int):
        lo, hi = float(allv.min()), float(allv.max())
        if hi <= lo:
            lo, hi = lo - 0.5, hi + 0.5
        edges = np.linspace(lo, hi, bins + 1)
    else:
        edges = np.asarray(bins, dtype=float)
    counts = {lb: np.histogram(v, bins=edges)[0] for lb, v in data.items()}
    cmax = max(int(c.max()) for c in counts.values()) or 1
    left, bottom, top = 34, 20, 34
    pw, ph = width - left - 10, height - top - bottom
    nb = len(edges) - 1
    bw = pw / nb
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' font-family='sans-serif' "
        f"font-size='10'><text x='{left}' y='12' font-size='12' font-weight='bold'>{escape(title)}</text>"
    ]
    for j, (lb, c) in enumerate(counts.items()):
        col = COLORS.get(lb, "#888")
        for k in range(nb):
            if not c[k]:
                continue
            h = c[k] / cmax * ph
            x = left + k * bw  # overlaid, translucent
            parts.append(
                f"<rect x='{x:.1f}' y='{top + ph - h:.1f}' width='{max(bw - 1, 1):.1f}' height='{h:.1f}' "
                f"fill='{col}' fill-opacity='0.45' stroke='{col}'/>"
            )
        parts.append(
            f"<rect x='{left + 110 * j}' y='18' width='9' height='9' fill='{col}' fill-opacity='0.6'/>"
            f"<text x='{left + 12 + 110 * j}' y='26'>{escape(lb)} (n={int(c.sum())})</text>"
        )
    parts.append(
        f"<line x1='{left}' y1='{top + ph}' x2='{left + pw}' y2='{top + ph}' stroke='#444'/>"
        f"<text x='{left}' y='{height - 5}' fill='#666'>{edges[0]:.3g}</text>"
        f"<text x='{left + pw}' y='{height - 5}' fill='#666' text-anchor='end'>{edges[-1]:.3g}</text>"
        f"<text x='{left - 4}' y='{top + 8}' fill='#666' text-anchor='end'>{cmax}</text>"
        f"<text x='{left - 4}' y='{top + ph}' fill='#666' text-anchor='end'>0</text></svg>"
    )
    return "<div class=plot>" + "".join(parts) + "</div>"
