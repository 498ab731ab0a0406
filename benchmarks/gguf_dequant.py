"""The first fetch of a bundled model: dequantising its GGUF into a float32 folder, with the header
parsed once (`kvprobe.models.bundled._one_header_parse`, what `kvprobe models fetch` does) against
parsed three times (transformers' own way: config, tokenizer and weights each read the file).

    .venv/bin/python benchmarks/gguf_dequant.py --model gemma3-270m --repeat 2

The GGUF is assembled first (downloaded once into $KVPROBE_HOME/downloads); each arm then writes
a folder under a temporary directory, the arms alternate, and the two folders are compared byte
for byte. Prints the CPU, each arm's wall times and the median ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import tempfile
from pathlib import Path

from common import alternate, report_arms
from kvprobe.hardware import cpu_line
from kvprobe.models import bundled


def folder_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m", choices=sorted(bundled.BUNDLED))
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    print(cpu_line(), flush=True)
    b = bundled.BUNDLED[args.model]
    gguf = bundled.assemble_gguf(b, progress=lambda s: print(s, flush=True))
    once = bundled._one_header_parse
    arms = {"parsed once": once, "parsed three times": contextlib.nullcontext}
    with tempfile.TemporaryDirectory() as tmp:
        def run(arm: str, r: int) -> Path:
            out = Path(tmp) / f"{arm.replace(' ', '-')}-{r}"
            bundled._one_header_parse = arms[arm]
            try:
                bundled.dequantize_to_folder(gguf, out, b.model_class)
            finally:
                bundled._one_header_parse = once
            return out

        times, outs = alternate(arms, args.repeat, run)
        digests = {arm: folder_digest(out) for arm, out in outs.items()}  # each arm's last folder
    same = len({tuple(d.items()) for d in digests.values()}) == 1
    print(f"\n{args.model}: n={args.repeat} runs per arm, alternating")
    medians = report_arms(times, 20)
    ratio = medians["parsed three times"] / medians["parsed once"]
    print(f"  parsed once is {ratio:.2f}x faster; the two folders are {'identical' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
