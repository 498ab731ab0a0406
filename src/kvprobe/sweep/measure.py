"""The cheap per-case measurement of a sweep cell: two prefills, then cache edits and short tails.

For one aligned case: prefill the old and the new prompt once (sharing the prefix before the
field, :class:`~kvprobe.probes.engine.PairCaches`), then

- **patches** (one batched one-token read): the new prompt's K/V swapped into the old cache at
  the field only (``field``), at the whole downstream span (``downstream``), at the downstream
  tokens of one kind (``kind:newline``, ``kind:punct``, ``kind:section``, ``kind:word``), at
  nothing (``none``, the stale read) and everywhere (``all``, the oracle read). The stale and
  oracle reads give validity for free;
- **strategies** (valid cases only): every edit strategy from the old cache, read at the decision
  token (no chain-of-thought), scored against the stale and oracle reads by
  :func:`kvprobe.editor.score.score_row` (``wall_s`` the repair's seconds, ``decide_s`` the
  read's). Three need no work of their own (:data:`SAME_AS_PATCH`): ``stale`` is the ``none``
  read, ``oracle`` the ``all`` read, and
  ``field_only`` the ``field`` read, since recomputing the field over a prefix identical in both
  prompts gives exactly the new prompt's field entries (``derive=False`` runs them anyway; a test
  checks that both agree).

One row per case x measure, with ``m``, the stale and oracle ``m``, recovery (NaN when the
oracle flip is under ``min_flip``) and agreement with the oracle's decision: the names of
:data:`kvprobe.editor.score.ROW_COLUMNS`, except that ``name`` holds a patch set's name or a
strategy's label (``measure`` says which) and ``agree`` is 0/1 (the summary averages it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pandas as pd

from kvprobe.datasets import AlignedCase
from kvprobe.editor.context import EditContext
from kvprobe.editor.strategies import Strategy, apply
from kvprobe.errors import KvprobeError
from kvprobe.editor.score import Reference, error_row, score_row, timed_read
from kvprobe.kv.readout import answer_targets, logit_diff, option_columns, predicted
from kvprobe.probes.engine import PairCaches, Patch, patched_reads

DOWNSTREAM_KINDS = ("newline", "punct", "section", "word")
SAME_AS_PATCH = {"stale": "none", "field_only": "field", "oracle": "all"}  # strategy -> the patch read it equals
COLUMNS = ["case_id", "domain", "field", "control", "valid", "n_tokens", "field_tokens", "downstream_tokens",
           "measure", "name", "m", "m_stale", "m_oracle", "oracle_flip", "recovery", "agree", "frac_recomputed",
           "wall_s", "decide_s", "chose", "error", "case_s"]


def patch_sets(a: AlignedCase) -> list[tuple[str, Patch]]:
    """The named patch sets of one case (kinds absent from its downstream span are left out)."""
    D, (f0, f1), (d0, d1) = a.decision_pos, a.field, a.downstream
    sets = [("none", Patch(())), ("all", Patch(tuple(range(D)))), ("field", Patch(tuple(range(f0, f1)))),
            ("downstream", Patch(tuple(range(d0, d1))))]
    for kind in DOWNSTREAM_KINDS:
        positions = tuple(p for p in range(d0, d1) if a.kinds[p] == kind)
        if positions:
            sets.append((f"kind:{kind}", Patch(positions)))
    return sets


def measure_case(lm, a: AlignedCase, strategies: Sequence[Strategy], min_flip: float, derive: bool = True
                 ) -> pd.DataFrame:
    """Every patch and, on a valid case, every strategy (see the module docstring); one row each."""
    start = time.perf_counter()
    case = a.case
    lm.check_length(len(a.ids_old))
    pc = PairCaches.build(lm, a)
    sets = patch_sets(a)
    logits = patched_reads(lm, pc, [p for _, p in sets], columns=option_columns(a.option_ids))
    # the reads hold the options' columns only: no distribution comparison against them
    ref = Reference.of(a, logits[0], logits[1], min_flip, lm.tokenizer, full_vocab=False)
    new_ans, old_ans = answer_targets(case)
    ms, preds = logit_diff(logits, a.option_ids, new_ans, old_ans).tolist(), predicted(logits, a.option_ids, case.options)
    m_stale, m_oracle, valid = ref.m_stale, ref.m_oracle, ref.valid
    rows = [{"measure": "patch", "name": name, "m": m, "recovery": ref.recovery(m),
             "agree": float(pred == ref.pred_oracle)} for (name, _), m, pred in zip(sets, ms, preds)]
    if valid:
        ctx = EditContext(lm, a, pc.old)
        D, (f0, f1) = a.decision_pos, a.field
        recomputed = {"none": 0, "field": f1 - f0, "all": D}
        patch_row = {row["name"]: row for row in rows}
        for s in strategies:
            if derive and s.label in SAME_AS_PATCH:
                same = patch_row[SAME_AS_PATCH[s.label]]
                rows.append({**same, "measure": "strategy", "name": s.label,
                             "frac_recomputed": recomputed[SAME_AS_PATCH[s.label]] / (D + 1)})
                continue
            try:
                edited = apply(ctx, s)  # the oracle too: a full prefill, timed like the others
                lg, decide_s = timed_read(lm, edited)
            except KvprobeError as exc:  # e.g. a chat template that refuses a second user turn
                rows.append(_strategy_row(error_row(s, exc)))
                continue
            rows.append(_strategy_row(score_row(ref, s, edited, lg, decide_s)))
    df = pd.DataFrame(rows)
    f0, f1 = a.field
    d0, d1 = a.downstream
    for col, value in (("case_id", case.case_id), ("domain", case.domain), ("field", case.field),
                       ("control", case.control), ("valid", valid), ("n_tokens", len(a.ids_old)),
                       ("field_tokens", f1 - f0), ("downstream_tokens", d1 - d0), ("m_stale", m_stale),
                       ("m_oracle", m_oracle), ("oracle_flip", m_oracle - m_stale)):
        df[col] = value
    df["case_s"] = time.perf_counter() - start
    return df.reindex(columns=COLUMNS)


def _strategy_row(row: dict) -> dict:
    """A strategy's row of the sweep table from its :func:`~kvprobe.editor.score.score_row`: its
    label under ``name`` (the column that names patch sets too), ``agree`` as 0/1 (a patch row's
    share-ready kind), ``chose`` None unless a choosing strategy settled on something."""
    out = {"measure": "strategy", "name": row["strategy"]}
    out |= {k: row[k] for k in ("m", "recovery", "frac_recomputed", "wall_s", "decide_s") if k in row}
    if row.get("error") is not None:
        return out | {"error": row["error"]}
    return out | {"agree": float(row["agree"]), "chose": row["chose"] or None}
