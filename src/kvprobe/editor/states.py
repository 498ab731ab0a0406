"""The caches a repair builds, as functions of a cache and token ids: the one home of each state that both the
edit strategies (:mod:`kvprobe.editor.strategies`: a case's decision) and ``kvprobe memory``'s arms
(:mod:`kvprobe.memory.runner`: a user's context, read by several questions) start from::

    prefilled    a full prefill of the ids into a fresh cache        (oracle, hoist's prefix, memory's layouts)
    appended     a cache with more ids fed after it                  (the prefix oracle; memory's erratum and
                                                                      neutral lines)
    recomputed   a cache with some positions recomputed from new ids (field_only, selective, cacheblend;
                                                                      memory's field_only)

Each leaves the cache it is given as it was.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvprobe.kv import cache as kvcache
from kvprobe.kv.recompute import recompute_positions


def prefilled(lm, ids: list[int]) -> DynamicCache:
    """A full prefill of ``ids`` at positions 0.. into a fresh full-length cache (only the last position's
    logits computed: the cache is what is wanted)."""
    _, cache = kvcache.prefill(lm.model, torch.tensor(ids), logits_to_keep=1)
    return cache


def appended(lm, base: DynamicCache, ids: list[int]) -> DynamicCache:
    """``base``'s positions with ``ids`` fed after them, as a new cache (the forward appends new tensors to
    views of ``base``'s, so ``base`` is left as it was)."""
    cache = kvcache.crop(base, kvcache.seq_len(base))
    kvcache.forward(lm.model, torch.tensor([ids], device=lm.device), cache, logits_to_keep=1)
    return cache


def recomputed(lm, base: DynamicCache, ids: list[int], positions: list[int]) -> DynamicCache:
    """A copy of ``base`` whose entries at ``positions`` are recomputed from ``ids`` against the others
    (:func:`~kvprobe.kv.recompute.recompute_positions`)."""
    return recompute_positions(lm, base, ids, positions)
