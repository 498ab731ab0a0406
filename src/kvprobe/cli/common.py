"""Shared CLI helpers: consoles, progress (a bar on a terminal, plain lines in a log), model
loading with a status line, and the checks every command that writes a folder makes first.

Nothing here imports torch: ``kvprobe --help`` must stay fast.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from kvprobe.errors import UsageError

LOG_WIDTH = 1000  # off a terminal: wide enough that no table cell or line is cut


def _width(stream) -> int | None:
    """On a terminal, rich's own width (the terminal's size, or ``COLUMNS`` when set); off a terminal
    (a log, a pipe), :data:`LOG_WIDTH`, so that every cell and line comes out in full (tables still fit
    their content). ``COLUMNS`` is not read there: pytest-xdist's workers, for one, set it to 80."""
    return None if stream.isatty() else LOG_WIDTH


# no emoji codes: "selective:abc:causal" must not print as "selective🔤causal"
console = Console(width=_width(sys.stdout), emoji=False)
err_console = Console(stderr=True, width=_width(sys.stderr), emoji=False)

class PlainProgress:
    """The part of rich's Progress that commands use, printed as plain lines on stderr: one when a
    task starts, then at most one every ``every`` seconds, and one when it completes. For logs and
    pipes, where a live bar is not drawn."""

    def __init__(self, every: float = 10.0):
        self.every = every
        self.tasks: dict[int, dict] = {}

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **_) -> int:
        task = len(self.tasks)
        self.tasks[task] = {"description": description, "total": total, "completed": 0, "start": time.monotonic(),
                            "said": 0.0, "done_said": False}
        self._say(task)
        return task

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, completed=self.tasks[task]["completed"] + advance)

    def update(self, task: int, description: str | None = None, completed: float | None = None,
               total: float | None = None, **_) -> None:
        t = self.tasks[task]
        changed = description is not None and description != t["description"]
        if description is not None:
            t["description"] = description
        if total is not None:
            t["total"] = total
        if completed is not None:
            t["completed"] = completed
        done = t["total"] is not None and t["completed"] >= t["total"]
        if changed or (done and not t["done_said"]) or (not done and time.monotonic() - t["said"] >= self.every):
            self._say(task)

    def _say(self, task: int) -> None:
        t = self.tasks[task]
        t["said"] = time.monotonic()
        elapsed = t["said"] - t["start"]
        count = f" {t['completed']:g}/{t['total']:g}" if t["total"] is not None else ""
        left = ""
        if t["total"] and 0 < t["completed"] < t["total"]:
            left = f", about {elapsed / t['completed'] * (t['total'] - t['completed']):.0f} s left"
        t["done_said"] = t["total"] is not None and t["completed"] >= t["total"]
        err_console.print(f"{t['description']}:{count} ({elapsed:.0f} s{left})", highlight=False, markup=False,
                          soft_wrap=True)


def progress_bar() -> Progress | PlainProgress:
    """A rich progress bar on stderr (so stdout stays clean for tables) on a terminal; plain lines
    on stderr otherwise."""
    if not err_console.is_terminal:
        return PlainProgress()
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err_console, transient=True)



def progress_of(bar):
    """A step's progress (:meth:`kvprobe.experiment.Experiment.step`): ``(label, total)`` adds a line to ``bar``
    and gives the tick that advances it."""
    def start(label: str, total: int | None):
        task = bar.add_task(label, total=total)
        return lambda: bar.advance(task)

    return start

def say(spec: str, msg: str) -> None:
    """One plain line on stderr for slow one-off work (downloading, dequantising, training), so it
    shows in logs too, where a live status line is not drawn."""
    err_console.print(f"{spec}: {msg}", highlight=False, markup=False, soft_wrap=True)


def load_with_status(spec: str, dtype: str = "float32", device: str = "cpu", attn: str = "eager",
                     allow_failed_toy: bool = False, device_map: str | None = None):
    """load_model with a live status line, and a plain line for each slow step (fetching, dequantising)."""
    from kvprobe.models import load_model

    kwargs = {"dtype": dtype, "device": device, "attn": attn, "allow_failed_toy": allow_failed_toy,
              "device_map": device_map, "progress": lambda msg: say(spec, msg)}
    if not err_console.is_terminal:  # a log: no live line; the slow steps say themselves
        return load_model(spec, **kwargs)
    with err_console.status(f"loading {spec}"):
        return load_model(spec, **kwargs)


def executor_for(ctx, executor: str, workers: int, ray_address: str | None, gpus_per_worker: float,
                 threads_per_worker: int, retries: int):
    """The executor of a command's --executor options (before any model is loaded: Ray missing or
    an address nothing answers at is refused here); a Ray-only option given with --executor serial
    is refused, not ignored."""
    from kvprobe.cli.options import RAY_ONLY
    from kvprobe.executor import make_executor

    if executor == "serial":
        given = [name for name in RAY_ONLY if given_on_command_line(ctx, name)]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} applies to --executor ray only; add --executor ray or "
                             f"leave it out")
    ex = make_executor(executor, workers, ray_address, gpus_per_worker, threads_per_worker, retries,
                       say=lambda message: err_console.print(message, highlight=False, markup=False, soft_wrap=True))
    if executor == "ray":
        try:
            ex.prepare()
        except BaseException:
            ex.close()
            raise
    return ex


def given_on_command_line(ctx, name: str) -> bool:
    """Whether option ``name`` (its parameter name) was given, not left at its default."""
    try:  # typer >= 0.20 vendors click: its own ParameterSource
        from typer._click.core import ParameterSource
    except ImportError:  # pragma: no cover
        from click.core import ParameterSource
    return ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)


def usable_out(out: Path, option: str = "--out") -> Path:
    """Refuse, before any work, an output folder that is a file or cannot be written."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{option} {out} is a file; give a folder (new or one this command wrote before)")
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"{option} {out} cannot be made: {probe} is a file")
    try:  # the real test (os.access says yes to root, and to read-only mounts such as /sys)
        Path(tempfile.mkdtemp(dir=probe, prefix=".kvprobe-write-check-")).rmdir()
    except OSError as exc:
        raise UsageError(f"{option} {out} cannot be written ({probe}: {exc.strerror or exc}); give a folder you "
                         f"can write") from None
    return out


def usable_file(out: Path, option: str = "--out") -> Path:
    """Refuse, before any work, an output file that is a folder or whose folder cannot be written."""
    if out.is_dir():
        raise UsageError(f"{option} {out} is a folder; give a file path")
    if out.exists() and not out.is_file():  # written by renaming a temporary file over it: /dev/null would be replaced
        raise UsageError(f"{option} {out} is not a regular file (a device, pipe or socket); give a file path")
    usable_out(out.parent, option)  # Path("x").parent is Path(".")
    return out


def emit_json(data, dest: str | None) -> None:
    """``--json``'s output: ``data`` as :func:`kvprobe.files.json_text` on stdout for ``-``, else the same
    text written atomically to the path (a line on the console says where); nothing without ``dest``."""
    from kvprobe.results import atomic_write, json_text

    if dest is None:
        return
    text = json_text(data)
    if dest == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    path = atomic_write(usable_file(Path(dest), "--json"), lambda tmp: tmp.write_text(text))
    console.print(f"wrote {path}", highlight=False)
