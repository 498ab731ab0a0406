"""Compare two single-field `kvprobe serve-bench` folders run with the same command (e.g. before and
after a change to the client): the same columns, the same rows per (rate, arm), the same prompts'
lengths and ceilings, and the hit rates.

    python scripts/serving_same_rows.py BEFORE_FOLDER AFTER_FOLDER

Unique values are salted per folder, so two runs send prompts of the same shape, not the same
bytes: prompt lengths may differ by a token where a salt tokenizes differently, and a hit rate is
compared against the one block a request may gain or lose at such a boundary. Exit 1 when anything
differs beyond that.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from kvprobe.serving import measure


def main(before: Path, after: Path) -> int:
    a, b = (pd.read_parquet(Path(f) / "serving.parquet") for f in (before, after))
    problems = []
    if list(a.columns) != list(b.columns):
        problems.append(f"columns differ: {sorted(set(a.columns) ^ set(b.columns))}")
    counts = a.groupby(["rate", "arm"]).size().to_frame("before")
    counts = counts.join(b.groupby(["rate", "arm"]).size().rename("after"))
    if not counts["before"].equals(counts["after"]):
        problems.append(f"rows per run differ:\n{counts}")
    sa, sb = measure.summarize(a).set_index(["rate", "arm"]), measure.summarize(b).set_index(["rate", "arm"])
    cols = ["prompt_tokens", "ceiling", "hit_rate_metrics", "hit_rate_usage"]
    table = sa[cols].merge(sb[cols], left_index=True, right_index=True, suffixes=("_before", "_after"))
    block = float(a["block_size"].iloc[0])
    for (rate, arm), r in table.iterrows():
        tol = block / r["prompt_tokens_before"] + 1e-9  # one block of one request's prompt
        if abs(r["prompt_tokens_before"] - r["prompt_tokens_after"]) > 2:
            problems.append(f"{rate}/{arm}: mean prompt length {r['prompt_tokens_before']:.1f} vs "
                            f"{r['prompt_tokens_after']:.1f}")
        for c in ("ceiling", "hit_rate_metrics", "hit_rate_usage"):
            if abs(r[f"{c}_before"] - r[f"{c}_after"]) > tol:
                problems.append(f"{rate}/{arm}: {c} {r[f'{c}_before']:.4f} vs {r[f'{c}_after']:.4f} "
                                f"(tolerance {tol:.4f})")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round(4).to_string())
    print(f"\n{len(a)} rows before, {len(b)} after; block size {block:g}")
    for p in problems:
        print("DIFFERS:", p)
    print("same rows and hit rates" if not problems else f"{len(problems)} difference(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
