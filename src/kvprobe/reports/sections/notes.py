"""The notes map: the prompt of the valid cases with the largest oracle flip, each token coloured by
its single-position patch effect, and the share of effect by token kind over cases."""

from __future__ import annotations

import pandas as pd
from markupsafe import Markup, escape

from kvprobe.datasets.tokens import TOKENS
from kvprobe.probes.base import single_position_sweep
from kvprobe.reports.figures import finite
from kvprobe.reports.folder import Run
from kvprobe.reports.sections.shared import decision_rows, guard, guard_note
from kvprobe.reports.sections.registry import Section, register
from kvprobe.reports.stats import Stat, nanfloat
from kvprobe.results import CONCENTRATION, LOCALITY, VALIDITY

N_MAP_CASES = 3  # cases shown in the notes map
N_OPEN = 1  # of them, shown unfolded (the rest folded, each behind a one-line summary)
N_RANKED = 5  # top notes numbered in the map
N_SUMMARY = 3  # top notes named in a folded case's summary line


def token_name(text: str) -> str:
    """A token as the page names it: its text in quotes, line breaks as \u21b5, surrounding spaces dropped
    (a token of spaces only is \u00b7)."""
    shown = text.replace("\n", "\u21b5").strip(" \t") or "\u00b7"
    return f'"{shown}"'


def _rgba(norm: float, scale: float) -> str:
    if not finite(norm) or scale <= 0:
        return "transparent"
    a = min(1.0, abs(norm) / scale) * 0.85
    r, g, b = (213, 94, 0) if norm > 0 else (0, 114, 178)
    return f"rgba({r},{g},{b},{a:.3f})"


def _token_html(text: str, cls: str, style: str, title: str, extra: str = "") -> str:
    lead = text[: len(text) - len(text.lstrip(" \t"))]
    core = text[len(lead):]
    shown = core.replace("\n", "\u21b5\n") if core else ("\u00b7" if not lead else "")
    return (f'{escape(lead)}<span class="{cls}" style="{style}" title="{escape(title)}">{escape(shown)}'
            f'{extra}</span>')


def _case_map(run: Run, case_id: str, sweep: pd.DataFrame, tokens: pd.DataFrame) -> dict:
    g = sweep.sort_values("position")
    flip = nanfloat(g["oracle_flip"].iloc[0])
    effects = dict(zip(g["position"].astype(int), g["value"].astype(float)))
    norms = {p: (e / flip if flip else float("nan")) for p, e in effects.items()}
    scale = max((abs(v) for v in norms.values() if finite(v)), default=0.0)
    n_pos = int(g["n_positions"].iloc[0]) if "n_positions" in g else max(effects) + 1
    t = tokens[tokens["case_id"] == case_id].sort_values("position") if len(tokens) else tokens
    if len(t):
        items = list(zip(t["position"].astype(int), t["token"], t["token_new"], t["kind"], t["region"]))
    else:  # no token text stored: one chip per position
        kinds = dict(zip(g["position"].astype(int), g["kind"]))
        regions = dict(zip(g["position"].astype(int), g["region"]))
        items = [(p, f" {kinds.get(p, '?')}{p}", f" {kinds.get(p, '?')}{p}", kinds.get(p, "?"), regions.get(p, "?"))
                 for p in range(n_pos)] + [(n_pos, " decision", " decision", "decision", "decision")]
    down = g[g["region"] == "downstream"]
    sign = 1.0 if flip >= 0 else -1.0
    ranked = (down.assign(s=down["value"] * sign).sort_values(["s", "position"], ascending=[False, True])
              ["position"].astype(int).tolist()[:N_RANKED])
    rank = {p: i + 1 for i, p in enumerate(ranked)}
    texts = {p: (text, kind) for p, text, _, kind, _ in items}
    # a note by its token's text and position; by kind and position where the folder has no token text
    notes = [{"position": p, "name": f"{token_name(texts[p][0])} (pos {p})" if len(t) and p in texts
              else f"pos {p} ({texts.get(p, ('', '?'))[1]})"} for p in ranked]
    field_pos = [p for p, *_, region in items if region == "field"]
    new_value = "".join(tn for p, _, tn, _, region in items if region == "field").strip()
    parts = []
    for p, text, _, kind, region in items:
        cls = f"tok {region}"
        e, nm = effects.get(p), norms.get(p)
        if region == "decision":
            title = f"position {p}: the decision token (its logits give the answer)"
            parts.append(_token_html(text, "tok decision", "", title))
            continue
        title = (f"position {p} \u00b7 {kind} \u00b7 {region} \u00b7 effect {e:+.4g} logits "
                 f"({nm:+.3f} of the oracle flip)" if e is not None and finite(nm) else f"position {p} \u00b7 {kind}")
        extra = f'<sup class="rank">{rank[p]}</sup>' if p in rank else ""
        parts.append(_token_html(text, cls, f"background:{_rgba(nm if nm is not None else float('nan'), scale)}",
                                 title, extra))
        if field_pos and p == field_pos[-1]:
            parts.append(f'<span class="newval" title="the new value">\u2192 {escape(new_value)}</span>')
    return {"case_id": case_id, "flip": flip, "scale": scale, "html": Markup("".join(parts)),
            "ranked": ranked, "notes": notes, "has_text": bool(len(t))}


