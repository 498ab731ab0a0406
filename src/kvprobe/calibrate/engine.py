"""``kvprobe calibrate``: a per-field repair policy for one template, from as few oracle-checked
pairs as the statistics allow.

For each field of the template, pairs are drawn (every field at a value from its set, then this
field moved to another value), and each pair is run three ways: the stale cache's decision, the
oracle's (the new prompt prefilled from the prefix it shares with the old one: the cache up to the
field's first token is reused, as a serving engine's prefix cache does; ``oracle="full"`` prefills
it whole) and the candidate repair in play. A candidate's stream is "its decision equals the
oracle's": on a pair where the oracle's decision changed, that is agreement; where it did not, it
is the absence of a spurious flip. The candidates (given cheapest first) form a chain
(:mod:`kvprobe.stopping.sequence`): the first is measured until the confidence sequence allows it
a verdict; once it is ruled out the next is measured back over the pairs so far, and goes on from
there. The field stops when the candidate in play is established, when every candidate is ruled out
(then the oracle), or at ``max_pairs``. Pairs whose old and new value have the same token ids change
nothing the model can see, and pairs whose values tokenise to different lengths cannot be edited in
place: both are counted, not measured. A field made mostly of them gets no repair verdict: it is
``degenerate`` (repair ``none``) where most had the same token ids, else ``unmeasurable`` (the
oracle) (:func:`kvprobe.stopping.rule.unmeasured`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
import yaml

from kvprobe.calibrate.batch import DEFAULT_PAIR_BATCH, PairStates
from kvprobe.calibrate.spec import CalibrationSpec, context_for, load_spec  # noqa: F401  (imported from here too)
from kvprobe.calibrate.summary import policy_of, summarize
from kvprobe.defaults import DEFAULT_THRESHOLD
from kvprobe.errors import KvprobeError, UsageError
from kvprobe.executor import Context, Serial
from kvprobe.stopping.rule import (DEGENERATE_SHARE, MIN_DRAWN, NOT_CANDIDATES, PROCEDURES, SAME_IDS,  # noqa: F401
                                   FieldResult,
                                   check_threshold, decide, is_candidate, unmeasured)
from kvprobe.stopping.sequence import Sequence
from kvprobe.tables import CALIBRATION, CALIBRATION_SUMMARY  # noqa: F401  (the CLI imports both from here)

DEFAULT_CANDIDATES = ("field_only", "erratum_turn:neutral", "erratum_turn")
SUMMARY = CALIBRATION_SUMMARY  # the two tables' names are kvprobe.tables'
POLICY_FILE = "field_policy.yaml"
CALIBRATE_MANIFEST = "calibrate_manifest.json"
UNKNOWN_SHARE = 0.2  # a prompt with more [UNK] tokens than this is refused


def _pairs(spec: CalibrationSpec, name: str, seed: int, n: int):
    """The field's first ``n`` drawn pairs, keyed by their index, in drawing order (a resume, and a
    rerun with a larger budget, draw the same ones)."""
    rng = random.Random(f"{seed}:{name}")
    for i in range(n):
        base = {f: vs.sample(rng) for f, vs in spec.fields.items()}
        yield pair_key(i), (base, spec.fields[name].other(base[name], rng))


def pair_key(i: int) -> str:
    """The key of a field's ``i``-th drawn pair (its part's name in the results folder)."""
    return f"{i:05d}"


_PREFIX = "calibrate.prefix"  # the SharedPrefix of the process measuring pairs (Context.keep)


class SharedPrefix:
    """The old prompts' common beginning, prefilled once per calibration (a one-entry prefix cache,
    as a serving engine's): every pair's old prompt starts with the template's text before its
    first field, so the cache there is computed once and each pair's old cache continues it. The
    prefix is the longest common beginning of the prompts seen so far: set by the second prompt (or by
    a first batch of prompts, :meth:`seed`) and cropped (never recomputed) when a later one shares
    fewer tokens. ``tokens_saved`` counts the prompt tokens not prefilled again."""

    def __init__(self, lm):
        self.lm, self.ids, self.cache, self.tokens_saved = lm, None, None, 0

    def shared(self, ids: list[int]) -> int:
        """How many of the first tokens of ``ids`` the prefix holds (at least one token of ``ids`` is left to
        run on top of it); 0 before the first prompt."""
        if self.ids is None:
            return 0
        n, limit = 0, min(len(self.ids), len(ids) - 1)
        while n < limit and self.ids[n] == ids[n]:
            n += 1
        return n

    def seed(self, prompts: list[list[int]]) -> None:
        """The prefix before any prompt was seen: the longest common beginning of ``prompts`` (a batch's old
        prompts; at least one token of each left to run on top of it), prefilled once."""
        from kvprobe.kv import cache as kvcache

        self.ids = list(prompts[0])  # what shared() measures the others against
        self.ids = self.ids[: min(map(self.shared, prompts))] or None
        if self.ids:
            self.cache = kvcache.prefill(self.lm.model, torch.tensor(self.ids), logits_to_keep=1)[1]

    def crop_to(self, n: int):
        """The prefix's cache, first cut to ``n`` tokens where it holds more (and kept so)."""
        from kvprobe.kv import cache as kvcache

        if n < len(self.ids):
            self.ids, self.cache = self.ids[:n], kvcache.copy(kvcache.crop(self.cache, n))
        return self.cache

    def old_cache(self, ids: list[int]):
        """The cache of ``ids`` (an old prompt up to its decision token), from the shared prefix."""
        from kvprobe.kv import cache as kvcache

        n = self.shared(ids)
        if n == 0:  # the first prompt, or one that shares nothing: prefilled whole, and kept
            _, cache = kvcache.prefill(self.lm.model, torch.tensor(ids), logits_to_keep=1)
            self.ids, self.cache = list(ids), kvcache.copy(cache)
            return cache
        cache = kvcache.copy(self.crop_to(n))
        kvcache.forward(self.lm.model, torch.tensor(ids[n:]), cache, logits_to_keep=1)
        self.tokens_saved += n
        return cache


