"""The answer of one results folder in five facts, for the report's headline, the end of ``kvprobe
run``, ``summary.json`` and ``kvprobe compare``: a pure function of the folder's files.

1. **Where the decision lives** (``where``): the field-only patch's recovery and its verdict by the
   rule of :mod:`kvprobe.sweep.summary` (its 95% CI below 1/3: downstream notes; above 2/3: the
   field; between: mixed), with the downstream span's and the top notes' recovery beside it.
2. **The repair to use** (``repair``): the one rule of :mod:`kvprobe.repair_rule`: the cheapest
   strategy established on both legs (agreement with the oracle on the decision cases, the decision
   kept on the negative controls, each a Wilson 95% lower bound at or above the threshold); when
   none is, ``recommended`` is null, ``closest`` the nearest and ``why_not`` its weak leg.
   ``per_field`` names the cheapest repair established on each leg alone: for the fields that
   decide, and for the fields that must not matter.
3. **K\\*** (``k_star``): established only where its lower bound reaches the threshold
   (:func:`kvprobe.editor.topk.k_star_for`), recomputed from the folder's tables.
4. **The composition gate** (``composition``), where the run composed: re-rotated agreement at the
   gated seam against the gate's threshold.
5. **Validity** (``validity``): how many cases count and why the others were dropped.
6. **Weight edit** (``weight_edit``), where the folder holds ``kvprobe weight-edit``'s table: per arm
   (the KV repairs and the LoRA edit) agreement with the oracle, the median time to the edited
   decision, setup, and contamination (a bootstrap over edited cases; 0 by construction for a KV
   repair).
7. **User memory** (``memory``), where the folder holds ``kvprobe memory``'s table: per arm accuracy,
   agreement with the group's reference, the negative questions the edit changed and cost, the TOST
   rows (recomputed from the table at the manifest's margin and alpha), and the per-field policy's
   choices where the run calibrated one.

``strategies`` is the main strategy table (the configured strategies, no chain-of-thought, valid
decision cases; control invariance over the valid controls). Every share is a Wilson 95%
interval, every mean a percentile bootstrap over cases. The file's schema is
``summary.schema.json`` beside this module (documented in docs/summary.md); :data:`SCHEMA_VERSION`
changes whenever a key changes meaning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from kvprobe.defaults import GATE_SEAM, GATE_THRESHOLD
from kvprobe.editor.topk import held_out_decisions, k_star_for, k_sweep
from kvprobe.metrics import summarize_edits, valid_case_ids
from kvprobe.reports.folder import Run, load_run
from kvprobe.repair_rule import (RULE, Candidate, Leg, cases_to_establish, cheapest_on, choose, clears, closest,
                                 is_repair)
from kvprobe.reports.arms import memory, weight_edit
from kvprobe.reports.numbers import num, stat_dict, stat_text
from kvprobe.reports.stats import Stat
from kvprobe.results import COMPOSE, EDITS, LOCALITY, VALIDITY, atomic_write_json
from kvprobe.sweep.summary import FIELD_ABOVE, NOTES_BELOW, verdict

SUMMARY = "summary.json"
SCHEMA = Path(__file__).with_name("summary.schema.json")
SCHEMA_VERSION = 6  # 2: the repair rule needs both legs; per_field, why_not; the run's sizing. 3: durations in
# seconds (repair_s, to_decision_s), as every other kvprobe file. 4: weight_edit (kvprobe weight-edit folders).
# 5: memory (kvprobe memory folders). 6: a TOST's margin is equivalence_margin (memory.equivalence)
WHERE = {"takes notes": "downstream notes", "reads the field": "the field", "mixed": "mixed",
         "inconclusive": "inconclusive"}
TOP_K = 8  # the top-notes figure quoted beside the verdict (the middle K when the run has no 8)
REPAIR_RULE = RULE  # kvprobe.repair_rule: the one rule of the headline, topk.yaml and auto
WHERE_RULE = (f"the field-only patch's recovery: its 95% CI below {NOTES_BELOW:.2f} means downstream notes, above "
              f"{FIELD_ABOVE:.2f} the field, between or straddling mixed; under 10 cases inconclusive")


# -- the tables the facts rest on --------------------------------------------------------------------
def main_edits(run: Run) -> pd.DataFrame:
    """The configured strategies' rows (every non-selective row, and the selective ones the config
    names) without chain-of-thought, one per case and strategy (a held-out K sweep can repeat one)."""
    e = run.table(EDITS)
    if e.empty or "strategy" not in e:
        return e
    configured = set(run.config.get("strategies") or [])
    e = e[~e["strategy"].str.startswith("selective:") | e["strategy"].isin(configured)]
    e = e[e["cot"] == 0] if "cot" in e else e
    return e.drop_duplicates(["case_id", "strategy"], keep="first")


def strategy_order(run: Run, names) -> list[str]:
    """``names`` in the run's configured order, the others after them alphabetically."""
    cfg = list(run.config.get("strategies") or [])
    return [s for s in cfg if s in set(names)] + sorted(set(names) - set(cfg))


