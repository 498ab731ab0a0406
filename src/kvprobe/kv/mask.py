"""Attention masks for forward passes over an arbitrary cache.

kvprobe often runs new tokens against a cache whose entries are not simply "the positions
before me": a selective recompute interleaves recomputed tokens with stale entries, a knockout
hides some entries from the decision token, a composed context has re-rotated blocks. One rule
covers all of them. Query token i (RoPE position ``q_pos[i]``) may attend to

- cache entry j iff ``visible[i, j]`` and ``k_pos[j] <= q_pos[i]``;
- new token k iff ``q_pos[k] <= q_pos[i]``;

and on sliding-window layers, additionally only to keys with position > ``q_pos[i] - window``
(HF's convention). Masks are additive floats, shape (B, 1, S, N + S): 0 where allowed and the
dtype's minimum elsewhere, which eager and SDPA attention both accept.
"""

from __future__ import annotations

import torch


def additive_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, visible: torch.Tensor | None,
                  window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The (B, 1, S, N + S) additive mask for queries at ``q_pos`` (B, S) over cache ``k_pos`` (B, N).

    ``visible`` (B, S, N) bool restricts which cache entries each query may see (None: all); (B, S, N + S)
    restricts the new tokens too (each still sees only positions up to its own).
    """
    B, S = q_pos.shape
    assert k_pos.shape[0] == B, (k_pos.shape, q_pos.shape)
    all_k = torch.cat([k_pos, q_pos], dim=1)  # (B, N + S)
    allowed = all_k[:, None, :] <= q_pos[:, :, None]  # (B, S, N + S)
    if visible is not None:
        N = k_pos.shape[1]
        assert visible.shape in ((B, S, N), (B, S, N + S)), (visible.shape, (B, S, N))
        allowed[:, :, : visible.shape[2]] &= visible
    if window is not None:
        allowed &= all_k[:, None, :] > q_pos[:, :, None] - window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]  # (B, 1, S, N + S)
