"""vLLM's CPU server with its engine in one process (``kvprobe serve start --one-process``,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) against vLLM's default engine-core and worker processes,
side by side: start-up, the serving benchmark's uncached arm (``edit_unique``: a full prefill each)
and a cached arm (``unchanged``), and the machine's CPU seconds over each (from /proc/stat: the
multiprocess engine's worker spins on a core between messages).

    .venv/bin/python benchmarks/vllm_one_process.py --repeat 2
    .venv/bin/python benchmarks/vllm_one_process.py --compiled    # without --enforce-eager (starts take minutes)

Needs `kvprobe serve setup` done and no kvprobe server running. The arms alternate, each starting
its own server and stopping it; every request of both must succeed with the same hit rates (the same
prompts, the same prefix cache). Prints the CPU, each arm's figures per run, the medians and the
ratios (multiprocess / one process). Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd

from kvprobe.hardware import cpu_line
from kvprobe.serving import measure, server
from kvprobe.serving.bench import Bench, BenchConfig

ARMS = {"multiprocess": False, "one process": True}


def busy_cpu_s() -> float:
    """The whole machine's busy CPU seconds so far (Linux)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def one_run(model: str, one_process: bool, eager: bool, n: int, out: Path) -> dict:
    cpu0, t0 = busy_cpu_s(), time.monotonic()
    state = server.start(model, owner="benchmark", eager=eager, one_process=one_process)
    start_s = time.monotonic() - t0
    try:
        cfg = BenchConfig(model=model, rates=[math.inf], n=n, max_s=600, arms=["unchanged", "edit_unique"])
        t1 = time.monotonic()
        df = pd.read_parquet(Bench(cfg, state.url, out).run())
        bench_s = time.monotonic() - t1
    finally:
        server.stop(state)
    if not df["ok"].all():
        raise SystemExit(f"a request failed: {df.loc[~df['ok']].iloc[0].to_dict()}")
    s = measure.summarize(df).set_index("arm")
    return {"start_s": start_s, "bench_s": bench_s, "cpu_s": busy_cpu_s() - cpu0,
            "uncached_req_per_s": float(s.loc["edit_unique", "throughput"]),
            "uncached_ttft_p50": float(s.loc["edit_unique", "ttft_p50"]),
            "cached_ttft_p50": float(s.loc["unchanged", "ttft_p50"]),
            "hit_rates": (round(float(s.loc["unchanged", "hit_rate_metrics"]), 3),
                          round(float(s.loc["edit_unique", "hit_rate_metrics"]), 3))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--n", type=int, default=12, help="requests per arm of the benchmark")
    ap.add_argument("--compiled", action="store_true", help="no --enforce-eager (torch.compile at each start)")
    args = ap.parse_args()
    print(cpu_line(), flush=True)
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            for arm, one in ARMS.items():
                got = one_run(args.model, one, not args.compiled, args.n, Path(tmp) / f"{r}-{one}")
                runs[arm].append(got)
                print(f"{arm}, run {r + 1}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in got.items()), flush=True)
    hits = {tuple(x["hit_rates"]) for arm in ARMS for x in runs[arm]}
    print(f"hit rates (unchanged, edit_unique) over every run: {sorted(hits)}")
    keys = ("start_s", "bench_s", "cpu_s", "uncached_req_per_s", "uncached_ttft_p50", "cached_ttft_p50")
    med = {arm: {k: statistics.median(x[k] for x in runs[arm]) for k in keys} for arm in ARMS}
    mode = "compiled" if args.compiled else "eager"
    print(f"medians over {args.repeat} run(s) an arm, {args.model}, {mode}, {args.n} requests an arm:")
    print(f"  {'':22s} {'multiprocess':>13s} {'one process':>12s} {'ratio':>7s}")
    for k in keys:
        a, b = med["multiprocess"][k], med["one process"][k]
        print(f"  {k:22s} {a:13.2f} {b:12.2f} {a / b if b else float('nan'):7.2f}")


if __name__ == "__main__":
    main()
