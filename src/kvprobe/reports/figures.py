"""Deterministic figures for the report: matplotlib ``Figure`` objects (no pyplot, no global
backend), saved as SVG with a fixed hash salt, text kept as text and no date, and embedded as
base64 ``data:`` URIs, so the same tables always give the same bytes and nothing is fetched.
"""

from __future__ import annotations

import base64
import io
import math
import re

import matplotlib
from markupsafe import Markup, escape
from matplotlib.figure import Figure

SVG_RC = {"svg.hashsalt": "kvprobe-report", "svg.fonttype": "none", "font.size": 8,
          "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
          "axes.titlesize": 9, "legend.fontsize": 7, "legend.frameon": False}
# colour-blind safe (Okabe-Ito)
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")


def new_figure(w: float = 5.0, h: float = 3.0, ncols: int = 1, nrows: int = 1, **kw):
    """(fig, axes) with the report's style; axes squeezed like ``plt.subplots``."""
    with matplotlib.rc_context(SVG_RC):
        fig = Figure(figsize=(w, h), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=True, **kw)
    return fig, axes


def to_img(fig: Figure, alt: str, cls: str = "fig") -> Markup:
    """``<img>`` with the figure as a base64 SVG data URI (deterministic bytes)."""
    buf = io.BytesIO()
    with matplotlib.rc_context(SVG_RC):
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
