"""What a calibration hands back, from its measured pairs: the per-(field, candidate) summary
table (agreement, agreement on changed pairs, spurious flips, each with the confidence sequence's
interval; cost), each field's relevance, and the ``field_policy.yaml`` mapping
(:mod:`kvprobe.field_policy` reads it back). :func:`kvprobe.calibrate.engine.calibrate` measures;
its ``FieldResult`` per field and ``CalibrationSpec`` are what ``results`` and ``spec`` are here (not
imported: the engine imports this module).
"""

from __future__ import annotations

import pandas as pd

from kvprobe.stopping.rule import relevance, verdict_of
from kvprobe.stopping.sequence import ALPHA_LOWER, ALPHA_UPPER, Sequence


def _share(seq: Sequence, k: int, n: int) -> dict:
    return {"k": int(k), "n": int(n), "value": k / n if n else float("nan"), "lo": seq.lower(k, n),
            "hi": seq.upper(k, n)}


def summarize(rows: pd.DataFrame, results: list, seq: Sequence, change_seq: Sequence,
              candidates: list[str]) -> pd.DataFrame:
    """One row per (field, strategy): agreement with the oracle over the candidate's own pairs
    (``n``: a chain measures one candidate a pair, :mod:`kvprobe.stopping.sequence`), on the pairs
    where the oracle's decision changed, and spurious flips where it did not, each with its interval
    from the confidence sequence; recompute share and repair time; the field's relevance."""
    out = []
    for res in results:
        got = rows[(rows.field == res.name) & rows.skip.isna()] if len(rows) else rows
        if len(got):  # skipped pairs' rows hold no verdicts: the measured ones' columns are booleans
            got = got.astype({"agree": bool, "changed": bool})
        ch = _share(change_seq, res.changed, res.pairs)
        oracle = got[got.strategy == "oracle"] if len(got) else got
        oracle_s = float(oracle.to_decision_s.median()) if len(oracle) else float("nan")
        # the share of the new prompt (before its decision token) the oracle took from the old cache
        reuse = (float((1 - oracle.tokens_recomputed / (oracle.tokens_total - 1)).mean()) if len(oracle)
                 else float("nan"))
        for s in candidates:
            g = got[got.strategy == s] if len(got) else got
            changed, same = (g[g.changed], g[~g.changed]) if len(g) else (g, g)
            agree = _share(seq, int(g.agree.sum()) if len(g) else 0, len(g))
            on_changed = _share(seq, int(changed.agree.sum()) if len(changed) else 0, len(changed))
            flips = int((~same.agree).sum()) if len(same) else 0
            fl = _share(seq, len(same) - flips, len(same))  # the no-flip share's interval, turned around
            out.append({
                "field": res.name, "strategy": s, "pairs": res.pairs, "n": len(g), "skipped": res.skipped,
                "change_rate": ch["value"], "change_lo": ch["lo"], "change_hi": ch["hi"],
                "agree": agree["value"], "agree_lo": agree["lo"], "agree_hi": agree["hi"],
                "n_changed": len(changed), "agree_changed": on_changed["value"], "agree_changed_lo": on_changed["lo"],
                "agree_changed_hi": on_changed["hi"], "n_unchanged": len(same), "spurious_flips": flips,
                "flip_rate": flips / len(same) if len(same) else float("nan"), "flip_lo": 1 - fl["hi"],
                "flip_hi": 1 - fl["lo"] if len(same) else 1.0,
                "frac_recomputed": float(g.frac_recomputed.mean()) if len(g) and "frac_recomputed" in g else float("nan"),
                "to_decision_s": float(g.to_decision_s.median()) if len(g) and "to_decision_s" in g
                else float("nan"),
                "errors": int(g.error.notna().sum()) if "error" in g else 0,
                "verdict": verdict_of(seq, int(g.agree.sum()) if len(g) else 0, len(g)),
                "oracle_s": oracle_s, "oracle_prefix_share": reuse, "chosen": res.chosen == s,
                "seconds": res.seconds,
            })
    return pd.DataFrame(out)


def relevance_of(res, change_seq: Sequence) -> str:
    return relevance(res.verdict, res.changed, res.pairs, change_seq)


def policy_of(lm, spec, results: list, summary: pd.DataFrame, seq: Sequence,
              change_seq: Sequence, candidates: list[str], max_pairs: int) -> dict:
    """The per-field policy (kvprobe.field_policy reads it)."""
    from kvprobe.field_policy import SCHEMA, method_line
    from kvprobe.identity import ModelIdentity

    fields = {}
    for res in results:
        rows = summary[summary.field == res.name]
        fields[res.name] = {
            "repair": res.chosen, "verdict": res.verdict, "reason": res.reason,
            "relevance": relevance_of(res, change_seq), "pairs": res.pairs, "skipped_pairs": res.skipped,
            "same_id_pairs": res.degenerate,
            "change_rate": {"value": round(res.changed / res.pairs, 4) if res.pairs else None, "k": res.changed,
                            "n": res.pairs, "lo": round(change_seq.lower(res.changed, res.pairs), 4),
                            "hi": round(change_seq.upper(res.changed, res.pairs), 4)},
            "seconds": round(res.seconds, 1),
            "strategies": {r.strategy: {"agreement": {"k": res.counts[r.strategy][0],
                                                      "value": round(r.agree, 4), "lo": round(r.agree_lo, 4),
                                                      "hi": round(r.agree_hi, 4), "n": int(r.n)},
                                        "spurious_flips": int(r.spurious_flips), "n_unchanged": int(r.n_unchanged),
                                        "flip_hi": round(r.flip_hi, 4), "verdict": r.verdict,
                                        "frac_recomputed": round(r.frac_recomputed, 4),
                                        "to_decision_s": round(r.to_decision_s, 4) if r.n else None}
                           for r in rows.itertuples()},
        }
    return {"kvprobe_field_policy": SCHEMA, "model": ModelIdentity.of_model(lm).as_dict(),
            "template": {"path": spec.path, "sha256": spec.digest(), "prompt_sha256": spec.prompt_digest(),
                         "fields": list(spec.fields)},
            "threshold": seq.threshold, "alpha_lower": ALPHA_LOWER, "alpha_upper": ALPHA_UPPER,
            "procedure": seq.procedure, "candidates": candidates, "max_pairs": max_pairs, "method": method_line(seq),
            "default": "oracle", "fields": fields}
