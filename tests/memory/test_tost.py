"""TOST for a paired accuracy difference (kvprobe.metrics.tost_paired, Tango's score interval), on
cases worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from kvprobe.metrics import paired_difference_ci, tost_paired

Z90 = norm.ppf(0.95)  # a 90% two-sided interval: the TOST at alpha = 0.05


def pairs(both: int, only_a: int, only_b: int, neither: int) -> tuple[list[int], list[int]]:
    a = [1] * both + [1] * only_a + [0] * only_b + [0] * neither
    b = [1] * both + [0] * only_a + [1] * only_b + [0] * neither
    return a, b


def test_no_discordant_pair_in_100_is_equivalent_at_005():
    """Both arms right on all 100: no discordant pair, so at d > 0 the restricted q is 0 and
    Z(d) = -n d / sqrt(n d (1 - d)); |Z| = z at d = z^2 / (n + z^2) = 1 - 100 / (100 + z^2) = 0.0263."""
    out = tost_paired(*pairs(100, 0, 0, 0), margin=0.05)
    half = 1 - 100 / (100 + Z90**2)
    assert out["diff"] == 0 and math.isclose(out["hi"], half, rel_tol=1e-9) and math.isclose(out["lo"], -half)
    assert round(half, 4) == 0.0263 and out["equivalent"] and out["n"] == 100


def test_no_discordant_pair_in_10_is_not_equivalent():
    """The same agreement on 10 questions: +-(1 - 10 / (10 + z^2)) = +-0.213, wider than the margin."""
    out = tost_paired(*pairs(10, 0, 0, 0), margin=0.05)
    assert math.isclose(out["hi"], 1 - 10 / (10 + Z90**2), rel_tol=1e-9) and not out["equivalent"]


def test_no_discordant_pair_at_mid_accuracy_is_as_wide_as_at_full_accuracy():
    """11 right and 7 wrong on both arms (18 pairs, none discordant): the interval depends on the
    discordant pairs only, +-z^2 / (18 + z^2) = +-0.131, so no equivalence at 0.05. (Newcombe's method
    10, the first version of this function, gave +-0.03 here and called it equivalent.)"""
    out = tost_paired(*pairs(11, 0, 0, 7), margin=0.05)
    assert math.isclose(out["hi"], Z90**2 / (18 + Z90**2), rel_tol=1e-9) and math.isclose(out["lo"], -out["hi"])
    assert round(out["hi"], 3) == 0.131 and not out["equivalent"]


def test_the_bounds_solve_tangos_score_equation_worked_by_hand():
    """both 40, only a 3, only b 2, neither 5 (n 50): at each bound d, q is the root in [0, 1] of
    2n q^2 + (-3 - 2 + (100 - 3 + 2) d) q - 2 d (1 - d) = 0 and (3 - 2 - 50 d) / sqrt(50 (2q + d(1 - d)))
    is +z at the lower bound and -z at the upper."""
    out = paired_difference_ci(*pairs(40, 3, 2, 5), confidence=0.90)
    assert (out["only_a"], out["only_b"], out["n"], out["diff"]) == (3, 2, 50, 0.02)
    for d, want in ((out["lo"], Z90), (out["hi"], -Z90)):
        roots = np.roots([2 * 50, -5 + 99 * d, -2 * d * (1 - d)])
        q = max(r.real for r in roots if abs(r.imag) < 1e-12)
        assert math.isclose((1 - 50 * d) / math.sqrt(50 * (2 * q + d * (1 - d))), want, rel_tol=1e-6)
    assert out["lo"] < -0.05 < 0.05 < out["hi"]  # 5 discordant of 50: far from equivalent
    assert not tost_paired(*pairs(40, 3, 2, 5))["equivalent"]


def test_a_small_difference_on_many_questions_is_equivalent_and_close_to_wald():
    """n 2000, 30 vs 10 discordant: difference 0.01, Wald se = sqrt((b + c) / n^2 - (b - c)^2 / n^3)."""
    a, b = pairs(1500, 30, 10, 460)
    out = tost_paired(a, b, margin=0.05)
    se = math.sqrt(40 / 2000**2 - 20**2 / 2000**3)
    assert math.isclose(out["diff"], 0.01)
    assert abs(out["lo"] - (0.01 - Z90 * se)) < 1e-3 and abs(out["hi"] - (0.01 + Z90 * se)) < 1e-3
    assert out["equivalent"]
    assert not tost_paired(a, b, margin=0.01)["equivalent"]  # a tighter margin than the difference


def test_a_real_difference_is_not_equivalent_and_nans_are_dropped():
    a, b = pairs(0, 10, 0, 10)
    out = tost_paired(a + [float("nan")], b + [1])
    assert out["n"] == 20 and out["diff"] == 0.5 and out["lo"] > 0.05 and not out["equivalent"]
    empty = tost_paired([], [])
    assert empty["n"] == 0 and not empty["equivalent"] and math.isnan(empty["diff"])


@pytest.mark.parametrize("kwargs", [{"margin": 0}, {"margin": 1}, {"alpha": 0.5}, {"alpha": 0}])
def test_bad_margin_or_alpha_is_refused(kwargs):
    with pytest.raises(ValueError):
        tost_paired([1], [1], **kwargs)
