"""Turn an :class:`EditCase` into prompt text, with the field value at a known character span.

A structured case's body follows ``case.layout`` (:mod:`kvprobe.datasets.layouts`). The
default, ``record`` (sections joined by a blank line, lines by a newline)::

    {system}                       # only when the system line is rendered into the body
    ## Policy
    {rule}
    - {filler}                     # fillers before the field (none for "early", half for "middle")
    ## Record
    {key}: {value}                 # record lines, with "{field}: {value}" first / middle / last
    ## Context
    {context line}
    ## Notes
    - {filler}                     # the remaining fillers ("early": all, "late": none)
    ## Request
    {question} Answer {a} or {b}.[ Think step by step, then give the answer.]

``field_position`` thus moves the field line and how much filler lies downstream of it (in every
layout). The section marks, newlines and punctuation downstream of the field are kept on purpose:
they are the "aggregator" positions where the model writes its notes about the field.

A user's case brings its own body: a free-form ``prompt`` with the old value replaced, or a
``template`` with its ``values`` filled in and the value at ``{field}``; then the erratum
paragraph (if any) and ``## Request`` with the question, as in the ``record`` layout.

Forms: ``"chat"`` applies the tokenizer's chat template (system message, few-shot demos as
earlier user/assistant turns, generation prompt added); ``"raw"`` is plain text ending in
``"\\nAnswer:"`` with demos as preceding ``"{body}\\nAnswer: {answer}\\n\\n"`` blocks. ``"auto"``
picks chat when the tokenizer has a chat template.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from jinja2 import TemplateError

from kvprobe.datasets.layouts import (
    BULLET,
    CONTEXT,
    LAYOUTS,
    NOTES,
    POLICY,
    RECORD,
    REQUEST,
    Parts,
    Turn,
    as_text,
    label,
)
from kvprobe.datasets.schema import EditCase, template_pieces
from kvprobe.defaults import FORMS
from kvprobe.errors import KvprobeError, UsageError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Form = Literal["chat", "raw"]

ANSWER_CUE = "Answer:"
ANSWER_WITH = "Answer {a} or {b}."
COT_LINE = "Think step by step, then give the answer."
# Every fixed string the renderer emits (the generator's vocabulary includes them).
SCAFFOLD = (POLICY, RECORD, CONTEXT, NOTES, REQUEST, BULLET, ANSWER_CUE, ANSWER_WITH, COT_LINE)

ERRATUM_AT = ("question", "turn")  # where an erratum goes: before the question, or a new turn after the prompt

# Stands in for the field value while rendering, to find its offset after any chat template.
SENTINEL = "@@KVPROBE_FIELD_VALUE@@"


@dataclass(frozen=True)
class RenderedPrompt:
    """Old and new prompt text; the value spans ``[char_start, char_end_old)`` and ``[char_start, char_end_new)``."""

    form: Form
    text_old: str
    text_new: str
    char_start: int
    char_end_old: int
    char_end_new: int


def _split_at(n: int, position: str) -> int:
    return {"early": 0, "middle": n // 2, "late": n}[position]


def question_text(case: EditCase) -> str:
    """The question, the options it accepts, and the chain-of-thought cue when ``case.cot``."""
    text = f"{case.question} {ANSWER_WITH.format(a=case.options[0], b=case.options[1])}" if case.options else case.question
    return f"{text} {COT_LINE}" if case.cot else text


def field_label(case: EditCase) -> str:
    """The edited field as the prompt (and an erratum) names it, under ``case.field_style``."""
    return label(case.field, case.field_style)


def parts(case: EditCase, value: str, erratum: str | None = None) -> Parts:
    """A structured case's parts, with ``value`` in the field line, for its layout."""
    cut = _split_at(len(case.fillers), case.field_position)
    record = [(label(key, case.field_style), val) for key, val in case.record]
    record.insert(_split_at(len(record), case.field_position), (field_label(case), value))
    return Parts(domain=case.domain, rule=case.rule, before=list(case.fillers[:cut]), record=record,
                 context=list(case.context), after=list(case.fillers[cut:]), erratum=erratum,
                 question=question_text(case), words=case.field_style == "words")


