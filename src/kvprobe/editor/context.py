"""What every edit strategy starts from: the model, the aligned case and the old prompt's cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvprobe.datasets import AlignedCase
from kvprobe.kv import cache as kvcache


@dataclass
class EditContext:
    """Everything a strategy may use for one case: the model, the aligned case, the old cache."""

    lm: object
    a: AlignedCase
    old_cache: DynamicCache  # ids_old[:D], never modified
    ranking: Callable[["EditContext"], list[int]] | None = None  # the causal ranking, if supplied
    seed: int = 0
    policy: object | None = None  # a kvprobe.policy.Policy for this model, if one was loaded (auto uses it)
    _attention: torch.Tensor | None = field(default=None, repr=False)

    @property
    def D(self) -> int:
        return self.a.decision_pos


def make_context(lm, a: AlignedCase, ranking=None, seed: int = 0, policy=None,
                 old_cache: DynamicCache | None = None) -> EditContext:
    """Prefill the old prompt (everything before the decision token) once for all strategies; a
    caller that holds that cache already (``old_cache``, positions [0, D)) passes it instead."""
    lm.check_length(len(a.ids_old))
    if old_cache is not None:
        assert kvcache.seq_len(old_cache) == a.decision_pos, (kvcache.seq_len(old_cache), a.decision_pos)
        return EditContext(lm, a, old_cache, ranking, seed, policy)
    _, cache = kvcache.prefill(lm.model, torch.tensor(a.ids_old[: a.decision_pos]), logits_to_keep=1)
    return EditContext(lm, a, cache, ranking, seed, policy)
