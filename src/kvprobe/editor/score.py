"""Scoring a repaired state against the stale and oracle reads of its case: the one measurement core.

Whatever asks "how close does this repair come to the oracle" (``kvprobe edit`` and ``kvprobe
run``'s edits table, ``kvprobe sweep``'s strategy rows, ``kvprobe diagnose``, a calibration)
builds its rows here, in one vocabulary (:data:`ROW_COLUMNS`, edits.parquet's):

    strategy            the strategy's label (its spec)
    k, ranking          selective's arguments (None for the others)
    m                   score(new answer) - score(old answer) at the decision token (NaN for a
                        case without expected answers)
    m_stale, m_oracle   the same of the stale and the oracle read; ``oracle_flip`` their difference
    recovery            (m - m_stale) / oracle_flip, NaN when the flip is under ``min_flip``
    pred, reference     the decision this state and the oracle (the reference) read (the arg-max
                        option; the top token's text for a case without options)
    agree               pred == reference (a bool)
    correct             pred == the case's expected_new
    cosine, kl          the next-token distribution against the oracle's (NaN when the oracle
                        logits are not the full vocabulary's)
    tokens_recomputed, tokens_total, frac_recomputed   what the repair computed, of how many
    wall_s, decide_s    the repair's seconds; the decision read's seconds
    rewritten_prompt    the repair needs a rewritten prompt (hoist)
    generated           the reasoning text with chain-of-thought, else ""
    error, note, chose  why it could not run (an error row has strategy and error only); what a
                        choosing strategy (auto) settled on and why ("" for the others)

:class:`Reference` holds a case's stale and oracle reads; :func:`score_row` and
:func:`error_row` build one row; :func:`measure_strategies` runs stale, the oracle and each
strategy on one case and scores them (the helper for a caller with no batching of its own).
Validity is :func:`kvprobe.kv.readout.valid_case`.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from kvprobe.datasets import AlignedCase
from kvprobe.defaults import DEFAULT_MIN_FLIP
from kvprobe.editor.context import EditContext, make_context
from kvprobe.editor.strategies import Oracle, Stale, Strategy, apply
from kvprobe.errors import KvprobeError
from kvprobe.kv.decode import Edited, decide, decide_batch, shape_of
from kvprobe.kv.readout import answer_targets, logit_diff, option_scores, predicted, valid_case
from kvprobe.metrics import compare, recovery

ROW_COLUMNS = ["strategy", "k", "ranking", "m", "m_stale", "m_oracle", "oracle_flip", "recovery", "pred",
               "reference", "agree", "correct", "cosine", "kl", "tokens_recomputed", "tokens_total",
               "frac_recomputed", "wall_s", "decide_s", "rewritten_prompt", "generated", "error", "note", "chose"]
NAN = float("nan")


@dataclass(frozen=True)
class Reference:
    """What every repaired state of one aligned case is scored against: the stale read (the old
    cache as it is) and the oracle read (a fresh prefill of the new prompt).

    Build it with :meth:`of` from the two reads' decision logits (V,). ``oracle_logits`` is kept
    for the distribution comparison (cosine, KL); None when the reads computed only the options'
    columns (then those are NaN). ``tokenizer`` names the top token of a case without options.
    """

    a: AlignedCase
    pred_stale: str
    pred_oracle: str
    m_stale: float
    m_oracle: float
    oracle_logits: torch.Tensor | None = None
    min_flip: float = DEFAULT_MIN_FLIP
    tokenizer: object = None

    @classmethod
    def of(cls, a: AlignedCase, stale: torch.Tensor, oracle: torch.Tensor, min_flip: float = DEFAULT_MIN_FLIP,
           tokenizer=None, full_vocab: bool = True) -> Reference:
        """The reference of ``a`` from its stale and oracle decision logits (V,); ``full_vocab``
        False: the logits hold the options' columns only (no cosine or KL against them)."""
        ref = cls(a, "", "", NAN, NAN, oracle if full_vocab else None, min_flip, tokenizer)
        return cls(a, ref.pred(stale), ref.pred(oracle), ref.m(stale), ref.m(oracle), ref.oracle_logits, min_flip,
                   tokenizer)

    @property
    def valid(self) -> bool:
        """The stale read gives the case's expected_old and the oracle read its expected_new."""
        return valid_case(self.a.case, self.pred_stale, self.pred_oracle)

    @property
    def oracle_flip(self) -> float:
        return self.m_oracle - self.m_stale

    def m(self, logits: torch.Tensor) -> float:
        """score(new answer) - score(old answer) of (V,) logits; NaN without expected answers."""
        case = self.a.case
        if case.expected_old is None or case.expected_new is None:
            return NAN
        return float(logit_diff(logits, self.a.option_ids, *answer_targets(case)))

    def recovery(self, m: float) -> float:
        return recovery(m, self.m_stale, self.m_oracle, self.min_flip)

    def pred(self, logits: torch.Tensor) -> str:
        """The decision (V,) logits read: the arg-max option, or the top token without options."""
        if self.a.case.options:
            return predicted(logits, self.a.option_ids, self.a.case.options)[0]
        return self.tokenizer.decode([int(logits.argmax())])

    def margin(self, logits: torch.Tensor) -> float:
        """How far the decision leads: the best option's score minus the other's (without options,
        the top token's logit minus the runner-up's)."""
        scores = option_scores(logits, self.a.option_ids, self.a.case.options) if self.a.case.options else logits
        top = scores.topk(2).values
        return float(top[0] - top[1])


