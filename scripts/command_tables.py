"""Every results-writing command on toys and tiny models, run into one folder, and two such folders compared:
the proof that a behaviour-preserving refactor of the harness keeps each command's tables and files.

    python scripts/command_tables.py run DIR            # each command of COMMANDS into DIR/<name>
    python scripts/command_tables.py compare OLD NEW    # exits 1 if any command's tables or files differ
    python scripts/command_tables.py compare OLD NEW --renamed   # OLD made before the schema-2 renames

``run`` calls the ``kvprobe`` of this interpreter (``PYTHONPATH=/tmp/old/src`` runs an older checkout's);
a command that exits non-zero is recorded (its exit code is compared too: ``weight-edit`` on a toy may
find no valid case). ``compare`` runs ``scripts/compare_runs.py`` on each pair of folders (every parquet
table, timing columns aside) and compares every JSON and YAML file parsed, with clock readings (keys
ending in ``_s``, ``seconds``, a manifest's prefill-equivalents, durations in a sentence), package versions
and the folders' own paths masked. Tables are read under today's column names (compare_runs does:
:func:`kvprobe.tables.today_names`); ``--renamed`` renames the before side's JSON keys the same way
(:data:`RENAMED_KEYS`) and carries its summary's version.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "from kvprobe.cli.app import main; main()"]
COMMANDS = {
    "run": ["run", "--model", "toy-qwen2", "--n", "8", "--compose", "2", "--no-report"],
    "edit": ["edit", "--model", "toy-qwen2", "--n", "8"],
    "validate": ["validate", "--model", "toy-llama", "--n", "10"],
    "calibrate": ["calibrate", "examples/calibrate-toy.yaml", "--model", "toy-qwen2", "--max-pairs", "3"],
    "memory": ["memory", "--model", "toy-qwen2", "--n", "4"],
    "memory-policy": ["memory", "--model", "toy-qwen2", "--n", "4", "--policy-users", "2"],
    "weight-edit": ["weight-edit", "--model", "toy-qwen2", "--n", "4"],
    "sweep": ["sweep", "--model", "toy-qwen2", "--n", "1", "--valid", "1", "--filler-tokens", "0", "--no-report"],
}
# clock readings and what is computed from them: a manifest's prefill-equivalents are time ratios
MASKED = {"versions", "seconds", "created", "kvprobe_version", "time", "timestamp", "prefill_equivalents"}
# ``compare --renamed``: what a rename of keys (tables schema 2, summary schema 6: a TOST's margin is
# equivalence_margin) changes in the files of a run made before it, applied to the before side
RENAMED_KEYS = {"memory_manifest.json": {"margin": "equivalence_margin"},
                "summary.json": {"margin": "equivalence_margin"}}
RENAMED_VERSIONS = {"kvprobe_summary": (5, 6)}
CLOCK = re.compile(r"\b\d+(\.\d+)? (ms|s)\b")  # "in 102 ms" in a headline sentence


def run(dest: Path, only: list[str]) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    codes = {}
    for name, args in COMMANDS.items():
        if only and name not in only:
            continue
        out = dest / name
        proc = subprocess.run([*CLI, *args, "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
        codes[name] = proc.returncode
        (dest / f"{name}.log").write_text(proc.stdout + proc.stderr)
        print(f"{name}: exit {proc.returncode}", flush=True)
    (dest / "exit_codes.json").write_text(json.dumps(codes, indent=2, sort_keys=True))
    return 0


def masked(value, root: str):
    if isinstance(value, dict):
        return {k: masked(v, root) for k, v in value.items() if k not in MASKED and not k.endswith("_s")}
    if isinstance(value, list):
        return [masked(v, root) for v in value]
    if isinstance(value, str):
        return CLOCK.sub("<t> \\2", value.replace(root, "<out>"))
    return value


def renamed(value, keys: dict):
    """``value`` with its keys renamed (``keys``) and its versions carried (:data:`RENAMED_VERSIONS`)."""
    if isinstance(value, dict):
        return {keys.get(k, k): (RENAMED_VERSIONS[k][1] if k in RENAMED_VERSIONS and v == RENAMED_VERSIONS[k][0]
                                 else renamed(v, keys)) for k, v in value.items()}
    if isinstance(value, list):
        return [renamed(v, keys) for v in value]
    return value


def files_equal(old: Path, new: Path, rename: bool = False) -> list[str]:
    said = []
    names, names_new = ({p.relative_to(d) for p in d.rglob("*")
                         if p.suffix in (".json", ".yaml") and "parts" not in p.parts} for d in (old, new))
    for rel in sorted(names ^ names_new):
        said.append(f"{rel}: only in {'before' if rel in names else 'after'}")
    for rel in sorted(names & names_new):
        load = json.loads if rel.suffix == ".json" else yaml.safe_load
        a = masked(load((old / rel).read_text()), str(old))
        if rename:
            a = renamed(a, RENAMED_KEYS.get(rel.name, {}))
        b = masked(load((new / rel).read_text()), str(new))
        if a != b:
            said.append(f"{rel}: differs at {', '.join(differences(a, b)[:6])}")
    return said


def differences(a, b, path: str = "") -> list[str]:
    """Where two parsed files differ: each key path, with both values where they are short."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if a == b:
        return []
    shown = f" ({a!r} -> {b!r})" if len(repr(a)) + len(repr(b)) < 80 else ""
    return [f"{path or '.'}{shown}"]


def compare(old: Path, new: Path, rename: bool = False) -> int:
    bad = 0
    codes_old = json.loads((old / "exit_codes.json").read_text())
    codes_new = json.loads((new / "exit_codes.json").read_text())
    for name in COMMANDS:
        if name not in codes_old or name not in codes_new:
            continue
        if codes_old[name] != codes_new[name]:
            print(f"{name}: exit {codes_old[name]} before, {codes_new[name]} after")
            bad += 1
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_runs.py"), str(old / name),
                               str(new / name)], capture_output=True, text=True)
        tables = [line for line in proc.stdout.splitlines() if line.strip()]
        files = files_equal(old / name, new / name, rename)
        print(f"{name}: {len(tables)} table(s) {'identical' if proc.returncode == 0 else 'DIFFER'}; "
              f"JSON/YAML files {'equal' if not files else 'DIFFER'}")
        for line in (tables if proc.returncode else []) + files:
            print(f"  {line}")
        bad += proc.returncode != 0 or bool(files)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("dest", type=Path)
    r.add_argument("--only", default="", help="comma-separated command names of COMMANDS")
    c = sub.add_parser("compare")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    c.add_argument("--renamed", action="store_true", help="the before side's keys renamed as RENAMED_KEYS says")
    args = ap.parse_args()
    if args.what == "run":
        return run(args.dest, [s for s in args.only.split(",") if s])
    return compare(args.old, args.new, args.renamed)


if __name__ == "__main__":
    sys.exit(main())
