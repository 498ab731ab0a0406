"""Does prefilling several calibration pairs' suffixes as one batch cost less than one by one, on this CPU?
(issue 54, item 2: "prefill several pairs' suffixes as one padded batch where that is faster on this CPU;
measure the batch size that is").

A calibration pair computes two suffixes: its old prompt's from the shared prefix on (the stale state) and its
new prompt's from the field on (the prefix oracle). Pairs drawn for one field are independent, so B of them
could run as one forward of B rows. This measures, side by side in one run, per batch size B: B pairs' old
suffixes each prefilled alone on a copy of the shared prefix's cache, against the B suffixes right-padded to
the longest and prefilled as one batch on B copies of it (a right pad changes no real token's keys or values:
attention is causal), and the same for the oracles' suffixes from the field. Median of ``--repeat`` tries,
after a warm-up of each shape; printed as seconds and the batch's time over the singles' sum.

    python benchmarks/suffix_batch.py --model qwen2.5-1.5b --dtype bfloat16 --batches 2,4,8
"""

from __future__ import annotations

import statistics

import torch
from common import template_bench, timed

from kvprobe.api import aligned_edit
from kvprobe.calibrate.engine import _pairs, context_for
from kvprobe.errors import KvprobeError
from kvprobe.kv import cache as kvcache


def common_prefix(rows: list[list[int]]) -> int:
    n = 0
    while all(len(r) > n + 1 for r in rows) and len({r[n] for r in rows}) == 1:
        n += 1
    return n


def singles(lm, base, suffixes: list[list[int]]) -> float:
    def run():
        for s in suffixes:
            kvcache.forward(lm.model, torch.tensor([s]), kvcache.crop(base, kvcache.seq_len(base)), logits_to_keep=1)
    return timed(run)[1]


def batched(lm, base, suffixes: list[list[int]], pad: int) -> float:
    width = max(map(len, suffixes))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in suffixes])

    def run():
        cache = kvcache.concat([kvcache.crop(base, kvcache.seq_len(base))] * len(suffixes), dim="batch")
        kvcache.forward(lm.model, ids, cache, logits_to_keep=1)
    return timed(run)[1]


def main() -> None:
    def options(ap):
        ap.add_argument("--field", default=None, help="the field whose pairs are drawn (default: the spec's first)")
        ap.add_argument("--batches", default="2,4,8")
        ap.add_argument("--repeat", type=int, default=3)

    args, lm, spec = template_bench(__doc__, options)
    name = args.field or next(iter(spec.fields))
    sizes = [int(b) for b in args.batches.split(",")]
    aligned = []
    for _, (base, new) in _pairs(spec, name, 7, 4 * max(sizes)):
        ctx = context_for(lm, spec, base)
        try:
            aligned.append(aligned_edit(lm, ctx.case(name, new), ctx.form))
        except KvprobeError:  # a value of another token length: not a pair calibrate measures
            continue
        if len(aligned) == max(sizes):
            break
    olds = [a.ids_old[: a.decision_pos] for a in aligned]
    n = common_prefix(olds)
    prefix = kvcache.prefill(lm.model, torch.tensor(olds[0][:n]), logits_to_keep=1)[1]
    f0 = min(a.field[0] for a in aligned)
    field_prefix = kvcache.prefill(lm.model, torch.tensor(olds[0][:f0]), logits_to_keep=1)[1]
    kinds = {"old prompt from the shared prefix": (prefix, [o[n:] for o in olds]),
             "oracle from the field": (field_prefix, [a.ids_new[f0: a.decision_pos] for a in aligned])}
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    full = statistics.median(timed(lambda: kvcache.prefill(lm.model, torch.tensor(olds[0]), logits_to_keep=1))[1]
                             for _ in range(args.repeat))
    print(f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()} field={name} pairs={len(aligned)} "
          f"prompt={len(olds[0])} tokens, shared prefix={n}, field at {f0}; a full prefill {full:.3f} s")
    print(f"{'suffix':<36} {'B':>3} {'tokens':>7} {'one by one s':>13} {'one batch s':>12} {'batch/singles':>14}")
    for label, (base, suffixes) in kinds.items():
        for b in sizes:
            rows = suffixes[:b]
            singles(lm, base, rows[:1]), batched(lm, base, rows, pad)  # warm-up of each shape
            one = statistics.median(singles(lm, base, rows) for _ in range(args.repeat))
            many = statistics.median(batched(lm, base, rows, pad) for _ in range(args.repeat))
            toks = f"{min(map(len, rows))}-{max(map(len, rows))}"
            print(f"{label:<36} {b:>3} {toks:>7} {one:>13.3f} {many:>12.3f} {many / one:>14.2f}")


if __name__ == "__main__":
    main()
