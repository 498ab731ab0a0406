"""Knockout: decision flip rates when positions are hidden from the decision token, and the heads
that carry the edit when patched one at a time."""

from __future__ import annotations

import warnings

import matplotlib
import numpy as np
import pandas as pd
import seaborn as sns
from markupsafe import Markup
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from kvprobe.reports.figures import PALETTE, errbar, finite, ink, legend_below, new_figure, styled, to_img
from kvprobe.reports.folder import Run
from kvprobe.reports.sections.shared import decision_rows, guard, guard_note
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat
from kvprobe.results import KNOCKOUT

TOP_HEADS = 12  # heads outlined at most
HEAD_MIN = 0.1  # the mean recovery (share of the oracle flip) a head must reach alone to be outlined


def build_knockout(run: Run) -> dict | None:
    k = run.table(KNOCKOUT)
    if k.empty or "probe" not in k:
        return None
    k = decision_rows(k)
    out: dict = {"flips": [], "fig": None, "heat": None, "head_sets": [], "head_note": None}
    edge = k[(k["probe"] == "edge_knockout") & (k["metric"] == "flip") & (k["set"] != "none")]
    if len(edge):
        per = edge.groupby(["case_id", "cache", "set", "band"], dropna=False)["value"].mean().reset_index()
        for (cache, s, band), g in per.groupby(["cache", "set", "band"], sort=True):
            out["flips"].append({"cache": cache, "set": s, "band": band, "stat": Stat.share(g["value"])})
        out["fig"] = _flip_fig(out["flips"])
    hp = k[k["probe"] == "head_patch"]
    single = hp[hp["set"] == "single"] if len(hp) else hp
    if len(single):
        rec = single[single["metric"] == "recovery"]
        used, excluded, guarded = guard(rec, run.min_flip)
        metric = "recovery"
        if not guarded:
            eff = single[single["metric"] == "effect"]
            used = eff.assign(value=eff["value"] * np.sign(eff["oracle_flip"].replace(0, 1.0)))
            metric = "effect toward the oracle (logits)"
        out["head_note"] = guard_note(excluded, guarded, rec["case_id"].nunique(), run.min_flip)
        if not guarded:
            out["head_note"] += " The heatmap shows the raw effect (m - m_stale, signed toward the oracle) instead."
        stats = {(int(lay), int(h)): Stat.of(g["value"]) for (lay, h), g in used.groupby(["layer", "head"])}
        marked, claim = carriers(stats, "recovery" if guarded else "effect")
        out["heat"] = _head_fig(stats, metric, marked, claim)
        out["n_head_cases"] = int(used["case_id"].nunique())
        out["marked"] = [f"L{lay}.H{h}" for lay, h in marked]
        out["claim"] = claim
        out["n_heads"] = len(stats)
        sets = hp[hp["set"].isin(["top", "random", "all"])]
        sets_rec, _, g2 = guard(sets[sets["metric"] == "recovery"], run.min_flip)
        for s in ("top", "random", "all"):
            r = sets_rec[sets_rec["set"] == s].groupby("case_id")["value"].mean() if g2 else pd.Series(dtype=float)
            a = sets[(sets["set"] == s) & (sets["metric"] == "agree")].groupby("case_id")["value"].mean()
            kk = sets[sets["set"] == s]["k"]
            if len(a):
                out["head_sets"].append({"set": s, "k": int(kk.iloc[0]) if len(kk) else None,
                                         "recovery": Stat.of(r), "agree": Stat.share(a)})
    if not out["flips"] and out["heat"] is None:
        return None
    return out


