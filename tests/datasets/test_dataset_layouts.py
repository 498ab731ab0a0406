"""Prompt layouts and their knobs: exact spans in every layout, today's record layout unchanged,
the vocabulary covering every layout, and the erratum placed as a new turn after a byte-identical
old prompt."""

from __future__ import annotations

import itertools

import pytest

from kvprobe.datasets import AlignedCase, align, erratum_text, generate, render_pair, render_prompt, vocabulary
from kvprobe.datasets.domains import DOMAINS
from kvprobe.datasets.layouts import FIELD_STYLES, LAYOUTS
from kvprobe.datasets.render import REQUEST, field_label, render_turns
from kvprobe.datasets.words import build_word_tokenizer, words
from kvprobe.defaults import LAYOUT_NAMES
from kvprobe.errors import UsageError

KNOBS = list(itertools.product(LAYOUTS, FIELD_STYLES, ("allow", "deny")))


@pytest.fixture(scope="module")
def layout_tok():
    return build_word_tokenizer(vocabulary(layouts=True))


@pytest.mark.parametrize(("layout", "style", "rule"), KNOBS)
def test_every_layout_holds_the_value_once_and_aligns(layout_tok, layout, style, rule):
    cases = generate(16, seed=3, controls=0.25, layout=layout, field_style=style, rule_style=rule, filler_tokens=60)
    for case in cases:
        pair = render_pair(case, None, "raw")  # raises unless the value occurs exactly once
        assert pair.text_old[pair.char_start:pair.char_end_old] == case.old_value
        a = align(case, layout_tok, "raw")
        assert isinstance(a, AlignedCase), a.reason
        assert "[UNK]" not in layout_tok.convert_ids_to_tokens(a.ids_old)  # the vocabulary covers the layout
        if style == "words" and "_" in case.field:
            assert field_label(case) in pair.text_old.lower() and case.field not in pair.text_old


def test_the_cli_lists_every_layout():
    assert tuple(LAYOUTS) == LAYOUT_NAMES  # the light list the CLI help prints


def test_layouts_differ_and_keep_the_parts_in_order():
    bodies = {}
    for layout in LAYOUTS:
        case = generate(1, seed=5, layout=layout, filler_tokens=40)[0]
        text = render_prompt(case, None, case.old_value, "raw")
        bodies[layout] = text
        value_at, question_at = text.index(case.old_value), text.rindex(case.question)
        assert value_at < text.index(case.fillers[-1]) < question_at  # the filler is downstream of the field
    assert len(set(bodies.values())) == len(LAYOUTS)
    assert "## Record" in bodies["record"] and "## " not in bodies["lines"].replace(REQUEST, "")
    assert '"notes": [' in bodies["json"] and "\nnotes:\n  - " in bodies["yaml"]
    assert "User: " in bodies["chat_history"] and "Tool: " in bodies["tool_spec"]


def test_chat_history_states_the_field_in_an_earlier_turn():
    case = generate(1, seed=1, layout="chat_history", filler_tokens=30)[0]
    turns = render_turns(case, case.old_value)
    assert [role for role, _ in turns] == ["user", "assistant"] * 3 + ["user"]
    assert case.old_value in turns[2][1] and case.question in turns[-1][1] and case.old_value not in turns[-1][1]


def test_the_default_is_the_record_layout_of_before():
    plain = generate(30, seed=2, few_shot=1)
    assert plain == generate(30, seed=2, few_shot=1, layout="record", field_style="key", rule_style="allow")
    assert {c.layout for c in plain} == {"record"}
    assert all(c.field_position in ("early", "middle", "late") for c in plain)


def test_filler_tokens_set_the_downstream_length():
    for target in (0, 50, 400):
        for case in generate(12, seed=4, filler_tokens=target):
            assert case.field_position == "early"
            n = sum(len(words(f)) for f in case.fillers)
            assert (n == 0) if target == 0 else (target <= n < target + 40)


def test_rule_style_deny_names_the_denying_values():
    for case in generate(24, seed=6, rule_style="deny", controls=0):
        gate = next(f for f in DOMAINS[case.domain].fields if f.name == case.field)
        assert case.rule.startswith("Answer no if") and all(v in case.rule for v in gate.deny)
        assert case.expected_old == ("yes" if case.old_value in gate.allow else "no")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_erratum_turn_leaves_the_old_prompt_byte_identical(layout):
    case = generate(1, seed=7, layout=layout)[0]
    line = erratum_text(field_label(case), case.new_value)
    old = render_prompt(case, None, case.old_value, "raw")
    turn = render_prompt(case, None, case.old_value, "raw", erratum=line, erratum_at="turn")
    inline = render_prompt(case, None, case.old_value, "raw", erratum=line)
    assert turn.startswith(old) and turn.endswith(f"{line}\n{case.question} Answer yes or no.\nAnswer:")
    assert inline.index(line) < inline.rindex(case.question)


def test_bad_knobs_are_one_line_usage_errors():
    for kwargs, words_ in (({"layout": "xml"}, "unknown layout"), ({"field_style": "camel"}, "unknown field style"),
                           ({"rule_style": "maybe"}, "unknown rule style"), ({"filler_tokens": -1}, "filler tokens")):
        with pytest.raises(UsageError, match=words_):
            generate(2, **kwargs)
    with pytest.raises(UsageError, match="erratum placement"):
        case = generate(1)[0]
        render_prompt(case, None, case.old_value, "raw", erratum="x", erratum_at="end")