ORACLES = {"prefix": "the old prompt's cache up to the field, the new prompt prefilled from there",
           "full": "a full prefill of the new prompt"}


def check_choice(name: str, value: str, accepted: dict[str, str], flag: str = "") -> str:
    """``value`` if it is one of ``accepted`` (:data:`ORACLES`, :data:`PROCEDURES`), else a one-line
    UsageError naming each accepted value and what it is (``flag``: ``--`` where the CLI asks)."""
    if value not in accepted:
        raise UsageError(f"{flag}{name} must be one of {', '.join(accepted)} ("
                         + "; ".join(f"{k}: {v}" for k, v in accepted.items()) + f"), got {value!r}")
    return value


def measure_pair(lm, spec: CalibrationSpec, name: str, base: dict[str, str], new: str, candidates: list,
                 form: str = "auto", prefix: SharedPrefix | None = None, oracle: str = "prefix",
                 batch_reads: bool | None = None, states: tuple | None = None) -> pd.DataFrame:
    """One pair: a row per strategy (stale, oracle, each candidate) from the one measurement core
    (:func:`kvprobe.editor.score.measure_strategies`, edits.parquet's columns, plus the pair's
    values, ``to_decision_s`` and ``changed``), or one skipped row. The old prompt's cache
    continues ``prefix`` where one is given; the oracle is computed as :data:`ORACLES` says (the
    same decision up to float rounding: tests/calibrate compares the two). The decisions of stale, the
    oracle and a candidate whose state has their shape are read as one batch where that was measured to
    cost less on this machine (``batch_reads`` None; True or False force it: the same decisions up to float
    rounding, :func:`kvprobe.editor.score.read_states`). ``states`` = (aligned case, old cache, prefix oracle, reads)
    are the pair's, computed beforehand with other pairs' (:class:`kvprobe.calibrate.batch.PairStates`; ``reads``:
    measure_strategies' ``given``); the oracle's row then counts its cost as :class:`PairStates` estimated it."""
    from kvprobe.calibrate.batch import given
    from kvprobe.editor.context import EditContext, make_context
    from kvprobe.editor.score import measure_strategies
    from kvprobe.editor.strategies import Oracle, PrefixOracle, parse_strategy

    check_choice("oracle", oracle, ORACLES)
    head = {"field": name, "old_value": base[name], "new_value": new,
            "others": yaml.safe_dump({k: v for k, v in base.items() if k != name}, default_flow_style=True).strip()}
    try:
        a = states[0] if states is not None else aligned_pair(lm, spec, name, base, new, form)
    except KvprobeError as exc:  # e.g. the two values tokenise to different lengths: no in-place edit
        return pd.DataFrame([{**head, "strategy": "", "skip": f"not editable in place ({exc})", "degenerate": False}])
    if a.ids_old == a.ids_new:
        return pd.DataFrame([{**head, "strategy": "", "skip": SAME_IDS, "degenerate": True}])
    unk = getattr(lm.tokenizer, "unk_token_id", None)
    if unk is not None and a.ids_old.count(unk) > UNKNOWN_SHARE * len(a.ids_old):
        raise KvprobeError(f"{a.ids_old.count(unk)} of the {len(a.ids_old)} tokens of the template are unknown to "
                           f"{lm.info.spec}'s tokenizer ([UNK]): its edits change little the model can see; use a "
                           f"model whose tokenizer covers the template's words")
    typed = [parse_strategy(c) if isinstance(c, str) else c for c in candidates]
    with lm.lock:
        D = a.decision_pos
        read = {}
        if states is not None:
            ec, orc, read = EditContext(lm, a, states[1]), given(states[2]), states[3]
        else:
            ec = (EditContext(lm, a, prefix.old_cache(a.ids_old[:D])) if prefix is not None else make_context(lm, a))
            orc = PrefixOracle() if oracle == "prefix" else Oracle()
        df = measure_strategies(lm, a, typed, ctx=ec, oracle=orc, batch_reads=batch_reads, given=read)
    stale = df.loc[df.strategy == "stale", "pred"].iloc[0]
    df.insert(0, "field", name)
    for i, (k, v) in enumerate(head.items()):
        if k != "field":
            df.insert(i, k, v)
    df["to_decision_s"] = df.wall_s + df.decide_s
    df["chose"] = [c if isinstance(c, str) and c else s for c, s in zip(df.chose, df.strategy)]
    df["degenerate"], df["skip"] = False, None
    df["changed"] = df.reference != stale
    df["agree"] = df.agree.astype("boolean").fillna(False).astype(bool)  # a repair that could not run fails
    return df


