"""Behavioural validity: does this model's decision actually follow the field?

For every case, prefill the prompt with the old and with the new value and read the decision.
A decision case is *valid* when the model answers correctly under both values (so the edit
flips it); a negative-control case is valid when it answers correctly under both (so the edit
leaves it alone). Probes and edits later run on valid cases only.

The two prompts share every token before the field, so that prefix is prefilled once and the
two suffixes run as one batch of two (:meth:`kvprobe.probes.engine.PairCaches.build`; a run keeps
those caches for its later stages).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pandas as pd

from kvprobe.datasets import AlignedCase, EditCase, Skip, align, require_answers
from kvprobe.kv.readout import answer_targets, logit_diff, predicted, valid_case
from kvprobe.probes.engine import PairCaches

CHECK_COLUMNS = ["case_id", "domain", "field", "control", "old_value", "new_value", "expected_old",
                 "expected_new", "pred_old", "pred_new", "correct_old", "correct_new", "flipped", "m_old",
                 "m_new", "logit_shift", "valid", "n_tokens"]


def validity_row(lm, a: AlignedCase, pc: PairCaches | None = None) -> dict:
    """One row of the validity table for an aligned case (``pc``: its caches, if already built)."""
    c = a.case
    logits = (pc or PairCaches.build(lm, a)).logits
    pred = predicted(logits, a.option_ids, c.options)
    m = logit_diff(logits, a.option_ids, *answer_targets(c)).tolist()
    correct_old, correct_new = pred[0] == c.expected_old, pred[1] == c.expected_new
    return {
        "case_id": c.case_id, "domain": c.domain, "field": c.field, "control": c.control,
        "old_value": c.old_value, "new_value": c.new_value, "expected_old": c.expected_old,
        "expected_new": c.expected_new, "pred_old": pred[0], "pred_new": pred[1],
        "correct_old": correct_old, "correct_new": correct_new, "flipped": pred[0] != pred[1],
        "m_old": m[0], "m_new": m[1], "logit_shift": m[1] - m[0],
        "valid": valid_case(c, pred[0], pred[1]), "n_tokens": len(a.ids_old),
    }


def validity_table(lm, cases: Iterable[EditCase], form: str = "auto",
                on_case: Callable[[int], None] = lambda i: None) -> tuple[pd.DataFrame, list[Skip]]:
    """Validity rows for every aligned case, and the skipped cases with their reasons (every case
    needs its expected answers)."""
    cases = list(cases)
    require_answers(cases, "the validity check")
    rows, skipped = [], []
    for i, case in enumerate(cases):
        a = align(case, lm.tokenizer, form=form)
        if isinstance(a, Skip):
            skipped.append(a)
        else:
            rows.append(validity_row(lm, a))
        on_case(i)
    return pd.DataFrame(rows, columns=CHECK_COLUMNS), skipped


def summarize(df: pd.DataFrame) -> dict:
    """Overall figures: accuracy under each value, paired flip rate, mean logit shift, validity."""
    dec, ctl = df[~df.control], df[df.control]
    out = {"n_cases": len(df), "n_decision": len(dec), "n_control": len(ctl)}
    if len(dec):
        out.update(acc_old=dec.correct_old.mean(), acc_new=dec.correct_new.mean(),
                   flip_rate=(dec.correct_old & dec.correct_new).mean(),
                   any_flip_rate=dec.flipped.mean(), mean_logit_shift=dec.logit_shift.mean())
    if len(ctl):
        out.update(control_invariance=(~ctl.flipped).mean(), control_mean_abs_shift=ctl.logit_shift.abs().mean())
    out["n_valid"] = int(df.valid.sum())
    return out
