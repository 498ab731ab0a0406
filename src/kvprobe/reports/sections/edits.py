"""Edit strategies: agreement with the oracle and recovery per strategy and chain-of-thought budget,
the recompute cost against agreement, and the held-out selective(K) sweep."""

from __future__ import annotations

import pandas as pd
from markupsafe import Markup

from kvprobe.metrics import stay_valid, summarize_edits, valid_case_ids
from kvprobe.reports.figures import PALETTE, errbar, finite, new_figure, to_img
from kvprobe.reports.folder import Run
from kvprobe.reports.sections.shared import decision_rows
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat
from kvprobe.results import EDITS


def _strategy_order(run: Run, names) -> list[str]:
    cfg = list(run.config.get("strategies") or [])
    return [s for s in cfg if s in set(names)] + sorted(set(names) - set(cfg))


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
    order = _strategy_order(run, main["strategy"].unique())
    summ = summarize_edits(main, by=("strategy", "cot")) if len(main) else pd.DataFrame()
    rows = []
    if len(summ):
        summ = summ.assign(o=summ["strategy"].map({s: i for i, s in enumerate(order)})).sort_values(["o", "cot"])
        errors = main.groupby(["strategy", "cot"])["error"].apply(lambda s: int(s.notna().sum())) \
            if "error" in main else {}
        for r in summ.itertuples():
            rows.append({"strategy": r.strategy, "cot": int(r.cot), "n": int(r.n),
                         "agreement": Stat(r.agreement, r.agreement_lo, r.agreement_hi, int(r.n)),
                         "recovery": Stat(r.recovery, r.recovery_lo, r.recovery_hi, int(r.n_recovery)),
                         "excluded": int(r.n_excluded_small_flip), "flip": r.median_oracle_flip,
                         "frac": r.frac_recomputed, "cosine": r.cosine, "kl": r.kl, "ms": r.wall_ms,
                         "decision_ms": r.to_decision_ms,
                         "errors": int(errors.get((r.strategy, r.cot), 0)) if len(errors) else 0})
    cots = sorted(int(c) for c in main["cot"].unique()) if "cot" in main else [0]
    sweep = valid[~main_mask.reindex(valid.index, fill_value=False) & valid["strategy"].str.startswith("selective:")]
    sweep = sweep[sweep["cot"] == 0] if "cot" in sweep else sweep
    sweep_rows = summarize_edits(sweep, by=("ranking", "k")).sort_values(["ranking", "k"]) if len(sweep) else None
    figs = []
    if rows:
        figs.append(_edits_bars(rows, cots))
        figs.append(_frontier(rows, sweep_rows))
    cot_table = None
    if len(cots) > 1:
        by = {(r["strategy"], r["cot"]): r["agreement"] for r in rows}
        cot_table = [{"strategy": s, "cells": [by.get((s, c)) for c in cots]} for s in order]
    return {"rows": rows, "figs": figs, "cots": cots, "cot_table": cot_table, "warning": warning,
            "still_valid": stay_valid(main),
            "n_cases": int(main["case_id"].nunique()) if len(main) else 0,
            "sweep": [] if sweep_rows is None else [
                {"ranking": r.ranking, "k": int(r.k), "agreement": Stat(r.agreement, r.agreement_lo, r.agreement_hi,
                                                                          int(r.n)), "frac": r.frac_recomputed}
                for r in sweep_rows.itertuples()]}


def _edits_bars(rows: list[dict], cots: list[int]) -> Markup:
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    h = 0.8 / max(1, len(cots))
    fig, axes = new_figure(6.0, 0.9 + 0.28 * len(strategies) * max(1, len(cots)) ** 0.5, ncols=2, sharey=True)
    for ax, metric in zip(axes, ("agreement", "recovery")):
        any_value, labelled = False, set()
        for j, cot in enumerate(cots):
            for i, s in enumerate(strategies):
                r = next((r for r in rows if r["strategy"] == s and r["cot"] == cot), None)
                if r is None or not finite(r[metric].mean):
                    continue
                st = r[metric]
                any_value = True
                ax.barh(i + (j - (len(cots) - 1) / 2) * h, st.mean, height=h * 0.9, color=PALETTE[j % len(PALETTE)],
                        xerr=errbar(st.lo, st.mean, st.hi), error_kw={"lw": 0.8, "capsize": 2},
                        label=None if cot in labelled else f"cot={cot}")
                labelled.add(cot)
        ax.set_yticks(range(len(strategies)), strategies)
        ax.invert_yaxis()
        ax.axvline(1.0, color="grey", lw=0.6, ls=":")
        ax.axvline(0.0, color="grey", lw=0.6)
        ax.set_title(metric)
        if not any_value:
            ax.text(0.5, 0.5, "no case passes\nthe min-flip guard", transform=ax.transAxes, ha="center",
                    va="center", color="grey")
        ax.set_xlabel(metric + " (95% CI)")
    if len(cots) > 1 and axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(loc="lower right")
    return to_img(fig, "agreement and recovery per edit strategy, with 95% CIs")


def _frontier(rows: list[dict], sweep: pd.DataFrame | None) -> Markup:
    fig, ax = new_figure(5.0, 3.2)
    base = [r for r in rows if r["cot"] == min(r2["cot"] for r2 in rows)]
    for i, r in enumerate(base):
        st = r["agreement"]
        if not finite(st.mean):
            continue
        ax.errorbar(100 * r["frac"], st.mean, yerr=errbar(st.lo, st.mean, st.hi), fmt="o", ms=4, color=PALETTE[0],
                    elinewidth=0.8, capsize=2)
        ax.annotate(r["strategy"], (100 * r["frac"], st.mean), fontsize=6, xytext=(3, 3 if i % 2 else -8),
                    textcoords="offset points")
    pts = sorted((100 * r["frac"], r["agreement"].mean) for r in base if finite(r["agreement"].mean))
    front, best = [], -1.0
    for x, y in pts:
        if y > best:
            front.append((x, y))
            best = y
    if len(front) > 1:
        ax.step([p[0] for p in front], [p[1] for p in front], where="post", color=PALETTE[0], lw=0.8, alpha=0.6,
                label="frontier")
    if sweep is not None:
        for j, (ranking, g) in enumerate(sweep.groupby("ranking", sort=True)):
            ax.plot(100 * g["frac_recomputed"], g["agreement"], marker=".", lw=0.8, color=PALETTE[(j + 1) % 8],
                    label=f"selective:K:{ranking} (held-out)")
    ax.set_xlabel("tokens recomputed (%)")
    ax.set_ylabel("agreement with the oracle")
    ax.set_ylim(-0.05, 1.1)
    ax.legend(loc="lower right")
    ax.set_title("recompute cost against agreement")
    return to_img(fig, "recompute cost against agreement: the frontier")


SECTION = register(Section(
    id="edits", title="Edit strategies", needs=EDITS, order=20, build=build_edits, template="sections/edits.html",
    intro="Decision agreement with the oracle (full re-prefill) and decision recovery per strategy, with 95% CIs; "
          "then the cost of each strategy (share of tokens recomputed) against its agreement. Chain-of-thought "
          "budgets side by side."))
