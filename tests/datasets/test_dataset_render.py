from __future__ import annotations

import pytest

from kvprobe.datasets import Demo, EditCase, render_body, render_pair, render_prompt
from kvprobe.errors import KvprobeError

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>\n{% endif %}"
)
NO_SYSTEM = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"


@pytest.mark.parametrize(("position", "before", "after"), [("early", 0, 2), ("middle", 1, 1), ("late", 2, 0)])
def test_field_position_moves_field_and_fillers(case_data, position, before, after):
    case = EditCase(**{**case_data, "field_position": position})
    body = render_body(case, "VALUE")
    lines = body.split("\n")
    record = lines[lines.index("## Record") + 1 : lines.index("## Record") + 4]
    assert record[{"early": 0, "middle": 1, "late": 2}[position]] == "order_status: VALUE"
    field_at = body.index("order_status: VALUE")
    fillers = [body.index(f) for f in case.fillers]
    assert sum(i < field_at for i in fillers) == before and sum(i > field_at for i in fillers) == after
    assert body.startswith(case.system + "\n\n## Policy\n" + case.rule)
    assert body.endswith("## Request\nShould the refund be approved? Answer yes or no.")


def test_raw_form_with_demos_and_cot(case_data):
    demo = Demo(body="## Policy\nx\n\n## Request\nOk? Answer yes or no.", answer="no")
    case = EditCase(**{**case_data, "few_shot": [demo.model_dump()], "cot": True})
    text = render_prompt(case, None, "delivered", "raw")
    assert text.startswith(case.system + "\n\n" + demo.body + "\nAnswer: no\n\n## Policy")
    assert text.endswith("Answer yes or no. Think step by step, then give the answer.\nAnswer:")
    assert text.count(case.system) == 1


def test_chat_form(case_data, word_tok):
    tok = word_tok.__class__(tokenizer_object=word_tok.backend_tokenizer)
    tok.chat_template = TEMPLATE
    case = EditCase(**{**case_data, "few_shot": [{"body": "demo body", "answer": "yes"}]})
    text = render_prompt(case, tok, "delivered")  # auto -> chat
    assert text.startswith(f"<system>\n{case.system}\n<user>\ndemo body\n<assistant>\nyes\n<user>\n## Policy")
    assert text.endswith("Answer yes or no.\n<assistant>\n")
    assert render_prompt(case, word_tok, "delivered").endswith("\nAnswer:")  # no template -> raw
    with pytest.raises(KvprobeError, match="needs a chat template"):
        render_prompt(case, word_tok, "delivered", "chat")


def test_chat_template_without_system_role(case_data, word_tok):
    tok = word_tok.__class__(tokenizer_object=word_tok.backend_tokenizer)
    tok.chat_template = NO_SYSTEM + TEMPLATE
    text = render_prompt(EditCase(**case_data), tok, "delivered")
    assert text.startswith(f"<user>\n{case_data['system']}\n\n## Policy")


def test_render_pair_span(case_data):
    pair = render_pair(EditCase(**case_data), None, "raw")
    assert pair.text_old[pair.char_start : pair.char_end_old] == "delivered"
    assert pair.text_new[pair.char_start : pair.char_end_new] == "pending"
    assert pair.text_old[: pair.char_start].endswith("order_status: ")
    assert pair.text_old[pair.char_end_old :] == pair.text_new[pair.char_end_new :]


def test_absent_field_raises(case_data, word_tok):
    tok = word_tok.__class__(tokenizer_object=word_tok.backend_tokenizer)
    tok.chat_template = "{{ 'a template that drops the messages' }}"
    with pytest.raises(KvprobeError, match="case c1: the value of field 'order_status' is absent"):
        render_pair(EditCase(**case_data), tok, "chat")
    with pytest.raises(KvprobeError, match="unknown prompt form"):
        render_pair(EditCase(**case_data), tok, "json")