def score_row(ref: Reference, s: Strategy, edited: Edited, logits: torch.Tensor, decide_s: float = NAN,
              generated: str = "") -> dict:
    """One row (:data:`ROW_COLUMNS`) for strategy ``s``, whose repaired state ``edited`` read the
    decision logits (V,) ``logits`` in ``decide_s`` seconds (``generated``: its reasoning text)."""
    m, pred = ref.m(logits), ref.pred(logits)
    distribution = (compare(logits, ref.oracle_logits) if ref.oracle_logits is not None
                    else {"cosine": NAN, "kl": NAN})
    return {
        "strategy": s.label, "k": s.k, "ranking": s.ranking, "m": m, "m_stale": ref.m_stale,
        "m_oracle": ref.m_oracle, "oracle_flip": ref.oracle_flip, "recovery": ref.recovery(m), "pred": pred,
        "reference": ref.pred_oracle, "agree": pred == ref.pred_oracle, "correct": pred == ref.a.case.expected_new,
        **distribution, "tokens_recomputed": float(edited.recomputed), "tokens_total": edited.total,
        "frac_recomputed": float(edited.recomputed) / edited.total, "wall_s": edited.wall_s, "decide_s": decide_s,
        "rewritten_prompt": edited.rewritten_prompt, "generated": generated, "error": None, "note": edited.note,
        "chose": edited.chose,
    }


def error_row(s: Strategy, error: Exception | str) -> dict:
    """The row of a strategy that could not repair the case: its label and the one-line error."""
    return {"strategy": s.label, "error": str(error)}


def timed_read(lm, edited: Edited) -> tuple[torch.Tensor, float]:
    """The decision logits (V,) of a repaired state (no chain-of-thought) and the seconds the read took."""
    start = time.perf_counter()
    logits, _ = decide(lm, edited, 0)
    return logits, time.perf_counter() - start


# Whether reading several states of one shape as one batch costs less than reading them one by one, per
# model in this process and number of rows: measured once (:func:`batch_pays`), since it depends on the CPU,
# the dtype and the matmul kernels (float32 on a Zen 4: a batch of 2 or 3 one-token reads of the 1.5B costs
# more than as many single reads; bfloat16: a third of them; docs/perf.md).
_PAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # lm.model -> {rows: measurement}


def batch_pays(lm, states: Sequence[Edited]) -> dict:
    """Time one read of ``states[0]`` alone and one batched read of all ``states`` (of one shape), the better
    of two tries each, once per model in this process and number of rows; ``{"rows", "single_s", "batch_s",
    "batched"}``, ``batched`` when the batch costs less than 0.9 of as many single reads."""
    known = _PAYS.setdefault(lm.model, {})
    if len(states) not in known:
        single = min(timed_read(lm, states[0])[1] for _ in range(2))
        batch = []
        for _ in range(2):
            start = time.perf_counter()
            decide_batch(lm, states)
            batch.append(time.perf_counter() - start)
        known[len(states)] = {"rows": len(states), "single_s": single, "batch_s": min(batch),
                              "batched": min(batch) < 0.9 * len(states) * single}
    return known[len(states)]


def batch_measured(lm) -> list[dict]:
    """What :func:`batch_pays` measured for ``lm`` in this process (empty where nothing was batched)."""
    return [v for _, v in sorted(_PAYS.get(lm.model, {}).items())]


