"""``kvprobe run`` as a pipeline: resuming an interrupted run, settings checks, the composition stage."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvprobe import pipeline as P
from kvprobe.errors import KvprobeError
from kvprobe.results import COMPOSE, EDITS, RUN_MANIFEST
from tests.conftest import tiny_model

SMALL = dict(model="tiny-llama", n=4, valid_only=False, probes=["locality"], ks=[1, 2],
             strategies=["stale", "field_only", "oracle"], rankings=["causal", "random"])


@pytest.fixture(scope="module")
def lm():
    return tiny_model("tiny-llama")


def test_interrupted_run_resumes_without_redoing_finished_cases(lm, tmp_path, monkeypatch):
    cfg = P.RunConfig(**SMALL)
    first = P.run(cfg, tmp_path, lm=lm)
    edits = pd.read_parquet(tmp_path / EDITS)
    parts = sorted((tmp_path / "parts" / "edits").glob("*.parquet"))
    assert len(parts) == edits.case_id.nunique() >= 2

    # a crash after the first edit part: the manifest and the later parts never got written
    (tmp_path / RUN_MANIFEST).unlink()
    for p in parts[1:]:
        p.unlink()
    redone = []
    real = P.edit_case

    def counting(lm_, case, *a, **k):
        redone.append(case.case.case_id)
        return real(lm_, case, *a, **k)

    monkeypatch.setattr(P, "edit_case", counting)
    second = P.run(cfg, tmp_path, lm=lm)
    assert sorted(redone) == sorted(p.name.split(".")[0] for p in parts[1:])
    assert second["counts"] == first["counts"]
    again = pd.read_parquet(tmp_path / EDITS)
    cols = ["case_id", "strategy", "cot", "pred", "m"]
    pd.testing.assert_frame_equal(again[cols].sort_values(cols, ignore_index=True),
                                  edits[cols].sort_values(cols, ignore_index=True))


def test_a_folder_with_other_settings_is_refused_but_an_older_config_resumes(lm, tmp_path):
    cfg = P.RunConfig(**SMALL)
    P.run(cfg, tmp_path, lm=lm)
    with pytest.raises(KvprobeError, match="different configuration"):
        P.run(P.RunConfig(**{**SMALL, "n": 5}), tmp_path, lm=lm)
    # a config.json written before a field existed: the field's default fills it in
    stored = json.loads((tmp_path / "config.json").read_text())
    for key in ("compose", "compose_seams"):
        stored.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(stored))
    P.run(cfg, tmp_path, lm=lm)


def test_run_with_compose_writes_the_gate_table_into_the_folder(lm, tmp_path):
    cfg = P.RunConfig(**{**SMALL, "compose": 2, "compose_seams": [4, 0]})
    assert cfg.compose_seams == [0, 4]
    manifest = P.run(cfg, tmp_path, lm=lm)
    df = pd.read_parquet(tmp_path / COMPOSE)
    assert df.query_id.nunique() == 2 and sorted(df.seam.unique()) == [0, 4] and set(df.rerotate) == {True, False}
    assert {(r["rerotate"], r["seam"]) for r in manifest["compose"]} == {(a, s) for a in (True, False) for s in (0, 4)}
    assert len(list((tmp_path / "blocks").glob("*.safetensors"))) >= 1
    assert "compose" in manifest["wall_s"]

    from kvprobe.reports.html import render_report

    html = render_report([tmp_path], tmp_path / "report.html").read_text()
    assert "Composition" in html


def test_bad_compose_settings_are_refused():
    with pytest.raises(ValueError, match="compose_seams"):
        P.RunConfig(compose_seams=[])
    with pytest.raises(ValueError):
        P.RunConfig(compose=-1)


def test_max_controls_carries_a_seeded_sample_of_the_valid_controls_into_the_edits(lm, tmp_path):
    base = dict(SMALL, n=20, probes=[], strategies=["stale", "oracle"], rankings=["random"])
    manifest = P.run(P.RunConfig(**base), tmp_path / "all", lm=lm)
    validity = pd.read_parquet(tmp_path / "all" / "validity.parquet")
    valid_controls = set(validity[validity.control & validity.valid].case_id)
    assert manifest["counts"]["valid_control"] == manifest["counts"]["edited_controls"] == len(valid_controls) >= 2

    capped = P.run(P.RunConfig(**base, max_controls=1), tmp_path / "one", lm=lm)
    assert capped["counts"]["valid_control"] == len(valid_controls) and capped["counts"]["edited_controls"] == 1
    edits = pd.read_parquet(tmp_path / "one" / EDITS)
    edited = set(edits[edits.control].case_id)
    assert len(edited) == 1 and edited <= valid_controls
    assert set(edits[~edits.control].case_id) == set(validity[~validity.control].case_id)  # decisions untouched
    with pytest.raises(ValueError):
        P.RunConfig(max_controls=-1)


def test_a_strategy_both_in_the_list_and_in_the_k_sweep_gets_one_row_per_case(lm, tmp_path):
    cfg = P.RunConfig(**{**SMALL, "strategies": ["stale", "selective:1:random", "oracle"]})
    P.run(cfg, tmp_path, lm=lm)
    edits = pd.read_parquet(tmp_path / EDITS)
    held = set(edits[edits.strategy == "selective:2:random"].case_id)
    assert held and not edits.duplicated(["case_id", "strategy", "cot"]).any()
    assert (edits.strategy == "selective:1:random").sum() == edits.case_id.nunique()


def test_edit_rows_time_the_repair_and_the_road_to_the_decision_separately(lm, tmp_path):
    """An erratum's cost is the line it feeds, not the crop before it: ``decide_s`` times the tail
    up to the decision logits (without CoT; with CoT the strategies reason as one batch)."""
    from kvprobe.cli.common import console
    from kvprobe.cli.edit import print_summary
    from kvprobe.metrics import summarize_edits

    cfg = P.RunConfig(**{**SMALL, "strategies": ["stale", "erratum", "oracle"], "cot": [0, 2]})
    P.run(cfg, tmp_path, lm=lm)
    edits = pd.read_parquet(tmp_path / EDITS)
    main = edits[edits.strategy.isin(cfg.strategies)]
    assert (main[main.cot == 0].decide_s > 0).all() and main[main.cot == 2].decide_s.isna().all()
    summ = summarize_edits(main).set_index(["strategy", "cot"])
    assert (summ.loc[(slice(None), 0), "to_decision_s"] > summ.loc[(slice(None), 0), "wall_s"]).all()
    assert summ.loc[(slice(None), 2), "to_decision_s"].isna().all()
    # a threshold no case reaches leaves recovery undefined everywhere: said, not printed as nan
    no_recovery = main.assign(recovery=float("nan"))
    with console.capture() as cap:
        print_summary(no_recovery, True, "tiny", min_flip=1e9)
    assert "nan" not in cap.get() and "- (0)" in cap.get()
    assert "with cot=0: no recovery ratio, since no case's |oracle flip| reaches min_flip=1e+09" in cap.get()


def test_no_case_reaching_min_flip_means_no_causal_ranking_and_says_why(lm, tmp_path):
    """An empty rule would rank by position alone; it is not run as 'causal', and topk.yaml says why."""
    import yaml

    from kvprobe.results import RANKING_RULE

    P.run(P.RunConfig(**{**SMALL, "min_flip": 1e9}), tmp_path, lm=lm)
    edits = pd.read_parquet(tmp_path / EDITS)
    assert not (edits.ranking == "causal").any() and (edits.ranking == "random").any()
    rule = json.loads((tmp_path / RANKING_RULE).read_text())["rule"]
    assert rule["n_training_cases"] == 0 and "min_flip=1e+09" in rule["note"]
    topk = yaml.safe_load((tmp_path / "topk.yaml").read_text())
    assert topk["k_star"] is None and topk["reason"].startswith("no causal ranking rule: none of the")
    assert "--min-flip" in topk["reason"]


def test_the_configured_erratum_template_reaches_the_editor_and_topk(lm, tmp_path):
    """An ``erratum`` without a template of its own uses ``erratum_template``; its rows say which."""
    import yaml

    from kvprobe.datasets import SHORT_ERRATUM

    cfg = P.RunConfig(**{**SMALL, "strategies": ["stale", "erratum", "field_erratum:paper", "oracle"],
                         "erratum_template": "short"})
    P.run(cfg, tmp_path, lm=lm)
    edits = pd.read_parquet(tmp_path / EDITS)
    assert {"erratum:short", "field_erratum"} <= set(edits.strategy) and "erratum" not in set(edits.strategy)
    assert yaml.safe_load((tmp_path / "topk.yaml").read_text())["erratum_template"] == SHORT_ERRATUM


def test_each_case_is_prefilled_once_and_the_cost_is_in_the_manifest(lm, tmp_path, monkeypatch):
    """Validity builds each case's caches; every later stage reuses them (no second build), and the
    manifest says what each stage cost in prefill-equivalents (over the oracle's prefill)."""
    from kvprobe.probes import engine

    built = []
    real = engine.PairCaches.build.__func__

    def counting(cls, lm_, a, residuals=False):
        built.append(a.case.case_id)
        return real(cls, lm_, a, residuals)

    monkeypatch.setattr(engine.PairCaches, "build", classmethod(counting))
    cfg = P.RunConfig(**{**SMALL, "probes": ["locality", "attention", "knockout", "linear"]})
    manifest = P.run(cfg, tmp_path, lm=lm)
    assert sorted(built) == sorted(set(built)) and len(built) == manifest["counts"]["aligned"]
    profile = manifest["prefill_equivalents"]
    assert profile["prefill_s"] > 0 and profile["valid_cases"] == manifest["counts"]["probed_decision"]
    assert {"validity", "locality", "attention", "knockout", "linear", "edits"} <= set(profile["per_valid_case"])
    assert profile["total_per_valid_case"] == pytest.approx(sum(profile["per_valid_case"].values()), abs=0.01)
    assert len(profile["cases"]["validity"]) == manifest["counts"]["aligned"]


def test_a_results_table_is_read_by_the_kinds_of_its_columns(tmp_path):
    """read_table: missing values, flags stored as 0/1, a column it has no kind for and a table of no rows
    pass; text in a number column, a number in a text column and 2 in a flag column do not, named."""
    import numpy as np

    from kvprobe.results import read_table

    path = tmp_path / EDITS
    ok = pd.DataFrame({"case_id": ["a", None], "k": [8, None], "agree": [1.0, np.nan], "valid": [True, False],
                       "extra": [[1], [2, 3]]})
    ok.to_parquet(path)
    assert read_table(path, ("case_id", "agree")).equals(pd.read_parquet(path))
    pd.DataFrame({"case_id": pd.Series([], dtype=str)}).to_parquet(path)
    assert read_table(path, ("agree",)).empty  # no case finished: nothing to check
    for change, needle in ((dict(k=["x", "y"]), "column k holds 'x', where whole numbers belong"),
                           (dict(case_id=[1, 2]), "column case_id holds 1, where strings belong"),
                           (dict(agree=[1.0, 2.0]), "column agree holds 2.0, where true/false flags belong")):
        ok.assign(**change).to_parquet(path)
        with pytest.raises(KvprobeError, match=f"^{path} is not an edits table as kvprobe writes it .{needle}"):
            read_table(path)
    with pytest.raises(KvprobeError, match=r"no column recovery, cot"):
        ok.to_parquet(path)
        read_table(path, ("case_id", "recovery", "cot"))


def test_a_sized_run_stops_on_its_targets_or_says_its_budget_ran_out(tmp_path):
    """Without n, a run checks cases in order until each leg of the repair rule can be established
    (here threshold 0.8: 16 valid decision cases, 16 valid controls) and no further; with too small a
    budget it checks every case and says which target fell short. summary.json records both."""
    from kvprobe.models import load_model
    from kvprobe.reports.summary import write_summary

    toy = load_model("toy-qwen2")
    base = dict(model="toy-qwen2", threshold=0.8, probes=[], strategies=["stale", "field_only", "oracle"])
    manifest = P.run(P.RunConfig(**base, budget=150), tmp_path / "sized", lm=toy)
    sizing = manifest["sizing"]
    assert sizing["per_leg"] == 16 and sizing["stopped"] == "targets reached"
    assert sizing["valid_decision_found"] == 16 and sizing["valid_controls_found"] == 16
    assert manifest["counts"]["checked"] == sizing["checked"] < manifest["counts"]["aligned"] == 150
    validity = pd.read_parquet(tmp_path / "sized" / "validity.parquet")
    assert len(validity) == sizing["checked"] and int((validity.valid & ~validity.control).sum()) == 16
    summary = json.loads(write_summary(tmp_path / "sized").read_text())
    assert summary["validity"]["sizing"] == sizing and "stopped there, on validity alone" in summary["headline"][-1]

    short = P.run(P.RunConfig(**base, budget=30), tmp_path / "short", lm=toy)["sizing"]
    assert short["stopped"] == "budget ran out" and short["checked"] <= 30
    assert "valid controls of the 16 needed" in short["reason"] and "larger --budget" in short["reason"]
