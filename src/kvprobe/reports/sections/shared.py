"""What several sections share: the decision rows of a table, the min-flip guard and its note, and
:func:`fmt` (also the template filter) for a number printed without a CI."""

from __future__ import annotations

import math

import pandas as pd

from kvprobe.reports.stats import nanfloat


def decision_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of decision cases (control cases left out)."""
    return df[~df["control"].astype(bool)] if "control" in df else df


def guard(df: pd.DataFrame, min_flip: float) -> tuple[pd.DataFrame, int, bool]:
    """Rows of cases whose |oracle_flip| >= min_flip; (rows, cases excluded, guarded). When no case
    passes, all rows come back with guarded False so the caller can say the values are unguarded."""
    if "oracle_flip" not in df or df.empty:
        return df, 0, True
    flips = df.groupby("case_id")["oracle_flip"].first().abs()
    keep = set(flips[flips >= min_flip].index)
    excluded = len(flips) - len(keep)
    if not keep:
        return df, excluded, False
    return df[df["case_id"].isin(keep)], excluded, True


def guard_note(excluded: int, guarded: bool, n_cases: int, min_flip: float) -> str | None:
    """What :func:`guard` did, in words for the page (None: every case passed)."""
    if not guarded:
        return (f"No case has an oracle flip of at least {min_flip:g} logits (all {n_cases} fall below the guard): "
                f"the values below are unguarded ratios of tiny differences and cannot be interpreted.")
    if excluded:
        return f"{excluded} case(s) with an oracle flip below {min_flip:g} logits are excluded."
    return None


def fmt(x, digits: int = 2) -> str:
    """``x`` with ``digits`` decimals, or "n/a" when it is missing or not finite."""
    x = nanfloat(x)
    return "n/a" if not math.isfinite(x) else f"{x:.{digits}f}"
