from __future__ import annotations

from collections import Counter

import pytest

from kvprobe.datasets import (
    CONTROL_FIELDS,
    DOMAINS,
    SHORT_ERRATUM,
    erratum_text,
    generate,
    render_prompt,
    vocabulary,
)
from kvprobe.errors import KvprobeError
from kvprobe.datasets.words import words


def test_deterministic():
    kwargs = {"seed": 7, "few_shot": 1, "controls": 0.3}
    assert generate(40, **kwargs) == generate(40, **kwargs)
    assert generate(40, seed=7) != generate(40, seed=8)


def test_balanced_answers_and_controls():
    cases = generate(160, seed=1, controls=0.25)
    controls = [c for c in cases if c.control]
    edits = [c for c in cases if not c.control]
    assert len(controls) == 40
    flips = Counter((c.expected_old, c.expected_new) for c in edits)
    assert flips[("yes", "no")] == flips[("no", "yes")] == 60
    assert Counter(c.expected_old for c in controls) == {"yes": 20, "no": 20}
    assert Counter(c.domain for c in cases) == {d: 20 for d in DOMAINS}
    assert len({c.case_id for c in cases}) == len(cases)


def test_control_cases_edit_a_control_field_and_fix_the_decision_field():
    for case in generate(48, seed=2, controls=1.0):
        spec = DOMAINS[case.domain]
        assert case.control and case.field in CONTROL_FIELDS
        assert case.expected_old == case.expected_new
        gates = [(k, v) for k, v in case.record if k in {f.name for f in spec.fields}]
        assert len(gates) == 1 and gates[0][0] in case.rule
        field = next(f for f in spec.fields if f.name == gates[0][0])
        assert case.expected_old == ("yes" if gates[0][1] in field.allow else "no")


def test_every_domain_is_complete():
    assert list(CONTROL_FIELDS) == ["timestamp", "nonce", "request_id"]
    assert len(DOMAINS) == 8
    for spec in DOMAINS.values():
        assert len(spec.fields) >= 2 and len(spec.templates) >= 2
        assert len(spec.fillers) >= 12 and len(set(spec.fillers)) == len(spec.fillers)
        for f in spec.fields:
            assert f.allow and f.deny and not set(f.allow) & set(f.deny)
    for pool in CONTROL_FIELDS.values():  # same shape: same word split
        assert len({len(words(v)) for v in pool}) == 1
    seen = {(c.domain, c.field) for c in generate(240, seed=0, controls=0.5)}
    for name in DOMAINS:
        assert {f for d, f in seen if d == name} >= set(CONTROL_FIELDS)


def test_knobs():
    cases = generate(30, seed=3, domains=["deploy_guard"], fields=["safety_mode", "nonce"],
                     fillers=(4, 4), positions=["late"], few_shot=2, cot=True, system=False)  # fmt: skip
    assert {c.domain for c in cases} == {"deploy_guard"}
    assert {c.field for c in cases} == {"safety_mode", "nonce"}
    assert all(len(c.fillers) == 4 and c.field_position == "late" and c.cot and c.system is None for c in cases)
    assert all(len(c.few_shot) == 2 for c in cases)
    assert all("Policy" in d.body and d.answer in ("yes", "no") for c in cases for d in c.few_shot)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"domains": ["casino"]}, "unknown domains"),
        ({"fields": ["colour"]}, "unknown fields"),
        ({"controls": 1.5}, "controls"),
        ({"fillers": (5, 2)}, "fillers"),
        ({"positions": ["top"]}, "positions"),
        ({"fields": ["order_status"]}, "needs a control field"),
        ({"fields": ["nonce"], "controls": 0.5}, "no decision field"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(KvprobeError, match=message):
        generate(10, **kwargs)


def test_erratum():
    assert erratum_text("region", "EU") == (
        "[STATE UPDATE] region has just changed to EU; this overrides any earlier value. Apply the current value."
    )
    assert erratum_text("region", "EU", SHORT_ERRATUM) == "[STATE UPDATE] region -> EU; overrides any earlier value."


def test_vocabulary_covers_every_prompt(word_tok):
    vocab = vocabulary()
    assert vocab == sorted(set(vocab)) and "\n" in vocab and "{" not in vocab
    unk = word_tok.unk_token_id
    cases = generate(64, seed=4, controls=0.3, few_shot=2, cot=True) + generate(64, seed=5, fillers=(0, 12))
    for case in cases:
        for value in (case.old_value, case.new_value):
            ids = word_tok(render_prompt(case, None, value, "raw"), add_special_tokens=False)["input_ids"]
            assert unk not in ids, case.case_id
    for field in [*CONTROL_FIELDS, *(f.name for s in DOMAINS.values() for f in s.fields)]:
        for template in (None, SHORT_ERRATUM):
            assert unk not in word_tok(erratum_text(field, "EU", template))["input_ids"]
