"""The per-model policy file: ``export_topk`` writes the strategies section from a run folder and a
sweep folder (checked against a hand computation), :func:`kvprobe.policy.load` reads it back for
its own model only, ``cheapest`` picks by the documented rule, ``ranking`` ranks, and every
refusal is one line. The folders are synthetic tables, so no model runs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import pytest
import yaml

from kvprobe import policy as P
from kvprobe.datasets import ERRATUM_TEMPLATES
from kvprobe.editor.causal_rule import RankingRule
from kvprobe.editor.topk import NO_RANKING, cases_to_establish, export_topk, k_star_fields, k_sweep
from kvprobe.errors import KvprobeError
from kvprobe.intervals import proportion_ci, wilson_share
from kvprobe.metrics import proportion
from kvprobe.results import (
    EDITS,
    RUN_MANIFEST,
    RANKING_RULE,
    SWEEP,
    SWEEP_CLAIM,
    SWEEP_MANIFEST,
)
from tests.conftest import tiny_model

HELD = ["h1", "h2", "h3", "h4"]
CONTROLS = ["c1", "c2"]
SCORES = {"word|2|1": 0.1, "newline|1|2": 0.5}


@pytest.fixture(scope="module")
def lm():
    return tiny_model("tiny-qwen2")


def _row(case_id: str, strategy: str, agree, frac: float, *, control: bool = False, valid: bool = True,
         cot: int = 0, ranking=None, k=None, wall: float = 0.01) -> dict:
    return {"model": "tiny-qwen2", "case_id": case_id, "strategy": strategy, "k": k, "ranking": ranking,
            "agree": agree, "recovery": float(bool(agree)) if agree is not None else None,
            "frac_recomputed": frac, "wall_s": wall, "decide_s": wall / 2, "error": None if agree is not None
            else "cannot rewrite", "control": control, "cot": cot, "valid": valid}


def run_edits() -> pd.DataFrame:
    """Held-out decision cases h1-h4, controls c1-c2; rows that must not count: the ranking case r1
    under the causal ranking learned from it, the invalid case h5 and a chain-of-thought row."""
    rows = []
    for c in HELD + CONTROLS:
        ctl = c in CONTROLS
        rows += [_row(c, "stale", ctl, 0.0, control=ctl), _row(c, "oracle", True, 1.0, control=ctl),
                 _row(c, "cacheblend:0.15", True, 0.2, control=ctl), _row(c, "auto", True, 0.01, control=ctl),
                 _row(c, "hoist", None if c == "h1" else True, 0.01, control=ctl)]
    frac = {"h1": 0.04, "h2": 0.05, "h3": 0.06, "h4": 0.05, "c1": 0.05, "c2": 0.05}
    rows += [_row(c, "field_only", c != "h4", frac[c], control=c in CONTROLS) for c in HELD + CONTROLS]
    wall = {"h1": 0.1, "h2": 0.2, "h3": 0.3, "h4": 0.4, "c1": 0.5, "c2": 0.6}
    rows += [_row(c, "erratum_turn", c != "c2", 0.1, control=c in CONTROLS, wall=wall[c]) for c in HELD + CONTROLS]
    rows += [_row(c, "selective:2:causal", True, 0.12, ranking="causal", k=2) for c in HELD]
    rows += [_row("r1", "selective:2:causal", False, 0.9, ranking="causal", k=2)]
    rows += [_row("h5", s, False, 0.9, valid=False) for s in ("field_only", "erratum_turn", "selective:2:causal")]
    rows += [_row("h1", s, False, 0.9, cot=8) for s in ("field_only", "erratum_turn")]
    return pd.DataFrame(rows)


def run_folder(folder, fingerprint: dict):
    folder.mkdir()
    (folder / RUN_MANIFEST).write_text(json.dumps({
        "kvprobe_run": 1, "config": {"model": fingerprint["spec"], "erratum_template": ERRATUM_TEMPLATES["short"]},
        "model": fingerprint, "n_layers": 2}))
    (folder / RANKING_RULE).write_text(json.dumps({
        "rule": {"kind": "position-key table", "n_training_cases": 3, "scores": SCORES}, "ranking_cases": ["r1"],
        "held_out_cases": HELD + ["h5"], "kinds_at_top": {"newline": 1.0}, "max_downstream": 5}))
    run_edits().to_parquet(folder / EDITS)
    return folder


def sweep_folder(folder, fingerprint: dict):
    """Two cells; stale and oracle derived from the patch reads (no wall time), one error row."""
    folder.mkdir()
    (folder / SWEEP_CLAIM).write_text(json.dumps({"model": fingerprint["spec"]}))
    (folder / SWEEP_MANIFEST).write_text(json.dumps({"kvprobe_sweep": 1, "config": {"model": fingerprint["spec"]},
                                                     "model": fingerprint}))
    rows = []
    for cell in ("record.f0", "lines.f0"):
        for i, control in enumerate((False, False, True)):
            case = f"{cell}.{i}"
            base = {"cell": cell, "case_id": case, "control": control, "valid": True, "error": None}
            rows.append({**base, "measure": "patch", "name": "field", "agree": 0.0, "frac_recomputed": None,
                         "wall_s": None})
            rows += [{**base, "measure": "strategy", "name": "stale", "agree": float(control), "frac_recomputed": 0.0,
                      "wall_s": None},
                     {**base, "measure": "strategy", "name": "oracle", "agree": 1.0, "frac_recomputed": 1.0,
                      "wall_s": None},
                     {**base, "measure": "strategy", "name": "erratum", "agree": float(i != 1),
                      "frac_recomputed": 0.3, "wall_s": 0.2}]
            turn = {**base, "measure": "strategy", "name": "erratum_turn", "agree": 1.0, "frac_recomputed": 0.25,
                    "wall_s": 0.1}
            rows.append(turn if (cell, i) != ("lines.f0", 0) else
                        {**turn, "agree": None, "frac_recomputed": None, "wall_s": None, "error": "no second turn"})
        rows.append({"cell": cell, "case_id": f"{cell}.bad", "control": False, "valid": False, "error": None,
                     "measure": "patch", "name": "field", "agree": 1.0, "frac_recomputed": None, "wall_s": None})
    pd.DataFrame(rows).to_parquet(folder / SWEEP)
    return folder


def entry(cfg: dict, spec: str) -> dict:
    return next(e for e in cfg["strategies"] if e["spec"] == spec)


# -- export: the strategies section, by hand ---------------------------------------------------------
def test_run_folder_export_keeps_topk_and_adds_the_strategies(lm, tmp_path):
    path = export_topk(run_folder(tmp_path / "run", lm.fingerprint()))
    cfg = yaml.safe_load(path.read_text())
    assert cfg["schema_version"] == 4 and cfg["model"] == lm.fingerprint()
    assert list(cfg)[:11] == ["schema_version", "model", "threshold", "judged_on", "ranking_rule", "recompute",
                              "token_kinds_at_top", "erratum_template", "k_sweep", "k_star", "k_star_status"]
    # K=2 agrees on all 4 held-out cases (valid, no CoT), but [0.51, 1.00] does not reach 0.95: no K*
    assert cfg["k_star"] is None and cfg["k_star_status"] == "not established" and cfg["k_candidate"] == 2
    assert cfg["n_cases"] == 4 and cfg["agreement"] == 1.0 and cfg["agreement_ci95"] == [0.5101, 1.0]
    assert "about 73 held-out cases, all agreeing, would be needed" in cfg["reason"]
    # the sweep starts at K = 0: field_only on the same held-out cases
    assert [(r["k"], r["agreement"], r["n"]) for r in cfg["k_sweep"]] == [(0, 0.75, 4), (2, 1.0, 4)]
    assert cfg["erratum_template"] == ERRATUM_TEMPLATES["short"]
    assert [e["spec"] for e in cfg["strategies"]] == ["stale", "oracle", "cacheblend:0.15", "auto", "hoist",
                                                      "field_only", "erratum_turn", "selective:2:causal"]
    turn = entry(cfg, "erratum_turn")  # h5 (invalid) and the CoT rows left out
    assert turn == {"spec": "erratum_turn", "agreement": 1.0, "agreement_ci95": [0.5101, 1.0], "n": 4,
                    "control_invariance": 0.5, "n_controls": 2, "frac_recomputed": 0.1,
                    "wall_s": pytest.approx(0.35), "decide_s": pytest.approx(0.175), "n_errors": 0}
    field = entry(cfg, "field_only")
    assert field["agreement"] == 0.75 and field["agreement_ci95"] == [0.3006, 0.9544]
    assert field["control_invariance"] == 1.0 and field["frac_recomputed"] == pytest.approx(0.05)
    stale = entry(cfg, "stale")
    assert stale["agreement"] == 0.0 and stale["control_invariance"] == 1.0
    selective = entry(cfg, "selective:2:causal")  # r1 taught the causal rule: left out
    assert selective["n"] == 4 and selective["n_controls"] == 0 and selective["control_invariance"] is None
    hoist = entry(cfg, "hoist")  # its error row counts as an error, not as a disagreement
    assert hoist["n"] == 3 and hoist["n_errors"] == 1 and hoist["agreement"] == 1.0


def test_sweep_folder_export(lm, tmp_path):
    path = export_topk(sweep_folder(tmp_path / "sweep", lm.fingerprint()))
    assert path == tmp_path / "sweep" / "topk.yaml"
    cfg = yaml.safe_load(path.read_text())
    assert cfg["schema_version"] == 4 and cfg["model"] == lm.fingerprint()
    assert cfg["k_star"] is None and cfg["k_star_status"] == "no ranking" and cfg["reason"] == NO_RANKING and "ranking_rule" not in cfg
    assert cfg["erratum_template"] == ERRATUM_TEMPLATES["paper"]  # the one the erratum strategies share
    assert [e["spec"] for e in cfg["strategies"]] == ["stale", "oracle", "erratum", "erratum_turn"]
    erratum = entry(cfg, "erratum")  # both cells pooled: cases 0 and 1 are decisions, case 2 a control
    assert erratum["n"] == 4 and erratum["agreement"] == 0.5 and erratum["control_invariance"] == 1.0
    assert erratum["n_controls"] == 2 and erratum["wall_s"] == 0.2 and "decide_s" not in erratum
    turn = entry(cfg, "erratum_turn")
    assert turn["n"] == 3 and turn["n_errors"] == 1 and turn["agreement_ci95"] == [0.4385, 1.0]
    assert entry(cfg, "stale")["wall_s"] is None  # derived from the patch read: not timed


def test_k_star_from_three_cases_is_not_established():
    """A run with 3 held-out cases, all agreeing at K=2: the point estimate reaches 0.95 but the Wilson lower
    bound is 0.44, so K* is "not established" (a percentile bootstrap would have said [1.0, 1.0])."""
    edits = run_edits()
    edits = edits[edits.case_id.isin(HELD[:3]) & ~edits.control]
    edits.loc[edits.strategy == "field_only", "agree"] = False  # K = 0 (the field alone) misses: 0 of 3
    fields = k_star_fields(k_sweep(edits), 0.95, max_downstream=5)
    assert fields["k_star"] is None and fields["k_star_status"] == "not established"
    assert fields["k_candidate"] == 2 and fields["n_cases"] == 3 and fields["agreement"] == 1.0
    assert fields["agreement_ci95"] == [0.4385, 1.0]
    assert k_star_fields(k_sweep(edits), 0.4, max_downstream=5)["k_star_status"] == "established"
    edits.loc[edits.strategy == "selective:2:causal", "agree"] = [True, False, False]
    never = k_star_fields(k_sweep(edits), 0.95, max_downstream=5)
    assert never["k_star_status"] == "not reached" and never["k_star"] is None
    assert never["reason"].endswith("the best, K=2, agrees 0.33")


def test_cases_to_establish_matches_the_interval():
    assert cases_to_establish(0.95) == 73 and cases_to_establish(0.8) == 16 and cases_to_establish(1.0) is None
    assert proportion_ci(73, 73)[0] >= 0.95 > proportion_ci(72, 72)[0]


def test_fifteen_of_fifteen_is_not_certain():
    """15/15 agreement: the Wilson interval is [0.80, 1.00] (scipy), as the report and topk.yaml print it."""
    share, lo, hi, n = proportion([1.0] * 15)
    assert (share, n, hi) == (1.0, 15, 1.0) and lo == pytest.approx(0.7961, abs=1e-4)
    assert proportion_ci(15, 15, method="exact")[0] == pytest.approx(0.7820, abs=1e-4)  # Clopper-Pearson
    assert wilson_share(1.0, 15) == proportion_ci(15, 15)


# -- load, cheapest, ranking -----------------------------------------------------------------------
def test_load_cheapest_and_ranking(lm, tmp_path):
    policy = P.load(export_topk(run_folder(tmp_path / "run", lm.fingerprint())), lm)
    assert policy.k_star is None and policy.k_star_status == "not established" and policy.threshold == 0.95
    assert len(policy.strategies) == 8
    turn = next(e for e in policy.strategies if e.spec == "erratum_turn")
    assert turn.agreement_ci95 == (0.5101, 1.0) and turn.name == "erratum_turn"
    assert turn.describe() == ("erratum_turn: agreement 1.00 [0.51, 1.00] on 4 cases, controls 1/2, "
                               "recomputed 0.10")
    # the one repair rule: both legs need a Wilson lower bound at the threshold; 4 decision cases and 2
    # controls reach 0.51 and 0.34 at best, so nothing is established at 0.95
    assert policy.cheapest() is None
    assert "no measured strategy is established at 0.95" in policy.why_none()
    # at 0.3: erratum_turn changes a control's answer (1/2: [0.09, 0.91]) yet passes; auto and hoist are never
    # chosen; field_only (3/4 [0.30, 0.95], controls 2/2) is the cheapest
    assert policy.cheapest(0.3).spec == "field_only"
    # at 0.34: field_only's 0.30 falls short; selective:2:causal has no control (its second leg is open), so
    # cacheblend (4/4 [0.51, 1.00], 2/2 [0.34, 1.00]) is the cheapest established
    assert policy.cheapest(0.34).spec == "cacheblend:0.15"
    assert policy.cheapest(1.01) is None
    rule = policy.ranking()
    assert isinstance(rule, RankingRule) and rule.n_cases == 3 and dict(rule.scores) == SCORES
    a = SimpleNamespace(kinds={4: "word", 5: "newline", 6: "word"}, field=(2, 4), decision_pos=8, downstream=(4, 7))
    # keys: 4 -> word|0|2 (unseen: 0), 5 -> newline|1|2 (0.5), 6 -> word|2|1 (0.1)
    assert rule.rank(a) == [5, 6, 4] and rule(SimpleNamespace(a=a)) == [5, 6, 4]
    assert P.load(policy.path, None).strategies == policy.strategies  # lm=None: no fingerprint check


def test_sweep_policy_has_evidence_but_no_ranking(lm, tmp_path):
    policy = P.load(export_topk(sweep_folder(tmp_path / "sweep", lm.fingerprint())), lm)
    assert policy.rule is None and policy.cheapest() is None  # 3 of 4 (its error counts against it) at best
    assert policy.cheapest(0.3).spec == "erratum_turn"  # 3/4 [0.30, 0.95], controls 2/2 [0.34, 1.00], 0.25
    assert policy.cheapest(1.01) is None
    with pytest.raises(KvprobeError, match=f"no learned causal ranking rule \\({NO_RANKING}\\)"):
        policy.ranking()


# -- refusals: one line each ------------------------------------------------------------------------
def refused(path, lm, *needles: str) -> str:
    with pytest.raises(KvprobeError) as exc:
        P.load(path, lm)
    text = str(exc.value)
    assert "\n" not in text and all(n in text for n in needles), text
    return text


def test_a_file_for_another_model_is_refused(lm, tmp_path):
    path = export_topk(run_folder(tmp_path / "run", lm.fingerprint()))
    other = tiny_model("tiny-llama")
    refused(path, other, "is for model tiny-qwen2 (weights", "not this model (tiny-llama, weights",
            "export one from a results folder of this model")
    cfg = yaml.safe_load(path.read_text())
    cfg["model"] = {**cfg["model"], "spec": "/somewhere/else"}  # another spec, same model: accepted
    path.write_text(yaml.safe_dump(cfg))
    assert P.load(path, lm).model["spec"] == "/somewhere/else"
    cfg["model"]["tokenizer_hash"] = "0" * 16
    path.write_text(yaml.safe_dump(cfg))
    refused(path, lm, "(tokenizer 00000000..)")


def test_bad_files_are_refused_in_one_line(lm, tmp_path):
    refused(tmp_path / "nope.yaml", lm, "policy file not found", "kvprobe export-topk")
    broken = tmp_path / "broken.yaml"
    broken.write_text("schema_version: 2\nmodel: [1, 2\n")
    refused(broken, lm, "is not valid YAML (line")
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"schema_version": 1, "k_star": 8, "erratum_template": "x"}))
    refused(old, lm, "has schema_version 1, this kvprobe reads 2, 3 or 4", "`kvprobe export-topk <results folder>` rewrites")
    other = tmp_path / "other.yaml"
    other.write_text("a: 1\n")
    refused(other, lm, "is not a topk.yaml (no schema_version)")
    partial = tmp_path / "partial.yaml"
    partial.write_text(yaml.safe_dump({"schema_version": 2, "model": {"spec": "x"}, "threshold": 0.9, "k_star": None,
                                       "erratum_template": None, "strategies": [{"spec": "stale"}]}))
    refused(partial, lm, "no model.config_hash, model.weights_hash, model.tokenizer_hash")
    cfg = yaml.safe_load(partial.read_text())
    cfg["model"] = lm.fingerprint()
    partial.write_text(yaml.safe_dump(cfg))
    refused(partial, lm, "strategies entry 1 has no agreement")


def test_export_topk_cli_on_a_sweep_folder(lm, tmp_path):
    from typer.testing import CliRunner

    from kvprobe.cli.app import app

    folder = sweep_folder(tmp_path / "sweep", lm.fingerprint())
    res = CliRunner().invoke(app, ["export-topk", str(folder)])
    assert res.exit_code == 0, res.output
    assert (folder / "topk.yaml").exists() and "strategies:" in res.output
    res = CliRunner().invoke(app, ["export-topk", str(folder), "--out", str(tmp_path / "named.yaml")])
    assert res.exit_code == 0 and res.output.strip() == f"wrote {tmp_path / 'named.yaml'}"  # a named file: quiet
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("x")
    res = CliRunner().invoke(app, ["export-topk", str(junk)])
    assert isinstance(res.exception, KvprobeError)
    assert "is not a kvprobe results folder (no manifest.json or sweep_manifest.json)" in str(res.exception)
    (folder / SWEEP_MANIFEST).unlink()  # a sweep that has not finished
    res = CliRunner().invoke(app, ["export-topk", str(folder)])
    assert isinstance(res.exception, KvprobeError) and "the sweep has not finished" in str(res.exception)


# -- a hand-edited file: every value checked against the file's schema -------------------------------
def _set(*keys, value):
    """A change to a loaded topk.yaml: the value at ``keys`` (names and list indices) becomes ``value``."""
    def change(cfg):
        target = cfg
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return change


BAD_VALUES = {  # a change -> what the one-line refusal must say
    "threshold -1": (_set("threshold", value=-1), "threshold is -1; accepted: a number in [0.5, 1)"),
    "threshold NaN": (_set("threshold", value=float("nan")), "threshold is nan; accepted: a number in [0.5, 1)"),
    "threshold 0.3": (_set("threshold", value=0.3), "threshold is 0.3; accepted: a number in [0.5, 1)"),
    "threshold 1": (_set("threshold", value=1), "threshold is 1; accepted: a number in [0.5, 1)"),
    "agreement 5.0": (_set("strategies", 2, "agreement", value=5.0),
                      "strategies entry 3, agreement is 5.0; accepted: a number from 0 to 1"),
    "n -7": (_set("strategies", 0, "n", value=-7), "strategies entry 1, n is -7; accepted: a whole number, 0 or more"),
    "n 'ten'": (_set("strategies", 0, "n_controls", value="ten"), "strategies entry 1, n_controls is 'ten'"),
    "n true": (_set("strategies", 0, "n", value=True), "strategies entry 1, n is True"),
    "k_star 'eight'": (_set("k_star", value="eight"), "k_star is 'eight'; accepted: a whole number, 0 or more"),
    "k_star without its status": (_set("k_star", value=2), "k_star 2 with k_star_status 'not established'"),
    "ranking_rule a string": (_set("ranking_rule", value="causal"),
                              "ranking_rule is 'causal'; accepted: a mapping (key: value)"),
    "n_training_cases 'ten'": (_set("ranking_rule", "n_training_cases", value="ten"),
                               "ranking_rule.n_training_cases is 'ten'; accepted: a whole number"),
    "a score not a number": (_set("ranking_rule", "scores", "word|2|1", value="high"),
                             "ranking_rule.scores.word|2|1 is 'high'; accepted: a finite number"),
    "interval upside down": (_set("strategies", 0, "agreement_ci95", value=[0.9, 0.1]),
                             "strategies entry 1, agreement_ci95 is [0.9, 0.1]"),
    "k_sweep n negative": (_set("k_sweep", 0, "n", value=-1), "k_sweep entry 1, n is -1"),
    "wall_s infinite": (_set("strategies", 0, "wall_s", value=float("inf")), "strategies entry 1, wall_s is inf"),
    "spec empty": (_set("strategies", 0, "spec", value=" "), "strategies entry 1, spec is ' '"),
    "status unknown": (_set("k_star_status", value="sure"), "k_star_status is 'sure'; accepted: one of"),
    "an unknown key": (_set("treshold", value=0.9), "has an unknown key 'treshold'"),
    "a strategies entry not a mapping": (_set("strategies", 1, value="field_only"),
                                         "strategies entry 2 is 'field_only'; accepted: a mapping"),
}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_a_hand_edited_value_is_refused_naming_the_field(lm, tmp_path, name):
    change, needle = BAD_VALUES[name]
    path = export_topk(run_folder(tmp_path / "run", lm.fingerprint()))
    cfg = yaml.safe_load(path.read_text())
    change(cfg)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    refused(path, lm, str(path), "is not a valid topk.yaml", needle, "kvprobe export-topk")


def test_a_negative_threshold_no_longer_lets_auto_choose_a_failed_strategy(lm, tmp_path):
    """The issue's file: with threshold -1, cacheblend (agreement 0.00 on 20 cases, 0 of 10 controls kept) was
    the cheapest strategy that 'reached' the threshold, so `auto` chose it. The file is refused now."""
    path = export_topk(run_folder(tmp_path / "run", lm.fingerprint()))
    cfg = yaml.safe_load(path.read_text())
    blend = entry(cfg, "cacheblend:0.15")
    blend.update(agreement=0.0, agreement_ci95=[0.0, 0.1611], n=20, control_invariance=0.0, n_controls=10,
                 frac_recomputed=0.001)
    cfg["threshold"] = -1
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    refused(path, lm, "threshold is -1; accepted: a number in [0.5, 1)")
    cfg["threshold"] = 0.95  # the same evidence under a valid threshold: cacheblend is not chosen
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert P.load(path, lm).cheapest(0.3).spec != "cacheblend:0.15"


def test_a_newer_schema_version_says_so(lm, tmp_path):
    path = export_topk(run_folder(tmp_path / "run", lm.fingerprint()))
    path.write_text(path.read_text().replace("schema_version: 4", "schema_version: 5", 1))
    refused(path, lm, "was written by a newer kvprobe (schema_version 5; this kvprobe reads 2, 3 or 4)")
    path.write_text(path.read_text().replace("schema_version: 5", "schema_version: '3'", 1))
    refused(path, lm, "has schema_version '3', not a version this kvprobe reads (2, 3 or 4)")


def test_a_schema_2_file_still_loads(lm, tmp_path):
    """Schema 2 had no k_star_status and chose K* on its point estimate; its interval ends may be NaN."""
    path = export_topk(run_folder(tmp_path / "run", lm.fingerprint()))
    cfg = yaml.safe_load(path.read_text())
    for key in ("k_star_status", "k_candidate"):
        cfg.pop(key)
    cfg.update(schema_version=2, k_star=2)
    cfg["k_sweep"][0].update(agreement_lo=float("nan"), agreement_hi=float("nan"), recovery_lo=float("nan"))
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    policy = P.load(path, lm)
    assert policy.k_star == 2 and policy.k_star_status is None


def test_an_unknown_strategy_in_a_policy_names_the_file(lm, tmp_path):
    from kvprobe.editor.auto import load_policy
    from kvprobe.editor.strategies import parse_strategy

    path = export_topk(run_folder(tmp_path / "run", lm.fingerprint()))
    cfg = yaml.safe_load(path.read_text())
    entry(cfg, "field_only")["spec"] = "telepathy"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with pytest.raises(KvprobeError) as exc:
        load_policy(path, lm)
    assert str(path) in str(exc.value) and "strategies entry 6 names a strategy this kvprobe does not know" in \
        str(exc.value) and "bad strategy 'telepathy'" in str(exc.value) and "\n" not in str(exc.value)
    assert exc.type is KvprobeError  # a bad file (exit 3), not a bad option (exit 2)
    with pytest.raises(KvprobeError, match=f"{path}.*telepathy"):
        parse_strategy(f"auto:{path}").check(lm, None)  # auto:PATH reads the file through the same check
