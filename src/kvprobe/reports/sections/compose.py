"""Composition: composed caches against a full recompute by seam size, with and without
re-rotation, and the time-to-first-token speedup where a benchmark result is present."""

from __future__ import annotations

import numpy as np
from markupsafe import Markup

from kvprobe.reports.figures import PALETTE, errbar, finite, new_figure, to_img
from kvprobe.reports.folder import TTFT, Run
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat, mean_of
from kvprobe.results import COMPOSE

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


SECTION = register(Section(
    id="compose", title="Composition", needs=f"{COMPOSE} / {TTFT}", order=70, build=build_compose,
    template="sections/compose.html",
    intro="Composed caches (precompiled blocks spliced with re-rotated keys and s seam tokens recomputed) against a "
          "full recompute: decision agreement and logit cosine by seam size, with and without re-rotation; "
          "time-to-first-token speedup where a benchmark result is present."))
