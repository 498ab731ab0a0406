"""``kvprobe report``: one self-contained HTML report from one or more results folders."""

from __future__ import annotations

from pathlib import Path

import typer

from kvprobe.cli.common import console


def report(results_dirs: list[Path] = typer.Argument(..., help="results folders of `kvprobe run` / `validate` / `serve-bench`; "
                                                                "several give one column per model"),
           out: Path | None = typer.Option(None, show_default="RESULTS_DIR/report.html for one folder, report.html "
                                                              "for several", help="HTML file to write")) -> None:
    """Render the notes map, edit strategies, locality, linear probes, knockout, top-K, composition,
    serving and run facts into one HTML file with no external resources."""
    from kvprobe.cli.common import usable_file
    from kvprobe.reports.html import render_report

    out = usable_file(out or (results_dirs[0] / "report.html" if len(results_dirs) == 1 else Path("report.html")))
    path = render_report(list(results_dirs), out)
    console.print(f"wrote {path}")
