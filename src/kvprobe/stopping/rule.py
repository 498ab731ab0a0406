"""The calibration's rule, from counts alone: when a field may stop and which repair it gets
(:func:`decide`), what a field whose edits were mostly not measured gets (:func:`unmeasured`), how
it bears on the decision (:func:`relevance`), and what a candidate and a threshold may be.
:func:`kvprobe.calibrate.engine.calibrate` applies it pair by pair; :func:`kvprobe.field_policy.verify`
applies it again to a policy file's recorded counts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvprobe.defaults import THRESHOLD_RANGE, is_threshold
from kvprobe.errors import UsageError
from kvprobe.stopping.sequence import Sequence
from kvprobe.repair_rule import NOT_REPAIRS, is_repair

SAME_IDS = "old and new value have the same token ids"
DEGENERATE_SHARE = 0.5  # a field whose drawn pairs are mostly not measurable gets no repair verdict
MIN_DRAWN = 10  # ... once at least this many pairs were drawn
NOT_MEASURED = "not measured"  # the verdict of a candidate with no pair of its own (verdict_of)
PROCEDURES = {"chain": "the candidate in play on each pair; once it is ruled out, the next measured back over the "
                       "pairs so far",
              "shared": "every candidate on every pair, alpha_lower shared"}  # how a field's candidates are tested
NOT_CANDIDATES = NOT_REPAIRS  # the two ends (stale, oracle), a rewritten prompt (hoist), a chooser (auto)


def is_candidate(spec: str) -> bool:
    """Whether ``spec`` (a parsed strategy's spec) is a repair a calibration may measure and a
    field policy may name (:func:`kvprobe.repair_rule.is_repair`: not one of its NOT_REPAIRS)."""
    return is_repair(spec)


def check_threshold(threshold, what: str) -> float:
    """``threshold`` if it is a repair threshold (:func:`kvprobe.defaults.is_threshold`); else a
    one-line UsageError."""
    if not is_threshold(threshold):
        raise UsageError(f"{what} must be {THRESHOLD_RANGE} (a repair agrees with the oracle at least that often), "
                         f"got {threshold!r}")
    return float(threshold)


@dataclass
class FieldResult:
    name: str
    pairs: int = 0
    degenerate: int = 0  # pairs whose values have the same token ids
    skipped: int = 0  # pairs not measured: those, and pairs that cannot be edited in place
    changed: int = 0
    chosen: str = "oracle"
    verdict: str = "open"
    reason: str = ""
    seconds: float = 0.0
    counts: dict[str, list[int]] = field(default_factory=dict)  # strategy -> [agree, n]


def unmeasured(res: FieldResult, name: str, drawn: int, skips: list[str]) -> None:
    """A field most of whose drawn edits were not measured. Two cases, told apart by the counts:

    - ``degenerate`` (repair ``none``): most skipped edits have old and new values of the same
      token ids, so the model sees no change (the tokenizer maps the values alike, e.g. to [UNK]);
    - ``unmeasurable`` (repair ``oracle``, the policy's default): the edits change what the model
      sees but cannot be edited in place (the values tokenise to different lengths), so kvprobe knows
      nothing of any repair: the field is re-prefilled (a server re-renders it), never "sent as
      nothing"."""
    top = Counter(s.split(" (")[0] for s in skips).most_common(1)[0][0]
    if res.degenerate * 2 > res.skipped:
        res.verdict, res.chosen = "degenerate", "none"
        res.reason = (f"{res.skipped} of {drawn} drawn edits of {name} were not measured ({res.degenerate} of them: "
                      f"{SAME_IDS}; the tokenizer maps the values alike, e.g. [UNK]): nothing the model can see "
                      f"changes")
    else:
        res.verdict, res.chosen = "unmeasurable", "oracle"
        res.reason = (f"{res.skipped} of {drawn} drawn edits of {name} cannot be measured ({top}; "
                      f"{res.degenerate} had the same token ids): no repair was measured, so the oracle (a full "
                      f"re-prefill) until values of equal token length are given")


def decide(res: FieldResult, seq: Sequence, candidates: list[str], final: bool = False,
           unit: str = "pairs") -> bool:
    """Set the field's choice from the verdicts so far; True when the field may stop. ``unit`` names
    what one draw of the stream is in the reason (kvprobe memory's policy: ``edits``)."""
    verdicts = {s: seq.verdict(*res.counts[s]) for s in candidates}
    live = [s for s in candidates if verdicts[s] != "ruled out"]
    relevance = (f"no {unit[:-1]} changed the oracle's decision" if res.changed == 0 else
                 f"{res.changed} of {res.pairs} {unit} changed the oracle's decision")
    if not live:
        res.chosen, res.verdict = "oracle", "established"
        res.reason = f"every candidate is ruled out below {seq.threshold:g} ({relevance})"
        return True
    first = live[0]
    if verdicts[first] == "established":
        k, n = res.counts[first]
        res.chosen, res.verdict = first, "established"
        cheaper = ("the cheapest candidate" if first == candidates[0] else
                   f"{', '.join(candidates[:candidates.index(first)])} ruled out")
        res.reason = (f"{first} gives the oracle's decision on {k} of {n} {unit} (lower bound "
                      f"{seq.lower(k, n):.3f} >= {seq.threshold:g}; {cheaper}); {relevance}")
        return True
    if final:
        done = [s for s in candidates if verdicts[s] == "established"]
        if done:
            k, n = res.counts[done[0]]
            res.chosen, res.verdict = done[0], "established"
            res.reason = (f"{done[0]} is established (lower bound {seq.lower(k, n):.3f}); cheaper candidates "
                          f"were still open after {res.pairs} {unit}; {relevance}")
        else:
            out = [s for s in candidates if verdicts[s] == "ruled out"]
            res.chosen, res.verdict = "oracle", "budget"
            res.reason = (f"no candidate established within {res.pairs} {unit} (the budget; "
                          + (f"ruled out: {', '.join(out)}; " if out else "")
                          + f"still open: {', '.join(live)}): the oracle until more {unit} are measured; {relevance}")
    return False


def relevance(verdict: str, changed: int, pairs: int, change_seq: Sequence) -> str:
    """How a field bears on the decision: ``degenerate`` (the model sees no change), ``unmeasured``
    (its edits could not be measured), ``inert`` (no pair changed the oracle's decision), ``gating``
    (the lower bound of the change rate reaches 0.5), else ``mixed``."""
    if verdict in ("degenerate", "unmeasurable"):
        return "degenerate" if verdict == "degenerate" else "unmeasured"
    if changed == 0:
        return "inert"
    return "gating" if change_seq.lower(changed, pairs) >= 0.5 else "mixed"


def verdict_of(seq: Sequence, k: int, n: int) -> str:
    """A candidate's verdict as a policy file (version 4 on) records it: ``not measured`` where it
    has no pair of its own (a chain never reached it, or the field had no measured pair), else its
    sequence's verdict."""
    return seq.verdict(k, n) if n else NOT_MEASURED


def chain_problem(counts: dict[str, list[int]], unchanged: dict[str, int], seq: Sequence, pairs: int,
                  changed: int) -> tuple[str, str] | None:
    """What in a chain's recorded counts (:mod:`kvprobe.stopping.sequence`) does not follow from
    the chain, as (where below the field's strategies, what), or None. The candidates measured are
    the first few, in order; the last of them counts every pair of the field (it was measured back
    over the pairs before it joined); each one before it was ruled out at its count, which is where
    the next one joined: at the pair it was ruled out on, while in play, or where the one before it
    stopped, when it was ruled out as soon as it was measured back."""
    cands = list(counts)
    reached = [s for s in cands if counts[s][1]]
    if reached != cands[:len(reached)]:
        return "", f"count pairs for {', '.join(reached)}: a chain measures its candidates in order, none skipped"
    if not reached:
        return ("", f"count no pair, but the field has {pairs}") if pairs else None
    last = reached[-1]
    if counts[last][1] != pairs or unchanged[last] != pairs - changed:
        return f".{last}", (f"counts {counts[last][1]} pairs ({unchanged[last]} unchanged), but the candidate a chain "
                            f"ends on counts every pair of the field ({pairs}, {pairs - changed} unchanged)")
    before = 0
    for s in reached[:-1]:
        k, n = counts[s]
        earlier = [seq.verdict(k - x, n - 1) for x in (0, 1) if 0 <= k - x <= n - 1]
        if seq.verdict(k, n) != "ruled out" or n < before or (n > before and "open" not in earlier) \
                or unchanged[s] > n:
            return f".{s}", (f"records {k} of {n}, but {reached[reached.index(s) + 1]} was measured after it: a chain "
                             f"moves on only where the candidate in play is ruled out")
        before = n
    return None
