"""The run's shared and batched forward passes (issue 20) compute the tables the one-pass-per-read
run computed: every table of a tiny-model run and a toy-model run, against the tables commit
c1257f3 wrote for the same configurations (tests/data/golden, by scripts/golden_tables.py), on
any of the CPU kinds this project runs on (issue 36).

A continuous value must agree within ``compare_runs.NOISE`` (1e-4 logits: five times the largest
difference two CPU kinds' kernels gave); a note set that sits within float noise of its boundary
is pinned to the reference's ranking and counted; a verdict within noise of its threshold is set
aside and counted (scripts/compare_runs.py says why each). So that a CPU dependence shows on one
machine, each configuration also runs under another float order: transformers' own eager
attention (``repeat_kv``, another summation order than kvprobe's grouped one) on 1 torch thread,
which moved the toy's tables exactly as a Zen 3 did (a top-8 note set, m by 3.3e-3,
acc_shuffled by 0.25) before the pinning. And the check still fails on a deliberate change.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


golden, compare_runs = _script("golden_tables"), _script("compare_runs")
GOLDEN = ROOT / "tests" / "data" / "golden"


def _compare(name: str, out: Path) -> tuple[list[str], list[str]]:
    with compare_runs.pinned_notes(GOLDEN / name) as pinned:
        folder = golden.run_config(name, out)
    lines = compare_runs.compare(GOLDEN / name, folder, set(compare_runs.TIMING), atol=compare_runs.NOISE)
    return lines, compare_runs.pinned_lines(pinned)


@pytest.mark.parametrize("order", ["as_built", "other_float_order"])
@pytest.mark.parametrize("name", list(golden.CONFIGS))
def test_same_tables_as_before_the_shared_passes(name, order, tmp_path):
    with golden.other_float_order() if order == "other_float_order" else nullcontext():
        lines, pinned = _compare(name, tmp_path / name)
    print("\n".join(pinned + lines))
    assert len(lines) >= 5 and not [line for line in lines if line.startswith("DIFF")], "\n".join(pinned + lines)


def test_a_deliberate_change_still_fails_the_check(tmp_path, monkeypatch):
    """One probe reading the wrong layer (the edge knockout hides each chosen edge one layer up,
    its rows still labelled as before) and one strategy recomputing one token fewer (selective
    drops its last position): both tables differ, in their values."""
    from kvprobe.editor import runner
    from kvprobe.probes import knockout

    real_reads, real_many = knockout.knockout_reads, runner.recompute_many
    monkeypatch.setattr(knockout, "knockout_reads",
                        lambda lm, cache, token, position, hidden, **kw:
                        real_reads(lm, cache, token, position, torch.roll(hidden, 1, dims=1), **kw))
    monkeypatch.setattr(runner, "recompute_many",
                        lambda lm, cache, ids, sets: real_many(lm, cache, ids, [sorted(s)[:-1] for s in sets]))
    lines, _ = _compare("toy-qwen2", tmp_path / "toy-qwen2")
    print("\n".join(lines))
    assert any(line.startswith("DIFF knockout.parquet") and 'name="value"' in line for line in lines), lines
    assert any(line.startswith("DIFF edits.parquet") and 'name="m"' in line for line in lines), lines


def test_a_diff_line_names_the_column_that_moved_and_how_many_rows(tmp_path):
    """A DIFF line names the column whose values moved most and counts its rows past the bound,
    not pandas' first complaint: the reference stores `layer` as int64 where a run stores Int64,
    which once made the linear table's 0.25 in `value` read as a difference in `layer`."""
    import pandas as pd

    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir(), after.mkdir()
    ref = pd.DataFrame({"layer": [0, 1, 2, 3], "metric": ["acc"] * 4, "value": [0.5, 0.25, 0.75, 1.0]})
    ref.to_parquet(before / "linear.parquet")
    run = ref.assign(layer=ref["layer"].astype("Int64"), value=[0.5, 0.5, 0.75, 1.0 + 5e-5])
    run.to_parquet(after / "linear.parquet")
    lines = compare_runs.compare(before, after, set(), atol=compare_runs.NOISE)
    assert lines == ['DIFF linear.parquet: column name="value" differs beyond 0.0001 in 1 of 4 rows '
                     "(largest difference 0.25)"], lines
    run.assign(value=ref["value"] + 5e-5).to_parquet(after / "linear.parquet")  # within noise; the dtype is no change
    assert compare_runs.compare(before, after, set(), atol=compare_runs.NOISE)[0].startswith("within 0.0001 linear")
    run.assign(value=[0.5, None, 0.75, 1.0]).to_parquet(after / "linear.parquet")  # a value lost
    assert compare_runs.compare(before, after, set(), atol=compare_runs.NOISE) == [
        'DIFF linear.parquet: column name="value" differs beyond 0.0001 in 1 of 4 rows (largest difference inf)']
