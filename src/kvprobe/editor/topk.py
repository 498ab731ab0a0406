"""The per-model policy file ``topk.yaml`` (:data:`~kvprobe.policy.TOPK_FILE`), written for serving:
K*, the ranking rule, the erratum template, and the evidence per strategy (``strategies``).
:mod:`kvprobe.policy` reads it back as a :class:`~kvprobe.policy.Policy`.

K* is the smallest K at which ``selective(K, causal)`` agrees with the oracle on held-out cases
(cases not used to learn the ranking) with the lower end of its Wilson 95% interval at or above
``threshold``. The sweep starts at K = 0 (the field alone, ``field_only`` on the same cases).
``k_star_status`` says how it stands:

- ``established``: ``k_star`` is that K, with its agreement, interval and ``n_cases``;
- ``not established``: some K reaches the threshold on its point estimate but no lower bound
  does (too few held-out cases: 15 of 15 gives [0.80, 1.00]); ``k_star`` is null, ``k_candidate``
  the smallest such K with its agreement, interval and ``n_cases``, and ``reason`` how many
  agreeing cases would establish it;
- ``not reached``: no K up to the downstream length reaches the threshold even on its point
  estimate; ``no ranking``: no causal ranking was learned (or, from a sweep, none is measured).

A ``kvprobe sweep`` folder exports too: its file has the model fingerprint, the strategies
section (every valid case of every cell) and ``k_star: null``, since a sweep learns no ranking.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pandas as pd
import yaml

from kvprobe.defaults import DEFAULT_THRESHOLD
from kvprobe.editor.strategies import Erratum, parse_strategy
from kvprobe.errors import KvprobeError
from kvprobe.intervals import wilson_share
from kvprobe.metrics import mean_ci, proportion
from kvprobe.policy import SCHEMA_VERSION, TOPK_FILE, Evidence, candidate
from kvprobe.repair_rule import cases_at_rate, cases_to_establish, cheapest_on, clears, is_repair
from kvprobe.stopping.rule import check_threshold
from kvprobe.results import (
    EDITS,
    RUN_MANIFEST,
    RANKING_RULE,
    RUN_MANIFEST_KEYS,
    SWEEP,
    SWEEP_CLAIM,
    SWEEP_MANIFEST,
    atomic_write,
    json_object,
    read_table,
)

__all__ = ["SCHEMA_VERSION", "TOPK_FILE", "cases_to_establish", "export_topk", "held_out_decisions", "k_star_fields",
           "k_star_for", "k_sweep", "kinds_of_top", "strategy_evidence", "topk_config", "write_topk"]
NO_RANKING = "a sweep measures no causal ranking"


def k_sweep(edits: pd.DataFrame, ranking: str = "causal") -> pd.DataFrame:
    """Agreement with the oracle per K for ``selective:K:<ranking>`` (no CoT), from K = 0: the
    ``field_only`` rows of the same cases. Agreement has a Wilson 95% interval, recovery a bootstrap one."""
    no_cot = edits[edits.cot == 0]
    sel = no_cot[no_cot.strategy.str.startswith("selective:") & (no_cot.ranking == ranking)]
    groups = [(int(k), g) for k, g in sel.groupby("k")]
    field = no_cot[(no_cot.strategy == "field_only") & no_cot.case_id.isin(set(sel.case_id))]
    if groups and len(field):
        groups.insert(0, (0, field))
    rows = []
    for k, g in groups:
        mean, lo, hi, n = proportion(g.agree.astype(float))
        rec = mean_ci(g.recovery)
        rows.append({"k": k, "agreement": mean, "agreement_lo": lo, "agreement_hi": hi, "n": n,
                     "recovery": rec[0], "recovery_lo": rec[1], "recovery_hi": rec[2],
                     "frac_recomputed": float(g.frac_recomputed.mean())})
    return pd.DataFrame(rows).sort_values("k") if rows else pd.DataFrame(rows)


def held_out_decisions(edits: pd.DataFrame, held_out_cases) -> pd.DataFrame:
    """The rows K* is judged on: valid decision cases among ``held_out_cases`` (not used to learn the ranking)."""
    return edits[edits.case_id.isin(set(held_out_cases)) & edits.valid.astype(bool) & ~edits.control.astype(bool)]


def k_star_for(sweep: pd.DataFrame, rule: dict, threshold: float, max_downstream: int) -> dict:
    """:func:`k_star_fields` of the held-out ``sweep``, or ``no ranking`` when the causal ``rule`` (as
    ranking_rule.json stores it) learned from no case."""
    if not rule.get("n_training_cases"):
        return {"k_star": None, "k_star_status": "no ranking",
                "reason": rule.get("note") or "the causal ranking rule has no training cases"}
    return k_star_fields(sweep, threshold, max_downstream)


def k_star_fields(sweep: pd.DataFrame, threshold: float, max_downstream: int) -> dict:
    """``k_star``, ``k_star_status`` and the evidence behind them (see the module docstring)."""
    def evidence(row) -> dict:
        return {"agreement": round(float(row.agreement), 4),
                "agreement_ci95": [round(float(row.agreement_lo), 4), round(float(row.agreement_hi), 4)],
                "n_cases": int(row.n)}

    if not len(sweep):
        return {"k_star": None, "k_star_status": "not reached", "reason": "no selective:K:causal results on "
                                                                          "held-out cases"}
    established = sweep[[clears(lo, threshold) for lo in sweep.agreement_lo]]
    if len(established):
        return {"k_star": int(established.iloc[0].k), "k_star_status": "established", **evidence(established.iloc[0])}
    reached = sweep[sweep.agreement >= threshold]
    if len(reached):
        best = reached.iloc[0]
        need = cases_to_establish(threshold)
        at_rate = cases_at_rate(float(best.agreement), threshold) if best.agreement < 1 else None
        more = ("no sample size would do" if not need else
                f"about {need} held-out cases, all agreeing, would be needed" if best.agreement >= 1 else
                f"at its observed rate about {at_rate} held-out cases would be needed" if at_rate else
                f"its observed rate is too close to the threshold for any practical sample")
        return {"k_star": None, "k_star_status": "not established", "k_candidate": int(best.k), **evidence(best),
                "reason": (f"K={int(best.k)}{' (the field alone)' if best.k == 0 else ''} agrees "
                           f"{best.agreement:.2f} [{best.agreement_lo:.2f}, "
                           f"{best.agreement_hi:.2f}] on n={int(best.n)} held-out cases: its 95% lower bound is "
                           f"below the threshold {threshold:g} ({more})")}
    return {"k_star": None, "k_star_status": "not reached",
            "reason": (f"no K up to {int(sweep.k.max())} (downstream length up to {max_downstream}) reached agreement "
                       f">= {threshold:g} with the oracle; the best, K={int(sweep.loc[sweep.agreement.idxmax()].k)}, "
                       f"agrees {sweep.agreement.max():.2f}")}


def _num(value, digits: int) -> float | None:
    """A rounded float for the YAML; None for NaN (not measured)."""
    return None if value is None or pd.isna(value) else round(float(value), digits)


def strategy_evidence(rows: pd.DataFrame, label: str = "strategy") -> list[dict]:
    """The ``strategies`` section: one entry per strategy label (column ``label``) in ``rows``, in the
    order they first appear, over the valid cases (pass no chain-of-thought rows).

    ``agreement`` (with its Wilson 95% CI) and ``n`` are over the decision cases, ``control_invariance``
    and ``n_controls`` over the controls (the oracle keeps the old answer there, so agreeing is keeping
    it; None without controls); ``frac_recomputed``, ``wall_s`` and, where the table has it,
    ``decide_s`` are means over both. A row the strategy could not repair (no ``agree``: an error
    row) counts in ``n_errors`` only.
    """
    out = []
    rows = rows[rows.valid.astype(bool)]
    for spec, g in rows.groupby(label, sort=False):
        ran = g[g.agree.notna()]
        agree = ran.agree.astype(float)
        control = ran.control.astype(bool)
        decision, controls = agree[~control], agree[control]
        n = len(decision)
        p = float(decision.mean()) if n else None
        entry = {"spec": str(spec), "agreement": _num(p, 4),
                 "agreement_ci95": [_num(x, 4) for x in wilson_share(p, n)] if n else None, "n": n,
                 "control_invariance": _num(controls.mean(), 4) if len(controls) else None,
                 "n_controls": len(controls), "frac_recomputed": _num(ran.frac_recomputed.mean(), 4),
                 "wall_s": _num(ran["wall_s"].mean(), 6) if "wall_s" in ran else None}
        if "decide_s" in ran:
            entry["decide_s"] = _num(ran["decide_s"].mean(), 6)
        entry["n_errors"] = len(g) - len(ran)
        out.append(entry)
    return out


def topk_config(edits: pd.DataFrame, fingerprint: dict, rule: dict, kinds_at_top: dict, max_downstream: int,
                erratum_template: str, threshold: float = DEFAULT_THRESHOLD, n_layers: int | None = None,
                strategies: list[dict] | None = None) -> dict:
    """The YAML-ready configuration (see module docstring); ``strategies`` is :func:`strategy_evidence`'s."""
    sweep = k_sweep(edits)
    if isinstance(rule.get("scores"), dict):  # best first (JSON storage sorts keys alphabetically)
        rule = {**rule, "scores": dict(sorted(rule["scores"].items(), key=lambda kv: -kv[1]))}
    cfg = {"schema_version": SCHEMA_VERSION, "model": fingerprint, "threshold": threshold,
           "judged_on": "held-out valid decision cases, not used to learn the ranking; no chain-of-thought",
           "ranking_rule": rule, "recompute": {"positions": "field span + top-K downstream by the ranking rule",
                                                "layers": "all" if n_layers is None else f"all {n_layers}"},
           "token_kinds_at_top": kinds_at_top, "erratum_template": erratum_template,
           "k_sweep": sweep.round(4).to_dict("records")}
    cfg.update(k_star_for(sweep, rule, threshold, max_downstream))
    cfg["strategies"] = strategies or []
    return cfg


