"""``kvprobe memory`` end to end on a toy: the table and manifest, resume (finished questions are not
redone), the claim (other settings refused), and bad options as one line (exit 2, nothing written)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvprobe.memory import arms
from tests.cli.test_conventions import error_line, kvprobe

ARGS = ["memory", "--model", "toy-qwen2", "--n", "4", "--session-tokens", "40,60", "--seams", "0,2"]


def test_memory_end_to_end_resumes_and_refuses_other_settings(tmp_path):
    out = tmp_path / "mem"
    proc = kvprobe(*ARGS, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    df = pd.read_parquet(out / "memory.parquet")
    assert len(df) == 4 * len(arms((0, 2))) and df["error"].isna().all()
    assert set(df["arm"]) == {a for _, a in arms((0, 2))}
    manifest = json.loads((out / "memory_manifest.json").read_text())
    fact = json.loads((out / "summary.json").read_text())["memory"]  # the summary's memory fact, written by the run
    assert {a["arm"] for a in fact["arms"]} == {a for _, a in arms((0, 2))} and fact["sentence"]
    assert manifest["n_users"] == 1 and {r["arm"] for r in manifest["equivalence"]} >= {"transplant_seam0", "late"}
    assert "TOST" in proc.stdout and "transplant_seam2" in proc.stdout
    parts = sorted((out / "parts" / "memory").glob("*.parquet"))
    assert len(parts) == 4
    # an interrupted run: one question's part is gone; the rerun computes it alone
    stamps = {p.name: p.stat().st_mtime_ns for p in parts[1:]}
    parts[0].unlink()
    again = kvprobe(*ARGS, "--out", out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert parts[0].exists() and {p.name: p.stat().st_mtime_ns for p in parts[1:]} == stamps
    timing = ["wall_s", "decide_s", "setup_s"]  # measured again for the recomputed question
    pd.testing.assert_frame_equal(pd.read_parquet(out / "memory.parquet").drop(columns=timing),
                                  df.drop(columns=timing))
    # other settings, another model, another command: one line each, exit 2
    assert "other settings" in error_line(kvprobe(*[a if a != "0,2" else "0" for a in ARGS], "--out", out), 2)
    line = error_line(kvprobe(*[a if a != "toy-qwen2" else "toy-llama" for a in ARGS], "--out", out), 2)
    assert "other settings" in line or "another model" in line
    assert "kvprobe memory" in error_line(kvprobe("edit", "--model", "toy-qwen2", "--n", "2", "--out", out), 2)


def test_the_policy_arm_calibrates_on_other_users_and_resumes(tmp_path):
    out = tmp_path / "pol"
    args = [*ARGS[:-2], "--seams", "0", "--policy-users", "2", "--threshold", "0.5", "--out", out]
    proc = kvprobe(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "per-field policy" in proc.stdout and "policy (" in proc.stdout
    df = pd.read_parquet(out / "memory.parquet")
    assert set(df["arm"]) == {a for _, a in arms((0,), policy=True)}
    manifest = json.loads((out / "memory_manifest.json").read_text())
    pol = manifest["policy"]
    assert pol["calibration_users"] == 2 and pol["threshold"] == 0.5 and pol["candidates"] == ["field_only", "erratum"]
    cal = pd.read_parquet(out / "memory_calibration.parquet")
    assert set(cal["fact"]) == set(pol["fields"]) and cal["user_id"].str.startswith("cal-s0-").all()
    assert not set(cal["question_id"]) & set(df["question_id"])
    for fact, d in pol["fields"].items():  # two users: at most two edits a fact, too few to establish at 0.5
        assert d["elements"] == cal.loc[cal["fact"] == fact, "element"].nunique() <= 2
        assert (d["repair"], d["verdict"]) in {("oracle", "budget"), ("oracle", "established")}
    edited = df[df["kind"] == "edited"].drop_duplicates("user_id").set_index("user_id")["fact"]  # the edited fact
    for r in df[df["arm"] == "policy"].itertuples():
        assert r.repair == pol["fields"][edited[r.user_id]]["repair"]
    settings = json.loads((out / "memory_config.json").read_text())
    assert settings["policy_users"] == 2 and settings["threshold"] == 0.5
    # a rerun reads the calibration's elements back and computes none
    parts = sorted((out / "parts" / "memory_calibration").glob("*.parquet"))
    stamps = {p.name: p.stat().st_mtime_ns for p in parts}
    again = kvprobe(*args)
    assert again.returncode == 0 and {p.name: p.stat().st_mtime_ns for p in parts} == stamps
    # another threshold is another policy: refused
    assert "other settings" in error_line(kvprobe(*[a if a != "0.5" else "0.6" for a in args]), 2)


@pytest.mark.parametrize("extra, text", [
    (["--margin", "0"], "--margin"), (["--alpha", "0.5"], "--alpha"), (["--seams", "-1"], "--seams"),
    (["--seams", "a"], "--seams"), (["--session-tokens", "10,20"], "session_tokens"),
    (["--session-tokens", "40"], "--session-tokens"), (["--questions-per-user", "2"], "questions_per_user"),
    (["--sessions", "0"], "sessions"), (["--policy-users", "-1"], "--policy-users"),
    (["--threshold", "1"], "--threshold")])
def test_bad_options_are_one_line_before_any_work(tmp_path, extra, text):
    out = tmp_path / "bad"
    line = error_line(kvprobe("memory", "--model", "toy-qwen2", "--n", "2", "--out", out, *extra), 2)
    assert text in line and not out.exists()
