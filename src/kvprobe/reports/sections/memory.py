"""User memory: ``kvprobe memory``'s arms per question (the profile placed early or late, a fact edited
and repaired, the profile transplanted), the TOST rows of the accuracy differences, and the per-field
policy's choices where the run calibrated one."""

from __future__ import annotations

import math

from kvprobe.reports.folder import Run
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import nanfloat
from kvprobe.reports.arms import memory_stat, memory_tables
from kvprobe.tables import MEMORY

SETTINGS = ("n", "n_users", "questions_per_user", "sessions", "session_tokens", "seams", "form", "seed")


def build_memory(run: Run) -> dict | None:
    tables = memory_tables(run)
    if tables is None:
        return None
    summ, tost, margin, alpha = tables
    rows = [{"group": r.group, "arm": r.arm, "repairs": getattr(r, "repairs", "") or "", "errors": int(r.n_errors),
             "questions": int(r.n_questions),
             **{name: memory_stat(r, name) for name in ("accuracy", "agreement", "negative_changed")},
             "tokens": r.tokens_recomputed, "frac": r.frac_recomputed, "state_ms": 1000 * r.wall_s,
             "read_ms": 1000 * r.decide_s} for r in summ.itertuples()]
    tests = [{"pair": f"{r.arm} - {r.against}", "n": int(r.n), "only_a": int(r.only_a), "only_b": int(r.only_b),
              "diff": _signed(r.diff), "interval": f"[{_signed(r.lo)}, {_signed(r.hi)}]" if r.n else "-",
              "equivalent": bool(r.equivalent)} for r in tost.itertuples()]
    m = run.memory_manifest
    return {"rows": rows, "tests": tests, "margin": f"{margin:g}", "alpha": f"{alpha:g}",
            "confidence": f"{1 - 2 * alpha:.0%}", "policy": _policy(m.get("policy")),
            "settings": {k: m[k] for k in SETTINGS if k in m}}


def _signed(x) -> str:
    """``+0.042`` (the sign always), or n/a."""
    x = nanfloat(x)
    return f"{x:+.3f}" if math.isfinite(x) else "n/a"


def _policy(p) -> dict | None:
    """The manifest's policy per fact, each candidate's agreement as k/n with its interval (``k``; manifests
    written before it was a statistic named it ``agree``)."""
    if not isinstance(p, dict):
        return None
    fields = p.get("fields") or {}
    names = list(p.get("candidates") or dict.fromkeys(s for d in fields.values() for s in d.get("strategies") or {}))

    def agreement(s: dict | None) -> dict | None:
        return None if s is None else {"k": s.get("k", s.get("agree")), "n": s.get("n"), "lo": s.get("lo"),
                                       "hi": s.get("hi")}

    return {"threshold": p.get("threshold"), "users": p.get("calibration_users"), "candidates": names,
            "fields": [{"fact": fact, "repair": d.get("repair"), "verdict": d.get("verdict"),
                        "elements": d.get("elements"), "changed": d.get("changed"), "reason": d.get("reason"),
                        "strategies": [agreement((d.get("strategies") or {}).get(name)) for name in names]}
                       for fact, d in fields.items()]}


SECTION = register(Section(
    id="memory", title="User memory", needs=MEMORY, order=26, build=build_memory,
    template="sections/memory.html",
    intro="A user's profile in a long conversation (kvprobe memory): questions answered with the profile placed "
          "before the trajectory (early) or after it (late); a profile fact edited and the late cache repaired "
          "(stale: no repair; oracle: a full prefill of the edited context; erratum: a correction line appended; "
          "neutral: a line that says nothing appended, the erratum's control; field_only: the value's tokens "
          "recomputed; policy: the repair a per-field calibration on other users chose for the fact); and the "
          "profile transplanted (precompiled once, spliced after a new session, re-rotated, its first S tokens "
          "fed fresh) against a full recompute. Accuracy is against the expected answers (Wilson 95% CI), "
          "agreement is with the group's reference (edit arms: the oracle; transplant arms: the full recompute), "
          "negatives changed is the share of questions the profile does not decide whose answer differs from the "
          "unedited late cache's. The TOST rows test the accuracy difference, paired by question, for "
          "equivalence within the margin (the (1 - 2 alpha) Tango score interval inside it), recomputed from the "
          "table."))
