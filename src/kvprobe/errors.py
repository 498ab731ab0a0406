"""User-facing errors: one line that names the problem and what is accepted.

The CLI prints ``KvprobeError`` messages as a single line and exits non-zero; anything
else is a bug and keeps its traceback.
"""


class KvprobeError(Exception):
    """A problem with the user's input or environment, explained in one line."""

    exit_code = 2

    def __init__(self, message: str):
        message = " ".join(str(message).split())  # always one line
        super().__init__(message)
