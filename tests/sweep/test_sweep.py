"""`kvprobe sweep` on a toy: the per-case measurement's invariants, the tables and the manifest,
a resume after Ctrl-C that redoes no finished case and equals an uninterrupted sweep, and a folder
with other settings refused before any work."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from kvprobe.datasets import AlignedCase, align
from kvprobe.editor.strategies import parse_strategy
from kvprobe.sweep.grid import SweepConfig, cell_cases
from kvprobe.sweep.measure import measure_case
from kvprobe.sweep.summary import cell_verdicts, layout_verdicts, verdict
from tests import cli_process
from tests.conftest import tiny_model

ARGS = ["sweep", "--model", "toy-qwen2", "--layouts", "record,lines", "--filler-tokens", "0,40", "--n", "8",
        "--no-report"]
TABLES = ("sweep.parquet", "sweep_summary.parquet")


def kvprobe(*args) -> subprocess.CompletedProcess:
    """The console entry point in a process of its own (forked from a warm one, tests/cli_process.py)."""
    return cli_process.run(*args, timeout=600)


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep") / "toy"
    proc = kvprobe(*ARGS, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_measure_invariants():
    lm = tiny_model("toy-qwen2")
    cfg = SweepConfig(model="toy-qwen2", layouts=["lines"], filler_tokens=[30], n=6)
    strategies = [parse_strategy(s) for s in ("stale", "field_only", "erratum", "erratum_turn", "oracle")]
    for case in cell_cases(cfg, cfg.cells()[0]):
        a = align(case, lm.tokenizer, "auto")
        assert isinstance(a, AlignedCase)
        df = measure_case(lm, a, strategies, min_flip=0.0, derive=False).set_index(["measure", "name"])
        derived = measure_case(lm, a, strategies, min_flip=0.0).set_index(["measure", "name"])
        pd.testing.assert_series_equal(df.agree, derived.agree)
        assert df.m.to_numpy() == pytest.approx(derived.m.to_numpy(), abs=1e-3, nan_ok=True)
        assert df.loc[("patch", "none"), "m"] == pytest.approx(df.loc[("patch", "none"), "m_stale"])
        assert df.loc[("patch", "all"), "recovery"] == pytest.approx(1.0)
        assert df.loc[("patch", "none"), "recovery"] == pytest.approx(0.0)
        if not df.valid.iloc[0]:
            assert "strategy" not in df.index.get_level_values(0)
            continue
        # recomputing the field over an identical prefix gives the new prompt's field entries
        assert df.loc[("strategy", "field_only"), "m"] == pytest.approx(df.loc[("patch", "field"), "m"], abs=1e-3)
        assert df.loc[("strategy", "oracle"), "m"] == pytest.approx(df.loc[("patch", "all"), "m"], abs=1e-3)
        assert df.loc[("strategy", "oracle"), "agree"] == 1.0 and df.loc[("strategy", "stale"), "agree"] == 0.0
        # the erratum turn reuses the whole old prompt but its generation prompt: it feeds no more than the inline one
        turn, inline = df.loc[("strategy", "erratum_turn")], df.loc[("strategy", "erratum")]
        assert turn.frac_recomputed < 0.5 and inline.frac_recomputed < 0.5


def test_tables_and_manifest(swept):
    rows = pd.read_parquet(swept / "sweep.parquet")
    summary = pd.read_parquet(swept / "sweep_summary.parquet")
    manifest = json.loads((swept / "sweep_manifest.json").read_text())
    cells = ["record.f0.key.allow", "record.f40.key.allow", "lines.f0.key.allow", "lines.f40.key.allow"]
    assert sorted(manifest["cells"]) == sorted(cells) and set(rows.cell) == set(cells)
    for cell, info in manifest["cells"].items():
        assert info["screened"] == 8 and info["wall_s"] > 0 and info["valid_decision"] <= 8
        assert set(rows[rows.cell == cell].case_id.str.split(".").str[0]) == {cell.split(".")[0]}
    assert manifest["wall_s"]["cells"] == pytest.approx(sum(c["wall_s"] for c in manifest["cells"].values()), abs=0.5)
    longer = summary.groupby("filler_tokens").downstream_tokens.mean()
    assert longer[40] > longer[0] + 20  # the knob moves the downstream span
    assert {"field", "downstream", "all", "none"} <= set(summary[summary.measure == "patch"].name)
    assert {"erratum", "erratum_turn", "field_erratum", "cacheblend:0.15", "oracle"} <= set(summary.name)
    field = summary[(summary.measure == "patch") & (summary.name == "field")]
    assert ((field.recovery_lo <= field.recovery) & (field.recovery <= field.recovery_hi)).all()
    assert set(manifest["layout_verdicts"]) == {"record", "lines"}
    assert manifest["layout_verdicts"] == layout_verdicts(cell_verdicts(summary))


def test_verdict_rule():
    assert verdict(0.02, 0.2, 20) == "takes notes"
    assert verdict(0.7, 0.9, 20) == "reads the field"
    assert verdict(0.3, 0.5, 20) == "mixed" and verdict(0.1, 0.7, 20) == "mixed"
    assert verdict(0.0, 0.1, 5) == "inconclusive" and verdict(float("nan"), float("nan"), 30) == "inconclusive"


def test_interrupted_sweep_resumes_without_redoing_cases(swept, tmp_path):
    out = tmp_path / "again"
    proc = cli_process.start(*ARGS, "--out", out)
    parts = out / "parts" / "cells"
    deadline = time.monotonic() + 300
    while not (parts.exists() and len(list(parts.rglob("*.parquet"))) >= 3):
        assert proc.poll() is None, proc.output()[1][-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stderr = proc.wait(timeout=120).stderr
    assert proc.returncode == 130, stderr[-2000:]
    assert "rerun the same command to resume" in stderr
    before = {p: p.stat().st_mtime_ns for p in parts.rglob("*.parquet")}
    assert 3 <= len(before) < 32
    resumed = kvprobe(*ARGS, "--out", out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())  # finished cases were not redone
    manifest = json.loads((out / "sweep_manifest.json").read_text())
    assert sum(c["resumed"] for c in manifest["cells"].values()) == len(before)
    for table in TABLES:
        a, b = pd.read_parquet(swept / table), pd.read_parquet(out / table)
        timing = [c for c in a if c in ("wall_s", "decide_s", "case_s")]
        pd.testing.assert_frame_equal(a.drop(columns=timing), b.drop(columns=timing))


def test_a_folder_with_other_settings_is_refused(swept):
    before = {p: p.stat().st_mtime_ns for p in swept.rglob("*")}
    proc = kvprobe(*[a if a != "0,40" else "0,80" for a in ARGS], "--out", swept)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "sweep with other settings" in proc.stderr and "filler_tokens" in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in swept.rglob("*")} == before


def test_bad_sweep_options_are_one_line_errors(tmp_path):
    for args, words in ((["--layouts", "record,xml"], "layouts"), (["--filler-tokens", "0,-5"], "filler-tokens"),
                        (["--field-styles", "camel"], "field-styles"), (["--strategies", "telepathy"], "telepathy")):
        proc = kvprobe("sweep", "--model", "toy-qwen2", *args, "--out", tmp_path / "bad")
        assert proc.returncode == 2, proc.stderr
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and words in errors[0] and "Traceback" not in proc.stderr
        assert not (tmp_path / "bad").exists()
