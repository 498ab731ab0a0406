"""Recompute chosen positions of a cache against its other, possibly stale, entries."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvprobe.kv import cache as kvcache


def recompute_positions(lm, cache: DynamicCache, ids: list[int], positions: list[int],
                        rope_positions: torch.Tensor | None = None) -> DynamicCache:
    """A copy of ``cache`` whose entries at ``positions`` are recomputed from ``ids``.

    Each recomputed token attends to the *stale* entries of the other positions before it and to
    the other recomputed tokens before it (CacheBlend semantics). Recomputing every position from
    the first changed one on therefore equals a fresh prefill. ``rope_positions``: the whole
    prompt's rotary positions where they are not its indices (an M-RoPE model's (3, 1, T) ids with
    an image in the prompt); the recomputed tokens are rotated by theirs.
    """
    work = kvcache.copy(cache)
    if not positions:
        return work
    n = kvcache.seq_len(work)
    sel = torch.tensor(sorted(positions))
    assert int(sel.max()) < n, "positions must lie inside the cache"
    visible = torch.ones(1, len(sel), n, dtype=torch.bool)
    visible[:, :, sel] = False  # the recomputed tokens stand in for their stale entries
    rotate = rope_positions[..., sel] if rope_positions is not None else None
    kvcache.masked_forward(lm, torch.tensor([ids[p] for p in sel.tolist()])[None], work, sel[None], visible=visible,
                           logits_to_keep=1, rope_positions=rotate)
    for layer in range(kvcache.n_layers(work)):
        k, v = kvcache.get_kv(work, layer)  # (1, H_kv, n + S, D)
        k[:, :, sel], v[:, :, sel] = k[:, :, n:].clone(), v[:, :, n:].clone()  # one head (MLA): overlapping
        kvcache.set_kv(work, layer, k[:, :, :n], v[:, :, :n])
    return work


def recompute_many(lm, cache: DynamicCache, ids: list[int], position_sets: list[list[int]]) -> list[DynamicCache]:
    """:func:`recompute_positions` for several position sets of one size, as one batched forward
    (one row per set, each with its own visibility): the same caches, one weight read."""
    if not position_sets:
        return []
    sizes = {len(p) for p in position_sets}
    assert len(sizes) == 1, f"position sets of one size only, got sizes {sorted(sizes)}"
    if not sizes.pop():
        return [kvcache.copy(cache) for _ in position_sets]
    n, B = kvcache.seq_len(cache), len(position_sets)
    sel = torch.tensor([sorted(p) for p in position_sets])  # (B, S)
    assert int(sel.max()) < n, "positions must lie inside the cache"
    work = kvcache.expand_batch(cache, B)
    visible = torch.ones(B, sel.shape[1], n, dtype=torch.bool)
    for b in range(B):
        visible[b, :, sel[b]] = False  # each row's recomputed tokens stand in for their stale entries
    kvcache.masked_forward(lm, torch.tensor(ids)[sel], work, sel, visible=visible, logits_to_keep=1)
    rows = torch.arange(B)[:, None]
    for layer in range(kvcache.n_layers(work)):
        k, v = kvcache.get_kv(work, layer)  # (B, H_kv, n + S, D)
        k = k.transpose(1, 2)  # (B, n + S, H_kv, D): index rows and positions together
        v = v.transpose(1, 2)
        k[rows, sel], v[rows, sel] = k[:, n:].clone(), v[:, n:].clone()
        kvcache.set_kv(work, layer, k[:, :n].transpose(1, 2), v[:, :n].transpose(1, 2))
    return [kvcache.take_rows(work, [b]) for b in range(B)]
