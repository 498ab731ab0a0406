"""The summary's facts of the commands that compare arms on one folder: ``kvprobe weight-edit``
(``weight_edit``) and ``kvprobe memory`` (``memory``, and the tables its report section reads). Part of
``summary.json`` (:mod:`kvprobe.reports.summary`, facts 6 and 7)."""

from __future__ import annotations

import pandas as pd

from kvprobe.errors import KvprobeError
from kvprobe.reports.folder import Run
from kvprobe.reports.numbers import num, stat_dict, stat_text
from kvprobe.reports.stats import Stat
from kvprobe.results import MEMORY, MEMORY_MANIFEST


def weight_edit(run: Run) -> dict | None:
    """``kvprobe weight-edit``'s arms over the valid decision cases (:func:`summarize_weight_edits`)."""
    from kvprobe.tables import WEIGHT_EDITS
    from kvprobe.weight_edit.runner import MEASURED, summarize_weight_edits

    df = run.table(WEIGHT_EDITS)
    if df.empty:
        return None
    summ = summarize_weight_edits(df)
    if summ.empty:
        return {"arms": [], "sentence": "Weight edit: no valid decision case, so no arm can be judged."}
    arms = []
    for r in summ.itertuples():
        measured = r.contamination_basis == MEASURED
        arms.append({
            "arm": r.strategy, "method": r.method,
            "agreement": {"value": num(r.agreement), "lo": num(r.agreement_lo), "hi": num(r.agreement_hi),
                          "n": int(r.n)},
            "to_decision_s": num(r.to_decision_s), "setup_s": num(r.setup_s),
            "contamination": ({"value": num(r.contamination), "lo": num(r.contamination_lo),
                               "hi": num(r.contamination_hi), "n": int(r.contamination_n)} if measured else None),
            "contamination_basis": r.contamination_basis, "contamination_reads": int(r.contamination_reads)})
    shown = [a for a in arms if a["method"] == "lora"] + [a for a in arms if a["arm"] == "erratum"]
    sentence = "Weight edit: " + "; ".join(
        f"{a['arm']} agrees with the oracle {stat_text(a['agreement'])} in {1000 * a['to_decision_s']:.0f} ms"
        + (f", changing {stat_text(a['contamination'])} of other requests' decisions" if a["contamination"]
           else "") for a in shown)
    oracle = [a for a in arms if a["arm"] == "oracle" and a["to_decision_s"] is not None]
    sentence += (f"; a full re-prefill takes {1000 * oracle[0]['to_decision_s']:.0f} ms" if oracle else "") + "."
    return {"arms": arms, "sentence": sentence}


MEMORY_ALPHA = 0.05  # kvprobe memory's --alpha default, for a table without its manifest


