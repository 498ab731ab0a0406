"""Issue 51's count of the experiment sequence, at a git revision: where each of its steps is called outside
the harness's own modules, and which modules still write the sequence themselves.

    python scripts/harness_count.py 08880c5 HEAD

The sequence (the issue's): ResultsFolder -> check -> load_cases -> check_case_ids -> require_answers -> load ->
align_all -> precheck_cases -> claim -> parts().map -> collect -> write(manifest) -> write_summary. A call is
found by its name in the module's syntax tree (``x.claim(...)`` counts as ``claim``); a module "writes the
sequence" when it calls at least three of the steps itself. Printed per revision: the modules that do, with the
steps they call and the lines of the functions that call them, then the totals.
"""

from __future__ import annotations

import ast
import subprocess
import sys

STEPS = ("ResultsFolder", "check_claim", "claim_folder", "load_cases", "check_case_ids", "require_answers",
         "align_all", "precheck_cases", "claim", "claim_inputs", "claim_identity", "collect", "write_summary")
HOMES = ("src/kvprobe/results.py", "src/kvprobe/experiment.py", "src/kvprobe/files.py")


def files_at(rev: str) -> list[str]:
    out = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "src/kvprobe"], capture_output=True,
                         text=True, check=True).stdout.split()
    return [f for f in out if f.endswith(".py")]


def source(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout


def steps_in(text: str) -> tuple[dict[str, int], int]:
    """Calls per step, and the lines of the functions (outermost) that make any of them."""
    tree = ast.parse(text)
    calls: dict[str, int] = {}
    lines = 0
    for top in ast.walk(tree):
        if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        found = False
        for node in ast.walk(top):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name in STEPS:
                    calls[name] = calls.get(name, 0) + 1
                    found = True
        if found:
            lines += top.end_lineno - top.lineno + 1
    return calls, lines


def report(rev: str) -> tuple[int, int, int]:
    copies = sites = harness_lines = 0
    print(f"== {rev}")
    for path in files_at(rev):
        if path in HOMES:
            continue
        calls, lines = steps_in(source(rev, path))
        n = sum(calls.values())
        sites += n
        if len(calls) >= 3:
            copies += 1
            harness_lines += lines
            print(f"  {path}: {len(calls)} steps ({', '.join(sorted(calls))}), {lines} lines in the functions "
                  f"that call them")
    print(f"  modules writing the sequence: {copies}; their functions' lines: {harness_lines}; "
          f"call sites of a step outside the harness: {sites}")
    return copies, harness_lines, sites


if __name__ == "__main__":
    for rev in sys.argv[1:] or ["HEAD"]:
        report(rev)
