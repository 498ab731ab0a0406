"""Recompute chosen positions of a cache against its other, possibly stale, entries."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvprobe.kv import cache as kvcache


def recompute_positions(lm, cache: DynamicCache, ids: list[int], positions: list[int]) -> DynamicCache:
    """A copy of ``cache`` whose entries at ``positions`` are recomputed from ``ids``.

    Each recomputed token attends to the *stale* entries of the other positions before it and to
    the other recomputed tokens before it (CacheBlend semantics). Recomputing every position from
    the first changed one on therefore equals a fresh prefill.
    """
    work = kvcache.copy(cache)
    if not positions:
        return work
    n = kvcache.seq_len(work)
    sel = torch.tensor(sorted(positions))
    assert int(sel.max()) < n, "positions must lie inside the cache"
    visible = torch.ones(1, len(sel), n, dtype=torch.bool)
    visible[:, :, sel] = False  # the recomputed tokens stand in for their stale entries
    kvcache.masked_forward(lm, torch.tensor([ids[p] for p in sel.tolist()])[None], work, sel[None], visible=visible,
                     logits_to_keep=1)
    for layer in range(kvcache.n_layers(work)):
        k, v = kvcache.get_kv(work, layer)  # (1, H_kv, n + S, D)
        k[:, :, sel], v[:, :, sel] = k[:, :, n:], v[:, :, n:]
        kvcache.set_kv(work, layer, k[:, :, :n], v[:, :, :n])
    return work
