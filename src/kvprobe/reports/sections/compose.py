"""Composition: composed caches against a full recompute by seam size, with and without
re-rotation, and the time-to-first-token speedup where a benchmark result is present."""

from __future__ import annotations

from markupsafe import Markup

from kvprobe.reports.figures import (DASHES, MARKERS, PALETTE, finite, legend_below, line, new_figure, styled,
                                     to_img)
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
                out["rows"].append({"rerotate": bool(rot), "seam": int(s),
                                    "agree": Stat.share(g["agree"].astype(float)),
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


@styled
def _compose_fig(rows: list[dict]) -> Markup:
    fig, axes = new_figure(6.8, 2.9, ncols=2)
    for ax, metric in zip(axes, ("agree", "cosine")):
        for j, rot in enumerate((True, False)):
            pts = [r for r in rows if r["rerotate"] == rot and r[metric] is not None and finite(r[metric].mean)]
            if pts:
                line(ax, [r["seam"] for r in pts], [r[metric].mean for r in pts], colour=PALETTE[j],
                     marker=MARKERS[j], dashes=DASHES[j], dodge=2.0 * (j - 0.5), stats=[r[metric] for r in pts],
                     label="re-rotated" if rot else "not re-rotated")
        ax.set_xscale("symlog", base=2, linthresh=1)
        seams = sorted({r["seam"] for r in rows})
        ax.set_xticks(seams, [str(s) for s in seams])
        ax.minorticks_off()
        ax.set_xlabel("seam tokens recomputed (s)")
        ax.set_ylabel({"agree": "decision agreement", "cosine": "logit cosine"}[metric])
        ax.set_title(f"{'agreement' if metric == 'agree' else 'cosine'} against full recompute")
    legend_below(fig, ncols=2)
    return to_img(fig, "composition: agreement and logit cosine against seam size, re-rotated or not, with 95% CI "
                       "bands")


@styled
def _ttft_fig(rows: list[dict]) -> Markup:
    fig, ax = new_figure(4.6, 2.8)
    pts = [r for r in rows if finite(r["speedup"].mean)]
    line(ax, [r["block_tokens"] for r in pts], [r["speedup"].mean for r in pts], colour=PALETTE[0],
         stats=[r["speedup"] for r in pts])
    ax.axhline(1.0, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["block_tokens"] for r in pts], [str(r["block_tokens"]) for r in pts])
    ax.minorticks_off()
    ax.set_xlabel("skill block length (tokens)")
    ax.set_ylabel("TTFT speedup (full / composed)")
    ax.set_title("time to first token (95% CI band)")
    return to_img(fig, "TTFT speedup against block length, with its 95% CI band")


SECTION = register(Section(
    id="compose", title="Composition", needs=f"{COMPOSE} / {TTFT}", order=70, build=build_compose,
    template="sections/compose.html",
    intro="Composed caches (precompiled blocks spliced with re-rotated keys and s seam tokens recomputed) against a "
          "full recompute: decision agreement and logit cosine by seam size, with and without re-rotation; "
          "time-to-first-token speedup where a benchmark result is present."))
