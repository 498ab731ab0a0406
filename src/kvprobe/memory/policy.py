"""The per-field policy arm of ``kvprobe memory``: which repair to deploy when a given profile fact
changes, calibrated on users apart from the evaluation's with ``kvprobe calibrate``'s confidence
sequence and stopping rule (:mod:`kvprobe.stopping.sequence`, :func:`kvprobe.stopping.rule.decide`).

The calibration split (:func:`kvprobe.datasets.memory.calibration_memory`) edits every fact of each
calibration user's profile in turn; one *element* is one such edit, read on four questions (the
edited fact's old and new value, another fact, a negative). Per element and candidate (``field_only``
then ``erratum``, cheapest first), the stream's outcome is "its decision equals the oracle's on every
one of the element's questions"; elements of one fact come from different users, so a fact's stream
is independent draws. Per fact the calibration stops as soon as the sequence allows a verdict for the
cheapest candidate still in play, when every candidate is ruled out (then the oracle), or when the
calibration users run out (``budget``: the oracle, until more are measured). Elements of a fact that
has stopped are not computed.

The reference here is the edited late context computed from the late cache's prefix (preamble and
trajectory, which an edit of the profile leaves as they are: a causal model's K/V there is the same)
and a prefill of the edited profile on it (:func:`oracle_from_prefix`): the oracle's decision at a
fraction of its cost, equal to a full prefill to float rounding (tests/memory/test_policy.py). The
evaluation's ``oracle`` arm stays a full prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch

from kvprobe.composer.gate import option_token_ids
from kvprobe.datasets.memory import MemorySet, calibration_memory
from kvprobe.datasets.memory_tokens import MemorySegments, segments
from kvprobe.defaults import DEFAULT_THRESHOLD
from kvprobe.executor import Context, Serial
from kvprobe.kv import cache as kvcache
from kvprobe.memory.runner import State, erratum_state, field_only_state, prefill_state, read_question
from kvprobe.stopping.rule import FieldResult, decide
from kvprobe.stopping.sequence import ALPHA_LOWER, ALPHA_UPPER, Sequence

CANDIDATES = ("field_only", "erratum")  # cheapest first: the value's tokens, then the correction line's
STRATEGIES = ("stale", "oracle", *CANDIDATES)
COLUMNS = ("element", "user_id", "fact", "question_id", "kind", "strategy", "answer", "option_diff", "reference",
           "agree",
           "changed", "tokens_recomputed", "wall_s", "decide_s")


@torch.no_grad()
def oracle_from_prefix(lm, late: State, start: int, profile_new: list[int]) -> State:
    """The edited late context's cache: the late cache's first ``start`` positions (everything before
    the profile) and the edited profile prefilled on them (``recomputed`` counts those tokens)."""
    t0 = time.perf_counter()
    cache = kvcache.copy(kvcache.crop(late.cache, start))
    kvcache.forward(lm.model, torch.tensor([profile_new], device=lm.device), cache, logits_to_keep=1)
    return State(cache, start + len(profile_new), len(profile_new), time.perf_counter() - t0)


def element_rows(lm, data: MemorySet, segs: MemorySegments, element: str, late: State,
                 options: dict[str, list[int]]) -> pd.DataFrame:
    """One row per (question, strategy) of one calibration element, on its base user's ``late`` state."""
    user, u = data.users[element], segs.users[element]
    late_ids, (p0, _) = segs.context(element, "late")
    new_ids, _ = segs.context(element, "late", edited=True)
    s0, s1 = u.profile_new.spans[user.edit_key]
    states = {"stale": State(late.cache, late.context_tokens, 0, 0.0),
              "oracle": oracle_from_prefix(lm, late, p0, u.profile_new.ids),
              "field_only": field_only_state(lm, late, new_ids, (p0 + s0, p0 + s1), late_ids),
              "erratum": erratum_state(lm, late, u.erratum)}
    rows = []
    for q in (q for q in data.questions if q.user_id == element):
        tail = segs.questions[q.question_id]
        got = {}
        for name in STRATEGIES:
            st = states[name]
            if st.cache is None:  # field-only where the values differ in token length: it fails the element
                got[name] = ("", float("nan"), float("nan"), float("nan"))
                continue
            answer, diff, decide_s = read_question(lm, st, tail, options)
            got[name] = (answer, diff, st.recomputed + len(tail), decide_s)
        ref, stale = got["oracle"][0], got["stale"][0]
        for name, (answer, diff, tokens, decide_s) in got.items():
            rows.append({"element": element, "user_id": element.split(":")[0], "fact": user.edit_key,
                         "question_id": q.question_id, "kind": q.kind, "strategy": name, "answer": answer,
                         "option_diff": diff, "reference": ref, "agree": bool(answer) and answer == ref,
                         "changed": ref != stale, "tokens_recomputed": tokens, "wall_s": states[name].wall_s,
                         "decide_s": decide_s})
    return pd.DataFrame(rows, columns=list(COLUMNS))


