"""The ``kvprobe`` command line: thin typer wrappers over the Python API.

Every user error is a :class:`~kvprobe.errors.KvprobeError`, printed as one line with its exit
code (see :mod:`kvprobe.errors` and docs/cli.md); tracebacks are for bugs only. The command
modules import torch and transformers inside their commands, so ``kvprobe --help`` is fast.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import threading

import typer

from kvprobe import __version__
from kvprobe.cli.calibrate import calibrate, check_policy
from kvprobe.cli.common import console, err_console
from kvprobe.cli.compare import compare
from kvprobe.cli.datasets import datasets_app
from kvprobe.cli.diagnose import diagnose
from kvprobe.cli.edit import edit, strategies
from kvprobe.cli.memory import memory
from kvprobe.cli.models import models_app
from kvprobe.cli.report import report
from kvprobe.cli.run import export_topk, run
from kvprobe.cli.serve import serve_app, serve_bench
from kvprobe.cli.sweep import sweep
from kvprobe.cli.toy import toy_app
from kvprobe.cli.validate import validate
from kvprobe.cli.weight_edit import weight_edit
from kvprobe.errors import EXIT_CODES, KvprobeError

try:  # typer >= 0.20 vendors click, and keeps Exit and Abort in typer.exceptions
    from typer._click.exceptions import ClickException
    from typer.exceptions import Abort, Exit
except ImportError:  # pragma: no cover
    from click.exceptions import Abort, ClickException, Exit

HELP = ("Probe, edit and compose a language model's KV cache.\n\n"
        + "Exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()) + ".")
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 120}
INTERRUPTED = "interrupted; finished work is saved: rerun the same command to resume"
TERMINATED = "terminated (SIGTERM); finished work is saved: rerun the same command to resume"
# OSErrors that are the machine's, not kvprobe's: one line and exit 4 (a full disk, a quota, a
# read-only file system, a permission denied)
ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, help=HELP, context_settings=CONTEXT)
app.add_typer(models_app, name="models")
app.add_typer(datasets_app, name="datasets")
app.add_typer(toy_app, name="toy")
app.command("run")(run)
app.command("edit")(edit)
app.command("weight-edit")(weight_edit)
app.command("memory")(memory)
app.command("sweep")(sweep)
app.command("calibrate")(calibrate)
app.command("check-policy")(check_policy)
app.command("diagnose")(diagnose)
app.command("strategies")(strategies)
app.command("validate")(validate)
app.command("export-topk")(export_topk)
app.command("report")(report)
app.command("compare")(compare)
app.add_typer(serve_app, name="serve")
app.command("serve-bench")(serve_bench)


def _version(value: bool) -> None:
    if value:
        console.print(f"kvprobe {__version__}", highlight=False)
        raise Exit(0)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print kvprobe's version and exit")) -> None:
    """Probe, edit and compose a language model's KV cache."""


def _quiet_third_parties() -> None:
    """No progress bars or advisory warnings from Hugging Face libraries in kvprobe's output: it
    prints its own progress (as plain lines when the output is not a terminal)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("matplotlib").setLevel(logging.ERROR)  # "building the font cache" on a new machine


def _error(message: str) -> None:
    """One line on stderr; the message is printed as it is (no rich markup: ``a:b:c`` stays)."""
    err_console.print("error: " + " ".join(message.split()), style="bold red" if err_console.is_terminal else None,
                      highlight=False, soft_wrap=True, markup=False)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt: the same unwinding (finished parts
    kept, no half-written file), then exit 143 (128 + 15) instead of 130."""


_terminated: list[int] = []


def _on_sigterm(signum, frame) -> None:
    _terminated.append(signum)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the unwinding short
    raise Terminated()


def _disk_error(exc: OSError) -> str:
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"the disk is full{where}: {exc.strerror or exc}; free some space and rerun the same command "
                f"(finished work is kept)")
    return f"{exc.strerror or exc}{where}; kvprobe needs to write there: give a folder you can write"


def _run_app() -> int:
    from typer.main import get_command

    from kvprobe.cli.argv import bare_json, check_args

    try:
        args = bare_json(sys.argv[1:])
        check_args(get_command(app), args)  # before anything runs
        code = app(args=args, standalone_mode=False)
    except KvprobeError as exc:
        _error(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:  # outside typer's own handling (which returns 130)
        code = 130
    except ClickException as exc:  # usage errors, in non-standalone mode
        _error(exc.format_message())
        return exc.exit_code
    except Exit as exc:
        code = exc.exit_code
    except Abort:
        code = 130
    except OSError as exc:
        if exc.errno not in ENVIRONMENT_ERRNOS:
            raise  # a bug: keep its traceback
        _error(_disk_error(exc))
        return 4
    if code == 130 and _terminated:
        code = 143
    if code in (130, 143):
        err_console.print(TERMINATED if code == 143 else INTERRUPTED, highlight=False, markup=False, soft_wrap=True)
    return code if isinstance(code, int) else 0


def main() -> None:
    """Console entry point: one-line errors with the documented exit codes, resumable interrupts
    (Ctrl-C and SIGTERM)."""
    _quiet_third_parties()
    if not sys.stdout.isatty():  # help into a pipe or a file: wide enough for the option lists
        import typer.rich_utils

        typer.rich_utils.MAX_WIDTH = typer.rich_utils.MAX_WIDTH or 120
    _terminated.clear()
    handle = (threading.current_thread() is threading.main_thread()
              and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    if handle:  # an ignored SIGTERM (SIG_IGN from the parent) stays ignored
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code = _run_app()
    finally:
        if handle:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.exit(code)
