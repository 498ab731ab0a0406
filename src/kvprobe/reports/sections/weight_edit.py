"""Weight edit: ``kvprobe weight-edit``'s LoRA edit per case beside the KV repairs on the same cases
(agreement with the oracle, time to the edited decision, setup, contamination of other requests)."""

from __future__ import annotations

from kvprobe.reports.folder import Run
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat
from kvprobe.tables import WEIGHT_EDITS


def build_weight_edit(run: Run) -> dict | None:
    from kvprobe.weight_edit.runner import MEASURED, summarize_weight_edits

    df = run.table(WEIGHT_EDITS)
    if df.empty:
        return None
    summ = summarize_weight_edits(df)
    rows = [{"arm": r.strategy, "method": r.method,
             "agree": Stat(float(r.agreement), float(r.agreement_lo), float(r.agreement_hi), int(r.n)),
             "to_decision_ms": 1000 * r.to_decision_s, "setup_ms": 1000 * r.setup_s,
             "contamination": (Stat(float(r.contamination), float(r.contamination_lo), float(r.contamination_hi),
                                    int(r.contamination_n)) if r.contamination_basis == MEASURED else None),
             "reads": int(r.contamination_reads), "steps": r.steps} for r in summ.itertuples()]
    m = run.weight_edit_manifest
    return {"rows": rows, "loss": m.get("loss"), "restored": m.get("weights_restored"),
            "settings": {k: m[k] for k in ("lora_rank", "lora_alpha", "lora_targets", "steps", "lr",
                                           "contamination_cases") if k in m}}


SECTION = register(Section(
    id="weight_edit", title="Weight edit", needs=WEIGHT_EDITS, order=25, build=build_weight_edit,
    template="sections/weight_edit.html",
    intro="A LoRA fitted per case (through peft) so that the stale prompt gives the oracle's decision, beside the KV "
          "repairs on the same valid decision cases: agreement with the oracle, the median time to the edited "
          "decision (the fit included; setup apart), and contamination: the share of other requests' decisions the "
          "adapter changes while it is active (mean over edited cases, bootstrap 95% CI). A KV repair changes one "
          "request's cache, so its contamination is 0 by construction."))
