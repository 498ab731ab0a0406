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

from kvprobe.errors import KvprobeError

MANIFEST = "manifest.json"
VALIDITY = "validity.parquet"
EDITS = "edits.parquet"
LOCALITY = "locality.parquet"
CONCENTRATION = "concentration.parquet"
ATTENTION = "attention.parquet"
LINEAR = "linear.parquet"
KNOCKOUT = "knockout.parquet"
COMPOSE = "compose.parquet"
RANKING_RULE = "ranking_rule.json"
TOKENS = "tokens.parquet"
TTFT = "ttft.parquet"
SERVING = "serving.parquet"  # kvprobe serve-bench: one row per request (kvprobe.serving.bench.COLUMNS)
SERVING_MANIFEST = "serving_manifest.json"
REPORT = "report.html"


def atomic_write(path: Path | str, write) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it into place (the one
    atomic write: an interrupted writer never leaves a half-written file that looks finished)."""
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
    return atomic_write(Path(path), lambda tmp: df.to_parquet(tmp, index=False))


def atomic_write_json(data: dict, path: Path | str) -> Path:
    """Write JSON atomically (sorted keys, indented); returns the path."""
    return atomic_write(Path(path), lambda tmp: tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str)))


def claim_folder(folder: Path | str, name: str, config: dict, settle=lambda stored: stored,
                 held: str = "run with a different configuration") -> None:
    """Record ``config`` as ``<folder>/<name>``, or, when a run already left one there, refuse the
    folder unless ``settle(stored) == config`` (so a rerun resumes only what it would have done)."""

    path = Path(folder) / name
    if path.exists():
        if settle(json.loads(path.read_text())) != config:
            raise KvprobeError(f"{folder} holds a {held}; choose another --out or remove it")
    else:
        atomic_write_json(config, path)


class CaseStore:
    """Per-case parts of one table, so an interrupted run resumes without redoing finished cases.

    Each finished case is one parquet file ``<folder>/parts/<table>/<case_id>.parquet``, written
    atomically; :meth:`collect` concatenates them into ``<folder>/<table>.parquet``.
    """

    def __init__(self, folder: Path | str, table: str):
        self.folder = Path(folder)
        self.table = table
        self.parts = self.folder / "parts" / table

    def _path(self, case_id: str) -> Path:
        return self.parts / f"{case_id}.parquet"

    def done(self, case_id: str) -> bool:
        return self._path(case_id).exists()

    def save(self, case_id: str, df: pd.DataFrame) -> Path:
        return atomic_write_parquet(df, self._path(case_id))

    def load(self, case_id: str) -> pd.DataFrame:
        return pd.read_parquet(self._path(case_id))

    def collect(self) -> Path:
        """Concatenate every finished part (sorted by case id) into the table file; returns its path."""
        files = sorted(self.parts.glob("*.parquet")) if self.parts.exists() else []
        frames = [pd.read_parquet(f) for f in files]
        frames = [f for f in frames if len(f)]
        df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        return atomic_write_parquet(df, self.folder / f"{self.table}.parquet")
