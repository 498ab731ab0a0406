"""Loading without noise: a model-loading error must reach the user as one line.

transformers draws a "Loading weights" progress bar on stderr and huggingface_hub logs every retry
of an unreachable hub; both would surround kvprobe's one-line error (and kvprobe says what it is
loading itself). :func:`quiet_hf` silences them for the duration of a load.
"""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def quiet_hf():
    """No transformers progress bars and no huggingface_hub warnings (retries) inside the block."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hub = logging.getLogger("huggingface_hub")
    level = hub.level
    hf_logging.disable_progress_bar()
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


def first_line(exc: BaseException) -> str:
    """An exception's first non-empty line (its type name when it has no message)."""
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
