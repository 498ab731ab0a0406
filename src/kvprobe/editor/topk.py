"""The per-model top-K configuration for serving: K*, the ranking rule, and the erratum template.

K* is the smallest K at which ``selective(K, causal)`` agrees with the oracle on at least
``threshold`` of held-out cases (cases not used to learn the ranking). When no K up to the
downstream length reaches it, the file says so (``k_star: null`` with the reason) instead of
inventing a number.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pandas as pd
import yaml

from kvprobe.errors import KvprobeError
from kvprobe.metrics import mean_ci
from kvprobe.results import EDITS, MANIFEST, RANKING_RULE, RUN_MANIFEST_KEYS, atomic_write, json_object, read_table

SCHEMA_VERSION = 1
TOPK_FILE = "topk.yaml"


def k_sweep(edits: pd.DataFrame, ranking: str = "causal") -> pd.DataFrame:
    """Agreement with the oracle per K for ``selective:K:<ranking>`` (valid, held-out, no CoT)."""
    sel = edits[(edits.strategy.str.startswith("selective:")) & (edits.ranking == ranking) & (edits.cot == 0)]
    rows = []
    for k, g in sel.groupby("k"):
        mean, lo, hi, n = mean_ci(g.agree.astype(float))
        rec = mean_ci(g.recovery)
        rows.append({"k": int(k), "agreement": mean, "agreement_lo": lo, "agreement_hi": hi, "n": n,
                     "recovery": rec[0], "recovery_lo": rec[1], "recovery_hi": rec[2],
                     "frac_recomputed": float(g.frac_recomputed.mean())})
    return pd.DataFrame(rows).sort_values("k") if rows else pd.DataFrame(rows)


def topk_config(edits: pd.DataFrame, fingerprint: dict, rule: dict, kinds_at_top: dict, max_downstream: int,
                erratum_template: str, threshold: float = 0.95, n_layers: int | None = None) -> dict:
    """The YAML-ready configuration (see module docstring)."""
    sweep = k_sweep(edits)
    if isinstance(rule.get("scores"), dict):  # best first (JSON storage sorts keys alphabetically)
        rule = {**rule, "scores": dict(sorted(rule["scores"].items(), key=lambda kv: -kv[1]))}
    reached = sweep[sweep.agreement >= threshold] if len(sweep) else sweep
    cfg = {"schema_version": SCHEMA_VERSION, "model": fingerprint, "threshold": threshold,
           "judged_on": "held-out valid decision cases, not used to learn the ranking; no chain-of-thought",
           "ranking_rule": rule, "recompute": {"positions": "field span + top-K downstream by the ranking rule",
                                                "layers": "all" if n_layers is None else f"all {n_layers}"},
           "token_kinds_at_top": kinds_at_top, "erratum_template": erratum_template,
           "k_sweep": sweep.round(4).to_dict("records")}
    if len(reached):
        best = reached.iloc[0]
        cfg.update(k_star=int(best.k), agreement=round(float(best.agreement), 4),
                   agreement_ci95=[round(float(best.agreement_lo), 4), round(float(best.agreement_hi), 4)],
                   n_cases=int(best.n))
    elif not rule.get("n_training_cases"):
        cfg.update(k_star=None, reason=rule.get("note") or "the causal ranking rule has no training cases")
    else:
        tried = int(sweep.k.max()) if len(sweep) else 0
        cfg.update(k_star=None, reason=(f"no K up to {tried} (downstream length up to {max_downstream}) reached "
                                        f"agreement >= {threshold} with the oracle" if len(sweep)
                                        else "no selective:K:causal results on held-out cases"))
    return cfg


def kinds_of_top(rule, aligned, k: int) -> dict:
    """Share of token kinds among each case's top-k ranked downstream positions."""
    counts = Counter(a.kinds[p] for a in aligned for p in rule.rank(a)[:k])
    total = sum(counts.values()) or 1
    return {kind: round(n / total, 4) for kind, n in counts.most_common()}


def write_topk(cfg: dict, path: Path | str) -> Path:
    return atomic_write(Path(path), lambda tmp: tmp.write_text(yaml.safe_dump(cfg, sort_keys=False)))


EDITS_COLUMNS = ("case_id", "strategy", "ranking", "cot", "k", "agree", "recovery", "frac_recomputed", "valid",
                 "control")


def export_topk(results_dir: Path | str, out: Path | str | None = None, threshold: float = 0.95) -> Path:
    """Compute the top-K YAML from a results folder (edits + ranking rule + manifest); returns its path.
    A folder whose files are missing, unreadable or not what ``kvprobe run`` writes is a one-line
    :class:`KvprobeError` naming the file."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise KvprobeError(f"results folder not found: {results_dir}")
    if not (results_dir / MANIFEST).exists():
        raise KvprobeError(f"{results_dir} is not a kvprobe results folder (no {MANIFEST}); run `kvprobe run` first")
    for name in (EDITS, RANKING_RULE):
        if not (results_dir / name).exists():
            raise KvprobeError(f"{results_dir} has no {name}: run `kvprobe run` with the editor and locality probe")
    manifest = json_object(results_dir / MANIFEST, RUN_MANIFEST_KEYS, "a `kvprobe run` manifest")
    config = manifest["config"]
    if not isinstance(config, dict) or "erratum_template" not in config:
        raise KvprobeError(f"{results_dir / MANIFEST} is not a `kvprobe run` manifest (its config has no "
                           f"erratum_template); rerun `kvprobe run`")
    rule = json_object(results_dir / RANKING_RULE, ("held_out_cases", "rule", "kinds_at_top", "max_downstream"),
                       "a ranking rule as `kvprobe run` writes it")
    edits = read_table(results_dir / EDITS)
    missing = [c for c in EDITS_COLUMNS if c not in edits.columns]
    if missing:
        raise KvprobeError(f"{results_dir / EDITS} is not an edits table of `kvprobe run` (no column "
                           f"{', '.join(missing)}); rerun `kvprobe run`")
    if not isinstance(rule["held_out_cases"], list) or not isinstance(rule["rule"], dict):
        raise KvprobeError(f"{results_dir / RANKING_RULE} is not a ranking rule as `kvprobe run` writes it "
                           f"(held_out_cases must be a list, rule an object); rerun `kvprobe run`")
    held_out = set(rule["held_out_cases"])
    edits = edits[edits.case_id.isin(held_out) & edits.valid & ~edits.control]
    cfg = topk_config(edits, manifest["model"], rule["rule"], rule["kinds_at_top"], rule["max_downstream"],
                      config["erratum_template"], threshold, manifest.get("n_layers"))
    return write_topk(cfg, out or results_dir / TOPK_FILE)