@dataclass
class MemoryPolicy:
    """What the calibration chose per fact (``repair``: a candidate or ``oracle``), with its evidence."""

    repairs: dict[str, str]
    fields: list[FieldResult]
    rows: pd.DataFrame
    seq: Sequence
    users: int

    @property
    def threshold(self) -> float:
        return self.seq.threshold

    def describe(self) -> dict:
        """The policy as the manifest keeps it: per fact the repair, verdict, reason and each
        candidate's agreement with its confidence-sequence interval (n = elements)."""
        seq = self.seq
        return {"threshold": self.threshold, "alpha_lower": ALPHA_LOWER, "alpha_upper": ALPHA_UPPER,
                "candidates": list(CANDIDATES), "calibration_users": self.users, "default": "oracle",
                "fields": {r.name: {"repair": r.chosen, "verdict": r.verdict, "reason": r.reason, "elements": r.pairs,
                                    "changed": r.changed,
                                    "strategies": {c: {"value": round(k / n, 4) if n else None, "k": k, "n": n,
                                                       "lo": round(seq.lower(k, n), 4), "hi": round(seq.upper(k, n), 4)}
                                                   for c, (k, n) in r.counts.items()}}
                           for r in self.fields}}


def calibrate_policy(lm, users: int, seed: int = 0, form: str = "auto", sessions: int = 3,
                     session_tokens: tuple[int, int] = (120, 200), threshold: float = DEFAULT_THRESHOLD,
                     store=None, on_element: Callable[[str, int | None], None] = lambda fact, done: None,
                     data: MemorySet | None = None) -> MemoryPolicy:
    """Calibrate a repair per profile fact on ``users`` calibration users (see the module docstring);
    finished elements are kept in ``store`` (a :class:`~kvprobe.results.CaseStore`) for resume. The
    elements are read in drawing order and a fact's elements stop at its verdict, so a resumed or
    rerun calibration uses the same elements and reaches the same policy. ``on_element(fact, done)``
    follows each edit (``done``: the fact's edits measured so far; None for an edit skipped because
    its fact has stopped)."""
    data = data or calibration_memory(users, seed, lm.tokenizer, sessions, session_tokens)
    segs = segments(data, lm.tokenizer, form)
    options = {o: option_token_ids(lm.tokenizer, o) for o in data.options}
    seq = Sequence(threshold=threshold, m=len(CANDIDATES))
    facts = list(dict.fromkeys(u.edit_key for u in data.users.values()))
    results = {f: FieldResult(f, counts={c: [0, 0] for c in CANDIDATES}) for f in facts}
    stopped: set[str] = set()

    def items():  # lazy: a fact that has stopped is not measured further
        for element, user in data.users.items():
            if user.edit_key not in stopped:
                yield element, element
            else:
                on_element(user.edit_key, None)  # skipped: progress counts it

    def one(ctx, element):
        base = element.split(":")[0]
        held = ctx.memo.get("memory.calibration")
        if held is None or held[0] != base:  # one base user's late cache at a time, shared by its elements
            ctx.memo.pop("memory.calibration", None)
            ctx.memo["memory.calibration"] = (base, prefill_state(ctx.lm, segs.context(element, "late")[0]))
        return element_rows(ctx.lm, data, segs, element, ctx.memo["memory.calibration"][1], options)

    frames = []
    for element, df, _ in Serial().each(store, items(), one, Context(lm)):
        frames.append(df)
        res = results[data.users[element].edit_key]
        res.pairs += 1
        res.changed += bool(df["changed"].any())
        for c in CANDIDATES:
            res.counts[c][0] += bool(df.loc[df["strategy"] == c, "agree"].all())
            res.counts[c][1] += 1
        on_element(res.name, res.pairs)
        if decide(res, seq, list(CANDIDATES), unit="edits"):
            stopped.add(res.name)
    for res in results.values():
        if res.name not in stopped:
            decide(res, seq, list(CANDIDATES), final=True, unit="edits")
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(COLUMNS))
    return MemoryPolicy({f: r.chosen for f, r in results.items()}, list(results.values()), rows, seq, users)
