"""The compact toy table of docs/sweep.md: per layout, field-only recovery at filler 0 and the valid
cases at fillers 0 / 100 / 300, then erratum agreement pooled over each toy grid's valid cases.

    .venv/bin/python scripts/sweep_toy_table.py    # reads results/sweep/toy-<family> for the six toys
"""

from __future__ import annotations

import json

import pandas as pd

from kvprobe.intervals import wilson_share
from kvprobe.results import SWEEP_MANIFEST, SWEEP_SUMMARY

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "mistral")
LAYOUTS = ("record", "lines", "json", "chat_history")
LENGTHS = (0, 100, 300)


def row(family: str) -> str:
    folder = f"results/sweep/toy-{family}"
    summary = pd.read_parquet(f"{folder}/{SWEEP_SUMMARY}")
    with open(f"{folder}/{SWEEP_MANIFEST}") as f:
        manifest = json.load(f)
    cells = []
    for layout in LAYOUTS:
        field = summary[(summary.layout == layout) & (summary.filler_tokens == 0) & (summary.measure == "patch")
                        & (summary.name == "field")].iloc[0]
        valid = [manifest["cells"][f"{layout}.f{t}.key.allow"]["valid_decision"] for t in LENGTHS]
        cells.append(f"{field.recovery:.2f} [{field.recovery_lo:.2f}, {field.recovery_hi:.2f}] "
                     f"({valid[0]} / {valid[1]} / {valid[2]})")
    for name in ("erratum", "erratum_turn"):
        rows = summary[(summary.measure == "strategy") & (summary.name == name)]
        n = int(rows.n_agree.sum())
        p = float((rows.agree * rows.n_agree).sum()) / n
        lo, hi = wilson_share(p, n)
        cells.append(f"{p:.2f} [{lo:.2f}, {hi:.2f}] (n={n})")
    cells.append(", ".join(f"{layout}: {manifest['layout_verdicts'][layout]}" for layout in LAYOUTS))
    return f"| toy-{family} | " + " | ".join(cells) + " |"


if __name__ == "__main__":
    print("| toy | " + " | ".join(f"{layout}: field-only at 0 (valid at 0 / 100 / 300)" for layout in LAYOUTS)
          + " | erratum | erratum_turn | verdicts |")
    print("|---" * (len(LAYOUTS) + 4) + "|")
    for family in FAMILIES:
        print(row(family))
