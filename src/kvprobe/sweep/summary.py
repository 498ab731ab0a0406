"""A sweep's rows summarised per cell, and the verdict each cell and each layout gets.

Per cell and measure, over the cell's valid decision cases: agreement with the oracle (with a
Wilson 95% interval, since it is a proportion) and recovery (with a percentile-bootstrap 95%
interval over the cases whose oracle flip is at least ``min_flip``).

The verdict reads the field-only patch (the new K/V at the field, every downstream entry stale):

- **takes notes**: the upper end of its recovery CI is below :data:`NOTES_BELOW`: most of the
  decision is read from the downstream notes, as the paper says;
- **reads the field**: the lower end is above :data:`FIELD_ABOVE`: the decision token reads the
  field's own K/V;
- **mixed**: the CI lies between, or straddles either threshold;
- **inconclusive**: under :data:`MIN_CASES` cases with a recovery, or no CI.

A layout's verdict is its cells' common verdict, "mixed" when its lengths disagree.
"""

from __future__ import annotations

import math

import pandas as pd

from kvprobe.intervals import wilson_share
from kvprobe.metrics import mean_ci

NOTES_BELOW = 1 / 3
FIELD_ABOVE = 2 / 3
MIN_CASES = 10
VERDICTS = ("takes notes", "reads the field", "mixed", "inconclusive")
RULE = (f"Verdict from the field-only patch recovery's 95% CI: 'takes notes' when its upper end is below "
        f"{NOTES_BELOW:.2f}, 'reads the field' when its lower end is above {FIELD_ABOVE:.2f}, 'mixed' otherwise; "
        f"'inconclusive' under {MIN_CASES} valid cases with an oracle flip of at least the minimum, or no CI. "
        f"A layout's verdict is its cells' common verdict, 'mixed' when they disagree.")
CELL_KEYS = ["cell", "layout", "filler_tokens", "field_style", "rule_style"]


def summarize(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per cell x (measure, name): case counts, agreement and recovery with 95% CIs."""
    out = []
    for keys, cell in rows.groupby(CELL_KEYS, sort=False):
        cases = cell.drop_duplicates("case_id")
        decision = cases[~cases.control]
        valid = cell[cell.valid & ~cell.control]
        base = dict(zip(CELL_KEYS, keys))
        base |= {"n_cases": len(cases), "n_decision": len(decision), "n_valid": int(decision.valid.sum()),
                 "validity": float(decision.valid.mean()) if len(decision) else float("nan"),
                 "n_valid_controls": int((cases.control & cases.valid).sum()),
                 "downstream_tokens": float(valid.drop_duplicates("case_id").downstream_tokens.mean())
                 if len(valid) else float(decision.downstream_tokens.mean()),
                 "n_tokens": float(decision.n_tokens.mean()), "case_s": float(cases.case_s.mean())}
        for (measure, name), group in valid.groupby(["measure", "name"], sort=False):
            ok = group[group.error.isna()] if "error" in group else group
            p_agree = float(ok.agree.mean()) if len(ok) else float("nan")
            agree_lo, agree_hi = wilson_share(p_agree, len(ok))
            rec_mean, rec_lo, rec_hi, rec_n = mean_ci(ok.recovery.dropna().to_numpy())
            out.append(base | {"measure": measure, "name": name, "agree": p_agree, "agree_lo": agree_lo,
                               "agree_hi": agree_hi, "n_agree": len(ok), "recovery": rec_mean,
                               "recovery_lo": rec_lo, "recovery_hi": rec_hi, "n_recovery": rec_n,
                               "frac_recomputed": float(ok.frac_recomputed.mean()) if len(ok) else float("nan"),
                               "n_errors": len(group) - len(ok)})
        if not len(valid):
            out.append(base | {"measure": "patch", "name": "field", "n_agree": 0, "n_recovery": 0})
    return pd.DataFrame(out)


def verdict(lo: float, hi: float, n: int) -> str:
    """The verdict of one field-only recovery CI over ``n`` cases (see the module docstring)."""
    if n < MIN_CASES or not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    if hi < NOTES_BELOW:
        return "takes notes"
    if lo > FIELD_ABOVE:
        return "reads the field"
    return "mixed"


def cell_verdicts(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per cell with the field-only recovery and its verdict."""
    field = summary[(summary.measure == "patch") & (summary.name == "field")]
    out = field[CELL_KEYS + ["n_valid", "recovery", "recovery_lo", "recovery_hi", "n_recovery"]].copy()
    out["verdict"] = [verdict(lo, hi, int(n or 0))
                      for lo, hi, n in zip(out.recovery_lo, out.recovery_hi, out.n_recovery)]
    return out.reset_index(drop=True)


def layout_verdicts(cells: pd.DataFrame) -> dict[str, str]:
    """layout -> its cells' common verdict; "mixed" when conclusive cells disagree, "inconclusive"
    when none is conclusive."""
    out = {}
    for layout, group in cells.groupby("layout", sort=False):
        conclusive = set(group.verdict) - {"inconclusive"}
        out[layout] = conclusive.pop() if len(conclusive) == 1 else ("mixed" if conclusive else "inconclusive")
    return out