def build_notes(run: Run) -> dict | None:
    loc = run.table(LOCALITY)
    if loc.empty or "set" not in loc:
        return None
    sweep = single_position_sweep(loc)
    if sweep.empty:
        return None
    sweep = decision_rows(sweep)
    per_case = sweep.groupby("case_id").agg(flip=("oracle_flip", "first"))
    validity = run.table(VALIDITY)
    valid_ids = (set(validity[validity["valid"].astype(bool) & ~validity["control"].astype(bool)]["case_id"])
                 if len(validity) else set())
    pool = per_case[per_case.index.isin(valid_ids)]
    warning = None
    if pool.empty:
        pool = per_case
        warning = ("No probed case is valid (the model does not answer correctly under both values), so these are "
                   "probed cases that are not valid: read them as mechanics, not as the model's behaviour.")
    pool = pool.assign(a=pool["flip"].abs(), cid=pool.index).sort_values(["a", "cid"], ascending=[False, True])
    tokens = run.table(TOKENS)
    info = validity.set_index("case_id") if len(validity) else pd.DataFrame()
    conc = run.table(CONCENTRATION)
    cases = []
    for i, cid in enumerate(pool.index[:N_MAP_CASES]):
        c = _case_map(run, cid, sweep[sweep["case_id"] == cid], tokens)
        if cid in info.index:
            row = info.loc[cid]
            c.update(domain=row.get("domain"), field=row.get("field"), old=row.get("old_value"),
                     new=row.get("new_value"), expected_old=row.get("expected_old"),
                     expected_new=row.get("expected_new"), valid=bool(row.get("valid")))
        c["small_flip"] = abs(c["flip"]) < run.min_flip
        c["open"] = i < N_OPEN
        kinds = conc[(conc["case_id"] == cid) & (conc["metric"] == "kind_share")] if len(conc) else conc
        c["kinds"] = [{"kind": k, "share": v, "n_tokens": int(n)}
                      for k, v, n in zip(kinds.get("kind", []), kinds.get("value", []), kinds.get("n_tokens", []))]
        cases.append(c)
    agg, agg_note = [], None
    if len(conc) and "kind" in conc:
        shares = decision_rows(conc[conc["metric"] == "kind_share"])
        used, excluded, guarded = guard(shares, run.min_flip)
        agg_note = guard_note(excluded, guarded, shares["case_id"].nunique(), run.min_flip)
        if guarded:
            for kind, gk in used.groupby("kind", sort=True):
                agg.append({"kind": kind, "stat": Stat.of(gk["value"]),
                            "n_tokens": Stat.of(gk["n_tokens"]).mean})
    return {"cases": cases, "warning": warning, "kinds": agg, "kinds_note": agg_note, "min_flip": run.min_flip,
            "n_summary": N_SUMMARY,
            "n_probed": len(per_case), "n_valid": len(set(per_case.index) & valid_ids),
            "text_missing": not len(tokens)}


SECTION = register(Section(
    id="notes", title="The notes map", needs=LOCALITY, order=10, build=build_notes, template="sections/notes.html",
    intro="The prompt of the valid cases with the largest oracle flip. Each token is coloured by its single-position "
          "patch effect (the change in m = logit(new answer) - logit(old answer) when only that position takes the "
          "new prompt's K/V), divided by the case's oracle flip: orange moves the decision toward the new value, "
          "blue away. The field is boxed (with its new value after the arrow), the downstream span underlined, the "
          "decision token outlined; small numbers rank the strongest notes."))
