"""The ``kvprobe`` command line: thin typer wrappers over the Python API.

Every user error is a :class:`~kvprobe.errors.KvprobeError`, printed as one line with a
non-zero exit; tracebacks are for bugs only.
"""

from __future__ import annotations

import sys

import typer
from rich.table import Table

from kvprobe.errors import KvprobeError

try:  # typer >= 0.20 vendors click, and keeps Exit and Abort in typer.exceptions
    from typer._click.exceptions import ClickException
    from typer.exceptions import Abort, Exit
except ImportError:  # pragma: no cover
    from click.exceptions import Abort, ClickException, Exit

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Probe, edit and compose a language model's KV cache.")
models_app = typer.Typer(help="List, fetch and inspect models.", invoke_without_command=True)
app.add_typer(models_app, name="models")

from kvprobe.cli.common import console, err_console  # noqa: E402
from kvprobe.cli.datasets import datasets_app  # noqa: E402
from kvprobe.cli.toy import toy_app  # noqa: E402

from kvprobe.cli.edit import edit  # noqa: E402
from kvprobe.cli.run import export_topk, run  # noqa: E402
from kvprobe.cli.validate import validate  # noqa: E402
from kvprobe.cli.report import report  # noqa: E402
from kvprobe.cli.serve import serve_app, serve_bench  # noqa: E402

app.add_typer(datasets_app, name="datasets")
app.add_typer(toy_app, name="toy")
app.command("edit")(edit)
app.command("run")(run)
app.command("export-topk")(export_topk)
app.command("validate")(validate)
app.command("report")(report)
app.add_typer(serve_app, name="serve")
app.command("serve-bench")(serve_bench)


@models_app.callback()
def models_list(ctx: typer.Context) -> None:
    """List bundled aliases, tiny and toy models, with family, size and cache state."""
    if ctx.invoked_subcommand is not None:
        return
    from kvprobe.models import BUNDLED, is_cached, tiny_names
    from kvprobe.models.tiny import TINY_VARIANTS

    table = Table(title="kvprobe models")
    for col in ("name", "family", "params", "download", "cached", "notes"):
        table.add_column(col)
    for b in BUNDLED.values():
        table.add_row(b.alias, b.family, b.params, f"{b.download_mb} MB", "yes" if is_cached(b.alias) else "no",
                      b.note or b.description)
    for name in tiny_names():
        fam = TINY_VARIANTS[name][0] if name in TINY_VARIANTS else name[5:]
        table.add_row(name, fam, "~0.1M", "-", "built", "random weights, for exact mechanics tests")
    for row in _toy_rows():
        table.add_row(*row)
    console.print(table)


def _toy_rows() -> list[tuple[str, ...]]:
    from kvprobe.models.toy_folder import toy_rows

    return toy_rows()


@models_app.command("fetch")
def models_fetch(alias: str = typer.Argument(..., help="a bundled alias, see `kvprobe models`")) -> None:
    """Download, verify and dequantise a bundled model once, into the kvprobe cache."""
    import time

    from kvprobe.cli.common import say
    from kvprobe.models import fetch

    start = time.perf_counter()
    with console.status(f"fetching {alias}"):
        folder = fetch(alias, progress=lambda msg: say(alias, msg))
    console.print(f"{alias} ready at {folder} ({time.perf_counter() - start:.1f} s)")


def main() -> None:
    """Console entry point: one-line errors, resumable interrupts."""
    try:
        app(standalone_mode=False)
    except KvprobeError as exc:
        err_console.print(f"[bold red]error:[/bold red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted; finished work is saved, run the same command again to resume")
        sys.exit(130)
    except ClickException as exc:  # usage errors, in non-standalone mode
        err_console.print(f"[bold red]error:[/bold red] {exc.format_message()}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except Exit as exc:
        sys.exit(exc.exit_code)
    except Abort:
        sys.exit(1)
