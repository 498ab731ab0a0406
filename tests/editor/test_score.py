"""The one measurement core (kvprobe.editor.score): one row vocabulary for every table that sets a
repair against the oracle, one validity rule, and strategies parsed once at the config's edge."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest

from kvprobe import editor
from kvprobe.datasets import align, generate
from kvprobe.editor import score
from kvprobe.editor import strategies as strategy_module
from kvprobe.editor.runner import edit_case, run_edits
from kvprobe.kv.readout import valid_case
from tests.conftest import tiny_model

SPECS = ["stale", "field_only", "selective:2:random", "erratum", "oracle"]


def aligned_case(index: int = 1):
    lm = tiny_model("tiny-llama")
    return lm, align(generate(4, seed=11)[index], lm.tokenizer, "raw")


def test_measure_strategies_scores_stale_oracle_and_each_strategy_in_the_edit_tables_vocabulary():
    lm, a = aligned_case()
    typed = [editor.parse_strategy(s) for s in ["erratum", "field_only", "erratum"]]  # erratum twice: one row
    rows = score.measure_strategies(lm, a, typed, min_flip=0.0)
    assert list(rows.columns) == [*score.ROW_COLUMNS, "margin", "read_batch"] and (rows.read_batch == 1).all()
    assert list(rows.strategy) == ["stale", "oracle", "erratum", "field_only"]
    by = rows.set_index("strategy")
    assert by.loc["oracle", "agree"] and by.loc["oracle", "recovery"] == pytest.approx(1.0)
    assert by.loc["stale", "recovery"] == pytest.approx(0.0) and by.loc["stale", "frac_recomputed"] == 0
    assert (rows.reference == by.loc["oracle", "pred"]).all()
    assert (rows.agree == (rows.pred == rows.reference)).all() and (rows.margin >= 0).all()
    assert (rows.m_stale == by.loc["stale", "m"]).all() and (rows.m_oracle == by.loc["oracle", "m"]).all()


def test_the_same_rows_as_edit_case():
    """edit_case (batched reads) and measure_strategies (one read each) score alike."""
    lm, a = aligned_case()
    typed = [editor.parse_strategy(s) for s in SPECS]
    mine = score.measure_strategies(lm, a, typed).set_index("strategy")
    theirs = edit_case(lm, a, typed).set_index("strategy")
    for col in ("m", "m_stale", "m_oracle", "recovery", "cosine", "kl"):
        assert mine[col].to_numpy() == pytest.approx(theirs.loc[mine.index, col].to_numpy(), abs=1e-4, nan_ok=True)
    for col in ("pred", "reference", "agree", "tokens_recomputed", "tokens_total", "k", "ranking", "chose", "note"):
        pd.testing.assert_series_equal(mine[col], theirs.loc[mine.index, col], check_dtype=False)
    assert bool(theirs.valid.iloc[0]) == valid_case(a.case, mine.loc["stale", "pred"], mine.loc["oracle", "pred"])


def test_batched_reads_give_the_reads_one_by_one():
    """Issue 54, item 2: the states of one shape (stale, the oracle, field_only and selective: a cache of D
    and the decision token) read as one batch give the decisions read one by one, the logits within float
    rounding; each row says how many reads shared its batch, and the errata (another shape) are read alone."""
    lm, a = aligned_case()
    typed = [editor.parse_strategy(s) for s in SPECS]
    alone = score.measure_strategies(lm, a, typed, batch_reads=False).set_index("strategy")
    batched = score.measure_strategies(lm, a, typed, batch_reads=True).set_index("strategy")
    for col in ("pred", "reference", "agree", "tokens_recomputed", "tokens_total"):
        pd.testing.assert_series_equal(alone[col], batched[col], check_dtype=False)
    for col in ("m", "m_stale", "m_oracle", "margin", "cosine", "kl"):
        assert batched[col].to_numpy() == pytest.approx(alone[col].to_numpy(), abs=1e-4, nan_ok=True)
    assert batched.read_batch.to_dict() == {"stale": 4, "oracle": 4, "field_only": 4, "selective:2:random": 4,
                                           "erratum": 1}
    assert len(set(batched.loc[["stale", "oracle", "field_only"], "decide_s"])) == 1  # the batch's seconds


def test_whether_a_batch_pays_is_measured_once_per_model_and_size(monkeypatch):
    """batch_reads=None batches where one batched read was measured to cost less than 0.9 of as many single
    reads, measured once per model and number of rows in the process."""
    lm, a = aligned_case()
    typed = [editor.parse_strategy("field_only")]
    calls = []
    real = score.decide_batch

    def counted(lm_, states):
        calls.append(len(states))
        return real(lm_, states)

    monkeypatch.setattr(score, "_PAYS", score.weakref.WeakKeyDictionary())
    monkeypatch.setattr(score, "decide_batch", counted)
    first = score.measure_strategies(lm, a, typed, batch_reads=None)
    measured = score.batch_measured(lm)
    assert [m["rows"] for m in measured] == [3] and calls[:2] == [3, 3]  # two timed tries of the batch
    again = score.measure_strategies(lm, a, typed, batch_reads=None)
    assert len(score.batch_measured(lm)) == 1  # not measured again
    expect = 3 if measured[0]["batched"] else 1
    assert (first.read_batch == expect).all() and (again.read_batch == expect).all()
    assert measured[0]["batched"] == (measured[0]["batch_s"] < 0.9 * 3 * measured[0]["single_s"])


def test_a_strategy_that_cannot_repair_the_case_is_an_error_row():
    lm, a = aligned_case()
    a = dataclasses.replace(a, case=a.case.model_copy(update={"rule": ""}))  # a prompt hoist cannot rewrite
    rows = score.measure_strategies(lm, a, [editor.Hoist(), editor.FieldOnly()]).set_index("strategy")
    assert "hoist" in rows.loc["hoist", "error"] and rows.loc["hoist", "reference"] == rows.loc["oracle", "pred"]
    assert pd.isna(rows.loc["hoist", "agree"]) and pd.isna(rows.loc["field_only", "error"])


def test_validity_is_one_rule():
    case = generate(4, seed=11)[1]
    assert valid_case(case, case.expected_old, case.expected_new)
    assert not valid_case(case, case.expected_new, case.expected_new)
    assert not valid_case(case, case.expected_old, case.expected_old)


def test_configs_parse_their_strategies_once_and_dump_the_specs_as_given(monkeypatch):
    from kvprobe import config
    from kvprobe.sweep import grid

    calls = []
    parse = strategy_module.parse_strategy
    for module in (config, grid):
        monkeypatch.setattr(module, "parse_strategy", lambda spec, **kw: calls.append(spec) or parse(spec, **kw))
    specs = ["erratum", " selective:8:causal", "cacheblend:0.150"]
    cfg = config.RunConfig(model="tiny-llama", strategies=specs, erratum_template="short")
    assert len(calls) == 3
    assert [s.label for s in cfg.edit_strategies()] == ["erratum:short", "selective:8:causal", "cacheblend:0.15"]
    assert cfg.edit_strategies() == cfg.edit_strategies() and len(calls) == 3  # held, not parsed again
    assert cfg.model_dump()["strategies"] == specs  # config.json keeps the specs as given
    assert json.dumps(config.RunConfig(**cfg.model_dump()).model_dump()) == json.dumps(cfg.model_dump())
    changed = cfg.model_copy(update={"strategies": ["oracle"]})  # no validation: parsed when asked
    assert [s.label for s in changed.edit_strategies()] == ["oracle"]
    calls.clear()
    sweep = grid.SweepConfig(model="toy-qwen2", strategies=["erratum:paper", "cacheblend:0.150"])
    assert sweep.strategies == ["erratum", "cacheblend:0.15"] and len(calls) == 2
    assert sweep.edit_strategies() == [editor.Erratum(), editor.CacheBlend(0.15)] and len(calls) == 2


def test_run_edits_takes_typed_strategies_without_parsing_them(monkeypatch):
    lm, a = aligned_case()
    typed = [editor.parse_strategy(s) for s in ("field_only", "erratum:short")]
    strings = run_edits(lm, [a.case], ["field_only", "erratum:short"], form="raw")[0]
    from kvprobe.editor import runner

    monkeypatch.setattr(runner, "parse_strategy", lambda spec, **kw: pytest.fail(f"parsed {spec} again")
                        if spec not in ("stale", "oracle") else strategy_module.parse_strategy(spec, **kw))
    again = run_edits(lm, [a.case], typed, form="raw")[0]
    timing = ["wall_s", "decide_s"]
    pd.testing.assert_frame_equal(strings.drop(columns=timing), again.drop(columns=timing))
