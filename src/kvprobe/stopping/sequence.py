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
whatever rule chose that moment (``simulate_coverage`` checks it). Where several repairs are tested
on the same pairs, their lower bounds share ``alpha_lower`` (Bonferroni over ``m``), so the repair a
calibration establishes is wrongly established with probability at most ``alpha_lower``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    """The confidence sequence for one repair (``m`` repairs share the lower bound's alpha)."""

    threshold: float = 0.95
    alpha_lower: float = ALPHA_LOWER
    alpha_upper: float = ALPHA_UPPER
    m: int = 1
    w0: float = W0

    @property
    def alpha(self) -> float:
        return self.alpha_lower / self.m

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
