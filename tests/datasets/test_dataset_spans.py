from __future__ import annotations

import pytest

from kvprobe.datasets import AlignedCase, EditCase, Skip, align, generate
from kvprobe.datasets.spans import token_kind
from kvprobe.errors import KvprobeError


def _decode(tok, ids: list[int]) -> str:
    return "".join(tok.decode(ids).split())  # the word tokenizer decodes with spaces between tokens


def _check_exact(a: AlignedCase, tok) -> None:
    lo, hi = a.field
    assert len(a.ids_old) == len(a.ids_new) == len(a.kinds)
    assert _decode(tok, a.ids_old[lo:hi]) == a.case.old_value
    assert _decode(tok, a.ids_new[lo:hi]) == a.case.new_value
    differ = [i for i, (x, y) in enumerate(zip(a.ids_old, a.ids_new)) if x != y]
    assert differ and lo <= differ[0] and differ[-1] < hi
    assert a.downstream == (hi, a.decision_pos) and a.decision_pos == len(a.ids_old) - 1
    assert a.kinds[lo:hi] == ["field"] * (hi - lo) and "field" not in a.kinds[:lo] + a.kinds[hi:]


def test_generated_cases_align_exactly(word_tok):
    cases = generate(48, seed=5, controls=0.25, few_shot=1)
    for case in cases:
        a = align(case, word_tok)
        assert isinstance(a, AlignedCase), a
        assert a.form == "raw"
        _check_exact(a, word_tok)
        assert set(a.kinds) == {"field", "newline", "punct", "section", "word"}
        assert word_tok.convert_ids_to_tokens(a.ids_old[-2:]) == ["Answer", ":"]
        assert a.option_ids == {"yes": [word_tok.convert_tokens_to_ids("yes")],
                                "no": [word_tok.convert_tokens_to_ids("no")]}  # fmt: skip


def test_control_value_spans_several_tokens(word_tok):
    case = next(c for c in generate(40, seed=0, controls=1.0) if c.field == "timestamp")
    a = align(case, word_tok)
    assert a.field[1] - a.field[0] == 7  # 2024 - 05 - 01T10 : 00
    _check_exact(a, word_tok)


def test_different_lengths_skip(case_data, word_tok):
    case = EditCase(**{**case_data, "new_value": "pre-paid"})
    assert align(case, word_tok) == Skip("c1", "field values tokenize to different lengths (1 vs 3)")


def test_colliding_options_skip(case_data, word_tok):
    case = EditCase(**{**case_data, "options": ["yes.", "yes!"], "expected_old": "yes.", "expected_new": "yes!"})
    result = align(case, word_tok)
    assert isinstance(result, Skip) and "share first-token ids" in result.reason


def test_absent_field_raises(case_data, word_tok):
    tok = word_tok.__class__(tokenizer_object=word_tok.backend_tokenizer)
    tok.chat_template = "{{ messages[-1]['content'][:20] }}"
    with pytest.raises(KvprobeError, match="case c1: .*field 'order_status'"):
        align(EditCase(**case_data), tok)


def test_raw_form_prepends_bos_when_the_tokenizer_adds_one(case_data, word_tok):
    tok = word_tok.__class__(tokenizer_object=word_tok.backend_tokenizer, bos_token="[BOS]")
    tok.add_bos_token = True
    a = align(EditCase(**case_data), tok)
    assert a.ids_old[0] == tok.bos_token_id and a.kinds[0] == "section"
    _check_exact(a, tok)


def test_chat_specials_are_sections(case_data, word_tok):
    tok = word_tok.__class__(tokenizer_object=word_tok.backend_tokenizer)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    a = align(EditCase(**case_data), tok)
    assert a.form == "chat"
    _check_exact(a, tok)
    tokens = tok.convert_ids_to_tokens(a.ids_old)
    assert tokens[-3:] == ["<|im_start|>", "assistant", "\n"] and a.kinds[-3:] == ["section", "word", "newline"]


@pytest.mark.parametrize(
    ("token", "kind"),
    [("ĠPolicy", "word"), ("Ċ", "newline"), ("ĊĊ", "newline"), (".Ċ", "newline"), ("<0x0A>", "newline"),
     ("##", "section"), ("Ġ##", "section"), ("▁---", "section"), ("Ġ-", "punct"), (":", "punct"),
     ("▁yes", "word"), ("_status", "word"), ("Ġ", "punct")],
)  # fmt: skip
def test_token_kind(token, kind):
    assert token_kind(token) == kind
