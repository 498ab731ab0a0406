"""Attention shares: where the decision token looks in the old prompt (the attention probe's table)."""

from __future__ import annotations

import pandas as pd
from markupsafe import Markup
from matplotlib.ticker import MaxNLocator

from kvprobe.probes.attention import ATTN_REGIONS
from kvprobe.reports.figures import DASHES, MARKERS, PALETTE, line, new_figure, styled, to_img
from kvprobe.reports.folder import Run
from kvprobe.reports.sections.shared import decision_rows
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat
from kvprobe.results import ATTENTION


def build_attention(run: Run) -> dict | None:
    att = run.table(ATTENTION)
    if att.empty or "metric" not in att:
        return None
    att = decision_rows(att[att["metric"] == "attn_share"])
    overall = att[att["layer"].isna() & att["head"].isna()]  # the mean over layers and heads, per case
    per_layer = att[att["layer"].notna() & att["head"].isna()]
    if overall.empty:
        return None
    keys = overall.groupby("region")["n_keys"].mean()
    # ("n_keys", not "keys": the template reads r.keys as the dict's method)
    rows = [{"region": r, "share": Stat.of(overall[overall["region"] == r]["value"].tolist()),
             "n_keys": float(keys.get(r, float("nan")))} for r in ATTN_REGIONS if (overall["region"] == r).any()]
    by_layer = per_layer.groupby(["region", "layer"])["value"].mean().reset_index()
    return {"rows": rows, "n": int(overall["case_id"].nunique()), "fig": _layer_fig(by_layer)}


@styled
def _layer_fig(by_layer: pd.DataFrame) -> Markup:
    fig, ax = new_figure(5.6, 2.8)
    for j, region in enumerate(ATTN_REGIONS):
        g = by_layer[by_layer["region"] == region].sort_values("layer")
        if len(g):
            line(ax, g["layer"].astype(int), g["value"], colour=PALETTE[j], marker=MARKERS[j], dashes=DASHES[j],
                 label=region, ms=3.5)
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("attention share\n(mean over heads, cases)")
    ax.set_ylim(-0.02, 1.02)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", title="region")
    return to_img(fig, "the decision token's attention share by region and layer (mean over heads and cases)")


SECTION = register(Section(
    id="attention", title="Attention shares", needs=ATTENTION, order=35, build=build_attention,
    template="sections/attention.html",
    intro="Where the decision token looks when it reads the old prompt's cache: its attention weights summed "
          "over the keys of each region (sink = position 0, prefix = the rest before the field, field, downstream, "
          "the decision token itself), averaged over heads and layers, per valid decision case. The paper reports, "
          "for Qwen3-8B, field 0.001, downstream 0.56 and sink 0.36. Attention is not causal: the locality and "
          "knockout sections say what the decision reads."))