def memory_tables(run: Run) -> tuple[pd.DataFrame, pd.DataFrame, float, float] | None:
    """``kvprobe memory``'s per-arm summary and TOST rows, recomputed from memory.parquet
    (:func:`kvprobe.memory.summarize_memory`, :func:`kvprobe.memory.equivalence`) at the manifest's
    margin and alpha (0.05 each where there is no manifest), and those two; None without the table."""
    df = run.table(MEMORY)
    if df.empty:
        return None
    from kvprobe.memory import DEFAULT_MARGIN, equivalence, summarize_memory

    m = run.memory_manifest
    key = "equivalence_margin" if "equivalence_margin" in m else "margin"  # "margin" before tables schema 2
    margin, alpha = m.get(key, DEFAULT_MARGIN), m.get("alpha", MEMORY_ALPHA)
    for key, value, top in ((key, margin, 1.0), ("alpha", alpha, 0.5)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < top:
            raise KvprobeError(f"{run.folder / MEMORY_MANIFEST} has {key} {value!r}, where kvprobe memory writes a "
                               f"number in (0, {top:g}); rerun the command that wrote it, or move the file away")
    return summarize_memory(df, margin), equivalence(df, margin, alpha), float(margin), float(alpha)


def memory(run: Run) -> dict | None:
    """``kvprobe memory``'s arms, TOST rows and policy (:func:`memory_tables`; the policy as its manifest
    keeps it, since the calibration that chose it is not in the table)."""
    tables = memory_tables(run)
    if tables is None:
        return None
    summ, tost, _, _ = tables
    arms = [{"group": r.group, "arm": r.arm, "questions": int(r.n_questions), "errors": int(r.n_errors),
             **{name: stat_dict(memory_stat(r, name)) for name in ("accuracy", "agreement", "negative_changed")},
             "tokens_recomputed": num(r.tokens_recomputed, 1), "frac_recomputed": num(r.frac_recomputed),
             "wall_s": num(r.wall_s, 5), "decide_s": num(r.decide_s, 5),
             "repairs": getattr(r, "repairs", "") or None} for r in summ.itertuples()]
    tests = [{"arm": r.arm, "against": r.against, "n": int(r.n), "only_a": int(r.only_a), "only_b": int(r.only_b),
              "difference": {"value": num(r.diff), "lo": num(r.lo), "hi": num(r.hi), "n": int(r.n)},
              "confidence": num(r.confidence), "equivalence_margin": num(r.equivalence_margin),
              "equivalent": bool(r.equivalent)}
             for r in tost.itertuples()]
    p = run.memory_manifest.get("policy")
    policy = ({"threshold": num(p.get("threshold")),
               "fields": {str(fact): {"repair": d.get("repair"), "verdict": d.get("verdict"),
                                      "elements": d.get("elements")}
                          for fact, d in (p.get("fields") or {}).items()}} if isinstance(p, dict) else None)
    return {"arms": arms, "equivalence": tests, "policy": policy, "sentence": memory_sentence(summ, tost)}


def memory_stat(r, name: str) -> Stat:
    """The ``name`` share of a :func:`kvprobe.memory.summarize_memory` row (``name``, ``_lo``, ``_hi``, ``_n``)."""
    return Stat(float(getattr(r, name)), float(getattr(r, f"{name}_lo")), float(getattr(r, f"{name}_hi")),
                int(getattr(r, f"{name}_n")))


def tost_text(r) -> str:
    """A TOST row of :func:`kvprobe.memory.equivalence`: the difference, its interval, the verdict."""
    if not r.n:
        return "no question answered on both arms"
    return (f"difference {r.diff:+.3f}, {r.confidence:.0%} [{r.lo:+.3f}, {r.hi:+.3f}] n={r.n}, "
            f"equivalent at ±{r.equivalence_margin:g}: {'yes' if r.equivalent else 'no'}")


def memory_sentence(summ: pd.DataFrame, tost: pd.DataFrame) -> str:
    """The measured facts of :func:`memory` in one sentence (placement, transplant, the edit repairs), from
    the unrounded tables, so that its numbers are the report's to the digit."""
    by = {r.arm: r for r in summ.itertuples()}
    pairs = {(r.arm, r.against): r for r in tost.itertuples()}
    parts = []
    if "late" in by and "early" in by:
        late = pairs.get(("late", "early"))
        parts.append(f"late placement accuracy {memory_stat(by['late'], 'accuracy').text()} vs early "
                     f"{memory_stat(by['early'], 'accuracy').text()}"
                     + (f" (late - early: {tost_text(late)})" if late else ""))
    parts += [f"{a} vs full recompute: {tost_text(r)}" for (a, b), r in pairs.items() if b == "transplant_full"]
    repairs = [by[a] for a in ("erratum", "field_only", "policy") if a in by]
    if repairs:
        parts.append("agreement with the oracle: " + ", ".join(
            f"{r.arm}{f' ({r.repairs})' if getattr(r, 'repairs', '') else ''} {memory_stat(r, 'agreement').text()}"
            for r in repairs))
    lines = [by[a] for a in ("erratum", "neutral") if a in by and by[a].negative_changed_n]
    if lines:
        parts.append("negative questions whose answer the appended line changed: " + ", ".join(
            f"{r.arm} {memory_stat(r, 'negative_changed').text()}" for r in lines))
    return "Memory: " + ("; ".join(parts) if parts else "no arm measured") + "."
