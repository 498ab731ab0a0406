"""A causal ranking *rule* for selective recompute, learned from locality sweeps.

Ranking a case's positions by its own single-position patch effects needs the new prompt's KV,
which is exactly what a serving engine does not have. So kvprobe learns a rule on some cases and
applies it to others: each downstream position is keyed by its token kind and by log2 buckets
of its distance after the field and before the decision; the rule scores a key by the mean
normalised effect (effect / oracle flip) it had on the training cases. Unseen keys score 0; ties
go to the position nearest the field. The rule is plain data, exported in the top-K YAML.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

from kvprobe.datasets import AlignedCase
from kvprobe.probes.base import single_position_sweep


def bucket(distance: int) -> int:
    """0 for distance 0, else 1 + floor(log2(distance)): 1, 2-3, 4-7, ..."""
    return 0 if distance <= 0 else 1 + int(math.log2(distance))


def position_key(a: AlignedCase, p: int) -> str:
    """``kind|after-field bucket|before-decision bucket`` of a downstream position."""
    return f"{a.kinds[p]}|{bucket(p - a.field[1])}|{bucket(a.decision_pos - 1 - p)}"


@dataclass(frozen=True)
class RankingRule:
    """Scores by position key; ``rank(a)`` orders a case's downstream positions, best first."""

    scores: Mapping[str, float]
    n_cases: int

    def rank(self, a: AlignedCase) -> list[int]:
        down = range(*a.downstream)
        return sorted(down, key=lambda p: (-self.scores.get(position_key(a, p), 0.0), p))

    def __call__(self, ctx) -> list[int]:  # usable as an EditContext ranking
        return self.rank(ctx.a)

    def as_dict(self) -> dict:
        top = sorted(self.scores.items(), key=lambda kv: -kv[1])
        return {"kind": "position-key table", "key": "token_kind|log2 distance after field|log2 distance before decision",
                "n_training_cases": self.n_cases, "scores": {k: round(v, 6) for k, v in top}}


def fit_rule(locality: pd.DataFrame, aligned: Mapping[str, AlignedCase], min_flip: float = 1.0) -> RankingRule:
    """Learn the rule from single-position sweep rows of the given cases (small flips are dropped)."""
    sweep = single_position_sweep(locality, "downstream")
    sweep = sweep[sweep.case_id.isin(aligned) & (sweep.oracle_flip.abs() >= min_flip)]
    if sweep.empty:
        return RankingRule({}, 0)
    keys = [position_key(aligned[c], int(p)) for c, p in zip(sweep.case_id, sweep.position)]
    norm = sweep.value / sweep.oracle_flip
    table = pd.DataFrame({"key": keys, "score": norm.values}).groupby("key").score.mean()
    return RankingRule(table.to_dict(), int(sweep.case_id.nunique()))
