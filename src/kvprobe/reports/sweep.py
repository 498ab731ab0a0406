"""The sweep report: a pure function of one ``kvprobe sweep`` folder.

:func:`render_sweep_report` reads ``sweep_manifest.json`` and ``sweep_summary.parquet`` (never a
model, never the raw rows) and writes ``report.html`` beside them. The page leads with its answer:

1. per layout, its verdict in words (:mod:`kvprobe.sweep.summary`) with the field-only patch
   recovery across its lengths, the verdict rule, and where an erratum works better (in the
   prompt before the question, or as a new turn) when both were run;
2. figures (seaborn lines against the mean downstream tokens of each cell, the precomputed 95% CIs
   as bands, one panel per field/rule style): field-only recovery against the paper's claim,
   erratum agreement, full-downstream recovery;
3. one table row per cell: every number with its 95% CI and n (:meth:`Stat.html` marks the
   inconclusive ones);
4. the run facts: model, fingerprint, config, seconds in all and per cell.

Self-contained (inline CSS, inline SVG, no script, no external resource). The same folder always
gives the same bytes: no timestamps, no absolute paths, SVGs with a fixed hash salt and no date.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from kvprobe.errors import KvprobeError
from kvprobe.reports.stats import RULE as STAT_RULE
from kvprobe.reports.sweep_figures import ERRATA, figures
from kvprobe.reports.sweep_figures import variant_label as _variant_label
from kvprobe.reports.stats import Stat, nanfloat
from kvprobe.results import SWEEP_MANIFEST, SWEEP_SUMMARY, atomic_write, json_object, read_table
from kvprobe.sweep.summary import (
    RULE,
    VERDICTS,
    cell_verdicts,
    layout_verdicts,
)

SWEEP_REPORT = "report.html"
TEMPLATE = "sweep.html"
# PAPER.md, mechanism table: field-only recovery of the five models, no chain-of-thought
MEANING = {
    "takes notes": "the decision reads notes written downstream of the field, as the paper says: the field's own "
                   "new K/V recover little of the edit",
    "reads the field": "the decision reads the field's own K/V: patching the field alone recovers most of the edit, "
                       "against the paper's claim",
    "mixed": "neither clearly: the field-only recovery lies between the thresholds or straddles one",
    "inconclusive": "too few valid cases with a large enough oracle flip (or no CI) to say",
}
KINDS = ("kind:newline", "kind:punct", "kind:section", "kind:word")


# the summary columns the page reads unconditionally (read_table refuses a summary without one)
NEEDS = ("cell", "layout", "filler_tokens", "downstream_tokens", "field_style", "rule_style", "measure", "name",
         "n_cases", "n_valid", "case_s", "agree", "agree_lo", "agree_hi", "n_agree", "recovery", "recovery_lo",
         "recovery_hi", "n_recovery")


def render_sweep_report(folder: Path | str) -> Path:
    """Write ``<folder>/report.html`` (atomically) from the sweep folder's files; returns its path.
    A folder that holds no sweep (or unreadable sweep files) is a :class:`KvprobeError`."""
    folder = Path(folder)
    html = render_sweep_html(folder)
    return atomic_write(folder / SWEEP_REPORT, lambda tmp: tmp.write_text(html, encoding="utf-8"))


def render_sweep_html(folder: Path | str) -> str:
    """The report's HTML text for one sweep folder (a pure function of its files)."""
    folder = Path(folder)
    manifest, summary = load_sweep(folder)
    return _env().get_template(TEMPLATE).render(**build(folder, manifest, summary))


def load_sweep(folder: Path) -> tuple[dict, pd.DataFrame]:
    """(manifest, summary) of a sweep folder; a one-line :class:`KvprobeError` naming what is missing."""
    if not folder.is_dir():
        raise KvprobeError(f"{folder} is not a folder; give the --out folder of a `kvprobe sweep`")
    path = folder / SWEEP_MANIFEST
    if not path.exists():
        raise KvprobeError(f"{folder} holds no {SWEEP_MANIFEST}: it is not a finished `kvprobe sweep` folder "
                           f"(run `kvprobe sweep --out {folder}` to finish it)")
    manifest = json_object(path, ("cells",), "a `kvprobe sweep` manifest")  # a newer kvprobe's is refused too
    return manifest, read_table(folder / SWEEP_SUMMARY, NEEDS)


