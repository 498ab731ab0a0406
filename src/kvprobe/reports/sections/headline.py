"""The answer first: where the decision lives, the repair to use, K*, the composition gate and
validity, each one sentence with the numbers behind it (:mod:`kvprobe.reports.summary`)."""

from __future__ import annotations

from kvprobe.reports.folder import Run
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.summary import REPAIR_RULE, WHERE_RULE, repair_answer, summarize_run


def build_headline(run: Run) -> dict | None:
    if not run.manifest and not run.compose_manifest:
        return None
    s = summarize_run(run)
    facts = []
    if s["where"]:
        facts.append({"id": "where", "label": "Where the decision lives", "answer": s["where"]["where"],
                      "sentence": s["where"]["sentence"], "rule": WHERE_RULE})
    if s["repair"]:
        r = s["repair"]
        facts.append({"id": "repair", "label": "Repair to use",
                      "answer": repair_answer(r),
                      "sentence": r["sentence"], "rule": f"{REPAIR_RULE} ({r['threshold']:g})"})
    if s["k_star"]:
        k = s["k_star"]
        facts.append({"id": "k_star", "label": "K*",
                      "answer": str(k["k_star"]) if k["status"] == "established" else k["status"],
                      "sentence": k["sentence"], "rule": "established only where the Wilson 95% lower bound on "
                                                         f"held-out cases reaches {k['threshold']:g}"})
    if s["composition"]:
        c = s["composition"]
        facts.append({"id": "composition", "label": "Composition gate", "answer": "pass" if c["passed"] else "fail",
                      "sentence": c["sentence"], "rule": None})
    if s["validity"]:
        v = s["validity"]
        facts.append({"id": "validity", "label": "Valid cases", "answer": f"{v['valid_decision']} of {v['decision']}",
                      "sentence": v["sentence"], "rule": None})
    return {"facts": facts, "threshold": s["threshold"]} if facts else None


SECTION = register(Section(
    id="headline", title="The answer", needs="manifest.json", order=0, build=build_headline,
    template="sections/headline.html",
    intro="What this folder says, each answer with the numbers behind it; the sections below hold the evidence. "
          "Shares carry Wilson 95% intervals, means percentile-bootstrap ones; summary.json holds the same facts."))
