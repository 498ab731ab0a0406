"""Deterministic figures for the report, drawn with seaborn on matplotlib ``Figure`` objects (no
pyplot, no global backend or style): saved as SVG with a fixed hash salt, text kept as text and no
date, and embedded as base64 ``data:`` URIs, so the same tables always give the same bytes and
nothing is fetched.

Every drawing function runs under :func:`styled` (seaborn's whitegrid theme and the report's sizes,
set for the call and restored after). Helpers keep the figures readable: :func:`ink` picks white or
black text for a coloured cell, :func:`place_labels` labels points directly without overlaps,
:func:`band` draws a 95% CI band, :func:`legend_below` puts the legend outside the data.
"""

from __future__ import annotations

import base64
import functools
import io
import math
import re

import matplotlib
import numpy as np
import seaborn as sns
from markupsafe import Markup, escape
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox, ScaledTranslation


SVG_RC = {"svg.hashsalt": "kvprobe-report", "svg.fonttype": "none", "font.size": 8,
          "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
          "axes.titlesize": 9, "axes.labelsize": 8, "xtick.labelsize": 7.5, "ytick.labelsize": 7.5,
          "legend.fontsize": 7.5, "legend.frameon": False, "xtick.bottom": True, "ytick.left": True}
# seaborn's theme without its font list (matplotlib's bundled DejaVu Sans everywhere: the same text
# metrics, so the same layout and bytes, on every machine)
RC = {**{k: v for k, v in {**sns.axes_style("whitegrid"), **sns.plotting_context("paper")}.items()
         if not k.startswith("font.")}, **SVG_RC}
# colour-blind safe (Okabe-Ito)
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
# told apart without colour too: curves that coincide stay visible
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
DASHES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1)), (0, (1, 1)), (0, (3, 2)), (0, (6, 2)))


def styled(draw):
    """Run the figure-drawing function ``draw`` under the report's rc settings (:data:`RC`), restored after."""
    @functools.wraps(draw)
    def run(*args, **kwargs):
        with matplotlib.rc_context(RC):
            return draw(*args, **kwargs)
    return run


def new_figure(w: float = 5.0, h: float = 3.0, ncols: int = 1, nrows: int = 1, **kw):
    """(fig, axes) with the report's style; axes squeezed like ``plt.subplots``."""
    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(w, h), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=True, **kw)
    return fig, axes


def to_img(fig: Figure, alt: str, cls: str = "fig") -> Markup:
    """``<img>`` with the figure as a base64 SVG data URI (deterministic bytes)."""
    buf = io.BytesIO()
    with matplotlib.rc_context(RC):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    data = base64.b64encode(clean_svg(buf.getvalue().decode("utf-8")).encode("utf-8")).decode("ascii")
    return Markup(f'<img class="{escape(cls)}" alt="{escape(alt)}" src="data:image/svg+xml;base64,{data}">')


def clean_svg(svg: str) -> str:
    """Drop the DOCTYPE (a DTD URL) and the RDF metadata block; what remains names only the SVG and
    XLink namespaces, which are identifiers, never fetched."""
    svg = re.sub(r"<!DOCTYPE[^>]*>\s*", "", svg, count=1)
    return re.sub(r"\s*<metadata>.*?</metadata>", "", svg, count=1, flags=re.S)


def finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def errbar(lo, mean, hi):
    """Asymmetric error bar lengths (NaN bounds give 0)."""
    low = mean - lo if finite(lo) and finite(mean) else 0.0
    high = hi - mean if finite(hi) and finite(mean) else 0.0
    return [max(0.0, low)], [max(0.0, high)]


# --- readable colour ---------------------------------------------------------------------------------

def luminance(colour) -> float:
    """WCAG relative luminance of a matplotlib colour (0 black .. 1 white)."""
    rgb = np.asarray(matplotlib.colors.to_rgb(colour), dtype=float)
    lin = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    return float(lin @ (0.2126, 0.7152, 0.0722))


def contrast(a, b) -> float:
    """WCAG contrast ratio of two colours (1 .. 21)."""
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def ink(background) -> str:
    """"white" or "black": the text colour with the higher contrast on ``background``."""
    return "white" if contrast("white", background) > contrast("black", background) else "black"


# --- lines, bands, legends ---------------------------------------------------------------------------

def band(ax, x, stats, colour, alpha: float = 0.15, transform=None, edges=None) -> None:
    """The 95% CI band of ``stats`` (one :class:`Stat` per x; a missing bound leaves a gap); with
    ``edges`` (a line style), its bounds are also drawn as thin lines, so overlapping bands stay apart."""
    lo = [s.lo if finite(s.lo) else np.nan for s in stats]
    hi = [s.hi if finite(s.hi) else np.nan for s in stats]
    if np.isfinite(lo).any():
        kw = {"transform": transform} if transform is not None else {}
        ax.fill_between(x, lo, hi, color=colour, alpha=alpha, lw=0, **kw)
        if edges is not None:
            for bound in (lo, hi):
                ax.plot(x, bound, color=colour, lw=0.5, ls=edges, alpha=0.8, label="_nolegend_", **kw)


