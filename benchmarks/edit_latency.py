"""Edit latency: each strategy against a full re-prefill of the edited prompt, side by side.

For each context length the old prompt is prefilled once (the serving engine's cache); then each
strategy repairs it and reads the decision, and the oracle re-prefills the new prompt. Ratios are
re-prefill time / strategy time, measured in the same run (best of --repeat).

    python benchmarks/edit_latency.py --model qwen2.5-0.5b --lengths 512,2048,4096
"""

from __future__ import annotations

import argparse

import torch

from common import long_case, timed
from kvprobe import editor
from kvprobe.models import load_model

STRATEGIES = ("field_only", "selective:8:aggregators", "cacheblend:0.15", "erratum", "field_erratum", "hoist")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--lengths", default="512,2048,4096")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--attn", default="sdpa", choices=("eager", "sdpa"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    lm = load_model(args.model, attn=args.attn)
    print(f"model={args.model} attn={args.attn} threads={torch.get_num_threads()}")
    print(f"{'tokens':>7} {'strategy':<26} {'ms':>9} {'re-prefill ms':>14} {'speedup':>8} {'recomputed':>10}")
    for target in (int(x) for x in args.lengths.split(",")):
        a = long_case(lm.tokenizer, target)
        ctx = editor.make_context(lm, a)

        def cost(spec: str) -> tuple[float, float]:
            """Best (repair + decision read) seconds over the repeats, and the recomputed fraction."""
            best, frac = float("inf"), 0.0
            for _ in range(args.repeat):
                edited = editor.apply(ctx, spec)  # wall_s excludes setup a deployment already holds
                _, t_read = timed(lambda: editor.decide(lm, edited))
                best, frac = min(best, edited.wall_s + t_read), edited.recomputed / edited.total
            return best, frac

        t_oracle, _ = cost("oracle")
        for spec in STRATEGIES:
            t, frac = cost(spec)
            print(f"{len(a.ids_old):>7} {spec:<26} {1000 * t:>9.1f} {1000 * t_oracle:>14.1f} {t_oracle / t:>7.1f}x "
                  f"{frac:>9.1%}")


if __name__ == "__main__":
    main()
