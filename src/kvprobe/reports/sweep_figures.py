"""The sweep report's figures: agreement and recovery against downstream tokens, one line per
layout (and field/rule style), with 95% intervals and the paper's reference band, as inline SVG.
"""

from __future__ import annotations

import io

import matplotlib
import numpy as np
import pandas as pd
from markupsafe import Markup, escape

from kvprobe.reports.figures import PALETTE, SVG_RC, clean_svg, new_figure
from kvprobe.sweep.summary import FIELD_ABOVE, NOTES_BELOW

PAPER_FIELD_ONLY = (-0.028, 0.025)
ERRATA = {"erratum": "placed before the question", "erratum_turn": "sent as a new turn after the prompt"}


def variant_label(field_style: str, rule_style: str) -> str:
    return f"field {field_style}, rule {rule_style}"


def figures(summary: pd.DataFrame, layouts: list[str], variants: list[tuple[str, str]]) -> list[dict]:
    specs = [
        ("field-only", "patch", ["field"], "recovery", "field-only patch recovery",
         ("Field-only patch recovery (the new K/V at the field, every downstream entry stale) against the mean "
          "downstream tokens of each cell, with 95% bootstrap CIs. The grey band is the paper's claim (field-only "
          f"recovery {PAPER_FIELD_ONLY[0]} to {PAPER_FIELD_ONLY[1]} on five models); dotted lines are the verdict "
          f"thresholds ({NOTES_BELOW:.2f}, {FIELD_ABOVE:.2f}).")),
        ("erratum", "strategy", list(ERRATA), "agree", "erratum agreement with the oracle",
         ("Agreement with the oracle's decision of the erratum placed before the question (solid) and sent as a new "
          "turn (dashed, when run), with Wilson 95% CIs.")),
        ("downstream", "patch", ["downstream"], "recovery", "full-downstream patch recovery",
         ("Full-downstream patch recovery (the new K/V at every downstream position, the field stale), with 95% "
          "bootstrap CIs; the paper reports 1.0.")),
    ]
    out = []
    for key, measure, names, value, ylabel, caption in specs:
        data = summary[(summary.measure == measure) & summary.name.isin(names)]
        data = data[np.isfinite(data[value].astype(float))]
        if not len(data):
            continue
        svg = _lines(data, key, layouts, variants, [n for n in names if n in set(data.name)], value, ylabel)
        out.append({"id": f"fig-{key}", "svg": svg, "caption": caption})
    return out


def _lines(data: pd.DataFrame, key: str, layouts: list[str], variants: list[tuple[str, str]], names: list[str],
           value: str, ylabel: str) -> Markup:
    """One line per layout (and per name, dashed after the first) against downstream tokens, a CI band
    each, one panel per (field_style, rule_style) when the grid has several."""
    import seaborn as sns
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    palette = dict(zip(layouts, sns.color_palette(list(PALETTE), len(layouts))))
    dashes = {n: ("" if i == 0 else (4, 2)) for i, n in enumerate(names)}
    markers = {n: m for n, m in zip(names, "osD^v")}
    lo_col, hi_col = f"{value}_lo", f"{value}_hi"
    with matplotlib.rc_context(SVG_RC):
        fig, axes = new_figure(max(5.0, 3.3 * len(variants) + 1.6), 3.0, ncols=len(variants), sharey=True)
        axes = np.atleast_1d(axes)
        for ax, (field_style, rule_style) in zip(axes, variants):
            panel = data[(data.field_style == field_style) & (data.rule_style == rule_style)]
            panel = panel.sort_values(["layout", "name", "downstream_tokens"])
            _reference(ax, key)
            for (layout, name), line in panel.groupby(["layout", "name"], sort=False):
                band = line[np.isfinite(line[lo_col].astype(float)) & np.isfinite(line[hi_col].astype(float))]
                if len(band) > 1:
                    ax.fill_between(band.downstream_tokens, band[lo_col], band[hi_col], color=palette[layout],
                                    alpha=0.15 if dashes[name] == "" else 0.08, linewidth=0)
                elif len(band) == 1:  # one length: the CI as an error bar
                    r = band.iloc[0]
                    ax.errorbar([r.downstream_tokens], [r[value]], color=palette[layout], lw=0.8, capsize=2,
                                yerr=[[max(r[value] - r[lo_col], 0)], [max(r[hi_col] - r[value], 0)]],  # rounding
                                fmt="none")
            if len(panel):
                sns.lineplot(data=panel, x="downstream_tokens", y=value, hue="layout",
                             hue_order=[x for x in layouts if x in set(panel.layout)], palette=palette, style="name",
                             style_order=names, dashes=dashes, markers=markers, estimator=None, errorbar=None,
                             sort=True, legend=False, ax=ax, markersize=4, linewidth=1.2)
            ax.set_xlabel("downstream tokens (mean per cell)")
            ax.set_ylabel(ylabel)
            if len(variants) > 1:
                ax.set_title(variant_label(field_style, rule_style))
        low = min(-0.05, float(np.nanmin(data[lo_col].astype(float).fillna(0))) - 0.02)
        high = max(1.05, float(np.nanmax(data[hi_col].astype(float).fillna(1))) + 0.02)
        axes[0].set_ylim(low, high)
        handles = [Line2D([], [], color=palette[x], marker="o", markersize=4, label=x) for x in layouts
                   if x in set(data.layout)]
        if len(names) > 1:
            handles += [Line2D([], [], color="#444", dashes=dashes[n] or (None, None), marker=markers[n], markersize=4,
                               label=n) for n in names]
        if key == "field-only":
            handles += [Patch(color="#888", alpha=0.35, label="paper: field-only ≈ 0"),
                        Line2D([], [], color="#666", ls=":", lw=0.8, label="verdict thresholds")]
        fig.legend(handles=handles, loc="outside right upper")
    return _svg(fig, key, f"{ylabel} against downstream tokens, one line per layout, with 95% CIs")


def _reference(ax, key: str) -> None:
    if key == "field-only":
        ax.axhspan(*PAPER_FIELD_ONLY, color="#888", alpha=0.35, linewidth=0)
        ax.axhline(0.0, color="#444", lw=0.6)
        for y in (NOTES_BELOW, FIELD_ABOVE):
            ax.axhline(y, color="#666", lw=0.8, ls=":")
    else:
        ax.axhline(1.0, color="#666", lw=0.8, ls=":")
        ax.axhline(0.0, color="#444", lw=0.6)


def _svg(fig, key: str, alt: str) -> Markup:
    """The figure as inline ``<svg>`` (fixed hash salt, no date); its ids prefixed with ``key`` so
    several figures on one page do not share ids."""
    buf = io.BytesIO()
    with matplotlib.rc_context(SVG_RC):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    svg = clean_svg(buf.getvalue().decode("utf-8"))
    svg = svg[svg.index("<svg"):]  # no XML declaration inside HTML
    svg = svg.replace(' id="', f' id="{key}-').replace('href="#', f'href="#{key}-').replace("url(#", f"url(#{key}-")
    svg = svg.replace("<svg ", f'<svg role="img" aria-label="{escape(alt)}" ', 1)
    return Markup(svg)
