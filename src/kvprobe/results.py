"""Results folders: ``manifest.json`` beside one parquet file per table.

File names are constants; every writer is atomic (temp file, then rename) and returns the path
it wrote, so an interrupted run never leaves a half-written table that looks finished.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pandas as pd

MANIFEST = "manifest.json"
VALIDITY = "validity.parquet"
EDITS = "edits.parquet"


def _atomic(path: Path, write) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_parquet(df: pd.DataFrame, path: Path | str) -> Path:
    """Write a DataFrame as parquet atomically; returns the path."""
    return _atomic(Path(path), lambda tmp: df.to_parquet(tmp, index=False))


def atomic_write_json(data: dict, path: Path | str) -> Path:
    """Write JSON atomically (sorted keys, indented); returns the path."""
    return _atomic(Path(path), lambda tmp: tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str)))
