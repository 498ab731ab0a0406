"""The probe protocol, the registry that ``kvprobe run`` iterates, and the shared tidy columns.

A probe is a small pure unit: a frozen dataclass whose ``run_case(lm, case, pc=None)`` (or, across
cases, ``run(lm, cases)``) returns a long/tidy DataFrame with :data:`RESULT_COLUMNS` (plus probe-specific
extras). No file I/O, no printing, no report calls inside a probe. ``pc`` is the case's
:class:`~kvprobe.probes.engine.PairCaches` (both prompts' caches and decision logits): ``kvprobe
run`` builds it once per case (at validity) and hands it to every stage, so a probe never prefills
the two prompts again; a probe run on its own builds it when ``pc`` is None.

Each probe module registers a :class:`ProbeStage`: the name a run config uses, the table it
writes, the probes whose tables it reads (``needs``), how to build the probe from the run's
:class:`Inputs`, whether it reads the residual streams (``residuals``), and the id of the report
section that draws its table. The run loops over :func:`in_order` and profiles every stage it ran;
the report draws every section whose table a folder has. Adding a built-in probe is one module
here, its name in :data:`kvprobe.catalog.PROBES`, and one section (module + template) in
:mod:`kvprobe.reports.sections` (docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pandas as pd

from kvprobe.datasets import AlignedCase
from kvprobe.datasets.spans import region_of  # noqa: F401  (re-exported for the probes)

RESULT_COLUMNS = ["model", "case_id", "probe", "layer", "head", "position", "region", "metric", "value"]
REGIONS = ("field", "downstream", "prefix", "sink", "decision")


class Probe(Protocol):
    name: str

    def run(self, lm, pairs: Sequence[AlignedCase]) -> pd.DataFrame: ...


@dataclass(frozen=True)
class Inputs:
    """What a run hands a probe stage when it builds the probe."""

    seed: int
    model_name: str
    tables: Mapping[str, pd.DataFrame] = field(default_factory=dict)  # stage name -> table, of earlier stages
    pairs: Any = None  # the run's kvprobe.probes.engine.PairMemo (each case's caches, built once), if any

    def table(self, name: str) -> pd.DataFrame:
        """The table of an earlier stage; empty when it did not run."""
        return self.tables.get(name, pd.DataFrame())


@dataclass(frozen=True)
class ProbeStage:
    """How ``kvprobe run`` runs one probe (see the module docstring)."""

    name: str  # the name in RunConfig.probes
    table: str  # the results file it writes
    build: Callable[[Inputs], Any]  # -> an object with run_case(lm, case, pc), or run(lm, cases) if not per_case
    per_case: bool = True  # False: one run over every case (stored whole, not in per-case parts)
    needs: tuple[str, ...] = ()  # stages that run first; their tables reach build() when they ran
    sections: tuple[str, ...] = ()  # ids of the report sections that draw the table
    derived: Callable[[pd.DataFrame], dict[str, pd.DataFrame]] = lambda table: {}  # more files from the table
    residuals: bool = False  # reads each case's residual streams (Inputs.pairs keeps them until it ran)


STAGES: dict[str, ProbeStage] = {}


def register(stage: ProbeStage) -> ProbeStage:
    """Add a probe stage to :data:`STAGES` (once per name); returns it."""
    if stage.name in STAGES:
        raise ValueError(f"probe stage {stage.name!r} is registered twice")
    STAGES[stage.name] = stage
    return stage


def in_order(names: Iterable[str]) -> list[ProbeStage]:
    """The named stages in registration order, each after the stages it needs."""
    wanted, done, out = set(names), set(), []

    def visit(stage: ProbeStage) -> None:
        if stage.name in done:
            return
        done.add(stage.name)
        for need in stage.needs:
            if need in wanted:
                visit(STAGES[need])
        out.append(stage)

    for stage in STAGES.values():
        if stage.name in wanted:
            visit(stage)
    return out


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


def single_position_sweep(locality: pd.DataFrame, region: str | None = None) -> pd.DataFrame:
    """The locality table's single-position sweep (metric ``effect``, set ``single``): one row per
    cache position of each case; only ``region``'s positions when given."""
    if locality.empty:
        return locality
    sweep = locality[(locality["metric"] == "effect") & (locality["set"] == "single")]
    return sweep if region is None else sweep[sweep["region"] == region]


def ranked_notes(locality: pd.DataFrame) -> dict[str, list[tuple[int, float]]]:
    """Per case, (downstream position, single-position patch effect toward the oracle), largest
    effect first: the ranking the notes are taken from."""
    sweep = single_position_sweep(locality, "downstream")
    if sweep.empty:
        return {}
    sweep = sweep.assign(signed=sweep.value * sweep.oracle_flip.map(lambda f: 1.0 if f >= 0 else -1.0))
    return {c: [(int(p), float(v)) for p, v in zip(g.position, g.signed)]
            for c, g in ((c, g.sort_values("signed", ascending=False, kind="stable"))
                         for c, g in sweep.groupby("case_id"))}


def top_notes(locality: pd.DataFrame, k: int | None = 8) -> dict[str, list[int]]:
    """Per case, downstream positions by single-position patch effect toward the oracle, largest
    first (the notes); the first ``k`` (None: all)."""
    return {c: [p for p, _ in order][:k] for c, order in ranked_notes(locality).items()}
