"""TOST for a paired accuracy difference (kvprobe.metrics.tost_paired), on cases worked by hand."""

from __future__ import annotations

import math

import pytest
from scipy.stats import norm

from kvprobe.metrics import paired_difference_ci, tost_paired

Z90 = norm.ppf(0.95)  # a 90% two-sided interval: the TOST at alpha = 0.05


def pairs(both: int, only_a: int, only_b: int, neither: int) -> tuple[list[int], list[int]]:
    a = [1] * both + [1] * only_a + [0] * only_b + [0] * neither
    b = [1] * both + [0] * only_a + [1] * only_b + [0] * neither
    return a, b


def wilson(k: int, n: int, z: float) -> tuple[float, float]:
    """The Wilson score interval, written out (not scipy's)."""
    p = k / n
    mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (mid - half) / (1 + z * z / n), (mid + half) / (1 + z * z / n)


def test_no_discordant_pair_in_100_is_equivalent_at_005():
    """Both arms right on all 100: p1 = p2 = 1, phi = 0 (a zero margin), so the interval is
    +-(1 - Wilson's lower bound of 100/100) = +-(1 - 100 / (100 + z^2)) = +-0.0263."""
    out = tost_paired(*pairs(100, 0, 0, 0), margin=0.05)
    half = 1 - 100 / (100 + Z90**2)
    assert out["diff"] == 0 and math.isclose(out["hi"], half, rel_tol=1e-9) and math.isclose(out["lo"], -half)
    assert round(half, 4) == 0.0263 and out["equivalent"] and out["n"] == 100


def test_no_discordant_pair_in_10_is_not_equivalent():
    """The same agreement on 10 questions: +-(1 - 10 / (10 + z^2)) = +-0.213, wider than the margin."""
    out = tost_paired(*pairs(10, 0, 0, 0), margin=0.05)
    assert math.isclose(out["hi"], 1 - 10 / (10 + Z90**2), rel_tol=1e-9) and not out["equivalent"]


def test_newcombe_interval_worked_out_by_hand():
    """both 40, only a 3, only b 2, neither 5 (n 50): p1 = 43/50, p2 = 42/50, phi from the 2x2 table,
    then dl and du from the two Wilson intervals (Newcombe 1998, method 10)."""
    n, z = 50, Z90
    p1, p2 = 43 / n, 42 / n
    (l1, u1), (l2, u2) = wilson(43, n, z), wilson(42, n, z)
    phi = (40 * 5 - 3 * 2) / math.sqrt(43 * 7 * 42 * 8)
    dl = math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    du = math.sqrt((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2)
    out = paired_difference_ci(*pairs(40, 3, 2, 5), confidence=0.90)
    assert (out["only_a"], out["only_b"], out["n"]) == (3, 2, 50)
    assert math.isclose(out["diff"], 0.02) and math.isclose(out["lo"], 0.02 - dl, abs_tol=1e-12)
    assert math.isclose(out["hi"], 0.02 + du, abs_tol=1e-12)
    assert not tost_paired(*pairs(40, 3, 2, 5))["equivalent"]  # the interval reaches past -0.05


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
