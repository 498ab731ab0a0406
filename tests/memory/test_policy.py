"""The per-field policy arm of ``kvprobe memory``: the calibration split (apart from the evaluation's
users, every fact edited in turn), its reference (the edited late context from the late cache's prefix
equals a full prefill), the sequential rule (a fact stops at its verdict, later elements of it are
not computed, a resume recomputes nothing), and the policy arm (the chosen repair's row)."""

from __future__ import annotations

import functools

import pandas as pd
import pytest
import torch

from kvprobe.composer.gate import option_token_ids
from kvprobe.datasets.memory import calibration_memory, generate_memory
from kvprobe.datasets.memory_tokens import segments
from kvprobe.kv import cache as kvcache
from kvprobe.memory import arms, question_rows, user_states
from kvprobe.memory import policy as mp
from kvprobe.memory.runner import prefill_state
from kvprobe.results import CaseStore
from tests.conftest import tiny_model

NAME = "tiny-llama"


@functools.cache
def setup():
    lm = tiny_model(NAME)
    data = calibration_memory(2, seed=0, tokenizer=lm.tokenizer, session_tokens=(40, 60))
    return lm, data, segments(data, lm.tokenizer, "raw")


def test_the_calibration_split_edits_every_fact_of_users_apart_from_the_evaluations():
    lm, data, _ = setup()
    again = calibration_memory(2, seed=0, tokenizer=lm.tokenizer, session_tokens=(40, 60))
    assert again == data  # deterministic
    evaluation = generate_memory(40, seed=0, tokenizer=lm.tokenizer, session_tokens=(40, 60))
    assert not {q.question_id for q in data.questions} & {q.question_id for q in evaluation.questions}
    assert not {u.split(":")[0] for u in data.users} & set(evaluation.users)
    bases = {}
    for element, user in data.users.items():
        base, key = element.split(":")
        assert user.edit_key == key and user.edit_new != user.edit_old
        assert (key, user.edit_new) not in set(user.remarks)  # never a value the trajectory names
        bases.setdefault(base, []).append(key)
        qs = [q for q in data.questions if q.user_id == element]
        assert [q.kind for q in qs] == ["edited", "other", "negative", "edited"]
        assert (qs[0].asked, qs[3].asked) == (user.edit_old, user.edit_new)
    assert len(bases) == 2
    for base, keys in bases.items():  # every fact of the base user's profile, in profile order
        assert keys == [k for k, _ in data.users[f"{base}:{keys[0]}"].profile]


def test_the_reference_from_the_late_caches_prefix_is_a_full_prefill_of_the_edited_context():
    lm, data, segs = setup()
    element = next(iter(data.users))
    late = prefill_state(lm, segs.context(element, "late")[0])
    new_ids, (p0, _) = segs.context(element, "late", edited=True)
    got = mp.oracle_from_prefix(lm, late, p0, segs.users[element].profile_new.ids)
    _, want = kvcache.prefill(lm.model, torch.tensor(new_ids))
    assert got.recomputed == len(new_ids) - p0 and got.context_tokens == len(new_ids)
    for (kg, vg), (kw, vw) in zip(kvcache.to_tensors(got.cache), kvcache.to_tensors(want)):
        assert (kg - kw).abs().max() <= 1e-5 and (vg - vw).abs().max() <= 1e-5
    assert kvcache.seq_len(late.cache) == len(segs.context(element, "late")[0])  # the late cache untouched


def test_element_rows_score_each_strategy_against_the_reference():
    lm, data, segs = setup()
    element = next(iter(data.users))
    options = {o: option_token_ids(lm.tokenizer, o) for o in data.options}
    late = prefill_state(lm, segs.context(element, "late")[0])
    df = mp.element_rows(lm, data, segs, element, late, options)
    assert len(df) == 4 * len(mp.STRATEGIES) and list(df.columns) == list(mp.COLUMNS)
    for _, g in df.groupby("question_id"):
        row = g.set_index("strategy")
        assert (row["reference"] == row.loc["oracle", "answer"]).all() and row.loc["oracle", "agree"]
        assert row.loc["field_only", "agree"] == (row.loc["field_only", "answer"] == row.loc["oracle", "answer"])
        assert row.loc["stale", "changed"] == (row.loc["stale", "answer"] != row.loc["oracle", "answer"])


def _fake_rows(agree: dict[str, bool]):
    """element_rows' stand-in: every question's candidates agree as ``agree`` says; counts its calls."""
    calls = []

    def rows(lm, data, segs, element, late, options):
        calls.append(element)
        out = [{"element": element, "user_id": element.split(":")[0], "fact": element.split(":")[1],
                "question_id": f"{element}-q", "kind": "edited", "strategy": s, "answer": "yes", "option_diff": 1.0,
                "reference": "yes", "agree": agree.get(s, True), "changed": True, "tokens_recomputed": 1,
                "wall_s": 0.0, "decide_s": 0.0} for s in mp.STRATEGIES]
        return pd.DataFrame(out, columns=list(mp.COLUMNS))
    return rows, calls


