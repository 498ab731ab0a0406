"""``kvprobe weight-edit``'s measurement: per decision case, the KV repairs (run by the editor's own
:func:`~kvprobe.editor.runner.edit_case`) and a LoRA weight edit (:mod:`.lora`), scored against the
same stale and oracle reads by :func:`~kvprobe.editor.score.score_row`: one tidy row per case x arm.

Columns beyond the edits table's (:data:`WEIGHT_COLUMNS`):

    method                 ``kv`` (a KV repair, or the stale and oracle references) or ``lora``
    setup_s                LoRA: wrapping the model with peft plus creating the optimizer (not in
                           the time to decision); NaN for a KV repair (nothing to set up)
    steps, reached         LoRA: optimizer steps taken; whether the edited decision was reached
    final_loss             LoRA: the cross-entropy of the oracle's answer token at the last read (nats)
    contamination_changed  decisions of other prompts that differ from the base model's while the
                           adapter is active
    contamination_n        how many other prompts were read (the old and the new prompt of each of
                           up to ``contamination_cases`` other cases)
    contamination          their share; a KV repair's is 0 by construction (its change lives in one
                           request's cache, the weights are untouched): ``contamination_basis`` says
                           ``measured`` or ``by construction``

For a LoRA row ``wall_s`` is the fit up to the last read and ``decide_s`` that read (a full forward
of the stale prompt under the edited weights), so ``wall_s + decide_s`` is the time to the edited
decision, as for a KV repair; ``tokens_recomputed`` counts that read's prefill only (every fit step
is another forward and backward over the prompt).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from kvprobe.datasets import AlignedCase, EditCase, Skip, require_answers
from kvprobe.defaults import DEFAULT_MIN_FLIP
from kvprobe.editor.context import make_context
from kvprobe.editor.runner import align_all, edit_case
from kvprobe.editor.score import Reference, score_row, timed_read
from kvprobe.editor.strategies import Oracle, Stale, Strategy, apply, parse_strategy
from kvprobe.executor import Context, Serial
from kvprobe.kv.decode import Edited
from kvprobe.metrics import mean_ci, proportion
from kvprobe.weight_edit.lora import LoraSettings, answer_token, decisions, fit, lora_adapter

WEIGHT_COLUMNS = ["method", "setup_s", "steps", "reached", "final_loss", "contamination_changed", "contamination_n",
                  "contamination", "contamination_basis"]
DEFAULT_KV_STRATEGIES = ("stale", "field_only", "erratum", "field_erratum", "oracle")
DEFAULT_CONTAMINATION_CASES = 8
BY_CONSTRUCTION = "by construction"
MEASURED = "measured"


def contamination_pool(aligned: Sequence[AlignedCase], m: int, seed: int = 0) -> list[AlignedCase]:
    """A fixed, seeded sample of ``m + 1`` of the aligned cases (all of them when fewer): each case's
    contamination is read on the first ``m`` of them that are not itself (:func:`others`)."""
    rng = random.Random(f"weight-edit-contamination:{seed}")
    return rng.sample(list(aligned), min(len(aligned), m + 1)) if m else []


def others(a: AlignedCase, pool: Sequence[AlignedCase], m: int) -> list[AlignedCase]:
    return [o for o in pool if o.case.case_id != a.case.case_id][:m]


def prompts(o: AlignedCase) -> list[tuple[list[int], dict, list]]:
    """The old and the new prompt of a case, up to and with its decision token, with its options."""
    end = o.decision_pos + 1
    return [(o.ids_old[:end], o.option_ids, o.case.options), (o.ids_new[:end], o.option_ids, o.case.options)]


def weight_edit_case(lm, a: AlignedCase, strategies: Sequence[Strategy], settings: LoraSettings,
                     other_cases: Sequence[AlignedCase] = (), base_decisions: Sequence[str] | None = None,
                     min_flip: float = DEFAULT_MIN_FLIP, model_name: str = "") -> pd.DataFrame:
    """The KV repairs ``strategies`` and, for a valid decision case, a LoRA edit of one aligned case
    (no chain-of-thought): one row per arm. ``other_cases`` are the cases whose old and new prompts
    the contamination is read on, ``base_decisions`` their decisions under the base model (read here
    when not given, before the adapter exists). The model's weights are the same afterwards. The
    case needs expected answers (and so its two options)."""
    ctx = make_context(lm, a)
    kv = edit_case(lm, a, strategies, 0, min_flip, model_name=model_name, old_cache=ctx.old_cache)
    kv["method"] = "kv"
    kv["contamination_changed"], kv["contamination_n"], kv["contamination"] = 0, 0, 0.0
    kv["contamination_basis"] = BY_CONSTRUCTION
    reads = {label: timed_read(lm, apply(ctx, s))[0] for label, s in (("stale", Stale()), ("oracle", Oracle()))}
    ref = Reference.of(a, reads["stale"], reads["oracle"], min_flip, lm.tokenizer)
    columns = [*kv.columns, *[c for c in WEIGHT_COLUMNS if c not in kv.columns]] if len(kv) else None
    if a.case.control or not ref.valid:
        return kv.reindex(columns=columns) if columns else kv
    other_prompts = [p for o in other_cases for p in prompts(o)]
    base = list(base_decisions) if base_decisions is not None else decisions(lm, other_prompts)
    assert len(base) == len(other_prompts), (len(base), len(other_prompts))
    target = answer_token(reads["oracle"], a.option_ids, ref.pred_oracle)
    end = a.decision_pos + 1
    with lm.lock, lora_adapter(lm, settings) as (wrapped, wrap_s):
        f = fit(lm, wrapped, a.ids_old[:end], a.option_ids, a.case.options, ref.pred_oracle, target, settings)
        after = decisions(lm, other_prompts)
    changed = sum(x != y for x, y in zip(base, after))
    edited = Edited(None, [], a.decision_pos, end, wall_s=f.fit_s, setup_s=wrap_s + f.optimizer_s,
                    note=f"{f.steps} step(s), lr {settings.lr:g}, targets {','.join(settings.targets)}")
    case = a.case
    row = {"model": model_name, "case_id": case.case_id, **score_row(ref, settings, edited, f.logits, f.decide_s),
           "domain": case.domain, "field": case.field, "control": case.control, "template_id": case.template_id,
           "cot": 0, "valid": ref.valid, "n_tokens": len(a.ids_old), "kind": "decision", "method": "lora",
           "setup_s": edited.setup_s, "steps": f.steps, "reached": f.reached, "final_loss": f.losses[-1],
           "contamination_changed": changed, "contamination_n": len(after),
           "contamination": changed / len(after) if after else float("nan"), "contamination_basis": MEASURED}
    lora = pd.DataFrame([row])
    return pd.concat([kv, lora], ignore_index=True).reindex(columns=columns or list(lora.columns))


def run_weight_edits(lm, cases: Sequence[EditCase], strategies: Sequence[Strategy | str] = DEFAULT_KV_STRATEGIES,
                     settings: LoraSettings | None = None, contamination_cases: int = DEFAULT_CONTAMINATION_CASES,
                     form: str = "auto", min_flip: float = DEFAULT_MIN_FLIP, seed: int = 0, model_name: str = "",
                     store=None, on_case: Callable[[], None] = lambda: None, executor=None
                     ) -> tuple[pd.DataFrame, list[Skip]]:
    """:func:`weight_edit_case` over the cases (finished cases kept in ``store``, a
    :class:`~kvprobe.results.CaseStore`, for resume), through ``executor`` (serial by default).
    Each case's contamination is read on the same seeded sample of ``contamination_cases`` other
    cases (:func:`contamination_pool`); their base decisions are read once per process."""
    settings = settings or LoraSettings(seed=seed)
    executor, ctx = executor or Serial(), Context(lm)
    require_answers(cases, "run_weight_edits")
    parsed = [s if isinstance(s, Strategy) else parse_strategy(s) for s in strategies]
    aligned, skipped = align_all(lm, cases, form)
    pool = contamination_pool(aligned, contamination_cases, seed)

    def one(ctx, a):
        chosen = others(a, pool, contamination_cases)
        base = [d for o in chosen
                for d in ctx.keep(f"weight_edit.base:{o.case.case_id}", lambda lm, o=o: decisions(lm, prompts(o)))]
        return weight_edit_case(ctx.lm, a, parsed, settings, chosen, base, min_flip, model_name)

    df = executor.map(store, [(a.case.case_id, a) for a in aligned], one, ctx, on_case)
    return df, skipped


def summarize_weight_edits(df: pd.DataFrame) -> pd.DataFrame:
    """One row per arm (strategy) over the valid decision cases: agreement with the oracle (Wilson
    95% CI), the median time to the edited decision and setup (seconds), and contamination, or 0 by
    construction. Contamination is the mean over edited cases of each adapter's share of changed
    decisions, with a bootstrap 95% CI over those cases (``contamination_n`` cases; the reads behind
    them in ``contamination_reads``): every adapter is read on the same other prompts, so the reads
    are not independent draws and a binomial interval over all of them would be too narrow."""
    sel = df[(df["kind"] == "decision") & df["valid"].astype(bool) & df["error"].isna()]
    rows = []
    for strategy, g in sel.groupby("strategy", sort=False):
        agree = proportion(g["agree"].astype(float))
        basis = g["contamination_basis"].iloc[0]
        reads = int(g["contamination_n"].sum())
        if basis == MEASURED and reads:
            share, lo, hi, n = mean_ci(g["contamination"])
        else:
            share, lo, hi, n = (0.0 if basis == BY_CONSTRUCTION else float("nan")), 0.0, 0.0, 0
        rows.append({"strategy": strategy, "method": g["method"].iloc[0], "n": len(g), "agreement": agree[0],
                     "agreement_lo": agree[1], "agreement_hi": agree[2],
                     "to_decision_s": float((g["wall_s"] + g["decide_s"]).median()),
                     "setup_s": float(g["setup_s"].median()) if g["setup_s"].notna().any() else float("nan"),
                     "steps": float(g["steps"].median()) if g["steps"].notna().any() else float("nan"),
                     "reached": float(g["reached"].astype(float).mean()) if g["reached"].notna().any() else np.nan,
                     "contamination": share, "contamination_lo": lo, "contamination_hi": hi, "contamination_n": n,
                     "contamination_reads": reads,
                     "contamination_basis": basis})
    return pd.DataFrame(rows)
