"""Edit strategies: agreement with the oracle and recovery per strategy and chain-of-thought budget,
the recompute cost against agreement, and the held-out selective(K) sweep."""

from __future__ import annotations

import re

import matplotlib
import numpy as np
import pandas as pd
import seaborn as sns
from markupsafe import Markup
from matplotlib.figure import Figure

from kvprobe.metrics import stay_valid, summarize_edits, valid_case_ids
from kvprobe.reports.figures import (DASHES, MARKERS, PALETTE, errbar, finite, legend_below, line, new_figure,
                                     place_labels, styled, to_img)
from kvprobe.reports.folder import Run
from kvprobe.reports.sections.shared import decision_rows
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat
from kvprobe.reports.summary import strategy_order
from kvprobe.results import EDITS


# what a strategy that picks its positions (cacheblend) records in the edits table's ``note``
FIELD_NOTE = re.compile(r"field recomputed: (True|False)")
N_NOTES = 2  # distinct free-text notes shown per strategy row


def strategy_notes(g: pd.DataFrame) -> list[str]:
    """The editor's notes on one strategy's rows (``note``, ``chose``), in words for its table row: how
    often it missed the field, which repair it chose how often, and its most frequent other notes."""
    n = len(g)
    notes = g["note"].dropna().astype(str).str.strip() if "note" in g else pd.Series(dtype=str)
    notes = notes[notes != ""]
    out = []
    missed = int((notes == "field recomputed: False").sum())
    if missed:
        out.append(f"missed the field on {missed} of {n} cases")
    chose = g["chose"].dropna().astype(str) if "chose" in g else pd.Series(dtype=str)
    chose = chose[chose != ""]
    if len(chose):
        counts = sorted(chose.value_counts().items(), key=lambda t: (-t[1], t[0]))
        out.append("chose " + ", ".join(f"{c} on {k} of {n} cases" for c, k in counts))
        return out  # its notes give each case's reason for the choice: one line per case, not a summary
    other = notes[~notes.str.fullmatch(FIELD_NOTE)]
    counts = sorted(other.value_counts().items(), key=lambda t: (-t[1], t[0]))
    out += [f"{text} ({k} of {n} cases)" for text, k in counts[:N_NOTES]]
    if len(counts) > N_NOTES:
        out.append(f"{len(counts) - N_NOTES} other notes")
    return out


def build_edits(run: Run) -> dict | None:
    e = run.table(EDITS)
    if e.empty or "strategy" not in e:
        return None
    # the configured strategies: every non-selective row (an erratum's label names the run's template, not the
    # spec in the config), and the configured selective ones
    main_mask = ~e["strategy"].str.startswith("selective:") | e["strategy"].isin(run.config.get("strategies") or [])
    dec = decision_rows(e)
    warning = None
    if "valid" in dec:
        valid = dec[dec["case_id"].isin(valid_case_ids(dec))]  # the same cases under every CoT budget
        if valid.empty:
            warning = ("No edited case is valid (the model does not answer correctly under both values): the numbers "
                       "below are over all probed decision cases and say nothing about editing a model that decides.")
            valid = dec
    else:
        valid = dec
    main = valid[main_mask.reindex(valid.index, fill_value=False)]
    # a held-out case's K sweep can repeat a configured strategy (e.g. selective:8:random): count it once
    main = main.drop_duplicates(["case_id", "strategy", "cot"], keep="first")
    order = strategy_order(run, main["strategy"].unique())
    summ = summarize_edits(main, by=("strategy", "cot")) if len(main) else pd.DataFrame()
    rows = []
    if len(summ):
        summ = summ.assign(o=summ["strategy"].map({s: i for i, s in enumerate(order)})).sort_values(["o", "cot"])
        errors = main.groupby(["strategy", "cot"])["error"].apply(lambda s: int(s.notna().sum())) \
            if "error" in main else {}
        notes = {key: strategy_notes(g) for key, g in main.groupby(["strategy", "cot"], sort=False)}
        for r in summ.itertuples():
            rows.append({"strategy": r.strategy, "cot": int(r.cot), "n": int(r.n),
                         "agreement": Stat(r.agreement, r.agreement_lo, r.agreement_hi, int(r.n)),
                         "recovery": Stat(r.recovery, r.recovery_lo, r.recovery_hi, int(r.n_recovery)),
                         "excluded": int(r.n_excluded_small_flip), "flip": r.median_oracle_flip,
                         "frac": r.frac_recomputed, "cosine": r.cosine, "kl": r.kl, "ms": 1000 * r.wall_s,
                         "decision_ms": 1000 * r.to_decision_s,
                         "errors": int(errors.get((r.strategy, r.cot), 0)) if len(errors) else 0,
                         "notes": notes.get((r.strategy, r.cot), [])})
    cots = sorted(int(c) for c in main["cot"].unique()) if "cot" in main else [0]
    sweep = valid[~main_mask.reindex(valid.index, fill_value=False) & valid["strategy"].str.startswith("selective:")]
    sweep = sweep[sweep["cot"] == 0] if "cot" in sweep else sweep
    sweep_rows = summarize_edits(sweep, by=("ranking", "k")).sort_values(["ranking", "k"]) if len(sweep) else None
    missed = {r["strategy"] for r in rows if any(n.startswith("missed the field") for n in r["notes"])}
    figs = []
    if rows:
        figs.append(_edits_bars(rows, cots, missed))
        figs.append(_frontier(rows, sweep_rows, missed))
    cot_table = None
    if len(cots) > 1:
        by = {(r["strategy"], r["cot"]): r["agreement"] for r in rows}
        cot_table = [{"strategy": s, "cells": [by.get((s, c)) for c in cots]} for s in order]
    missed_notes = [f"{s}: " + "; ".join(n for n in next(r["notes"] for r in rows if r["strategy"] == s)
                                          if n.startswith("missed")) for s in sorted(missed)]
    return {"rows": rows, "figs": figs, "cots": cots, "cot_table": cot_table, "warning": warning,
            "missed": missed_notes,
            "still_valid": stay_valid(main),
            "n_cases": int(main["case_id"].nunique()) if len(main) else 0,
            "sweep": [] if sweep_rows is None else [
                {"ranking": r.ranking, "k": int(r.k), "agreement": Stat(r.agreement, r.agreement_lo, r.agreement_hi,
                                                                          int(r.n)), "frac": r.frac_recomputed}
                for r in sweep_rows.itertuples()]}