def strategy_rows(run: Run) -> list[dict]:
    """The main strategy table: per strategy, agreement and recovery over the valid decision cases,
    control invariance over the valid controls, cost, time and the editor's notes."""
    e = main_edits(run)
    if e.empty:
        return []
    control = e["control"].astype(bool) if "control" in e else pd.Series(False, index=e.index)
    dec = e[~control]
    if "valid" in dec:
        ids = valid_case_ids(dec)
        dec = dec[dec["case_id"].isin(ids)] if ids else dec
    ctl = e[control & e["valid"].astype(bool)] if "valid" in e else e[control]
    summ = summarize_edits(dec, by=("strategy",)) if len(dec) else pd.DataFrame()
    rows = []
    for name in strategy_order(run, e["strategy"].unique()):
        r = summ[summ["strategy"] == name] if len(summ) else summ
        g = dec[dec["strategy"] == name]
        c = ctl[ctl["strategy"] == name]
        c = c[c["agree"].notna()] if "agree" in c else c
        notes = g["note"].dropna().astype(str) if "note" in g else pd.Series(dtype=str)
        notes = notes[notes != ""]
        errors = int(g["error"].notna().sum()) if "error" in g else 0
        row = {"strategy": name, "n": len(g), "errors": errors,
               "control_invariance": stat_dict(Stat.share(c["agree"].astype(float))) if len(c) else None,
               "notes": [{"note": n, "cases": int(k)} for n, k in notes.value_counts().items()]}
        if len(r):
            r = r.iloc[0]
            row |= {"agreement": stat_dict(Stat(r.agreement, r.agreement_lo, r.agreement_hi,
                                                int(r.n) - errors)),
                    "recovery": stat_dict(Stat(r.recovery, r.recovery_lo, r.recovery_hi, int(r.n_recovery))),
                    "frac_recomputed": num(r.frac_recomputed), "repair_s": num(r.wall_s, 5),
                    "to_decision_s": num(r.to_decision_s, 5)}
        else:
            row |= {"agreement": None, "recovery": None, "frac_recomputed": None, "repair_s": None,
                    "to_decision_s": None}
        rows.append(row)
    return rows


