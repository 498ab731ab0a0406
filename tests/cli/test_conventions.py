"""What a user of a Python CLI expects: documented exit codes, folders that are never silently
mixed, safe part-file names, inputs checked before any model work, a fast --help, plain progress
in logs, a version, and error text printed as it is."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tests import cli_process
from tests.cli.test_errors import one_line_error

ROOT = Path(__file__).resolve().parents[2]

CLI = [sys.executable, "-c", "from kvprobe.cli.app import main; main()"]


def kvprobe(*args, cwd=None) -> subprocess.CompletedProcess:
    """The console entry point in a process of its own (forked from a warm one, tests/cli_process.py)."""
    return cli_process.run(*args, cwd=cwd, timeout=600)


def fresh_kvprobe(*args) -> subprocess.CompletedProcess:
    """A new Python process, imports and all: for what only a fresh process shows (start-up time, the
    warnings and progress bars a library prints the first time)."""
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=600)


def error_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """The one error line of a failed command, checked for its exit code and for no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def case(case_id: str, **kw) -> dict:
    base = {"case_id": case_id, "domain": "mine", "field": "tier", "old_value": "gold", "new_value": "basic",
            "control": False, "prompt": "Loans are issued to premium members only.\ntier: gold",
            "question": "Issue the loan?", "options": ["yes", "no"], "expected_old": "yes", "expected_new": "no"}
    return {**base, **kw}


def write_jsonl(path: Path, cases: list[dict]) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in cases))
    return path


# -- defect 1: `kvprobe edit` never mixes results -------------------------------------------------
def test_edit_refuses_a_folder_holding_another_models_edits(tmp_path):
    out = tmp_path / "e1"
    assert kvprobe("edit", "--model", "tiny-qwen2", "--n", "2", "--strategies", "stale,oracle",
                   "--out", out).returncode in (0, 1)  # random weights: maybe no valid case (exit 1)
    before = snapshot(out)
    line = error_line(kvprobe("edit", "--model", "tiny-llama", "--n", "2", "--strategies", "stale,oracle,erratum",
                              "--out", out), 2)
    assert str(out) in line and "other settings" in line and "model" in line
    assert snapshot(out) == before  # nothing written, nothing lost


def test_edit_refuses_a_run_folder_and_run_refuses_an_edit_folder(tmp_path):
    run_dir, edit_dir = tmp_path / "run", tmp_path / "edit"
    assert kvprobe("run", "--model", "tiny-llama", "--n", "2", "--all-cases", "--probes", "locality",
                   "--strategies", "stale,oracle", "--no-report", "--out", run_dir).returncode == 0
    before = snapshot(run_dir)
    line = error_line(kvprobe("edit", "--model", "tiny-llama", "--seed", "3", "--n", "2", "--out", run_dir), 2)
    assert "kvprobe run" in line
    assert snapshot(run_dir) == before
    kvprobe("edit", "--model", "tiny-llama", "--n", "1", "--strategies", "stale", "--out", edit_dir)
    assert "kvprobe edit" in error_line(kvprobe("run", "--model", "tiny-llama", "--n", "1", "--out", edit_dir), 2)


def test_edit_default_folder_is_per_model(tmp_path):
    for model in ("tiny-llama", "tiny-qwen2"):
        kvprobe("edit", "--model", model, "--n", "1", "--strategies", "stale", cwd=tmp_path)
    assert (tmp_path / "results/edit/tiny-llama/edit_config.json").exists()
    assert (tmp_path / "results/edit/tiny-qwen2/edit_config.json").exists()


# -- defect 3: case ids are not paths ---------------------------------------------------------------
def test_case_ids_become_safe_part_names(tmp_path):
    from kvprobe.results import CaseStore, part_name

    ids = ["refund/1", "../../escape", "/abs/path", ".hidden", "a%2Fb", "ünï", "x" * 300]
    names = [part_name(i) for i in ids]
    assert len(set(names)) == len(ids)
    assert all("/" not in n and "\\" not in n and not n.startswith(".") and len(n) < 250 for n in names)
    store = CaseStore(tmp_path / "out", "edits")
    for i in ids:
        store.save(i, pd.DataFrame({"case_id": [i]}))
    assert sorted(p.parent for p in (tmp_path / "out").rglob("*.parquet")) == [store.parts] * len(ids)
    assert sorted(pd.read_parquet(store.collect()).case_id) == sorted(ids)
    assert {p.name for p in tmp_path.iterdir()} == {"out"}  # nothing escaped --out


