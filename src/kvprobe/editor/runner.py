"""Run edit strategies over a dataset and tabulate them against the oracle (one tidy row per
case x strategy x CoT setting, built by :mod:`kvprobe.editor.score`). Validity comes for free:
the stale and oracle reads are the model's decisions under the old and the new value.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import pandas as pd

from kvprobe.datasets import AlignedCase, EditCase, Skip, align, require_answers
from kvprobe.errors import KvprobeError
from kvprobe.executor import Context, Serial
from kvprobe.editor.context import EditContext, make_context
from kvprobe.editor.score import Reference, error_row, score_row
from kvprobe.editor.rankings import rank_downstream
from kvprobe.editor.strategies import Selective, Strategy, apply, parse_strategy
from kvprobe.kv.decode import Edited, decide, decide_batch, decide_many, shape_of
from kvprobe.kv.recompute import recompute_many
from kvprobe.metrics import DEFAULT_MIN_FLIP


def edit_case(lm, a: AlignedCase, strategies: Sequence[Strategy], cot_tokens: int = 0,
              min_flip: float = DEFAULT_MIN_FLIP, ranking=None, seed: int = 0, model_name: str = "",
              old_cache=None, sweep: Sequence[Selective] = ()) -> pd.DataFrame:
    """Every strategy on one aligned case, against that case's stale and oracle reads; ``old_cache``
    is the old prompt's cache of [0, D) when the caller holds it (never changed), else prefilled.

    ``sweep`` (a K sweep's ``selective`` strategies) adds rows after the strategies' rows; they are
    recomputed one batch per K, and their ``wall_s`` is their batch's time shared by its rows.
    Each row's ``kind`` says which it is: ``k_sweep`` (a sweep's row, on a decision or a control
    case), ``control`` (a strategy on a negative control) or ``decision``, so that a groupby on
    ``strategy`` within one kind never mixes them.
    Without CoT, the decisions of states of one shape (cache length and tail) are read as one
    batch; their ``decide_s`` is one read of that shape, timed on its own.
    """
    case = a.case
    swept = {s.label for s in sweep} - {s.label for s in strategies}  # the rows of kind k_sweep
    if cot_tokens:  # with CoT every strategy reasons, each on its own
        strategies, sweep = [*strategies, *sweep], ()
    strategies = list({s.label: s for s in strategies}.values())  # one row per strategy, even if listed twice
    sweep = [s for s in {s.label: s for s in sweep}.values() if s.label not in {t.label for t in strategies}]
    ctx = make_context(lm, a, ranking=ranking, seed=seed, old_cache=old_cache)

    wanted = {"stale": parse_strategy("stale"), "oracle": parse_strategy("oracle")}
    for s in strategies:
        wanted.setdefault(s.label, s)
    applied: dict[str, Edited | KvprobeError] = {}
    for label, s in wanted.items():
        try:
            applied[label] = apply(ctx, s)
        except KvprobeError as exc:
            if s.name != "hoist":  # a user error (bad K, too long): stop, do not tabulate
                raise
            applied[label] = exc  # hoist cannot rewrite every prompt: tabulated as an error row
    ok = [label for label, e in applied.items() if not isinstance(e, KvprobeError)]
    if cot_tokens:  # reasoning runs batched over the strategies
        reads = dict(zip(ok, decide_many(lm, [applied[label] for label in ok], cot_tokens)))
        decide_s: dict[str, float] = {}
    else:
        reads, decide_s = _read_by_shape(lm, {label: applied[label] for label in ok})
        for label in ok:  # let the caches go
            applied[label] = dataclasses.replace(applied[label], cache=None)
        by_k: dict[int, list[Selective]] = {}
        for s in sweep:
            by_k.setdefault(s.k, []).append(s)
        for group in by_k.values():  # one K at a time: a sweep holds dozens of caches
            states = dict(zip((s.label for s in group), apply_selective_many(ctx, group)))
            got, times = _read_by_shape(lm, states)
            reads |= got
            decide_s |= times
            applied |= {label: dataclasses.replace(e, cache=None) for label, e in states.items()}
        strategies += sweep
    ref = Reference.of(a, reads["stale"][0], reads["oracle"][0], min_flip, lm.tokenizer)
    rows = []
    for s in strategies:
        edited = applied[s.label]
        if isinstance(edited, KvprobeError):
            rows.append(error_row(s, edited))
            continue
        logits, text = reads[s.label]
        rows.append(score_row(ref, s, edited, logits, decide_s.get(s.label, float("nan")), text))
    df = pd.DataFrame(rows)
    df.insert(0, "model", model_name)
    df.insert(1, "case_id", case.case_id)
    for col, value in (("domain", case.domain), ("field", case.field), ("control", case.control),
                       ("template_id", case.template_id), ("cot", cot_tokens), ("valid", ref.valid),
                       ("n_tokens", len(a.ids_old))):
        df[col] = value
    df["kind"] = ["k_sweep" if s.label in swept else "control" if case.control else "decision" for s in strategies]
    return df


def _read_by_shape(lm, states: dict[str, Edited]) -> tuple[dict[str, tuple], dict[str, float]]:
    """Each state's (decision logits, "") and ``decide_s``: states of one cache length and tail are
    read as one batch, and one of them alone (timed: the cost of one read of that shape)."""
    groups: dict[tuple, list[str]] = {}
    for label, e in states.items():
        groups.setdefault(shape_of(e), []).append(label)
    reads, times = {}, {}
    for labels in groups.values():
        start = time.perf_counter()
        reads[labels[0]] = decide(lm, states[labels[0]], 0)
        elapsed = time.perf_counter() - start
        rest = decide_batch(lm, [states[label] for label in labels[1:]])
        reads |= {label: (logits, "") for label, logits in zip(labels[1:], rest)}
        times |= {label: elapsed for label in labels}
    return reads, times


def align_all(lm, cases: Sequence[EditCase], form: str = "auto", cot: bool = False
              ) -> tuple[list[AlignedCase], list[Skip]]:
    """Align every case (with the chain-of-thought cue when ``cot``), splitting off the skips."""
    aligned, skipped = [], []
    for case in cases:
        a = align(case.model_copy(update={"cot": cot}) if cot != case.cot else case, lm.tokenizer, form)
        (skipped if isinstance(a, Skip) else aligned).append(a)
    return aligned, skipped


def run_edits(lm, cases: Sequence[EditCase], strategies: Sequence[Strategy | str], cot: Sequence[int] = (0,),
              form: str = "auto", min_flip: float = DEFAULT_MIN_FLIP, ranking=None, seed: int = 0,
              model_name: str = "", store=None, on_case: Callable[[], None] = lambda: None, executor=None
              ) -> tuple[pd.DataFrame, list[Skip]]:
    """All strategies x CoT settings over the cases; finished cases are kept in ``store`` (resume).
    ``strategies`` are typed (taken as they are; ``RunConfig.edit_strategies()``) or spec strings
    (parsed here). Every case needs its expected answers (the rows say whether it is valid).
    ``executor`` (:mod:`kvprobe.executor`; serial by default) computes the cases."""
    executor, ctx = executor or Serial(), Context(lm)
    require_answers(cases, "run_edits")
    parsed = [s if isinstance(s, Strategy) else parse_strategy(s) for s in strategies]
    frames, skipped = [], []
    for cot_tokens in cot:
        aligned, skips = align_all(lm, cases, form, cot=cot_tokens > 0)
        skipped += skips
        items = [(f"{a.case.case_id}.cot{cot_tokens}", a) for a in aligned]

        def one(ctx, a, cot_tokens=cot_tokens):
            return edit_case(ctx.lm, a, parsed, cot_tokens, min_flip, ranking, seed, model_name)

        done = executor.map(store, items, one, ctx, on_case)  # store: a kvprobe.results.CaseStore (resume), or None
        frames += [done] if len(done) else []
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), skipped


def apply_selective_many(ctx: EditContext, strategies: list[Selective]) -> list[Edited]:
    """Several ``selective`` strategies of one K on one case (a K sweep's rankings), the same
    caches as applying each, recomputed as one batched forward. Each row's ``wall_s`` is the
    batch's time shared equally by its rows."""
    assert len({s.k for s in strategies}) == 1, "apply_selective_many takes strategies of one K"
    for s in strategies:
        s.check(ctx.lm, ctx.a)
    f0, f1 = ctx.a.field
    start = time.perf_counter()
    sets = [list(range(f0, f1)) + rank_downstream(ctx, s.ranking)[: s.k] for s in strategies]
    caches = recompute_many(ctx.lm, ctx.old_cache, ctx.a.ids_new, sets)
    share = (time.perf_counter() - start) / len(strategies)
    return [Edited(cache, [ctx.a.ids_new[ctx.D]], len(positions), ctx.D + 1, wall_s=share,
                   ids=ctx.a.ids_new[: ctx.D + 1])
            for cache, positions in zip(caches, sets)]
