"""What a calibration pair costs, in prefill-equivalents, before and after issue 54, side by side.

A pair's cost is the wall time of `measure_pair` (the old prompt's cache continued from the shared
prefix, the stale read, the oracle, the candidates) over one full prefill of its new prompt and its
decision read, measured on the same pair in the same run. Two procedures, alternating pair by pair:

- before (kvprobe up to issue 54): the oracle a full prefill, every candidate measured on every pair;
- after: the oracle from the prefix the two prompts share, one candidate a pair (the chain's
  candidate in play), each candidate timed as the one in play.

Per strategy it prints the median seconds to the decision (`to_decision_s`, repair plus read) in
prefill-equivalents, and for the errata the seconds per appended token over the full prefill's
seconds per token. With ``--policy`` (a field_policy.yaml of this spec) it also weighs each
candidate's pair cost by the pairs the chain gave it there, and compares the whole calibration's
pairs with the shared procedure's (``--pairs-before``, 83 at 0.95 for three candidates).

    python benchmarks/calibrate_cost.py --model qwen2.5-1.5b --dtype float32 --pairs 4
"""

from __future__ import annotations

import statistics
import time

import torch
import yaml
from common import template_bench

from kvprobe.api import aligned_edit
from kvprobe.calibrate.engine import DEFAULT_CANDIDATES, SharedPrefix, _pairs, context_for, measure_pair
from kvprobe.kv import cache as kvcache
from kvprobe.kv.readout import option_columns


def full_prefill_s(lm, a) -> float:
    """One full prefill of the new prompt up to its decision token, and the decision read there."""
    start = time.perf_counter()
    D = a.decision_pos
    _, cache = kvcache.prefill(lm.model, torch.tensor(a.ids_new[:D]), logits_to_keep=1)
    kvcache.forward(lm.model, torch.tensor([a.ids_new[D]]), cache, columns=option_columns(a.option_ids))
    return time.perf_counter() - start


def main() -> None:
    def options(ap):
        ap.add_argument("--pairs", type=int, default=4, help="timed pairs per field (after one untimed warm-up pair)")
        ap.add_argument("--policy", default=None, help="a field_policy.yaml of this spec: weigh by its chain's pairs")
        ap.add_argument("--pairs-before", type=int, default=83, help="pairs a field took with shared alpha")

    args, lm, spec = template_bench(__doc__, options)
    cands = list(DEFAULT_CANDIDATES)
    print(f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()} spec={args.spec} "
          f"pairs per field={args.pairs} (+1 warm-up)")
    prefix = {"before": SharedPrefix(lm), "after": SharedPrefix(lm)}
    results = {}
    for name in spec.fields:
        eq = {"before": [], **{f"after:{c}": [] for c in cands}}
        strat: dict[str, list[float]] = {}
        per_token: dict[str, list[float]] = {}
        for i, (_, (base, new)) in enumerate(_pairs(spec, name, 1, args.pairs + 1)):
            ctx = context_for(lm, spec, base)
            a = aligned_edit(lm, ctx.case(name, new), ctx.form)
            ref = full_prefill_s(lm, a)
            start = time.perf_counter()
            df = measure_pair(lm, spec, name, base, new, cands, prefix=prefix["before"], oracle="full")
            before = time.perf_counter() - start
            after = {}
            for c in cands:
                start = time.perf_counter()
                got = measure_pair(lm, spec, name, base, new, [c], prefix=prefix["after"], oracle="prefix")
                after[c] = time.perf_counter() - start
                row = got[got.strategy == "oracle"].iloc[0]
                strat.setdefault("oracle (prefix)", []).append(row.to_decision_s / ref)
            if i == 0 or "skip" in df and isinstance(df.skip.iloc[0], str):
                continue  # the warm-up pair, or a pair that cannot be measured
            eq["before"].append(before / ref)
            for c in cands:
                eq[f"after:{c}"].append(after[c] / ref)
            tok_s = ref / (a.decision_pos + 1)
            for r in df.itertuples():
                label = "oracle (full)" if r.strategy == "oracle" else r.strategy
                strat.setdefault(label, []).append(r.to_decision_s / ref)
                if r.strategy.startswith("erratum"):
                    per_token.setdefault(r.strategy, []).append(r.to_decision_s / max(1.0, r.tokens_recomputed) / tok_s)
        results[name] = {k: statistics.median(v) for k, v in eq.items() if v}
        print(f"\n{name}: prefill-equivalents per pair (median of {len(eq['before'])})")
        for k, v in results[name].items():
            print(f"  {k:<34} {v:6.2f}")
        print("  per strategy, repair and read:")
        for k, v in strat.items():
            print(f"    {k:<32} {statistics.median(v):6.2f}")
        for k, v in per_token.items():
            print(f"    {k} per appended token / full prefill per token: {statistics.median(v):.2f}")
    if args.policy:
        policy = yaml.safe_load(open(args.policy))
        total_after = total_before = pairs_after = pairs_before = 0.0
        print("\nthe whole calibration, weighed by the policy's pairs (prefill-equivalents):")
        for name, f in policy["fields"].items():
            n = {c: f["strategies"][c]["agreement"]["n"] for c in cands}
            after = sum(n[c] * results[name][f"after:{c}"] for c in cands)
            before = args.pairs_before * results[name]["before"]
            print(f"  {name:<12} after {sum(n.values()):3d} pairs ({', '.join(f'{c} {n[c]}' for c in cands if n[c])}): "
                  f"{after:7.1f}   before {args.pairs_before} pairs: {before:7.1f}   ratio {before / after:.2f}")
            total_after, total_before = total_after + after, total_before + before
            pairs_after, pairs_before = pairs_after + sum(n.values()), pairs_before + args.pairs_before
        print(f"  all fields   after {pairs_after:.0f} pairs: {total_after:.1f} "
              f"({total_after / pairs_after:.2f} a pair)"
              f"   before {pairs_before:.0f} pairs: {total_before:.1f} ({total_before / pairs_before:.2f} a pair)"
              f"   ratio {total_before / total_after:.2f}")


if __name__ == "__main__":
    main()