def render_turns(case: EditCase, value: str, *, erratum: str | None = None, erratum_at: str = "question"
                 ) -> list[Turn]:
    """The user-visible turns with ``value`` in the field line (the system line apart).

    ``erratum`` (a correction line, see :func:`kvprobe.datasets.erratum_text`) goes where
    ``erratum_at`` says: ``"question"``, its own paragraph just before the question (everything
    before it is the unchanged old prompt), or ``"turn"``, a new user turn after the whole old
    prompt that states the erratum and asks again (the serving case: the cached prompt stays
    byte-identical).
    """
    if erratum_at not in ERRATUM_AT:
        raise UsageError(f"unknown erratum placement {erratum_at!r}; use one of {', '.join(ERRATUM_AT)}")
    inline = erratum if erratum_at == "question" else None
    if case.prompt is not None:
        turns = [("user", _free_body(case, value, inline))]
    elif case.template is not None:
        turns = [("user", _template_body(case, value, inline))]
    else:
        turns = LAYOUTS[case.layout](parts(case, value, inline))
    if erratum and erratum_at == "turn":
        turns.append(("user", f"{erratum}\n{question_text(case)}"))
    return turns


def render_body(case: EditCase, value: str, *, system: bool = True, erratum: str | None = None,
                erratum_at: str = "question") -> str:
    """The user-visible text with ``value`` in the field line, as one body (see
    :mod:`kvprobe.datasets.layouts`; a conversation becomes ``User:``/``Assistant:`` paragraphs)."""
    body = as_text(render_turns(case, value, erratum=erratum, erratum_at=erratum_at))
    return f"{case.system}\n\n{body}" if system and case.system else body


def check_text(case: EditCase) -> None:
    """Refuse, before any tokenizer or model work, a free-form case whose prompt does not hold its
    old value exactly once (a generated case always does; a template case's schema checks its
    single ``{field}`` placeholder)."""
    if case.prompt is not None:
        _free_body(case, case.new_value, None)


def _free_body(case: EditCase, value: str, erratum: str | None) -> str:
    """A user's free-form body with ``value`` in place of its single ``old_value`` occurrence."""
    hits = [m.start() for m in re.finditer(rf"(?<!\w){re.escape(case.old_value)}(?!\w)", case.prompt)]
    if len(hits) != 1:
        raise KvprobeError(f"case {case.case_id}: the old value {case.old_value!r} of field '{case.field}' occurs "
                           f"{len(hits)} times in its prompt; it must occur exactly once, as a whole word")
    i = hits[0]
    return _with_request(case, case.prompt[:i] + value + case.prompt[i + len(case.old_value):], erratum)


def _template_body(case: EditCase, value: str, erratum: str | None) -> str:
    """A user's template with ``case.values`` filled in and ``value`` at its single ``{field}``
    placeholder (the schema checked both)."""
    fill = {**case.values, case.field: value}
    pieces = template_pieces(case.template)
    body = "".join(literal + (fill[name] if name is not None else "") for literal, name in pieces)
    return _with_request(case, body, erratum)


def _with_request(case: EditCase, body: str, erratum: str | None) -> str:
    """A user's body, then the erratum paragraph (if any), then ``## Request`` and the question."""
    paragraphs = [body.rstrip(), *([erratum] if erratum else []), f"{REQUEST}\n{question_text(case)}"]
    return "\n\n".join(paragraphs)


