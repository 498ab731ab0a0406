"""``kvprobe report``: one self-contained HTML report from one or more results folders."""

from __future__ import annotations

from pathlib import Path

import typer

from kvprobe.cli.common import console
from kvprobe.errors import UsageError


def report(results_dirs: list[Path] = typer.Argument(..., help="results folders of `kvprobe run` / `validate` / `serve-bench` / `weight-edit` / `memory` (or one `kvprobe sweep` folder); "
                                                                "several give one column per model"),
           out: Path | None = typer.Option(None, show_default="RESULTS_DIR/report.html for one folder, report.html "
                                                              "for several", help="HTML file to write")) -> None:
    """Render the answer (headline), the notes map, edit strategies, locality, linear probes, knockout,
    top-K, composition, serving and run facts into one HTML file with no external resources."""
    from kvprobe.cli.common import usable_file
    from kvprobe.reports.html import render_report
    from kvprobe.results import SWEEP_MANIFEST

    sweeps = [d for d in results_dirs if (d / SWEEP_MANIFEST).exists()]
    if sweeps:  # a sweep folder has its own page
        if len(results_dirs) > 1 or out is not None:
            raise UsageError(f"{sweeps[0]} is a `kvprobe sweep` folder: its report is rendered alone, into the "
                             f"folder (give it as the only folder, without --out)")
        from kvprobe.reports.sweep import render_sweep_report

        console.print(f"wrote {render_sweep_report(sweeps[0])}")
        return
    out = usable_file(out or (results_dirs[0] / "report.html" if len(results_dirs) == 1 else Path("report.html")))
    path = render_report(list(results_dirs), out)
    console.print(f"wrote {path}")
