"""Template cases: a user's body with ``{name}`` placeholders, the edited field at ``{field}``, and
expected answers that an edit does not need (but validity does)."""

from __future__ import annotations

import json

import pytest

from kvprobe.datasets import (
    AlignedCase,
    EditCase,
    align,
    load_jsonl,
    render_pair,
    render_prompt,
    require_answers,
    save_jsonl,
)
from kvprobe.datasets.render import render_turns
from kvprobe.errors import KvprobeError

LOAN = "Loans are issued only if the tier is gold.\nTier: {tier}."


@pytest.fixture
def loan() -> dict:
    """The loan example as plain JSON data: the old value also appears in the rule."""
    return {"case_id": "loan1", "domain": "loans", "field": "tier", "old_value": "gold", "new_value": "basic",
            "template": LOAN, "question": "Issue the loan?", "options": ["yes", "no"],
            "expected_old": "yes", "expected_new": "no"}


def _write(tmp_path, *cases: dict):
    path = tmp_path / "cases.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in cases))
    return path


@pytest.fixture
def chat_tok(word_tok):
    tok = word_tok.__class__(tokenizer_object=word_tok.backend_tokenizer)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


def test_a_template_case_round_trips(tmp_path, loan):
    case = EditCase(**{**loan, "template": "{{Bank}} {branch}: " + LOAN, "values": {"branch": "north"},
                       "system": "You are a loan officer."})
    path = save_jsonl([case], tmp_path / "cases.jsonl")
    assert load_jsonl(path) == [case]
    assert json.loads(path.read_text())["values"] == {"branch": "north"}


def test_the_body_fills_values_and_puts_the_question_after_it(loan):
    case = EditCase(**{**loan, "template": "{{Bank}} {branch}: " + LOAN, "values": {"branch": "north"}})
    assert render_prompt(case, None, "basic", "raw") == ("{Bank} north: Loans are issued only if the tier is gold.\n"
                                                         "Tier: basic.\n\n## Request\nIssue the loan? Answer yes or "
                                                         "no.\nAnswer:")


@pytest.mark.parametrize("chat", [False, True])
def test_the_loan_example_aligns_on_the_record_value(loan, word_tok, chat_tok, chat):
    tok = chat_tok if chat else word_tok  # the tiny models' word-level tokenizer, with and without a chat template
    case = EditCase(**loan)
    pair = render_pair(case, tok)
    record = pair.text_old.index("Tier: gold") + len("Tier: ")
    assert pair.text_old.index("gold") < record  # the rule's "gold" comes first, and is not the field
    assert (pair.char_start, pair.char_end_old, pair.char_end_new) == (record, record + 4, record + 5)
    assert pair.text_new[pair.char_start:pair.char_end_new] == "basic"
    a = align(case, tok)
    assert isinstance(a, AlignedCase) and a.form == ("chat" if chat else "raw")
    lo, hi = a.field
    offsets = tok(pair.text_old, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert (hi - lo, offsets[lo]) == (1, (record, record + 4))
    assert tok.convert_ids_to_tokens(a.ids_old[lo:hi]) == ["gold"] and a.ids_old[:lo] == a.ids_new[:lo]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rule": "Loans for gold only."}, "exactly one of 'rule' (structured form), 'prompt' (free-form body) or "
                                           "'template' (body with placeholders); got rule and template"),
        ({"prompt": "Tier: gold"}, "got prompt and template"),
        ({"template": "Tier: {tier}, or {tier}."}, "field 'template': the template must hold the placeholder {tier} of "
                                                  "the edited field exactly once; it holds it 2 times (its "
                                                  "placeholders: {tier})"),
        ({"template": "Level: {level}."}, "it holds it 0 times (its placeholders: {level})"),
        ({"template": "Tier: {tier}. Branch: {branch"}, "field 'template': the template is not a valid format "
                                                        "string: expected '}' before end of string"),
        ({"template": "Tier: {tier}. Note }"}, "field 'template': the template is not a valid format string: "
                                               "Single '}' encountered"),
        ({"template": "Tier: {tier}. {0}"}, "field 'template': the template's placeholder {0} is not a plain name"),
        ({"template": "Tier: {tier!r}."}, "the template's placeholder {tier!r} has a conversion or format spec"),
        ({"template": LOAN + " Branch: {branch}."}, "field 'values': no value for the template's placeholder(s) "
                                                    "{branch}; give every placeholder but {tier} a value"),
        ({"values": {"branch": "north"}}, "field 'values': {branch} is not a placeholder of the template (its "
                                          "placeholders: {tier})"),
        ({"values": {"tier": "gold"}}, "field 'values': the edited field's placeholder {tier} takes old_value and "
                                       "new_value"),
        ({"template": None, "prompt": "Tier: gold", "values": {"branch": "north"}},
         "field 'values': only a template case has placeholders to fill"),
        ({"layout": "json"}, "a template case (with 'template') has its own layout: leave 'layout' and 'field_style' "
                             "at their defaults"),
        ({"field_style": "words"}, "a template case (with 'template') has its own layout"),
        ({"expected_new": None}, "expected_old is given but expected_new is not; give both expected answers or "
                                 "neither"),
    ],
)  # fmt: skip
def test_bad_templates_give_one_line_errors(tmp_path, loan, change, message):
    good = {**loan, "case_id": "ok"}
    with pytest.raises(KvprobeError) as info:
        load_jsonl(_write(tmp_path, good, {**loan, **change}))
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{tmp_path / 'cases.jsonl'} line 2: ") and message in text, text


