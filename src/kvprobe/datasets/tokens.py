"""Prompt tokens of the probed cases, saved beside the results so that a report can show them.

The probes store positions, token kinds and regions, never the token text; the notes map in the
report needs it. :func:`case_tokens` is called once by the pipeline (it needs the tokenizer) and
its frame is saved as :data:`TOKENS`; the report then reads only that file.

Rows: one per prompt position ``0..decision_pos`` of every case, with ``token`` the text of the
token in the old prompt *including the whitespace before it* (so joining the tokens of a case
gives back its prompt), ``token_new`` the same for the new prompt (differs only on the field),
``kind`` (:data:`kvprobe.datasets.KINDS`, "field" on the field span) and ``region`` (sink,
prefix, field, downstream, decision), as :func:`kvprobe.datasets.spans.region_of` names them.
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from kvprobe.datasets.render import render_pair
from kvprobe.datasets.spans import bos_prefix, region_of
from kvprobe.results import TOKENS  # noqa: F401  (re-exported)

TOKEN_COLUMNS = ("case_id", "position", "token", "token_new", "kind", "region")



def token_texts(tokenizer, text: str, ids: list[int]) -> list[str]:
    """Surface text of each token of ``text`` (whose ids are ``ids``), each with the whitespace that
    precedes it. Uses the tokenizer's character offsets; where they do not reproduce ``ids``,
    decodes one id at a time instead."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        got, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, TypeError, ValueError):
        got, offsets = [], []
    if got == list(ids):
        out, prev = [], 0
        for start, end in offsets:
            if end <= prev:  # a token with no characters of its own (e.g. an added special token)
                out.append("")
                continue
            out.append(text[prev:end])
            prev = end
        if "".join(out) == text[:prev]:
            return out
    return [tokenizer.decode([i]) for i in ids]


def case_tokens(lm, aligned: Iterable) -> pd.DataFrame:
    """Token rows (:data:`TOKEN_COLUMNS`) for aligned cases (``kvprobe.datasets.AlignedCase``)."""
    tok = lm.tokenizer
    records = []
    for a in aligned:
        rendered = render_pair(a.case, tok, a.form)
        bos = bos_prefix(tok, rendered.form)
        old = token_texts(tok, bos + rendered.text_old, a.ids_old)
        new = token_texts(tok, bos + rendered.text_new, a.ids_new)
        assert len(old) == len(new) == len(a.ids_old), (len(old), len(new), len(a.ids_old))
        for p in range(a.decision_pos + 1):
            records.append({"case_id": a.case.case_id, "position": p, "token": old[p], "token_new": new[p],
                            "kind": a.kinds[p], "region": region_of(a, p)})
    return pd.DataFrame(records, columns=list(TOKEN_COLUMNS))
