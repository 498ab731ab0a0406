"""``kvprobe models``: list the models kvprobe knows, and fetch a bundled one."""

from __future__ import annotations

import typer

from kvprobe.cli import options as opt
from kvprobe.cli.common import console, emit_json, say

models_app = typer.Typer(help="List the models kvprobe knows, and fetch a bundled one.", invoke_without_command=True)


@models_app.callback()
def models_list(ctx: typer.Context, as_json: opt.Json = None) -> None:
    """List bundled aliases, tiny and toy models, with family, size and cache state."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Table

    from kvprobe.models import BUNDLED, is_cached, tiny_names
    from kvprobe.models.tiny import TINY_VARIANTS
    from kvprobe.models.toy_folder import toy_rows

    columns = ("name", "family", "params", "download", "cached", "notes")
    rows = [(b.alias, b.family, b.params, f"{b.download_mb} MB", "yes" if is_cached(b.alias) else "no",
             b.note or b.description) for b in BUNDLED.values()]
    rows += [(name, TINY_VARIANTS[name][0] if name in TINY_VARIANTS else name[5:], "~0.1M", "-", "built",
              "random weights, for exact mechanics tests") for name in tiny_names()]
    rows += [tuple(row) for row in toy_rows()]
    emit_json([dict(zip(columns, row)) for row in rows], as_json)
    if as_json == "-":
        return
    table = Table(title="kvprobe models")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)


@models_app.command("fetch")
def models_fetch(alias: str = typer.Argument(..., help="a bundled alias, see `kvprobe models`")) -> None:
    """Download, verify and dequantise a bundled model once, into the kvprobe cache."""
    import time

    from kvprobe.models import fetch

    start = time.perf_counter()
    folder = fetch(alias, progress=lambda msg: say(alias, msg))
    console.print(f"{alias} ready at {folder} ({time.perf_counter() - start:.1f} s)")
