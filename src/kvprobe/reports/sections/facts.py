"""Run facts: model, fingerprint, dataset, case counts, versions, seed and wall time, from the run's
and the composition run's manifests."""

from __future__ import annotations

from kvprobe.reports.folder import Run
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.summary import reason_text
from kvprobe.results import RUN_MANIFEST


def build_facts(run: Run) -> dict | None:
    m, cm = run.manifest, run.compose_manifest
    if not m and not cm:
        return None
    facts = []
    if m:
        cfg = m.get("config", {})
        fp = m.get("model", {})
        facts += [("model", cfg.get("model") or fp.get("spec")),
                  ("fingerprint", ", ".join(f"{k}={v}" for k, v in sorted(fp.items()))),
                  ("model info", ", ".join(f"{k}={v}" for k, v in sorted(m.get("model_info", {}).items())
                                           if v is not None)),
                  ("shape", f"{m.get('n_layers')} layers, {m.get('n_heads')} query heads, "
                            f"{m.get('n_kv_heads')} kv heads"),
                  ("dataset", f"{cfg.get('dataset')} (n={cfg.get('n')}, form={cfg.get('form')}, "
                              f"few_shot={cfg.get('few_shot')})"),
                  ("seed", m.get("seed", cfg.get("seed"))),
                  ("min flip guard", f"{cfg.get('min_flip')} logits"),
                  ("valid_only", cfg.get("valid_only")),
                  ("probes", ", ".join(cfg.get("probes", []))),
                  ("chain-of-thought budgets", ", ".join(map(str, cfg.get("cot", []))))]
        facts += [("versions", ", ".join(f"{k} {v}" for k, v in sorted(m.get("versions", {}).items())))]
        wall = m.get("wall_s", {})
        facts += [("wall time", f"{wall.get('total', float('nan')):.1f} s total; " +
                   ", ".join(f"{k} {v:.1f} s" for k, v in wall.items() if k != "total"))] if wall else []
    if cm:
        fp = cm.get("model", {})
        facts += [("composition run", f"{cm.get('command', 'validate')}: n={cm.get('n')}, seams={cm.get('seams')}, "
                   f"gated seam {cm.get('gated_seam')}, threshold {cm.get('threshold')}, "
                   f"block tokens {cm.get('block_tokens')}, blocks {cm.get('n_blocks')}, attn {cm.get('attn')}")]
        if isinstance(fp, dict) and not m:
            facts += [("fingerprint", ", ".join(f"{k}={v}" for k, v in sorted(fp.items())))]
        if cm.get("wall_s") is not None:
            facts += [("composition wall time", f"{float(cm['wall_s']):.1f} s")]
    counts = m.get("counts", {})
    validity = m.get("validity", {})
    return {"facts": [(k, "" if v is None else str(v)) for k, v in facts], "counts": sorted(counts.items()),
            "skipped": m.get("skipped", []),
            "invalid": sorted((reason_text(k), v) for k, v in m.get("invalid_reasons", {}).items()),
            "validity": sorted(validity.items()), "folder": str(run.folder), "has_manifest": bool(m)}


SECTION = register(Section(
    id="facts", title="Run facts", needs=RUN_MANIFEST, order=90, build=build_facts, template="sections/facts.html",
    intro="Model, fingerprint, dataset, case counts (valid, skipped, invalid with reasons), versions, seed and wall "
          "time."))
