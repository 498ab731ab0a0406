"""A causal ranking *rule* for selective recompute, learned from locality sweeps.

Ranking a case's positions by its own single-position patch effects needs the new prompt's KV,
which is exactly what a serving engine does not have. So kvprobe learns a rule on some cases and
applies it to others: each downstream position is keyed by its token kind and by log2 buckets
of its distance after the field and before the decision; the rule scores a key by the mean
normalised effect (effect / oracle flip) it had on the training cases. Unseen keys score 0; ties
go to the position nearest the field. The rule is plain data, exported in the top-K YAML; its class,
:class:`kvprobe.policy.RankingRule`, lives with the code that reads that file back.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from kvprobe.datasets import AlignedCase
from kvprobe.policy import RankingRule, bucket, position_key
from kvprobe.probes.base import single_position_sweep

__all__ = ["RankingRule", "bucket", "fit_rule", "position_key"]  # the rule itself lives with the policy file


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
