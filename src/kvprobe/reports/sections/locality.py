"""Locality: recovery of the top-k notes against k random downstream positions, and of the field
or downstream span one layer at a time."""

from __future__ import annotations

import numpy as np
from markupsafe import Markup
from matplotlib.ticker import MaxNLocator

from kvprobe.reports.figures import PALETTE, errbar, finite, new_figure, to_img
from kvprobe.reports.folder import Run
from kvprobe.reports.sections.shared import decision_rows, guard, guard_note
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat
from kvprobe.results import LOCALITY


def build_locality(run: Run) -> dict | None:
    loc = run.table(LOCALITY)
    if loc.empty or "set" not in loc:
        return None
    loc = decision_rows(loc[loc["metric"] == "recovery"])
    if loc.empty:
        return None
    n_cases = loc["case_id"].nunique()
    used, excluded, guarded = guard(loc, run.min_flip)
    note = guard_note(excluded, guarded, n_cases, run.min_flip)
    per_case = used.groupby(["case_id", "set", "k"], dropna=False)["value"].mean().reset_index()
    curves = {}
    for s in ("topk", "randomk"):
        g = per_case[per_case["set"] == s]
        curves[s] = [(int(k), Stat.of(gk["value"])) for k, gk in g.groupby("k", sort=True)]
    named = [(s, Stat.of(per_case[per_case["set"] == s]["value"])) for s in ("none", "field", "downstream", "all")
             if (per_case["set"] == s).any()]
    layers = {}
    for s in ("field@layer", "downstream@layer"):
        g = used[used["set"] == s]
        if len(g):
            per = g.groupby(["case_id", "layer"])["value"].mean().reset_index()
            layers[s.split("@")[0]] = [(int(lay), Stat.of(gl["value"])) for lay, gl in per.groupby("layer")]
    fig = _locality_fig(curves, named, layers, guarded) if any(curves.values()) or layers else None
    ks = sorted(set(k for k, _ in curves["topk"]) & set(k for k, _ in curves["randomk"]))
    headline = None
    if ks:
        k = 8 if 8 in ks else ks[len(ks) // 2]
        headline = {"k": k, "top": dict(curves["topk"])[k], "random": dict(curves["randomk"])[k]}
    return {"curves": curves, "named": named, "fig": fig, "note": note, "guarded": guarded, "headline": headline}


def _locality_fig(curves, named, layers, guarded) -> Markup:
    fig, axes = new_figure(6.4, 2.8, ncols=2)
    ax = axes[0]
    for j, (s, label) in enumerate((("topk", "top-k notes"), ("randomk", "random k (control)"))):
        pts = [(k, st) for k, st in curves.get(s, []) if finite(st.mean)]
        if not pts:
            continue
        x = [k for k, _ in pts]
        ax.plot(x, [st.mean for _, st in pts], marker="o", ms=3, color=PALETTE[j], label=label)
        lo = [st.lo if finite(st.lo) else st.mean for _, st in pts]
        hi = [st.hi if finite(st.hi) else st.mean for _, st in pts]
        ax.fill_between(x, lo, hi, color=PALETTE[j], alpha=0.2, lw=0)
    for j, (s, st) in enumerate(named):
        if s in ("downstream", "field") and finite(st.mean):
            ax.axhline(st.mean, color=PALETTE[2 + j % 3], ls="--", lw=0.7, label=f"{s} span ({st.mean:.2f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (downstream positions patched)")
    ax.set_ylabel("decision recovery")
    ax.set_title("top-k against random-k" + ("" if guarded else " (UNGUARDED)"))
    ax.legend(loc="best")
    ax = axes[1]
    for j, (region, pts) in enumerate(sorted(layers.items())):
        pts = [(lay, st) for lay, st in pts if finite(st.mean)]
        if not pts:
            continue
        ax.errorbar([p[0] for p in pts], [p[1].mean for p in pts],
                    yerr=np.array([[e[0][0], e[1][0]] for e in (errbar(st.lo, st.mean, st.hi) for _, st in pts)]).T,
                    marker="o", ms=3, capsize=2, lw=0.8, color=PALETTE[j], label=f"{region} span, one layer")
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("decision recovery")
    ax.set_title("one layer at a time")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")
    return to_img(fig, "top-k against random-k recovery curves, and recovery by layer")


SECTION = register(Section(
    id="locality", title="Locality", needs=LOCALITY, order=30, build=build_locality,
    template="sections/locality.html",
    intro="Recovery when the k downstream positions with the largest single-position effect take the new K/V "
          "(top-k) against k random downstream positions (the control), and the field or downstream span one layer "
          "at a time."))
