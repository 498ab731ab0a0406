"""One table across results folders (``kvprobe compare``): each folder's headline facts
(:mod:`kvprobe.reports.summary`) in a row, then the main strategy table with one column per folder;
as rows for a terminal, a CSV (one row per folder and strategy), JSON (the summaries) and a
self-contained HTML page (no script, no external resource; the same folders give the same bytes).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import seaborn as sns
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from kvprobe.errors import KvprobeError, UsageError
from kvprobe.reports.figures import PALETTE, new_figure, styled, to_img
from kvprobe.reports.folder import load_runs
from kvprobe.reports.stats import RULE
from kvprobe.reports.numbers import stat_text
from kvprobe.reports.summary import REPAIR_RULE, SCHEMA_VERSION, WHERE_RULE, repair_answer, summarize_run
from kvprobe.results import RUN_MANIFEST, SWEEP_MANIFEST, atomic_write

COMPARE_VERSION = 1
STAT_KEYS = ("value", "lo", "hi", "n")


def summaries(folders, threshold: float | None = None) -> list[dict]:
    """The summary of each ``kvprobe run`` folder (labels made unique); a sweep folder or a folder
    without a run is a one-line error."""
    folders = [Path(f) for f in folders]
    if not folders:
        raise UsageError("give at least one results folder")
    for f in folders:
        if (f / SWEEP_MANIFEST).exists():
            raise UsageError(f"{f} is a `kvprobe sweep` folder; compare takes `kvprobe run` folders (a sweep has its "
                             f"own page: `kvprobe report {f}`)")
        if f.is_dir() and not (f / RUN_MANIFEST).exists():
            raise KvprobeError(f"{f} has no {RUN_MANIFEST}: compare takes folders `kvprobe run` finished; rerun it "
                               f"there")
    return [summarize_run(run, threshold) for run in load_runs(folders)]


# -- flat rows ---------------------------------------------------------------------------------------
def _flat(prefix: str, d: dict | None) -> dict:
    d = d or {}
    return {f"{prefix}_{k}" if k != "value" else prefix: d.get(k) for k in STAT_KEYS}


def headline_row(s: dict) -> dict:
    """One folder's headline facts as flat columns (numbers, not text)."""
    w, r, k, c, v = (s.get(key) or {} for key in ("where", "repair", "k_star", "composition", "validity"))
    return {"model": s["model"], "folder": s["folder"], "threshold": s["threshold"],
            "where": w.get("where"), **_flat("field_recovery", w.get("field_recovery")),
            **_flat("downstream_recovery", w.get("downstream_recovery")),
            "repair": r.get("recommended"), "repair_closest": r.get("closest"),
            **_flat("repair_agreement", r.get("agreement")), "repair_frac_recomputed": r.get("frac_recomputed"),
            "repair_to_decision_s": r.get("to_decision_s"), "k_star_status": k.get("status"),
            "k_star": k.get("k_star"), "k_candidate": k.get("k") if k.get("k_star") is None else None,
            **_flat("k_agreement", k.get("agreement")),
            "gate_passed": c.get("passed"), "gate_seam": c.get("seam"), **_flat("gate_agreement", c.get("agreement")),
            "valid_decision": v.get("valid_decision"), "decision": v.get("decision")}


def strategy_row(r: dict) -> dict:
    return {"strategy": r["strategy"], **_flat("agreement", r.get("agreement")),
            **_flat("recovery", r.get("recovery")), **_flat("control_invariance", r.get("control_invariance")),
            "frac_recomputed": r.get("frac_recomputed"), "to_decision_s": r.get("to_decision_s"),
            "notes": "; ".join(f"{n['note']} ({n['cases']} cases)" for n in r.get("notes") or [])}


def long_rows(sums: list[dict]) -> list[dict]:
    """One row per folder and strategy: the folder's headline columns, then the strategy's."""
    out = []
    for s in sums:
        head = headline_row(s)
        out += [head | strategy_row(r) for r in s["strategies"]] or [head]
    return out


def to_csv(sums: list[dict]) -> str:
    rows = long_rows(sums)
    columns = list(dict.fromkeys(c for r in rows for c in r))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def to_json(sums: list[dict]) -> dict:
    return {"kvprobe_compare": COMPARE_VERSION, "summary_schema": SCHEMA_VERSION, "runs": sums}


# -- text -----------------------------------------------------------------------------------------------
def _k_text(k: dict | None) -> str:
    if not k:
        return "n/a"
    if k["status"] == "established":
        return f"{k['k_star']} ({stat_text(k['agreement'])})"
    if k.get("k") is not None and k.get("agreement"):
        return f"{k['status']} (K={k['k']}: {stat_text(k['agreement'])})"
    return k["status"]


