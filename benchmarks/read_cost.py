"""What a batch of one-token reads costs against one full prefill, side by side.

The probes read a case's decision hundreds of times (a patched copy of the cache each, fed the
decision token), batched. This prints, for one generated case, one full prefill of its prompt and
a batch of B one-token reads over copies of its cache, each in seconds and in prefill-equivalents:
where the batch stops costing one weight read and starts costing its rows' arithmetic.

    python benchmarks/read_cost.py --model qwen2.5-1.5b --batches 1,16,64,128
"""

from __future__ import annotations

import argparse

import torch

from common import timed
from kvprobe.datasets import align
from kvprobe.kv import cache as kvcache
from kvprobe.kv.readout import option_columns
from kvprobe.models import load_model
from kvprobe.config import RunConfig, load_cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    lm = load_model(args.model, dtype=args.dtype)
    a = align(load_cases(RunConfig(model=args.model, n=2))[1], lm.tokenizer, "auto")
    D = a.decision_pos
    ids = torch.tensor(a.ids_old[:D])
    (_, cache), t_prefill = timed(lambda: kvcache.prefill(lm.model, ids, logits_to_keep=1), args.repeat)
    print(f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()} prompt={D} tokens")
    print(f"{'what':<28} {'seconds':>8} {'prefill-eq':>11} {'per row':>10}")
    print(f"{'full prefill':<28} {t_prefill:>8.3f} {1:>11.2f}")
    for B in (int(b) for b in args.batches.split(",")):
        batch = kvcache.expand_batch(cache, B)

        def read():
            out = kvcache.forward(lm.model, torch.full((B, 1), a.ids_old[D]), batch, torch.full((B, 1), D),
                                  columns=option_columns(a.option_ids))
            kvcache.truncate_(batch, D)
            return out

        _, t = timed(read, args.repeat)
        print(f"{f'{B} one-token reads':<28} {t:>8.3f} {t / t_prefill:>11.2f} {t / t_prefill / B:>10.4f}")


if __name__ == "__main__":
    main()
