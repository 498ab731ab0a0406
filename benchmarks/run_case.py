"""What one valid case of ``kvprobe run`` costs, per stage, in prefill-equivalents.

Runs ``kvprobe run`` (every probe, the default strategies, the held-out K sweep, no CoT) on
``--n`` generated cases into a fresh folder, then times one full prefill of each valid case's new
prompt (the oracle's repair: positions [0, D)) in the same process. A stage's cost per valid case
is its wall time divided by the number of valid decision cases; in prefill-equivalents it is that
divided by the median full-prefill time. Ratios, not seconds: this machine is noisy. (A run also
writes its own profile to manifest.json, ``prefill_equivalents``, over the oracle's prefill time.)

    python benchmarks/run_case.py --model qwen2.5-1.5b --n 10 --json after.json
    python benchmarks/run_case.py --model qwen2.5-1.5b --n 10 --before before.json   # side by side

``--before`` prints another run's figures (a JSON this script wrote, e.g. from an earlier commit
run with ``PYTHONPATH=<that checkout>/src``) beside this one's, with the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

import kvprobe
from kvprobe.datasets import align
from kvprobe.kv import cache as kvcache
from kvprobe.models import load_model
from kvprobe.config import RunConfig, load_cases
from kvprobe.pipeline import run

STAGES = ("validity", "locality", "attention", "knockout", "linear", "edits")


def full_prefill_s(lm, cases, valid_ids: list[str], form: str, repeat: int) -> list[float]:
    """Best-of-``repeat`` seconds of one full prefill of each valid case's new prompt."""
    by_id = {c.case_id: c for c in cases}
    out = []
    for cid in valid_ids:
        a = align(by_id[cid], lm.tokenizer, form)
        ids = torch.tensor(a.ids_new[: a.decision_pos], device=lm.device)
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            kvcache.prefill(lm.model, ids, logits_to_keep=1)
            best = min(best, time.perf_counter() - start)
        out.append(best)
    return out


def measure(args) -> dict:
    torch.set_grad_enabled(False)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    cfg = RunConfig(model=args.model, n=args.n, seed=args.seed, dtype=args.dtype, device=args.device)
    cases = load_cases(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "run"
        start = time.perf_counter()
        manifest = run(cfg, out, lm=lm, cases=cases)
        total = time.perf_counter() - start
        validity = pd.read_parquet(out / "validity.parquet")
    valid_ids = sorted(validity[validity.valid & ~validity.control].case_id)
    prefill = full_prefill_s(lm, cases, valid_ids, cfg.form, args.repeat)
    p = statistics.median(prefill)
    n_valid = len(valid_ids)
    wall = manifest["wall_s"]
    stages = {s: wall.get(s, 0.0) for s in STAGES}
    return {
        "kvprobe": kvprobe.__file__, "model": args.model, "dtype": args.dtype, "device": args.device, "n": args.n,
        "seed": args.seed, "threads": torch.get_num_threads(), "n_valid": n_valid,
        "n_tokens": int(validity[validity.valid & ~validity.control].n_tokens.median()),
        "prefill_s": p, "total_s": total,
        "per_case_s": {s: w / n_valid for s, w in stages.items()},
        "prefill_equivalents": {s: w / n_valid / p for s, w in stages.items()},
        "total_prefill_equivalents": sum(stages.values()) / n_valid / p,
        "manifest_profile": {k: v for k, v in manifest.get("prefill_equivalents", {}).items() if k != "cases"},
    }


def show(now: dict, before: dict | None) -> None:
    print(f"model={now['model']} dtype={now['dtype']} device={now['device']} n={now['n']} seed={now['seed']} "
          f"threads={now['threads']}  valid cases={now['n_valid']}  median prompt={now['n_tokens']} tokens  "
          f"full prefill={now['prefill_s']:.3f} s")
    prof = now.get("manifest_profile")
    if prof:
        print(f"the run's own manifest (denominator: the oracle's prefill, {prof['prefill_s']:.3f} s): "
              f"{prof['total_per_valid_case']:.2f} prefill-equivalents per valid case")
    if before:
        print(f"before: {before['kvprobe']}  valid cases={before['n_valid']}  full prefill={before['prefill_s']:.3f} s")
    head = f"{'stage':<10} {'s/case':>8} {'prefill-eq':>11}"
    if before:
        head += f" {'before s/case':>14} {'before prefill-eq':>18} {'fewer':>7}"
    print(head)
    rows = [*STAGES, "total"]
    for s in rows:
        pe = now["total_prefill_equivalents"] if s == "total" else now["prefill_equivalents"][s]
        sec = sum(now["per_case_s"].values()) if s == "total" else now["per_case_s"][s]
        line = f"{s:<10} {sec:>8.2f} {pe:>11.2f}"
        if before:
            bpe = before["total_prefill_equivalents"] if s == "total" else before["prefill_equivalents"][s]
            bsec = sum(before["per_case_s"].values()) if s == "total" else before["per_case_s"][s]
            line += f" {bsec:>14.2f} {bpe:>18.2f} {bpe / pe if pe else float('nan'):>6.1f}x"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--n", type=int, default=10, help="generated cases (about 4 in 10 are valid on the 1.5B)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=2, help="full prefills timed per valid case (best of)")
    ap.add_argument("--out", help="keep the run's folder here (default: a temporary folder)")
    ap.add_argument("--json", help="write the figures to this JSON file")
    ap.add_argument("--before", help="a JSON written by this script to print side by side")
    args = ap.parse_args()
    now = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(now, indent=1))
    show(now, json.loads(Path(args.before).read_text()) if args.before else None)


if __name__ == "__main__":
    main()
