"""When to stop measuring a repair: a confidence sequence for a share, valid under optional stopping.

A calibration watches, pair after pair, whether a repair's decision equals the oracle's (a
Bernoulli stream with unknown rate ``p``). It wants to stop as soon as it may claim either
``p >= threshold`` (the repair is *established*) or ``p < threshold`` (it is *ruled out*). Looking
after every pair and stopping at the first look that allows a claim breaks a fixed-n interval,
so the bounds here are a **confidence sequence**: one-sided Clopper-Pearson bounds whose error
levels are *spent* over the looks (a fixed alpha-spending schedule, union bound over looks):

- the lower bound spends ``alpha_lower``: ``w0`` of it at the one look ``n0`` where an unbroken run
  of agreements first reaches the threshold (``n0 = ceil(log(w0 * alpha_lower) / log(threshold))``,
  62 pairs at 0.95), the rest spread over every look ``n`` as ``6 / (pi^2 n^2)`` (which sums to 1);
- the upper bound spends ``alpha_upper`` as ``6 / (pi^2 n^2)`` over every look.

So with probability at least ``1 - alpha_lower - alpha_upper`` the true rate lies inside every
interval of the sequence at once, and hence inside the one reported where the calibration stopped,
whatever rule chose that moment (``simulate_coverage`` checks it).

Several repairs of one field are tested one of two ways, so that the repair chosen is wrongly
established with probability at most ``alpha_lower``:

- **shared** (``chain=0``; ``kvprobe memory``'s policy): every repair is measured on the same pairs and
  their lower bounds share ``alpha_lower`` (Bonferroni over ``m``): 83 pairs at 0.95 for three;
- **a chain** (``chain=N``, at most N pairs; ``kvprobe calibrate``): the repairs are taken one after
  another, cheapest first. The first is measured from the first pair; once the one in play is
  ruled out, the next is measured back over every pair so far (the pairs every repair would have
  seen) and goes on from there. A repair is measured only while it is in play or about to be, so a
  field settled by its cheapest repair pays for that one alone. Only the repair in play can be
  chosen, and reaching repair j needs every earlier one ruled out, which is likely only where their
  rates lie far below the threshold, where wrongly establishing them is unlikely; so the repairs
  need not split ``alpha_lower``. How much each may spend is computed, not assumed:
  :func:`chain_error` gives the exact worst case of the chain's error over every rate of every
  repair, from each repair's own first-passage chances (a recursion over the binomial paths, as
  group-sequential boundaries are computed: Armitage, McPherson and Rowe 1969; Jennison and
  Turnbull 2000, ch. 8), with no assumption on how the repairs' results on one pair depend on each
  other; :func:`chain_alpha` gives the largest share of ``alpha_lower`` each repair may spend with
  that worst case within ``alpha_lower``. At 0.95, three repairs and up to 200 pairs that is all of
  it: 62 pairs establish a repair, as for one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.stats import beta

from kvprobe.repair_rule import clears

ALPHA_LOWER = 0.045  # wrongly establishing a repair
ALPHA_UPPER = 0.005  # wrongly ruling one out (the cost: the oracle where a cheaper repair would do)
W0 = 0.95  # the share of alpha_lower spent at the first look where an established verdict is possible
_SERIES = 6 / math.pi ** 2  # sum over n >= 1 of 1/n^2 is pi^2/6


def first_look(threshold: float, alpha: float, w0: float = W0) -> int:
    """The number of pairs, all agreeing, at which the lower bound first reaches ``threshold``."""
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    return max(1, math.ceil(math.log(w0 * alpha) / math.log(threshold) - 1e-12))


@dataclass(frozen=True)
class Sequence:
    """The confidence sequence for one of ``m`` repairs: they share the lower bound's alpha
    (``chain=0``), or are tested as a chain of at most ``chain`` pairs, each spending
    :func:`chain_alpha` (see the module's docstring)."""

    threshold: float = 0.95
    alpha_lower: float = ALPHA_LOWER
    alpha_upper: float = ALPHA_UPPER
    m: int = 1
    w0: float = W0
    chain: int = 0

    @property
    def alpha(self) -> float:
        if self.chain:
            return chain_alpha(self.threshold, self.m, self.chain, self.alpha_lower, self.alpha_upper, self.w0)
        return self.alpha_lower / self.m

    @property
    def procedure(self) -> str:
        return "chain" if self.chain else "shared"

    @property
    def n0(self) -> int:
        return first_look(self.threshold, self.alpha, self.w0)

    def spent_lower(self, n: int) -> float:
        a = self.alpha * (1 - self.w0) * _SERIES / n ** 2
        return a + (self.alpha * self.w0 if n == self.n0 else 0.0)

    def spent_upper(self, n: int) -> float:
        return self.alpha_upper * _SERIES / n ** 2

    def lower(self, k: int, n: int) -> float:
        """Lower bound on the rate after ``k`` agreements in ``n`` pairs (0 before any pair)."""
        if n == 0 or k == 0:
            return 0.0
        return float(beta.ppf(self.spent_lower(n), k, n - k + 1))

    def upper(self, k: int, n: int) -> float:
        if n == 0 or k == n:
            return 1.0
        return float(beta.isf(self.spent_upper(n), k + 1, n - k))

    def to_establish(self, k: int, n: int, limit: int) -> int:
        """How many more pairs, every one agreeing, establish a repair at ``k`` agreements in ``n`` pairs: the
        earliest pair at which its stream could stop (``limit``, the pairs left in the budget, where none does)."""
        return next((m for m in range(1, limit) if self.verdict(k + m, n + m) == "established"), max(1, limit))

    def verdict(self, k: int, n: int) -> str:
        """``established``, ``ruled out`` or ``open`` after ``k`` agreements in ``n`` pairs."""
        if clears(self.lower(k, n), self.threshold):
            return "established"
        if self.upper(k, n) < self.threshold:
            return "ruled out"
        return "open"


def bounds_table(seq: Sequence, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """``lower[n, k]`` and ``upper[n, k]`` for every ``n <= max_n`` and ``k <= n`` (vectorised)."""
    n = np.arange(max_n + 1)[:, None].astype(float)
    k = np.arange(max_n + 1)[None, :].astype(float)
    nn = np.maximum(n, 1)
    a_low = seq.alpha * (1 - seq.w0) * _SERIES / nn ** 2 + np.where(n == seq.n0, seq.alpha * seq.w0, 0.0)
    a_up = seq.alpha_upper * _SERIES / nn ** 2
    with np.errstate(all="ignore"):
        lower = np.where((k > 0) & (k <= n), beta.ppf(a_low, np.maximum(k, 1), np.maximum(n - k + 1, 1)), 0.0)
        upper = np.where(k < n, beta.isf(a_up, k + 1, np.maximum(n - k, 1)), 1.0)
    return np.nan_to_num(lower), np.nan_to_num(upper, nan=1.0)


def _passages(seq: Sequence, max_n: int, ps: np.ndarray) -> dict[str, np.ndarray]:
    """For each rate in ``ps``, exact over the binomial paths of ``max_n`` pairs (the distribution
    of agreements carried forward pair by pair): ``f``, the chance that the stream stopped at its
    first verdict ends established; ``g``, that it ends ruled out; ``h``, that its lower bound ever
    reaches the threshold; ``r``, that its upper bound ever falls below it."""
    lower, upper = bounds_table(seq, max_n)
    est, below = clears(lower, seq.threshold), upper < seq.threshold
    never = np.zeros_like(est)
    p = ps[:, None]

    def first_passage(stop_a: np.ndarray, stop_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The chances that a path first enters ``stop_a`` and that it first enters ``stop_b`` (the two
        disjoint; a path stops at the first it enters)."""
        dist = np.zeros((len(ps), max_n + 2))
        dist[:, 0] = 1.0
        hit_a, hit_b = np.zeros(len(ps)), np.zeros(len(ps))
        for n in range(1, max_n + 1):
            nxt = dist * (1 - p)
            nxt[:, 1:] += dist[:, :-1] * p
            dist = nxt
            a, b = stop_a[n, :n + 1], stop_b[n, :n + 1]
            hit_a += dist[:, :n + 1][:, a].sum(axis=1)
            hit_b += dist[:, :n + 1][:, b].sum(axis=1)
            dist[:, :n + 1][:, a | b] = 0.0
        return hit_a, hit_b

    f, g = first_passage(est, below & ~est)
    h, _ = first_passage(est, never)
    _, r = first_passage(never, below)
    return {"f": f, "g": g, "h": h, "r": r}


GRID = 512  # rates on [0, threshold] between which chain_error brackets the worst case


@lru_cache(maxsize=64)
def chain_error(threshold: float, alpha: float, m: int, max_pairs: int, alpha_upper: float = ALPHA_UPPER,
                w0: float = W0) -> float:
    """An upper bound, exact up to the grid's bracketing, on the probability that a chain of ``m``
    repairs (each spending ``alpha`` on its lower bound; at most ``max_pairs`` pairs) ends with a
    repair established whose rate is below ``threshold``, over every rate of every repair and
    whatever the dependence between the repairs' results on one pair.

    Candidate 1 is measured from the first pair and the field stops when it is established: it is
    chosen and wrong with chance at most ``f(p1)`` (its stream stopped at its first verdict), and
    the chain goes on only if it is ruled out, chance ``g(p1)``. A later candidate ``j`` is chosen
    and wrong only if its lower bound ever reaches the threshold, ``h(pj)``, and only if candidate
    ``j`` was reached; candidate ``j + 1`` is reached only if ``j``'s upper bound ever fell below the
    threshold, ``r(pj)``. Using these marginal chances alone (no independence between candidates),
    the worst case of candidates ``j..m`` is ``X_m = sup_{p<t} h(p)``,
    ``X_j = sup_p [h(p) [p < t] + min(r(p), X_{j+1})]``, and the chain's is
    ``sup_p [f(p) [p < t] + min(g(p), X_2)]``. Each chance is monotone in ``p`` (more agreements
    reach "established" no later, "ruled out" no sooner), so on a grid cell ``[a, b]`` a term is at
    most its rising part at ``b`` plus its falling part at ``a``; above the threshold only the
    falling part counts, at ``t``. More pairs only raise every chance, so ``max_pairs`` bounds a
    field that stops sooner."""
    seq = Sequence(threshold=threshold, alpha_lower=alpha, alpha_upper=alpha_upper, w0=w0)
    grid = np.linspace(0.0, threshold, GRID + 1)
    c = _passages(seq, max_pairs, grid)
    if m == 1:
        return float(c["f"][-1])

    def worst(rise: np.ndarray, fall: np.ndarray, rest: float) -> float:
        return max(float(np.max(rise[1:] + np.minimum(fall[:-1], rest))), float(min(fall[-1], rest)))

    rest = float(c["h"][-1])
    for _ in range(m - 2):
        rest = worst(c["h"], c["r"], rest)
    return worst(c["f"], c["g"], rest)


@lru_cache(maxsize=64)
def chain_alpha(threshold: float, m: int, max_pairs: int, alpha_lower: float = ALPHA_LOWER,
                alpha_upper: float = ALPHA_UPPER, w0: float = W0) -> float:
    """What each repair of a chain of ``m`` may spend on its lower bound: ``alpha_lower`` when the
    chain's worst-case error (:func:`chain_error`) stays within it, else the largest of
    ``alpha_lower * (1 - i/20)`` that does, else Bonferroni's ``alpha_lower / m`` (which is valid for
    any rule, by the union bound)."""
    for i in range(20):
        alpha = alpha_lower * (1 - i / 20)
        if alpha <= alpha_lower / m:
            break
        if chain_error(threshold, alpha, m, max_pairs, alpha_upper, w0) <= alpha_lower:
            return alpha
    return alpha_lower / m


def simulate_chain(ps, seq: Sequence, trials: int = 10_000, seed: int = 0) -> dict:
    """A chain of repairs at rates ``ps`` (cheapest first), each with its own Bernoulli result on
    every pair, under the shipped rule: the first is measured from the first pair; once the one in
    play is ruled out, the next is measured back over every pair so far and goes on from there; the
    field stops when the one in play is established, when all are ruled out, or after ``seq.chain``
    pairs. Returns how often the interval of the repair in play where the field stopped holds its
    rate (``coverage``), how often the chosen repair is wrongly established (its rate below the
    threshold), which one is chosen, and the pairs used."""
    N = seq.chain
    lower, upper = bounds_table(seq, N)
    rng = np.random.default_rng(seed)
    looks = np.arange(N + 1)
    covered, wrong, chosen, used = 0, 0, np.zeros(len(ps) + 1, int), []
    for _ in range(trials):
        n, pick, held = 1, len(ps), True
        for j, p in enumerate(ps):
            k = np.concatenate([[0], np.cumsum(rng.random(N) < p)])
            est, out = clears(lower[looks, k], seq.threshold), upper[looks, k] < seq.threshold
            verdict = (est | out)[n:]
            stop = n + int(verdict.argmax()) if verdict.any() else N
            n = stop
            held = bool(lower[stop, k[stop]] <= p <= upper[stop, k[stop]])
            if est[stop]:
                pick = j
                wrong += p < seq.threshold
                break
            if not out[stop]:
                break  # the budget ran out on an open repair
        covered += held
        chosen[pick] += 1
        used.append(n)
    return {"ps": [float(p) for p in ps], "trials": trials, "max_pairs": N, "alpha_each": seq.alpha,
            "chosen": {("oracle" if j == len(ps) else j): int(c) for j, c in enumerate(chosen) if c},
            "coverage": covered / trials, "wrongly_established": wrong / trials,
            "median_pairs": float(np.median(used)), "nominal": 1 - seq.alpha_lower - seq.alpha_upper}


def simulate_coverage(p: float, seq: Sequence, trials: int = 10_000, max_n: int = 400, seed: int = 0) -> dict:
    """How often the interval reported at the stopping time holds ``p``, under the shipped rule
    (stop at the first look with a verdict, or after ``max_n`` pairs); and how often that verdict
    is wrong (established below the threshold, ruled out at or above it)."""
    lower, upper = bounds_table(seq, max_n)
    rng = np.random.default_rng(seed)
    x = rng.random((trials, max_n)) < p
    k = np.concatenate([np.zeros((trials, 1), int), np.cumsum(x, axis=1)], axis=1)  # k[t, n]
    n = np.arange(max_n + 1)[None, :]
    lo, up = lower[n, k], upper[n, k]
    decided = clears(lo, seq.threshold) | (up < seq.threshold)
    decided[:, 0] = False
    decided[:, max_n] = True
    stop = decided.argmax(axis=1)
    rows = np.arange(trials)
    lo_s, up_s = lo[rows, stop], up[rows, stop]
    est = clears(lo_s, seq.threshold)
    out = up_s < seq.threshold
    wrong = (est & (p < seq.threshold)) | (out & (p >= seq.threshold))
    return {"p": p, "trials": trials, "max_pairs": max_n, "coverage": float(((lo_s <= p) & (p <= up_s)).mean()),
            "established": float(est.mean()), "ruled_out": float(out.mean()), "wrong_verdicts": float(wrong.mean()),
            "median_pairs": float(np.median(stop)), "nominal": 1 - seq.alpha_lower - seq.alpha_upper}
