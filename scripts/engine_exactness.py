"""The exactness table of the in-engine repair (docs/serving.md): llama.cpp's own cache, edited in place,
against kvprobe's repairs of the same cases.

    python scripts/engine_exactness.py --model smollm2-135m --n 6
    python scripts/engine_exactness.py --model qwen2.5-0.5b --n 6 --precision served

``--precision exact`` (the default): the bundled GGUF dequantised to float32 (the weights kvprobe's
model folder holds), a float32 cache and attention in float32. ``served``: the GGUF as shipped
(quantised), llama.cpp's float16 cache and its own choice of attention kernel, as the agent workload
serves it. Cases: kvprobe's generated cases (seed 0). Prints one Markdown row per comparison: the
largest |logit difference| over the vocabulary and the cases, and on how many cases the decision agreed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a bundled alias")
    parser.add_argument("--n", type=int, default=6, help="generated cases (seed 0)")
    parser.add_argument("--k", type=int, default=4, help="the selective repair's K")
    parser.add_argument("--precision", choices=("exact", "served"), default="exact")
    parser.add_argument("--threads", type=int, default=2)
    opts = parser.parse_args()

    from kvprobe.datasets.generate import generate
    from kvprobe.editor.runner import align_all
    from kvprobe.hardware import cpu_line
    from kvprobe.models import bundled
    from kvprobe.models.load import load_model
    from kvprobe.serving.engine_check import exactness
    from kvprobe.serving.llamacpp import Engine, float32_of

    exact = opts.precision == "exact"
    gguf = float32_of(opts.model) if exact else bundled.gguf_file(opts.model)
    lm = load_model(opts.model)
    aligned, skipped = align_all(lm, generate(opts.n, seed=0))
    start = time.perf_counter()
    with Engine(gguf, n_ctx=4096, sessions=2, threads=opts.threads, kv="f32" if exact else "f16",
                flash_attn=False if exact else None) as engine:
        df = exactness(lm, engine, aligned, k=opts.k, on_case=lambda: print(".", end="", file=sys.stderr, flush=True))
    print(file=sys.stderr)
    what = ("float32 GGUF (dequantised), float32 cache, attention in float32" if exact
            else f"{gguf.name} as shipped, float16 cache, llama.cpp's attention kernel")
    print(f"{opts.model}: {what}; {len(aligned)} cases ({len(skipped)} skipped), "
          f"{time.perf_counter() - start:.0f} s; {cpu_line()}\n")
    print("| edit | repair | compared | tokens recomputed (mean) | max abs dlogit | same decision |")
    print("|---|---|---|---:|---:|---:|")
    for (edit, repair, compared), g in df.groupby(["edit", "repair", "compared"], sort=False):
        print(f"| {edit} | {repair} | {compared} | {g.tokens_recomputed.mean():.1f} | "
              f"{g.max_abs_dlogit.max():.2g} | {int(g.same_decision.sum())}/{len(g)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