def _env() -> Environment:
    return Environment(loader=PackageLoader("kvprobe.reports", "templates"), autoescape=select_autoescape(["html"]),
                       undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


# -- the page's content -------------------------------------------------------------------------------
def build(folder: Path, manifest: dict, summary: pd.DataFrame) -> dict:
    """The template context of one sweep."""
    cfg = manifest.get("config", {})
    summary = grid_order(summary, cfg)
    cells = cell_verdicts(summary)
    cell_verdict = {**dict(zip(cells.cell, cells.verdict)), **manifest.get("cell_verdicts", {})}
    verdicts = {**layout_verdicts(cells), **manifest.get("layout_verdicts", {})}
    layouts = list(dict.fromkeys(summary.layout))
    variants = _variants(summary)
    strategies = _present(summary, "strategy", cfg.get("strategies") or [])
    return {
        "model": cfg.get("model") or manifest.get("model", {}).get("spec", "?"), "folder": folder.name,
        "layouts": layouts, "lengths": sorted(set(summary.filler_tokens)), "variants": variants,
        "headline": [_headline(layout, verdicts.get(layout, "inconclusive"), cells[cells.layout == layout],
                               cell_verdict, summary, len(variants) > 1) for layout in layouts],
        "verdict_rule": manifest.get("verdict_rule") or RULE, "stat_rule": STAT_RULE,
        "errata": _errata(summary, layouts), "warnings": _warnings(manifest, summary),
        "figures": figures(summary, layouts, variants),
        "table": _table(manifest, summary, cell_verdict, strategies, len(variants) > 1),
        "facts": _facts(manifest), "per_cell": _per_cell(manifest, summary),
    }


def grid_order(summary: pd.DataFrame, cfg: dict) -> pd.DataFrame:
    """The summary in grid order: the config's layouts, then lengths, then styles (unknown ones last)."""
    def rank(values: list, column: pd.Series) -> pd.Series:
        index = {v: i for i, v in enumerate(values)}
        return column.map(lambda v: index.get(v, len(index)))

    keys = pd.DataFrame({"layout": rank(cfg.get("layouts") or [], summary.layout), "layout_name": summary.layout,
                         "filler": summary.filler_tokens,
                         "field": rank(cfg.get("field_styles") or [], summary.field_style),
                         "rule": rank(cfg.get("rule_styles") or [], summary.rule_style), "row": range(len(summary))},
                        index=summary.index)
    order = keys.sort_values(list(keys.columns)).index
    return summary.loc[order].reset_index(drop=True)


def _variants(summary: pd.DataFrame) -> list[tuple[str, str]]:
    """The (field_style, rule_style) pairs of the grid, in order."""
    return list(dict.fromkeys(zip(summary.field_style, summary.rule_style)))


def _present(summary: pd.DataFrame, measure: str, order: list[str]) -> list[str]:
    names = list(dict.fromkeys(summary[summary.measure == measure].name.dropna()))
    return [n for n in order if n in names] + [n for n in names if n not in order]


def _n(x) -> int:
    x = nanfloat(x)
    return int(x) if math.isfinite(x) else 0


def recovery_stat(row) -> Stat:
    return Stat(nanfloat(row.recovery), nanfloat(row.recovery_lo), nanfloat(row.recovery_hi), _n(row.n_recovery))


def agree_stat(row) -> Stat:
    return Stat(nanfloat(row.agree), nanfloat(row.agree_lo), nanfloat(row.agree_hi), _n(row.n_agree))


# The per-cell numbers `kvprobe sweep` prints and docs/sweep.md tabulates: (measure, name, statistic, title).
HEADLINE = (("patch", "field", "recovery", "field-only recovery"),
            ("patch", "downstream", "recovery", "downstream recovery"),
            ("strategy", "erratum", "agree", "erratum agreement"),
            ("strategy", "erratum_turn", "agree", "erratum_turn agreement"),
            ("strategy", "field_erratum", "agree", "field_erratum agreement"),
            ("strategy", "cacheblend:0.15", "agree", "cacheblend:0.15 agreement"))


def headline_stats(cell_rows: pd.DataFrame) -> list[Stat | None]:
    """One cell's :data:`HEADLINE` numbers (None where the cell has no such row)."""
    out = []
    for measure, name, what, _ in HEADLINE:
        hit = cell_rows[(cell_rows.measure == measure) & (cell_rows.name == name)]
        out.append(None if not len(hit) else (agree_stat if what == "agree" else recovery_stat)(hit.iloc[0]))
    return out


def _cell_label(row, styled: bool) -> str:
    label = f"{row.filler_tokens} filler tokens"
    return f"{label} ({_variant_label(row.field_style, row.rule_style)})" if styled else label


def _headline(layout: str, verdict: str, cells: pd.DataFrame, cell_verdict: dict, summary: pd.DataFrame,
              styled: bool) -> dict:
    """One layout's verdict in words, with its field-only recovery range across its lengths."""
    tokens = summary.drop_duplicates("cell").set_index("cell").downstream_tokens
    shown = cells[np.isfinite(cells.recovery.astype(float))]
    down = [tokens.get(c, float("nan")) for c in shown.cell]
    if not len(shown):
        text = "It has no field-only recovery: no valid case with an oracle flip of at least the minimum"
    elif len(shown) == 1:
        text = (f"Its field-only patch recovery is {recovery_stat(next(shown.itertuples())).text()} at "
                f"{down[0]:.0f} downstream tokens")
    else:
        means, lo, hi = (shown[c].astype(float) for c in ("recovery", "recovery_lo", "recovery_hi"))
        text = (f"Its field-only patch recovery runs from {means.min():.2f} to {means.max():.2f} across "
                f"{len(shown)} cells ({np.nanmin(down):.0f} to {np.nanmax(down):.0f} downstream tokens)")
        if np.isfinite(lo).any() and np.isfinite(hi).any():
            text += f"; their 95% CIs span {np.nanmin(lo):.2f} to {np.nanmax(hi):.2f}"
    per_cell = [{"label": _cell_label(r, styled), "stat": recovery_stat(r), "verdict": cell_verdict.get(r.cell, "?")}
                for r in cells.itertuples()]
    conclusive = [c for c in per_cell if c["verdict"] in VERDICTS and c["verdict"] != "inconclusive"]
    why = MEANING.get(verdict, "")
    if verdict == "mixed" and len({c["verdict"] for c in conclusive}) > 1:
        why = "its cells disagree: " + "; ".join(f"{c['verdict']} at {c['label']}" for c in conclusive)
    if conclusive and len(conclusive) < len(per_cell):
        why += f" ({len(per_cell) - len(conclusive)} of {len(per_cell)} cells are inconclusive and do not count)"
    phrase = f"{layout} {verdict}" if verdict in ("takes notes", "reads the field") else f"{layout} is {verdict}"
    return {"layout": layout, "verdict": verdict, "phrase": phrase, "why": why, "text": text, "cells": per_cell}


def _pooled(rows: pd.DataFrame) -> Stat:
    """Agreement pooled over cells (each cell's proportion weighted by its n), with a Wilson 95% CI."""
    n = rows.n_agree.fillna(0).astype(int)
    total = int(n.sum())
    hits = float((rows.agree.fillna(0) * n).sum())
    return Stat.wilson(hits / total if total else float("nan"), total)


def _errata(summary: pd.DataFrame, layouts: list[str]) -> dict | None:
    """Erratum placement: agreement with the erratum before the question and as a new turn (both run)."""
    rows = summary[(summary.measure == "strategy") & summary.name.isin(ERRATA)]
    if set(rows.name) != set(ERRATA):
        return None
    pooled = {name: _pooled(rows[rows.name == name]) for name in ERRATA}
    a, b = pooled["erratum"], pooled["erratum_turn"]
    if a.n == 0 or b.n == 0 or not (math.isfinite(a.lo) and math.isfinite(b.lo)):
        compare = "at least one placement has no agreement to compare"
    elif a.lo > b.hi:
        compare = "the erratum before the question agrees more often (the 95% CIs do not overlap)"
    elif b.lo > a.hi:
        compare = "the erratum as a new turn agrees more often (the 95% CIs do not overlap)"
    else:
        compare = "their 95% CIs overlap: no difference between the placements at this n"
    per_layout = [{"layout": layout, **{name: _pooled(rows[(rows.layout == layout) & (rows.name == name)])
                                        for name in ERRATA}} for layout in layouts]
    return {"pooled": pooled, "where": ERRATA, "compare": compare, "per_layout": per_layout}


def _warnings(manifest: dict, summary: pd.DataFrame) -> list[str]:
    out = []
    wanted = manifest.get("config", {}).get("valid")
    for cell, info in manifest.get("cells", {}).items():
        if not info.get("valid_decision"):
            out.append(f"Cell {cell} has no valid decision case (of {info.get('screened', 0)} screened): "
                       f"its numbers are missing.")
        elif wanted and not info.get("reached_valid", True):
            out.append(f"Cell {cell} reached only {info['valid_decision']} of the {wanted} valid cases asked for "
                       f"(all {info.get('screened', 0)} cases screened).")
    errors = summary[summary.n_errors.fillna(0) > 0] if "n_errors" in summary else summary.iloc[:0]
    for r in errors.itertuples():
        out.append(f"{r.name} failed on {_n(r.n_errors)} case(s) of cell {r.cell}; they are left out of its numbers.")
    return out


def _table(manifest: dict, summary: pd.DataFrame, cell_verdict: dict, strategies: list[str], styled: bool) -> dict:
    """One row per cell: counts, patch recoveries (field, downstream, by token kind), strategy agreement."""
    kinds = [k for k in KINDS if k in set(summary[summary.measure == "patch"].name)]
    rows = []
    for cell, group in summary.groupby("cell", sort=False):
        first = group.iloc[0]
        info = manifest.get("cells", {}).get(cell, {})
        by = {(r.measure, r.name): r for r in group.itertuples()}
        rec = {name: recovery_stat(by[("patch", name)]) for measure, name in by if measure == "patch"}
        rows.append({"cell": cell, "layout": first.layout, "filler": int(first.filler_tokens),
                     "field_style": first.field_style, "rule_style": first.rule_style,
                     "downstream": f"{nanfloat(first.downstream_tokens):.0f}",
                     "valid": f"{info.get('valid_decision', _n(first.n_valid))}/"
                              f"{info.get('screened', _n(first.n_cases))}",
                     "field": rec.get("field"), "down": rec.get("downstream"), "kinds": [rec.get(k) for k in kinds],
                     "agree": [agree_stat(by[("strategy", s)]) if ("strategy", s) in by else None for s in strategies],
                     "verdict": cell_verdict.get(cell, "?"), "seconds": f"{nanfloat(info.get('wall_s')):.1f}"})
    return {"rows": rows, "kinds": [k.removeprefix("kind:") for k in kinds], "strategies": strategies,
            "styled": styled}


def _facts(manifest: dict) -> list[tuple[str, str]]:
    cfg, fp, wall = manifest.get("config", {}), manifest.get("model", {}), manifest.get("wall_s", {})

    def show(v) -> str:
        return ", ".join(map(str, v)) if isinstance(v, list) else str(v)

    facts = [("model", str(cfg.get("model") or fp.get("spec"))),
             ("fingerprint", ", ".join(f"{k}={v}" for k, v in sorted(fp.items()))),
             ("model info", ", ".join(f"{k}={v}" for k, v in sorted(manifest.get("model_info", {}).items())
                                      if v is not None))]
    facts += [(f"config: {k}", show(v)) for k, v in sorted(cfg.items())]
    if manifest.get("versions"):
        facts.append(("versions", ", ".join(f"{k} {v}" for k, v in sorted(manifest["versions"].items()))))
    facts.append(("seconds", (f"{nanfloat(wall.get('cells')):.1f} s measuring the cells (summed over their cases); "
                              f"{nanfloat(wall.get('this_invocation')):.1f} s in the last invocation")))
    resumed = sum(int(c.get("resumed", 0)) for c in manifest.get("cells", {}).values())
    if resumed:
        facts.append(("cases kept from an interrupted invocation", str(resumed)))
    return facts


def _per_cell(manifest: dict, summary: pd.DataFrame) -> list[dict]:
    case_s = summary.drop_duplicates("cell").set_index("cell").case_s
    order = list(dict.fromkeys(summary.cell))
    cells = manifest.get("cells", {})
    out = []
    for cell in order + sorted(set(cells) - set(order)):
        info = cells.get(cell, {})
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(info.get("skip_reasons", {}).items()))
        out.append({"cell": cell, "screened": info.get("screened", ""), "aligned": info.get("aligned", ""),
                    "skipped": f"{info.get('skipped', 0)}" + (f" ({reasons})" if reasons else ""),
                    "valid": info.get("valid_decision", ""), "seconds": f"{nanfloat(info.get('wall_s')):.1f}",
                    "case_s": f"{nanfloat(case_s.get(cell)):.2f}"})
    return out


# -- figures ----------------------------------------------------------------------------------------
