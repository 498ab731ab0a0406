"""Exactness of the in-engine repair: llama.cpp's edited cache against kvprobe's own.

For one aligned case, the old prompt (before its decision token) is prefilled once in the engine
and once in kvprobe; each repair is then made in both, and the decision token read on each:

    stale          nothing recomputed
    field_only     the field's tokens recomputed (:meth:`Engine.edit`; kvprobe's ``field_only``)
    selective:K    the field and K downstream positions by kvprobe's attention ranking, the same
                   positions in both
    oracle         the new prompt through the engine's prefix cache (the shared prefix reused, the
                   rest decoded) against a fresh prefill of it in the engine, and kvprobe's oracle

A no-op edit writes the old value's tokens back over the field: the engine's read must be its own
prefill's of the old prompt; so must an edit of every position from the field on, of the new one.
Every other engine read is compared with kvprobe's read of the same repair (``max |dlogit|`` over the
vocabulary, and the decision over the case's options); the ``floor`` row is the two prefills'
difference, what the precision allows at all (float32 weights and cache with attention in float32:
2e-5 to 3e-5; the bundled quantised GGUFs with llama.cpp's float16 cache: up to about 1 logit).
The ``what the repair leaves`` row (kvprobe's field_only against its oracle) is the size of the
differences the comparison must tell apart.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from kvprobe.datasets.render import render_pair
from kvprobe.datasets.spans import bos_prefix
from kvprobe.editor.context import make_context
from kvprobe.editor.rankings import rank_downstream
from kvprobe.editor.strategies import apply
from kvprobe.kv.decode import decide
from kvprobe.kv.readout import predicted
from kvprobe.serving.llamacpp import Engine, check_ids

COLUMNS = ["case_id", "edit", "repair", "compared", "tokens_recomputed", "max_abs_dlogit", "decision_engine",
           "decision_kvprobe", "same_decision"]
SESSION, FRESH = 0, 1


def _decision(logits, a) -> str:
    return predicted(torch.as_tensor(np.asarray(logits)), a.option_ids, list(a.case.options))[0]


def case_rows(lm, engine: Engine, a, k: int = 4) -> list[dict]:
    """The exactness rows of one aligned case ``a`` (kvprobe's ``AlignedCase``) on ``engine``."""
    rendered = render_pair(a.case, lm.tokenizer, a.form)
    bos = bos_prefix(lm.tokenizer, rendered.form)
    check_ids(engine.tokenize(bos + rendered.text_old), a.ids_old, f"case {a.case.case_id}'s old prompt")
    check_ids(engine.tokenize(bos + rendered.text_new), a.ids_new, f"case {a.case.case_id}'s new prompt")
    D, (f0, f1) = a.decision_pos, a.field
    ctx = make_context(lm, a)
    later = rank_downstream(ctx, "attention")[:k]
    ours = {s: decide(lm, apply(ctx, s))[0].float().numpy() for s in ("stale", "field_only", f"selective:{k}:attention",
                                                                       "oracle")}
    rows: list[dict] = []

    def row(edit, repair, compared, theirs, mine, n):
        d_e, d_k = _decision(theirs, a), _decision(mine, a)
        rows.append(dict(case_id=a.case.case_id, edit=edit, repair=repair, compared=compared, tokens_recomputed=n,
                         max_abs_dlogit=float(np.abs(theirs - mine).max()), decision_engine=d_e,
                         decision_kvprobe=d_k, same_decision=d_e == d_k))

    def old_session():
        engine.open(SESSION)
        engine.serve(SESSION, a.ids_old[:D])  # the cached prompt, before its decision token

    engine.open(FRESH)
    fresh_old, _ = engine.serve(FRESH, a.ids_old[: D + 1])
    fresh_new, n_tail = engine.serve(FRESH, a.ids_new[: D + 1])  # the prefix cache: only the changed tail
    engine.open(FRESH)
    prefill_new, _ = engine.serve(FRESH, a.ids_new[: D + 1])
    row("real", "oracle", "engine prefill vs kvprobe oracle (the floor)", prefill_new, ours["oracle"], D + 1)
    row("real", "oracle", "engine prefix-cache recompute vs engine prefill", fresh_new, prefill_new, n_tail)

    row("real", "field_only", "kvprobe field_only vs kvprobe oracle (what the repair leaves)", ours["field_only"],
        ours["oracle"], f1 - f0)
    old_session()
    stale = engine.read(SESSION, [a.ids_new[D]])
    row("real", "stale", "engine vs kvprobe", stale, ours["stale"], 0)
    n = engine.edit(SESSION, f0, a.ids_old[f0:f1])
    row("no-op", "field_only", "engine edit vs engine prefill", engine.read(SESSION, [a.ids_old[D]]), fresh_old, n)
    n = engine.edit(SESSION, f0, a.ids_new[f0:f1])
    row("real", "field_only", "engine edit vs kvprobe", engine.read(SESSION, [a.ids_new[D]]), ours["field_only"], n)
    old_session()
    n = engine.edit(SESSION, f0, a.ids_new[f0:f1], also=later)
    row("real", f"selective:{k}:attention", "engine edit vs kvprobe", engine.read(SESSION, [a.ids_new[D]]),
        ours[f"selective:{k}:attention"], n)
    old_session()
    n = engine.edit(SESSION, f0, a.ids_new[f0:f1], also=range(f1, D))
    row("real", "every position from the field", "engine edit vs engine prefill",
        engine.read(SESSION, [a.ids_new[D]]), prefill_new, n)
    return rows


def exactness(lm, engine: Engine, cases, k: int = 4, on_case=lambda: None) -> pd.DataFrame:
    """:func:`case_rows` for every aligned case, as one table (:data:`COLUMNS`)."""
    rows = []
    for a in cases:
        rows += case_rows(lm, engine, a, k)
        on_case()
    return pd.DataFrame(rows, columns=COLUMNS)
