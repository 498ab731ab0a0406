"""Eager attention without copying the shared key/value heads: kvprobe's default attention.

transformers' eager attention expands every key/value head to its group of query heads
(``repeat_kv``) before the two matmuls, a full copy of the cache per layer and per forward. A
batched read (hundreds of patched copies of one cache, each fed one token) spends more time
making those copies than multiplying. :func:`grouped_eager` computes the same thing (same
scaling, optional softcap, additive mask, float32 softmax, the attention weights returned) with
each key/value head multiplied against its query heads as one group, so nothing is copied.
Without autograd (every read and evaluation) the scaling, softcap and mask are applied in place:
the same operations on the same values, the same bits. That saves most where there is a softcap
(benchmarks/toy_eval.py, one thread on a Zen 4, alternating runs: toy-gemma2's held-out evaluation
18.4 s against 21.2 s, 1.15x; toy-qwen2's, without softcap, 14.4 s against 14.6 s, within noise).

Registered with transformers as :data:`NAME`; a model loaded with ``attn="eager"`` runs on it
(:func:`use_grouped`). Its results equal the stock eager attention's to float rounding.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

NAME = "kvprobe_eager"


def grouped_eager(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """query (B, H, S, d), key/value (B, H_kv, N, d) -> (output (B, S, H, d_v), weights (B, H, S, N)).

    Query head h reads key/value head ``h // (H / H_kv)``, as ``repeat_kv`` lays them out."""
    B, H, S, d = query.shape
    H_kv, N = key.shape[1], key.shape[2]
    group = H // H_kv
    if scaling is None:
        scaling = module.head_dim**-0.5
    weights = torch.matmul(query.reshape(B, H_kv, group * S, d), key.transpose(2, 3)).view(B, H, S, N)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        weights = weights * scaling  # autograd keeps tanh's output: no step may overwrite it
        if softcap is not None:
            weights = torch.tanh(weights / softcap) * softcap
        if attention_mask is not None:
            weights = weights + attention_mask
    else:  # the same operations in place: no (B, H, S, N) tensor allocated per step
        weights.mul_(scaling)
        if softcap is not None:
            weights.div_(softcap).tanh_().mul_(softcap)
        if attention_mask is not None:
            weights.add_(attention_mask)
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights.view(B, H_kv, group * S, N), value).view(B, H, S, value.shape[-1])
    return out.transpose(1, 2).contiguous(), weights


AttentionInterface.register(NAME, grouped_eager)
AttentionMaskInterface.register(NAME, eager_mask)  # the masks eager attention takes


def use_grouped(model) -> None:
    """Switch a model loaded with eager attention to :func:`grouped_eager` (others are left alone)."""
    if getattr(model.config, "_attn_implementation", None) == "eager":
        model.set_attn_implementation(NAME)
