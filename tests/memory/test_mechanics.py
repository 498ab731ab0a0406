"""The memory arms' mechanics, exact on a tiny model: the transplanted profile's KV equals a fresh
prefill's after re-rotation, the erratum arm's cache is a prefill of the appended text, the field-only
arm changes the value's positions only, and the rows score what they read."""

from __future__ import annotations

import functools

import pandas as pd
import torch

from kvprobe import composer
from kvprobe.composer.gate import option_token_ids
from kvprobe.datasets.memory import generate_memory
from kvprobe.datasets.memory_tokens import segments
from kvprobe.kv import cache as kvcache
from kvprobe.memory import arms, question_rows, run_memory, summarize_memory, user_states
from kvprobe.memory.runner import prefill_state
from kvprobe.results import CaseStore
from tests.conftest import tiny_model

NAME = "tiny-llama"
TOL = 1e-4


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def assert_caches_close(a, b, tol: float = TOL, upto: int | None = None):
    assert kvcache.seq_len(a) == kvcache.seq_len(b)
    for (ka, va), (kb, vb) in zip(kvcache.to_tensors(a), kvcache.to_tensors(b)):
        assert maxdiff(ka[:, :, :upto], kb[:, :, :upto]) <= tol and maxdiff(va[:, :, :upto], vb[:, :, :upto]) <= tol


@functools.cache
def setup():
    lm = tiny_model(NAME)
    data = generate_memory(4, seed=0, tokenizer=lm.tokenizer, session_tokens=(40, 60))
    segs = segments(data, lm.tokenizer, "raw")
    uid = data.questions[0].user_id
    return lm, data, segs, uid, user_states(lm, data, segs, uid, (0, 4))


def test_a_jointly_computed_profile_moved_and_rerotated_is_a_fresh_prefill():
    """The profile's KV from a prefill at other positions (+37), spliced after the next session with
    re-rotation: the whole cache equals a full prefill of that context (as tests/composer/test_compose.py)."""
    lm, data, segs, uid, _ = setup()
    u = segs.users[uid]
    head, profile = segs.preamble + u.next_session, u.profile.ids
    shift = 37
    _, shifted = kvcache.prefill(lm.model, torch.tensor(head + profile), start=shift)
    block = composer.block_from_cache(lm, shifted, profile, len(head))
    block.start = len(head) + shift  # its entries were computed at these positions
    c = composer.compose(lm, [head, block])
    _, fresh = kvcache.prefill(lm.model, torch.tensor(head + profile))
    assert_caches_close(c.cache, fresh)


def test_the_transplanted_blocks_layer0_keys_are_a_fresh_prefills():
    """The arm's block is precompiled behind the preamble alone; re-rotated to its place after the next
    session, its layer-0 keys (token and position only) equal a fresh prefill's; later layers differ,
    as they must (the block never saw the session)."""
    lm, data, segs, uid, states = setup()
    u = segs.users[uid]
    head = segs.preamble + u.next_session
    _, fresh = kvcache.prefill(lm.model, torch.tensor(head + u.profile.ids))
    got = states["transplant_seam0"].cache
    lo, hi = len(head), len(head) + len(u.profile.ids)
    slot = lm.adapter.rotated_slot
    assert maxdiff(kvcache.get_kv(got, 0)[slot][:, :, lo:hi], kvcache.get_kv(fresh, 0)[slot][:, :, lo:hi]) <= TOL
    assert maxdiff(kvcache.get_kv(got, 0)[slot][:, :, :lo], kvcache.get_kv(fresh, 0)[slot][:, :, :lo]) <= TOL
    assert states["transplant_seam0"].recomputed == len(head)
    assert states["transplant_seam4"].recomputed == len(head) + 4
    assert_caches_close(states["transplant_full"].cache, fresh)


def test_the_erratum_arm_is_the_late_cache_with_the_correction_prefilled():
    lm, data, segs, uid, states = setup()
    late_ids, _ = segs.context(uid, "late")
    erratum = segs.users[uid].erratum
    _, want = kvcache.prefill(lm.model, torch.tensor(late_ids + erratum))
    assert_caches_close(states["erratum"].cache, want, tol=1e-5)
    assert states["erratum"].recomputed == len(erratum)
    assert kvcache.seq_len(states["late"].cache) == len(late_ids)  # the late cache was not touched