@styled
def _flip_fig(flips: list[dict]) -> Markup:
    caches = sorted({f["cache"] for f in flips}, key=lambda c: (c != "old", c))
    sets = [s for s in ("topk", "field", "randomk") if any(f["set"] == s for f in flips)]
    bands = [b for b in ("all", "early", "middle", "late") if any(f["band"] == b for f in flips)]
    bands += sorted({f["band"] for f in flips} - set(bands), key=str)
    colours = {s: PALETTE[j] for j, s in enumerate(sets)}
    by_colour = {matplotlib.colors.to_hex(c): s for s, c in colours.items()}
    fig, axes = new_figure(3.2 * len(caches), 2.9, ncols=len(caches), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, cache in zip(axes, caches):
        stats = {(f["band"], f["set"]): f["stat"] for f in flips if f["cache"] == cache and finite(f["stat"].mean)}
        data = pd.DataFrame([{"band": str(b), "set": s, "value": st.mean} for (b, s), st in stats.items()])
        if len(data):
            sns.barplot(data=data, x="band", y="value", hue="set", order=[str(b) for b in bands], hue_order=sets,
                        palette=colours, errorbar=None, ax=ax, width=0.8, saturation=1, legend=False)
            for c in ax.containers:  # the legend below names the sets once
                c.set_label("_nolegend_")
            for bar in ax.patches:  # each bar's CI, found by its band (x) and its set (colour)
                s = by_colour.get(matplotlib.colors.to_hex(bar.get_facecolor()))
                x = bar.get_x() + bar.get_width() / 2
                st = stats.get((bands[round(x)], s)) if 0 <= round(x) < len(bands) else None
                if st is not None:
                    ax.errorbar(x, st.mean, yerr=errbar(st.lo, st.mean, st.hi), fmt="none", ecolor="0.2", lw=0.8,
                                capsize=2)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{cache} cache")
        ax.set_xlabel("layer band")
        ax.set_ylabel("decision flip rate (95% CI)")
        ax.grid(axis="x", visible=False)
    for s, c in colours.items():
        axes[0].bar([0], [0], width=0, color=c, label=f"{s} hidden")
    legend_below(fig, axes[:1], ncols=len(sets))
    return to_img(fig, "attention-edge knockout: decision flip rate by hidden set and layer band, on the old and the "
                       "new cache, with 95% CIs")


def carriers(stats: dict, metric: str) -> tuple[list, str]:
    """The heads the heatmap outlines, and what they meet, in words: a mean recovery of at least
    :data:`HEAD_MIN` of the oracle flip with its 95% CI above 0 (for the raw effect, where no case
    passes the min-flip guard: the 95% CI above 0), the :data:`TOP_HEADS` strongest at most."""
    if metric == "recovery":
        claim = f"mean recovery \u2265 {HEAD_MIN:g} and a 95% CI above 0"
        ok = [lh for lh, st in stats.items() if finite(st.mean) and st.mean >= HEAD_MIN and finite(st.lo)
              and st.lo > 0]
    else:
        claim = "mean effect toward the oracle with a 95% CI above 0"
        ok = [lh for lh, st in stats.items() if finite(st.lo) and st.lo > 0]
    ok = sorted(ok, key=lambda lh: (-stats[lh].mean, lh))[:TOP_HEADS]
    if len(ok) == TOP_HEADS:
        claim += f" (the {TOP_HEADS} strongest)"
    return ok, claim


@styled
def head_figure(stats: dict, metric: str, marked: list, claim: str) -> Figure:
    """Mean ``metric`` per (layer, head) of ``stats`` ({(layer, head): Stat}), each value written in white or
    black (whichever reads on its cell) where there are at most 64 heads, and the ``marked`` heads outlined."""

    L = int(max(lay for lay, _ in stats)) + 1
    H = int(max(h for _, h in stats)) + 1
    mat = pd.DataFrame(np.full((L, H), np.nan), index=range(L), columns=range(H))
    for (lay, h), st in stats.items():
        mat.iloc[int(lay), int(h)] = st.mean
    fig, ax = new_figure(min(7.5, 2.8 + 0.42 * H), min(9.0, 1.9 + 0.34 * L))
    values = mat.to_numpy()
    vmax = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 1.0
    with warnings.catch_warnings():  # seaborn 0.13 calls the Colormap.set_bad that matplotlib 3.11 deprecates
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        sns.heatmap(mat, ax=ax, cmap="RdBu_r", center=0, vmin=-(vmax or 1), vmax=vmax or 1, linewidths=0.5,
                    linecolor="white", cbar_kws={"shrink": 0.8, "label": f"mean {metric}"}, square=False)
    mesh = ax.collections[0]
    if L * H <= 64:  # each cell's value, in white or black, whichever reads on its colour
        for i in range(L):
            for j in range(H):
                v = values[i, j]
                if np.isfinite(v):
                    ax.text(j + 0.5, i + 0.5, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color=ink(mesh.cmap(mesh.norm(v))))
    for lay, h in marked:
        ax.add_patch(Rectangle((h, lay), 1, 1, fill=False, ec="black", lw=1.6, zorder=5))
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.tick_params(length=0)
    ax.set_title(f"{len(marked)} of {len(stats)} heads outlined:\n{claim}" if marked else
                 f"no head outlined: none has a {claim}", fontsize=8)
    return fig


def _head_fig(stats: dict, metric: str, marked: list, claim: str) -> Markup:
    alt = (f"head-patch heatmap, layers by query heads, coloured by mean {metric}; "
           + (f"{len(marked)} heads outlined: {claim}" if marked else f"no head has a {claim}"))
    return to_img(head_figure(stats, metric, marked, claim), alt)


SECTION = register(Section(
    id="knockout", title="Knockout", needs=KNOCKOUT, order=50, build=build_knockout,
    template="sections/knockout.html",
    intro="How often hiding positions from the decision token flips its answer (top-k notes, field, random-k "
          "control; by layer band, on the stale and on the oracle cache), and which attention heads carry the edit "
          "when patched one at a time."))
