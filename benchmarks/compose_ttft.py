"""Time to first token: full prefill against a composed cache, by skill length, side by side.

For each block length L (512 .. 8k tokens, where the model's position range allows) one skill
block is precompiled behind the shared preamble and saved to the block store; then, in the same
loop iteration, these are timed:

- **full**: prefill of the context (lead + block + query after the cached preamble), logits
  of the last token only;
- **compose**: load the block from the store (header and identity checks, sha256 of the bytes),
  re-rotate the block's keys to their new position, splice, then one forward pass of the fresh
  tokens (the lead, the seam's s block tokens, the query) against the spliced entries
  (:func:`kvprobe.composer.splice.compose_fused`); logits of the last token;
- **memcpy**: ``torch.clone`` of the block's K/V tensors, the lower bound for anything that
  touches the same bytes once.

The shared preamble (the system turn, at position 0) is precompiled once and reused by both
paths, as a server's prefix cache would (its KV is exact: nothing precedes it). ``no-pc`` is
the composition with the preamble prefilled fresh too (no prefix cache).

Prints one row per length (best of ``--repeat``; the full prefill once at L >= 4096) with the
speedup full / compose, compose / memcpy, and the composed logits' cosine with the full
prefill's. The store file was just written, so its load is a warm page-cache read.

    .venv/bin/python benchmarks/compose_ttft.py --model qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--seam", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import torch.nn.functional as F

    from kvprobe.datasets.skills import SYSTEM, head_tail, policy_skill
    from kvprobe.datasets.domains import DOMAINS
    from kvprobe import composer
    from kvprobe.composer import store as block_store
    from kvprobe.models import load_model

    lm = load_model(args.model, attn="sdpa")
    block_store.identity(lm)  # the loaded model's identity: computed once per process, not per request
    tok = lm.tokenizer
    form, head, tail = head_tail(tok, SYSTEM)

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    spec = DOMAINS["retail_refund"]
    gate = spec.fields[0]
    preamble = enc(head)
    lead = enc("## Context\nThe customer wrote in through the chat widget.\n\n")
    query = enc(f"## Record\n{gate.name}: {gate.deny[0]}\nitem: blender\n\n## Request\n"
                f"{spec.templates[0].question} Answer yes or no.{tail}")
    limit = getattr(lm.model.config, "max_position_embeddings", None) or 10**9
    lengths = [L for L in (int(x) for x in args.lengths.split(",")) if len(preamble + lead + query) + L <= limit]
    print(f"{args.model} ({lm.info.n_params / 1e6:.0f}M params, {form} form, sdpa, {args.threads} thread(s)), "
          f"seam s={args.seam}; context = {len(preamble)} preamble + {len(lead)} lead + L block + {len(query)} query")
    header = (f"{'L':>6} {'full s':>8} {'compose s':>10} {'speedup':>8} {'no-pc s':>8} {'speedup':>8} | {'load':>5} "
              f"{'rerot':>5} {'splice':>6} {'fwd':>5} ms | {'KV MB':>6} {'memcpy ms':>9} {'comp/memcpy':>11} "
              f"{'cosine':>7}")
    print(header)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # The shared preamble (system turn) at position 0: cached once, exact, used by both paths.
        pre_block = block_store.load_block(block_store.save_block(composer.precompile(lm, preamble, name="preamble"), lm,
                                              Path(tmp) / f"preamble{block_store.SUFFIX}"), lm)
        for L in lengths:
            text = policy_skill(spec.name, gate.name, seed=0, target=L + 64, tokenizer=tok).text
            block_ids = enc(text)[:L]
            if len(block_ids) < L:
                raise SystemExit(f"could not build a {L}-token block")
            path = block_store.save_block(composer.precompile(lm, block_ids, preamble, name=f"L{L}"), lm, Path(tmp) / f"L{L}{block_store.SUFFIX}")
            best = {"full": float("inf"), "compose": float("inf"), "nopc": float("inf"), "memcpy": float("inf")}
            parts: dict = {}
            for r in range(args.repeat):
                if r == 0 or L < 4096:
                    t0 = time.perf_counter()
                    c = composer.Composer(lm)
                    c.block(pre_block)
                    full = c.text(lead + block_ids + query)  # a plain prefill after the cached preamble
                    best["full"] = min(best["full"], time.perf_counter() - t0)
                t0 = time.perf_counter()
                block = block_store.load_block(path, lm)
                t_load = time.perf_counter() - t0
                c = composer.compose_fused(lm, [pre_block, lead, block, query], seam=args.seam)
                logits = c.logits
                total = time.perf_counter() - t0
                if total < best["compose"]:
                    best["compose"] = total
                    parts = {"load": t_load, "rerot": c.timings.rerotate, "splice": c.timings.splice,
                             "fwd": c.timings.prefill}
                t0 = time.perf_counter()
                composer.compose_fused(lm, [preamble + lead, block_store.load_block(path, lm), query], seam=args.seam)
                best["nopc"] = min(best["nopc"], time.perf_counter() - t0)
                for _ in range(3):
                    t0 = time.perf_counter()
                    copies = [(k.clone(), v.clone()) for k, v in block.kv]
                    best["memcpy"] = min(best["memcpy"], time.perf_counter() - t0)
                    del copies
            cosine = float(F.cosine_similarity(logits.double(), full.double(), dim=0))
            mb = block.nbytes / 2**20
            rows.append({"L": L, **best, **parts, "mb": mb, "cosine": cosine})
            print(f"{L:>6} {best['full']:>8.2f} {best['compose']:>10.3f} {best['full'] / best['compose']:>7.1f}x "
                  f"{best['nopc']:>8.3f} {best['full'] / best['nopc']:>7.1f}x | "
                  + " ".join(f"{1000 * parts[k]:>5.0f}" for k in ("load", "rerot", "splice", "fwd"))
                  + f"    | {mb:>6.1f} {1000 * best['memcpy']:>9.1f} {best['compose'] / best['memcpy']:>10.0f}x "
                  f"{cosine:>7.4f}", flush=True)
    print("speedup curve (full / compose): " + ", ".join(f"{r['L']}: {r['full'] / r['compose']:.1f}x" for r in rows))


if __name__ == "__main__":
    main()