def aligned_pair(lm, spec: CalibrationSpec, name: str, base: dict[str, str], new: str, form: str = "auto"):
    """The pair's aligned edit (a KvprobeError where the two values cannot be edited in place)."""
    from kvprobe.api import aligned_edit

    ctx = context_for(lm, spec, base, form)
    return aligned_edit(lm, ctx.case(name, new), ctx.form)


def _in_play(res: FieldResult, seq: Sequence, candidates: list[str]) -> str:
    """The candidate the chain measures next: the first not ruled out (the last one if all are: the
    field stops there)."""
    return next((s for s in candidates if seq.verdict(*res.counts[s]) != "ruled out"), candidates[-1])


@dataclass
class Calibration:
    """What :func:`calibrate` measured: the rows, the per-field summary, and the policy."""

    rows: pd.DataFrame
    summary: pd.DataFrame
    policy: dict
    fields: list[FieldResult]
    prefix_tokens_saved: int = 0  # old-prompt tokens not prefilled again (SharedPrefix), this process
    wasted: int = 0  # pairs a parallel executor measured past a field's stopping point: dropped, parts kept
    reads: list = field(default_factory=list)  # whether batched reads paid, as measured here (batch_measured)
    pair_batch: int = 1  # pairs whose old caches and oracles were prefilled as one batch (1: one by one)
    states_unused: int = 0  # pairs whose states a batch computed ahead of a field's verdict (PairStates.unused)
    states_reused: int = 0  # measure-backs of a joining candidate on a pair's kept states (PairStates.reused)
    single_read_s: float | None = None  # a decision read alone, which batched reads' costs start from (PairStates)


