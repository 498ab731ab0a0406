"""Numbers as kvprobe's summary files store them: a float rounded (None where it is not finite), a
:class:`~kvprobe.reports.stats.Stat` as ``{value, lo, hi, n}``, and that dict as text. Shared by the summary's
facts (:mod:`kvprobe.reports.summary`, :mod:`kvprobe.reports.arms`) and ``kvprobe compare``."""

from __future__ import annotations

import math

from kvprobe.reports.stats import Stat

def num(x, digits: int = 4):
    """``x`` as a float rounded to ``digits``; None where it is not a finite number."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return round(x, digits) if math.isfinite(x) else None


def stat_dict(st: Stat | None) -> dict | None:
    """``{"value", "lo", "hi", "n"}`` (nulls where not measured); None for no Stat."""
    if st is None:
        return None
    return {"value": num(st.mean), "lo": num(st.lo), "hi": num(st.hi), "n": int(st.n)}


def stat_text(d: dict | None, digits: int = 2) -> str:
    """``0.98 [0.91, 1.00] n=60`` from a :func:`stat_dict` (``n/a`` where there is none)."""
    if not d or d.get("value") is None:
        return f"n/a (n={d['n']})" if d else "n/a"
    ci = f" [{d['lo']:.{digits}f}, {d['hi']:.{digits}f}]" if d.get("lo") is not None else " [no CI]"
    return f"{d['value']:.{digits}f}{ci} n={d['n']}"
