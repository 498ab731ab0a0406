"""Spurious flips per erratum wording: how often each wording moves a decision the oracle keeps.

    .venv/bin/python benchmarks/erratum_wordings.py [--models toy-qwen2,...] [--spec SPEC] [--pairs N]

For each model, each field of the spec gets N pairs drawn as `kvprobe calibrate` draws them (a fixed
number: no early stopping, so a plain Clopper-Pearson interval is valid) and every wording of the
erratum as a new turn is scored against the oracle: on pairs whose oracle decision did not change,
a changed decision is a spurious flip; on pairs where it changed, agreement. Prints a markdown
table with n always shown.
"""

from __future__ import annotations

import argparse
import time

from common import share
import kvprobe
from kvprobe.calibrate.engine import _pairs, load_spec, measure_pair
from kvprobe.hardware import cpu_line

WORDINGS = ("erratum_turn:neutral", "erratum_turn", "erratum_turn:short")
TOYS = ("toy-llama", "toy-qwen2", "toy-qwen3", "toy-gemma2", "toy-gemma3", "toy-mistral")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(TOYS))
    ap.add_argument("--spec", default="examples/calibrate-toy.yaml")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=1)  # not calibrate's default seed: fresh pairs
    args = ap.parse_args()
    spec = load_spec(args.spec)
    print(cpu_line(), flush=True)
    print(f"spec {args.spec}, {args.pairs} pairs per field, seed {args.seed}, dtype {args.dtype}\n")
    print("| model | field | changed | wording | spurious flips (unchanged pairs) [95% CI] | agreement (changed pairs) [95% CI] |")
    print("|---|---|---:|---|---|---|")
    for model in args.models.split(","):
        lm = kvprobe.load(model, dtype=args.dtype)
        start = time.perf_counter()
        for name in spec.fields:
            frames = [measure_pair(lm, spec, name, base, new, list(WORDINGS))
                      for _, (base, new) in _pairs(spec, name, args.seed, args.pairs)]
            frames = [f for f in frames if f.skip.isna().all()]
            changed = sum(bool(f.changed.iloc[0]) for f in frames)
            for w in WORDINGS:
                rows = [f[f.strategy == w].iloc[0] for f in frames]
                same = [r for r in rows if not r.changed]
                moved = [r for r in rows if r.changed]
                flips = sum(r.pred != r.reference for r in same)
                agree = sum(r.pred == r.reference for r in moved)
                print(f"| {model} | {name} | {changed}/{len(frames)} | {w} | {share(flips, len(same))} | "
                      f"{share(agree, len(moved))} |", flush=True)
        print(f"<!-- {model}: {time.perf_counter() - start:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
