"""``kvprobe run``'s cases (:mod:`kvprobe.pipeline`): every case aligned to the model and checked before any
model work (:func:`prepare`), then, after the validity stage, the valid ones chosen and split into the
cases that learn the causal ranking rule and the held-out cases that judge it (:func:`split_holdout`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import pandas as pd

from kvprobe.config import RunConfig, precheck_cases
from kvprobe.datasets import Skip, align


def split_holdout(case_ids: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Deterministic split by hashed case id: (ranking cases, held-out cases); both non-empty when possible."""
    keyed = sorted(case_ids, key=lambda c: hashlib.sha256(f"{seed}:{c}".encode()).hexdigest())
    n_hold = min(len(keyed) - 1, max(1, round(fraction * len(keyed)))) if len(keyed) > 1 else 0
    return sorted(keyed[n_hold:]), sorted(keyed[:n_hold])


@dataclass
class Selection:
    """The run's cases: generated or loaded, aligned, checked for validity, and split."""

    cases: list
    aligned: dict  # case_id -> AlignedCase
    skipped: list  # Skip, one per case that does not align
    validity: pd.DataFrame = field(default_factory=pd.DataFrame)
    valid_ids: list[str] = field(default_factory=list)  # the decision cases probed and edited
    control_ids: list[str] = field(default_factory=list)  # the valid controls edited (a seeded sample)
    n_valid_controls: int = 0
    rank_ids: list[str] = field(default_factory=list)  # learn the causal ranking rule on these
    held_ids: list[str] = field(default_factory=list)  # and judge it (the K sweep) on these
    sizing: dict | None = None  # a sized run's targets and how they were met (RunConfig.sizing)

    @property
    def valid(self) -> list:
        return [self.aligned[c] for c in self.valid_ids]

    @property
    def controls(self) -> list:
        return [self.aligned[c] for c in self.control_ids]


def prepare(cfg: RunConfig, lm, cases: list) -> Selection:
    """Align every case and check, before any model work, what would otherwise fail late: every
    case's length (with its chain-of-thought budget) against the model's window, and every
    configured strategy against every case (a selective K against its downstream span, an
    erratum prompt's length)."""
    sel = Selection(cases, {}, [])
    for case in cases:
        a = align(case, lm.tokenizer, cfg.form)
        if isinstance(a, Skip):
            sel.skipped.append(a)
        else:
            sel.aligned[case.case_id] = a
    precheck_cases(lm, list(sel.aligned.values()), cfg.edit_strategies(), cfg.cot, cfg.form)
    return sel