def headline_cells(s: dict) -> dict[str, str]:
    """One folder's headline facts as short texts (terminal and HTML)."""
    w, r, c, v = s.get("where"), s.get("repair"), s.get("composition"), s.get("validity")
    repair = "n/a"
    if r:
        name = repair_answer(r)
        frac = f", {100 * r['frac_recomputed']:.1f}% recomputed" if r["frac_recomputed"] is not None else ""
        # the numbers are the recommended repair's, or the closest's where nothing is established at all
        single = r["recommended"] or name.startswith("none established")
        repair = f"{name}: {stat_text(r['agreement'])}{frac}" if single else name
    return {"model": s["model"],
            "where the decision lives": f"{w['where']} (field {stat_text(w['field_recovery'])})" if w else "n/a",
            f"repair (lower bound >= {s['threshold']:g})": repair, "K*": _k_text(s.get("k_star")),
            "composition gate": (f"{'pass' if c['passed'] else 'fail'} at s={c['seam']}: {stat_text(c['agreement'])}"
                                 if c else "not run"),
            "valid cases": f"{v['valid_decision']} of {v['decision']}" if v else "n/a"}


def strategy_matrix(sums: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(strategies in first-seen order, per strategy one cell per folder: agreement, recomputed share)."""
    names = list(dict.fromkeys(r["strategy"] for s in sums for r in s["strategies"]))
    cells = []
    for name in names:
        row = []
        for s in sums:
            r = next((r for r in s["strategies"] if r["strategy"] == name), None)
            if r is None or not r.get("agreement"):
                row.append("")
                continue
            frac = f" ({100 * r['frac_recomputed']:.1f}%)" if r.get("frac_recomputed") is not None else ""
            row.append(stat_text(r["agreement"]) + frac)
        cells.append(row)
    return names, cells


# -- HTML ----------------------------------------------------------------------------------------------
@styled
def agreement_figure(sums: list[dict]):
    """Agreement with its Wilson CI per strategy (rows), one colour and marker per folder, dodged; the
    legend outside the data."""
    names = list(dict.fromkeys(r["strategy"] for s in sums for r in s["strategies"]))
    if not names:
        return None
    fig, ax = new_figure(6.4, 0.7 + 0.32 * len(names) * max(1.0, len(sums) ** 0.5))
    step = 0.7 / max(1, len(sums))
    markers = "osD^v<>P"
    for j, s in enumerate(sums):
        xs, ys, lo, hi = [], [], [], []
        for i, name in enumerate(names):
            r = next((r for r in s["strategies"] if r["strategy"] == name), None)
            a = (r or {}).get("agreement") or {}
            if a.get("value") is None:
                continue
            y = i + (j - (len(sums) - 1) / 2) * step
            xs.append(a["value"])
            ys.append(y)
            lo.append(a["value"] - (a["lo"] if a["lo"] is not None else a["value"]))
            hi.append((a["hi"] if a["hi"] is not None else a["value"]) - a["value"])
        colour = PALETTE[j % len(PALETTE)]
        ax.errorbar(xs, ys, xerr=[lo, hi], fmt="none", ecolor=colour, elinewidth=0.9, capsize=2)
        sns.scatterplot(x=xs, y=ys, color=colour, marker=markers[j % len(markers)], s=22, ax=ax, label=s["model"],
                        zorder=3)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(-0.03, 1.03)
    ax.axvline(sums[0]["threshold"], color="grey", ls="--", lw=0.7)
    ax.set_xlabel("agreement with the oracle (Wilson 95% CI); dashed: the threshold")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return to_img(fig, "agreement with the oracle per strategy and folder, with Wilson 95% intervals")


def render_compare_html(sums: list[dict]) -> str:
    env = Environment(loader=PackageLoader("kvprobe.reports", "templates"), autoescape=select_autoescape(["html"]),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    heads = [headline_cells(s) for s in sums]
    names, cells = strategy_matrix(sums)
    return env.get_template("compare.html").render(
        sums=sums, heads=heads, head_columns=list(heads[0]), names=names, cells=cells,
        figure=agreement_figure(sums), rule=RULE, where_rule=WHERE_RULE, repair_rule=REPAIR_RULE)


def write_text(path: Path, text: str) -> Path:
    try:
        return atomic_write(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot write {path} ({exc.strerror or exc}); give a path you can write") from None