def read_states(lm, states: dict[str, Edited], batch: bool | None = False
                ) -> dict[str, tuple[torch.Tensor, float, int]]:
    """Each state's decision logits (V,), its read's seconds and how many reads shared it. With ``batch``, the
    states of one shape (cache length and tail) are read as one batch, and each of them gets the batch's
    seconds (an upper bound of its own read: on a CPU a read's cost is mostly the pass over the weights);
    ``batch=None`` batches where :func:`batch_pays` measured that it costs less. Alone, each is timed alone."""
    groups: dict[tuple, list[str]] = {}
    for label, e in states.items():
        groups.setdefault(shape_of(e), []).append(label)
    out = {}
    for labels in groups.values():
        together = len(labels) > 1 and (batch if batch is not None
                                        else batch_pays(lm, [states[x] for x in labels])["batched"])
        if together:
            start = time.perf_counter()
            logits = decide_batch(lm, [states[x] for x in labels])
            elapsed = time.perf_counter() - start
            out |= {x: (g, elapsed, len(labels)) for x, g in zip(labels, logits)}
        else:
            out |= {x: (*timed_read(lm, states[x]), 1) for x in labels}
    return out


def measure_strategies(lm, a: AlignedCase, strategies: Sequence[Strategy], *, ctx: EditContext | None = None,
                       old_cache=None, min_flip: float = DEFAULT_MIN_FLIP,
                       on_row: Callable[[], None] = lambda: None, oracle: Strategy | None = None,
                       batch_reads: bool | None = False, given: dict | None = None) -> pd.DataFrame:
    """Stale, the oracle, then each of ``strategies`` (typed; one row per label) on one aligned case,
    each repaired from the old cache, read at the decision token (no chain-of-thought) and scored
    against the stale and oracle reads: a frame of :data:`ROW_COLUMNS` plus ``margin``
    (:meth:`Reference.margin`) and ``read_batch`` (how many reads shared this one's batch), the stale row
    first, then the oracle's.

    ``ctx`` is the case's :class:`EditContext` (it carries a policy or a ranking), else one is built
    from ``old_cache`` (the old prompt's cache of [0, D), never changed) or a prefill. A strategy
    that refuses the case or fails with a :class:`KvprobeError` is an :func:`error_row` (with
    ``reference``, so it can be counted against the oracle's decision). The caller
    holds ``lm.lock`` where threads share the model. ``on_row`` is called after each strategy's row.
    ``oracle`` computes the oracle's state (a full prefill, :class:`Oracle`, unless given: calibrate's
    :class:`~kvprobe.editor.strategies.PrefixOracle`). ``batch_reads`` reads the states of one shape as
    one batch (:func:`read_states`; None: where it was measured to pay); each is read alone by default.
    ``given`` maps a label (stale, oracle, a strategy's) to its state and read, computed beforehand with other
    cases' (``(Edited, (logits, seconds, reads in its batch))``: :class:`kvprobe.calibrate.batch.PairStates`).
    """
    ctx = ctx if ctx is not None else make_context(lm, a, old_cache=old_cache)
    oracle = oracle or Oracle()
    given = given or {}
    alone = batch_reads is False  # each read as soon as its state is built, timed alone
    references = {"stale": Stale(), "oracle": oracle}
    wanted = references | {s.label: s for s in strategies if s.label not in references}
    states = {label: given[label][0] for label in wanted if label in given}
    reads = {label: given[label][1] for label in states}
    for label, s in references.items():  # their failures are the case's, not a row's
        if label not in states:
            states[label] = apply(ctx, s)
            if alone:
                reads[label] = (*timed_read(lm, states[label]), 1)
    errors = {}
    for label, s in wanted.items():
        if label in states:
            continue
        try:
            s.check(lm, a)
            states[label] = apply(ctx, s)
            if alone:
                reads[label] = (*timed_read(lm, states[label]), 1)
        except KvprobeError as exc:
            errors[label] = exc
    if not alone:
        reads |= read_states(lm, {k: e for k, e in states.items() if k not in reads}, batch_reads)
    ref = Reference.of(a, reads["stale"][0], reads["oracle"][0], min_flip, lm.tokenizer)
    rows = []
    for label, s in wanted.items():
        if label in errors:
            rows.append(error_row(s, errors[label]) | {"reference": ref.pred_oracle})
        else:
            logits, decide_s, shared = reads[label]
            rows.append(score_row(ref, s, states[label], logits, decide_s) | {"margin": ref.margin(logits),
                                                                             "read_batch": shared})
        if label in {s.label for s in strategies}:
            on_row()
    return pd.DataFrame(rows).reindex(columns=[*ROW_COLUMNS, "margin", "read_batch"])
