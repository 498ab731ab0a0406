"""Linear probes: held-out accuracy by layer at the field, the notes and the decision token, with
the write and commit depths."""

from __future__ import annotations

import numpy as np
import pandas as pd
from markupsafe import Markup
from matplotlib.ticker import MaxNLocator

from kvprobe.reports.figures import (DASHES, MARKERS, PALETTE, finite, legend_below, line, new_figure, styled,
                                     to_img)
from kvprobe.reports.folder import Run
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat, nanfloat
from kvprobe.results import LINEAR


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


@styled
def _linear_fig(acc, shuf, lens, write, commit, n_layers) -> Markup:
    sites = [s for s in ("field", "notes", "decision") if (acc["region"] == s).any()]
    fig, axes = new_figure(2.6 * max(1, len(sites)), 2.9, ncols=max(1, len(sites)), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, site in zip(axes, sites):
        g = acc[(acc["region"] == site) & (acc["label"] == "value")]
        streams = list(g.groupby("stream", sort=True))
        for j, (stream, gs) in enumerate(streams):
            gs = gs.sort_values("layer")
            y = gs["value"].astype(float).tolist()
            line(ax, gs["layer"].astype(float).tolist(), y, colour=PALETTE[j], marker=MARKERS[j], dashes=DASHES[j],
                 label=f"{stream} (Wilson 95% band)", ms=3.5, dodge=1.5 * (j - (len(streams) - 1) / 2),
                 stats=[Stat.wilson(v, int(n)) for v, n in zip(y, gs["n"])])
        sh = shuf[(shuf["region"] == site) & (shuf["label"] == "value")]
        if len(sh):
            m = sh.groupby("layer")["value"].mean()
            ax.plot(m.index.astype(float), m.values, color="grey", ls="--", lw=0.7, label="shuffled labels")
        if site == "decision" and len(lens):
            line(ax, lens["layer"].astype(float), lens["value"].astype(float), colour=PALETTE[3], marker="s",
                 dashes=DASHES[3], lw=0.8, ms=3, label="logit lens agrees")
        if site in write:
            ax.axvline(write[site], color=PALETTE[4], lw=1.2, label=f"write depth (L{write[site]})")
        if commit is not None:
            ax.axvline(commit, color="black", ls=":", lw=1.2, label=f"commit depth (L{commit})")
        ax.set_title(f"at the {site}" if site != "decision" else "at the decision token")
        ax.set_xlabel(f"layer (of {n_layers})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(-0.05, 1.05)
    axes[0].set_ylabel("held-out accuracy (label: value)")
    legend_below(fig, axes, ncols=4)
    return to_img(fig, "linear-probe held-out accuracy by layer with Wilson 95% bands, at the field, the notes and "
                       "the decision token, with the write and commit depths")


SECTION = register(Section(
    id="linear", title="Linear probes", needs=LINEAR, order=40, build=build_linear, template="sections/linear.html",
    intro="Held-out accuracy (grouped by template) of a logistic probe for the value's side, by layer, at the field "
          "and at the notes; the write depth (first layer reaching the threshold, residual stream) and the commit "
          "depth (from which the logit lens agrees with the decision) are marked."))
