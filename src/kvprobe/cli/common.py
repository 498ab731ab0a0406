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


def load_with_status(spec: str, dtype: str = "float32", device: str = "cpu"):
    """load_model with a live status line (fetching, dequantising, training a toy...)."""
    from kvprobe.models import load_model

    with err_console.status(f"loading {spec}") as status:
        return load_model(spec, dtype=dtype, device=device, progress=lambda msg: status.update(f"{spec}: {msg}"))