def test_field_only_recomputes_the_value_and_nothing_else():
    lm, data, segs, uid, states = setup()
    late_ids, (p0, _) = segs.context(uid, "late")
    s0, s1 = segs.users[uid].profile_new.spans[data.users[uid].edit_key]
    got, late, oracle = states["field_only"].cache, states["late"].cache, states["oracle"].cache
    assert states["field_only"].recomputed == s1 - s0
    for (kg, vg), (kl, vl), (ko, vo) in zip(*(kvcache.to_tensors(c) for c in (got, late, oracle))):
        outside = [i for i in range(len(late_ids)) if not p0 + s0 <= i < p0 + s1]
        assert torch.equal(kg[:, :, outside], kl[:, :, outside]) and torch.equal(vg[:, :, outside], vl[:, :, outside])
    # the first value token sees the same prefix as in the oracle: its entries are the oracle's
    assert_caches_close(got, oracle, tol=1e-5, upto=p0 + s0 + 1)
    new_ids, _ = segs.context(uid, "late", edited=True)
    assert_caches_close(states["oracle"].cache, prefill_state(lm, new_ids).cache, tol=1e-6)


def test_rows_read_each_arm_and_score_against_their_reference():
    lm, data, segs, uid, states = setup()
    options = {o: option_token_ids(lm.tokenizer, o) for o in data.options}
    q = next(x for x in data.questions if x.user_id == uid and x.kind == "edited")
    df = question_rows(lm, data, segs, states, q.question_id, options, (0, 4), NAME)
    assert list(df["arm"]) == [a for _, a in arms((0, 4))]
    row = df.set_index("arm")
    # the late arm's answer is a full prefill of the late context with the question, read by hand
    late_ids, _ = segs.context(uid, "late")
    logits = composer.oracle_logits(lm, late_ids + segs.questions[q.question_id])
    scores = {o: float(logits[ids].max()) for o, ids in options.items()}
    assert row.loc["late", "answer"] == max(scores, key=scores.get)
    assert row.loc["erratum", "agree"] == float(row.loc["erratum", "answer"] == row.loc["oracle", "answer"])
    assert row.loc["oracle", "expected"] == q.expected_new and row.loc["early", "expected"] == q.expected_old
    assert row.loc["stale", "changed"] == 0  # the stale cache is the late one
    assert row.loc["oracle", "tokens_recomputed"] == row.loc["oracle", "context_tokens"]


def test_a_resume_recomputes_no_finished_question(tmp_path, monkeypatch):
    lm = tiny_model(NAME)
    store = CaseStore(tmp_path, "memory")
    first = run_memory(lm, 5, session_tokens=(40, 60), store=store)
    assert len(first) == 5 * len(arms())
    import kvprobe.memory.runner as runner

    calls = []
    monkeypatch.setattr(runner, "user_states", lambda *a, **k: calls.append(a) or {})
    again = run_memory(lm, 5, session_tokens=(40, 60), store=store)
    assert not calls
    pd.testing.assert_frame_equal(first, again)
    summary = summarize_memory(first)
    assert set(summary["arm"]) == {a for _, a in arms()} and (summary["n_questions"] == 5).all()


def test_the_neutral_control_is_the_late_cache_with_the_neutral_line_where_the_erratum_goes():
    lm, data, segs, uid, states = setup()
    late_ids, _ = segs.context(uid, "late")
    _, want = kvcache.prefill(lm.model, torch.tensor(late_ids + segs.neutral))
    assert_caches_close(states["neutral"].cache, want, tol=1e-5)
    assert not set(lm.tokenizer.decode(segs.neutral).split()) & set(data.users[uid].edit_new.split())


def test_field_only_refuses_a_value_of_another_token_length_in_its_row():
    from kvprobe.memory.runner import State, field_only_state

    lm, data, segs, uid, states = setup()
    late_ids, _ = segs.context(uid, "late")
    st = field_only_state(lm, states["late"], late_ids + [late_ids[-1]], (len(late_ids) - 2, len(late_ids)), late_ids)
    assert isinstance(st, State) and st.cache is None and "+1 token(s)" in st.error
