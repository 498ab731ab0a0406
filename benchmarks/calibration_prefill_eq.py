"""A whole calibration's cost in prefill-equivalents per pair, per field, for finished calibrations side by side.

For each field of each folder: the seconds ``kvprobe calibrate`` spent on it (its manifest's ``fields``, every
candidate and every measure-back included) over its pairs, divided by one full prefill of a new prompt of that
field with its decision read (``calibrate_cost.full_prefill_s``), measured here on the field's first drawn pairs
(after one warm-up), once for all the folders. The folders must be calibrations of one spec, model and dtype
(their manifests say; refused otherwise), so every ratio shares one prefill. Run it where the calibrations ran
(the manifests name the spec by the path they were given).

    python benchmarks/calibration_prefill_eq.py before after --pairs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from calibrate_cost import full_prefill_s

from kvprobe.calibrate.engine import CALIBRATE_MANIFEST, _pairs, aligned_pair, load_spec
from kvprobe.errors import KvprobeError
from kvprobe.hardware import cpu_line
from kvprobe.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path, help="finished kvprobe calibrate --out folders")
    ap.add_argument("--pairs", type=int, default=5, help="full prefills timed per field (after one warm-up)")
    args = ap.parse_args()
    manifests = {f: json.loads((f / CALIBRATE_MANIFEST).read_text()) for f in args.folders}
    same = {(m["spec"], m["settings"]["model"], m["settings"]["dtype"], m["settings"]["seed"])
            for m in manifests.values()}
    if len(same) != 1:
        raise SystemExit(f"the folders calibrated different specs, models, dtypes or seeds: {sorted(same)}")
    spec_path, model, dtype, seed = same.pop()
    torch.set_grad_enabled(False)
    print(cpu_line())
    print(f"model={model} dtype={dtype} spec={spec_path} full prefills per field={args.pairs} (+1 warm-up)")
    lm, spec = load_model(model, dtype=dtype), load_spec(spec_path)
    width = max(len(str(f)) for f in args.folders)
    for name in spec.fields:
        times = []
        for _, (base, new) in _pairs(spec, name, seed, 4 * (args.pairs + 1)):
            try:
                a = aligned_pair(lm, spec, name, base, new)
            except KvprobeError:
                continue
            times.append(full_prefill_s(lm, a))
            if len(times) == args.pairs + 1:
                break
        prefill = statistics.median(times[1:])
        print(f"{name}: a full prefill and its read {prefill:.3f} s (median of {len(times) - 1})")
        for folder, m in manifests.items():
            f = m["fields"][name]
            per_pair = f["seconds"] / f["pairs"]
            print(f"  {str(folder):{width}s} {f['pairs']:4d} pairs {f['seconds']:7.1f} s  {per_pair:.3f} s a pair  "
                  f"{per_pair / prefill:.2f} prefill-equivalents")


if __name__ == "__main__":
    main()
