"""``kvprobe compare``: one table across `kvprobe run` folders (:mod:`kvprobe.reports.compare`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvprobe.cli import options as opt
from kvprobe.cli.common import console as stdout_console
from kvprobe.cli.common import emit_json, err_console
from kvprobe.defaults import THRESHOLD_RANGE


def compare(results_dirs: list[Path] = typer.Argument(..., help="`kvprobe run` results folders (models or runs)"),
            csv_out: Path | None = typer.Option(None, "--csv", help="also write one row per folder and strategy "
                                                                    "as CSV here"),
            json_out: opt.Json = None,
            html_out: Path | None = typer.Option(None, "--html", help="also write a self-contained comparison "
                                                                      "page here"),
            threshold: Annotated[float | None, typer.Option(
                callback=opt.threshold_option,
                show_default=f"each folder's topk.yaml, else {opt.DEFAULTS['threshold']}",
                help=f"agreement whose Wilson 95% lower bound a recommended repair and K* must reach; "
                     f"{THRESHOLD_RANGE}")] = None) -> None:
    """Compare results folders in one table: where the decision lives, the repair to use, K*, the
    composition gate and valid cases per folder, then every strategy's agreement side by side.
    ``--json`` gives the folders' summaries (the summary.json schema)."""
    from kvprobe.cli.common import usable_file
    from kvprobe.reports import compare as C

    named = {"--csv": csv_out, "--json": None if json_out in (None, "-") else Path(json_out), "--html": html_out}
    outs = [p for p in named.values() if p is not None]
    for option, p in named.items():
        if p is not None:
            usable_file(p, option)
    if len(set(outs)) < len(outs):
        from kvprobe.errors import UsageError

        raise UsageError("--csv, --json and --html name the same file; give each its own path")
    sums = C.summaries(results_dirs, threshold)
    console = err_console if json_out == "-" else stdout_console  # stdout holds the JSON alone
    heads = [C.headline_cells(s) for s in sums]
    table = Table(title="the answer, per folder", show_lines=True)
    for col in heads[0]:
        table.add_column(col, overflow="fold")
    for h in heads:
        table.add_row(*h.values())
    console.print(table)
    names, cells = C.strategy_matrix(sums)
    table = Table(title="agreement with the oracle (Wilson 95% CI, n) and share recomputed")
    table.add_column("strategy")
    for s in sums:
        table.add_column(s["model"], justify="right", overflow="fold")
    for name, row in zip(names, cells):
        table.add_row(name, *row)
    console.print(table)
    if csv_out:
        console.print(f"wrote {C.write_text(csv_out, C.to_csv(sums))}")
    emit_json(C.to_json(sums), json_out)  # the same text on stdout (-) as in a file
    if html_out:
        console.print(f"wrote {C.write_text(html_out, C.render_compare_html(sums))}")
