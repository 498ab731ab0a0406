"""Markdown tables of `kvprobe sweep` folders, as docs/sweep.md shows them.

    .venv/bin/python scripts/sweep_table.py results/sweep/qwen2.5-1.5b [more folders]

Per cell: downstream tokens (mean over the valid cases), valid / screened cases, field-only and
full-downstream patch recovery, and agreement with the oracle of erratum (before the question),
erratum_turn (a new turn after the old prompt), field_erratum and cacheblend:0.15, each with its
95% CI (bootstrap for recovery, Wilson for agreement); then the cell's verdict and seconds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from kvprobe.reports.stats import Stat
from kvprobe.results import SWEEP_MANIFEST, SWEEP_SUMMARY

COLUMNS = [("patch", "field", "recovery", "field-only recovery"),
           ("patch", "downstream", "recovery", "downstream recovery"),
           ("strategy", "erratum", "agree", "erratum agreement"),
           ("strategy", "erratum_turn", "agree", "erratum_turn agreement"),
           ("strategy", "field_erratum", "agree", "field_erratum agreement"),
           ("strategy", "cacheblend:0.15", "agree", "cacheblend:0.15 agreement")]


def stat(row, what: str) -> str:
    if what == "agree":
        s = Stat(row.agree, row.agree_lo, row.agree_hi, int(row.n_agree or 0))
    else:
        s = Stat(row.recovery, row.recovery_lo, row.recovery_hi, int(row.n_recovery or 0))
    return s.text().replace(" n=", " (n=") + ")" if s.n else "n/a"


def table(folder: Path) -> str:
    manifest = json.loads((folder / SWEEP_MANIFEST).read_text())
    summary = pd.read_parquet(folder / SWEEP_SUMMARY)
    cfg = manifest["config"]
    lines = [f"**{cfg['model']}**: {len(manifest['cells'])} cells, {manifest['wall_s']['cells']:.0f} s of measurement "
             f"({manifest['wall_s']['cells'] / 60:.0f} min)", "",
             "| layout | filler | downstream tokens | valid / screened | " + " | ".join(c[3] for c in COLUMNS)
             + " | verdict | s |", "|" + "---|" * (len(COLUMNS) + 6)]
    order = {name: i for i, name in enumerate(cfg["layouts"])}
    cells = sorted(manifest["cells"].items(), key=lambda kv: (order.get(kv[1]["layout"], 99), kv[1]["filler_tokens"],
                                                              kv[1]["field_style"], kv[1]["rule_style"]))
    for cell, info in cells:
        rows = summary[summary.cell == cell]
        styles = "" if (info["field_style"], info["rule_style"]) == ("key", "allow") else \
            f" ({info['field_style']}, {info['rule_style']})"
        texts = []
        for measure, name, what, _ in COLUMNS:
            hit = rows[(rows.measure == measure) & (rows.name == name)]
            texts.append(stat(hit.iloc[0], what) if len(hit) else "-")
        down = rows.downstream_tokens.iloc[0] if len(rows) else float("nan")
        lines.append(f"| {info['layout']}{styles} | {info['filler_tokens']} | {down:.0f} | "
                     f"{info['valid_decision']} / {info['screened']} | " + " | ".join(texts)
                     + f" | {manifest['cell_verdicts'].get(cell, '-')} | {info['wall_s']:.0f} |")
    lines += ["", "Verdict per layout: " + "; ".join(f"{k}: {v}" for k, v in manifest["layout_verdicts"].items())
              + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: sweep_table.py SWEEP_FOLDER [SWEEP_FOLDER ...]")
    print("\n".join(table(Path(f)) for f in sys.argv[1:]))
