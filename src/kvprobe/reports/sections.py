"""One builder per report section: ``build_<id>(run) -> dict | None`` (None: the folder lacks the
table). Builders read the loaded tables only; figures come from :mod:`kvprobe.reports.figures`,
numbers from :mod:`kvprobe.reports.stats` (each with its n and 95% CI).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from markupsafe import Markup, escape

from matplotlib.ticker import MaxNLocator

from kvprobe.metrics import stay_valid, summarize_edits, valid_case_ids
from kvprobe.reports.figures import PALETTE, errbar, finite, new_figure, to_img
from kvprobe.reports.load import TTFT, Run
from kvprobe.reports.stats import Stat, mean_of, nanfloat
from kvprobe.reports.tokens import TOKENS
from kvprobe.results import COMPOSE, CONCENTRATION, EDITS, KNOCKOUT, LINEAR, LOCALITY, SERVING, VALIDITY

N_MAP_CASES = 3  # cases shown in the notes map
N_RANKED = 5  # top notes numbered in the map
TOP_HEADS = 12


def _decision_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[~df["control"].astype(bool)] if "control" in df else df


def _guard(df: pd.DataFrame, min_flip: float) -> tuple[pd.DataFrame, int, bool]:
    """Rows of cases whose |oracle_flip| >= min_flip; (rows, cases excluded, guarded). When no case
    passes, all rows come back with guarded False so the caller can say the values are unguarded."""
    if "oracle_flip" not in df or df.empty:
        return df, 0, True
    flips = df.groupby("case_id")["oracle_flip"].first().abs()
    keep = set(flips[flips >= min_flip].index)
    excluded = len(flips) - len(keep)
    if not keep:
        return df, excluded, False
    return df[df["case_id"].isin(keep)], excluded, True


def _guard_note(excluded: int, guarded: bool, n_cases: int, min_flip: float) -> str | None:
    if not guarded:
        return (f"No case has an oracle flip of at least {min_flip:g} logits (all {n_cases} fall below the guard): "
                f"the values below are unguarded ratios of tiny differences and cannot be interpreted.")
    if excluded:
        return f"{excluded} case(s) with an oracle flip below {min_flip:g} logits are excluded."
    return None


# -- 1. the notes map --------------------------------------------------------------------------
def _rgba(norm: float, scale: float) -> str:
    if not finite(norm) or scale <= 0:
        return "transparent"
    a = min(1.0, abs(norm) / scale) * 0.85
    r, g, b = (213, 94, 0) if norm > 0 else (0, 114, 178)
    return f"rgba({r},{g},{b},{a:.3f})"


def _token_html(text: str, cls: str, style: str, title: str, extra: str = "") -> str:
    lead = text[: len(text) - len(text.lstrip(" \t"))]
    core = text[len(lead):]
    shown = core.replace("\n", "\u21b5\n") if core else ("\u00b7" if not lead else "")
    return (f'{escape(lead)}<span class="{cls}" style="{style}" title="{escape(title)}">{escape(shown)}'
            f'{extra}</span>')


def _case_map(run: Run, case_id: str, sweep: pd.DataFrame, tokens: pd.DataFrame) -> dict:
    g = sweep.sort_values("position")
    flip = nanfloat(g["oracle_flip"].iloc[0])
    effects = dict(zip(g["position"].astype(int), g["value"].astype(float)))
    norms = {p: (e / flip if flip else float("nan")) for p, e in effects.items()}
    scale = max((abs(v) for v in norms.values() if finite(v)), default=0.0)
    n_pos = int(g["n_positions"].iloc[0]) if "n_positions" in g else max(effects) + 1
    t = tokens[tokens["case_id"] == case_id].sort_values("position") if len(tokens) else tokens
    if len(t):
        items = list(zip(t["position"].astype(int), t["token"], t["token_new"], t["kind"], t["region"]))
    else:  # no token text stored: one chip per position
        kinds = dict(zip(g["position"].astype(int), g["kind"]))
        regions = dict(zip(g["position"].astype(int), g["region"]))
        items = [(p, f" {kinds.get(p, '?')}{p}", f" {kinds.get(p, '?')}{p}", kinds.get(p, "?"), regions.get(p, "?"))
                 for p in range(n_pos)] + [(n_pos, " decision", " decision", "decision", "decision")]
    down = g[g["region"] == "downstream"]
    sign = 1.0 if flip >= 0 else -1.0
    ranked = (down.assign(s=down["value"] * sign).sort_values(["s", "position"], ascending=[False, True])
              ["position"].astype(int).tolist()[:N_RANKED])
    rank = {p: i + 1 for i, p in enumerate(ranked)}
    field_pos = [p for p, *_, region in items if region == "field"]
    new_value = "".join(tn for p, _, tn, _, region in items if region == "field").strip()
    parts = []
    for p, text, _, kind, region in items:
        cls = f"tok {region}"
        e, nm = effects.get(p), norms.get(p)
        if region == "decision":
            title = f"position {p}: the decision token (its logits give the answer)"
            parts.append(_token_html(text, "tok decision", "", title))
            continue
        title = (f"position {p} \u00b7 {kind} \u00b7 {region} \u00b7 effect {e:+.4g} logits "
                 f"({nm:+.3f} of the oracle flip)" if e is not None and finite(nm) else f"position {p} \u00b7 {kind}")
        extra = f'<sup class="rank">{rank[p]}</sup>' if p in rank else ""
        parts.append(_token_html(text, cls, f"background:{_rgba(nm if nm is not None else float('nan'), scale)}",
                                 title, extra))
        if field_pos and p == field_pos[-1]:
            parts.append(f'<span class="newval" title="the new value">\u2192 {escape(new_value)}</span>')
    return {"case_id": case_id, "flip": flip, "scale": scale, "html": Markup("".join(parts)),
            "ranked": ranked, "has_text": bool(len(t))}


def build_notes(run: Run) -> dict | None:
    loc = run.table(LOCALITY)
    if loc.empty or "set" not in loc:
        return None
    sweep = loc[(loc["metric"] == "effect") & (loc["set"] == "single")]
    if sweep.empty:
        return None
    sweep = _decision_rows(sweep)
    per_case = sweep.groupby("case_id").agg(flip=("oracle_flip", "first"))
    validity = run.table(VALIDITY)
    valid_ids = (set(validity[validity["valid"].astype(bool) & ~validity["control"].astype(bool)]["case_id"])
                 if len(validity) else set())
    pool = per_case[per_case.index.isin(valid_ids)]
    warning = None
    if pool.empty:
        pool = per_case
        warning = ("No probed case is valid (the model does not answer correctly under both values), so these are "
                   "probed cases that are not valid: read them as mechanics, not as the model's behaviour.")
    pool = pool.assign(a=pool["flip"].abs(), cid=pool.index).sort_values(["a", "cid"], ascending=[False, True])
    tokens = run.table(TOKENS)
    info = validity.set_index("case_id") if len(validity) else pd.DataFrame()
    conc = run.table(CONCENTRATION)
    cases = []
    for cid in pool.index[:N_MAP_CASES]:
        c = _case_map(run, cid, sweep[sweep["case_id"] == cid], tokens)
        if cid in info.index:
            row = info.loc[cid]
            c.update(domain=row.get("domain"), field=row.get("field"), old=row.get("old_value"),
                     new=row.get("new_value"), expected_old=row.get("expected_old"),
                     expected_new=row.get("expected_new"), valid=bool(row.get("valid")))
        c["small_flip"] = abs(c["flip"]) < run.min_flip
        kinds = conc[(conc["case_id"] == cid) & (conc["metric"] == "kind_share")] if len(conc) else conc
        c["kinds"] = [{"kind": k, "share": v, "n_tokens": int(n)}
                      for k, v, n in zip(kinds.get("kind", []), kinds.get("value", []), kinds.get("n_tokens", []))]
        cases.append(c)
    agg, agg_note = [], None
    if len(conc) and "kind" in conc:
        shares = _decision_rows(conc[conc["metric"] == "kind_share"])
        used, excluded, guarded = _guard(shares, run.min_flip)
        agg_note = _guard_note(excluded, guarded, shares["case_id"].nunique(), run.min_flip)
        if guarded:
            for kind, gk in used.groupby("kind", sort=True):
                agg.append({"kind": kind, "stat": Stat.of(gk["value"]),
                            "n_tokens": Stat.of(gk["n_tokens"]).mean})
    return {"cases": cases, "warning": warning, "kinds": agg, "kinds_note": agg_note, "min_flip": run.min_flip,
            "n_probed": len(per_case), "n_valid": len(set(per_case.index) & valid_ids),
            "text_missing": not len(tokens)}


# -- 2. edit strategies ------------------------------------------------------------------------
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
    dec = _decision_rows(e)
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


# -- 3. locality -------------------------------------------------------------------------------
def build_locality(run: Run) -> dict | None:
    loc = run.table(LOCALITY)
    if loc.empty or "set" not in loc:
        return None
    loc = _decision_rows(loc[loc["metric"] == "recovery"])
    if loc.empty:
        return None
    n_cases = loc["case_id"].nunique()
    used, excluded, guarded = _guard(loc, run.min_flip)
    note = _guard_note(excluded, guarded, n_cases, run.min_flip)
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


# -- 4. linear probes --------------------------------------------------------------------------
def build_linear(run: Run) -> dict | None:
    lin = run.table(LINEAR)
    if lin.empty or "metric" not in lin:
        return None
    n_layers = int(lin["n_layers"].dropna().iloc[0]) if "n_layers" in lin and lin["n_layers"].notna().any() \
        else int(run.manifest.get("n_layers") or (lin["layer"].max() + 1))
    acc = lin[lin["metric"] == "acc"]
    shuf = lin[lin["metric"] == "acc_shuffled"]
    depth = lin[lin["metric"].isin(["write_depth", "commit_depth"])]
    lens = lin[lin["metric"] == "logit_lens_agree"].sort_values("layer")
    commit = depth[depth["metric"] == "commit_depth"]
    commit_layer = (int(commit["layer"].iloc[0]) if len(commit) and finite(nanfloat(commit["layer"].iloc[0]))
                    else None)
    write = {}
    rows = []
    for r in depth.sort_values(["metric", "region", "stream", "label"]).itertuples():
        layer = nanfloat(r.layer)
        note = getattr(r, "note", None)
        rows.append({"metric": r.metric, "site": r.region, "stream": r.stream, "label": r.label, "n": int(r.n),
                     "layer": int(layer) if finite(layer) else None,
                     "depth": nanfloat(r.value), "note": note if isinstance(note, str) else None})
        if r.metric == "write_depth" and r.stream == "resid" and r.label == "value" and finite(layer):
            write[r.region] = int(layer)
    fig = _linear_fig(acc, shuf, lens, write, commit_layer, n_layers)
    notes = sorted({n for n in lin.get("note", pd.Series(dtype=object)).dropna().unique() if isinstance(n, str)})
    n = int(acc["n"].max()) if len(acc) and "n" in acc else 0
    table = []
    for (site, stream, label), g in acc.groupby(["region", "stream", "label"], sort=True):
        best = g.loc[g["value"].idxmax()] if g["value"].notna().any() else None
        table.append({"site": site, "stream": stream, "label": label,
                      "best": None if best is None else (int(best["layer"]),
                                                          Stat.wilson(float(best["value"]), int(best["n"])))})
    return {"fig": fig, "rows": rows, "notes": notes, "n": n, "n_layers": n_layers, "commit": commit_layer,
            "write": write, "table": table,
            "n_templates": int(lin["n_templates"].max()) if "n_templates" in lin else None}


def _linear_fig(acc, shuf, lens, write, commit, n_layers) -> Markup:
    sites = [s for s in ("field", "notes", "decision") if (acc["region"] == s).any()]
    fig, axes = new_figure(2.4 * max(1, len(sites)), 2.6, ncols=max(1, len(sites)), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, site in zip(axes, sites):
        g = acc[(acc["region"] == site) & (acc["label"] == "value")]
        for j, (stream, gs) in enumerate(g.groupby("stream", sort=True)):
            gs = gs.sort_values("layer")
            x = gs["layer"].astype(float).tolist()
            y = gs["value"].astype(float).tolist()
            sts = [Stat.wilson(v, int(n)) for v, n in zip(y, gs["n"])]
            ax.plot(x, y, marker="o", ms=3, color=PALETTE[j], label=f"{stream}")
            ax.fill_between(x, [s.lo if finite(s.lo) else np.nan for s in sts],
                            [s.hi if finite(s.hi) else np.nan for s in sts], color=PALETTE[j], alpha=0.15, lw=0)
        sh = shuf[(shuf["region"] == site) & (shuf["label"] == "value")]
        if len(sh):
            m = sh.groupby("layer")["value"].mean()
            ax.plot(m.index.astype(float), m.values, color="grey", ls="--", lw=0.7, label="shuffled labels")
        if site == "decision" and len(lens):
            ax.plot(lens["layer"].astype(float), lens["value"].astype(float), color=PALETTE[3], marker="s", ms=3,
                    lw=0.8, label="logit lens agrees")
        if site in write:
            ax.axvline(write[site], color=PALETTE[4], lw=1.2, label=f"write depth (L{write[site]})")
        if commit is not None:
            ax.axvline(commit, color="black", ls=":", lw=1.2, label=f"commit depth (L{commit})")
        ax.set_title(f"at the {site}" if site != "decision" else "at the decision token")
        ax.set_xlabel(f"layer (of {n_layers})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(-0.05, 1.05)
    axes[0].set_ylabel("held-out accuracy (label: value)")
    handles = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=min(4, len(handles)))
    return to_img(fig, "linear-probe accuracy by layer with the write and commit depths")


# -- 5. knockout -------------------------------------------------------------------------------
def build_knockout(run: Run) -> dict | None:
    k = run.table(KNOCKOUT)
    if k.empty or "probe" not in k:
        return None
    k = _decision_rows(k)
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
        used, excluded, guarded = _guard(rec, run.min_flip)
        metric = "recovery"
        if not guarded:
            eff = single[single["metric"] == "effect"]
            used = eff.assign(value=eff["value"] * np.sign(eff["oracle_flip"].replace(0, 1.0)))
            metric = "effect toward the oracle (logits)"
        out["head_note"] = _guard_note(excluded, guarded, rec["case_id"].nunique(), run.min_flip)
        if not guarded:
            out["head_note"] += " The heatmap shows the raw effect (m - m_stale, signed toward the oracle) instead."
        per = used.groupby(["layer", "head"])["value"].agg(["mean", "count"]).reset_index()
        out["heat"] = _head_fig(per, metric)
        out["n_head_cases"] = int(used["case_id"].nunique())
        sets = hp[hp["set"].isin(["top", "random", "all"])]
        sets_rec, _, g2 = _guard(sets[sets["metric"] == "recovery"], run.min_flip)
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


# -- 6. top-K ----------------------------------------------------------------------------------
def build_topk(run: Run) -> dict | None:
    if run.topk_text is None:
        return None
    cfg = run.topk
    sweep = cfg.get("k_sweep") or []
    rows = [{"k": int(r["k"]), "agreement": Stat(nanfloat(r.get("agreement")), nanfloat(r.get("agreement_lo")),
                                                  nanfloat(r.get("agreement_hi")), int(r.get("n") or 0)),
             "recovery": Stat(nanfloat(r.get("recovery")), nanfloat(r.get("recovery_lo")),
                              nanfloat(r.get("recovery_hi")), int(r.get("n") or 0)),
             "frac": nanfloat(r.get("frac_recomputed"))} for r in sweep if "k" in r]
    k_star = cfg.get("k_star")
    fig = None
    if rows:
        fig_, ax = new_figure(4.6, 2.8)
        pts = [r for r in rows if finite(r["agreement"].mean)]
        ax.errorbar([r["k"] for r in pts], [r["agreement"].mean for r in pts],
                    yerr=np.array([[e[0][0], e[1][0]] for e in
                                   (errbar(r["agreement"].lo, r["agreement"].mean, r["agreement"].hi)
                                    for r in pts)]).T.reshape(2, -1),
                    marker="o", ms=3, capsize=2, lw=0.9, color=PALETTE[0], label="selective:K:causal (held-out)")
        if cfg.get("threshold") is not None:
            ax.axhline(float(cfg["threshold"]), color="grey", ls="--", lw=0.7, label=f"threshold {cfg['threshold']}")
        if k_star is not None:
            ax.axvline(int(k_star), color=PALETTE[3], lw=1.2, label=f"K* = {k_star}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("K (downstream positions recomputed besides the field)")
        ax.set_ylabel("agreement with the oracle")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(loc="lower right")
        fig = to_img(fig_, "K sweep with K* marked")
    ci = cfg.get("agreement_ci95") or [float("nan"), float("nan")]
    star = Stat(nanfloat(cfg.get("agreement")), nanfloat(ci[0]), nanfloat(ci[1]), int(cfg.get("n_cases") or 0)) \
        if k_star is not None else None
    return {"rows": rows, "fig": fig, "k_star": k_star, "star": star, "reason": cfg.get("reason"),
            "yaml": run.topk_text}


# -- 7. composition ----------------------------------------------------------------------------
COMPOSE_NEEDS = ("seam", "rerotate", "agree")


def build_compose(run: Run) -> dict | None:
    c, t = run.table(COMPOSE), run.table(TTFT)
    if c.empty and t.empty:
        return None
    out: dict = {"rows": [], "fig": None, "missing": None, "ttft": [], "ttft_fig": None, "ttft_missing": None,
                 "n_queries": None}
    if len(c):
        missing = [col for col in COMPOSE_NEEDS if col not in c]
        if missing:
            out["missing"] = missing
        else:
            unit = "query_id" if "query_id" in c else None
            out["n_queries"] = int(c[unit].nunique()) if unit else len(c)
            for (rot, s), g in c.groupby(["rerotate", "seam"], sort=True):
                out["rows"].append({"rerotate": bool(rot), "seam": int(s), "agree": Stat.of(g["agree"].astype(float)),
                                    "cosine": Stat.of(g["cosine"]) if "cosine" in g else None,
                                    "kl": Stat.of(g["kl"]) if "kl" in g else None})
            out["rows"].sort(key=lambda r: (not r["rerotate"], r["seam"]))
            out["fig"] = _compose_fig(out["rows"])
    if len(t):
        if "speedup" not in t and {"full_s", "compose_s"} <= set(t.columns):
            t = t.assign(speedup=t["full_s"] / t["compose_s"])
        if "block_tokens" not in t or "speedup" not in t:
            out["ttft_missing"] = [col for col in ("block_tokens", "speedup") if col not in t]
        else:
            for L, g in t.groupby("block_tokens", sort=True):
                out["ttft"].append({"block_tokens": int(L), "speedup": Stat.of(g["speedup"]),
                                    "full_s": mean_of(g["full_s"]) if "full_s" in g else float("nan"),
                                    "compose_s": mean_of(g["compose_s"]) if "compose_s" in g else float("nan")})
            out["ttft_fig"] = _ttft_fig(out["ttft"])
    return out


def _compose_fig(rows: list[dict]) -> Markup:
    fig, axes = new_figure(6.4, 2.6, ncols=2)
    for ax, metric in zip(axes, ("agree", "cosine")):
        for j, rot in enumerate((True, False)):
            pts = [r for r in rows if r["rerotate"] == rot and r[metric] is not None and finite(r[metric].mean)]
            if not pts:
                continue
            x = [r["seam"] for r in pts]
            ax.errorbar(x, [r[metric].mean for r in pts],
                        yerr=np.array([[e[0][0], e[1][0]] for e in
                                       (errbar(r[metric].lo, r[metric].mean, r[metric].hi) for r in pts)]).T,
                        marker="o", ms=3, capsize=2, lw=0.9, color=PALETTE[j],
                        label="re-rotated" if rot else "not re-rotated")
        ax.set_xscale("symlog", base=2, linthresh=1)
        ax.set_xlabel("seam tokens recomputed (s)")
        ax.set_ylabel({"agree": "decision agreement", "cosine": "logit cosine"}[metric])
        ax.set_title(f"{'agreement' if metric == 'agree' else 'cosine'} against full recompute")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right")
    return to_img(fig, "composition: agreement and cosine against seam size")


def _ttft_fig(rows: list[dict]) -> Markup:
    fig, ax = new_figure(4.4, 2.6)
    pts = [r for r in rows if finite(r["speedup"].mean)]
    ax.errorbar([r["block_tokens"] for r in pts], [r["speedup"].mean for r in pts],
                yerr=np.array([[e[0][0], e[1][0]] for e in
                               (errbar(r["speedup"].lo, r["speedup"].mean, r["speedup"].hi) for r in pts)]).T
                .reshape(2, -1), marker="o", ms=3, capsize=2, color=PALETTE[0])
    ax.axhline(1.0, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("skill block length (tokens)")
    ax.set_ylabel("TTFT speedup (full / composed)")
    ax.set_title("time to first token")
    return to_img(fig, "TTFT speedup against block length")


# -- 8. serving ---------------------------------------------------------------------------------
SERVING_NEEDS = ("rate", "arm", "ok", "prompt_tokens", "cached_tokens", "ceiling_tokens", "ttft_s", "run_wall_s",
                 "run_queries", "run_hits", "agree")
ARM_LABELS = {"unchanged": "unchanged (baseline)", "edit_unique": "in-prefix edit, unique values",
              "edit_set": "in-prefix edit, small value set", "erratum": "erratum"}


def _rate_text(rate: float) -> str:
    return "saturation" if math.isinf(rate) else f"{rate:g}/s"


def build_serving(run: Run) -> dict | None:
    from kvprobe.serving.metrics import ratios, summarize

    df = run.table(SERVING)
    if df.empty:
        return None
    missing = [col for col in SERVING_NEEDS if col not in df]
    if missing:
        return {"missing": missing}
    summary = summarize(df)
    arms = [a for a in ARM_LABELS if a in set(summary["arm"])] + sorted(set(summary["arm"]) - set(ARM_LABELS))
    pooled = []
    for arm in arms:
        g = df[(df["arm"] == arm) & df["ok"].astype(bool)]
        runs = df[df["arm"] == arm].groupby("rate")[["run_queries", "run_hits"]].first()
        prompt = float(g["prompt_tokens"].sum())
        reported = bool(df["cached_reported"].any()) if "cached_reported" in df else True
        pooled.append({"arm": arm, "label": ARM_LABELS.get(arm, arm), "n": len(g),
                       "metrics": float(runs["run_hits"].sum() / runs["run_queries"].sum())
                       if runs["run_queries"].sum() > 0 else float("nan"),
                       "usage": float(g["cached_tokens"].fillna(0).sum()) / prompt if prompt and reported
                       else float("nan"),
                       "ceiling": float(g["ceiling_tokens"].sum()) / prompt if prompt else float("nan"),
                       "agree": Stat.of(g["agree"].dropna().astype(float)),
                       "oracle_answers": int(g.loc[g["oracle_answer"] != "?", "oracle_answer"].nunique())
                       if "oracle_answer" in g else 0})
    rows = [{"rate": _rate_text(r.rate), "arm": r.arm, "ok": r.ok, "n": r.n, "metrics": r.hit_rate_metrics,
             "usage": r.hit_rate_usage, "agree_rates": r.hit_rates_agree, "ceiling": r.ceiling,
             "p50": r.ttft_p50 * 1000, "p90": r.ttft_p90 * 1000, "p99": r.ttft_p99 * 1000,
             "throughput": r.throughput, "agreement": r.agreement, "n_agreement": r.n_agreement}
            for r in summary.itertuples()]
    ratio_rows = [{"rate": _rate_text(r.rate), "p50": r.ttft_p50_ratio, "p90": r.ttft_p90_ratio,
                   "throughput": r.throughput_ratio} for r in ratios(summary).itertuples()]
    m = run.serving_manifest
    policy = m.get("policy", {})
    facts = [("server", f"{m.get('served_model', '?')} at {m.get('url', '?')} ({m.get('server_version') or 'version ?'}"
                        f"{', started for the run' if m.get('own_server') else ''})"),
             ("KV block size", m.get("block_size")),
             ("policy", f"{policy.get('domain')}: field {policy.get('field')}, base value {policy.get('base_value')}, "
                        f"{policy.get('base_prompt_tokens')} prompt tokens"),
             ("erratum template", policy.get("erratum_template")),
             ("erratum ceiling", f"{policy.get('erratum_shared_tokens')} shared prefix tokens of "
                                 f"{policy.get('erratum_prompt_tokens')}: {fmt(policy.get('erratum_ceiling'), 3)}"),
             ("runs", ", ".join(f"{k}={v}" for k, v in sorted((m.get("config") or {}).items())
                                if k in ("n", "max_s", "seed", "rates", "policy_tokens")))] if m else []
    disagree = [r for r in rows if r["agree_rates"] is False]
    note = (f"In {len(disagree)} run(s) the /metrics and per-request hit rates differ by more than 2 points "
            f"(preempted or concurrently scheduled requests are counted twice by the server's counters).") \
        if disagree else None
    stuck = [p["arm"] for p in pooled if p["arm"] != "unchanged" and p["oracle_answers"] == 1]
    stuck_note = (f"The oracle gave one answer for every value of {', '.join(stuck)}: there, decision agreement "
                  f"cannot tell a right answer from a stuck one.") if stuck else None
    return {"missing": None, "rows": rows, "pooled": pooled, "ratios": ratio_rows, "facts": facts, "note": note,
            "stuck_note": stuck_note,
            "bars": _serving_bars(pooled), "load_fig": _serving_load(summary, arms)}


def _serving_bars(pooled: list[dict]) -> Markup:
    fig, ax = new_figure(5.2, 2.6)
    x = np.arange(len(pooled))
    for j, (key, label) in enumerate((("metrics", "/metrics"), ("usage", "cached_tokens"))):
        ax.bar(x + (j - 0.5) * 0.38, [100 * nanfloat(p[key]) for p in pooled], width=0.38, color=PALETTE[j],
               label=label)
    for i, p in enumerate(pooled):
        if finite(p["ceiling"]):
            ax.plot([i - 0.42, i + 0.42], [100 * p["ceiling"]] * 2, color="black", lw=1.2,
                    label="ceiling" if i == 0 else None)
    ax.set_xticks(x, [p["arm"] for p in pooled])
    ax.set_ylim(0, 128)
    ax.set_yticks([0, 20, 40, 60, 80, 100])
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_title("hit rate per arm, all loads pooled")
    ax.legend(loc="upper center", ncols=3)
    return to_img(fig, "prefix-cache hit rate per arm with its block-granularity ceiling")


def _serving_load(summary: pd.DataFrame, arms: list[str]) -> Markup:
    rates = sorted(summary["rate"].unique())
    finite_rates = [r for r in rates if math.isfinite(r)]
    sat_x = (max(finite_rates) * 2) if finite_rates else 1.0
    fig, axes = new_figure(6.8, 2.6, ncols=2)
    for j, arm in enumerate(arms):
        g = summary[summary["arm"] == arm].sort_values("rate")
        xs = [r if math.isfinite(r) else sat_x for r in g["rate"]]
        axes[0].plot(xs, 1000 * g["ttft_p90"], marker="o", ms=3, color=PALETTE[j], label=arm)
        axes[0].plot(xs, 1000 * g["ttft_p50"], ls=":", lw=0.8, color=PALETTE[j])
        axes[1].plot(xs, g["throughput"], marker="o", ms=3, color=PALETTE[j], label=arm)
    ticks = [r if math.isfinite(r) else sat_x for r in rates]
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{r:g}" if math.isfinite(r) else "sat" for r in rates])
        ax.minorticks_off()
        ax.set_xlabel("offered load (requests/s; sat = all at once)")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("TTFT (ms): p90 solid, p50 dotted")
    axes[0].set_title("time to first token against load")
    axes[1].set_ylabel("completed requests/s")
    axes[1].set_title("throughput against load")
    axes[1].legend(loc="upper left")
    return to_img(fig, "TTFT and throughput against load per arm")


# -- 9. run facts ------------------------------------------------------------------------------
def build_facts(run: Run) -> dict | None:
    m, cm = run.manifest, run.compose_manifest
    if not m and not cm:
        return None
    facts = []
    if m:
        cfg = m.get("config", {})
        fp = m.get("model", {})
        facts += [("model", cfg.get("model") or fp.get("spec")),
                  ("fingerprint", ", ".join(f"{k}={v}" for k, v in sorted(fp.items()))),
                  ("model info", ", ".join(f"{k}={v}" for k, v in sorted(m.get("model_info", {}).items())
                                           if v is not None)),
                  ("shape", f"{m.get('n_layers')} layers, {m.get('n_heads')} query heads, "
                            f"{m.get('n_kv_heads')} kv heads"),
                  ("dataset", f"{cfg.get('dataset')} (n={cfg.get('n')}, form={cfg.get('form')}, "
                              f"few_shot={cfg.get('few_shot')})"),
                  ("seed", m.get("seed", cfg.get("seed"))),
                  ("min flip guard", f"{cfg.get('min_flip')} logits"),
                  ("valid_only", cfg.get("valid_only")),
                  ("probes", ", ".join(cfg.get("probes", []))),
                  ("chain-of-thought budgets", ", ".join(map(str, cfg.get("cot", []))))]
        facts += [("versions", ", ".join(f"{k} {v}" for k, v in sorted(m.get("versions", {}).items())))]
        wall = m.get("wall_s", {})
        facts += [("wall time", f"{wall.get('total', float('nan')):.1f} s total; " +
                   ", ".join(f"{k} {v:.1f} s" for k, v in wall.items() if k != "total"))] if wall else []
    if cm:
        fp = cm.get("model", {})
        facts += [("composition run", f"{cm.get('command', 'validate')}: n={cm.get('n')}, seams={cm.get('seams')}, "
                   f"gated seam {cm.get('gated_seam')}, threshold {cm.get('threshold')}, "
                   f"block tokens {cm.get('block_tokens')}, blocks {cm.get('n_blocks')}, attn {cm.get('attn')}")]
        if isinstance(fp, dict) and not m:
            facts += [("fingerprint", ", ".join(f"{k}={v}" for k, v in sorted(fp.items())))]
        if cm.get("wall_s") is not None:
            facts += [("composition wall time", f"{float(cm['wall_s']):.1f} s")]
    counts = m.get("counts", {})
    validity = m.get("validity", {})
    return {"facts": [(k, "" if v is None else str(v)) for k, v in facts], "counts": sorted(counts.items()),
            "skipped": m.get("skipped", []), "invalid": sorted(m.get("invalid_reasons", {}).items()),
            "validity": sorted(validity.items()), "folder": str(run.folder), "has_manifest": bool(m)}


BUILDERS = {"notes": build_notes, "edits": build_edits, "locality": build_locality, "linear": build_linear,
            "knockout": build_knockout, "topk": build_topk, "compose": build_compose, "serving": build_serving,
            "facts": build_facts}


def fmt(x, digits: int = 2) -> str:
    x = nanfloat(x)
    return "n/a" if not math.isfinite(x) else f"{x:.{digits}f}"
