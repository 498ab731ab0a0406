"""How far a run's answers move between two precisions: two `kvprobe run` folders of one model and
one dataset (e.g. --dtype float32 and --dtype bfloat16), compared on the cases valid in both.

    python scripts/dtype_compare.py results/run84 results/run84-bf16

Prints, per edit strategy (no CoT, decision cases valid in both runs and rows both hold), the agreement with the
oracle and the mean recovery in each folder and their difference; the locality probe's recovery
by patch set; K* from each topk.yaml; the validity counts; and each stage's wall time with the
speed ratio.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import yaml


def load(folder: Path) -> dict:
    manifest = json.loads((folder / "manifest.json").read_text())
    topk = yaml.safe_load((folder / "topk.yaml").read_text()) if (folder / "topk.yaml").exists() else {}
    return {"manifest": manifest, "topk": topk or {},
            "validity": pd.read_parquet(folder / "validity.parquet"),
            "edits": pd.read_parquet(folder / "edits.parquet"),
            "locality": pd.read_parquet(folder / "locality.parquet") if (folder / "locality.parquet").exists()
            else pd.DataFrame()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    args = ap.parse_args()
    A, B = load(args.a), load(args.b)
    dt = [r["manifest"]["model_info"]["dtype"] for r in (A, B)]
    valid = [set(r["validity"][r["validity"].valid & ~r["validity"].control].case_id) for r in (A, B)]
    common = valid[0] & valid[1]
    print(f"{args.a} ({dt[0]}): {len(valid[0])} valid decision cases; {args.b} ({dt[1]}): {len(valid[1])}; "
          f"valid in both: {len(common)}")
    va, vb = (r["validity"].set_index("case_id") for r in (A, B))
    both = va.index.intersection(vb.index)
    changed = (va.loc[both, ["pred_old", "pred_new"]] != vb.loc[both, ["pred_old", "pred_new"]]).any(axis=1)
    print(f"validity: decisions that differ between the two, of {len(both)} cases: {int(changed.sum())}; "
          f"largest |m_old| change {float((va.loc[both].m_old - vb.loc[both].m_old).abs().max()):.3f}, "
          f"|m_new| {float((va.loc[both].m_new - vb.loc[both].m_new).abs().max()):.3f}")

    def edits(r):
        e = r["edits"]
        return e[(e.cot == 0) & ~e.control & e.case_id.isin(common) & e.error.isna()]

    ea, eb = edits(A), edits(B)
    keys = ea[["case_id", "strategy"]].merge(eb[["case_id", "strategy"]])  # rows both runs have (the K sweep's
    ea, eb = (e.merge(keys) for e in (ea, eb))  # held-out cases depend on the valid set)
    print(f"\n{'strategy':<24} {'n':>3} {dt[0] + ' agree':>15} {dt[1] + ' agree':>15} {'diff':>6} "
          f"{dt[0] + ' recovery':>18} {dt[1] + ' recovery':>18} {'diff':>6}")
    worst = {"agree": (0.0, ""), "recovery": (0.0, "")}
    for s in ea.strategy.unique():
        x, y = ea[ea.strategy == s], eb[eb.strategy == s]
        if not len(x) or not len(y):
            continue
        ag = (float(x.agree.mean()), float(y.agree.mean()))
        rc = (float(x.recovery.mean()), float(y.recovery.mean()))
        for key, pair in (("agree", ag), ("recovery", rc)):
            if abs(pair[1] - pair[0]) > worst[key][0]:
                worst[key] = (abs(pair[1] - pair[0]), s)
        print(f"{s:<24} {len(x):>3} {ag[0]:>15.3f} {ag[1]:>15.3f} {ag[1] - ag[0]:>+6.3f} "
              f"{rc[0]:>18.3f} {rc[1]:>18.3f} {rc[1] - rc[0]:>+6.3f}")
    merged = ea.merge(eb, on=["case_id", "strategy"], suffixes=("_a", "_b"))
    flips = int((merged.pred_a != merged.pred_b).sum())
    print(f"\nlargest change: agreement {worst['agree'][0]:.3f} ({worst['agree'][1]}), mean recovery "
          f"{worst['recovery'][0]:.3f} ({worst['recovery'][1]}); per-row decisions that differ: {flips} of "
          f"{len(merged)}; largest |m| change {float((merged.m_a - merged.m_b).abs().max()):.3f} logits")

    la, lb = A["locality"], B["locality"]
    if len(la) and len(lb):
        def rec(df):
            r = df[(df.metric == "recovery") & df.case_id.isin(common) & df.layer.isna() & ~df.control
                   & (df.oracle_flip.abs() >= 1.0)]
            return r.groupby("set").value.mean()
        ra, rb = rec(la), rec(lb)
        d = (rb - ra).dropna()
        print(f"locality recovery by patch set (flip >= 1): largest change {float(d.abs().max()):.3f} "
              f"({d.abs().idxmax()}); field {ra.get('field', float('nan')):.3f} -> {rb.get('field', float('nan')):.3f}")
    ks = [(r["topk"].get("k_star"), r["topk"].get("k_star_status"), r["topk"].get("k_candidate")) for r in (A, B)]
    print("K*: " + " -> ".join(f"{k} ({status}{f', candidate K={c}' if c else ''})" for k, status, c in ks))
    wa, wb = (r["manifest"]["wall_s"] for r in (A, B))
    print("\nwall time by stage: " + ", ".join(f"{k} {wa[k]:.0f} s -> {wb[k]:.0f} s ({wa[k] / wb[k]:.1f}x)"
                                               for k in wa if k in wb and wb[k] > 0))


if __name__ == "__main__":
    main()
