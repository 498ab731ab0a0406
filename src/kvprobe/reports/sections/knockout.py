"""Knockout: decision flip rates when positions are hidden from the decision token, and the heads
that carry the edit when patched one at a time."""

from __future__ import annotations

import numpy as np
import pandas as pd
from markupsafe import Markup

from kvprobe.reports.figures import PALETTE, errbar, finite, new_figure, to_img
from kvprobe.reports.folder import Run
from kvprobe.reports.sections.shared import decision_rows, guard, guard_note
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat
from kvprobe.results import KNOCKOUT

TOP_HEADS = 12


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
            out["flips"].append({"cache": cache, "set": s, "band": band, "stat": Stat.of(g["value"])})
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
        per = used.groupby(["layer", "head"])["value"].agg(["mean", "count"]).reset_index()
        out["heat"] = _head_fig(per, metric)
        out["n_head_cases"] = int(used["case_id"].nunique())
        sets = hp[hp["set"].isin(["top", "random", "all"])]
        sets_rec, _, g2 = guard(sets[sets["metric"] == "recovery"], run.min_flip)
        for s in ("top", "random", "all"):
            r = sets_rec[sets_rec["set"] == s].groupby("case_id")["value"].mean() if g2 else pd.Series(dtype=float)
            a = sets[(sets["set"] == s) & (sets["metric"] == "agree")].groupby("case_id")["value"].mean()
            kk = sets[sets["set"] == s]["k"]
            if len(a):
                out["head_sets"].append({"set": s, "k": int(kk.iloc[0]) if len(kk) else None,
                                         "recovery": Stat.of(r), "agree": Stat.of(a)})
    if not out["flips"] and out["heat"] is None:
        return None
    return out


def _flip_fig(flips: list[dict]) -> Markup:
    caches = sorted({f["cache"] for f in flips}, key=lambda c: (c != "old", c))
    sets = [s for s in ("topk", "field", "randomk") if any(f["set"] == s for f in flips)]
    bands = [b for b in ("all", "early", "middle", "late") if any(f["band"] == b for f in flips)]
    bands += sorted({f["band"] for f in flips} - set(bands), key=str)
    fig, axes = new_figure(3.0 * len(caches), 2.6, ncols=len(caches), sharey=True)
    axes = np.atleast_1d(axes)
    w = 0.8 / max(1, len(sets))
    for ax, cache in zip(axes, caches):
        for j, s in enumerate(sets):
            for i, b in enumerate(bands):
                f = next((f for f in flips if f["cache"] == cache and f["set"] == s and f["band"] == b), None)
                if f is None or not finite(f["stat"].mean):
                    continue
                st = f["stat"]
                ax.bar(i + (j - (len(sets) - 1) / 2) * w, st.mean, width=w * 0.9, color=PALETTE[j],
                       yerr=errbar(st.lo, st.mean, st.hi), error_kw={"lw": 0.8, "capsize": 2},
                       label=s if i == 0 else None)
        ax.set_xticks(range(len(bands)), bands)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{cache} cache")
        ax.set_xlabel("layer band")
        ax.legend(loc="upper right")
    axes[0].set_ylabel("decision flip rate (95% CI)")
    return to_img(fig, "attention-edge knockout flip rates by set, band and cache")


def _head_fig(per: pd.DataFrame, metric: str) -> Markup:
    from matplotlib.patches import Rectangle

    L, H = int(per["layer"].max()) + 1, int(per["head"].max()) + 1
    mat = np.full((L, H), np.nan)
    for r in per.itertuples():
        mat[int(r.layer), int(r.head)] = r.mean
    fig, ax = new_figure(min(7.0, 2.6 + 0.35 * H), min(8.0, 1.6 + 0.3 * L))
    vmax = float(np.nanmax(np.abs(mat))) if np.isfinite(mat).any() else 1.0
    im = ax.imshow(mat, cmap="RdBu_r", vmin=-vmax or -1, vmax=vmax or 1, aspect="auto", interpolation="nearest")
    ax.grid(False)
    flat = [(mat[i, j], i, j) for i in range(L) for j in range(H) if np.isfinite(mat[i, j])]
    top = sorted(flat, key=lambda t: (-t[0], t[1], t[2]))[:TOP_HEADS]
    for _, i, j in top:
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="black", lw=1.4))
    if L * H <= 64:
        for v, i, j in flat:
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6)
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(H))
    ax.set_yticks(range(L))
    fig.colorbar(im, ax=ax, shrink=0.8).set_label(f"mean {metric}", fontsize=7)
    ax.set_title(f"top {min(TOP_HEADS, len(flat))} heads outlined")
    return to_img(fig, "head-effect heatmap, layers by heads, top heads outlined")


SECTION = register(Section(
    id="knockout", title="Knockout", needs=KNOCKOUT, order=50, build=build_knockout,
    template="sections/knockout.html",
    intro="How often hiding positions from the decision token flips its answer (top-k notes, field, random-k "
          "control; by layer band, on the stale and on the oracle cache), and which attention heads carry the edit "
          "when patched one at a time."))
