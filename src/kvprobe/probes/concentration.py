"""Suffix concentration: how few downstream positions carry the field's effect?

A pure function of the locality probe's single-position sweep (rows ``metric == "effect"``,
``set == "single"``: one row per cache position with its ``region``, token ``kind`` and the
change in m when only that position takes the new prompt's K/V). Per case, over |effect|:

- ``region_share``: the share of the total in each region (sink, prefix, field, downstream).
  Positions before the field hold identical K/V in both prompts, so sink and prefix should be 0;
- ``topk_share``: the share of the downstream total captured by the top-k downstream positions,
  for k = 1, 2, 4, ... up to the first power of two that covers the span (so it ends at 1);
  ``k50``/``k90``: the fewest top positions that capture half / 90% of it;
- ``kind_share`` and ``kind_mean_abs``: by token kind, the share of the total and the mean
  |effect| per token (logits); ``n_tokens`` says how many tokens of that kind there are.

A case whose total is 0 gets NaN shares. ``oracle_flip`` and ``control`` ride along so that
:func:`aggregate_concentration` can drop controls and small flips.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvprobe.datasets import KINDS
from kvprobe.metrics import DEFAULT_MIN_FLIP, mean_ci
from kvprobe.probes.base import rows, single_position_sweep

PROBE = "concentration"
SPAN_REGIONS = ("sink", "prefix", "field", "downstream")


def topk_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= n (at least [1])."""
    ks = [1]
    while ks[-1] < n:
        ks.append(ks[-1] * 2)
    return ks


def case_concentration(sweep: pd.DataFrame) -> list[dict]:
    """Records for one case's single-position sweep rows."""
    mag = sweep["value"].abs().to_numpy(float)
    total = mag.sum()
    share = (lambda x: x / total) if total > 0 else (lambda x: float("nan"))  # noqa: E731
    region = sweep["region"].to_numpy()
    kind = sweep["kind"].to_numpy()
    out = [{"region": r, "metric": "region_share", "value": float(share(mag[region == r].sum())),
            "n_tokens": int((region == r).sum())} for r in SPAN_REGIONS]
    down = np.sort(mag[region == "downstream"])[::-1]
    n_down, down_total = len(down), down.sum()
    if n_down:
        curve = np.cumsum(down) / down_total if down_total > 0 else np.full(n_down, np.nan)
        for k in topk_ks(n_down):
            out.append({"region": "downstream", "metric": "topk_share", "k": k,
                        "value": float(curve[min(k, n_down) - 1]), "n_tokens": n_down})
        for metric, q in (("k50", 0.5), ("k90", 0.9)):
            hit = np.nonzero(curve >= q - 1e-12)[0]
            out.append({"region": "downstream", "metric": metric, "n_tokens": n_down,
                        "value": float(hit[0] + 1) if len(hit) else float("nan")})
    for kd in KINDS:
        sel = kind == kd
        n = int(sel.sum())
        out.append({"kind": kd, "metric": "kind_share", "value": float(share(mag[sel].sum())), "n_tokens": n})
        out.append({"kind": kd, "metric": "kind_mean_abs", "n_tokens": n,
                    "value": float(mag[sel].mean()) if n else float("nan")})
    return out


def concentration(locality_df: pd.DataFrame) -> pd.DataFrame:
    """Tidy concentration rows (probe "concentration") from locality rows, one block per case."""
    sweep = single_position_sweep(locality_df)
    frames = []
    for (model, case_id), g in sweep.groupby(["model", "case_id"], sort=False, dropna=False):
        df = rows(model, case_id, PROBE, case_concentration(g.sort_values("position")))
        for col in ("oracle_flip", "control"):
            df[col] = g[col].iloc[0] if col in g else None
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def aggregate_concentration(df: pd.DataFrame, min_flip: float = DEFAULT_MIN_FLIP, controls: bool = False
                            ) -> pd.DataFrame:
    """Per model and (metric, region, kind, k): mean with a bootstrap 95% CI over cases.

    Controls are dropped unless ``controls``; cases with |oracle_flip| < ``min_flip`` are dropped
    (their effects are noise) and counted in ``n_excluded_small_flip``. A case's top-k curve is 1
    past the end of its downstream span, and is filled so before averaging over cases.
    """
    df = df.copy()
    if not controls and "control" in df:
        df = df[~df["control"].astype(bool)]
    small = df["oracle_flip"].abs() < min_flip if "oracle_flip" in df else pd.Series(False, index=df.index)
    n_small = df[small].groupby("model")["case_id"].nunique()
    df = df[~small]
    # fill each case's top-k curve with 1 for ks past its span, up to the largest k of its model
    topk = df[df["metric"] == "topk_share"]
    fill = []
    for model, g in topk.groupby("model", sort=False):
        ks = sorted(g["k"].dropna().unique())
        for case_id, c in g.groupby("case_id", sort=False):
            have = set(c["k"])
            last = c.sort_values("k").iloc[-1]
            fill += [{**last.to_dict(), "k": k, "value": 1.0 if last["value"] == last["value"] else np.nan}
                     for k in ks if k not in have]
    if fill:
        df = pd.concat([df, pd.DataFrame(fill)], ignore_index=True)
    out = []
    keys = ["model", "metric", "region", "kind", "k"]
    columns = keys + ["mean", "lo", "hi", "n", "n_excluded_small_flip"]
    for key, g in df.groupby(keys, sort=False, dropna=False):
        mean, lo, hi, n = mean_ci(g["value"].astype(float))
        out.append({**dict(zip(keys, key)), "mean": mean, "lo": lo, "hi": hi, "n": n,
                    "n_excluded_small_flip": int(n_small.get(key[0], 0))})
    return pd.DataFrame(out, columns=columns)