def line(ax, x, y, *, colour, marker: str = "o", dashes="-", label: str | None = None, dodge: float = 0.0,
         ms: float = 4.0, lw: float = 1.1, stats=None, band_alpha: float = 0.15, band_edges: bool = False):
    """One curve drawn with seaborn (no estimation: the points as given), its CI band when ``stats``
    (outlined in the curve's line style with ``band_edges``), shifted ``dodge`` points sideways so that
    curves which coincide stay apart; returns the line."""
    shift = ax.transData + ScaledTranslation(dodge / 72, 0, ax.figure.dpi_scale_trans) if dodge else None
    before = len(ax.lines)
    sns.lineplot(x=np.asarray(x, dtype=float), y=np.asarray(y, dtype=float), ax=ax, color=colour, marker=marker,
                 markersize=ms, linewidth=lw, linestyle=dashes, estimator=None, errorbar=None, sort=False,
                 markeredgecolor="white", markeredgewidth=0.4, label=label, legend=False)
    drawn = ax.lines[before:]
    for ln in drawn:
        if shift is not None:
            ln.set_transform(shift)
        ln.set_label(label if label else "_nolegend_")
    if stats is not None:
        band(ax, x, stats, colour, alpha=band_alpha, transform=shift, edges=dashes if band_edges else None)
    return drawn[-1] if drawn else None


def legend_below(fig: Figure, axes=None, ncols: int = 3, **kw) -> None:
    """One legend for ``axes`` (all of the figure's by default; labels once each), below the plots,
    outside every data area."""
    handles: dict = {}
    for ax in axes if axes is not None else fig.axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if not lab.startswith("_"):
                handles.setdefault(lab, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center",
                   ncols=max(1, min(ncols, len(handles))), **kw)


# --- direct labels without overlaps ------------------------------------------------------------------

# (dx, dy, ha, va) per unit of distance: right, left, above, below, then the diagonals
_AROUND = ((1, 0, "left", "center"), (-1, 0, "right", "center"), (0, 1, "center", "bottom"),
           (0, -1, "center", "top"), (0.7, 0.7, "left", "bottom"), (0.7, -0.7, "left", "top"),
           (-0.7, 0.7, "right", "bottom"), (-0.7, -0.7, "right", "top"))
_DISTANCES = (5, 10, 16, 23, 31, 40)  # points


def freeze_layout(fig: Figure):
    """Lay the figure out once (constrained layout, Agg text metrics) and keep it, so positions read now
    hold when it is saved; returns the renderer, for measuring text."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    fig.set_layout_engine("none")
    return canvas.get_renderer()


def _overlap(a: Bbox, b: Bbox) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def place_labels(ax, points, labels, *, obstacles=(), others=(), fontsize: float = 7, pad: float = 1.0,
                 colour="0.15") -> list:
    """Label each data point ``(x, y)`` of ``points`` with its text in ``labels``, so that no label
    covers another label, a point (of ``points`` or the unlabelled ``others``) or a data-space rectangle
    of ``obstacles`` ((x0, y0, x1, y1), e.g. an error bar), and every label stays inside the axes.

    Each label, in the order given, tries places around its point, nearest first (right, left, above,
    below, diagonals, at growing distances), measured with the Agg renderer after the layout is frozen,
    and takes the first clear one; a label with no clear place takes the least covered one, joined to
    its point by a thin leader line. Returns the text artists (in ``ax.texts``)."""
    fig = ax.figure
    renderer = freeze_layout(fig)
    px = fig.dpi / 72
    inside = ax.get_window_extent(renderer)
    to_px = ax.transData.transform
    blocked = []
    for x, y in list(points) + list(others):
        cx, cy = to_px((x, y))
        r = 3.0 * px
        blocked.append(Bbox.from_extents(cx - r, cy - r, cx + r, cy + r))
    for x0, y0, x1, y1 in obstacles:
        (ax0, ay0), (ax1, ay1) = to_px((x0, y0)), to_px((x1, y1))
        blocked.append(Bbox.from_extents(min(ax0, ax1) - px, min(ay0, ay1), max(ax0, ax1) + px, max(ay0, ay1)))
    texts = []
    for (x, y), text in zip(points, labels):
        t = ax.text(x, y, text, fontsize=fontsize, color=colour, zorder=5)
        t.set_in_layout(False)
        best = None
        for d in _DISTANCES:
            for dx, dy, ha, va in _AROUND:
                t.set_transform(ax.transData + ScaledTranslation(dx * d / 72, dy * d / 72, fig.dpi_scale_trans))
                t.set_ha(ha)
                t.set_va(va)
                box = t.get_window_extent(renderer).padded(pad * px)
                out = (max(0, inside.x0 - box.x0) + max(0, box.x1 - inside.x1) + max(0, inside.y0 - box.y0)
                       + max(0, box.y1 - inside.y1))
                cost = sum(_overlap(box, b) for b in blocked) + 1e3 * out
                if best is None or cost < best[0]:
                    best = (cost, d, dx, dy, ha, va, box)
                if cost == 0:
                    break
            if best[0] == 0:
                break
        cost, d, dx, dy, ha, va, box = best
        t.set_transform(ax.transData + ScaledTranslation(dx * d / 72, dy * d / 72, fig.dpi_scale_trans))
        t.set_ha(ha)
        t.set_va(va)
        if d > _DISTANCES[0]:  # away from its point: a leader line says whose label it is
            ax.annotate("", (x, y), xytext=(dx * (d - 1), dy * (d - 1)), textcoords="offset points",
                        arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5", "shrinkA": 0, "shrinkB": 2},
                        annotation_clip=False).set_in_layout(False)
        blocked.append(box)
        texts.append(t)
    return texts
