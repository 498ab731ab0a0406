"""The probe registry that `kvprobe run` iterates: order, needs, and the report sections it names."""

from __future__ import annotations

import pandas as pd
import pytest

from kvprobe.probes import STAGES, Inputs, ProbeStage, in_order, register
from kvprobe.reports.sections import SECTIONS


def test_the_built_in_probes_in_run_order():
    assert list(STAGES) == ["locality", "attention", "knockout", "linear"]
    assert [s.name for s in in_order(["linear", "knockout", "locality"])] == ["locality", "knockout", "linear"]
    assert [s.name for s in in_order(["knockout"])] == ["knockout"]  # a need that is not asked for is not run


def test_every_probe_names_report_sections_that_exist():
    for stage in STAGES.values():
        assert set(stage.sections) <= set(SECTIONS), (stage.name, stage.sections)


def test_a_stage_runs_after_what_it_needs_and_registers_once():
    stage = register(ProbeStage("early_reader", "early.parquet", lambda inputs: None, needs=("linear",)))
    try:
        assert [s.name for s in in_order(["early_reader", "linear"])] == ["linear", "early_reader"]
        with pytest.raises(ValueError, match="registered twice"):
            register(stage)
    finally:
        STAGES.pop("early_reader")


def test_inputs_give_an_empty_table_for_a_stage_that_did_not_run():
    inputs = Inputs(seed=0, model_name="m", tables={"locality": pd.DataFrame({"a": [1]})})
    assert len(inputs.table("locality")) == 1 and inputs.table("knockout").empty
