"""Prompt layouts: the same case, laid out as a sectioned record, plain lines, prose, JSON, YAML,
an earlier chat turn or a tool description.

A layout is a small function from the case's :class:`Parts` (rule, fillers before the field, the
record with the field among its lines, context, fillers after the field, an optional erratum,
the question) to the turns of the prompt: ``[("user", text)]`` for every layout but
``chat_history``, which states the record in an earlier user turn. Every layout keeps the parts in
the same order, so the fillers after the field are downstream of it in every layout, and every
layout renders the field value exactly once (the renderer finds its span through a sentinel).

Layouts (``EditCase.layout``)::

    record        ## Policy / ## Record / ## Context / ## Notes / ## Request, "key: value" lines
    lines         the rule, plain sentences, a "Field name: value." line among them, the question;
                  no headers, no bullets
    prose         running text: "The field name is value." inside a paragraph
    json          the rule, then the record (context and notes included) as a JSON object
    yaml          the same as YAML
    chat_history  the user states the record in an earlier turn; the question comes turns later
    tool_spec     a tool description block whose fixed arguments hold the field

``field_style`` names record keys as written (``key``: ``order_status``) or in words (``words``:
``order status``, "Order status" at the start of a line).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Layout = Literal["record", "lines", "prose", "json", "yaml", "chat_history", "tool_spec"]
FieldStyle = Literal["key", "words"]
FIELD_STYLES: tuple[FieldStyle, ...] = ("key", "words")
Turn = tuple[str, str]  # (role, content)

POLICY = "## Policy"
RECORD = "## Record"
CONTEXT = "## Context"
NOTES = "## Notes"
REQUEST = "## Request"
BULLET = "- "
# The fixed words of the layouts other than "record" (the generator's vocabulary holds them).
RECORD_LEAD = "Record:"
CHAT_LEAD = "Here are the details."
CHAT_ACK = "Noted."
TOOL_LEAD = "Tool:"
TOOL_DESCRIPTION = "Description:"
TOOL_ARGUMENTS = "Arguments:"
TOOL_NOTES = "Notes:"
USER, ASSISTANT = "User:", "Assistant:"
LAYOUT_WORDS = (RECORD_LEAD, CHAT_LEAD, CHAT_ACK, TOOL_LEAD, TOOL_DESCRIPTION, TOOL_ARGUMENTS, TOOL_NOTES, USER,
                ASSISTANT, 'The is . { } [ ] " , context notes record')


def label(key: str, style: FieldStyle) -> str:
    """A record key as the prompt names it: ``order_status`` or ``order status``."""
    return key if style == "key" else key.replace("_", " ")


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


@dataclass(frozen=True)
class Parts:
    """What every layout lays out, in this order; ``record`` holds (label, value) pairs."""

    domain: str
    rule: str
    before: list[str]  # filler sentences before the field
    record: list[tuple[str, str]]  # the field among them, labels already styled
    context: list[str]
    after: list[str]  # filler sentences after the field (the downstream filler)
    erratum: str | None
    question: str
    words: bool = False  # field_style "words": a label that starts a line is capitalised

    def line_label(self, key: str) -> str:
        return _capital(key) if self.words else key


def _record(p: Parts) -> list[Turn]:
    sections = [
        [POLICY, p.rule, *(BULLET + f for f in p.before)],
        [RECORD, *(f"{k}: {v}" for k, v in p.record)],
    ]
    if p.context:
        sections.append([CONTEXT, *p.context])
    if p.after:
        sections.append([NOTES, *(BULLET + f for f in p.after)])
    if p.erratum:
        sections.append([p.erratum])
    sections.append([REQUEST, p.question])
    return [("user", "\n\n".join("\n".join(lines) for lines in sections))]


def _lines(p: Parts) -> list[Turn]:
    lines = [p.rule, *p.before, *(f"{p.line_label(k)}: {v}." for k, v in p.record), *p.context, *p.after,
             *([p.erratum] if p.erratum else []), p.question]
    return [("user", "\n".join(lines))]


def _prose(p: Parts) -> list[Turn]:
    facts = " ".join(f"The {k} is {v}." for k, v in p.record)
    paragraphs = [" ".join([p.rule, *p.before]), " ".join([facts, *p.context, *p.after])]
    return [("user", "\n\n".join([*paragraphs, *([p.erratum] if p.erratum else []), p.question]))]


def _structured(p: Parts) -> dict:
    data: dict = dict(p.record)
    if p.context:
        data["context"] = list(p.context)
    if p.after:
        data["notes"] = list(p.after)
    return data


def _head(p: Parts) -> str:
    return "\n".join([p.rule, *p.before])


def _json(p: Parts) -> list[Turn]:
    block = f"{RECORD_LEAD}\n{json.dumps(_structured(p), indent=2, ensure_ascii=False)}"
    return [("user", "\n\n".join([_head(p), block, *([p.erratum] if p.erratum else []), p.question]))]


def _yaml(p: Parts) -> list[Turn]:
    lines = ["record:", *(f"  {k}: {v}" for k, v in p.record)]
    for name, items in (("context", p.context), ("notes", p.after)):
        if items:
            lines += [f"{name}:", *(f"  - {item}" for item in items)]
    return [("user", "\n\n".join([_head(p), "\n".join(lines), *([p.erratum] if p.erratum else []), p.question]))]


def _chat_history(p: Parts) -> list[Turn]:
    turns: list[Turn] = [("user", _head(p)), ("assistant", CHAT_ACK)]
    turns += [("user", "\n".join([CHAT_LEAD, *(f"{p.line_label(k)}: {v}." for k, v in p.record)])),
              ("assistant", CHAT_ACK)]
    if p.context or p.after:
        turns += [("user", "\n".join([*p.context, *p.after])), ("assistant", CHAT_ACK)]
    return [*turns, ("user", "\n\n".join([*([p.erratum] if p.erratum else []), p.question]))]


def _tool_spec(p: Parts) -> list[Turn]:
    block = [f"{TOOL_LEAD} {p.domain}", f"{TOOL_DESCRIPTION} {p.rule}", TOOL_ARGUMENTS,
             *(f"{BULLET}{k}: {v}" for k, v in p.record)]
    if p.after:
        block += [TOOL_NOTES, *(BULLET + f for f in p.after)]
    paragraphs = ["\n".join(p.before)] if p.before else []
    paragraphs += ["\n".join(block), *(["\n".join(p.context)] if p.context else []),
                   *([p.erratum] if p.erratum else []), p.question]
    return [("user", "\n\n".join(paragraphs))]


LAYOUTS: dict[str, Callable[[Parts], list[Turn]]] = {
    "record": _record, "lines": _lines, "prose": _prose, "json": _json, "yaml": _yaml,
    "chat_history": _chat_history, "tool_spec": _tool_spec,
}  # fmt: skip


def as_text(turns: list[Turn]) -> str:
    """Turns as one plain-text body: a single user turn as it is, a conversation as ``User:`` /
    ``Assistant:`` paragraphs (the raw form, and few-shot demos)."""
    if len(turns) == 1:
        return turns[0][1]
    return "\n\n".join(f"{USER if role == 'user' else ASSISTANT} {text}" for role, text in turns)
