"""Top-K: agreement of field + top-K recompute with the oracle by K, K* marked, and the exported
``topk.yaml`` verbatim."""

from __future__ import annotations

import numpy as np

from kvprobe.reports.figures import PALETTE, errbar, finite, new_figure, to_img
from kvprobe.reports.folder import Run
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat, nanfloat


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


SECTION = register(Section(
    id="topk", title="Top-K", needs="topk.yaml", order=60, build=build_topk, template="sections/topk.html",
    intro="Agreement of field + top-K recompute with the oracle on held-out cases, by K, with K* marked; then the "
          "exported configuration verbatim."))
