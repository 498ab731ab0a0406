"""The memory set: deterministic, its lengths, negatives no profile decides, and an edit that changes the
expected answer of exactly the questions on the edited fact."""

from __future__ import annotations

import re

import pytest

from kvprobe.datasets.memory import (FACT_BY_KEY, FACTS, FILLER, NEGATIVE_FACTS, generate_memory, next_session_text,
                                     profile_text, render, session_text, trajectory_text)
from kvprobe.datasets.memory_tokens import segments
from kvprobe.datasets.words import words
from kvprobe.errors import UsageError
from tests.conftest import tiny_model


def mentions(text: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text, re.IGNORECASE) is not None


def user_text(user) -> str:
    return profile_text(user.profile) + trajectory_text(user) + next_session_text(user)


def test_the_same_arguments_give_the_same_set_and_another_seed_another():
    assert generate_memory(12, seed=3) == generate_memory(12, seed=3)
    assert generate_memory(12, seed=3).users != generate_memory(12, seed=4).users


def test_session_lengths_follow_the_drawn_targets():
    lo, hi = 80, 120
    data = generate_memory(16, seed=1, sessions=4, session_tokens=(lo, hi))
    longest_pair = max(len(words(f"User: {a}\n")) + len(words(f"Assistant: {b}\n")) for a, b in FILLER)
    for user in data.users.values():
        assert len(user.sessions) == 4
        for turns in [*user.sessions, user.next_session]:
            n = len(words("".join(f"{r}: {t}\n" for r, t in turns)))
            assert lo <= n <= hi + longest_pair + 40, n  # the last filler pair, and the remarks' lines


def test_lengths_are_counted_in_the_models_tokens():
    tok = tiny_model("tiny-llama").tokenizer
    data = generate_memory(8, seed=0, tokenizer=tok, session_tokens=(60, 60))
    for user in data.users.values():
        n = len(tok.encode("".join(f"{r}: {t}\n" for r, t in user.next_session), add_special_tokens=False))
        assert 60 <= n <= 60 + 60, n


def test_negative_questions_ask_what_no_text_of_the_user_holds():
    data = generate_memory(60, seed=2)
    negatives = [q for q in data.questions if q.kind == "negative"]
    assert negatives and all(q.expected_old == q.expected_new == "" for q in negatives)
    for q in negatives:
        fact, text = FACT_BY_KEY[q.fact], user_text(data.users[q.user_id])
        assert fact in NEGATIVE_FACTS
        assert not any(mentions(text, w) for w in (*fact.values, *fact.label.split())), q
    filler = " ".join(a + " " + b for a, b in FILLER)
    for fact in FACTS + NEGATIVE_FACTS:
        assert not any(mentions(filler, v) for v in fact.values), fact.key  # filler decides nothing


def test_an_edit_changes_exactly_the_answers_on_its_fact():
    data = generate_memory(80, seed=5)
    assert {q.kind for q in data.questions} == {"edited", "other", "negative"}
    for q in data.questions:
        user = data.users[q.user_id]
        assert (q.expected_old != q.expected_new) == (q.fact == user.edit_key), q
        if q.kind != "negative":  # the expected answers follow the profile before and after the edit
            assert (q.expected_old == "yes") == (q.asked == user.values[q.fact])
            assert (q.expected_new == "yes") == (q.asked == dict(user.profile_after_edit())[q.fact])
    for user in data.users.values():
        assert user.edit_new != user.edit_old and user.edit_new in FACT_BY_KEY[user.edit_key].values
        # the trajectory names earlier values only: never the current one, nor one a question asks about
        for key, earlier in user.remarks:
            assert earlier != user.values[key]
            assert all(earlier != q.asked for q in data.questions if q.user_id == user.user_id and q.fact == key)


def test_layouts_place_the_profile_early_or_late_and_the_edit_in_it():
    data = generate_memory(4, seed=0)
    q = data.questions[0]
    user = data.users[q.user_id]
    early, late = render(data, q, "early"), render(data, q, "late")
    profile, trajectory = profile_text(user.profile), trajectory_text(user)
    assert early.index(profile) < early.index(trajectory) and late.index(trajectory) < late.index(profile)
    label = FACT_BY_KEY[user.edit_key].label
    assert render(data, q, "late", edited=True) == late.replace(f"{label}: {user.edit_old}\n",
                                                                f"{label}: {user.edit_new}\n")
    assert session_text(user.sessions[0], 1).startswith("## Session 1\n")


@pytest.mark.parametrize("name", ["tiny-llama", "toy-qwen2"])
def test_segments_mark_every_value_and_the_edit_swaps_tokens_one_for_one(name):
    tok = tiny_model(name).tokenizer
    data = generate_memory(8, seed=0, tokenizer=tok, session_tokens=(40, 60))
    segs = segments(data, tok, "raw")
    for uid, user in data.users.items():
        u = segs.users[uid]
        for key, value in user.profile:
            assert tok.decode(u.profile.ids[slice(*u.profile.spans[key])]).strip() == value
        assert len(u.profile.ids) == len(u.profile_new.ids)  # a value of the same token length
        differ = [i for i, (a, b) in enumerate(zip(u.profile.ids, u.profile_new.ids)) if a != b]
        s0, s1 = u.profile.spans[user.edit_key]
        assert differ and set(differ) <= set(range(s0, s1))
        late, (p0, p1) = segs.context(uid, "late")
        early, (e0, e1) = segs.context(uid, "early")
        assert late[p0:p1] == early[e0:e1] == u.profile.ids and p1 == len(late) and e0 == len(segs.preamble)


def test_bad_options_are_usage_errors():
    for kwargs in ({"sessions": 0}, {"session_tokens": (10, 20)}, {"session_tokens": (90, 80)},
                   {"questions_per_user": 2}, {"n_facts": 1}):
        with pytest.raises(UsageError):
            generate_memory(4, **kwargs)
    with pytest.raises(UsageError):
        generate_memory(0)
