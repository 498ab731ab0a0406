"""Write the reference tables that ``tests/unit/test_same_tables.py`` holds every later version to.

    PYTHONPATH=<a checkout>/src python scripts/golden_tables.py tests/data/golden
    PYTHONPATH=<a checkout>/src python scripts/golden_tables.py OUT --only qwen2.5-0.5b   # a real model
    python scripts/golden_tables.py OUT --other-float-order   # as another CPU would compute them

Runs ``kvprobe run`` for each configuration in :data:`CONFIGS` (tiny and toy models: every probe,
the default strategies, a K sweep) and keeps each run's tables (parquet) under OUT/<name>/. The
tables in the repository were written by commit c1257f3, before issue 20 batched and shared the
run's forward passes, so the test shows the faster run computes the same tables.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

CONFIGS = {
    # random weights: every aligned case, so every probe and strategy runs
    "tiny-llama": dict(model="tiny-llama", n=4, valid_only=False, ks=[1, 2, 4]),
    # a model that decides: valid cases only, the default strategies and K sweep
    "toy-qwen2": dict(model="toy-qwen2", n=6, ks=[1, 2, 4, 8]),
}
# compared by hand (issue 20's note), not by the test: a bundled real model, five cases
REAL = {"qwen2.5-0.5b": dict(model="qwen2.5-0.5b", n=5, valid_only=False)}


def run_config(name: str, out: Path) -> Path:
    """Run one configuration into ``out`` (a fresh folder); returns it."""
    from kvprobe.config import RunConfig
    from kvprobe.pipeline import run

    run(RunConfig(**{**CONFIGS, **REAL}[name]), out)
    return out


@contextmanager
def other_float_order():
    """Runs inside compute in another float order, as another CPU's kernels would: transformers'
    own eager attention (``repeat_kv``, then one matmul per head group) instead of kvprobe's grouped
    kernel, on one torch thread. It moves the toy's tables the way a Zen 3 did (issue 36)."""
    import torch

    import kvprobe.models.load as load

    saved, threads = load.use_grouped, torch.get_num_threads()
    load.use_grouped = lambda model: None
    torch.set_num_threads(1)
    try:
        yield
    finally:
        load.use_grouped = saved
        torch.set_num_threads(threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", help=f"one configuration: {', '.join([*CONFIGS, *REAL])} (default: the test's)")
    ap.add_argument("--other-float-order", action="store_true", help="compute as another CPU would (see other_float_order)")
    args = ap.parse_args()
    for name in [args.only] if args.only else CONFIGS:
        with tempfile.TemporaryDirectory() as tmp, other_float_order() if args.other_float_order else nullcontext():
            folder = run_config(name, Path(tmp) / name)
            dest = args.out / name
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            for table in sorted(folder.glob("*.parquet")):
                shutil.copy(table, dest / table.name)
            print(f"{name}: {len(list(dest.glob('*.parquet')))} tables -> {dest}")


if __name__ == "__main__":
    main()
