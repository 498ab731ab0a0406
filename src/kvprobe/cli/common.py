"""Shared CLI helpers: consoles, progress bars, model loading with a status line."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(width=170) if not sys.stdout.isatty() else Console()  # logs: wide enough for the edit table
err_console = Console(stderr=True)


def progress_bar() -> Progress:
    """A rich progress bar on stderr (so stdout stays clean for tables)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err_console, transient=True)


ALLOW_FAILED_TOY_HELP = "load a toy folder even though its manifest records a failed held-out check"


def say(spec: str, msg: str) -> None:
    """One plain line on stderr for slow one-off work (downloading, dequantising, training), so it
    shows in logs too, where a live status line is not drawn."""
    err_console.print(f"{spec}: {msg}", highlight=False, markup=False, soft_wrap=True)


def load_with_status(spec: str, dtype: str = "float32", device: str = "cpu", attn: str = "eager",
                     allow_failed_toy: bool = False):
    """load_model with a live status line, and a plain line for each slow step (fetching, dequantising)."""
    from kvprobe.models import load_model

    with err_console.status(f"loading {spec}"):
        return load_model(spec, dtype=dtype, device=device, attn=attn, allow_failed_toy=allow_failed_toy,
                          progress=lambda msg: say(spec, msg))
