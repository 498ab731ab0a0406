"""Checks of the command line itself, made once for every command before it runs.

click (and so typer) keeps the last of ``--n 3 --n 4`` without a word, and a float option's range
check reads NaN as "should be less than or equal to 1". :func:`check_args` walks the argument list
against the click command tree and refuses, as a one-line :class:`~kvprobe.errors.UsageError`:

- a single-valued option given twice (``--n 3 --n 4``, ``--report --no-report``); options that
  take several values (``multiple``, such as ``diagnose --value``) may repeat;
- NaN for a float option, with the range it accepts.

Anything it does not recognise (an unknown command or option, a missing value) is left to click,
which reports it. :func:`bare_json` gives a bare ``--json`` its optional value, ``-`` (stdout),
which click cannot express.
"""

from __future__ import annotations

import math
import typing

from kvprobe.errors import UsageError


def bare_json(args: list[str]) -> list[str]:
    """``args`` with ``-`` after each ``--json`` that has no value: the last argument, or one followed
    by another option. (A value that is neither - nor a .json path is refused by the option itself,
    so ``--json prompt.txt`` can never overwrite a file that is not JSON.)"""
    out = []
    for i, token in enumerate(args):
        out.append(token)
        if token == "--":
            return out + args[i + 1:]
        if token == "--json" and (i + 1 == len(args) or (args[i + 1].startswith("-") and args[i + 1] != "-")):
            out.append("-")
    return out


def check_args(root, args: list[str]) -> None:
    """Refuse a repeated single-valued option or a NaN float in ``args`` (``sys.argv[1:]``)."""
    cmd, i = root, 0
    while cmd is not None:
        options = {name: p for p in cmd.params if getattr(p, "param_type_name", "") == "option"
                   for name in (*p.opts, *p.secondary_opts)}
        seen: dict[str, str] = {}  # param name -> how it was first given
        sub = None
        while i < len(args):
            token = args[i]
            i += 1
            if token == "--":  # the rest are arguments
                return
            if token.startswith("-") and token != "-":
                name, eq, value = token.partition("=")
                param = options.get(name)
                if param is None:
                    continue
                takes_value = not getattr(param, "is_flag", False) and param.nargs != 0
                if takes_value and not eq:
                    if i >= len(args):
                        return  # click says the value is missing
                    value = args[i]
                    i += param.nargs if param.nargs > 0 else 1
                given = f"{name} {value}" if takes_value else name
                if not (param.multiple or getattr(param, "count", False)):
                    if param.name in seen:
                        both = "/".join((*param.opts, *param.secondary_opts))
                        raise UsageError(f"{both} is given twice ({seen[param.name]!r} and {given!r}); give it "
                                         f"once")
                    seen[param.name] = given
                if takes_value and _is_float(param):
                    _check_float(name, value, param)
            elif sub is None and hasattr(cmd, "commands"):
                sub = cmd.commands.get(token)
                if sub is None:
                    return  # click says the command is unknown
                break
        cmd = sub


def _is_float(param) -> bool:
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if annotation is not None:
        return annotation is float or float in typing.get_args(annotation)
    return "float" in type(getattr(param, "type", None)).__name__.lower()  # a click FloatParamType or FloatRange


def _check_float(name: str, value: str, param) -> None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return  # not a number at all: click's message says so
    if math.isnan(number):
        lo, hi = getattr(param, "min", None), getattr(param, "max", None)
        callback = getattr(param, "callback", None)  # typer wraps it; a checking callback may say what it accepts
        accepted = getattr(getattr(callback, "__wrapped__", callback), "accepted", None) or (
            f"a number in [{lo:g}, {hi:g}]" if lo is not None and hi is not None
            else f"a number >= {lo:g}" if lo is not None else f"a number <= {hi:g}" if hi is not None
            else "a number")
        raise UsageError(f"{name} {value!r} is not a number (NaN); give {accepted}")
