"""Serving: the erratum against the in-prefix edit on a real vLLM server under load (prefix-cache hit
rates against their ceiling, TTFT and throughput, agreement with the oracle)."""

from __future__ import annotations

import math

import pandas as pd
import seaborn as sns
from markupsafe import Markup

from kvprobe.reports.figures import (DASHES, MARKERS, PALETTE, finite, legend_below, line, new_figure, styled,
                                     to_img)
from kvprobe.reports.folder import Run
from kvprobe.reports.sections.shared import fmt
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat, nanfloat
from kvprobe.results import SERVING

SERVING_NEEDS = ("rate", "arm", "ok", "prompt_tokens", "cached_tokens", "ceiling_tokens", "ttft_s", "run_wall_s",
                 "run_queries", "run_hits", "agree")
ARM_LABELS = {"unchanged": "unchanged (baseline)", "edit_unique": "in-prefix edit, unique values",
              "edit_set": "in-prefix edit, small value set", "erratum": "erratum"}


def _rate_text(rate: float) -> str:
    return "saturation" if math.isinf(rate) else f"{rate:g}/s"


def build_serving(run: Run) -> dict | None:
    from kvprobe.serving.measure import ratios, summarize

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
                       "agree": Stat.share(g["agree"].dropna().astype(float)),
                       "distinct_references": int(g.loc[g["reference"] != "?", "reference"].nunique())
                       if "reference" in g else 0})
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
    stuck = [p["arm"] for p in pooled if p["arm"] != "unchanged" and p["distinct_references"] == 1]
    stuck_note = (f"The oracle gave one answer for every value of {', '.join(stuck)}: there, decision agreement "
                  f"cannot tell a right answer from a stuck one.") if stuck else None
    return {"missing": None, "rows": rows, "pooled": pooled, "ratios": ratio_rows, "facts": facts, "note": note,
            "stuck_note": stuck_note,
            "bars": _serving_bars(pooled), "load_fig": _serving_load(summary, arms)}


@styled
def _serving_bars(pooled: list[dict]) -> Markup:
    fig, ax = new_figure(5.6, 2.9)
    sources = {"/metrics": "metrics", "cached_tokens": "usage"}
    data = pd.DataFrame([{"arm": p["arm"], "source": label, "hit": 100 * nanfloat(p[key])}
                         for p in pooled for label, key in sources.items()])
    sns.barplot(data=data, x="arm", y="hit", hue="source", hue_order=list(sources), order=[p["arm"] for p in pooled],
                palette=dict(zip(sources, PALETTE)), errorbar=None, ax=ax, width=0.76, saturation=1)
    for i, p in enumerate(pooled):
        if finite(p["ceiling"]):
            ax.plot([i - 0.42, i + 0.42], [100 * p["ceiling"]] * 2, color="black", lw=1.2,
                    label="ceiling (whole KV blocks)" if i == 0 else None)
    ax.set_ylim(0, 105)
    ax.set_yticks([0, 20, 40, 60, 80, 100])
    ax.set_xlabel("")
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.set_title("hit rate per arm, all loads pooled")
    ax.grid(axis="x", visible=False)
    if ax.get_legend() is not None:
        ax.get_legend().remove()
    legend_below(fig, ncols=3)
    return to_img(fig, "prefix-cache hit rate per arm, from the server's counters and from cached_tokens, with its "
                       "block-granularity ceiling")


@styled
def _serving_load(summary: pd.DataFrame, arms: list[str]) -> Markup:
    rates = sorted(summary["rate"].unique())
    finite_rates = [r for r in rates if math.isfinite(r)]
    sat_x = (max(finite_rates) * 2) if finite_rates else 1.0
    fig, axes = new_figure(7.0, 2.9, ncols=2)
    for j, arm in enumerate(arms):
        g = summary[summary["arm"] == arm].sort_values("rate")
        xs = [r if math.isfinite(r) else sat_x for r in g["rate"]]
        style = {"colour": PALETTE[j % len(PALETTE)], "marker": MARKERS[j % 8], "ms": 3.5,
                 "dodge": 1.5 * (j - (len(arms) - 1) / 2)}  # arms that coincide stay apart
        line(axes[0], xs, 1000 * g["ttft_p90"], label=arm, **style)
        line(axes[0], xs, 1000 * g["ttft_p50"], dashes=":", lw=0.8, **(style | {"ms": 0}))
        line(axes[1], xs, g["throughput"], label=arm, dashes=DASHES[j % 8], **style)
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
    legend_below(fig, [axes[1]], ncols=4)
    return to_img(fig, "TTFT (p50 and p90) and throughput against the offered load, per arm")


SECTION = register(Section(
    id="serving", title="Serving", needs=SERVING, order=80, build=build_serving, template="sections/serving.html",
    intro="The erratum against the in-prefix edit on a real vLLM server under Poisson load (kvprobe serve-bench): "
          "the prefix-cache hit rate from the server's /metrics counters and from each response's cached_tokens, "
          "against the block-granularity ceiling (whole KV blocks of a prefix an earlier request filled, never the "
          "last token); time to first token and throughput against the offered load; and how often each arm's "
          "answer agrees with the oracle, the greedy answer on the prompt with the current value written in "
          "place."))