def test_a_fact_stops_at_its_verdict_and_its_later_edits_are_not_computed(monkeypatch, tmp_path):
    lm = tiny_model(NAME)
    rows, calls = _fake_rows({"field_only": True})
    monkeypatch.setattr(mp, "element_rows", rows)
    monkeypatch.setattr(mp, "prefill_state", lambda lm, ids: None)
    threshold = 0.5
    n0 = mp.Sequence(threshold=threshold, m=len(mp.CANDIDATES)).n0
    users = 3 * n0
    store = CaseStore(tmp_path, "memory_calibration")
    pol = mp.calibrate_policy(lm, users, session_tokens=(40, 60), threshold=threshold, store=store)
    data = calibration_memory(users, 0, lm.tokenizer, session_tokens=(40, 60))
    per_fact = pd.Series([e.split(":")[1] for e in data.users]).value_counts()
    for res in pol.fields:
        computed = sum(c.endswith(f":{res.name}") for c in calls)
        if per_fact[res.name] >= n0:  # enough edits drawn: established at the first possible look, no later one
            assert (res.chosen, res.verdict, res.pairs, computed) == ("field_only", "established", n0, n0)
        else:
            assert (res.chosen, res.verdict, computed) == ("oracle", "budget", per_fact[res.name])
    assert pol.repairs == {r.name: r.chosen for r in pol.fields}
    described = pol.describe()["fields"]
    assert all(d["strategies"]["field_only"]["n"] == d["elements"] for d in described.values())
    # a resume reads every finished element and computes none
    again_rows, again_calls = _fake_rows({"field_only": True})
    monkeypatch.setattr(mp, "element_rows", again_rows)
    again = mp.calibrate_policy(lm, users, session_tokens=(40, 60), threshold=threshold, store=store)
    assert not again_calls and again.repairs == pol.repairs


def test_every_candidate_ruled_out_leaves_the_oracle(monkeypatch):
    lm = tiny_model(NAME)
    rows, _ = _fake_rows({"field_only": False, "erratum": False})
    monkeypatch.setattr(mp, "element_rows", rows)
    monkeypatch.setattr(mp, "prefill_state", lambda lm, ids: None)
    pol = mp.calibrate_policy(lm, 40, session_tokens=(40, 60), threshold=0.95)
    assert {r.verdict for r in pol.fields} == {"established"} and set(pol.repairs.values()) == {"oracle"}
    assert all("ruled out" in r.reason for r in pol.fields)
    assert all(r.pairs < 40 for r in pol.fields)  # stopped well before the budget


@pytest.mark.parametrize("chosen", ["field_only", "erratum", "oracle"])
def test_the_policy_arm_is_the_row_of_the_repair_chosen_for_the_edited_fact(chosen):
    lm = tiny_model(NAME)
    data = generate_memory(4, seed=0, tokenizer=lm.tokenizer, session_tokens=(40, 60))
    segs = segments(data, lm.tokenizer, "raw")
    uid = data.questions[0].user_id
    states = user_states(lm, data, segs, uid, (0,))
    options = {o: option_token_ids(lm.tokenizer, o) for o in data.options}
    policy = {data.users[uid].edit_key: chosen}
    df = question_rows(lm, data, segs, states, data.questions[0].question_id, options, (0,), NAME, policy)
    assert list(df["arm"]) == [a for _, a in arms((0,), policy=True)]
    row = df.set_index("arm")
    cols = ["answer", "option_diff", "agree", "changed", "tokens_recomputed", "frac_recomputed", "wall_s", "decide_s"]
    pd.testing.assert_series_equal(row.loc["policy", cols], row.loc[chosen, cols], check_names=False)
    assert row.loc["policy", "repair"] == chosen and row.loc["policy", "group"] == "edit"
    assert row.drop(index="policy")["repair"].isna().all()


def test_the_policy_arm_falls_back_to_the_oracle_where_its_repair_cannot_be_made():
    from kvprobe.memory.runner import State

    lm = tiny_model(NAME)
    data = generate_memory(4, seed=0, tokenizer=lm.tokenizer, session_tokens=(40, 60))
    segs = segments(data, lm.tokenizer, "raw")
    uid = data.questions[0].user_id
    states = dict(user_states(lm, data, segs, uid, (0,)))
    states["field_only"] = State(None, 10, 0, float("nan"), error="the new value takes +1 token(s)")
    options = {o: option_token_ids(lm.tokenizer, o) for o in data.options}
    df = question_rows(lm, data, segs, states, data.questions[0].question_id, options, (0,), NAME,
                       {data.users[uid].edit_key: "field_only"})
    row = df.set_index("arm")
    assert isinstance(row.loc["field_only", "error"], str) and row.loc["policy", "repair"] == "oracle"
    assert row.loc["policy", "answer"] == row.loc["oracle", "answer"] and pd.isna(row.loc["policy", "error"])
