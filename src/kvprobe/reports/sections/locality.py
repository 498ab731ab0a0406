"""Locality: recovery of the top-k notes against k random downstream positions, and of the field
or downstream span one layer at a time."""

from __future__ import annotations

from markupsafe import Markup
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from kvprobe.reports.figures import DASHES, MARKERS, PALETTE, finite, legend_below, line, new_figure, styled, to_img
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


SPANS = {"field": (PALETTE[3], MARKERS[2]), "downstream": (PALETTE[4], MARKERS[3])}  # colour, marker


def _locality_fig(curves, named, layers, guarded) -> Markup:
    return to_img(locality_figure(curves, named, layers, guarded),
                  "decision recovery: top-k notes against random k downstream positions by k, with 95% CI bands and "
                  "the whole field and downstream spans; and the field or downstream span patched one layer at a "
                  "time")


@styled
def locality_figure(curves, named, layers, guarded) -> Figure:
    """Recovery against k for the top-k notes and the random-k control, and by layer for the spans, with 95%
    CI bands; the legend below both plots, outside their data."""
    fig, axes = new_figure(7.2, 3.2, ncols=2, sharey=True)
    ax = axes[0]
    ks = set()
    for j, (s, label) in enumerate((("topk", "top-k notes"), ("randomk", "random k (control)"))):
        pts = [(k, st) for k, st in curves.get(s, []) if finite(st.mean)]
        if pts:
            ks |= {k for k, _ in pts}
            line(ax, [k for k, _ in pts], [st.mean for _, st in pts], colour=PALETTE[j], marker=MARKERS[j],
                 dashes=DASHES[j], label=f"{label} (95% CI band)", stats=[st for _, st in pts])
    for s, st in named:
        if s in SPANS and finite(st.mean):
            ax.axhline(st.mean, color=SPANS[s][0], ls=DASHES[2], lw=0.9, label=f"whole {s} span, all layers "
                                                                               f"({st.mean:.2f})")
    if ks:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ks), [str(k) for k in sorted(ks)])
        ax.minorticks_off()
    ax.set_xlabel("k (downstream positions patched)")
    ax.set_ylabel("decision recovery")
    ax.set_title("top-k against random-k" + ("" if guarded else " (UNGUARDED)"))
    ax = axes[1]
    for j, (region, pts) in enumerate(sorted(layers.items())):
        pts = [(lay, st) for lay, st in pts if finite(st.mean)]
        if pts:
            colour, marker = SPANS.get(region, (PALETTE[5], MARKERS[4]))
            line(ax, [p[0] for p in pts], [p[1].mean for p in pts], colour=colour, marker=marker,
                 dashes=DASHES[j], label=f"{region} span, one layer at a time (95% CI band)",
                 stats=[st for _, st in pts], dodge=2.0 * (j - 0.5))
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("one layer at a time")
    ax.yaxis.set_tick_params(labelleft=True)
    lo, hi = ax.get_ylim()
    ax.set_ylim(min(lo, -0.05), max(hi, 1.05))  # recovery's scale, 0 (stale) to 1 (oracle), always in view
    legend_below(fig, ncols=2)
    return fig


SECTION = register(Section(
    id="locality", title="Locality", needs=LOCALITY, order=30, build=build_locality,
    template="sections/locality.html",
    intro="Recovery when the k downstream positions with the largest single-position effect take the new K/V "
          "(top-k) against k random downstream positions (the control), and the field or downstream span one layer "
          "at a time."))
