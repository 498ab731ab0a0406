"""The evidence auto's runtime check was designed from (docs/auto.md, "Design"): session 8's sweep
folders, none of whose cases the evaluation reuses.

    python scripts/auto_design.py results/sweep/qwen2.5-1.5b results/sweep/toy-qwen2 ...

Per folder, over valid decision cases: how often recomputing the field alone moves the decision
off the stale one, how often it then agrees with the oracle, and how each erratum-style repair
does on the cases where it does not move.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

FALLBACKS = ("erratum_turn", "erratum", "field_erratum", "field_erratum_turn", "cacheblend:0.15")


def main(folders: list[str]) -> None:
    print("| model | valid decision cases | field-only moved the decision | agreement when moved | "
          + " | ".join(f"{f} when not moved" for f in FALLBACKS) + " |")
    print("|---" * (4 + len(FALLBACKS)) + "|")
    for folder in map(Path, folders):
        d = pd.read_parquet(folder / "sweep.parquet")
        v = d[d.valid & ~d.control]
        field = v[(v.measure == "patch") & (v.name == "field")].set_index(["cell", "case_id"])
        moved = np.sign(field.m) != np.sign(field.m_stale)  # m = score(new answer) - score(old answer)
        strat = v[v.measure == "strategy"].set_index(["cell", "case_id"])
        cells = []
        for name in FALLBACKS:
            s = strat[strat.name == name].agree
            s = s[s.index.isin(field.index[~moved])]
            cells.append(f"{s.mean():.3f} ({len(s)})" if len(s) else "-")
        print(f"| {folder.name} | {len(field)} | {int(moved.sum())} ({moved.mean():.2f}) | "
              f"{field.agree[moved].mean():.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
