"""The field-edit case: one prompt, one mutable field, the answer before and after the edit.

A JSONL case file holds exactly ``EditCase.model_dump(mode="json")``, one case per line.
"""

from __future__ import annotations

import re
import unicodedata
from string import Formatter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvprobe.datasets.layouts import FieldStyle, Layout

Position = Literal["early", "middle", "late"]
POSITIONS: tuple[Position, ...] = ("early", "middle", "late")


class Demo(BaseModel):
    """A few-shot demonstration: a fully rendered prompt body and its answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    body: str = Field(min_length=1)
    answer: str = Field(min_length=1)


# A chat template's turn and sequence marks: ChatML and Llama 3 (<|im_end|>, <|eot_id|>), Gemma
# (<start_of_turn>), Llama 2 and Mistral ([INST], <<SYS>>, <s>), and the common bos/eos/pad names. A
# field value holding one could close the user's turn and open another, whatever the tokenizer.
SPECIAL_TOKEN = re.compile(r"<\|[^|<>\s]{1,40}\|>|</?s>|<(?:start|end)_of_turn>|<(?:bos|eos|pad|unk|mask)>"
                           r"|\[/?INST\]|<</?SYS>>")
SECTION_MARK = "##"  # kvprobe's prompt layouts open a section with it ("## Policy")
VALUE_RULE = ("a field value is one line of plain text: non-empty, no surrounding spaces, no line break or control "
              "character, no chat-template special token, no section mark '##'")


def value_problem(value, tokenizer=None) -> str | None:
    """Why ``value`` cannot be a field's value (None when it can): it must be one line of plain text
    (:data:`VALUE_RULE`). A line break or a special token in a value would reach the model as a new
    line, section or chat turn of the prompt (an injection), so every entry point refuses them
    (EditCase, calibration specs, ``EditableContext``, ``PromptState``). ``tokenizer``: its own
    special tokens are refused as well."""
    if not isinstance(value, str):
        return f"is {type(value).__name__} {value!r}, not text"
    if not value or value != value.strip():
        return f"must be non-empty, one line, without surrounding spaces; got {value!r}"
    if any(c in "\u2028\u2029" or unicodedata.category(c) == "Cc" for c in value):
        return (f"holds a line break or a control character ({value!r}): {VALUE_RULE}, since a line break would "
                f"open a new line, section or turn of the prompt")
    if SECTION_MARK in value:
        return (f"holds {SECTION_MARK!r}, the mark that opens a section of the prompt ({value!r}): {VALUE_RULE}, "
                f"since a value must not read as a section of its own (a fake '## Policy')")
    found = SPECIAL_TOKEN.search(value)
    specials = [t for t in _special_tokens(tokenizer) if t in value] if tokenizer is not None else []
    if found or specials:
        token = found.group() if found else specials[0]
        return f"holds {token!r}, a chat template's special token ({value!r}): {VALUE_RULE}"
    return None


def _special_tokens(tokenizer) -> list[str]:
    tokens = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(t, "special", False):
            tokens.add(str(getattr(t, "content", t)))
    return sorted((t for t in tokens if t and len(t) > 1), key=len, reverse=True)


def _check_value(name: str, value: str) -> None:
    problem = value_problem(value)
    if problem:
        raise ValueError(f"{name} {problem}")


def template_pieces(template: str) -> list[tuple[str, str | None]]:
    """A template as (literal text, placeholder name or None) pairs, ``{{``/``}}`` already unescaped.

    Raises ``ValueError`` (one line) for a bad format string or a placeholder that is not a plain
    ``{name}`` (no index, attribute, conversion or format spec).
    """
    try:
        parsed = list(Formatter().parse(template))
    except ValueError as err:
        raise ValueError(f"the template is not a valid format string: {err} (write '{{{{' and '}}}}' for literal "
                         f"braces)") from None
    pieces = []
    for literal, name, spec, conversion in parsed:
        if name is not None:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            if not name or name.isdigit() or name != name.strip() or any(c in name for c in ".[]"):
                raise ValueError(f"the template's placeholder {shown} is not a plain name; write {{name}} (and '{{{{' "
                                 f"and '}}}}' for literal braces)")
            if spec or conversion:
                raise ValueError(f"the template's placeholder {shown} has a conversion or format spec; write plain "
                                 f"{{{name}}}")
        pieces.append((literal, name))
    return pieces


def placeholders(template: str) -> list[str]:
    """The placeholder names of a template, in order of first appearance."""
    return list(dict.fromkeys(name for _, name in template_pieces(template) if name is not None))


def _listed(names) -> str:
    return ", ".join("{" + n + "}" for n in names) or "none"


class EditCase(BaseModel):
    """One case: a prompt whose record holds ``field``, edited from ``old_value`` to ``new_value``.

    A case has one of three forms. Structured (the generator's): ``rule``, ``fillers``,
    ``record``, ``context`` and ``field_position`` are assembled into the body. Free form (user
    datasets): ``prompt`` is the body, and must contain ``old_value`` exactly once, as a whole
    word. Template (user datasets): ``template`` is the body with str.format-style ``{name}``
    placeholders (``{{`` and ``}}`` are literal braces); ``{field}`` appears exactly once and
    takes ``old_value``/``new_value``, ``values`` fills every other placeholder, and the values may
    appear anywhere else in the text. In both user forms the question follows the body.

    ``expected_old``/``expected_new`` are the answers under each value; they are optional (both or
    neither) since an edit needs none, but everything that measures validity needs them (see
    :func:`kvprobe.datasets.require_answers`). ``control`` marks a negative control (timestamp,
    nonce, request_id): the edit must not change the answer, so ``expected_old == expected_new``.
    Otherwise the edit flips it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    case_id: str = Field(min_length=1)
    domain: str = Field(min_length=1)
    field: str = Field(min_length=1)
    old_value: str
    new_value: str
    control: bool = False
    system: str | None = None
    prompt: str | None = None  # a free-form body holding old_value exactly once (user datasets)
    template: str | None = None  # a body with a single {field} placeholder (user datasets)
    values: dict[str, str] = Field(default={}, validate_default=True)  # the template's other placeholders
    rule: str = ""
    fillers: list[str] = []
    field_position: Position = "middle"
    context: list[str] = []
    record: list[tuple[str, str]] = []
    question: str = Field(min_length=1)
    options: list[str] = Field(default=[], max_length=2)  # two answer options, or none (then: the top token)
    expected_old: str | None = None
    expected_new: str | None = None
    template_id: str = "user"
    few_shot: list[Demo] = []
    cot: bool = False
    layout: Layout = "record"  # how the structured parts are laid out (kvprobe.datasets.layouts)
    field_style: FieldStyle = "key"  # record keys as written ("order_status") or in words ("order status")

    @field_validator("template")
    @classmethod
    def _one_field_placeholder(cls, template: str | None, info: ValidationInfo) -> str | None:
        if template is None or "field" not in info.data:
            return template
        field = info.data["field"]
        names = [name for _, name in template_pieces(template) if name is not None]
        if names.count(field) != 1:
            raise ValueError(f"the template must hold the placeholder {{{field}}} of the edited field exactly "
                             f"once; it holds it {names.count(field)} times (its placeholders: "
                             f"{_listed(dict.fromkeys(names))})")
        return template

    @field_validator("values")
    @classmethod
    def _fill_every_placeholder(cls, values: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        template, field = info.data.get("template"), info.data.get("field")
        if template is None:
            if values and "template" in info.data:
                raise ValueError("only a template case has placeholders to fill, and this case has no 'template'")
            return values
        names = placeholders(template)
        if field in values:
            raise ValueError(f"the edited field's placeholder {{{field}}} takes old_value and new_value, not a "
                             f"value here")
        if extra := [n for n in values if n not in names]:
            raise ValueError(f"{_listed(extra)} is not a placeholder of the template (its placeholders: "
                             f"{_listed(names)})")
        if missing := [n for n in names if n != field and n not in values]:
            raise ValueError(f"no value for the template's placeholder(s) {_listed(missing)}; give every "
                             f"placeholder but {{{field}}} a value")
        for name, value in values.items():
            _check_value(f"values.{name}", value)
        return values

    @model_validator(mode="after")
    def _consistent(self) -> EditCase:
        _check_value("field", self.field)
        _check_value("old_value", self.old_value)
        _check_value("new_value", self.new_value)
        forms = [name for name, given in (("rule", bool(self.rule)), ("prompt", self.prompt is not None),
                                          ("template", self.template is not None)) if given]
        if len(forms) != 1:
            raise ValueError(f"a case needs exactly one of 'rule' (structured form), 'prompt' (free-form body) or "
                             f"'template' (body with placeholders); got {' and '.join(forms) or 'none'}")
        if self.old_value == self.new_value:
            raise ValueError(f"old_value and new_value must differ (both {self.old_value!r})")
        if len(self.options) == 1:
            raise ValueError(f"give two answer options, or none; got one: {self.options}")
        if (self.expected_old is not None or self.expected_new is not None) and not self.options:
            raise ValueError("expected answers need the two answer options they are chosen from")
        if len(set(self.options)) != len(self.options):
            raise ValueError(f"options must be distinct, got {self.options}")
        for name in ("expected_old", "expected_new"):
            if getattr(self, name) is not None and getattr(self, name) not in self.options:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of options {self.options}")
        if (self.expected_old is None) != (self.expected_new is None):
            given, absent = ("expected_old", "expected_new") if self.expected_new is None else ("expected_new",
                                                                                                 "expected_old")
            raise ValueError(f"{given} is given but {absent} is not; give both expected answers or neither")
        if self.expected_old is not None:
            if self.control and self.expected_old != self.expected_new:
                raise ValueError("a control case must keep its answer (expected_old == expected_new)")
            if not self.control and self.expected_old == self.expected_new:
                raise ValueError("a non-control case must flip its answer (expected_old != expected_new)")
        own = forms[0] if forms[0] != "rule" else None
        if own and (self.layout != "record" or self.field_style != "key"):
            kind = "free-form" if own == "prompt" else "template"
            raise ValueError(f"a {kind} case (with '{own}') has its own layout: leave 'layout' and 'field_style' "
                             f"at their defaults")
        if any(key == self.field for key, _ in self.record):
            raise ValueError(f"record must not repeat the edited field {self.field!r}")
        return self
