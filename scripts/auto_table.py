"""auto against every fixed strategy, from `kvprobe sweep` folders: the tables of docs/auto.md.

    python scripts/auto_table.py results/auto/qwen2.5-1.5b [more sweep folders]
    python scripts/auto_table.py --compact results/auto/toy-*     # one line per folder

Per folder (one model), over the valid cases of every cell, no chain-of-thought: each strategy's
agreement with the oracle on decision cases (95% Wilson CI), its invariance on negative controls
(controls whose answer it keeps, as the oracle does), the mean recomputed share and the mean time
to the decision (the repair plus reading the decision; measured only with `kvprobe sweep
--time-all`), and where it sits against the fixed strategies' cost-agreement frontier (cost =
recomputed share). Then what each auto variant chose, and the issue's test: auto's agreement
within 0.02 of the best fixed strategy's, with control invariance at least that strategy's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from kvprobe.intervals import wilson_share

REFERENCE = ("stale", "oracle")  # the two ends: neither is a repair to choose


def strategy_rows(folder: Path) -> pd.DataFrame:
    d = pd.read_parquet(folder / "sweep.parquet")
    return d[(d.measure == "strategy") & d.valid & d.error.isna()]


def table(rows: pd.DataFrame) -> pd.DataFrame:
    out = []
    for name, g in rows.groupby("name", sort=False):
        dec, ctl = g[~g.control], g[g.control]
        k, n = int(dec.agree.sum()), len(dec)
        lo, hi = wilson_share(k / n if n else float("nan"), n)
        out.append({"strategy": name, "n": n, "agreement": k / n if n else float("nan"), "lo": lo, "hi": hi,
                    "controls_kept": int(ctl.agree.sum()), "n_controls": len(ctl),
                    "invariance": ctl.agree.mean() if len(ctl) else float("nan"),
                    "recomputed": g.frac_recomputed.mean(), "to_decision_s": g.wall_s.mean()})
    t = pd.DataFrame(out)
    fixed = t[~t.strategy.str.startswith("auto")]
    t["frontier"] = [_dominated_by(r, fixed) for r in t.itertuples()]
    return t


def _dominated_by(r, fixed: pd.DataFrame) -> str:
    better = fixed[(fixed.strategy != r.strategy) & (fixed.recomputed <= r.recomputed) & (fixed.agreement >= r.agreement)
                   & ((fixed.recomputed < r.recomputed) | (fixed.agreement > r.agreement))]
    return "on" if better.empty else "below: " + ", ".join(better.strategy)


def verdict(t: pd.DataFrame) -> list[str]:
    fixed = t[~t.strategy.str.startswith("auto") & ~t.strategy.isin(REFERENCE)]
    best = fixed.sort_values(["agreement", "recomputed"], ascending=[False, True]).iloc[0]
    lines = [f"best fixed repair: {best.strategy} (agreement {best.agreement:.3f}, controls "
             f"{best.controls_kept}/{best.n_controls}, recomputed {best.recomputed:.3f})"]
    for r in t[t.strategy.str.startswith("auto")].itertuples():
        within = r.agreement >= best.agreement - 0.02
        kept = (r.n_controls == 0 or best.n_controls == 0) or r.invariance >= best.invariance
        lines.append(f"{r.strategy}: agreement {r.agreement:.3f} ({r.agreement - best.agreement:+.3f} vs best: "
                     f"{'within' if within else 'NOT within'} 0.02), controls {r.controls_kept}/{r.n_controls} "
                     f"({'at least' if kept else 'BELOW'} the best's), recomputed {r.recomputed:.3f} vs "
                     f"{best.recomputed:.3f}, frontier: {r.frontier}")
    return lines


def choices(rows: pd.DataFrame) -> list[str]:
    auto = rows[rows.name.str.startswith("auto")]
    out = []
    for name, g in auto.groupby("name", sort=False):
        counts = g.groupby(["control", "chose"]).size()
        parts = [f"{'controls' if c else 'decisions'} -> {chose}: {n}" for (c, chose), n in counts.items()]
        agree = g.groupby(["control", "chose"]).agree.mean()
        out.append(f"{name} chose: " + "; ".join(parts) + " | agreement by choice: "
                   + ", ".join(f"{'controls' if c else 'decisions'} {k} {v:.3f}" for (c, k), v in agree.items()))
    return out


def markdown(t: pd.DataFrame) -> str:
    lines = ["| strategy | agreement [95% CI] (n) | controls kept | recomputed | to decision (s) | frontier |",
             "|---|---|---|---|---|---|"]
    for r in t.itertuples():
        secs = "-" if pd.isna(r.to_decision_s) else f"{r.to_decision_s:.2f}"
        lines.append(f"| {r.strategy} | {r.agreement:.3f} [{r.lo:.2f}, {r.hi:.2f}] ({r.n}) | "
                     f"{r.controls_kept}/{r.n_controls} | {r.recomputed:.3f} | {secs} | {r.frontier} |")
    return "\n".join(lines)


def compact(folders: list[str]) -> None:
    """One line per folder: field_only, erratum_turn, the best fixed repair and the auto variants,
    each as agreement, controls kept and recomputed share, auto with its frontier position."""
    print("| model | field_only | erratum_turn | best fixed (not oracle) | auto | auto with its design policy |")
    print("|---|---|---|---|---|---|")
    for folder in map(Path, folders):
        t = table(strategy_rows(folder)).set_index("strategy")
        cell = lambda r: f"{r.agreement:.3f}, {r.controls_kept}/{r.n_controls}, {r.recomputed:.3f}"  # noqa: E731
        fixed = t[~t.index.str.startswith("auto") & ~t.index.isin(REFERENCE)]
        best = fixed.sort_values(["agreement", "recomputed"], ascending=[False, True])
        autos = [cell(t.loc[name]) + f" ({t.loc[name].frontier})" for name in t.index if name.startswith("auto")]
        print(f"| {folder.name} | {cell(t.loc['field_only'])} | {cell(t.loc['erratum_turn'])} | "
              f"{best.index[0]}: {cell(best.iloc[0])} | " + " | ".join(autos) + " |")


def main(folders: list[str]) -> None:
    if folders and folders[0] == "--compact":
        return compact(folders[1:])
    for folder in map(Path, folders):
        rows = strategy_rows(folder)
        t = table(rows)
        cells = ", ".join(sorted(rows.cell.unique()))
        print(f"\n### {folder.name} ({cells}; {rows[~rows.control].case_id.nunique()} valid decision cases, "
              f"{rows[rows.control].case_id.nunique()} valid controls)\n")
        print(markdown(t))
        print()
        for line in verdict(t) + choices(rows):
            print(f"- {line}")


if __name__ == "__main__":
    main(sys.argv[1:])
