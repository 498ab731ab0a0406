"""Train every toy family on several seeds and tabulate the held-out figures (docs/toys.md).

    python scripts/toy_seeds.py --seeds 0,1,2 --out results/toy-seeds --workers 2 --save-seed 0
    python scripts/toy_seeds.py --seeds 0,1,2 --out results/toy-seeds --ship    # then: copy seed 0 into the package

Each (family, seed) run writes ``<out>/<family>-s<seed>.json`` (the training manifest) as it ends,
so an interrupted run resumes where it stopped; ``--save-seed S`` also keeps that seed's model
folders under ``<out>/toy-<family>/``. The table (held-out figures, the smallest margin over the
thresholds, failures against today's :data:`~kvprobe.toys.evaluate.THRESHOLDS`) goes to
``<out>/table.md``. ``--ship`` copies the saved seed-0 folders to ``src/kvprobe/models/toys/``
(what ``toy-<family>`` loads), with ``heldout_failures`` judged by today's thresholds. Runs are
deterministic per CPU type; wall times are noisy when two run at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

COLUMNS = ["acc_old", "acc_new", "acc_erratum", "acc_erratum_short", "inv_control_value", "inv_control_added",
           "inv_control_removed", "acc_long", "acc_unseen"]


def train_one(family: str, seed: int, out: str, save: bool) -> str:
    from kvprobe.toys.train import save_toy, train_toy

    result = train_toy(family, seed=seed, save=False)
    if save:
        save_toy(result.model, result.tokenizer, result.manifest, Path(out) / f"toy-{family}")
    path = Path(out) / f"{family}-s{seed}.json"
    path.write_text(json.dumps(result.manifest, indent=2))
    return str(path)


def table(out: Path, families: list[str], seeds: list[int]) -> str:
    from kvprobe.toys.evaluate import THRESHOLDS, threshold_failures

    head = ["toy", "seed", *COLUMNS, "min margin", "train s", "failures"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fam in families:
        for s in seeds:
            p = out / f"{fam}-s{s}.json"
            if not p.exists():
                continue
            m = json.loads(p.read_text())
            h = m["heldout"]
            margin = min(h[k] - v for k, v in THRESHOLDS.items())
            lines.append("| " + " | ".join([f"toy-{fam}", str(s), *(f"{h[c]:.3f}" for c in COLUMNS), f"{margin:+.3f}",
                                            str(m["train_wall_s"]), "; ".join(threshold_failures(h)) or "-"]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--families", default="llama,qwen2,qwen3,mistral,gemma2,gemma3")
    ap.add_argument("--out", default="results/toy-seeds")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--save-seed", type=int, default=None, help="keep this seed's model folders")
    ap.add_argument("--ship", action="store_true", help="copy the saved folders into the package")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    families = args.families.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = [(f, s) for s in seeds for f in families if not (out / f"{f}-s{s}.json").exists()]
    print(f"{len(todo)} runs to do ({len(seeds) * len(families) - len(todo)} already done)", flush=True)
    with ProcessPoolExecutor(args.workers) as pool:
        futures = {pool.submit(train_one, f, s, str(out), s == args.save_seed): (f, s) for f, s in todo}
        for fut in as_completed(futures):
            print(f"done toy-{futures[fut][0]} seed {futures[fut][1]}: {fut.result()}", flush=True)
    (out / "table.md").write_text(table(out, families, seeds))
    sys.stdout.write((out / "table.md").read_text())
    if args.ship:
        for fam in families:
            print(f"shipped {ship(out / f'toy-{fam}')}")


def ship(folder: Path) -> Path:
    """Copy a saved toy folder into the package, failures judged by today's thresholds."""
    import shutil

    from kvprobe.models import toy_folder
    from kvprobe.toys.evaluate import threshold_failures

    manifest = toy_folder.read_manifest(folder)
    manifest["heldout_failures"] = threshold_failures(manifest["heldout"])
    if manifest["heldout_failures"]:
        raise SystemExit(f"{folder} fails {manifest['heldout_failures']}: not shipped")
    dest = toy_folder.shipped_dir(manifest["family"])
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        if (folder / name).exists():
            shutil.copyfile(folder / name, dest / name)
    (dest / toy_folder.TOY_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


if __name__ == "__main__":
    main()