@styled
def _edits_bars(rows: list[dict], cots: list[int], missed: set[str]) -> Markup:
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    names = {s: s + (" \u2020" if s in missed else "") for s in strategies}
    colours = {str(c): PALETTE[j % len(PALETTE)] for j, c in enumerate(cots)}
    fig, axes = new_figure(6.4, 1.0 + 0.3 * len(strategies) * max(1, len(cots)) ** 0.5, ncols=2, sharey=True)
    for ax, metric in zip(axes, ("agreement", "recovery")):
        stats = {(names[r["strategy"]], str(r["cot"])): r[metric] for r in rows if finite(r[metric].mean)}
        data = pd.DataFrame([{"strategy": s, "cot": c, "value": st.mean} for (s, c), st in stats.items()])
        if len(data):
            sns.barplot(data=data, y="strategy", x="value", hue="cot", order=list(names.values()),
                        hue_order=list(colours), palette=colours, orient="h", errorbar=None, legend=False, ax=ax,
                        width=0.8, dodge=len(cots) > 1, saturation=1)
            for c in ax.containers:  # the legend below names the budgets once
                c.set_label("_nolegend_")
            by_colour = {matplotlib.colors.to_hex(c): cot for cot, c in colours.items()}
            for bar in ax.patches:  # each bar's CI, found by its category (y) and its budget (colour)
                cot = by_colour.get(matplotlib.colors.to_hex(bar.get_facecolor()))
                y = bar.get_y() + bar.get_height() / 2
                st = stats.get((list(names.values())[round(y)], cot))
                if st is not None:
                    ax.errorbar(st.mean, y, xerr=errbar(st.lo, st.mean, st.hi), fmt="none", ecolor="0.2", lw=0.8,
                                capsize=2)
        else:
            ax.text(0.5, 0.5, "no case passes\nthe min-flip guard", transform=ax.transAxes, ha="center",
                    va="center", color="grey")
        ax.set_yticks(range(len(names)), list(names.values()))
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.axvline(1.0, color="grey", lw=0.6, ls=":")
        ax.axvline(0.0, color="grey", lw=0.6)
        ax.set_title(metric)
        ax.set_xlabel(metric + " (95% CI)")
        ax.set_ylabel("")
        ax.grid(axis="y", visible=False)
    if len(cots) > 1:
        for cot, c in colours.items():
            axes[0].bar([0], [0], color=c, label=f"cot={cot}", width=0)
        legend_below(fig, axes[:1], ncols=len(cots))
    return to_img(fig, "agreement and recovery per edit strategy, with 95% CIs" +
                  (" (\u2020 missed the field on some cases)" if missed else ""))


def _sweep_stats(g: pd.DataFrame) -> list[Stat]:
    return [Stat(r.agreement, r.agreement_lo, r.agreement_hi, int(r.n)) for r in g.itertuples()]


