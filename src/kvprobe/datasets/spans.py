"""Exact token alignment of an edit case under one tokenizer.

Conventions (token indices into ``ids_old``/``ids_new``, half-open ``[start, end)``):

- ``field``: the tokens that overlap the value's characters. A leading space merged into the
  first value token (byte-level ``Ġ``, sentencepiece ``▁``) belongs to the field; any other
  character of a token that also holds value characters is a straddle, and the case is skipped.
- ``downstream = (field[1], decision_pos)``: every token after the field except the last.
- ``decision_pos = len(ids) - 1``: the last prompt token, whose logits give the decision.

A case aligns only if the tokens before and after the field are identical under the old and new
value and the field has the same length under both; otherwise :func:`align` returns a
:class:`Skip` with the reason. It never returns a misaligned pair.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvprobe.datasets.render import Form, render_pair
from kvprobe.datasets.schema import EditCase
from kvprobe.errors import KvprobeError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

KINDS = ("field", "newline", "punct", "section", "word")
_SECTION_MARK = re.compile(r"#+|-{3,}|={3,}|\*{3,}")
# Token-string spellings of whitespace: byte-level BPE (GPT-2), sentencepiece, byte fallback.
_WHITESPACE = {"Ġ": " ", "Ċ": "\n", "ĉ": "\t", "▁": " ", "<0x0A>": "\n", "<0x09>": "\t", "<0x20>": " "}


@dataclass(frozen=True)
class AlignedCase:
    """Token ids of the old and new prompt (same length) and where things sit in them."""

    case: EditCase
    form: Form
    ids_old: list[int]
    ids_new: list[int]
    field: tuple[int, int]
    downstream: tuple[int, int]
    decision_pos: int
    kinds: list[str]  # one of KINDS per token
    option_ids: dict[str, list[int]]  # option -> first-token ids (bare and space-prefixed)


@dataclass(frozen=True)
class Skip:
    """A case that does not align under this tokenizer, and why."""

    case_id: str
    reason: str


def surface(token: str) -> str:
    """A token string with its whitespace markers turned back into whitespace."""
    for mark, char in _WHITESPACE.items():
        token = token.replace(mark, char)
    return token


def token_kind(token: str, special: bool = False) -> str:
    """Tag one token string: "section", "newline", "punct" or "word" ("field" comes from the span)."""
    if special:
        return "section"
    text = surface(token)
    core = text.strip()
    if _SECTION_MARK.fullmatch(core):
        return "section"
    if any(c.isalnum() for c in core):
        return "word"
    return "newline" if "\n" in text else "punct"


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, added in tokenizer.added_tokens_decoder.items() if added.special)
    return ids


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as err:  # slow tokenizers have no offsets
        raise KvprobeError(f"alignment needs a fast tokenizer; {type(tokenizer).__name__} is not") from err
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _field_tokens(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    hit = [i for i, (a, b) in enumerate(offsets) if b > a and a < end and b > start]
    return (hit[0], hit[-1] + 1) if hit else None


def option_ids(tokenizer: PreTrainedTokenizerBase, option: str) -> list[int]:
    """First-token ids of ``option`` bare and with a leading space, deduplicated, whitespace-only dropped."""
    ids: list[int] = []
    for text in (option, " " + option):
        enc = tokenizer.encode(text, add_special_tokens=False)
        if enc and surface(tokenizer.convert_ids_to_tokens(enc[0])).strip() and enc[0] not in ids:
            ids.append(enc[0])
    return ids


def region_of(a: AlignedCase, position: int) -> str:
    """Where a position sits: sink (position 0), prefix, field, downstream or decision."""
    if position == a.decision_pos:
        return "decision"
    if a.field[0] <= position < a.field[1]:
        return "field"
    if position >= a.field[1]:
        return "downstream"
    return "sink" if position == 0 else "prefix"


def bos_prefix(tokenizer: PreTrainedTokenizerBase, form: str) -> str:
    """The BOS text prepended to a raw prompt (chat templates write their own), or ""."""
    if form == "raw" and tokenizer.bos_token and getattr(tokenizer, "add_bos_token", False):
        return tokenizer.bos_token
    return ""


def prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str, form: str) -> list[int]:
    """Token ids of a rendered prompt, tokenized exactly as :func:`align` does."""
    return _encode(tokenizer, bos_prefix(tokenizer, form) + text)[0]


def align(case: EditCase, tokenizer: PreTrainedTokenizerBase, form: str = "auto") -> AlignedCase | Skip:
    """Tokenize the old and new prompt and locate the field, or say why the case cannot align.

    Chat prompts are tokenized without added special tokens (the template writes its own BOS);
    raw prompts get ``tokenizer.bos_token`` prepended when the tokenizer sets ``add_bos_token``.
    Raises ``KvprobeError`` when the field value is missing from the prompt or its tokens.
    """
    rendered = render_pair(case, tokenizer, form)
    bos = bos_prefix(tokenizer, rendered.form)
    start = rendered.char_start + len(bos)

    sides = {}
    for side, text, end in (
        ("old", bos + rendered.text_old, rendered.char_end_old + len(bos)),
        ("new", bos + rendered.text_new, rendered.char_end_new + len(bos)),
    ):
        ids, offsets = _encode(tokenizer, text)
        span = _field_tokens(offsets, start, end)
        if span is None:
            raise KvprobeError(f"case {case.case_id}: no token holds the value of field '{case.field}'")
        lo, hi = span
        if offsets[lo][0] < start and text[offsets[lo][0] : start].strip():
            token = text[offsets[lo][0] : offsets[lo][1]]
            return Skip(case.case_id, f"token {token!r} straddles the start of the {side} field value")
        if offsets[hi - 1][1] > end:
            token = text[offsets[hi - 1][0] : offsets[hi - 1][1]]
            return Skip(case.case_id, f"token {token!r} straddles the end of the {side} field value")
        sides[side] = (ids, span)

    (ids_old, (lo, hi)), (ids_new, (lo_new, hi_new)) = sides["old"], sides["new"]
    if hi - lo != hi_new - lo_new:
        return Skip(case.case_id, f"field values tokenize to different lengths ({hi - lo} vs {hi_new - lo_new})")
    if ids_old[:lo] != ids_new[:lo_new]:
        return Skip(case.case_id, "tokens before the field differ between the old and new prompt")
    if ids_old[hi:] != ids_new[hi_new:]:
        return Skip(case.case_id, "tokens after the field differ between the old and new prompt")
    assert len(ids_old) == len(ids_new) and lo == lo_new  # follows from the three checks above
    if hi >= len(ids_old):
        return Skip(case.case_id, "the field is the last token; nothing downstream to read a decision from")

    options = {opt: option_ids(tokenizer, opt) for opt in case.options}
    for opt, ids in options.items():
        if not ids:
            return Skip(case.case_id, f"option {opt!r} has no non-space first token")
    first, second = (set(options[opt]) for opt in case.options) if options else (set(), set())
    if first & second:
        return Skip(case.case_id, f"options {case.options} share first-token ids {sorted(first & second)}")

    special = _special_ids(tokenizer)
    kinds = [token_kind(tok, i in special) for i, tok in zip(ids_old, tokenizer.convert_ids_to_tokens(ids_old))]
    kinds[lo:hi] = ["field"] * (hi - lo)
    decision = len(ids_old) - 1
    return AlignedCase(
        case=case,
        form=rendered.form,
        ids_old=ids_old,
        ids_new=ids_new,
        field=(lo, hi),
        downstream=(hi, decision),
        decision_pos=decision,
        kinds=kinds,
        option_ids=options,
    )
