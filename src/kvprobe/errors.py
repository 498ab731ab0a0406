"""User-facing errors: one line that names the problem and what is accepted, and an exit code.

The CLI prints a ``KvprobeError`` as a single line and exits with its ``exit_code``; anything
else is a bug and keeps its traceback. The exit codes (docs/cli.md documents them)::

    0    ok
    1    a gate or check ran and failed (CheckFailed)
    2    usage: a bad option, value or combination, or an --out that cannot be used (UsageError)
    3    bad input data or files: a dataset, config, model file or results folder (KvprobeError)
    4    environment: a model that cannot be fetched, a missing or dead server, a full disk or a
         KVPROBE_HOME that cannot be written (EnvironmentProblem)
    130  interrupted (Ctrl-C); finished work is kept and the same command resumes
    143  terminated (SIGTERM); finished work is kept and the same command resumes
"""

from __future__ import annotations

EXIT_CODES = {
    0: "ok",
    1: "a gate or check ran and failed",
    2: "usage: a bad option, value or combination, or an --out that cannot be used",
    3: "bad input data or files: a dataset, config, model file or results folder",
    4: "environment: a model that cannot be fetched, a missing or dead server, a full disk, an unwritable "
       "KVPROBE_HOME",
    130: "interrupted (Ctrl-C); finished work is kept and the same command resumes",
    143: "terminated (SIGTERM, 128 + 15); finished work is kept and the same command resumes",
}


PYDANTIC_PREFIX = "Value error, "  # what pydantic puts before a validator's ValueError message


def validator_message(err: dict) -> str:
    """One error of a pydantic ``ValidationError.errors()``: its message as the validator wrote it
    (pydantic prefixes a ``ValueError``'s message with :data:`PYDANTIC_PREFIX`)."""
    return str(err["msg"]).removeprefix(PYDANTIC_PREFIX)


class KvprobeError(Exception):
    """A problem with the user's input data or files, explained in one line (exit status 3)."""

    exit_code = 3

    def __init__(self, message: str):
        message = " ".join(str(message).split())  # always one line
        super().__init__(message)


class UsageError(KvprobeError):
    """A bad option, option value or combination, or an unusable --out (exit status 2)."""

    exit_code = 2

    @classmethod
    def from_validation(cls, exc, command: str) -> UsageError:
        """The first error of a pydantic ValidationError over a command's options, named as the option."""
        err = exc.errors()[0]
        msg = validator_message(err)
        return cls(f"bad {command} option --{str(err['loc'][0]).replace('_', '-')}: {msg}")


class CheckFailed(KvprobeError):
    """A gate or check ran and its result failed (exit status 1)."""

    exit_code = 1


def no_decision_case(model: str, then: str, of: str = "") -> CheckFailed:
    """The one wording of every command's refusal when ``model`` answered no decision case (``of`` a dataset)
    right under both values: nothing after it can be judged; ``then`` says what that means for the command."""
    return CheckFailed(f"{model} answered no decision case{f' of {of}' if of else ''} correctly under both values"
                       f"{then}")


def no_case_to_judge(model: str, table, of: str = "") -> CheckFailed:
    """:func:`no_decision_case` for a command that edits (``kvprobe edit``, ``weight-edit``): its ``table`` keeps
    the raw rows."""
    return no_decision_case(model, f", so no edit can be judged; the table in {table} holds the raw rows", of)


class EnvironmentProblem(KvprobeError):
    """Something outside the inputs is missing or broken: no network, no vLLM, a dead server (exit status 4)."""

    exit_code = 4
