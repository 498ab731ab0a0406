"""Where an appended erratum's time goes, per token, against a full prefill of the new prompt, side by side.

For pairs of a calibration spec (the old prompt, one field changed), on the same model in one run:

- prefill: the new prompt's ``D`` tokens into an empty cache, then its decision read (one token);
- erratum: the old prompt's cache, the erratum prompt's tail after the prefix they share (the note
  turn and the question, ``S`` tokens) fed on top, its last logits read: what ``decide`` does for
  ``erratum_turn`` (and what ``kvprobe edit``, ``run``, ``diagnose`` and the API pay for every erratum).

Each is timed (median of ``--repeat``) and profiled once with ``torch.profiler``; the profile's self CPU
time is split by kind of operator: the weight matmuls (``aten::addmm``/``mm``/``linear``), attention
(``bmm``, ``matmul``, ``softmax``, ``scaled_dot_product_attention``), the cache's growth (``cat``,
``copy_``, ``index``), and the rest (norms, RoPE, activations, Python glue). Printed per token: seconds
and each kind's share, so a suffix's extra cost per token is seen where it arises: matmuls on fewer rows
(each weight read serves S rows, not D), attention over the whole cache, or copying it.

    python benchmarks/erratum_profile.py --model qwen2.5-1.5b --dtype float32 --pairs 3
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
from common import template_bench

from kvprobe.api import aligned_edit
from kvprobe.calibrate.engine import _pairs, context_for
from kvprobe.editor.context import make_context
from kvprobe.editor.strategies import parse_strategy
from kvprobe.kv import cache as kvcache

KINDS = {"matmul": ("aten::addmm", "aten::mm", "aten::linear", "aten::_weight_int", "aten::mkldnn"),
         "attention": ("aten::bmm", "aten::matmul", "aten::softmax", "aten::_softmax",
                       "aten::scaled_dot_product_attention", "aten::_scaled_dot_product"),
         "cache copies": ("aten::cat", "aten::copy_", "aten::index", "aten::slice_scatter", "aten::clone")}


def kind_of(name: str) -> str:
    return next((k for k, prefixes in KINDS.items() if name.startswith(prefixes)), "rest")


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile(fn) -> dict[str, float]:
    """Self CPU seconds of one call of ``fn``, by kind of operator."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU]) as p:
        fn()
    out: dict[str, float] = defaultdict(float)
    for e in p.key_averages():
        out[kind_of(e.key)] += e.self_cpu_time_total / 1e6
    return out


def main() -> None:
    def options(ap):
        ap.add_argument("--strategy", default="erratum_turn")
        ap.add_argument("--pairs", type=int, default=3)
        ap.add_argument("--repeat", type=int, default=3)

    args, lm, spec = template_bench(__doc__, options)
    strategy = parse_strategy(args.strategy)
    print(f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()} strategy={strategy.spec}")
    print(f"{'pair':<26} {'what':<9} {'tokens':>6} {'s':>7} {'s/token':>8} {'ratio':>6}  "
          f"{'matmul':>7} {'attention':>9} {'cache':>6} {'rest':>6}")
    ratios = []
    field = next(iter(spec.fields))
    for i, (_, (base, new)) in enumerate(_pairs(spec, field, 1, args.pairs + 1)):
        ctx = context_for(lm, spec, base)
        a = aligned_edit(lm, ctx.case(field, new), ctx.form)
        D = a.decision_pos
        _, old_cache = kvcache.prefill(lm.model, torch.tensor(a.ids_old[:D]), logits_to_keep=1)
        edited = strategy.apply(make_context(lm, a, old_cache=old_cache))
        tail, shared = edited.tail_ids, kvcache.seq_len(edited.cache)
        label = f"{field}: {base[field]}->{new}"

        def prefill():
            _, cache = kvcache.prefill(lm.model, torch.tensor(a.ids_new[:D]), logits_to_keep=1)
            kvcache.forward(lm.model, torch.tensor([a.ids_new[D]]), cache, logits_to_keep=1)

        def erratum():
            cache = kvcache.crop(edited.cache, shared)  # views: the forward appends, the base is kept
            kvcache.forward(lm.model, torch.tensor([tail]), cache, logits_to_keep=1)

        prefill(), erratum()  # warm
        if i == 0:
            continue  # the first pair warms the kernels up, untimed
        rows = {}
        for name, fn, tokens in (("prefill", prefill, D + 1), ("erratum", erratum, len(tail))):
            s, kinds = timed(fn, args.repeat), profile(fn)
            total = sum(kinds.values()) or 1.0
            rows[name] = (tokens, s, {k: v / total for k, v in kinds.items()})
        per = {name: s / tokens for name, (tokens, s, _) in rows.items()}
        ratios.append(per["erratum"] / per["prefill"])
        for name, (tokens, s, share) in rows.items():
            ratio = f"{per[name] / per['prefill']:.2f}"
            print(f"{label[:26]:<26} {name:<9} {tokens:>6} {s:>7.3f} "
                  f"{per[name]:>8.4f} {ratio:>6}  {share.get('matmul', 0):>7.0%} {share.get('attention', 0):>9.0%} "
                  f"{share.get('cache copies', 0):>6.0%} {share.get('rest', 0):>6.0%}")
    if ratios:
        print(f"erratum seconds per token over prefill seconds per token: median {statistics.median(ratios):.2f} "
              f"(n={len(ratios)} pairs, range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
