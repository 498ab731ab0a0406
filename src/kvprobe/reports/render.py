"""The HTML report: a pure function of one or more results folders.

:func:`render_report` reads each folder's parquet, JSON and YAML files (never the probes or a
model), builds every section that some folder has the table for, and writes one self-contained
HTML file: inline CSS, figures as base64 SVG ``data:`` URIs, no script, no external resource.
Several folders give one column per model in every section. The same folders always give the
same bytes (no timestamps; SVGs with a fixed hash salt and no date).
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from kvprobe.errors import KvprobeError
from kvprobe.reports.load import TTFT, Run, load_runs
from kvprobe.reports.sections import BUILDERS, fmt
from kvprobe.reports.stats import MAX_CI_WIDTH, MIN_N, RULE
from kvprobe.reports.tokens import TOKENS
from kvprobe.results import COMPOSE, EDITS, KNOCKOUT, LINEAR, LOCALITY, MANIFEST, SERVING

TEMPLATE = "report.html"

# (id, title, the tables it needs, what it shows)
SECTIONS = (
    ("notes", "1. The notes map", LOCALITY,
     "The prompt of the valid cases with the largest oracle flip. Each token is coloured by its single-position "
     "patch effect (the change in m = logit(new answer) - logit(old answer) when only that position takes the new "
     "prompt's K/V), divided by the case's oracle flip: orange moves the decision toward the new value, blue away. "
     "The field is boxed (with its new value after the arrow), the downstream span underlined, the decision token "
     "outlined; small numbers rank the strongest notes."),
    ("edits", "2. Edit strategies", EDITS,
     "Decision agreement with the oracle (full re-prefill) and decision recovery per strategy, with 95% CIs; then the "
     "cost of each strategy (share of tokens recomputed) against its agreement. Chain-of-thought budgets side by side."),
    ("locality", "3. Locality", LOCALITY,
     "Recovery when the k downstream positions with the largest single-position effect take the new K/V (top-k) "
     "against k random downstream positions (the control), and the field or downstream span one layer at a time."),
    ("linear", "4. Linear probes", LINEAR,
     "Held-out accuracy (grouped by template) of a logistic probe for the value's side, by layer, at the field and "
     "at the notes; the write depth (first layer reaching the threshold, residual stream) and the commit depth "
     "(from which the logit lens agrees with the decision) are marked."),
    ("knockout", "5. Knockout", KNOCKOUT,
     "How often hiding positions from the decision token flips its answer (top-k notes, field, random-k control; by "
     "layer band, on the stale and on the oracle cache), and which attention heads carry the edit when patched one "
     "at a time."),
    ("topk", "6. Top-K", "topk.yaml",
     "Agreement of field + top-K recompute with the oracle on held-out cases, by K, with K* marked; then the "
     "exported configuration verbatim."),
    ("compose", "7. Composition", f"{COMPOSE} / {TTFT}",
     "Composed caches (precompiled blocks spliced with re-rotated keys and s seam tokens recomputed) against a full "
     "recompute: decision agreement and logit cosine by seam size, with and without re-rotation; time-to-first-token "
     "speedup where a benchmark result is present."),
    ("serving", "8. Serving", SERVING,
     "The erratum against the in-prefix edit on a real vLLM server under Poisson load (kvprobe serve-bench): the "
     "prefix-cache hit rate from the server's /metrics counters and from each response's cached_tokens, against the "
     "block-granularity ceiling (whole KV blocks of a prefix an earlier request filled, never the last token); "
     "time to first token and throughput against the offered load; and how often each arm's answer agrees with "
     "the oracle, the greedy answer on the prompt with the current value written in place."),
    ("facts", "9. Run facts", MANIFEST,
     "Model, fingerprint, dataset, case counts (valid, skipped, invalid with reasons), versions, seed and wall time."),
)


def _env() -> Environment:
    env = Environment(loader=PackageLoader("kvprobe.reports", "templates"), autoescape=select_autoescape(["html"]),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["fmt"] = fmt
    return env


def build(runs: list[Run]) -> dict:
    """The template context: sections (only those some folder has data for) × runs."""
    sections = []
    for sid, title, needs, intro in SECTIONS:
        cells = [BUILDERS[sid](run) for run in runs]
        if all(c is None for c in cells):
            continue
        sections.append({"id": sid, "title": title, "needs": needs, "intro": intro, "cells": cells})
    return {"runs": runs, "sections": sections, "rule": RULE, "min_n": MIN_N, "max_ci_width": MAX_CI_WIDTH,
            "tokens_file": TOKENS}


def render_html(results_dirs) -> str:
    """The report's HTML text for ``results_dirs`` (a pure function of their files)."""
    dirs = [Path(d) for d in results_dirs]
    if not dirs:
        raise KvprobeError("give at least one results folder")
    runs = load_runs(dirs)
    return _env().get_template(TEMPLATE).render(**build(runs))


def render_report(results_dirs: list[Path], out: Path) -> Path:
    """Write the self-contained HTML report of ``results_dirs`` to ``out`` (atomically); returns ``out``."""
    from kvprobe.results import _atomic

    html = render_html(results_dirs)
    return _atomic(Path(out), lambda tmp: tmp.write_text(html, encoding="utf-8"))
