"""The batched cache-space patching engine.

Existing toolkits patch by re-running the whole forward pass per intervention. Here an
intervention is a *cache edit*: start from the old prompt's cache, swap some entries for the new
prompt's (all layers or chosen ones), and re-read the decision by feeding only the decision
token. Many patched caches go through one decode step as a batch, so a single-position sweep
over an L-token prompt costs L one-token reads, not L forward passes.

All caches here hold positions [0, D) of a prompt; the decision token (position D) is fed at
read time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvprobe.datasets import AlignedCase
from kvprobe.kv import cache as kvcache

DEFAULT_BATCH_BYTES = 768 * 2**20  # memory budget for one batch of patched caches


@dataclass(frozen=True)
class Patch:
    """Swap old-cache entries at ``positions`` for the new prompt's, on ``layers`` (None: all)."""

    positions: tuple[int, ...]
    layers: tuple[int, ...] | None = None


@dataclass
class PairCaches:
    """The old and new caches of one aligned case (positions [0, D)) and the decision token."""

    a: AlignedCase
    old: DynamicCache
    new: DynamicCache

    @property
    def D(self) -> int:
        return self.a.decision_pos

    @classmethod
    def build(cls, lm, a: AlignedCase) -> "PairCaches":
        """Prefill both prompts, sharing the computation of the identical prefix before the field."""
        D, f0 = a.decision_pos, a.field[0]
        prefix = kvcache.prefill(lm.model, torch.tensor(a.ids_old[:f0]), logits_to_keep=1)[1] if f0 else kvcache.new_cache()
        old, new = kvcache.copy(prefix), kvcache.copy(prefix)
        for cache, ids in ((old, a.ids_old), (new, a.ids_new)):
            kvcache.forward(lm.model, torch.tensor([ids[f0:D]]), cache, logits_to_keep=1)
        return cls(a, old, new)


def cache_bytes(cache: DynamicCache) -> int:
    return sum(k.numel() * k.element_size() * 2 for k, _ in kvcache.to_tensors(cache))


@torch.no_grad()
def read_batch(lm, caches: list[DynamicCache], token: int, position: int, visible: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Decision logits (B, V) for a batch of same-length caches, each fed ``token`` at ``position``.

    ``visible`` (B, 1, N) hides cache entries from the decision token (edge knockout).
    """
    batch = kvcache.concat(caches, dim="batch")
    B = len(caches)
    ids = torch.full((B, 1), token)
    pos = torch.full((B, 1), position)
    if visible is None:
        out = kvcache.forward(lm.model, ids, batch, pos)
    else:
        out = kvcache.masked_forward(lm, ids, batch, pos, visible=visible)
    return out.logits[:, -1]


@torch.no_grad()
def patched_reads(lm, pc: PairCaches, patches: Sequence[Patch], batch_bytes: int = DEFAULT_BATCH_BYTES
                  ) -> torch.Tensor:
    """Decision logits (len(patches), V): one read per patched copy of the old cache, batched."""
    per = max(1, batch_bytes // max(1, cache_bytes(pc.old)))
    old_kv, new_kv = kvcache.to_tensors(pc.old), kvcache.to_tensors(pc.new)
    n_layers = len(old_kv)
    out = []
    for start in range(0, len(patches), per):
        chunk = patches[start : start + per]
        B = len(chunk)
        layers = []
        for layer, ((k0, v0), (k1, v1)) in enumerate(zip(old_kv, new_kv)):
            k, v = k0.expand(B, -1, -1, -1).clone(), v0.expand(B, -1, -1, -1).clone()  # (B, H_kv, D, hd)
            for b, p in enumerate(chunk):
                if p.positions and (p.layers is None or layer in p.layers):
                    idx = torch.tensor(p.positions)
                    k[b, :, idx], v[b, :, idx] = k1[0, :, idx], v1[0, :, idx]
            layers.append((k, v))
        batch = kvcache.from_tensors(layers)
        assert kvcache.n_layers(batch) == n_layers
        ids = torch.full((B, 1), pc.a.ids_old[pc.D])
        out.append(kvcache.forward(lm.model, ids, batch, torch.full((B, 1), pc.D)).logits[:, -1])
    return torch.cat(out)
