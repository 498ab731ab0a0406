"""The probe protocol, registry and the shared tidy-table columns.

A probe is a small pure unit: a frozen dataclass whose ``run(lm, pairs)`` returns a long/tidy
DataFrame with :data:`RESULT_COLUMNS` (plus probe-specific extras). No file I/O, no printing,
no report calls inside a probe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import pandas as pd

from kvprobe.datasets import AlignedCase
from kvprobe.datasets.spans import region_of  # noqa: F401  (re-exported for the probes)

RESULT_COLUMNS = ["model", "case_id", "probe", "layer", "head", "position", "region", "metric", "value"]
REGIONS = ("field", "downstream", "prefix", "sink", "decision")


class Probe(Protocol):
    name: str

    def run(self, lm, pairs: Sequence[AlignedCase]) -> pd.DataFrame: ...


PROBES: dict[str, type] = {}


def register(cls):
    """Class decorator: add a probe class to :data:`PROBES` under its ``name``."""
    PROBES[cls.name] = cls
    return cls


def run_each(probe, lm, pairs: Sequence[AlignedCase]) -> pd.DataFrame:
    """``probe.run_case`` over the pairs, concatenated (the ``run`` of every per-case probe)."""
    frames = [probe.run_case(lm, a) for a in pairs]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def rows(model: str, case_id: str, probe: str, records: list[dict]) -> pd.DataFrame:
    """A tidy frame with the shared columns first; missing shared columns are filled with None."""
    df = pd.DataFrame(records)
    for col in RESULT_COLUMNS:
        if col not in df:
            df[col] = None
    df["model"], df["case_id"], df["probe"] = model, case_id, probe
    extras = [c for c in df.columns if c not in RESULT_COLUMNS]
    return df[RESULT_COLUMNS + extras]
