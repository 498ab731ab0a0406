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


@pytest.mark.parametrize("extra, text", [
    (["--margin", "0"], "--margin"), (["--alpha", "0.5"], "--alpha"), (["--seams", "-1"], "--seams"),
    (["--seams", "a"], "--seams"), (["--session-tokens", "10,20"], "session_tokens"),
    (["--session-tokens", "40"], "--session-tokens"), (["--questions-per-user", "2"], "questions_per_user"),
    (["--sessions", "0"], "sessions")])
def test_bad_options_are_one_line_before_any_work(tmp_path, extra, text):
    out = tmp_path / "bad"
    line = error_line(kvprobe("memory", "--model", "toy-qwen2", "--n", "2", "--out", out, *extra), 2)
    assert text in line and not out.exists()