@styled
def frontier_figure(rows: list[dict], sweep: pd.DataFrame | None, missed: set[str]) -> Figure:
    """Left: each configured strategy's recomputed share against its agreement (95% CI), labelled directly,
    and the frontier (the best agreement for its cost). Right, on the same scales: the held-out
    selective(K) curves with their CI bands, each its own colour, marker and line style and dodged a
    little sideways (they often coincide), over the frontier for reference."""
    panels = 2 if sweep is not None and len(sweep) else 1
    fig, axes = new_figure(4.6 * panels, 3.9, ncols=panels, sharex=True)
    axes = np.atleast_1d(axes)
    ax = axes[0]
    base = [r for r in rows if r["cot"] == min(r2["cot"] for r2 in rows) and finite(r["agreement"].mean)]
    xs = [100 * r["frac"] for r in base]
    ys = [r["agreement"].mean for r in base]
    front, best = [], -1.0
    for x, y in sorted(zip(xs, ys)):
        if y > best:
            front.append((x, y))
            best = y
    for k, a in enumerate(axes):
        if len(front) > 1:
            a.step([p[0] for p in front], [p[1] for p in front], where="post", color=PALETTE[0], lw=0.8,
                   alpha=0.5 if k == 0 else 0.3, label="frontier of the configured strategies")
    if panels == 2:
        curves = list(sweep.groupby("ranking", sort=True))
        for j, (ranking, g) in enumerate(curves):
            g = g.sort_values("k")
            line(axes[1], (100 * g["frac_recomputed"]).tolist(), g["agreement"],
                 colour=PALETTE[(j + 1) % len(PALETTE)], marker=MARKERS[(j + 1) % 8], dashes=DASHES[(j + 1) % 8],
                 label=f"selective:K:{ranking}", dodge=2.5 * (j - (len(curves) - 1) / 2), stats=_sweep_stats(g),
                 band_alpha=0.08, band_edges=True)
        axes[1].set_title("held-out selective(K) by ranking, K rising to the right\n(95% CI bands; y zoomed)")
    if base:
        ax.errorbar(xs, ys, yerr=np.array([[e[0][0], e[1][0]] for e in
                                           (errbar(r["agreement"].lo, r["agreement"].mean, r["agreement"].hi)
                                            for r in base)]).T.reshape(2, -1),
                    fmt="none", ecolor=PALETTE[0], elinewidth=0.8, capsize=2, zorder=3)
        sns.scatterplot(x=xs, y=ys, ax=ax, color=PALETTE[0], s=30, zorder=4, legend=False)
    ax.set_title("configured strategies (95% CI)")
    for a in axes:
        a.set_xscale("symlog", linthresh=1, linscale=0.6)
        ticks = [0, 1, 2, 5, 10, 20, 50, 100]
        a.set_xticks(ticks, [str(t) for t in ticks])
        a.minorticks_off()
        a.set_xlim(-0.3, 180)
        a.set_xlabel("tokens recomputed (%, log scale above 1)")
    ax.set_ylim(-0.08, 1.12)
    if panels == 2:
        seen = np.r_[sweep["agreement_lo"].to_numpy(float), sweep["agreement"].to_numpy(float)]
        low = float(seen[np.isfinite(seen)].min()) if np.isfinite(seen).any() else 0.0
        axes[1].set_ylim(max(-0.08, low - 0.05), 1.05)
    ax.set_ylabel("agreement with the oracle")
    legend_below(fig, axes, ncols=2)
    obstacles = [(x, r["agreement"].lo, x, r["agreement"].hi) for x, r in zip(xs, base)
                 if finite(r["agreement"].lo) and finite(r["agreement"].hi)]
    place_labels(ax, list(zip(xs, ys)), [r["strategy"] + (" \u2020" if r["strategy"] in missed else "") for r in base],
                 obstacles=obstacles)
    return fig


def _frontier(rows: list[dict], sweep: pd.DataFrame | None, missed: set[str]) -> Markup:
    return to_img(frontier_figure(rows, sweep, missed),
                  "recompute cost against agreement: each configured strategy labelled, with the frontier; beside "
                  "it the held-out selective(K) curves per ranking with 95% CI bands")


SECTION = register(Section(
    id="edits", title="Edit strategies", needs=EDITS, order=20, build=build_edits, template="sections/edits.html",
    intro="Decision agreement with the oracle (full re-prefill) and decision recovery per strategy, with 95% CIs; "
          "then the cost of each strategy (share of tokens recomputed) against its agreement. Chain-of-thought "
          "budgets side by side."))