def kinds_of_top(rule, aligned, k: int) -> dict:
    """Share of token kinds among each case's top-k ranked downstream positions."""
    counts = Counter(a.kinds[p] for a in aligned for p in rule.rank(a)[:k])
    total = sum(counts.values()) or 1
    return {kind: round(n / total, 4) for kind, n in counts.most_common()}


def write_topk(cfg: dict, path: Path | str) -> Path:
    return atomic_write(Path(path), lambda tmp: tmp.write_text(yaml.safe_dump(cfg, sort_keys=False)))


# the columns export-topk reads (read_table refuses a table with rows that lacks one, or of the wrong kind)
EDITS_COLUMNS = ("case_id", "strategy", "ranking", "cot", "k", "agree", "recovery", "frac_recomputed", "valid",
                 "control")
SWEEP_COLUMNS = ("case_id", "measure", "name", "agree", "valid", "control", "frac_recomputed", "wall_s")


def export_topk(results_dir: Path | str, out: Path | str | None = None,
                threshold: float = DEFAULT_THRESHOLD) -> Path:
    """Compute the top-K YAML from a ``kvprobe run`` folder (edits + ranking rule + manifest) or a
    ``kvprobe sweep`` folder (:func:`export_sweep`); returns its path. A folder whose files are
    missing, unreadable or not what those commands write is a one-line :class:`KvprobeError`
    naming the file; a threshold outside [0.5, 1) a one-line UsageError (a topk.yaml holding one
    would be refused where it is read)."""
    check_threshold(threshold, "threshold")
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise KvprobeError(f"results folder not found: {results_dir}")
    if not (results_dir / RUN_MANIFEST).exists() and ((results_dir / SWEEP_CLAIM).exists()
                                                   or (results_dir / SWEEP_MANIFEST).exists()):
        return export_sweep(results_dir, out, threshold)
    if not (results_dir / RUN_MANIFEST).exists():
        raise KvprobeError(f"{results_dir} is not a kvprobe results folder (no {RUN_MANIFEST} or {SWEEP_MANIFEST}); "
                           f"run `kvprobe run` or `kvprobe sweep` first")
    for name in (EDITS, RANKING_RULE):
        if not (results_dir / name).exists():
            raise KvprobeError(f"{results_dir} has no {name}: run `kvprobe run` with the editor and locality probe")
    manifest = json_object(results_dir / RUN_MANIFEST, RUN_MANIFEST_KEYS, "a `kvprobe run` manifest")
    config = manifest["config"]
    if not isinstance(config, dict) or "erratum_template" not in config:
        raise KvprobeError(f"{results_dir / RUN_MANIFEST} is not a `kvprobe run` manifest (its config has no "
                           f"erratum_template); rerun `kvprobe run`")
    rule = json_object(results_dir / RANKING_RULE, ("held_out_cases", "rule", "kinds_at_top", "max_downstream"),
                       "a ranking rule as `kvprobe run` writes it")
    edits = read_table(results_dir / EDITS, EDITS_COLUMNS)
    if not isinstance(rule["held_out_cases"], list) or not isinstance(rule["rule"], dict):
        raise KvprobeError(f"{results_dir / RANKING_RULE} is not a ranking rule as `kvprobe run` writes it "
                           f"(held_out_cases must be a list, rule an object); rerun `kvprobe run`")
    held_out = edits.case_id.isin(set(rule["held_out_cases"]))
    # every valid case (as the run's headline), but a causal ranking only on cases it did not learn from
    rows = edits[(edits.cot == 0) & (held_out | edits.control.astype(bool) | edits.ranking.ne("causal"))]
    evidence = strategy_evidence(rows)
    cfg = topk_config(held_out_decisions(edits, rule["held_out_cases"]), manifest["model"], rule["rule"], rule["kinds_at_top"], rule["max_downstream"],
                      config["erratum_template"], threshold, manifest.get("n_layers"), evidence)
    cfg["fields"] = field_repairs(rows, evidence, threshold)
    return write_topk(cfg, out or results_dir / TOPK_FILE)


