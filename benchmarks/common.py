"""Shared helpers for the benchmarks (never imported by the package or the tests)."""

from __future__ import annotations

import argparse
import statistics
import time

from kvprobe.datasets import DOMAINS, align, generate
from kvprobe.intervals import proportion_ci


def long_case(tokenizer, target_tokens: int, seed: int = 0, form: str = "auto"):
    """An aligned decision case padded with its domain's filler rules to about ``target_tokens``."""
    for case in generate(16, seed=seed, controls=0.0):
        pool = list(DOMAINS[case.domain].fillers)
        fillers = list(case.fillers)
        a = align(case, tokenizer, form)
        while not isinstance(a, type(None)) and hasattr(a, "ids_old") and len(a.ids_old) < target_tokens:
            fillers.append(pool[len(fillers) % len(pool)])
            a = align(case.model_copy(update={"fillers": fillers, "field_position": "early"}), tokenizer, form)
        if hasattr(a, "ids_old"):
            return a
    raise RuntimeError("no generated case aligned under this tokenizer")


def timed(fn, repeat: int = 1):
    """(result of the last call, best wall seconds over ``repeat`` calls)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def alternate(arms, repeat: int, run) -> tuple[dict[str, list[float]], dict]:
    """``run(arm, r)`` for each run ``r`` and each arm in turn (the arms alternate, so that drift in the
    machine's speed falls on both), timed and printed; returns each arm's wall times and its last result."""
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    results: dict = {}
    for r in range(repeat):
        for arm in arms:
            t0 = time.perf_counter()
            results[arm] = run(arm, r)
            times[arm].append(time.perf_counter() - t0)
            print(f"{arm}, run {r + 1}: {times[arm][-1]:.1f} s", flush=True)
    return times, results


def report_arms(times: dict[str, list[float]], width: int) -> dict[str, float]:
    """Print each arm's median wall time and its runs, one line an arm; returns the medians."""
    medians = {arm: statistics.median(ts) for arm, ts in times.items()}
    for arm, ts in times.items():
        print(f"  {arm:{width}s} median {medians[arm]:6.1f} s  ({', '.join(f'{t:.1f}' for t in ts)})")
    return medians


def share(k: int, n: int) -> str:
    """``k/n [lo, hi]``: a share with its 95% Clopper-Pearson interval (valid for a fixed number of
    trials, as a benchmark runs), or ``- (n=0)``."""
    if not n:
        return "- (n=0)"
    lo, hi = proportion_ci(k, n, method="exact")
    return f"{k}/{n} [{lo:.2f}, {hi:.2f}]"


def template_bench(doc: str, add_options) -> tuple[argparse.Namespace, object, object]:
    """The start of a benchmark on a calibration template: ``--model``, ``--dtype`` and ``--spec`` (the 1.5B
    and the refund template by default) and the options ``add_options(parser)`` adds; then gradients off, the
    CPU line printed, the model loaded and the spec read. Returns (args, the loaded model, the spec)."""
    import torch

    from kvprobe.calibrate.spec import load_spec
    from kvprobe.hardware import cpu_line
    from kvprobe.models import load_model

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--spec", default="examples/calibrate-refund-clear.yaml")
    add_options(ap)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    print(cpu_line())
    return args, load_model(args.model, dtype=args.dtype), load_spec(args.spec)
