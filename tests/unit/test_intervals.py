"""kvprobe.intervals: the one home of the binomial interval (issue 51), equal to scipy's to the last bit,
and the only one: no other module of kvprobe, its scripts or its benchmarks computes a Wilson interval."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from scipy.stats import binomtest

from kvprobe import intervals
from kvprobe.intervals import proportion_ci, wilson, wilson_share

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("confidence", [0.95, 0.9])
def test_wilson_is_scipys_interval_bit_for_bit(confidence):
    """Every k of every n <= 300. scipy's public path (binomtest(k, n).proportion_ci) also computes the test's
    p-value, 0.4 ms a call (40 s of the suite for both levels), so the 45,450 pairs are compared with the
    function it calls for the interval, and that function with the public path on every 37th pair."""
    from scipy.stats._binomtest import _binom_wilson_conf_int

    for i, (n, k) in enumerate((n, k) for n in range(1, 301) for k in range(n + 1)):
        low, high = _binom_wilson_conf_int(k, n, confidence, "two-sided", False)
        assert wilson(k, n, confidence) == (float(low), float(high)), (k, n)
        if i % 37 == 0:
            ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
            assert (float(ci.low), float(ci.high)) == (float(low), float(high)), (k, n)


def test_the_edges_and_what_is_refused():
    none = (wilson(0, 0) + wilson_share(0.5, 0) + wilson_share(float("nan"), 9) + wilson_share(None, 9)
            + proportion_ci(0, 0))
    assert len(none) == 10 and all(math.isnan(x) for x in none)
    assert wilson(0, 7)[0] == 0.0 and wilson(7, 7)[1] == 1.0
    lo, hi = wilson(15, 15)
    assert (round(lo, 2), hi) == (0.80, 1.0)  # 15 of 15 is not certain
    assert wilson_share(2 / 3, 3) == wilson(2, 3)  # a stored share: share * n successes, rounded
    assert proportion_ci(15, 15, method="exact")[0] == pytest.approx(0.7820, abs=1e-4)  # Clopper-Pearson
    with pytest.raises(ValueError, match="accepted: wilson, exact"):
        proportion_ci(1, 2, method="bootstrap")
    with pytest.raises(ValueError, match=r"successes must be in \[0, n\]"):
        wilson(3, 2)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        wilson(1, 2, confidence=1.5)


def test_the_default_level_loads_no_scipy():
    """kvprobe.policy reads the repair rule, which reads this module: at 95% nothing past the standard library."""
    code = ("import sys; import kvprobe.intervals as i; i.wilson(3, 4); i.wilson_share(0.5, 8); "
            "print(sorted(m for m in ('scipy', 'numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_other_home_computes_a_wilson_interval():
    """The Wilson formula (a square root of p(1-p)/n or 4np(1-p)) and scipy's binomtest appear in
    kvprobe.intervals only, among src, scripts and benchmarks."""
    formula = re.compile(r"binomtest|sqrt\([^)]*\bp\s*\*\s*\(1\s*-\s*p\)|\bwilson_ci\b|Z95\s*=")
    homes = sorted(str(p.relative_to(ROOT)) for folder in ("src", "scripts", "benchmarks")
                   for p in (ROOT / folder).rglob("*.py") if formula.search(p.read_text()))
    assert homes == ["src/kvprobe/intervals.py"], homes
    assert intervals.Z95 == float(__import__("scipy.special", fromlist=["ndtri"]).ndtri(0.975))


def test_one_gate_rule_the_lower_bound_at_or_above_the_threshold():
    """repair_rule.clears is the gate of every verdict on a share: a repair's leg, validate's composition gate, the
    report's headline, K*, calibrate's sequences. At the threshold it clears; a missing or NaN bound never does."""
    from kvprobe.repair_rule import Leg, cases_to_establish, clears
    from kvprobe.stopping.sequence import Sequence

    assert clears(0.95, 0.95) and not clears(0.9499, 0.95) and not clears(float("nan"), 0.5) and not clears(None, 0.5)
    n = cases_to_establish(0.95)
    assert clears(wilson(n, n)[0], 0.95) and not clears(wilson(n - 1, n - 1)[0], 0.95)
    assert Leg(n, n).status(0.95) == "established" and Leg(n - 1, n - 1).status(0.95) == "open"
    seq = Sequence(0.95)
    k = next(k for k in range(1, 2000) if clears(seq.lower(k, k), 0.95))
    assert seq.verdict(k, k) == "established" and seq.verdict(k - 1, k - 1) == "open"