def test_a_value_may_appear_anywhere_else_in_a_template_but_not_in_a_free_form_prompt(tmp_path, loan):
    assert load_jsonl(_write(tmp_path, loan))[0].template == LOAN
    free = {k: v for k, v in loan.items() if k != "template"} | {"prompt": LOAN.format(tier="gold")}
    with pytest.raises(KvprobeError, match="occurs 2 times in its prompt"):
        load_jsonl(_write(tmp_path, free))


def test_a_case_without_expected_answers_loads_and_require_answers_refuses_it(tmp_path, loan):
    bare = {k: v for k, v in loan.items() if not k.startswith("expected_")}
    cases = load_jsonl(_write(tmp_path, loan | {"case_id": "full"}, bare))
    assert (cases[1].expected_old, cases[1].expected_new, cases[1].control) == (None, None, False)
    assert render_pair(cases[1], None, "raw") == render_pair(cases[0], None, "raw")
    require_answers(cases[:1], "kvprobe edit")  # answers given: nothing to say
    with pytest.raises(KvprobeError) as info:
        require_answers(cases, "kvprobe edit")
    assert str(info.value) == ("case loan1 has no expected answers (expected_old, expected_new); kvprobe edit "
                               "measures validity and needs them")


def test_erratum_placements_render_for_a_template_case(loan, chat_tok):
    case = EditCase(**loan)
    line = "Correction: the tier is now basic."
    inline = render_prompt(case, None, "gold", "raw", erratum=line)
    assert inline.index("Tier: gold.") < inline.index(line) < inline.index("## Request")
    old = render_prompt(case, None, "gold", "raw")
    turn = render_prompt(case, None, "gold", "raw", erratum=line, erratum_at="turn")
    assert turn.startswith(old) and turn.endswith(f"\n\n{line}\nIssue the loan? Answer yes or no.\nAnswer:")
    assert render_turns(case, "gold", erratum=line, erratum_at="turn") == [
        ("user", render_turns(case, "gold")[0][1]), ("user", f"{line}\nIssue the loan? Answer yes or no.")]
    chat = render_prompt(case, chat_tok, "gold", "chat", erratum=line, erratum_at="turn")
    assert chat.count("<|im_start|>user") == 2 and chat.index("Tier: gold.") < chat.index(line)
