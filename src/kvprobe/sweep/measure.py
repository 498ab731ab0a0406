"""The cheap per-case measurement of a sweep cell: two prefills, then cache edits and short tails.

For one aligned case: prefill the old and the new prompt once (sharing the prefix before the
field, :class:`~kvprobe.probes.engine.PairCaches`), then

- **patches** (one batched one-token read): the new prompt's K/V swapped into the old cache at
  the field only (``field``), at the whole downstream span (``downstream``), at the downstream
  tokens of one kind (``kind:newline``, ``kind:punct``, ``kind:section``, ``kind:word``), at
  nothing (``none``, the stale read) and everywhere (``all``, the oracle read). The stale and
  oracle reads give validity for free;
- **strategies** (valid cases only): every edit strategy from the old cache, read at the decision
  token (no chain-of-thought), against the oracle read. Three need no work of their own
  (:data:`SAME_AS_PATCH`): ``stale`` is the ``none`` read, ``oracle`` the ``all`` read, and
  ``field_only`` the ``field`` read, since recomputing the field over a prefix identical in both
  prompts gives exactly the new prompt's field entries (``derive=False`` runs them anyway; a test
  checks that both agree).

One row per case x measure, with ``m``, the stale and oracle ``m``, recovery (NaN when the
oracle flip is under ``min_flip``) and agreement with the oracle's decision.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pandas as pd

from kvprobe.datasets import AlignedCase
from kvprobe.editor.context import EditContext
from kvprobe.editor.strategies import Strategy, apply
from kvprobe.errors import KvprobeError
from kvprobe.kv.decode import decide
from kvprobe.kv.readout import answer_targets, logit_diff, option_columns, predicted
from kvprobe.metrics import recovery
from kvprobe.probes.engine import PairCaches, Patch, patched_reads

DOWNSTREAM_KINDS = ("newline", "punct", "section", "word")
SAME_AS_PATCH = {"stale": "none", "field_only": "field", "oracle": "all"}  # strategy -> the patch read it equals
COLUMNS = ["case_id", "domain", "field", "control", "valid", "n_tokens", "field_tokens", "downstream_tokens",
           "measure", "name", "m", "m_stale", "m_oracle", "oracle_flip", "recovery", "agree", "frac_recomputed",
           "wall_s", "chose", "error", "case_s"]


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
    new_ans, old_ans = answer_targets(case)
    m_of = lambda lg: logit_diff(lg, a.option_ids, new_ans, old_ans)
    pred_of = lambda lg: predicted(lg, a.option_ids, case.options)
    lm.check_length(len(a.ids_old))
    pc = PairCaches.build(lm, a)
    sets = patch_sets(a)
    logits = patched_reads(lm, pc, [p for _, p in sets], columns=option_columns(a.option_ids))
    ms, preds = m_of(logits).tolist(), pred_of(logits)
    m_stale, m_oracle, pred_stale, pred_oracle = ms[0], ms[1], preds[0], preds[1]
    valid = pred_stale == case.expected_old and pred_oracle == case.expected_new
    rows = [{"measure": "patch", "name": name, "m": m, "recovery": recovery(m, m_stale, m_oracle, min_flip),
             "agree": float(pred == pred_oracle)} for (name, _), m, pred in zip(sets, ms, preds)]
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
            t0 = time.perf_counter()
            try:
                edited = apply(ctx, s)  # the oracle too: a full prefill, timed like the others
                lg, _ = decide(lm, edited, 0)
            except KvprobeError as exc:  # e.g. a chat template that refuses a second user turn
                rows.append({"measure": "strategy", "name": s.label, "error": str(exc)})
                continue
            m = float(m_of(lg[None])[0])
            rows.append({"measure": "strategy", "name": s.label, "m": m,
                         "recovery": recovery(m, m_stale, m_oracle, min_flip),
                         "agree": float(pred_of(lg[None])[0] == pred_oracle),
                         "frac_recomputed": float(edited.recomputed) / edited.total,
                         "wall_s": time.perf_counter() - t0, "chose": edited.chose or None})
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
