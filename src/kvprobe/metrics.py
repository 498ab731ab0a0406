"""Decision metrics against the oracle, per case and aggregated with 95% CIs: Wilson intervals
(:mod:`kvprobe.intervals`) for yes/no shares such as agreement, a percentile bootstrap for means such as recovery.

Per case, with m = score(new answer) - score(old answer) at the decision token:

- ``recovery = (m - m_stale) / (m_oracle - m_stale)``: 0 is stale, 1 is the oracle. The ratio
  is unstable when the oracle flip is small, so cases with ``|m_oracle - m_stale| < min_flip``
  get NaN and are counted as excluded; the flip size is always reported beside it;
- ``agree``: the strategy's arg-max option equals the oracle's;
- ``cosine`` and ``kl`` (KL(oracle || strategy), nats) over the full next-token distribution.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from kvprobe.defaults import DEFAULT_MIN_FLIP  # noqa: F401  (logits; below it no recovery ratio)
from kvprobe.intervals import proportion_ci

N_BOOT = 2000


def compare(logits: torch.Tensor, oracle: torch.Tensor) -> dict:
    """Cosine and KL(oracle || logits) of two (V,) logit vectors."""
    logits, oracle = logits.double(), oracle.double()
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(oracle, -1), log_target=True, reduction="sum")
    return {"cosine": float(F.cosine_similarity(logits, oracle, dim=0)), "kl": float(kl)}


def recovery(m: float, m_stale: float, m_oracle: float, min_flip: float = DEFAULT_MIN_FLIP) -> float:
    flip = m_oracle - m_stale
    return float("nan") if abs(flip) < min_flip else (m - m_stale) / flip


def bootstrap_ci(values, n_boot: int = N_BOOT, seed: int = 0, alpha: float = 0.05) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean (NaNs dropped); (nan, nan) for fewer than 2 values."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    if len(x) < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), (n_boot, len(x)))].mean(1)
    return float(np.quantile(means, alpha / 2)), float(np.quantile(means, 1 - alpha / 2))


def proportion(values) -> tuple[float, float, float, int]:
    """(share, lo, hi, n) of yes/no ``values`` (NaNs dropped) with the Wilson 95% interval: the
    interval for agreement, invariance and validity, where a bootstrap would print 15/15 as [1, 1]."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    if not len(x):
        return float("nan"), float("nan"), float("nan"), 0
    lo, hi = proportion_ci(int(x.sum()), len(x))
    return float(x.mean()), lo, hi, int(len(x))


def mean_ci(values) -> tuple[float, float, float, int]:
    """(mean, lo, hi, n) ignoring NaNs."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    lo, hi = bootstrap_ci(x)
    return (float(x.mean()) if len(x) else float("nan")), lo, hi, int(len(x))


def valid_case_ids(decisions: pd.DataFrame) -> set[str]:
    """The decision cases valid without chain-of-thought (stale gives the old answer, oracle the
    new): the one case set every CoT budget is summarised over, so budgets compare paired. A
    table with no budget-0 rows falls back to its own rows' validity."""
    if "cot" in decisions and (decisions["cot"] == 0).any():
        decisions = decisions[decisions["cot"] == 0]
    return set(decisions.loc[decisions["valid"].astype(bool), "case_id"])


def stay_valid(decisions: pd.DataFrame) -> list[dict]:
    """Per CoT budget above 0: how many of these decision cases stay valid after reasoning (stale
    still gives the old answer, oracle the new), as dicts of cot, n (cases) and valid."""
    if "cot" not in decisions or "valid" not in decisions:
        return []
    return [{"cot": int(c), "n": int(g["case_id"].nunique()),
             "valid": int(g.loc[g["valid"].astype(bool), "case_id"].nunique())}
            for c, g in decisions.groupby("cot") if c]


