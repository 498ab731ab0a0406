"""A resume reuses only rows computed from the same inputs: a dataset edited in place under the same
case ids, or a model folder replaced under the same path, is refused in one line (exit 2) instead of
being mixed with the old rows (main eac58e9 resumed both, exit 0, with the old rows)."""

from __future__ import annotations

import json
import shutil

from kvprobe.models.toy_folder import shipped_dir
from tests.cli.test_conventions import error_line, kvprobe

EDIT = ("edit", "--n", "3", "--strategies", "stale,field_only")


def test_a_dataset_changed_under_the_same_case_ids_is_refused(tmp_path):
    data, out = tmp_path / "gen.jsonl", tmp_path / "E"
    assert kvprobe("datasets", "generate", "--n", "3", "--out", data).returncode == 0
    first = kvprobe(*EDIT, "--model", "toy-qwen2", "--dataset", data, "--out", out)
    assert first.returncode == 0, first.stderr[-2000:]
    assert kvprobe(*EDIT, "--model", "toy-qwen2", "--dataset", data, "--out", out).returncode == 0  # same: resumes
    cases = [json.loads(line) for line in data.read_text().splitlines()]
    c = cases[0]  # swap the old and the new value of one case, its id kept
    c["old_value"], c["new_value"] = c["new_value"], c["old_value"]
    c["expected_old"], c["expected_new"] = c["expected_new"], c["expected_old"]
    data.write_text("".join(json.dumps(x) + "\n" for x in cases))
    before = sorted(p.name for p in (out / "parts").rglob("*"))
    line = error_line(kvprobe(*EDIT, "--model", "toy-qwen2", "--dataset", data, "--out", out), 2)
    assert "other contents of 1 case(s)" in line and c["case_id"] in line, line
    assert sorted(p.name for p in (out / "parts").rglob("*")) == before  # nothing written, nothing lost


def test_a_model_folder_replaced_under_the_same_path_is_refused(tmp_path):
    data, mine, out = tmp_path / "gen.jsonl", tmp_path / "mytoy", tmp_path / "E2"
    assert kvprobe("datasets", "generate", "--n", "3", "--out", data).returncode == 0
    shutil.copytree(shipped_dir("qwen2"), mine)
    first = kvprobe(*EDIT, "--model", mine, "--dataset", data, "--out", out)
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(mine)
    shutil.copytree(shipped_dir("llama"), mine)
    line = error_line(kvprobe(*EDIT, "--model", mine, "--dataset", data, "--out", out), 2)
    assert "another model" in line and "weights_hash" in line, line
    manifest = json.loads((out / "edit_manifest.json").read_text())
    assert manifest["model"]["family"] == "qwen2"  # the folder still says what computed its rows


def test_run_refuses_a_changed_dataset_too(tmp_path):
    data, out = tmp_path / "gen.jsonl", tmp_path / "R"
    assert kvprobe("datasets", "generate", "--n", "3", "--out", data).returncode == 0
    args = ("run", "--model", "tiny-llama", "--n", "3", "--all-cases", "--probes", "locality", "--strategies",
            "stale", "--dataset", data, "--out", out)
    first = kvprobe(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    cases = [json.loads(line) for line in data.read_text().splitlines()]
    cases[1]["question"] = cases[1]["question"] + " Answer carefully."
    data.write_text("".join(json.dumps(x) + "\n" for x in cases))
    assert "other contents of 1 case(s)" in error_line(kvprobe(*args), 2)


def test_an_unreadable_part_is_computed_again_and_said_so(tmp_path):
    """A part cut short (a full disk, a bad copy) is not a traceback on resume: it is computed again
    (the claim says it would come out the same), the table equals a clean run's, and the manifest
    names it."""
    import pandas as pd

    out = tmp_path / "E"
    args = (*EDIT, "--model", "toy-qwen2", "--out", out)
    assert kvprobe(*args).returncode == 0
    clean = pd.read_parquet(out / "edits.parquet").drop(columns=["wall_s", "decide_s"])
    part = sorted((out / "parts" / "edits").glob("*.parquet"))[1]
    part.write_bytes(part.read_bytes()[:200])
    again = kvprobe(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    pd.testing.assert_frame_equal(pd.read_parquet(out / "edits.parquet").drop(columns=["wall_s", "decide_s"]), clean)
    manifest = json.loads((out / "edit_manifest.json").read_text())
    assert manifest["recomputed_parts"] == [f"edits/{part.stem}"]
