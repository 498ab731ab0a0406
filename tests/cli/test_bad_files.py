"""Broken model files, configs and results folders: one line `error: ...`, the right exit code, no traceback.

Exit codes (kvprobe.errors): 3 for a bad file (model file, config, results folder), 4 for a model
that cannot be fetched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvprobe.models.toy_folder import shipped_dir

from tests import cli_process


def kvprobe(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The console entry point in a process of its own (forked from a warm one, tests/cli_process.py)."""
    return cli_process.run(*args, env={**os.environ, **(env or {})}, timeout=300)


def one_line_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """Exit ``code``, exactly one non-empty stderr line, starting ``error:``, holding each needle; no traceback."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _gguf(path: Path) -> Path:
    """A small but well-formed GGUF (one float tensor, no tokenizer): its header parses."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- a. GGUF files ---------------------------------------------------------------------------------

def test_truncated_and_garbage_gguf(tmp_path):
    whole = _gguf(tmp_path / "whole.gguf").read_bytes()
    cases = {"header.gguf": whole[:15], "data.gguf": whole[: len(whole) - 1000], "garbage.gguf": os.urandom(4096),
             "empty.gguf": b""}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        one_line_error(kvprobe("datasets", "check", "--model", str(tmp_path / name), "--n", "1"), 3,
                       name, "not a readable GGUF file")
    # a whole GGUF that transformers cannot build a model from (no tokenizer): still one line
    one_line_error(kvprobe("datasets", "check", "--model", str(tmp_path / "whole.gguf"), "--n", "1"), 3,
                   "whole.gguf", "does not load")


# -- b. Hugging Face folders -----------------------------------------------------------------------

@pytest.mark.parametrize("config, needle", [("{not json", "not valid JSON"), ('{"a": 1}', "no model_type"),
                                            ('{"model_type": "nonsense"}', "'nonsense'"),
                                            ("[1, 2]", "not an object")])
def test_hf_folder_with_a_bad_config(tmp_path, config, needle):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(config)
    one_line_error(kvprobe("datasets", "check", "--model", str(folder), "--n", "1"), 3, "config.json", needle)


def test_hf_folder_without_weights_or_with_broken_weights(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shipped_dir("qwen2") / name, folder / name)
    one_line_error(kvprobe("datasets", "check", "--model", str(folder), "--n", "1"), 3, "no weights")
    (folder / "model.safetensors").write_bytes(os.urandom(1000))
    one_line_error(kvprobe("datasets", "check", "--model", str(folder), "--n", "1"), 3, "does not load")


# -- c. toy folders --------------------------------------------------------------------------------

@pytest.mark.parametrize("damage, needle", [
    ("truncate", "does not load as a toy model"),
    ("manifest-json", "not a readable toy manifest"),
    ("manifest-keys", "not a toy manifest"),
    ("manifest-family", "names family 'nope'"),
])
def test_damaged_toy_folder(tmp_path, damage, needle):
    folder = tmp_path / "toy"
    shutil.copytree(shipped_dir("qwen2"), folder)
    weights, manifest = folder / "model.safetensors", folder / "toy_manifest.json"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100_000])
    elif damage == "manifest-json":
        manifest.write_text("{not json")
    elif damage == "manifest-keys":
        manifest.write_text('{"family": "qwen2"}')
    else:
        data = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**data, "family": "nope"}))
    one_line_error(kvprobe("datasets", "check", "--model", str(folder), "--n", "1"), 3, needle)


# -- d. run configs --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "a list"), ("hello\n", "a single string"),
                                        ("7\n", "a single number")])
def test_run_config_not_a_mapping(tmp_path, text, kind):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    one_line_error(kvprobe("run", "--config", str(cfg), "--out", str(tmp_path / "out")), 3,
                   "cfg.yaml", kind, "mapping of RunConfig keys")
    assert not (tmp_path / "out").exists()