def summarize_edits(df: pd.DataFrame, by=("strategy", "cot")) -> pd.DataFrame:
    """One row per group: agreement, recovery (guarded), cosine, KL, cost, each with n and CI.

    Cost, in seconds, is ``wall_s``, the repair alone, and ``to_decision_s``, the repair plus feeding the
    tail (an erratum line, a hoisted suffix, the decision token) up to the decision's logits. The
    latter exists without CoT only: with CoT the strategies reason as one batch. Tables written
    before ``decide_s`` was recorded give NaN there."""
    rows = []
    for key, g in df.groupby(list(by), sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        agree = proportion(g.agree.astype(float))
        rec = mean_ci(g.recovery)
        row = dict(zip(by, key))
        row.update(n=len(g), agreement=agree[0], agreement_lo=agree[1], agreement_hi=agree[2],
                   recovery=rec[0], recovery_lo=rec[1], recovery_hi=rec[2], n_recovery=rec[3],
                   n_excluded_small_flip=int(g.recovery.isna().sum()),
                   median_oracle_flip=float(g.oracle_flip.abs().median()),
                   correct=float(g.correct.mean()), cosine=float(g.cosine.mean()), kl=float(g.kl.mean()),
                   frac_recomputed=float(g.frac_recomputed.mean()), wall_s=float(g.wall_s.mean()),
                   to_decision_s=(float((g.wall_s + g.decide_s).mean(skipna=False))
                                  if "decide_s" in g else float("nan")))
        rows.append(row)
    return pd.DataFrame(rows)


def paired_difference_ci(a, b, confidence: float = 0.95) -> dict:
    """The difference of two paired proportions, mean(a) - mean(b), with Tango's score interval
    (Tango 1998, Statistics in Medicine 17:891, the interval recommended there for equivalence in a
    paired design). ``a``, ``b``: yes/no per item (pairs with a NaN on either side dropped).

    With ``only_a`` (a yes, b no) = x, ``only_b`` = y, n pairs and a difference d, the score is
    ``Z(d) = (x - y - n d) / sqrt(n (2 q + d (1 - d)))``, q the restricted maximum-likelihood
    P(only b) given d, the root of ``2n q^2 + (-x - y + (2n - x + y) d) q - y d (1 - d) = 0``; the
    interval is every d with |Z(d)| <= z. It depends on the discordant pairs only: none in n pairs
    gives +-z^2 / (n + z^2) (0.131 for 18 pairs, 0.026 for 100 at 90%), never an empty interval
    (the Wald interval's) nor one that shrinks with the agreement (Newcombe's method 10 gives +-0.03
    for 18 pairs at 61% accuracy with no discordant pair). Returns n, ``only_a``, ``only_b``, the
    difference, ``lo``, ``hi`` (NaNs without pairs).
    """
    from scipy.optimize import brentq
    from scipy.stats import norm

    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    keep = ~(np.isnan(x) | np.isnan(y))
    x, y = x[keep].astype(bool), y[keep].astype(bool)
    n, only_a, only_b = int(len(x)), int((x & ~y).sum()), int((~x & y).sum())
    out = {"n": n, "only_a": only_a, "only_b": only_b, "diff": float("nan"), "lo": float("nan"), "hi": float("nan")}
    if not n:
        return out
    z, diff = float(norm.ppf(0.5 + confidence / 2)), (only_a - only_b) / n
    out["diff"] = diff
    eps = 1e-12
    lo_end, hi_end = -1 + eps, 1 - eps
    if score_paired(lo_end, n, only_a, only_b) <= z:
        out["lo"] = -1.0
    else:
        out["lo"] = brentq(lambda d: score_paired(d, n, only_a, only_b) - z, lo_end, diff, xtol=1e-12)
    if score_paired(hi_end, n, only_a, only_b) >= -z:
        out["hi"] = 1.0
    else:
        out["hi"] = brentq(lambda d: score_paired(d, n, only_a, only_b) + z, diff, hi_end, xtol=1e-12)
    return out


def score_paired(d: float, n: int, only_a: int, only_b: int) -> float:
    """Tango's score statistic Z(d) for a paired difference d (see :func:`paired_difference_ci`)."""
    w = -only_a - only_b + (2 * n - only_a + only_b) * d
    q = (math.sqrt(w * w + 8 * n * only_b * d * (1 - d)) - w) / (4 * n)
    var = n * (2 * q + d * (1 - d))
    num = only_a - only_b - n * d
    return num / math.sqrt(var) if var > 0 else math.copysign(math.inf, num) if num else 0.0


def tost_paired(a, b, margin: float = 0.05, alpha: float = 0.05) -> dict:
    """Two one-sided tests (TOST) of equivalence for the difference of two paired proportions
    (accuracy of arm ``a`` minus arm ``b`` on the same items): H0 is |difference| >= ``margin``.

    Decided by interval inclusion: both one-sided tests reject at level ``alpha`` exactly when the
    (1 - 2 alpha) interval of the difference lies inside (-margin, margin); the interval is
    :func:`paired_difference_ci` (Tango's score interval for paired proportions), so the default is
    a 90% interval for a 5% test. Returns :func:`paired_difference_ci`'s keys plus
    ``equivalence_margin``, ``alpha``, ``confidence`` and ``equivalent`` (False without pairs)."""
    if not 0 < margin < 1:
        raise ValueError(f"margin must be in (0, 1), got {margin}")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    out = paired_difference_ci(a, b, 1 - 2 * alpha)
    equivalent = bool(out["n"]) and -margin < out["lo"] and out["hi"] < margin
    return {**out, "equivalence_margin": margin, "alpha": alpha, "confidence": 1 - 2 * alpha, "equivalent": equivalent}
