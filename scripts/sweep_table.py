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

from kvprobe.reports.sweep import HEADLINE, grid_order, headline_stats
from kvprobe.results import SWEEP_MANIFEST, SWEEP_SUMMARY


def cell_text(stat) -> str:
    return stat.text().replace(" n=", " (n=") + ")" if stat and stat.n else ("n/a" if stat else "-")


def table(folder: Path) -> str:
    manifest = json.loads((folder / SWEEP_MANIFEST).read_text())
    cfg = manifest["config"]
    summary = grid_order(pd.read_parquet(folder / SWEEP_SUMMARY), cfg)
    lines = [(f"**{cfg['model']}**: {len(manifest['cells'])} cells, {manifest['wall_s']['cells']:.0f} s of "
              f"measurement ({manifest['wall_s']['cells'] / 60:.0f} min)"), "",
             "| layout | filler | downstream tokens | valid / screened | " + " | ".join(c[3] for c in HEADLINE)
             + " | verdict | s |", "|" + "---|" * (len(HEADLINE) + 6)]
    for cell in dict.fromkeys(summary.cell):
        rows, info = summary[summary.cell == cell], manifest["cells"][cell]
        styles = "" if (info["field_style"], info["rule_style"]) == ("key", "allow") else \
            f" ({info['field_style']}, {info['rule_style']})"
        texts = [cell_text(stat) for stat in headline_stats(rows)]
        lines.append(f"| {info['layout']}{styles} | {info['filler_tokens']} | {rows.downstream_tokens.iloc[0]:.0f} | "
                     f"{info['valid_decision']} / {info['screened']} | " + " | ".join(texts)
                     + f" | {manifest['cell_verdicts'].get(cell, '-')} | {info['wall_s']:.0f} |")
    lines += ["", "Verdict per layout: " + "; ".join(f"{k}: {v}" for k, v in manifest["layout_verdicts"].items())
              + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: sweep_table.py SWEEP_FOLDER [SWEEP_FOLDER ...]")
    print("\n".join(table(Path(f)) for f in sys.argv[1:]))
