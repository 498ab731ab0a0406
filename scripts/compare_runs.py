"""Compare the tables of two results folders: every parquet file, row for row, timing columns aside.

    python scripts/compare_runs.py BEFORE_DIR AFTER_DIR [--ignore wall_s,decide_s,...] [--atol 1e-4]

Prints one line per table (identical, equal within the tolerance with its largest difference, or
what differs) and exits 1 if any table differs. Used to show that a behaviour-preserving change
keeps ``kvprobe run``'s tables bit for bit (``--atol 0``, the default) or to a tolerance (a change
of computation order, e.g. batching, moves float32 results by rounding only; a ratio over an
oracle flip below 1 logit is compared on its numerator's scale, see RATIOS).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

TIMING = ("wall_s", "decide_s", "setup_s", "seconds", "elapsed_s", "train_wall_s")


# Ratios over a case's oracle flip (m_oracle - m_stale): where the flip is below MIN_FLIP logits
# (the guard every analysis applies), their difference is compared on the numerator's scale, i.e.
# times the flip: a random-weight model's 1e-3 flip turns 1e-7 of rounding into 1e-4 of ratio.
RATIOS = ("recovery", "region_share", "topk_share", "kind_share")
MIN_FLIP = 1.0


def max_abs_diff(x: pd.DataFrame, y: pd.DataFrame) -> float:
    """The largest absolute difference between the numeric columns of two frames of one shape
    (NaN where both are NaN counts as equal; ratios of small flips scaled, see :data:`RATIOS`); inf
    where a NaN stands against a number."""
    scale = np.ones(len(x))
    if {"metric", "value", "oracle_flip"} <= set(x.columns):
        flip = x["oracle_flip"].astype(float).abs().to_numpy()
        small = x["metric"].isin(RATIOS).to_numpy() & (flip < MIN_FLIP)
        scale[small] = flip[small]
    if {"metric", "value", "n_tokens", "case_id"} <= set(x.columns) and (x["metric"] == "kind_mean_abs").any():
        scale = np.minimum(scale, _share_denominators(x))
    worst = 0.0
    for col in x.columns:
        a, b = x[col], y[col]
        if pd.api.types.is_bool_dtype(a) or not pd.api.types.is_numeric_dtype(a):
            continue
        a, b = a.astype(float).to_numpy(), b.astype(float).to_numpy()
        both = np.isnan(a) & np.isnan(b)
        if (np.isnan(a) ^ np.isnan(b)).any():
            return float("inf")
        if (~both).any():
            d = np.abs(a - b) * (scale if col == "value" else 1.0)
            worst = max(worst, float(d[~both].max()))
    return worst


def _share_denominators(conc: pd.DataFrame) -> np.ndarray:
    """Per row of a concentration table, what its share divides by, in logits (1 for other rows):
    the case's total |effect| (rebuilt as the sum of kind_mean_abs x n_tokens) for region and kind
    shares, its downstream part for top-k shares. Shares of a case whose effects sum to 0.08
    logits move by 1e-3 when each effect moves by 4e-6: compared times the denominator, a share
    difference is a difference of summed effects, in logits, like every other value."""
    out = np.ones(len(conc))
    for _, g in conc.groupby("case_id", sort=False):
        kinds = g[g["metric"] == "kind_mean_abs"]
        total = float((kinds["value"].fillna(0) * kinds["n_tokens"]).sum())
        down = g[(g["metric"] == "region_share") & (g.get("region") == "downstream")]["value"]
        down_total = total * float(down.iloc[0]) if len(down) else total
        rows = conc.index.get_indexer(g.index)
        metric = g["metric"].to_numpy()
        out[rows[np.isin(metric, ("region_share", "kind_share"))]] = total
        out[rows[metric == "topk_share"]] = down_total
    return np.minimum(out, 1.0)


def compare(before: Path, after: Path, ignore: set[str], atol: float = 0.0) -> list[str]:
    """One line per table; a line starting with 'DIFF' marks a difference (beyond ``atol`` in a
    numeric column; any difference elsewhere)."""
    lines = []
    names = sorted({p.name for p in before.glob("*.parquet")} | {p.name for p in after.glob("*.parquet")})
    for name in names:
        a, b = before / name, after / name
        if not a.exists() or not b.exists():
            lines.append(f"DIFF {name}: only in {'after' if b.exists() else 'before'}")
            continue
        x, y = pd.read_parquet(a), pd.read_parquet(b)
        drop = sorted(c for c in set(x.columns) | set(y.columns) if c in ignore)
        x, y = x.drop(columns=[c for c in drop if c in x]), y.drop(columns=[c for c in drop if c in y])
        if list(x.columns) != list(y.columns):
            lines.append(f"DIFF {name}: columns {sorted(set(x.columns) ^ set(y.columns))} differ")
            continue
        if x.shape != y.shape:
            lines.append(f"DIFF {name}: shape {x.shape} against {y.shape}")
            continue
        try:
            pd.testing.assert_frame_equal(x, y, check_exact=True)
        except AssertionError as exc:
            numeric = [c for c in x.columns if pd.api.types.is_numeric_dtype(x[c]) and not pd.api.types.is_bool_dtype(x[c])]
            rest = [c for c in x.columns if c not in numeric]
            try:
                pd.testing.assert_frame_equal(x[rest], y[rest], check_exact=True)
            except AssertionError as other:
                lines.append(f"DIFF {name}: {str(other).splitlines()[0]} {str(other).splitlines()[-1][:200]}")
                continue
            worst = max_abs_diff(x, y)
            if worst > atol:
                lines.append(f"DIFF {name}: {str(exc).splitlines()[0]} (largest difference {worst:.3g})")
                continue
            lines.append(f"within {atol:g} {name}: {x.shape[0]} rows x {x.shape[1]} columns, largest difference "
                         f"{worst:.3g}" + (f" (ignored {', '.join(drop)})" if drop else ""))
            continue
        lines.append(f"identical {name}: {x.shape[0]} rows x {x.shape[1]} columns"
                     + (f" (ignored {', '.join(drop)})" if drop else ""))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--ignore", default=",".join(TIMING), help="comma-separated columns to leave out")
    ap.add_argument("--atol", type=float, default=0.0, help="largest absolute difference allowed in a numeric column")
    args = ap.parse_args()
    lines = compare(args.before, args.after, set(args.ignore.split(",")), args.atol)
    print("\n".join(lines))
    sys.exit(1 if any(line.startswith("DIFF") for line in lines) else 0)


if __name__ == "__main__":
    main()
