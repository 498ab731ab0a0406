"""Binomial intervals, one home: every share kvprobe prints or decides on (agreement, kept controls,
validity, accuracy, state correctness) carries the interval of this module.

- :func:`wilson`: the Wilson score interval of ``k`` successes in ``n`` trials, Newcombe's (1998)
  closed form exactly as scipy's ``binomtest(k, n).proportion_ci(method="wilson")`` computes it, so
  the two agree to the last bit (tests/unit/test_intervals.py checks every ``k`` of ``n`` <= 300).
  15 of 15 gives [0.80, 1.00], not [1, 1];
- :func:`wilson_share`: the same from a stored share and its count (``share * n`` successes, rounded);
- :func:`proportion_ci`: a method by name, ``wilson`` or ``exact`` (Clopper-Pearson, from scipy).

The interval that stays valid under repeated looks (``kvprobe calibrate``'s stopping rule) is a
confidence sequence, not a fixed-n interval: :mod:`kvprobe.stopping.sequence`.

At the default 95% this module imports only the standard library: ``kvprobe.policy`` (through
:mod:`kvprobe.repair_rule`) must load without numpy, scipy or torch. Another level takes its normal
quantile from scipy (``ndtri``), as scipy's own interval does.
"""

from __future__ import annotations

import math

CONFIDENCE = 0.95
Z95 = 1.959963984540054  # scipy.special.ndtri(0.975), the normal quantile of a two-sided 95% interval
METHODS = ("wilson", "exact")

NAN2 = (float("nan"), float("nan"))


def z_of(confidence: float) -> float:
    """The normal quantile of a two-sided interval at ``confidence`` (in (0, 1))."""
    if confidence == CONFIDENCE:
        return Z95
    if not 0 < confidence < 1:
        raise ValueError(f"a confidence level must be in (0, 1), got {confidence!r}")
    from scipy.special import ndtri

    return float(ndtri(0.5 + 0.5 * confidence))


def wilson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval of ``k`` successes in ``n`` trials; (nan, nan) without trials."""
    if not n:
        return NAN2
    if not 0 <= k <= n:
        raise ValueError(f"successes must be in [0, n]: got {k} of {n}")
    z = z_of(confidence)
    p = k / n
    denom = 2 * (n + z ** 2)
    centre = (2 * n * p + z ** 2) / denom
    delta = z / denom * math.sqrt(4 * n * p * (1 - p) + z ** 2)
    return (0.0 if k == 0 else centre - delta), (1.0 if k == n else centre + delta)


def wilson_share(share: float | None, n: int | None, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """:func:`wilson` of a share of ``n`` trials (``share * n`` successes, rounded); (nan, nan) without
    trials or without a finite share."""
    if not n or share is None or not math.isfinite(share):
        return NAN2
    return wilson(round(share * n), int(n), confidence)


def proportion_ci(k: int, n: int, confidence: float = CONFIDENCE, method: str = "wilson") -> tuple[float, float]:
    """The interval for ``k`` successes of ``n`` trials by ``method`` (one of :data:`METHODS`: ``wilson``,
    or ``exact``, Clopper-Pearson by scipy); (nan, nan) without trials."""
    if method not in METHODS:
        raise ValueError(f"unknown interval method {method!r}; accepted: {', '.join(METHODS)}")
    if not n:
        return NAN2
    if method == "wilson":
        return wilson(int(k), int(n), confidence)
    from scipy.stats import binomtest

    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)