def test_run_config_unknown_key_and_missing_file(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("bogus: 1\n")
    one_line_error(kvprobe("run", "--config", str(cfg), "--out", str(tmp_path / "out")), 3, "bogus",
                   "accepted keys")
    one_line_error(kvprobe("run", "--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "out")), 3,
                   "not found")
    assert not (tmp_path / "out").exists()


# -- e, f. results folders -------------------------------------------------------------------------

def _results(folder: Path, manifest: dict | None = None) -> Path:
    """A results folder as far as the report and export-topk read it first: a run manifest, a ranking
    rule, and garbage where the parquet tables should be."""
    folder.mkdir()
    manifest = manifest or {"kvprobe_run": 1, "config": {"model": "tiny-llama", "erratum_template": "x"},
                            "model": {"spec": "tiny-llama"}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "ranking_rule.json").write_text(json.dumps({"held_out_cases": [], "rule": {}, "kinds_at_top": {},
                                                          "max_downstream": 0}))
    (folder / "edits.parquet").write_bytes(os.urandom(300))
    return folder


def test_corrupt_parquet_in_a_results_folder(tmp_path):
    folder = _results(tmp_path / "res")
    one_line_error(kvprobe("report", str(folder), "--out", str(tmp_path / "r.html")), 3, "edits.parquet",
                   "not a readable parquet table")
    one_line_error(kvprobe("export-topk", str(folder), "--out", str(tmp_path / "topk.yaml")), 3, "edits.parquet",
                   "not a readable parquet table")
    (folder / "edits.parquet").unlink()
    (folder / "locality.parquet").write_text("garbage")
    one_line_error(kvprobe("report", str(folder), "--out", str(tmp_path / "r.html")), 3, "locality.parquet")
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "topk.yaml").exists()


@pytest.mark.parametrize("manifest", ['{"a": 1}', "[1]"])
def test_report_refuses_a_manifest_kvprobe_did_not_write(tmp_path, manifest):
    folder = tmp_path / "res"
    folder.mkdir()
    (folder / "manifest.json").write_text(manifest)
    one_line_error(kvprobe("report", str(folder), "--out", str(tmp_path / "r.html")), 3, "manifest.json",
                   "not a `kvprobe run` manifest")
    assert not (tmp_path / "r.html").exists()


def test_a_table_lacking_a_column_or_holding_the_wrong_kind_names_both(tmp_path):
    """A required column missing, or text where numbers or flags belong: one line naming the file and the
    column (export-topk, report and compare read the same tables through one check)."""
    import pandas as pd

    folder = _results(tmp_path / "res")
    edits = {"case_id": ["c1"], "strategy": ["stale"], "ranking": [None], "cot": [0], "k": [None], "agree": [True],
             "recovery": [0.0], "frac_recomputed": [0.0], "valid": [True], "control": [False]}
    pd.DataFrame({k: v for k, v in edits.items() if k != "agree"}).to_parquet(folder / "edits.parquet")
    out = ("--out", str(tmp_path / "r.html"))
    one_line_error(kvprobe("export-topk", str(folder), "--out", str(tmp_path / "t.yaml")), 3,
                   f"{folder / 'edits.parquet'} is not an edits table as kvprobe writes it (no column agree)")
    one_line_error(kvprobe("report", str(folder), *out), 3, "edits.parquet", "(no column agree, correct, ")
    one_line_error(kvprobe("compare", str(folder)), 3, "edits.parquet", "(no column agree, correct, ")
    pd.DataFrame({**edits, "k": ["eight"]}).to_parquet(folder / "edits.parquet")
    one_line_error(kvprobe("export-topk", str(folder), "--out", str(tmp_path / "t.yaml")), 3,
                   "edits.parquet is not an edits table as kvprobe writes it (column k holds 'eight', where whole "
                   "numbers belong)")
    pd.DataFrame({"case_id": ["c1"], "control": [False], "valid": ["x"]}).to_parquet(folder / "validity.parquet")
    for args in (("report", str(folder), *out), ("compare", str(folder))):
        one_line_error(kvprobe(*args), 3, "validity.parquet is not a validity table as kvprobe writes it (column "
                                          "valid holds 'x', where true/false flags belong)")
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "t.yaml").exists()


NEWER = {  # a manifest from a newer kvprobe: (file, what it holds)
    "manifest.json": {"kvprobe_run": 2, "config": {"model": "tiny-llama"}, "model": {"spec": "tiny-llama"}},
    "sweep_manifest.json": {"kvprobe_sweep": 99, "config": {"model": "tiny-llama"}, "model": {}, "cells": {}},
    "compose_manifest.json": {"kvprobe_validate": 2, "command": "validate", "model": {"spec": "tiny-llama"}},
    "serving_manifest.json": {"kvprobe_serve_bench": 2, "command": "serve-bench", "config": {}},
}


def test_a_manifest_from_a_newer_kvprobe_is_refused(tmp_path):
    for name, manifest in NEWER.items():
        folder = tmp_path / name.split(".")[0]
        folder.mkdir()
        (folder / name).write_text(json.dumps(manifest))
        key, version = next(iter(manifest.items()))
        out = () if name.startswith("sweep") else ("--out", str(tmp_path / "r.html"))  # a sweep's page: its folder
        one_line_error(kvprobe("report", str(folder), *out), 3,
                       f"{folder / name} was written by a newer kvprobe ({key} {version}; this kvprobe reads 1)")
    one_line_error(kvprobe("compare", str(tmp_path / "manifest")), 3, "manifest.json was written by a newer kvprobe")
    one_line_error(kvprobe("export-topk", str(tmp_path / "sweep_manifest"), "--out", str(tmp_path / "t.yaml")), 3,
                   "sweep_manifest.json was written by a newer kvprobe")
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "sweep_manifest" / "report.html").exists()


# -- g. a hub id with no hub ------------------------------------------------------------------------

def test_offline_hub_id_is_one_line_and_fast(tmp_path):
    # an endpoint that refuses at once, whatever this machine's network; an empty Hugging Face cache
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "KVPROBE_HOME": str(tmp_path / "kv")}
    start = time.monotonic()
    one_line_error(kvprobe("datasets", "check", "--model", "someorg/somemodel", "--n", "1", env=env), 4,
                   "someorg/somemodel", "cannot be reached")
    assert time.monotonic() - start < 60


def test_a_toy_folder_named_toy_something_loads_by_its_relative_path(tmp_path):
    """``toy-<family>`` is the shipped toy; another ``toy-...`` name that is a folder here is that folder."""
    shutil.copytree(shipped_dir("qwen2"), tmp_path / "toy-mine")
    weights = tmp_path / "toy-mine" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    proc = cli_process.run("datasets", "check", "--model", "toy-mine", "--n", "1", cwd=tmp_path, timeout=300)
    one_line_error(proc, 3, "toy-mine does not load as a toy model")
