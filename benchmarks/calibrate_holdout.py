"""A calibrated policy on fresh pairs: auto with the field policy against every fixed repair and
auto without a policy, on pairs of the same template that the calibration never saw.

    .venv/bin/python benchmarks/calibrate_holdout.py --model qwen2.5-1.5b --dtype bfloat16 \\
        --spec examples/calibrate-refund.yaml --policy results/calibrate/qwen2.5-1.5b/field_policy.yaml --pairs 20

Pairs are drawn as `kvprobe calibrate` draws them but with another seed (default 1; calibrate's
default is 0), a fixed number per field, so plain Clopper-Pearson intervals are valid. Per field
and strategy: agreement with the oracle on pairs whose oracle decision changed, spurious flips on
pairs where it did not (with the upper end of the 95% interval), and the median time to the
decision against the oracle's, all measured side by side in one run. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
from common import share
import kvprobe
from kvprobe.calibrate.engine import _pairs, load_spec, measure_pair
from kvprobe.hardware import cpu_line

FIXED = ("field_only", "erratum_turn:neutral", "erratum_turn")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print(cpu_line(), flush=True)
    lm = kvprobe.load(args.model, dtype=args.dtype)
    spec = load_spec(args.spec)
    strategies = [*FIXED, "auto", f"auto:{args.policy}"]
    print(f"{args.model} ({args.dtype}), {args.spec}, {args.pairs} fresh pairs per field (seed {args.seed})\n")
    print("| field | changed | strategy | ran | agreement on changed pairs [95% CI] | spurious flips on unchanged "
          "[95% CI] | ms to decision (oracle) |")
    print("|---|---:|---|---|---|---|---|")
    for name in spec.fields:
        start = time.perf_counter()
        frames = [measure_pair(lm, spec, name, base, new, strategies)
                  for _, (base, new) in _pairs(spec, name, args.seed, args.pairs)]
        df = pd.concat([f for f in frames if f.skip.isna().all()], ignore_index=True)
        n_pairs = int((df.strategy == "oracle").sum())
        changed = int(df[df.strategy == "oracle"].changed.sum())
        oracle_ms = 1000 * df[df.strategy == "oracle"].to_decision_s.median()
        for s in strategies:
            g = df[df.strategy == s]
            ch, same = g[g.changed.astype(bool)], g[~g.changed.astype(bool)]
            ran = ", ".join(f"{k} {v}" for k, v in g.chose.value_counts().items()) if "chose" in g else s
            label = "auto + field policy" if s.startswith("auto:") else s
            print(f"| {name} | {changed}/{n_pairs} | {label} | {ran} | {share(int(ch.agree.sum()), len(ch))} | "
                  f"{share(int((~same.agree.astype(bool)).sum()), len(same))} | "
                  f"{1000 * g.to_decision_s.median():.0f} ({oracle_ms:.0f}) |", flush=True)
        print(f"<!-- {name}: {time.perf_counter() - start:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