def resolve_form(tokenizer: PreTrainedTokenizerBase | None, form: str) -> Form:
    """``"auto"`` -> ``"chat"`` when the tokenizer has a chat template, else ``"raw"``."""
    if form not in FORMS:
        raise UsageError(f"unknown prompt form {form!r}; use one of {', '.join(FORMS)}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if form == "auto":
        return "chat" if has_template else "raw"
    if form == "chat" and not has_template:
        name = getattr(tokenizer, "name_or_path", None) or "this tokenizer"
        raise UsageError(f"form 'chat' needs a chat template, and {name} has none; use form 'raw'")
    return form  # type: ignore[return-value]


def _raw(case: EditCase, value: str, erratum: str | None = None, erratum_at: str = "question") -> str:
    head = f"{case.system}\n\n" if case.system else ""
    demos = "".join(f"{d.body}\n{ANSWER_CUE} {d.answer}\n\n" for d in case.few_shot)
    turns = render_turns(case, value, erratum=erratum, erratum_at=erratum_at)
    if erratum and erratum_at == "turn":  # the old prompt, answer cue included, then the new turn
        old = as_text(turns[:-1])
        return f"{head}{demos}{old}\n{ANSWER_CUE}\n\n{turns[-1][1]}\n{ANSWER_CUE}"
    return f"{head}{demos}{as_text(turns)}\n{ANSWER_CUE}"


def _chat(case: EditCase, tokenizer: PreTrainedTokenizerBase, value: str, erratum: str | None = None,
          erratum_at: str = "question") -> str:
    turns: list[dict[str, str]] = []
    for demo in case.few_shot:
        turns += [{"role": "user", "content": demo.body}, {"role": "assistant", "content": demo.answer}]
    turns += [{"role": role, "content": text}
              for role, text in render_turns(case, value, erratum=erratum, erratum_at=erratum_at)]

    def apply(messages: list[dict[str, str]]) -> str:
        # enable_thinking only matters to templates that read it (Qwen3): no thinking block unless CoT.
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=case.cot
        )

    try:
        if case.system:
            try:
                return apply([{"role": "system", "content": case.system}, *turns])
            except TemplateError:
                # Some templates (Gemma-2) reject a system role: put the line atop the first user turn.
                first = {"role": "user", "content": f"{case.system}\n\n{turns[0]['content']}"}
                return apply([first, *turns[1:]])
        return apply(turns)
    except TemplateError as err:
        raise KvprobeError(f"case {case.case_id}: the chat template failed: {err}") from err


def render_prompt(
    case: EditCase, tokenizer: PreTrainedTokenizerBase | None, value: str, form: str = "auto",
    erratum: str | None = None, erratum_at: str = "question",
) -> str:
    """The full prompt with ``value`` in the field line (``tokenizer`` may be None for ``"raw"``).

    With ``erratum``, the correction sits where ``erratum_at`` says (see :func:`render_turns`).
    """
    resolved = resolve_form(tokenizer, form)
    if resolved == "raw":
        return _raw(case, value, erratum, erratum_at)
    return _chat(case, tokenizer, value, erratum, erratum_at)


def render_pair(case: EditCase, tokenizer: PreTrainedTokenizerBase | None, form: str = "auto") -> RenderedPrompt:
    """Old and new prompt and the value's character span, found through a unique sentinel.

    Raises ``KvprobeError`` when the rendered prompt lacks the field value (or holds it twice).
    """
    resolved = resolve_form(tokenizer, form)
    text = render_prompt(case, tokenizer, SENTINEL, resolved)
    count = text.count(SENTINEL)
    if count != 1:
        where = "is absent from" if count == 0 else f"occurs {count} times in"
        raise KvprobeError(f"case {case.case_id}: the value of field '{case.field}' {where} the {resolved} prompt")
    start = text.index(SENTINEL)
    head, tail = text[:start], text[start + len(SENTINEL) :]
    return RenderedPrompt(
        form=resolved,
        text_old=head + case.old_value + tail,
        text_new=head + case.new_value + tail,
        char_start=start,
        char_end_old=start + len(case.old_value),
        char_end_new=start + len(case.new_value),
    )
