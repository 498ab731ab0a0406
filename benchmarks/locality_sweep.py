"""Single-position locality sweep: kvprobe's batched cache-space engine against a naive loop.

The naive loop is what a TransformerLens or nnsight user writes today: for each position p, run
the whole forward pass of the old prompt with hooks on every layer's k/v projections that keep
the old run's values everywhere except at p, where they take the new run's, and read the
decision. kvprobe instead swaps cache entries and re-reads only the decision token, many patched
caches per batch. Both must give the same effects; the ratio is measured in one run.

    python benchmarks/locality_sweep.py --model qwen2.5-0.5b --tokens 1000 --naive-positions 6
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from common import long_case, timed
from kvprobe.kv.readout import logit_diff
from kvprobe.models import load_model
from kvprobe.probes.engine import PairCaches, Patch, patched_reads
from kvprobe.probes.locality import targets


@contextlib.contextmanager
def kv_hooks(lm, replace):
    """Forward hooks on every layer's k and v projections: ``replace(layer, which, out) -> out``."""
    handles = []
    try:
        for layer in range(lm.adapter.n_layers):
            for which in ("k", "v"):
                mod = lm.adapter.proj(lm.model, layer, which)
                handles.append(mod.register_forward_hook(
                    lambda m, i, o, layer=layer, which=which: replace(layer, which, o)))
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def naive_effects(lm, a, positions):
    """Per position: full forward of the old prompt with k/v of every position frozen to the old
    run, except p, which takes the new run's, and the decision token, which keeps its own
    (identical to a cache-space patch read by the decision token)."""
    ids_old, ids_new = torch.tensor([a.ids_old]), torch.tensor([a.ids_new])
    store = {}
    for tag, ids in (("old", ids_old), ("new", ids_new)):
        with kv_hooks(lm, lambda layer, which, out, tag=tag: store.__setitem__((tag, layer, which), out.clone())):
            lm.model(ids)
    new_ans, old_ans = targets(a)
    base = float(logit_diff(lm.model(ids_old).logits[0, -1], a.option_ids, new_ans, old_ans))
    out = []
    for p in positions:
        def patch(layer, which, o, p=p):
            out = store[("old", layer, which)].clone()
            out[:, p] = store[("new", layer, which)][:, p]
            out[:, -1] = o[:, -1]  # the decision token's own k/v come from its patched residual, as in a cache read
            return out

        with kv_hooks(lm, patch):
            logits = lm.model(ids_old).logits[0, -1]
        out.append(float(logit_diff(logits, a.option_ids, new_ans, old_ans)) - base)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--naive-positions", type=int, default=6, help="positions timed with the naive loop")
    args = ap.parse_args()

    lm = load_model(args.model)
    a = long_case(lm.tokenizer, args.tokens)
    D = a.decision_pos
    pc = PairCaches.build(lm, a)
    new_ans, old_ans = targets(a)

    def sweep():
        reads = patched_reads(lm, pc, [Patch(()), *[Patch((p,)) for p in range(D)]])
        m = logit_diff(reads, a.option_ids, new_ans, old_ans)
        return (m[1:] - m[0]).tolist()

    effects, t_kv = timed(sweep)
    step = max(1, D // args.naive_positions)
    picks = sorted({*range(0, D, step), *range(*a.field)})[: args.naive_positions + (a.field[1] - a.field[0])]
    naive, t_naive = timed(lambda: naive_effects(lm, a, picks))
    err = max(abs(naive[i] - effects[p]) for i, p in enumerate(picks))
    scale = max(abs(e) for e in effects) or 1.0
    per_naive = t_naive / len(picks)
    print(f"model={args.model} prompt={D + 1} tokens, sweep over {D} positions")
    print(f"kvprobe batched cache-space sweep: {t_kv:.2f} s for {D} positions ({1000 * t_kv / D:.1f} ms/position)")
    print(f"naive hook loop: {t_naive:.2f} s for {len(picks)} positions ({per_naive:.2f} s/position; "
          f"{per_naive * D:.0f} s extrapolated to all {D})")
    print(f"max |effect difference| on the {len(picks)} shared positions: {err:.2e} (largest effect {scale:.3f})")
    print(f"speedup (per position, measured side by side): {per_naive * D / t_kv:.1f}x")
    if err > 1e-3 * max(1.0, scale):
        raise SystemExit("the two implementations disagree")


if __name__ == "__main__":
    main()