def calibrate(lm, spec: CalibrationSpec | Path | str, *, candidates=DEFAULT_CANDIDATES,
              threshold: float = DEFAULT_THRESHOLD,
              max_pairs: int = 200, seed: int = 0, form: str = "auto", parts=None,
              progress: Callable[[str, int, int], None] = lambda field, done, total: None,
              executor=None, oracle: str = "prefix", procedure: str = "chain",
              say: Callable[[str], None] = lambda message: None, batch_reads: bool | None = None,
              pair_batch: int = DEFAULT_PAIR_BATCH) -> Calibration:
    """Calibrate every field of ``spec`` (or the spec file at that path) on the model ``lm`` (a
    loaded model or a spec :func:`kvprobe.load` takes; see the module docstring).
    ``parts(name)`` gives a :class:`kvprobe.results.CaseStore` per field to keep finished pairs.
    ``oracle`` is how each pair's oracle is computed (:data:`ORACLES`; from the shared prefix by
    default). ``procedure`` is how the candidates are tested (:data:`PROCEDURES`): ``chain`` (the
    candidate in play measured; once it is ruled out the next, measured back over the pairs so far)
    or ``shared`` (every candidate on every pair, alpha_lower shared: what kvprobe did before the
    chain). ``say`` gets a line when a chain brings its next candidate in (measuring it back over
    the pairs so far takes a while). ``batch_reads``: :func:`measure_pair`'s (None: batched where measured
    to pay). ``pair_batch``: how many drawn pairs' old caches and prefix oracles are prefilled as one batch
    (:mod:`kvprobe.calibrate.batch`; 1: one by one, and always so on a parallel executor or the full oracle).

    ``executor`` (:mod:`kvprobe.executor`; serial by default) measures the pairs. The sequential
    rule reads them in the order they were drawn, whatever order the workers finish in, so it
    stops at the same pair as a serial run: the pairs used are the serial run's. Pairs a parallel
    executor measured past that point (at most its lookahead per field) are dropped, never counted:
    counting them would let the stopping time depend on which pairs finish first, and the interval
    is valid for the rule applied to the drawn sequence. They are reported (``Calibration.wasted``)
    and their parts kept."""
    from kvprobe.editor.strategies import parse_strategy

    if not isinstance(spec, CalibrationSpec):
        spec = load_spec(spec)
    if isinstance(lm, str):
        from kvprobe.api import load

        lm = load(lm)
    candidates = [parse_strategy(s).spec for s in candidates]
    bad = [s for s in candidates if not is_candidate(s)]
    if bad or not candidates:
        raise UsageError(f"candidates are repairs to measure, cheapest first (not {', '.join(NOT_CANDIDATES)}); got "
                         f"{', '.join(bad) or 'none'}")
    check_threshold(threshold, "threshold")
    check_choice("oracle", oracle, ORACLES)
    check_choice("procedure", procedure, PROCEDURES)
    chain = procedure == "chain"
    typed = {s: parse_strategy(s) for s in candidates}

    def measured(cand: str | None) -> list:
        """The strategies a pair is measured for: the chain's candidate in play, or every candidate (shared)."""
        return [typed[c] for c in ([cand] if cand else candidates)]

    prefix = SharedPrefix(lm)  # the template before its first field: prefilled once, for every field's pairs
    executor = executor or Serial()
    ctx = Context(lm)
    ctx.memo[_PREFIX] = prefix  # a worker process keeps its own
    wasted = executor.wasted
    batcher = (PairStates(lm, prefix, pair_batch, reads=batch_reads is not False)
               if pair_batch > 1 and oracle == "prefix" and isinstance(executor, Serial) else None)
    seq = Sequence(threshold=threshold, m=len(candidates), chain=max_pairs if chain else 0)
    change_seq = Sequence(threshold=threshold)
    frames, results = [], []
    for name in spec.fields:
        res = FieldResult(name, counts={s: [0, 0] for s in candidates})
        store = parts(name) if parts is not None else None
        # skipped draws (no oracle run) are not budget. Each pair is sent with the candidate in play when
        # it is sent; a parallel executor sends pairs ahead, so one that reaches the rule after the next
        # candidate joined is measured for it here
        pair_of, rows_of, counted = {}, {}, {}
        drawn = list(_pairs(spec, name, seed, 2 * max_pairs + 10))
        items = ((key, (key, pair_of.setdefault(key, pair), _in_play(res, seq, candidates) if chain else None))
                 for key, pair in drawn)
        start = time.perf_counter()

        def ahead(key, name=name, drawn=drawn, store=store):
            """The drawn pairs from ``key`` on that no part holds yet, with their aligned edits (None where the
            pair cannot be edited in place or changes no token: measured, and skipped, one by one)."""
            for k, (base, new) in drawn[int(key):]:
                if store is not None and store.holds(k):
                    continue
                try:
                    a = aligned_pair(lm, spec, name, base, new, form)
                except KvprobeError:
                    a = None
                yield k, (a if a is not None and a.ids_old != a.ids_new else None)

        def one(ctx, item, name=name, states=None):  # sent to a parallel executor's workers: refers to no model
            key, (base, new), cand = item
            return measure_pair(ctx.lm, spec, name, base, new, measured(cand), form, ctx.keep(_PREFIX, SharedPrefix),
                                oracle, batch_reads, states)

        def batched(ctx, item, one=one, ahead=ahead, res=res):
            key, _, cand = item
            # the field stops once the first candidate still live is established: no states past the earliest pair
            # at which it could be (they would go unused)
            live = _in_play(res, seq, candidates)
            limit = seq.to_establish(*res.counts[live], max_pairs - res.pairs)
            states = batcher.get(key, ahead(key), measured(cand), limit)
            if chain and live != candidates[-1]:  # a candidate may still join
                batcher.keep(key, states)
            return one(ctx, item, states=states)

        def count(key: str, cand: str, res=res, name=name, store=store) -> None:
            """Count ``cand`` on the pair ``key``, measuring it there first if its part lacks it."""
            df = rows_of[key]
            if not (df.strategy == cand).any():  # measured back: on the pair's kept states where there are some
                got = measure_pair(lm, spec, name, *pair_of[key], [typed[cand]], form, prefix, oracle, batch_reads,
                                   batcher.reuse(key) if batcher is not None else None)
                df = rows_of[key] = pd.concat([df, got[got.strategy == cand]], ignore_index=True)
                if store is not None:
                    store.save(key, df)
            res.counts[cand][0] += bool(df.loc[df.strategy == cand, "agree"].iloc[0])
            res.counts[cand][1] += 1
            counted[key].append(cand)

        def settle(res=res) -> bool:
            """The rule after a pair; a chain whose candidate in play was ruled out brings the next one
            in, measured back over the field's pairs so far (and so on, should it be ruled out there)."""
            while not decide(res, seq, candidates):
                cand = _in_play(res, seq, candidates) if chain else None
                if cand is None or res.counts[cand][1] == res.pairs:
                    return False
                out = candidates[candidates.index(cand) - 1]
                say(f"{res.name}: {out} ruled out ({res.counts[out][0]} of {res.counts[out][1]} pairs agree); {cand} "
                    f"joins, measured back over the {res.pairs} pairs so far")
                back = [key for key in counted if cand not in counted[key]]
                if batcher is not None:  # read it on the kept pairs and those computed ahead, a batch at a time
                    batcher.read_back(back, typed[cand])
                for key in back:
                    count(key, cand)
                if batcher is not None and cand == candidates[-1]:
                    batcher.release()  # the last candidate: none will be measured back
            return True

        loop = executor.each(store, items, batched if batcher is not None else one, ctx)
        for key, df, _ in loop:
            rows_of[key] = df
            if isinstance(df.skip.iloc[0], str):
                res.degenerate += bool(df.degenerate.iloc[0])
                res.skipped += 1
                drawn = res.skipped + res.pairs
                if drawn >= MIN_DRAWN and res.skipped > DEGENERATE_SHARE * drawn:
                    unmeasured(res, name, drawn, [d.skip.iloc[0] for d in rows_of.values()
                                                  if isinstance(d.skip.iloc[0], str)])
                    break
                continue
            res.pairs += 1
            res.changed += int(df.changed.iloc[0])
            counted[key] = []
            for c in ([_in_play(res, seq, candidates)] if chain else candidates):
                count(key, c)
            progress(name, res.pairs, max_pairs)
            if settle():
                break
            if res.pairs >= max_pairs:
                decide(res, seq, candidates, final=True)
                break
        else:
            decide(res, seq, candidates, final=True)
        loop.close()  # pairs measured ahead of the stopping point are counted now
        if batcher is not None:
            batcher.forget()  # states computed ahead of the verdict: unused
        res.seconds = time.perf_counter() - start
        # a pair's rows: stale, the oracle and the candidates counted on it (a part may hold more: a
        # candidate measured ahead, or counted in an earlier run that stopped elsewhere)
        frames += [df if key not in counted else
                   df[df.strategy.isin(["stale", "oracle", *counted[key]])].reset_index(drop=True)
                   for key, df in rows_of.items()]
        results.append(res)
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    summary = summarize(rows, results, seq, change_seq, candidates)
    policy = policy_of(lm, spec, results, summary, seq, change_seq, candidates, max_pairs)
    from kvprobe.editor.score import batch_measured

    return Calibration(rows, summary, policy, results, prefix.tokens_saved, executor.wasted - wasted,
                       batch_measured(lm), batcher.size if batcher is not None else 1,
                       batcher.unused if batcher is not None else 0, batcher.reused if batcher is not None else 0,
                       batcher.single_s if batcher is not None else None)
