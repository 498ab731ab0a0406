"""Compare two `kvprobe calibrate` folders pair by pair: the verdict and repair of every field, and on
every pair both measured, each strategy's decision (the oracle's, the stale read's, each candidate's).

    python scripts/compare_calibrations.py BEFORE_FOLDER AFTER_FOLDER

Pairs are matched by field and values (the draws follow the seed, so two calibrations of one spec
and seed draw the same pairs in the same order; a pair drawn twice is told apart by its order).
Every pair whose decision differs is listed with the oracle's margin (first option minus second) in
both. Exits 1 when a field's verdict or repair differs, or any decision does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import yaml

KEY = ["field", "old_value", "new_value", "others"]


def load(folder: Path) -> tuple[pd.DataFrame, dict]:
    rows = pd.read_parquet(folder / "calibration.parquet")
    rows = rows[rows.skip.isna()].copy()
    # a strategy's n-th row with a pair's values is from that pair's n-th draw
    rows["draw"] = rows.groupby([*KEY, "strategy"]).cumcount()
    policy = yaml.safe_load((folder / "field_policy.yaml").read_text())
    return rows, policy


def main(before: Path, after: Path) -> int:
    (b, pb), (a, pa) = load(before), load(after)
    bad = 0
    for name in pa["fields"]:
        fb, fa = pb["fields"].get(name, {}), pa["fields"][name]
        same = (fb.get("verdict"), fb.get("repair")) == (fa["verdict"], fa["repair"])
        bad += not same
        print(f"{name}: before {fb.get('repair')} ({fb.get('verdict')}, {fb.get('pairs')} pairs), after "
              f"{fa['repair']} ({fa['verdict']}, {fa['pairs']} pairs){'' if same else '  DIFFERS'}")
    both = b.merge(a, on=[*KEY, "draw", "strategy"], suffixes=("_before", "_after"))
    for (name, strategy), g in both.groupby(["field", "strategy"], sort=False):
        differ = g[g.pred_before != g.pred_after]
        print(f"  {name} {strategy}: {len(g)} pairs both measured, {len(differ)} decisions differ")
        for r in differ.itertuples():
            print(f"    {r.old_value} -> {r.new_value} ({r.others}): {r.pred_before} vs {r.pred_after}, margin "
                  f"{r.margin_before:+.4f} vs {r.margin_after:+.4f}")
        bad += len(differ)
    oracle = both[both.strategy == "oracle"]
    print(f"oracle margins: largest difference {float((oracle.margin_before - oracle.margin_after).abs().max()):.2e} "
          f"over {len(oracle)} pairs")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
