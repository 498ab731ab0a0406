"""The HTML report: a pure function of one or more results folders.

:func:`render_report` reads each folder's parquet, JSON and YAML files (never the probes or a
model), builds every section registered in :mod:`kvprobe.reports.sections` that some folder has
the table for, and writes one self-contained HTML file: inline CSS, figures as base64 SVG
``data:`` URIs, no script, no external resource.
Several folders give one column per model in every section. The same folders always give the
same bytes (no timestamps; SVGs with a fixed hash salt and no date).
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import ChoiceLoader, Environment, FileSystemLoader, PackageLoader, StrictUndefined, select_autoescape

from kvprobe.datasets.tokens import TOKENS
from kvprobe.errors import UsageError
from kvprobe.reports.folder import Run, load_runs
from kvprobe.reports.sections import SECTIONS, in_order
from kvprobe.reports.sections.shared import fmt
from kvprobe.reports.stats import MAX_CI_WIDTH, MIN_N, RULE
from kvprobe.results import atomic_write

TEMPLATE = "report.html"


def _env() -> Environment:
    """kvprobe's templates, then the folders of sections registered from outside kvprobe."""
    outside = sorted({s.template_dir for s in SECTIONS.values() if s.template_dir})
    loader = ChoiceLoader([PackageLoader("kvprobe.reports", "templates"), *map(FileSystemLoader, outside)])
    env = Environment(loader=loader, autoescape=select_autoescape(["html"]),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["fmt"] = fmt
    return env


def build(runs: list[Run]) -> dict:
    """The template context: the registered sections in order (only those some folder has data for) × runs,
    numbered 1, 2, ... as shown."""
    sections = []
    for sec in in_order():
        cells = [sec.build(run) for run in runs]
        if all(c is None for c in cells):
            continue
        sections.append({"id": sec.id, "title": f"{len(sections) + 1}. {sec.title}", "needs": sec.needs,
                         "intro": sec.intro, "template": sec.template, "cells": cells})
    return {"runs": runs, "sections": sections, "rule": RULE, "min_n": MIN_N, "max_ci_width": MAX_CI_WIDTH,
            "tokens_file": TOKENS}


def render_html(results_dirs) -> str:
    """The report's HTML text for ``results_dirs`` (a pure function of their files)."""
    dirs = [Path(d) for d in results_dirs]
    if not dirs:
        raise UsageError("give at least one results folder")
    runs = load_runs(dirs, tables=tuple(name for sec in SECTIONS.values() for name in sec.tables))
    return _env().get_template(TEMPLATE).render(**build(runs))


def render_report(results_dirs: list[Path], out: Path) -> Path:
    """Write the self-contained HTML report of ``results_dirs`` to ``out`` (atomically); returns ``out``.
    An ``out`` that is a folder, or cannot be written, is a :class:`UsageError` (and nothing is written)."""
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder; give the HTML file to write, e.g. {out / 'report.html'}")
    html = render_html(results_dirs)
    try:
        return atomic_write(out, lambda tmp: tmp.write_text(html, encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot write the report to {out} ({exc.strerror or exc}); give a path you can "
                         f"write") from None
