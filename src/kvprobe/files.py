"""Files written whole or not at all: the one atomic write, and the one JSON form kvprobe writes (results
folders, claims, manifests, ``--json``). :mod:`kvprobe.results` builds its tables and folders on these."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()


def atomic_write(path: Path | str, write) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it into place (the one
    atomic write: an interrupted writer never leaves a half-written file that looks finished)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; a results file reads like any other file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def json_text(data) -> str:
    """The one JSON form kvprobe writes, to a file or to stdout (``--json -``): indented, keys sorted, a value
    JSON lacks (a path, a timestamp) as its string, a final newline."""
    return json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"


def atomic_write_json(data: dict, path: Path | str) -> Path:
    """Write :func:`json_text` atomically; returns the path."""
    return atomic_write(Path(path), lambda tmp: tmp.write_text(json_text(data)))