# -- the five facts -------------------------------------------------------------------------------------
def where(run: Run) -> dict | None:
    """Where the decision lives, from the locality probe's patches (or, without it, ``field_only``)."""
    loc = run.table(LOCALITY)
    found = {}
    if len(loc) and "set" in loc and (loc["metric"] == "recovery").any():
        rec = loc[(loc["metric"] == "recovery")]
        rec = rec[~rec["control"].astype(bool)] if "control" in rec else rec
        if "oracle_flip" in rec:
            flips = rec.groupby("case_id")["oracle_flip"].first().abs()
            rec = rec[rec["case_id"].isin(flips[flips >= run.min_flip].index)]
        per_case = rec.groupby(["case_id", "set", "k"], dropna=False)["value"].mean().reset_index()
        for name in ("field", "downstream"):
            found[name] = Stat.of(per_case[per_case["set"] == name]["value"])
        ks = sorted(set(per_case[per_case["set"] == "topk"]["k"].dropna().astype(int)))
        if ks:
            k = TOP_K if TOP_K in ks else ks[len(ks) // 2]
            found["top"] = (k, Stat.of(per_case[(per_case["set"] == "topk") & (per_case["k"] == k)]["value"]),
                            Stat.of(per_case[(per_case["set"] == "randomk") & (per_case["k"] == k)]["value"]))
        source = "the locality probe's field-only patch"
    else:
        e = main_edits(run)
        g = e[(e["strategy"] == "field_only") & ~e["control"].astype(bool)] if len(e) and "control" in e else e[:0]
        if "valid" in g and g["valid"].any():
            g = g[g["valid"].astype(bool)]
        if not len(g):
            return None
        found["field"] = Stat.of(g["recovery"])
        source = "the field_only strategy's recovery"
    field = found["field"]
    v = verdict(field.lo, field.hi, field.n)
    out = {"verdict": v, "where": WHERE[v], "source": source, "rule": WHERE_RULE,
           "field_recovery": stat_dict(field), "downstream_recovery": stat_dict(found.get("downstream")),
           "top_notes": None}
    if not field.n:
        out["sentence"] = (f"Where the decision lives is inconclusive: no valid case has an oracle flip of at least "
                           f"{run.min_flip:g} logit{'' if run.min_flip == 1 else 's'}, so no recovery can be measured.")
        return out
    parts = [f"the field alone recovers {stat_text(out['field_recovery'])} of the edit"]
    if found.get("downstream") and found["downstream"].n:
        parts.append(f"the downstream span {stat_text(out['downstream_recovery'])}")
    if "top" in found:
        k, top, rand = found["top"]
        out["top_notes"] = {"k": k, "recovery": stat_dict(top), "random_k": stat_dict(rand)}
        parts.append(f"the top {k} notes {stat_text(stat_dict(top))} (random {k}: {stat_text(stat_dict(rand))})")
    head = {"takes notes": "The decision lives in downstream notes",
            "reads the field": "The decision reads the field itself",
            "mixed": "The decision is mixed (partly the field, partly downstream notes)",
            "inconclusive": "Where the decision lives is inconclusive"}[v]
    out["sentence"] = f"{head}: {'; '.join(parts)} (recovery, 95% CI)."
    return out


def _candidate(r: dict) -> Candidate:
    """A strategy row as :mod:`kvprobe.repair_rule` reads it (a case it could not repair counts against it)."""
    a, c = r["agreement"] or {}, r["control_invariance"] or {}
    agree = Leg.of(a.get("value"), a.get("n"))
    seconds = r["to_decision_s"] if r["to_decision_s"] is not None else r["repair_s"]
    return Candidate(r["strategy"], Leg(agree.k, agree.n + int(r.get("errors") or 0)),
                     Leg.of(c.get("value"), c.get("n")), r["frac_recomputed"], seconds)


def repair_answer(r: dict) -> str:
    """The short answer to "which repair?" from :func:`repair`'s verdict: the repair established on
    both legs; else the repairs established per kind of field, each for its kind; only where nothing
    is established, ``none established`` and the closest (which the verdict does not name)."""
    if r["recommended"]:
        return r["recommended"]
    per = r.get("per_field") or {}
    dec, ctl = per.get("decision_fields"), per.get("control_fields")
    if dec and ctl:
        return f"per field: {dec} for the fields that decide, {ctl} for the fields that must not matter"
    if dec:
        return f"{dec} for the fields that decide (none established for the fields that must not matter)"
    if ctl:
        return f"{ctl} for the fields that must not matter (none established for the fields that decide)"
    return f"none established (closest: {r['closest']})"


def repair(rows: list[dict], threshold: float) -> dict | None:
    """The recommended repair by :data:`REPAIR_RULE` among ``rows`` (:func:`strategy_rows`), and per
    kind of field: the cheapest repair established on agreement alone (for the fields that decide)
    and on controls kept alone (for the fields that must not matter)."""
    tried = [r for r in rows
             if is_repair(r["strategy"]) and r["agreement"] and r["agreement"]["lo"] is not None]
    if not tried:
        return None
    cands = {r["strategy"]: _candidate(r) for r in tried}
    pick, ok = choose(list(cands.values()), threshold)
    near = pick or closest(list(cands.values()))
    r = next(x for x in tried if x["strategy"] == near.name)
    need = cases_to_establish(threshold)
    by_kind = {kind: getattr(cheapest_on(list(cands.values()), leg, threshold), "name", None)
               for kind, leg in (("decision_fields", "agreement"), ("control_fields", "kept"))}
    out = {"rule": REPAIR_RULE, "threshold": threshold, "recommended": pick.name if pick else None,
           "closest": None if pick else near.name, "qualifying": [c.name for c in ok], "cases_to_establish": need,
           "per_field": by_kind, "why_not": None if pick else near.why_not(threshold)}
    out |= {k: r[k] for k in ("agreement", "control_invariance", "frac_recomputed", "repair_s", "to_decision_s")}
    cost_text = _cost_text(r)
    dec, ctl = by_kind["decision_fields"], by_kind["control_fields"]
    if pick:
        out["sentence"] = (f"Repair with {pick.name}: agreement {stat_text(r['agreement'])}, {cost_text}"
                           f"{_controls_text(r)}; established on both legs at {threshold:g}.")
    elif dec and ctl:
        d, c = (next(x for x in tried if x["strategy"] == name) for name in (dec, ctl))
        out["sentence"] = (f"Repair per kind of field (no single repair is established on both legs at {threshold:g}): "
                           f"for the fields that decide, {dec} (agreement {stat_text(d['agreement'])}, "
                           f"{_cost_text(d)}); "
                           f"for the fields that must not matter, {ctl} (it keeps the decision on "
                           f"{stat_text(c['control_invariance'])} of the negative controls, {_cost_text(c)}). "
                           f"{dec} is not the repair for every field: {cands[dec].why_not(threshold)}.")
    else:
        out["sentence"] = (f"No repair is established at {threshold:g} on both legs (agreement with the oracle, and "
                           f"the decision kept on negative controls). The closest is {near.name}, agreement "
                           f"{stat_text(r['agreement'])}, {cost_text}{_controls_text(r)} ({near.why_not(threshold)}); "
                           f"only a full re-prefill is known to be right"
                           + (f" (a lower bound of {threshold:g} takes at least {need} cases on each leg, all "
                              f"succeeding)." if need else ".")
                           + (f" For the fields that decide alone, {dec} is established on agreement." if dec else "")
                           + (f" For the fields that must not matter alone, {ctl} keeps the decision." if ctl else ""))
    return out


def _cost_text(r: dict) -> str:
    frac = f"{100 * r['frac_recomputed']:.1f}% of tokens recomputed" if r["frac_recomputed"] is not None else \
        "recomputed share not measured"
    seconds = r["to_decision_s"] if r["to_decision_s"] is not None else r["repair_s"]
    what = "to the decision" if r["to_decision_s"] is not None else "repair"
    return f"{frac}, {seconds:.2f} s {what}" if seconds is not None else frac


def _controls_text(r: dict) -> str:
    c = r["control_invariance"]
    if not c or c["value"] is None:
        return ""
    kept = round(c["value"] * c["n"])
    return f"; it keeps the answer on {kept} of {c['n']} negative controls"


def k_star(run: Run, threshold: float) -> dict | None:
    """K* from the folder's held-out K sweep (see :func:`kvprobe.editor.topk.k_star_for`)."""
    rule = run.ranking_rule
    e = run.table(EDITS)
    if not rule or e.empty or "strategy" not in e:
        return None
    held = held_out_decisions(e, rule.get("held_out_cases") or [])
    out = k_star_for(k_sweep(held), rule.get("rule") or {}, threshold, int(rule.get("max_downstream") or 0))
    k = out["k_star"] if out["k_star"] is not None else out.get("k_candidate")
    ev = ({"value": out["agreement"], "lo": out["agreement_ci95"][0], "hi": out["agreement_ci95"][1],
           "n": out["n_cases"]} if "agreement" in out else None)
    res = {"status": out["k_star_status"], "k_star": out["k_star"], "k": k, "agreement": ev,
           "reason": out.get("reason"), "threshold": threshold}
    if out["k_star_status"] == "established":
        res["sentence"] = (f"K* = {k}: the field plus the top {k} ranked positions agree {stat_text(ev)} on held-out "
                           f"cases, lower bound at or above {threshold:g}.")
    elif out["k_star_status"] == "no ranking":
        res["sentence"] = f"K*: none, since no causal ranking was learned ({out.get('reason')})."
    else:
        res["sentence"] = f"K* {out['k_star_status']}: {out.get('reason')}."
    return res


def composition(run: Run) -> dict | None:
    """The composition gate at the gated seam, re-rotated (as ``kvprobe validate``)."""
    df = run.table(COMPOSE)
    if df.empty:
        return None
    cm = run.compose_manifest
    seam = int(cm.get("gated_seam", GATE_SEAM))
    threshold = float(cm.get("threshold", GATE_THRESHOLD))
    if not {"rerotate", "seam", "agree"} <= set(df.columns):
        return None
    rot = df[df["rerotate"].astype(bool)]
    if rot.empty:
        return None
    if seam not in set(rot["seam"]):  # a run with other seams: the nearest one
        seam = int(min(rot["seam"], key=lambda s: (abs(s - seam), s)))
    agree = Stat.share(rot[rot["seam"] == seam]["agree"].astype(float))
    st = stat_dict(agree)
    passed = clears(st["lo"], threshold)
    return {"seam": seam, "threshold": threshold, "agreement": st, "passed": passed, "established": passed,
            "sentence": (f"Composition gate {'passes' if passed else 'fails'}: a moved, re-rotated block agrees with "
                         f"a full prefill {stat_text(st)} at seam {seam} (threshold {threshold:g} on the lower "
                         f"bound{'' if passed or agree.mean < threshold else ', which is below it'}).")}


def validity(run: Run) -> dict | None:
    """How many cases count, and why the others were dropped."""
    m = run.manifest
    if not m:
        return None
    counts = m.get("counts", {})
    v = run.table(VALIDITY)
    dec = v[~v["control"].astype(bool)] if len(v) and "control" in v else v
    share = stat_dict(Stat.share(dec["valid"].astype(float))) if len(dec) else None
    dropped = {reason_text(k): int(n) for k, n in (m.get("invalid_reasons") or {}).items()}
    skipped: dict[str, int] = {}
    for s in m.get("skipped") or []:
        skipped[s.get("reason", "?")] = skipped.get(s.get("reason", "?"), 0) + 1
    sizing = m.get("sizing")
    out = {"cases": counts.get("cases"), "aligned": counts.get("aligned"), "checked": counts.get("checked"),
           "sizing": sizing, "decision": len(dec) if len(v) else None,
           "valid_decision": counts.get("valid_decision"), "valid_share": share,
           "valid_controls": counts.get("valid_control"), "controls": int(len(v) - len(dec)) if len(v) else None,
           "invalid": dropped, "skipped": skipped}
    why = [f"{n} {r}" for r, n in sorted(dropped.items(), key=lambda kv: -kv[1])]
    why += [f"{n} skipped ({r})" for r, n in skipped.items()]
    out["sentence"] = (f"{out['valid_decision']} of {out['decision']} decision cases are valid (the model answers "
                       f"right under both values; {stat_text(share)})"
                       + (f"; dropped: {', '.join(why)}" if why else "")
                       + (f"; {out['valid_controls']} of {out['controls']} negative controls valid"
                          if out["controls"] else "") + "."
                       + (" No case is valid: every number below is over all probed cases and says nothing about "
                          "editing a model that decides." if out["valid_decision"] == 0 else "")
                       + (" " + sizing_text(sizing) if sizing else ""))
    return out


def sizing_text(sizing: dict) -> str:
    """How a sized run chose its cases, and whether it stopped on its targets or its budget."""
    head = (f"The run was sized to establish each leg at {sizing['threshold']:g} ({sizing['per_leg']} cases a leg, "
            f"all succeeding): it checked {sizing.get('checked')} cases in order (budget {sizing['budget']}) for "
            f"{sizing['valid_decision']} valid decision cases and {sizing['valid_controls']} valid controls, and found "
            f"{sizing.get('valid_decision_found')} and {sizing.get('valid_controls_found')}")
    if sizing.get("stopped") == "targets reached":
        return head + ("; it stopped there, on validity alone (no edit's outcome), so every interval is a fixed-sample "
                       "one.")
    return head + f"; it stopped because {sizing.get('reason', 'the budget ran out')}."


def reason_text(reason: str) -> str:
    """An invalid-case reason in words; manifests written before the words were fixed said "wrong under old
    value wrong under new value" for a case wrong under both."""
    if "old value" in reason and "new value" in reason:
        return "wrong under both values"
    return reason.replace("under old value", "under the old value").replace("under new value", "under the new value")


# -- the summary --------------------------------------------------------------------------------------------
def summarize_run(run: Run, threshold: float | None = None) -> dict:
    """The five facts of ``run`` (see the module docstring) at ``threshold``, by default the one the folder
    records (:attr:`Run.threshold`)."""
    threshold = run.threshold if threshold is None else threshold
    rows = strategy_rows(run)
    facts = {"where": where(run), "repair": repair(rows, threshold), "k_star": k_star(run, threshold),
             "composition": composition(run), "validity": validity(run), "weight_edit": weight_edit(run),
             "memory": memory(run)}
    return {"kvprobe_summary": SCHEMA_VERSION, "model": run.label, "folder": str(run.folder),
            "fingerprint": run.manifest.get("model") if run.manifest else None, "threshold": threshold,
            **facts, "strategies": rows,
            "headline": [f["sentence"] for f in facts.values() if f is not None]}


def write_summary(folder: Path | str, threshold: float | None = None) -> Path:
    """Write ``summary.json`` into the results ``folder`` (atomically); returns its path. The command that
    computed the folder passes its ``threshold``; None reads the folder's (:attr:`Run.threshold`)."""
    folder = Path(folder)
    return atomic_write_json(summarize_run(load_run(folder), threshold), folder / SUMMARY)


def schema() -> dict:
    return json.loads(SCHEMA.read_text(encoding="utf-8"))
