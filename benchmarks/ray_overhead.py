"""Ray's overhead: `kvprobe edit`'s cases per second, serial against Ray workers, side by side in one run.

For each model, the same N generated cases through ``run_edits`` (every default strategy, no parts
kept) by: serial on 1 torch thread, serial on 2, Ray with 1 worker and with 2 workers (each worker
1 torch thread), in that order and on the same local Ray (started once, 127.0.0.1). Prints each
configuration's seconds, cases per second, the workers' start-up (Ray up and every worker's model
loaded and fingerprinted, paid once per command) separately, and the ratios to serial on 1 thread;
the overhead per case is Ray-1-worker minus serial-1-thread, per case. Checks that every
configuration gave the same table (compare_runs' noise bound). Never part of the tests.

    python benchmarks/ray_overhead.py --models toy-qwen2,qwen2.5-0.5b --n 12
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from kvprobe.datasets import generate  # noqa: E402
from kvprobe.editor.runner import run_edits  # noqa: E402
from kvprobe.executor import RayExecutor, Serial  # noqa: E402
from kvprobe.hardware import cpu_line  # noqa: E402
from kvprobe.models import load_model  # noqa: E402

NOISE = 1e-4  # scripts/compare_runs.py's bound on float order


def timed_edits(lm, cases, executor) -> tuple[pd.DataFrame, float]:
    start = time.perf_counter()
    df, _ = run_edits(lm, cases, ["stale", "field_only", "selective:8:attention", "cacheblend:0.15", "erratum",
                                  "field_erratum", "hoist", "oracle"], executor=executor)
    return df, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="toy-qwen2,qwen2.5-0.5b")
    ap.add_argument("--n", type=int, default=12, help="cases per configuration")
    args = ap.parse_args()
    import ray

    torch.set_grad_enabled(False)
    print(cpu_line())
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR, object_store_memory=256 * 2**20)
    cases = generate(args.n, seed=0)
    rows = []
    for spec in args.models.split(","):
        lm = load_model(spec)
        results = {}
        for name, threads, workers in (("serial, 1 thread", 1, 0), ("serial, 2 threads", 2, 0),
                                       ("ray, 1 worker", 1, 1), ("ray, 2 workers", 1, 2)):
            torch.set_num_threads(threads)
            if workers:
                ex = RayExecutor(workers=workers, threads_per_worker=1)
                start = time.perf_counter()
                ex._start(lm)  # the workers up and holding the model: once per command
                setup = time.perf_counter() - start
                df, seconds = timed_edits(lm, cases, ex)
                ex.close()
            else:
                setup = 0.0
                df, seconds = timed_edits(lm, cases, Serial())
            results[name] = df
            rows.append({"model": spec, "configuration": name, "cases": len(cases), "setup_s": setup,
                         "seconds": seconds, "cases_per_s": len(cases) / seconds})
            print(f"{spec:<14} {name:<18} n={len(cases)} {seconds:7.1f} s  {len(cases) / seconds:6.3f} cases/s  "
                  f"(start-up {setup:.1f} s)", flush=True)
        base = results["serial, 1 thread"]
        for name, df in results.items():
            diff = np.abs(df.m.to_numpy(float) - base.m.to_numpy(float))
            same = df[["case_id", "strategy", "agree"]].equals(base[["case_id", "strategy", "agree"]])
            print(f"  {name:<18} same table as serial-1-thread: {same and np.nanmax(diff) <= NOISE} "
                  f"(largest |m| difference {np.nanmax(diff):.2g})")
        torch.set_num_threads(2)
    ray.shutdown()
    table = pd.DataFrame(rows)
    print("\nside by side (ratios to serial on 1 thread, the same model; start-up not included):")
    for spec, g in table.groupby("model", sort=False):
        one = g[g.configuration == "serial, 1 thread"].iloc[0]
        for r in g.itertuples():
            ratio = r.cases_per_s / one.cases_per_s
            print(f"  {spec:<14} {r.configuration:<18} {r.cases_per_s:6.3f} cases/s  x{ratio:4.2f}"
                  f"  start-up {r.setup_s:5.1f} s")
        ray1 = g[g.configuration == "ray, 1 worker"].iloc[0]
        print(f"  {spec:<14} Ray's overhead per case: {1000 * (ray1.seconds - one.seconds) / one.cases:+.0f} ms "
              f"(1 worker against serial, both 1 thread; a case takes {1000 * one.seconds / one.cases:.0f} ms)")


if __name__ == "__main__":
    main()
