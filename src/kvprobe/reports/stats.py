"""Numbers as the report prints them: every mean with its 95% CI and n, and a plain-words verdict
where the sample is too small to conclude.

The rule (:func:`caveat`): a number is *not conclusive* when it rests on fewer than
:data:`MIN_N` cases, or when its 95% CI is missing or wider than :data:`MAX_CI_WIDTH`
(on a 0-1 scale: agreement, recovery, flip rate, accuracy, share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from markupsafe import Markup, escape

from kvprobe.intervals import wilson_share
from kvprobe.metrics import mean_ci, proportion

MIN_N = 10
MAX_CI_WIDTH = 0.5
RULE = (f"Shares (agreement, invariance, validity, accuracy) carry Wilson 95% intervals, which stay honest at "
        f"0 or 1 (15 of 15 is [0.80, 1.00]); means (recovery, shares of a case's effect) a percentile bootstrap "
        f"over cases. A number is marked inconclusive when it rests on fewer than {MIN_N} cases or its 95% CI "
        f"is missing or wider than {MAX_CI_WIDTH}.")


def _f(x: float, digits: int = 2) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.{digits}f}"


@dataclass(frozen=True)
class Stat:
    """A mean with its 95% CI over ``n`` units."""

    mean: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values) -> "Stat":
        return cls(*mean_ci(values))

    @classmethod
    def share(cls, values) -> "Stat":
        """The share of yes (1) among yes/no ``values`` (NaNs dropped), with its Wilson 95% interval; values
        that are not all 0 or 1 (a per-case mean over several draws) are a mean, with the bootstrap interval."""
        x = np.asarray(values, dtype=float)
        x = x[~np.isnan(x)]
        return cls(*proportion(x)) if np.isin(x, (0.0, 1.0)).all() else cls.of(x)

    @classmethod
    def wilson(cls, p: float, n: int) -> "Stat":
        """A proportion ``p`` of ``n`` trials with the Wilson score 95% interval."""
        if not n or p is None or not math.isfinite(p):
            return cls(float("nan"), float("nan"), float("nan"), int(n or 0))
        return cls(float(p), *wilson_share(p, n), int(n))

    @property
    def caveat(self) -> str | None:
        return caveat(self.n, self.lo, self.hi)

    def text(self, digits: int = 2) -> str:
        if self.n == 0 or not math.isfinite(self.mean):
            return f"n/a (n={self.n})"
        ci = f"[{_f(self.lo, digits)}, {_f(self.hi, digits)}]" if math.isfinite(self.lo) else "[no CI]"
        return f"{_f(self.mean, digits)} {ci} n={self.n}"

    def html(self, digits: int = 2) -> Markup:
        """``0.82 [0.71, 0.90] n=12`` with a warning mark when inconclusive."""
        if self.n == 0 or not math.isfinite(self.mean):
            return Markup(f'<span class="stat na" data-n="{self.n}">n/a <span class="n">n={self.n}</span></span>')
        ci = (f"[{_f(self.lo, digits)}, {_f(self.hi, digits)}]" if math.isfinite(self.lo) else "[no CI]")
        warn = self.caveat
        mark = Markup(f' <span class="warn" title="{escape(warn)}">inconclusive</span>') if warn else ""
        return Markup(f'<span class="stat" data-n="{self.n}">{_f(self.mean, digits)} <span class="ci">{ci}</span> '
                      f'<span class="n">n={self.n}</span>{mark}</span>')


def caveat(n: int, lo: float, hi: float) -> str | None:
    """Why a number cannot be concluded from, in words; None when it can."""
    if n == 0:
        return "no cases"
    if n < MIN_N:
        return f"too few cases to conclude (n={n} < {MIN_N})"
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return f"no confidence interval (n={n})"
    if hi - lo > MAX_CI_WIDTH:
        return f"CI too wide to conclude (width {hi - lo:.2f} > {MAX_CI_WIDTH})"
    return None


def nanfloat(x) -> float:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return x


def mean_of(values) -> float:
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    return float(x.mean()) if len(x) else float("nan")