def field_repairs(rows: pd.DataFrame, evidence: list[dict], threshold: float) -> dict:
    """Per edited field: its kind (``decides``: its edits are decision cases; ``must not matter``: negative
    controls) and the cheapest repair the one rule (:mod:`kvprobe.repair_rule`) establishes on that
    kind's leg alone (agreement, or the decision kept), or null. ``auto`` reads it per field."""
    cands = [candidate(Evidence(**e)) for e in evidence if is_repair(e["spec"]) and e["frac_recomputed"] is not None]
    best = {kind: getattr(cheapest_on(cands, leg, threshold), "name", None)
            for kind, leg in (("decides", "agreement"), ("must not matter", "kept"))}
    if "field" not in rows:  # a table written without fields: nothing per field
        return {}
    valid = rows[rows.valid.astype(bool)]
    out = {}
    for name, g in valid.groupby("field", sort=True):
        control = g.control.astype(bool)
        kind = "mixed" if control.any() and not control.all() else ("must not matter" if control.all() else "decides")
        out[str(name)] = {"kind": kind, "repair": best.get(kind), "cases": int(g.case_id.nunique())}
    return out


def export_sweep(folder: Path, out: Path | str | None = None,
                 threshold: float = DEFAULT_THRESHOLD) -> Path:
    """The YAML of a ``kvprobe sweep`` folder: the model fingerprint its manifest holds, ``k_star:
    null`` (a sweep learns no ranking), and the strategies section over every valid case of every
    cell (the layouts pooled). The erratum template is the one the sweep's erratum strategies
    share (null when they use several, or there is none)."""
    if not (folder / SWEEP_MANIFEST).exists():
        raise KvprobeError(f"{folder} has no {SWEEP_MANIFEST}: the sweep has not finished; rerun the same "
                           f"`kvprobe sweep` to finish it")
    manifest = json_object(folder / SWEEP_MANIFEST, ("kvprobe_sweep", "config", "model"), "a `kvprobe sweep` manifest")
    if not isinstance(manifest["model"], dict):
        raise KvprobeError(f"{folder / SWEEP_MANIFEST} is not a `kvprobe sweep` manifest (model is not an object); "
                           f"rerun `kvprobe sweep`")
    if not (folder / SWEEP).exists():
        raise KvprobeError(f"{folder} has no {SWEEP}; rerun the same `kvprobe sweep` to write it")
    rows = read_table(folder / SWEEP, SWEEP_COLUMNS)
    rows = rows[rows.measure == "strategy"]
    try:
        templates = {s.text for s in map(parse_strategy, rows["name"].unique()) if isinstance(s, Erratum)}
    except KvprobeError:
        raise KvprobeError(f"{folder / SWEEP} names a strategy this kvprobe does not know; rerun `kvprobe sweep`"
                           ) from None
    cfg = {"schema_version": SCHEMA_VERSION, "model": manifest["model"], "threshold": threshold,
           "judged_on": "every valid case of every cell of the sweep (layouts pooled); no chain-of-thought",
           "erratum_template": templates.pop() if len(templates) == 1 else None,
           "k_star": None, "k_star_status": "no ranking", "reason": NO_RANKING, "strategies": strategy_evidence(rows, "name")}
    return write_topk(cfg, out or folder / TOPK_FILE)