def test_a_case_id_with_a_slash_keeps_its_rows_and_nothing_escapes(tmp_path):
    data = write_jsonl(tmp_path / "cases.jsonl", [case("refund/1"), case("../../evil"), case("/tmp/abs")])
    out = tmp_path / "out"
    proc = kvprobe("edit", "--model", "tiny-llama", "--dataset", data, "--strategies", "stale,oracle", "--out", out)
    assert proc.returncode in (0, 1), proc.stderr  # random weights: maybe no valid case
    df = pd.read_parquet(out / "edits.parquet")
    assert sorted(df.case_id.unique()) == ["../../evil", "/tmp/abs", "refund/1"]
    assert {p.name for p in tmp_path.iterdir()} == {"cases.jsonl", "out"}
    assert not Path("/tmp/abs.cot0.parquet").exists()


def test_colliding_case_ids_are_refused(tmp_path):
    data = write_jsonl(tmp_path / "cases.jsonl", [case("Refund-1"), case("refund-1")])
    line = error_line(kvprobe("edit", "--model", "tiny-llama", "--dataset", data, "--out", tmp_path / "out"), 3)
    assert "collide" in line and "'Refund-1'" in line
    assert not (tmp_path / "out").exists()


# -- defect 5: a folder is claimed only once the inputs are valid --------------------------------------
def test_a_failed_run_does_not_claim_its_folder(tmp_path):
    out = tmp_path / "X"
    proc = kvprobe("run", "--model", "tiny-llama", "--dataset", tmp_path / "nope.jsonl", "--out", out)
    assert not (out / "config.json").exists()  # the defect: a claim that refused the corrected command
    assert "nope.jsonl" in error_line(proc, 3)
    assert not out.exists()
    line = error_line(kvprobe("run", "--model", "tiny-llama", "--strategies", "selective:100000:random",
                              "--n", "2", "--out", out), 2)
    assert "K=100000" in line and "downstream span" in line
    assert not (out / "config.json").exists()
    proc = kvprobe("run", "--model", "tiny-llama", "--n", "2", "--all-cases", "--probes", "locality",
                   "--strategies", "stale,oracle", "--no-report", "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_prompt_over_the_window_is_refused_before_any_model_work(tmp_path):
    from kvprobe.models import load_model

    window = load_model("tiny-llama").max_positions
    long = case("long", prompt="Loans are issued to premium members only. " + "Filler words here. " * window +
                "\ntier: gold")
    data = write_jsonl(tmp_path / "long.jsonl", [long])
    start = time.perf_counter()
    line = error_line(kvprobe("run", "--model", "tiny-llama", "--dataset", data, "--out", tmp_path / "out"), 3)
    assert "case long" in line and f"window of {window} positions" in line
    assert not (tmp_path / "out").exists()
    assert time.perf_counter() - start < 120


# -- exit codes -------------------------------------------------------------------------------------
def test_exit_codes(tmp_path):
    from kvprobe.errors import EXIT_CODES

    assert kvprobe("--version").returncode == 0
    error_line(kvprobe("run", "--n", "0"), 2)  # click's own range check
    error_line(kvprobe("run", "--model", "tiny-llama", "--cot", "a,b"), 2)
    error_line(kvprobe("run", "--model", "tiny-llama", "--cot", "-1"), 2)
    error_line(kvprobe("export-topk", tmp_path, "--threshold", "7"), 2)
    error_line(kvprobe("edit", "--dataset", tmp_path / "missing.jsonl"), 3)
    error_line(kvprobe("serve-bench", "--model", "smollm2-135m", "--url", "http://127.0.0.1:9", "--n", "1"), 4)
    # a check that ran and failed: no valid case (the case's expected answers are both 'maybe')
    data = write_jsonl(tmp_path / "c.jsonl", [case("c1", options=["yes", "maybe"], expected_old="maybe",
                                                   expected_new="maybe")])
    proc = kvprobe("edit", "--model", "tiny-llama", "--dataset", data, "--strategies", "stale", "--out",
                   tmp_path / "e")
    if "0 of 1 decision cases valid" in proc.stdout:
        assert "no decision case" in error_line(proc, 1)
    assert set(EXIT_CODES) == {0, 1, 2, 3, 4, 130, 143}
    doc = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    for code, meaning in EXIT_CODES.items():
        assert f"| {code} | {meaning} |" in doc


def test_error_text_is_printed_as_it_is():
    line = error_line(kvprobe("edit", "--model", "tiny-llama", "--strategies", "selective:abc:causal"), 2)
    assert "'selective:abc:causal'" in line


# -- conventions ------------------------------------------------------------------------------------
def test_help_imports_no_model_stack_and_shows_defaults():
    code = ("import sys, kvprobe.cli.app; heavy = [m for m in ('torch', 'transformers', 'pandas') "
            "if m in sys.modules]; print(heavy)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"
    # `edit --help` itself imports none of them either (what made help slow; checked by what it
    # imports, not by a wall time that a loaded 2-core machine stretches several-fold)
    code = ("import atexit, sys; atexit.register(lambda: print([m for m in ('torch', 'transformers', 'pandas') "
            "if m in sys.modules], file=sys.stderr)); sys.argv = ['kvprobe', 'edit', '--help']; "
            "from kvprobe.cli.app import main; main()")
    helped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert helped.returncode == 0 and helped.stderr.strip().splitlines()[-1] == "[]", helped.stderr[-2000:]
    proc = fresh_kvprobe("edit", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.replace("│", " ").split())  # help wrapped inside rich's box: its borders out
    for needle in ("[default: toy-qwen2]", "[default: 40]", "selective:K:RANKING", "default: stale, field_only",
                   "--form", "--few-shot", "--min-flip"):
        assert needle in text, needle
    assert "inspect" not in kvprobe("models", "--help").stdout
    assert kvprobe("--version").stdout.startswith("kvprobe ")


def test_cli_help_facts_match_their_homes():
    from kvprobe.cli import options
    from kvprobe.defaults import DEFAULT_STRATEGIES
    from kvprobe.editor import strategies
    from kvprobe.config import RunConfig
    from kvprobe.probes import STAGES

    builtin = [c for c in strategies.STRATEGIES.values() if c.__module__.startswith("kvprobe.editor.")]
    assert options.STRATEGY_GRAMMAR == ", ".join(c.grammar() for c in builtin)
    assert options.PROBES == ", ".join(n for n, s in STAGES.items() if s.build.__module__.startswith("kvprobe.probes"))
    from kvprobe.catalog import toy_family_names
    from kvprobe.cli.toy import FAMILY_HELP
    from kvprobe.models.toy_folder import toy_families

    assert toy_family_names() == toy_families() and FAMILY_HELP == "gemma2, gemma3, llama, mistral, qwen2 or qwen3"
    cfg = RunConfig()
    assert (cfg.model, cfg.budget, cfg.threshold, cfg.min_flip, cfg.form, tuple(cfg.strategies)) == (
        options.DEFAULTS["model"], options.DEFAULTS["budget"], options.DEFAULTS["threshold"],
        options.DEFAULTS["min_flip"], options.DEFAULTS["form"], DEFAULT_STRATEGIES)
    assert cfg.n is None and cfg.sizing()["per_leg"] == 73  # a run sizes itself unless --n is given


def test_plain_progress_and_no_third_party_noise_in_logs(tmp_path):
    proc = fresh_kvprobe("run", "--model", "toy-qwen2", "--n", "3", "--probes", "locality", "--strategies",
                         "stale,oracle", "--out", tmp_path / "r")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for stage in ("validity: 3/3", "locality: 0/", "edits: 0/"):
        assert stage in proc.stderr, proc.stderr
    for noise in ("Loading weights", "it/s]", "UserWarning", "\r"):
        assert noise not in proc.stderr + proc.stdout, noise
    mode = stat.S_IMODE(os.stat(tmp_path / "r" / "edits.parquet").st_mode)
    assert mode & stat.S_IRGRP, oct(mode)  # not 0600: a results file reads like any other file


def test_unusable_output_paths_are_refused_before_any_work(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        before = snapshot(tmp_path)
        assert "is a file" in error_line(kvprobe("run", "--model", "tiny-llama", "--out", a_file), 2)
        unwritable = locked / "x" if os.geteuid() != 0 else Path("/sys/kvprobe-test/x")  # root ignores chmod
        assert "cannot be written" in error_line(kvprobe("edit", "--model", "tiny-llama", "--out", unwritable), 2)
        assert "is a folder" in error_line(kvprobe("report", tmp_path, "--out", locked), 2)
        assert "is a folder" in error_line(kvprobe("datasets", "generate", "--out", locked, "--n", "2"), 2)
        assert snapshot(tmp_path) == before and not list(tmp_path.rglob("*.tmp"))
    finally:
        locked.chmod(0o700)


def test_output_off_a_terminal_is_never_cut(tmp_path):
    """Into a pipe or a log (here a file, with COLUMNS=80 as pytest-xdist sets it), tables keep every
    cell whole: the strategy table's longest description and the default list come out in full, and no
    cell ends in rich's ellipsis; the descriptions are plain text, not the docstrings' Sphinx markup."""
    from kvprobe.defaults import DEFAULT_STRATEGIES

    proc = cli_process.run("strategies", env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    assert "``" not in proc.stdout and ":data:`" not in proc.stdout and ":meth:`" not in proc.stdout  # no Sphinx
    assert f"default: {','.join(DEFAULT_STRATEGIES)}" in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) > 200  # unwrapped: wider than the old fixed 170


def test_the_repair_threshold_has_one_default_and_one_range_everywhere(tmp_path):
    """Issue 51: every command that establishes a repair (run, export-topk, compare, calibrate, memory)
    takes --threshold through one option (default DEFAULT_THRESHOLD, range [0.5, 1)), and a run
    config, a topk.yaml, a field_policy.yaml and the library's export_topk accept the same range. The
    composition gate's --threshold (validate) is another quantity, with its own default."""
    from typer.main import get_command

    from kvprobe.cli import options as opt
    from kvprobe.cli.app import app
    from kvprobe.config import RunConfig
    from kvprobe.defaults import DEFAULT_THRESHOLD, GATE_THRESHOLD, THRESHOLD_RANGE, is_threshold
    from kvprobe.editor.topk import export_topk
    from kvprobe.errors import KvprobeError, UsageError

    having = {name: p for name, cmd in get_command(app).commands.items() for p in cmd.params
              if p.name == "threshold"}
    assert set(having) == {"run", "export-topk", "compare", "calibrate", "memory", "validate"}
    gate = having.pop("validate")
    assert gate.default == GATE_THRESHOLD and gate.callback is None
    for name, p in having.items():
        assert getattr(p.callback, "__wrapped__", None) is opt.threshold_option, name
        assert p.default == (None if name == "compare" else DEFAULT_THRESHOLD), name
    assert THRESHOLD_RANGE == "a number in [0.5, 1)"
    assert [is_threshold(x) for x in (0.5, 0.95, 0.999, 0.49, 1, 1.5, -1, float("nan"), True, "0.9")] == \
        [True, True, True, False, False, False, False, False, False, False]
    for value in (0.3, 1.0):
        with pytest.raises(KvprobeError, match=rf"threshold is {value}; accepted: a number in \[0.5, 1\)"):
            RunConfig.from_yaml(_yaml(tmp_path, f"threshold: {value}\n"))
        with pytest.raises(UsageError, match=r"threshold must be a number in \[0.5, 1\)"):
            export_topk(tmp_path, threshold=value)
    assert RunConfig.from_yaml(_yaml(tmp_path, "threshold: 0.5\n")).threshold == 0.5
    for args in (["run", "--threshold", "0.3"], ["export-topk", str(tmp_path), "--threshold", "1"],
                 ["compare", str(tmp_path), "--threshold", "0.49"], ["memory", "--threshold", "1"],
                 ["calibrate", "examples/calibrate-toy.yaml", "--threshold", "0.3"]):
        proc = kvprobe(*args, cwd=ROOT)
        one_line_error(proc, "--threshold must be a number in [0.5, 1)")
        assert proc.returncode == 2, (args, proc.stderr)


def _yaml(folder, text: str):
    path = folder / "cfg.yaml"
    path.write_text(text)
    return path


def test_json_is_one_option_on_every_command_that_has_it(tmp_path):
    """``--json [PATH|-]`` is the same option on every command that gives JSON (diagnose, compare,
    models, strategies): a path ending in .json, ``-`` or a bare ``--json`` for stdout (then stdout
    holds the JSON alone), any other value refused in one line before any work."""
    from typer.main import get_command

    from kvprobe.cli import options as opt
    from kvprobe.cli.app import app
    from kvprobe.cli.argv import bare_json

    def commands(cmd, path=()):
        yield path, cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from commands(sub, (*path, name))

    having = {" ".join(path): p for path, cmd in commands(get_command(app)) for p in cmd.params if "--json" in p.opts}
    assert set(having) == {"diagnose", "compare", "models", "strategies"}
    assert {(p.metavar, p.callback.__name__ if p.callback else None) for p in having.values()} == \
        {("[PATH|-]", opt._json_dest.__name__)}
    assert bare_json(["models", "--json"]) == ["models", "--json", "-"]
    assert bare_json(["compare", "a", "--json", "--csv", "x.csv"]) == ["compare", "a", "--json", "-", "--csv", "x.csv"]
    assert bare_json(["compare", "a", "--json", "c.json"]) == ["compare", "a", "--json", "c.json"]
    assert bare_json(["diagnose", "--", "--json"]) == ["diagnose", "--", "--json"]
    for command in ("models", "strategies"):
        for args in (["--json"], ["--json", "-"]):
            proc = kvprobe(command, *args, cwd=tmp_path)
            assert proc.returncode == 0, proc.stderr
            assert json.loads(proc.stdout)  # stdout is the JSON and nothing else
        proc = kvprobe(command, "--json", "out.json", cwd=tmp_path)
        assert proc.returncode == 0 and json.loads((tmp_path / "out.json").read_text()) == json.loads(
            kvprobe(command, "--json", cwd=tmp_path).stdout)
        assert "wrote" in proc.stdout and "name" in proc.stdout or "spec" in proc.stdout  # the table as well
        proc = kvprobe(command, "--json", "notes.txt", cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.strip() == (
            "error: --json 'notes.txt': give a path ending in .json, or - (or --json alone) for stdout")
        assert not (tmp_path / "notes.txt").exists()
