"""Loading without noise: a model-loading error must reach the user as one line.

transformers draws a "Loading weights" progress bar on stderr and huggingface_hub logs every retry
of an unreachable hub; both would surround kvprobe's one-line error (and kvprobe says what it is
loading itself). :func:`quiet_hf` silences them for the duration of a load; :func:`plain_tensor_progress` turns
the bar transformers draws over a GGUF's tensors into kvprobe's own progress lines.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable


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


PROGRESS_EVERY_S = 10.0  # a dequantisation's progress line, at most this often


@contextlib.contextmanager
def plain_tensor_progress(progress: Callable[[str], None]):
    """transformers counts a GGUF's tensors with a tqdm bar (redrawn with carriage returns: noise in a log that is
    not a terminal): inside the block, the count goes to ``progress`` as plain lines, at most every
    :data:`PROGRESS_EVERY_S` seconds, and once at the end."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    def plain(items, *args, **kwargs):
        total, last = len(items), time.monotonic()
        for i, item in enumerate(items, 1):
            yield item
            if i == total or time.monotonic() - last >= PROGRESS_EVERY_S:
                progress(f"dequantising: {i}/{total} tensors")
                last = time.monotonic()

    original = gguf_utils.tqdm
    gguf_utils.tqdm = plain
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def first_line(exc: BaseException) -> str:
    """An exception's first non-empty line (its type name when it has no message)."""
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
