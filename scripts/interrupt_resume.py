"""Ctrl-C a `kvprobe run` in two stages, resume it, and compare its tables with an uninterrupted run.

    python scripts/interrupt_resume.py [--model toy-qwen2] [--n 40] [--seed 0] [--stages locality,edits]

Runs the command once uninterrupted, then into a second folder: for each stage, sends SIGINT once
that stage has saved three case parts and checks exit code 130 and the one-line message; then
reruns the same command to the end and compares every table of the two folders (timing columns
aside, via compare_runs.py). Exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compare_runs import TIMING, compare

MESSAGE = "interrupted; finished work is saved: rerun the same command to resume"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="toy-qwen2")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", default="locality,edits")
    args = ap.parse_args()
    kvprobe = [sys.executable, "-c", "from kvprobe.cli.app import main; main()", "run", "--model", args.model,
               "--n", str(args.n), "--seed", str(args.seed), "--no-report"]
    scratch = Path(tempfile.mkdtemp(prefix="kvprobe-interrupt-"))
    full, resumed = scratch / "full", scratch / "resumed"
    failed = False
    try:
        subprocess.run([*kvprobe, "--out", str(full)], check=True, capture_output=True)
        for stage in args.stages.split(","):
            proc = subprocess.Popen([*kvprobe, "--out", str(resumed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            parts = resumed / "parts" / stage
            while not (parts.exists() and len(list(parts.glob("*.parquet"))) >= 3):
                if proc.poll() is not None:
                    sys.exit(f"the run ended before {stage} saved three parts")
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate()
            last = stderr.strip().splitlines()[-1]
            ok = proc.returncode == 130 and last == MESSAGE and "Traceback" not in stderr
            failed |= not ok
            print(f"SIGINT in {stage}: exit {proc.returncode}, last line {last!r} ({'ok' if ok else 'NOT OK'})")
        rerun = subprocess.run([*kvprobe, "--out", str(resumed)], capture_output=True, text=True)
        print(f"resumed: exit {rerun.returncode}")
        lines = compare(full, resumed, set(TIMING))
        print("\n".join(lines))
        failed |= rerun.returncode != 0 or any(line.startswith("DIFF") for line in lines)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
