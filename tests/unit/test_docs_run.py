"""Every command and snippet of README.md and docs/*.md, run by a test (issue 31, "Docs that run").

Each fenced block of the docs is one test case. A ```bash block's commands (``\\`` continues a line;
a ``for`` loop up to ``done`` is one command) and the ``$ `` lines of a ```console block run in a
temporary folder that holds a copy of ``examples/`` and links to ``scripts/`` and ``benchmarks/``, with
the environment the test session has (``KVPROBE_HOME`` included); a ```python block is exec'd there.
``kvprobe`` commands run through the fork server of ``tests/cli_process.py``, like the CLI tests, and
so do ``python SCRIPT.py`` commands (``run_script``) unless they set a ``PYTHON*`` variable.

What happens to each command is written down in :data:`PLAN` and :data:`SNIPPETS`, and printed
(``pytest -rP tests/unit/test_docs_run.py`` shows the table):

- ``ran as written``: every ``kvprobe`` command on a tiny or toy model or none (``models``,
  ``datasets generate``, ``report`` ...), and any command :data:`PLAN` marks so; it must exit 0.
- ``swapped``: a command naming a real model or taking minutes runs with its model swapped for the
  toy of the same family and a small ``--n`` (or what the entry says); the command that ran is printed.
- ``parsed only``: a command that needs a GPU, a vLLM server, a fresh machine or hours; its
  ``kvprobe`` part is parsed by the CLI itself (click's ``make_context``: an unknown option or a bad
  value fails) and the scripts and example files it names must exist.

Every ``kvprobe`` command is parsed as written before it runs, swapped or not. Blocks in other
languages (``text``, ``json``, ``yaml``, ``html``) are formats and output, not commands; a fence with
no language, or a language not listed here, fails the test, as does a command the plan does not
know (anything but ``kvprobe ...``) and a ``kvprobe`` command that names a real model without an
entry in :data:`PLAN`. docs/extending.md's Python blocks are run by tests/unit/test_extending.py,
which this test checks reads exactly those blocks.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvprobe.hardware import native_bf16
from tests import cli_process

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
RUNNABLE = ("bash", "console", "python")
NOT_COMMANDS = {"text": "a layout or an output example", "json": "a data format", "yaml": "a file format",
                "html": "a template"}
RUN_N = "4"  # cases of the toy runs that stand in for long runs
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")


# -- the blocks ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence
    lang: str
    body: str
    heading: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks() -> list[Block]:
    """Every fenced block of README.md and docs/*.md, its body dedented to its fence."""
    out = []
    for doc in DOCS:
        lines, heading, i = (ROOT / doc).read_text().splitlines(), "", 0
        while i < len(lines):
            if lines[i].startswith("#") and not lines[i].startswith("#!"):
                heading = lines[i].lstrip("#").strip()
            m = FENCE.match(lines[i])
            if m:
                start, body = i, []
                i += 1
                while lines[i].strip() != "```":
                    body.append(lines[i])
                    i += 1
                out.append(Block(doc, start + 1, m["lang"], textwrap.dedent("\n".join(body)) + "\n", heading))
            i += 1
    return out


def commands(block: Block) -> list[str]:
    """The commands of a bash or console block, one string each: continuations joined (bash drops
    ``\\`` and the newline), comments and prompts dropped, whitespace collapsed."""
    text = block.body.replace("\\\n", "")
    if block.lang == "console":
        lines = [line[2:] for line in text.splitlines() if line.startswith("$ ")]
    else:
        lines = text.splitlines()
    out, loop = [], []
    for line in lines:
        line = " ".join(uncommented(line).split())
        if not line:
            continue
        if loop or line.startswith("for "):
            loop.append(line)
            if line == "done":
                out.append(" ".join(loop))
                loop = []
            continue
        out.append(line)
    assert not loop, f"{block.id}: a for loop without its done"
    return out


def uncommented(line: str) -> str:
    """``line`` up to its comment: a ``#`` outside quotes, at the start or after whitespace."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


# -- what happens to each command ------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """Ran as written; ``needs``: (path in the folder, what makes it) made before it runs."""

    note: str = ""
    needs: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Swap:
    """Ran with its model swapped and options set (an option given is replaced, else appended; None:
    a flag) and text replaced in its words, for ``why``; ``code`` and ``expect``: the exit code and a
    line the output must hold, where the swap cannot end in 0."""

    why: str
    model: str | None = None
    set: dict = field(default_factory=dict)
    replace: dict = field(default_factory=dict)
    needs: tuple[tuple[str, str], ...] = ()
    code: int = 0
    expect: str | None = None


@dataclass(frozen=True)
class Parse:
    """Parsed only (its kvprobe part by the CLI, the files it names checked), for ``why``."""

    why: str


SMALL_RUN = {"--n": RUN_N}
TINY_SWEEP = {"--n": "1", "--valid": "1", "--filler-tokens": "0"}
SLOW_SWEEP = "a sweep of 2-9 cells x 40-90 cases screened each on a real model: an hour or more on 2 cores"
CLUSTER = "a Ray cluster of several machines: tests/executor/test_ray.py runs a local one"
SLURM = "a Slurm job on GPU nodes"
VLLM = "needs vLLM's CPU build (3.4 GB, `kvprobe serve setup`) and a server: tests/serving/test_vllm.py runs it"
CALIBRATE_REAL = ("calibrating the 1.5B takes 10-20 min; toy-qwen2's tokenizer does not cover the template (26 of 104 "
                  "tokens [UNK], refused), so smollm2-135m with 2 pairs a field (bfloat16 where the CPU computes it "
                  "natively, else float32): the whole loop runs and ends in 'no verdict' (exit 1); a verdict takes "
                  "about 80 pairs")
NO_VERDICT = "no verdict within 2 pairs"
# The calibrate blocks load the 1.5B in bfloat16, the fast dtype where the CPU computes it natively. Swapped
# to smollm2-135m they keep it there; on a CPU without native bfloat16 (a Zen 1 or Zen 3) they run in float32,
# as a user of that CPU would: torch emulates bfloat16 there, and the three blocks took 4.5, 3.9 and 2.0 times
# their native time under torch's AVX2 kernels (docs/testing.md), time that tests torch's emulation, not the
# command. A bfloat16 load and decision is checked on every CPU by tests/models/test_devices.py, bfloat16 keys'
# rotation by tests/kv/test_rope.py.
CALIBRATE_DTYPE = {"--dtype": "bfloat16" if native_bf16() else "float32"}

ENGINE_1_5B = ("the 1.5B on llama.cpp, 4 arms x 100 turns: about 15 minutes; tests/serving/test_llamacpp.py runs "
               "the policy+edit arm and its state check on smollm2-135m's GGUF")
EXACTNESS = ("the exactness table: tests/serving/test_llamacpp.py checks the same comparisons on smollm2-135m's "
             "float32 GGUF")

# Keyed by the command as :func:`commands` writes it. A kvprobe command not here runs as written.
PLAN: dict[str, Run | Swap | Parse] = {
    # README.md
    "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/kvprobe run":
        Parse("sets a fresh machine up: this environment is that one; `kvprobe run` runs in `## kvprobe run`"),
    "(command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
    "chromium)) && python3 scripts/cpu.py && python3 -m venv .venv && CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF\" "
    ".venv/bin/pip install -q --no-compile -e '.[test,crosscheck,engine]' && PYTHONDONTWRITEBYTECODE= .venv/bin/pytest "
    "-q -n 2 --dist worksteal --durations=15":
        Parse("is the test suite itself (.ci/run), on a fresh machine"),
    "kvprobe models fetch smollm2-135m": Run("cached after the first fetch: a sha256 check"),
    "kvprobe run": Swap("sized by its rule: 222 cases, 30-60 s", set=SMALL_RUN),
    "kvprobe run --model qwen2.5-1.5b --n 60 --out results/qwen2.5-1.5b":
        Swap("the 1.5B: about a minute a valid case", model="toy-qwen2", set=SMALL_RUN),
    "kvprobe run --config examples/run.yaml --out results/run-yaml":
        Swap("sized by its rule (toy-qwen2, budget 300)", set=SMALL_RUN),
    "kvprobe run --model smollm2-135m --compose 50":
        Swap("probes and 50 compositions on a 135M model: minutes", model="toy-llama",
             set={**SMALL_RUN, "--compose": "2", "--out": "results/smollm2-135m"}),
    "kvprobe sweep --model qwen2.5-1.5b --layouts record,lines,json --filler-tokens 0,100,300 --n 40 --valid 20 "
    "--out results/sweep/qwen2.5-1.5b": Swap(SLOW_SWEEP, model="toy-qwen2", set=TINY_SWEEP),
    "kvprobe sweep --model toy-qwen2 --layouts record,lines,prose,json,yaml,chat_history,tool_spec "
    "--field-styles key,words": Swap("14 cells x 40 cases: minutes", set=TINY_SWEEP),
    "kvprobe diagnose examples/loan.txt --model qwen2.5-1.5b --field tier --value tier=gold --new silver "
    "--question \"Is the loan issued?\" --options yes,no": Swap("the 1.5B (9 GB)", model="toy-qwen2"),
    "kvprobe calibrate examples/calibrate-refund.yaml --model qwen2.5-1.5b --dtype bfloat16":
        Swap(CALIBRATE_REAL, model="smollm2-135m", set={"--max-pairs": "2", **CALIBRATE_DTYPE}, code=1,
             expect=NO_VERDICT),
    "kvprobe edit --model toy-qwen2 --n 40 --cot 0,32 --strategies "
    "stale,field_only,selective:8:attention,cacheblend:0.15,erratum,field_erratum,hoist,oracle":
        Swap("40 cases x 2 CoT settings: 35 s", set={"--n": "8"}),
    "kvprobe datasets show --index 3 --model smollm2-135m": Run("the tokenizer only"),
    "kvprobe datasets check --model qwen2.5-0.5b --n 40": Swap("80 prefills of the 0.5B", model="toy-qwen2",
                                                                 set=SMALL_RUN),
    "kvprobe validate --model smollm2-135m --n 50": Swap("50 queries x 7 seams x 2 on a 135M model: minutes",
                                                         model="toy-llama", set={"--n": "35"}),
    "python benchmarks/compose_ttft.py --model qwen2.5-0.5b":
        Swap("prompts of 512-8192 tokens on the 0.5B, twice each", model="toy-qwen2",
             set={"--lengths": "64,128", "--repeat": "1"}),
    "kvprobe serve setup": Parse(VLLM),
    "kvprobe serve-bench --model smollm2-135m --out results/serving-smollm2-135m": Parse(VLLM),
    "kvprobe report results/serving-smollm2-135m": Parse("its folder is the serve-bench's above"),
    "kvprobe serve start --model smollm2-135m": Parse(VLLM),
    "kvprobe serve-bench --model smollm2-135m --url http://127.0.0.1:PORT": Parse(VLLM),
    "kvprobe serve stop": Parse("stops the server `kvprobe serve start` started"),
    "kvprobe serve-bench --workload agent --model qwen2.5-1.5b --spec examples/calibrate-refund-clear.yaml "
    "--field-policy examples/policies/qwen2.5-1.5b-refund-clear.yaml --sessions 10 --turns 4 --rates 0.2,inf":
        Parse(VLLM),
    # docs/api.md
    "kvprobe diagnose examples/loan.txt --model qwen2.5-1.5b --field tier --value tier=gold --new silver,platinum "
    "--question \"Is the loan issued?\" --options yes,no": Swap("the 1.5B (9 GB)", model="toy-qwen2"),
    # docs/auto.md
    "kvprobe sweep --model qwen2.5-1.5b --layouts record,yaml --filler-tokens 0 --n 90 --valid 30 --controls 0.2 "
    "--seed 11 --time-all --out results/auto/qwen2.5-1.5b --strategies stale,field_only,selective:8:attention,"
    "cacheblend:0.15,erratum,field_erratum,erratum_turn,field_erratum_turn,auto,oracle":
        Swap(SLOW_SWEEP, model="toy-qwen2", set={"--n": "3", "--valid": "1"}),
    "python scripts/auto_table.py results/auto/qwen2.5-1.5b": Run("on the swapped sweep above"),
    "kvprobe diagnose examples/loan.txt --model qwen2.5-1.5b --field tier --value tier=gold --new silver,platinum "
    "--question \"Is the loan issued?\" --options yes,no --policy results/auto/policies/qwen2.5-1.5b.yaml":
        Swap("the 1.5B (9 GB); its policy is toy-qwen2's topk.yaml, exported from a toy run", model="toy-qwen2",
             needs=(("results/auto/policies/qwen2.5-1.5b.yaml", "topk.yaml of run toy-qwen2"),)),
    # docs/calibrate.md
    # (kvprobe calibrate examples/calibrate-toy.yaml runs as written: with fewer pairs no field reaches a verdict;
    # its qwen2.5-1.5b command is the README's)
    # docs/distributed.md
    "pip install 'kvprobe[ray]'": Parse("installs the extra; the test extra installed it here"),
    "kvprobe run --model toy-qwen2 --n 12 --executor ray --workers 2 --out results/ray-toy":
        Swap("a local Ray and two workers (10 s of start-up); 4 cases", set=SMALL_RUN),
    "kvprobe run --model toy-qwen2 --n 8 --no-report --out results/serial-toy": Swap("4 cases", set=SMALL_RUN),
    "kvprobe run --model toy-qwen2 --n 8 --no-report --out results/ray-toy2 --executor ray --workers 2":
        Swap("4 cases, as the serial run above", set=SMALL_RUN, expect="ray: 2 worker(s) on 1 node(s)"),
    "python scripts/compare_runs.py results/serial-toy results/ray-toy2 --atol 1e-4":
        Run("the two runs above: exits 1 if a table differs"),
    "ray start --head --port 6379": Parse(CLUSTER),
    "ray start --address HEAD_IP:6379": Parse(CLUSTER),
    "kvprobe calibrate examples/calibrate-refund.yaml --model qwen2.5-1.5b --executor ray --ray-address HEAD_IP:6379 "
    "--workers 8 --threads-per-worker 4": Parse(CLUSTER),
    'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)': Parse(SLURM),
    'srun --nodes=1 --ntasks=1 -w "$head" ray start --head --port 6379 --block &': Parse(SLURM),
    'srun --nodes=3 --ntasks=3 --exclude "$head" ray start --address "$head:6379" --block &': Parse(SLURM),
    'kvprobe run --model qwen2.5-1.5b --n 400 --executor ray --ray-address "$head:6379" --workers 16 '
    '--gpus-per-worker 1 --threads-per-worker 4 --out results/qwen2.5-1.5b-cluster': Parse(SLURM),
    # docs/edits.md
    "kvprobe run --model qwen2.5-0.5b --n 1000 --probes locality,attention --cot 0,48 --max-controls 12 "
    "--out results/qwen2.5-0.5b": Swap("1000 cases of the 0.5B: hours", model="toy-qwen2", set=SMALL_RUN),
    "kvprobe run --model qwen2.5-0.5b --n 1000 --probes locality,attention --cot 0 --max-controls 12 --min-flip 0.25 "
    "--out results/qwen2.5-0.5b-flip0.25": Swap("1000 cases of the 0.5B: hours", model="toy-qwen2", set=SMALL_RUN),
    # docs/perf.md
    "git worktree add /tmp/base c1257f3": Parse("adds a worktree of an old commit to the repository"),
    "PYTHONPATH=/tmp/base/src python benchmarks/run_case.py --model qwen2.5-1.5b --n 10 --json before.json":
        Swap("the 1.5B, 10 cases: 10 min; this checkout stands in for the old commit's worktree", model="toy-qwen2",
             set={"--n": "2", "--repeat": "1"}, replace={"PYTHONPATH=/tmp/base/src": None}),
    "python benchmarks/run_case.py --model qwen2.5-1.5b --n 10 --before before.json":
        Swap("the 1.5B, 10 cases: 10 min", model="toy-qwen2", set={"--n": "2", "--repeat": "1"}),
    "python benchmarks/read_cost.py --model qwen2.5-1.5b --dtype bfloat16 --batches 1,1,2,3,4,8 --repeat 3":
        Swap("the 1.5B: minutes", model="toy-qwen2", set={"--batches": "1,2", "--repeat": "1", **CALIBRATE_DTYPE}),
    "python benchmarks/read_cost.py --model qwen2.5-1.5b --dtype float32 --batches 1,1,2,3,4,8 --repeat 3":
        Swap("the 1.5B: minutes", model="toy-qwen2", set={"--batches": "1,2", "--repeat": "1"}),
    "python benchmarks/erratum_profile.py --model qwen2.5-1.5b --dtype float32 --pairs 3":
        Swap("the 1.5B: minutes; toy-qwen2's tokenizer does not cover the template", model="smollm2-135m",
             set={"--pairs": "1", "--repeat": "1"}),
    "python benchmarks/erratum_profile.py --model qwen2.5-1.5b --dtype bfloat16 --pairs 3":
        Swap("the 1.5B: minutes (bfloat16 where the CPU computes it natively, else float32)", model="smollm2-135m",
             set={"--pairs": "1", "--repeat": "1", **CALIBRATE_DTYPE}),
    "python benchmarks/suffix_batch.py --model qwen2.5-1.5b --dtype bfloat16 --batches 2,4,8":
        Swap("the 1.5B: minutes; toy-qwen2 on the toy spec, whose words its tokenizer covers", model="toy-qwen2",
             set={"--spec": "examples/calibrate-toy.yaml", "--batches": "2", "--repeat": "1", **CALIBRATE_DTYPE}),
    "python benchmarks/suffix_batch.py --model qwen2.5-1.5b --dtype float32 --batches 2,4,8":
        Swap("the 1.5B: minutes; toy-qwen2 on the toy spec, whose words its tokenizer covers", model="toy-qwen2",
             set={"--spec": "examples/calibrate-toy.yaml", "--batches": "2", "--repeat": "1"}),
    # docs/serving.md
    "kvprobe serve-bench --workload agent --model qwen2.5-1.5b --spec examples/calibrate-refund-clear.yaml "
    "--field-policy examples/policies/qwen2.5-1.5b-refund-clear.yaml --sessions 10 --turns 4 --rates 0.2,inf "
    "--out results/agent-qwen2.5-1.5b": Parse(VLLM),
    "kvprobe calibrate examples/agent-refund.yaml --model qwen2.5-1.5b --dtype bfloat16 --max-pairs 100 "
    "--out results/calibrate/agent-refund":
        Swap(CALIBRATE_REAL.replace("26 of 104", "many"), model="smollm2-135m",
             set={"--max-pairs": "2", **CALIBRATE_DTYPE}, code=1, expect=NO_VERDICT),
    "kvprobe serve-bench --workload agent --model qwen2.5-1.5b --spec examples/agent-refund.yaml "
    "--field-policy examples/policies/qwen2.5-1.5b-agent-refund.yaml --sessions 10 --turns 4 --rates 0.2,inf":
        Parse(VLLM),
    "CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF\" .venv/bin/pip install -e '.[engine]'":
        Parse("installs the extra; the test command installed it here"),
    "kvprobe serve-bench --workload agent --engine llama.cpp --model qwen2.5-1.5b --spec examples/agent-refund.yaml "
    "--field-policy examples/policies/qwen2.5-1.5b-agent-refund.yaml --sessions 10 --turns 10 --policy-tokens 0 "
    "--threads 2 --rates 0.2,inf --out results/agent-llamacpp-qwen2.5-1.5b":
        Parse(ENGINE_1_5B),
    "python scripts/engine_exactness.py --model smollm2-135m --n 6": Parse(EXACTNESS),
    "python scripts/engine_exactness.py --model qwen2.5-0.5b --n 6": Parse(EXACTNESS),
    "python scripts/engine_exactness.py --model smollm2-135m --n 6 --precision served": Parse(EXACTNESS),
    "kvprobe serve-bench --model smollm2-135m --out BEFORE": Parse(VLLM),
    "kvprobe serve-bench --model smollm2-135m --out AFTER": Parse(VLLM),
    "python scripts/serving_same_rows.py BEFORE AFTER": Parse("compares the two serve-bench folders above"),
    # docs/summary.md
    "kvprobe compare results/run/toy-qwen2 results/run/toy-llama results/run/qwen2.5-1.5b --csv compare.csv "
    "--json compare.json --html compare.html":
        Run("on toy runs (--n 4); results/run/qwen2.5-1.5b is a toy-qwen2 run",
            needs=(("results/run/toy-qwen2", "run toy-qwen2"), ("results/run/toy-llama", "run toy-llama"),
                   ("results/run/qwen2.5-1.5b", "run toy-qwen2"))),
    "kvprobe run --model toy-qwen2 --compose 20 --out results/run/toy-qwen2":
        Swap("sized by its rule: 222 cases, 30-60 s", set={**SMALL_RUN, "--compose": "2"}),
    "kvprobe run --model toy-llama --out results/run/toy-llama": Swap("sized by its rule: 30-60 s", set=SMALL_RUN),
    "cp results/run/<model>/summary.json docs/summaries/<model>.summary.json":
        Swap("<model> is a placeholder", replace={"<model>": "toy-qwen2"}),
    # docs/sweep.md
    "kvprobe sweep --model qwen2.5-1.5b --layouts record,lines,json --filler-tokens 0,100,300 --n 40 --valid 20 "
    "--strategies stale,field_only,erratum,erratum_turn,field_erratum,cacheblend:0.15,oracle "
    "--out results/sweep/qwen2.5-1.5b": Swap(SLOW_SWEEP, model="toy-qwen2", set=TINY_SWEEP),
    ".venv/bin/python scripts/sweep_table.py results/sweep/qwen2.5-1.5b": Run("on the swapped sweep above"),
    "kvprobe sweep --model qwen2.5-0.5b --layouts record,lines,json,chat_history --filler-tokens 0,100,300 --n 16 "
    "--strategies stale,field_only,erratum,erratum_turn,field_erratum,cacheblend:0.15,oracle "
    "--out results/sweep/qwen2.5-0.5b": Swap(SLOW_SWEEP, model="toy-qwen2", set=TINY_SWEEP),
    "for f in llama qwen2 qwen3 gemma2 gemma3 mistral; do kvprobe sweep --model toy-$f --layouts "
    "record,lines,json,chat_history --filler-tokens 0,100,300 --n 20 --strategies "
    "stale,field_only,erratum,erratum_turn,field_erratum,cacheblend:0.15,oracle --out results/sweep/toy-$f done":
        Parse("six toys x 12 cells x 20 cases: about 20 min; the 1.5B's sweep above runs swapped on toy-qwen2"),
    ".venv/bin/python scripts/sweep_toy_table.py": Parse("reads the six toy sweeps of the loop above"),
    ".venv/bin/python scripts/sweep_table.py results/sweep/toy-qwen2": Parse("reads a sweep of the loop above"),
    # docs/weight-edit.md
    "kvprobe weight-edit --model toy-qwen2 --n 40 --out results/weight-edit/toy-qwen2":
        Swap("40 cases, each with a LoRA fitted: 10-20 s alone, minutes on shared cores", set=SMALL_RUN),
    "kvprobe weight-edit --model toy-llama --n 40 --out results/weight-edit/toy-llama":
        Swap("40 cases, each with a LoRA fitted: 10-20 s alone, minutes on shared cores", set=SMALL_RUN),
    # docs/memory.md
    "kvprobe memory --model toy-qwen2 --n 24 --out results/memory/toy-qwen2":
        Swap("24 questions, 9 arms each: about a minute on shared cores", set=SMALL_RUN),
    "kvprobe memory --model qwen2.5-0.5b --n 12 --out results/memory/qwen2.5-0.5b":
        Swap("a real model: 6 min on shared cores", model="toy-qwen2", set=SMALL_RUN),
    "kvprobe memory --model qwen2.5-1.5b --dtype bfloat16 --n 140 --policy-users 40 --threshold 0.8 "
    "--out results/memory/qwen2.5-1.5b":
        Swap("140 questions and a 40-user calibration on the 1.5B: an hour on 2 cores", model="toy-qwen2",
             set={**SMALL_RUN, "--policy-users": "2"}),
    # docs/toys.md
    "kvprobe toy eval --family qwen2": Swap("400 held-out cases: 100 s", set={"--n": "20"}),
    "kvprobe toy train --family qwen2": Swap("the recipe's steps and 400 held-out cases: minutes; into this folder's "
                                             "own KVPROBE_HOME", set={"--steps": "5", "--heldout": "20"}),
    "kvprobe run --model ~/.cache/kvprobe/models/toy-qwen2":
        Swap("the 5-step toy trained above (it fails its held-out check, hence --allow-failed-toy; it decides "
             "nothing, so the run ends in exit 1 before the probes)",
             replace={"~/.cache/kvprobe": "{home}"}, set={**SMALL_RUN, "--allow-failed-toy": None}, code=1,
             expect="the probes need a model that decides by the field"),
    "python scripts/toy_seeds.py --seeds 0,1,2 --out results/toy-seeds --workers 2 --save-seed 0":
        Parse("trains 18 toys (3 seeds x 6 families): hours"),
    "python scripts/toy_seeds.py --seeds 0,1,2 --out results/toy-seeds --ship":
        Parse("trains 18 toys and copies seed 0 into the package"),
}



@dataclass(frozen=True)
class Snippet:
    """A Python block: ``before`` runs first in its scope, ``replace`` edits its text, ``needs`` as for
    :class:`Run`, ``after`` checks its scope (``__body__`` is the block's text); ``why`` where it
    does not run as written."""

    why: str = ""
    before: str = ""
    replace: dict = field(default_factory=dict)
    needs: tuple[tuple[str, str], ...] = ()
    after: str = ""


# (doc, text the block holds, what to do); a Python block matched by none is exec'd as written
SNIPPETS: list[tuple[str, str, Snippet]] = [
    ("README.md", "ctx = kvprobe.EditableContext(lm)\n",
     Snippet(after="assert len(__body__.strip().splitlines()) <= 10")),
    ("README.md", "policy.load(", Snippet(
        "`lm` is the model of the run above it, and the 1.5B's run (results/qwen2.5-1.5b) is a toy-qwen2 run (--n 4)",
        before='from kvprobe.models import load_model\nlm = load_model("toy-qwen2")',
        needs=(("results/qwen2.5-1.5b", "run toy-qwen2"),))),
    ("README.md", "composer.compose(", Snippet(after="assert c.logits.shape[-1] == lm.model.config.vocab_size")),
    ("docs/calibrate.md", 'calibrate("toy-qwen2"', Snippet(
        after="assert len(cal.summary) and cal.policy")),
    ("docs/serving.md", "openai.OpenAI(", Snippet(
        "no vLLM here: a stand-in OpenAI-compatible server on 127.0.0.1 answers, and it must receive state.messages()",
        replace={"http://127.0.0.1:8000/v1": "{openai_url}"},
        after="assert __received__[-1]['messages'] == state.messages()")),
    ("docs/toys.md", "evaluate_toy(lm)", Snippet("400 held-out cases: 100 s; 20 here",
                                                 replace={"evaluate_toy(lm)": "evaluate_toy(lm, n=20)"})),
]
DELEGATED = {"docs/extending.md": "run by tests/unit/test_extending.py"}  # Python blocks run by another test


def snippet_plan(block: Block) -> Snippet:
    found = [s for doc, marker, s in SNIPPETS if doc == block.doc and marker in block.body]
    assert len(found) <= 1, f"{block.id}: {len(found)} entries of SNIPPETS match it"
    return found[0] if found else Snippet()


def command_plan(cmd: str) -> Run | Swap | Parse:
    if cmd in PLAN:
        return PLAN[cmd]
    words = shlex.split(cmd)
    assert words[0] == "kvprobe", f"a command this test does not know: {cmd!r}; add it to PLAN"
    model = option(words, "--model")
    assert model is None or model.startswith(("tiny-", "toy-")), \
        f"{cmd!r} names the model {model}: add it to PLAN (as written if it is cheap, else swapped)"
    return Run()


def option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def mode(plan) -> str:
    if isinstance(plan, Parse):
        return "parsed only"
    if isinstance(plan, Swap) or (isinstance(plan, Snippet) and plan.why):
        return "swapped"
    return "ran as written"


def swapped(cmd: str, plan: Run | Swap, home: Path) -> list[str]:
    """The words of ``cmd`` as it runs."""
    words = shlex.split(cmd)
    if isinstance(plan, Run):
        return words
    for old, new in plan.replace.items():
        words = [w for w in words if w != old] if new is None else [w.replace(old, new.format(home=home))
                                                                     for w in words]
    for name, value in (({"--model": plan.model} if plan.model else {}) | plan.set).items():
        if name in words and value is not None:
            words[words.index(name) + 1] = value
        elif name not in words:
            words += [name] if value is None else [name, value]
    return words


def table() -> list[tuple[Block, str, str, str]]:
    """(block, what, mode, detail) for every command and Python block; a block in another language is
    one row 'not a command'."""
    rows = []
    for block in blocks():
        if block.lang in NOT_COMMANDS:
            rows.append((block, block.lang, "not a command", NOT_COMMANDS[block.lang]))
        elif block.lang == "python" and block.doc in DELEGATED:
            rows.append((block, "python block", "delegated", DELEGATED[block.doc]))
        elif block.lang == "python":
            plan = snippet_plan(block)
            rows.append((block, "python block", mode(plan), plan.why))
        else:
            assert block.lang in RUNNABLE, f"{block.id}: a fenced block tagged {block.lang!r}; tag it with one " \
                                           f"of {RUNNABLE + tuple(NOT_COMMANDS)}"
            for cmd in commands(block):
                plan = command_plan(cmd)
                detail = getattr(plan, "why", "") or getattr(plan, "note", "")
                if isinstance(plan, Swap):
                    detail = f"ran `{shlex.join(swapped(cmd, plan, Path('$KVPROBE_HOME')))}`: {plan.why}"
                rows.append((block, cmd, mode(plan), detail))
    return rows


# Counted by hand from the docs: a new block or command changes them, and the table says where.
EXPECTED = {"ran as written": 28, "swapped": 46, "parsed only": 34, "delegated": 3, "not a command": 10}


def test_every_block_is_classified_and_counted():
    rows = table()
    print(f"\n{'block':<22} {'mode':<15} command or block: what ran")
    for block, what, how, detail in rows:
        print(f"{block.id:<22} {how:<15} {what[:110]}" + (f"\n{'':<38} {detail}" if detail else ""))
    per_doc = {doc: Counter(how for b, _, how, _ in rows if b.doc == doc) for doc in DOCS}
    print("\nper file:")
    for doc, counts in per_doc.items():
        print(f"  {doc:<20} " + ", ".join(f"{counts[k]} {k}" for k in EXPECTED if counts[k]))
    total = Counter(how for _, _, how, _ in rows)
    print("total: " + ", ".join(f"{total[k]} {k}" for k in EXPECTED))
    assert dict(total) == {k: v for k, v in EXPECTED.items() if v}
    assert not [k for k in PLAN if not any(what == k for _, what, _, _ in rows)], "PLAN names commands no doc has"
    assert all(any(b.doc == doc and marker in b.body for b in blocks()) for doc, marker, _ in SNIPPETS)


def test_the_extending_blocks_are_the_ones_test_extending_runs():
    from tests.unit import test_extending

    ours = [b.body for b in blocks() if b.doc == "docs/extending.md" and b.lang == "python"]
    theirs = [*test_extending.blocks("A probe", "python"), *test_extending.blocks("An edit strategy", "python")]
    assert ours == theirs


# -- running them ----------------------------------------------------------------------------------

def parse(args: list[str]):
    """Parse ``kvprobe ARGS`` as the CLI does, without running it: click's ``make_context`` on the
    group and each subcommand converts and checks every option (an unknown option or a bad value
    raises), after the command line's own preparation (a bare ``--json`` is ``--json -``)."""
    import typer

    from kvprobe.cli.app import app
    from kvprobe.cli.argv import bare_json, check_args

    cmd = typer.main.get_command(app)
    args = bare_json(list(args))
    check_args(cmd, args)
    ctx = cmd.make_context("kvprobe", args, resilient_parsing=False)
    while hasattr(cmd, "resolve_command") and (rest := [*getattr(ctx, "_protected_args", []), *ctx.args]):
        name, cmd, rest = cmd.resolve_command(ctx, rest)  # a group without a subcommand (`kvprobe models`) stops
        ctx = cmd.make_context(name, rest, parent=ctx, resilient_parsing=False)
    return ctx


def check_parts(cmd: str) -> None:
    """The ``kvprobe`` parts of a shell line parse; the scripts and example files it names exist."""
    for part in re.split(r"&&|\|\||;|[()]", cmd):
        words = shlex.split(part)
        while words and (words[0] in ("do", "then") or re.match(r"^\w+=", words[0])):
            words = words[1:]
        if words and words[-1] == "done":
            words = words[:-1]
        if words and (words[0] == "kvprobe" or words[0].endswith("/kvprobe")):
            parse(words[1:])
        for w in words:
            if re.match(r"^(scripts|benchmarks|examples)/", w):
                assert (ROOT / w).exists(), f"{cmd!r} names {w}, which is not in the repository"


@pytest.fixture(scope="session")
def made(tmp_path_factory):
    """``made(what, dest)``: a toy run folder (``run MODEL``, --n 4, made once per test process and
    copied) or its ``topk.yaml of run MODEL`` at ``dest``."""
    base, runs = tmp_path_factory.mktemp("docs-made"), {}

    def run_of(model: str) -> Path:
        if model not in runs:
            proc = cli_process.run("run", "--model", model, "--n", RUN_N, "--out", str(base / model), cwd=base)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
            runs[model] = base / model
        return runs[model]

    def make(what: str, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if what.startswith("run "):
            shutil.copytree(run_of(what.removeprefix("run ")), dest)
        else:
            shutil.copy(run_of(what.removeprefix("topk.yaml of run ")) / "topk.yaml", dest)

    return make


def workdir(tmp_path: Path) -> Path:
    """A folder laid out like the repository for the docs' relative paths: a copy of examples/, links
    to scripts/ and benchmarks/, an empty docs/summaries/."""
    folder = tmp_path / "w"
    shutil.copytree(ROOT / "examples", folder / "examples")
    for name in ("scripts", "benchmarks"):
        (folder / name).symlink_to(ROOT / name)
    (folder / "docs" / "summaries").mkdir(parents=True)
    return folder


def run_command(cmd: str, plan: Run | Swap | Parse, folder: Path, env: dict, made) -> None:
    if shlex.split(cmd)[0] == "kvprobe" or isinstance(plan, Parse):
        check_parts(cmd)  # as written, before any swap
    if isinstance(plan, Parse):
        return
    for path, what in plan.needs:
        made(what, folder / path)
    words = swapped(cmd, plan, Path(env["KVPROBE_HOME"]) if "KVPROBE_HOME" in env else Path.home())
    if words[0] == "kvprobe":
        proc = cli_process.run(*words[1:], cwd=folder, env=env)
    else:
        extra = {}
        while re.match(r"^\w+=", words[0]):
            key, _, value = words.pop(0).partition("=")
            extra[key] = value
        if words[0] in ("python", "python3", ".venv/bin/python"):
            words[0] = sys.executable
        if words[0] == sys.executable and words[1].endswith(".py") and not any(k.startswith("PYTHON") for k in extra):
            proc = cli_process.run_script(words[1], *words[2:], cwd=folder, env={**env, **extra})  # no imports paid
        else:
            proc = subprocess.run(words, cwd=folder, env={**env, **extra}, capture_output=True, text=True, timeout=600)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    code, expect = getattr(plan, "code", 0), getattr(plan, "expect", None)
    assert proc.returncode == code, f"`{shlex.join(words)}` exited {proc.returncode}, not {code}:\n{out}"
    assert expect is None or expect in proc.stdout + proc.stderr, f"`{shlex.join(words)}` did not say {expect!r}"


class StandIn:
    """An OpenAI-compatible chat endpoint on 127.0.0.1 that answers "yes" and keeps what it received."""

    def __init__(self):
        self.received: list[dict] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.received.append(body)
                reply = json.dumps({
                    "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "length",
                                 "message": {"role": "assistant", "content": "yes"}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def run_snippet(block: Block, plan: Snippet, folder: Path, made, monkeypatch) -> None:
    for path, what in plan.needs:
        made(what, folder / path)
    monkeypatch.chdir(folder)
    stand_in = StandIn() if "{openai_url}" in plan.replace.values() else None
    try:
        code = block.body
        for old, new in plan.replace.items():
            assert old in code, f"{block.id} no longer holds {old!r}"
            code = code.replace(old, new.format(openai_url=stand_in.url if stand_in else ""))
        scope = {"__name__": "docs_snippet", "__body__": block.body,
                 "__received__": stand_in.received if stand_in else None}
        exec(compile(plan.before, f"{block.id} (before)", "exec"), scope)
        exec(compile(code, block.id, "exec"), scope)
        exec(compile(plan.after, f"{block.id} (after)", "exec"), scope)
    finally:
        if stand_in:
            stand_in.close()


RUN_BLOCKS = [b for b in blocks() if b.lang in RUNNABLE and not (b.lang == "python" and b.doc in DELEGATED)]


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda b: b.id)
def test_doc_block_runs(block, tmp_path, monkeypatch, made):
    folder = workdir(tmp_path)
    if block.lang == "python":
        run_snippet(block, snippet_plan(block), folder, made, monkeypatch)
        return
    env = dict(os.environ)
    if "kvprobe toy train" in block.body:  # it trains into $KVPROBE_HOME: this folder's own
        env["KVPROBE_HOME"] = str(tmp_path / "home")
    for cmd in commands(block):
        run_command(cmd, command_plan(cmd), folder, env, made)
