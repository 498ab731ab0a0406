"""Compare the tables of two results folders: every parquet file, row for row, timing columns aside.

    python scripts/compare_runs.py BEFORE_DIR AFTER_DIR [--ignore wall_s,decide_s,...]

Prints one line per table (identical, or what differs) and exits 1 if any table differs. Used to
show that a behaviour-preserving change keeps ``kvprobe run``'s tables bit for bit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

TIMING = ("wall_s", "decide_s", "setup_s", "seconds", "elapsed_s", "train_wall_s")


def compare(before: Path, after: Path, ignore: set[str]) -> list[str]:
    """One line per table; a line starting with 'DIFF' marks a difference."""
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
            lines.append(f"DIFF {name}: {str(exc).splitlines()[0]}")
            continue
        lines.append(f"identical {name}: {x.shape[0]} rows x {x.shape[1]} columns"
                     + (f" (ignored {', '.join(drop)})" if drop else ""))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--ignore", default=",".join(TIMING), help="comma-separated columns to leave out")
    args = ap.parse_args()
    lines = compare(args.before, args.after, set(args.ignore.split(",")))
    print("\n".join(lines))
    sys.exit(1 if any(line.startswith("DIFF") for line in lines) else 0)


if __name__ == "__main__":
    main()
