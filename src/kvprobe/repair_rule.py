"""The one rule for "which repair may I deploy", shared by the run's headline (``summary.json``),
``topk.yaml``'s :meth:`kvprobe.policy.Policy.cheapest` and so ``auto``.

A repair is **established** at a threshold ``t`` when it is established on both legs:

- **agreement**: on decision edits (edits that change the oracle's decision), its decision equals
  the oracle's: the Wilson 95% lower bound of that share is at least ``t``;
- **no spurious flip**: on negative controls (edits that must not change the decision), it keeps
  the decision: the Wilson 95% lower bound of the kept share is at least ``t``.

A leg with no case measured is *open*, so a repair measured without controls is never
established. A leg is *ruled out* when its interval lies wholly below ``t``. Among the established
repairs the cheapest wins: the least share of tokens recomputed, then the least time to the
decision. ``kvprobe calibrate`` applies the same two legs per field with an interval that stays
valid under its repeated looks (:mod:`kvprobe.stopping.sequence`): one stream per field whose
pairs are agreement where the oracle's decision changed and no-flip where it did not.

This module imports nothing but the standard library and :mod:`kvprobe.intervals` (``kvprobe.policy``
reads it, and must load without torch); the interval is :func:`kvprobe.intervals.wilson`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvprobe.intervals import Z95, wilson

RULE = ("the cheapest repair (share of tokens recomputed, then time to the decision) established on both legs: its "
        "agreement with the oracle on decision edits, and its keeping of the decision on negative controls (edits "
        "that must not change it), each with a Wilson 95% lower bound at or above the threshold")


def clears(lower: float | None, threshold: float) -> bool:
    """The gate, one rule for every verdict kvprobe gives on a share (a repair's leg, ``kvprobe validate``'s
    composition gate, the report's headline, K*, calibrate's sequences): its lower bound is at or above
    ``threshold``. A bound that is missing or NaN (nothing measured) never clears. An array of bounds gives
    the rule element by element (calibrate's coverage simulation applies it so)."""
    return lower is not None and lower >= threshold  # NaN compares False


NOT_REPAIRS = ("stale", "oracle", "hoist", "auto")  # never chosen: the two ends, a rewritten prompt, a chooser
NOT_REPAIRS_WHY = ("stale and oracle are the two ends, hoist rewrites the prompt (the field moved to its end), auto "
                   "chooses among repairs")


def is_repair(spec: str) -> bool:
    """Whether the rule may choose ``spec`` (not one of :data:`NOT_REPAIRS`, by name)."""
    return spec.partition(":")[0] not in NOT_REPAIRS


@dataclass(frozen=True)
class Leg:
    """``k`` successes of ``n`` cases on one leg, with the Wilson 95% interval."""

    k: int
    n: int

    @classmethod
    def of(cls, share: float | None, n: int | None) -> "Leg":
        """A leg from a stored share and its case count (``share * n`` successes, rounded)."""
        if share is None or not n or not math.isfinite(share):
            return cls(0, 0)
        return cls(round(share * n), int(n))

    @property
    def lo(self) -> float:
        return wilson(self.k, self.n)[0]

    @property
    def hi(self) -> float:
        return wilson(self.k, self.n)[1]

    def status(self, threshold: float) -> str:
        """``established``, ``ruled out``, ``open`` or ``not measured``."""
        if not self.n:
            return "not measured"
        if clears(self.lo, threshold):
            return "established"
        return "ruled out" if self.hi < threshold else "open"


@dataclass(frozen=True)
class Candidate:
    """A repair's evidence: its two legs and its cost (frac recomputed, seconds to the decision)."""

    name: str
    agreement: Leg
    kept: Leg
    frac_recomputed: float | None = None
    seconds: float | None = None

    def status(self, threshold: float) -> str:
        legs = (self.agreement.status(threshold), self.kept.status(threshold))
        if legs == ("established", "established"):
            return "established"
        return "ruled out" if "ruled out" in legs else "open"

    def cost(self) -> tuple[float, float]:
        inf = math.inf
        return (self.frac_recomputed if self.frac_recomputed is not None else inf,
                self.seconds if self.seconds is not None else inf)

    def why_not(self, threshold: float) -> str:
        """Which leg keeps it from being established, in words."""
        out = []
        for word, leg in (("agreement", self.agreement), ("controls kept", self.kept)):
            st = leg.status(threshold)
            if st == "not measured":
                out.append(f"no {'negative control' if word == 'controls kept' else 'decision case'} measured")
            elif st != "established":
                out.append(f"{word} {leg.k}/{leg.n} (lower bound {leg.lo:.2f} < {threshold:g})")
        return "; ".join(out)


def choose(candidates: list[Candidate], threshold: float) -> tuple[Candidate | None, list[Candidate]]:
    """(the cheapest established candidate or None, every established one cheapest first)."""
    ok = sorted((c for c in candidates if c.status(threshold) == "established"), key=Candidate.cost)
    return (ok[0] if ok else None), ok


def cheapest_on(candidates: list[Candidate], leg: str, threshold: float) -> Candidate | None:
    """The cheapest candidate established on one leg alone (``agreement`` or ``kept``): the repair
    for the fields that decide, or for the fields that must not matter."""
    ok = [c for c in candidates if getattr(c, leg).status(threshold) == "established"]
    return min(ok, key=Candidate.cost, default=None)


def closest(candidates: list[Candidate]) -> Candidate | None:
    """The candidate nearest to being established: the highest lower bound of its weaker leg, then cheapest."""
    def key(c: Candidate):
        los = [leg.lo if leg.n else 0.0 for leg in (c.agreement, c.kept)]
        return (-min(los), c.cost())
    return min(candidates, key=key, default=None)


def cases_at_rate(rate: float, threshold: float, limit: int = 100_000) -> int | None:
    """The fewest cases at which a share of ``rate`` has a Wilson 95% lower bound at or above
    ``threshold`` (None when ``rate`` is not above it, or past ``limit``)."""
    if not rate > threshold:
        return None
    n = cases_to_establish(threshold) or 1
    while n <= limit:
        if clears(wilson(math.floor(rate * n), n)[0], threshold):
            return n
        n = math.ceil(n * 1.05)
    return None


def cases_to_establish(threshold: float) -> int | None:
    """The fewest cases, all succeeding, whose Wilson 95% lower bound n / (n + z^2) reaches ``threshold``
    on one leg (None for a threshold of 1, which no sample reaches)."""
    if threshold >= 1:
        return None
    n = max(1, math.ceil(threshold * Z95 ** 2 / (1 - threshold)) - 1)
    while not clears(wilson(n, n)[0], threshold):
        n += 1
    return n
