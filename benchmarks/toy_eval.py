"""A shipped toy's held-out evaluation (what tests/toys/test_toy.py reruns for each toy), with
kvprobe's grouped eager attention as it is (scaling, softcap and mask applied in place when there is
no autograd) against the same attention with each step allocating a new tensor (its form before);
or, with ``--what batch``, 16 prompts a batch (``toys.evaluate.predict``'s default) against 64.

    .venv/bin/python benchmarks/toy_eval.py --family gemma2 --repeat 2
    .venv/bin/python benchmarks/toy_eval.py --family qwen2 --what batch

One torch thread (as each test worker). The arms alternate on the same loaded model and the same
prompts; their figures must be identical (the same operations on the same values). Prints the CPU,
each arm's wall times and the median ratio.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AttentionInterface

from common import alternate, report_arms
from kvprobe.hardware import cpu_line
from kvprobe.models import attention, load_model, toy_folder
from kvprobe.toys import evaluate as toy_eval


def allocating(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """grouped_eager with a new (B, H, S, N) tensor at each step: its form before the in-place path."""
    B, H, S, d = query.shape
    H_kv, N = key.shape[1], key.shape[2]
    if scaling is None:
        scaling = module.head_dim**-0.5
    weights = torch.matmul(query.reshape(B, H_kv, (H // H_kv) * S, d), key.transpose(2, 3)) * scaling
    weights = weights.view(B, H, S, N)
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights.view(B, H_kv, (H // H_kv) * S, N), value).view(B, H, S, value.shape[-1])
    return out.transpose(1, 2).contiguous(), weights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="gemma2", choices=toy_folder.toy_families())
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--what", choices=("attention", "batch"), default="attention")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(cpu_line(), flush=True)
    lm = load_model(f"toy-{args.family}")
    h = toy_folder.read_manifest(toy_folder.shipped_dir(args.family))["heldout"]
    if args.what == "batch":
        return batch_sizes(lm, h, args)
    arms = {"in place": attention.grouped_eager, "allocating": allocating}

    def run(arm: str, r: int) -> dict:
        AttentionInterface.register(attention.NAME, arms[arm])
        return toy_eval.evaluate_toy(lm, n=h["n"], n_unseen=max(20, h["n"] // 4), fillers=tuple(h["fillers"]))

    try:
        times, figures = alternate(arms, args.repeat, run)
    finally:
        AttentionInterface.register(attention.NAME, attention.grouped_eager)
    same = figures["in place"] == figures["allocating"]
    print(f"\ntoy-{args.family}: n={args.repeat} runs per arm, alternating, {h['n']} held-out cases")
    medians = report_arms(times, 12)
    ratio = medians["allocating"] / medians["in place"]
    print(f"  in place is {ratio:.2f}x faster; the figures are {'identical' if same else 'DIFFERENT'}")


def batch_sizes(lm, h: dict, args) -> None:
    predict = toy_eval.predict
    arms = {"16 a batch": 16, "64 a batch": 64}

    def run(arm: str, r: int) -> dict:
        toy_eval.predict = lambda model, tok, texts: predict(model, tok, texts, batch_size=arms[arm])
        return toy_eval.evaluate_toy(lm, n=h["n"], n_unseen=max(20, h["n"] // 4), fillers=tuple(h["fillers"]))

    try:
        times, figures = alternate(arms, args.repeat, run)
    finally:
        toy_eval.predict = predict
    same = figures["16 a batch"] == figures["64 a batch"]
    print(f"\ntoy-{args.family}: n={args.repeat} runs per arm, alternating, {h['n']} held-out cases")
    medians = report_arms(times, 12)
    ratio = medians["64 a batch"] / medians["16 a batch"]
    print(f"  16 a batch is {ratio:.2f}x faster; the figures are {'identical' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
