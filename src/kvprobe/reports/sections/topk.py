"""Top-K: agreement of field + top-K recompute with the oracle by K (from K = 0, the field alone), with
Wilson 95% bands, the threshold and K* where it is established; the exported ``topk.yaml`` folded."""

from __future__ import annotations

import seaborn as sns

from kvprobe.reports.figures import PALETTE, finite, new_figure, styled, to_img
from kvprobe.reports.folder import Run
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat, nanfloat

LEGACY = "established on its point estimate (a schema-2 file: export it again for the interval rule)"


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
    status = cfg.get("k_star_status") or (LEGACY if k_star is not None else "not reached")
    k_shown = k_star if k_star is not None else cfg.get("k_candidate")
    ci = cfg.get("agreement_ci95") or [float("nan"), float("nan")]
    star = (Stat(nanfloat(cfg.get("agreement")), nanfloat(ci[0]), nanfloat(ci[1]), int(cfg.get("n_cases") or 0))
            if k_shown is not None and cfg.get("agreement") is not None else None)
    threshold = nanfloat(cfg.get("threshold"))
    fig = _sweep_fig(rows, threshold, k_shown, k_star is not None) if rows else None
    return {"rows": rows, "fig": fig, "k_star": k_star, "k_shown": k_shown, "status": status, "star": star,
            "reason": cfg.get("reason"), "threshold": threshold, "yaml": run.topk_text}


@styled
def _sweep_fig(rows: list[dict], threshold: float, k_shown, established: bool):
    """Agreement by K on an evenly spaced K axis (0 = the field alone), a Wilson band, the threshold."""
    pts = [r for r in rows if finite(r["agreement"].mean)]
    x = list(range(len(pts)))
    labels = ["0\n(field)" if r["k"] == 0 else str(r["k"]) for r in pts]
    fig, ax = new_figure(4.8, 2.9)
    lo = [r["agreement"].lo if finite(r["agreement"].lo) else r["agreement"].mean for r in pts]
    hi = [r["agreement"].hi if finite(r["agreement"].hi) else r["agreement"].mean for r in pts]
    ax.fill_between(x, lo, hi, color=PALETTE[0], alpha=0.18, lw=0, label="Wilson 95% CI")
    sns.lineplot(x=x, y=[r["agreement"].mean for r in pts], marker="o", markersize=4, color=PALETTE[0], ax=ax,
                 label="selective:K:causal (held-out)")
    if finite(threshold):
        ax.axhline(threshold, color="grey", ls="--", lw=0.7, label=f"threshold {threshold:g}")
    if k_shown is not None and int(k_shown) in [r["k"] for r in pts]:
        i = [r["k"] for r in pts].index(int(k_shown))
        ax.axvline(i, color=PALETTE[3], lw=1.2, ls="-" if established else ":",
                   label=f"K* = {k_shown}" if established else f"K = {k_shown}: not established")
    ax.set_xticks(x, labels)
    ax.set_xlabel("K (downstream positions recomputed besides the field)")
    ax.set_ylabel("agreement with the oracle")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # outside the data
    return to_img(fig, "held-out agreement by K with its Wilson 95% band, the threshold and K*")


SECTION = register(Section(
    id="topk", title="Top-K", needs="topk.yaml", order=60, build=build_topk, template="sections/topk.html",
    intro="Agreement of field + top-K recompute with the oracle on held-out cases, by K from 0 (the field alone), with "
          "Wilson 95% bands. K* is established only where the interval's lower bound reaches the threshold. The "
          "exported configuration is folded below."))
