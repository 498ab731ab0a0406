"""The run's shared and batched forward passes (issue 20) compute the tables the one-pass-per-read
run computed: every table of a tiny-model run and a toy-model run, against the tables commit
c1257f3 wrote for the same configurations (tests/data/golden, by scripts/golden_tables.py), equal
to 1e-4 in every numeric column and exactly elsewhere (timing columns aside)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


golden, compare_runs = _script("golden_tables"), _script("compare_runs")


@pytest.mark.parametrize("name", list(golden.CONFIGS))
def test_same_tables_as_before_the_shared_passes(name, tmp_path):
    folder = golden.run_config(name, tmp_path / name)
    lines = compare_runs.compare(ROOT / "tests" / "data" / "golden" / name, folder, set(compare_runs.TIMING),
                                 atol=1e-4)
    assert len(lines) >= 5 and not [line for line in lines if line.startswith("DIFF")], "\n".join(lines)
