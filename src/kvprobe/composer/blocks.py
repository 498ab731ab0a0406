"""Blocks: a span of tokens prefilled once, alone behind a preamble, ready to splice (see
:mod:`kvprobe.composer`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvprobe.errors import KvprobeError
from kvprobe.kv import cache as kvcache
from kvprobe.models import rope

SEAMS = (0, 1, 2, 4, 8, 16, 32)  # seam-repair widths the validation reports


@dataclass(eq=False)
class Block:
    """A precompiled block: its tokens and per-layer (keys, values), each (1, H_kv, T, D).

    The K/V were computed at RoPE positions ``start .. start + T - 1`` (behind ``preamble``,
    whose own K/V are not kept). ``config_hash`` and ``dtype`` name the model they belong to.

    An **image block** (M-RoPE, :mod:`kvprobe.composer.images`) has three position ids per token:
    ``rope_positions`` (3, T), temporal/height/width, the first token's (start, start, start);
    it takes ``span`` positions (its largest position - start + 1), fewer than its tokens, and the
    text after it continues from there. ``embeds`` (T, d) are the decoder's input embeddings of
    its tokens (the vision tower's features in the image tokens), so that a seam can be fed fresh;
    ``image`` names the image (``sha256`` of its pixel values and ``grid_thw``).
    """

    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    start: int
    preamble: list[int]
    config_hash: str
    dtype: str
    name: str = ""
    rope_positions: torch.Tensor | None = None  # (3, T) under M-RoPE (image blocks); None: start + arange(T)
    embeds: torch.Tensor | None = None  # (T, d) input embeddings (image blocks)
    image: dict | None = None  # {"sha256": ..., "grid_thw": [t, h, w]} (image blocks)
    _rotated: dict = field(default_factory=dict, repr=False)  # delta -> rotated keys, per layer

    def __post_init__(self):
        check_block_shape(self)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def positions(self) -> list[int] | list[list[int]]:
        """RoPE positions: one per token, or (image blocks) three rows of one per token."""
        if self.rope_positions is not None:
            return self.rope_positions.tolist()
        return list(range(self.start, self.start + len(self.ids)))

    @property
    def scheme(self) -> str:
        """The position scheme its keys were rotated in: ``rope`` (one id per token) or ``mrope``."""
        return "rope" if self.rope_positions is None else "mrope"

    @property
    def span(self) -> int:
        """How many positions it takes: its tokens, or an image block's largest position - start + 1."""
        if self.rope_positions is None:
            return len(self.ids)
        return int(self.rope_positions.max()) - self.start + 1

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)

    def kv_at(self, lm, position: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: (keys, values) (1, H_kv, T, D) moved to start at ``position``: the slot that
        holds rotated keys turned (the keys; the rotary part under multi-head latent attention),
        the other as stored (memoised per shift)."""
        delta = position - self.start
        if delta == 0:
            return list(self.kv)
        if delta not in self._rotated:
            self._rotated.clear()  # keep one shift only: blocks can be large
            self._rotated[delta] = [rope.rerotate_kv(lm.adapter, layer, kv, delta) for layer, kv in enumerate(self.kv)]
        return self._rotated[delta]


def check_block_shape(block: Block) -> None:
    """Refuse K/V that do not hold exactly one (1, H_kv, T, D) entry per block token, and an image
    block's positions or embeddings of another length."""
    T = len(block.ids)
    if T == 0:
        raise KvprobeError(f"block {block.name or '(unnamed)'} has no tokens")
    if block.rope_positions is not None:
        pos = block.rope_positions
        if pos.shape != (3, T) or pos[:, 0].tolist() != [block.start] * 3 or int(pos.min()) < block.start:
            raise KvprobeError(f"block {block.name or '(unnamed)'}: M-RoPE positions must be (3, {T}) starting at "
                               f"({block.start}, {block.start}, {block.start}), got {tuple(pos.shape)}")
        if block.embeds is None or block.embeds.shape[0] != T:
            raise KvprobeError(f"block {block.name or '(unnamed)'}: an image block needs its {T} tokens' input "
                               f"embeddings")
    for layer, (k, v) in enumerate(block.kv):
        if k.ndim != 4 or v.ndim != 4 or k.shape[0] != 1 or k.shape[:3] != v.shape[:3]:
            raise KvprobeError(f"block {block.name or '(unnamed)'} layer {layer}: K/V must be (1, H_kv, T, D), "
                               f"got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[2] != T:
            why = (" (taken from an evicting sliding-window cache? precompile into a full-length cache)"
                   if k.shape[2] < T else "")
            raise KvprobeError(f"block {block.name or '(unnamed)'} layer {layer} holds K/V for {k.shape[2]} "
                               f"positions but has {T} tokens{why}; refusing to splice it")


def _dtype_name(lm) -> str:
    return str(next(lm.model.parameters()).dtype).removeprefix("torch.")


def is_mrope(lm) -> bool:
    """Whether ``lm`` rotates by three position ids (M-RoPE, Qwen2-VL): it can hold image blocks."""
    return "mrope_section" in lm.adapter.rope_parameters(0)


def check_composable(lm) -> None:
    """Refuse a model whose keys cannot be re-rotated (its load-time self-check failed)."""
    if lm.info.rope_unsupported:
        raise KvprobeError(f"cannot compose caches for {lm.info.spec}: {lm.info.rope_unsupported}")


def check_block(lm, block: Block) -> None:
    """Refuse a block that belongs to another model, position scheme or dtype, or has the wrong shape."""
    if block.scheme == "mrope" and not is_mrope(lm):
        raise KvprobeError(f"block {block.name or '(unnamed)'} is an M-RoPE image block; {lm.info.spec} rotates by "
                           f"one position id (1-D RoPE)")
    if block.config_hash != lm.config_hash():
        raise KvprobeError(f"block {block.name or '(unnamed)'} was precompiled for another model "
                           f"(config {block.config_hash}, this model {lm.config_hash()}); precompile it again")
    if block.dtype != _dtype_name(lm):
        raise KvprobeError(f"block {block.name or '(unnamed)'} is {block.dtype} but the model is {_dtype_name(lm)}; "
                           f"precompile it again in the model's dtype")
    if len(block.kv) != lm.adapter.n_layers:
        raise KvprobeError(f"block {block.name or '(unnamed)'} has {len(block.kv)} layers, the model "
                           f"{lm.adapter.n_layers}")
    want_k, want_v = lm.adapter.cache_dims
    if any(((k.shape[1], k.shape[3]), (v.shape[1], v.shape[3])) != (want_k, want_v) for k, v in block.kv):
        raise KvprobeError(f"block {block.name or '(unnamed)'} K/V do not have the model's cache shape (heads, dim: "
                           f"keys {want_k}, values {want_v})")
    check_block_shape(block)


@torch.no_grad()
def precompile(lm, ids: Sequence[int], preamble: Sequence[int] = (), name: str = "") -> Block:
    """The K/V of ``ids`` computed in isolation behind ``preamble`` (positions len(preamble)..).

    Prefills ``preamble + ids`` into a fresh full-length cache (never the model's own, which
    evicts on sliding-window layers) and keeps the block's entries, copied and contiguous.
    """
    check_composable(lm)
    ids, preamble = [int(i) for i in ids], [int(i) for i in preamble]
    if not ids:
        raise KvprobeError(f"block {name or '(unnamed)'} has no tokens")
    lm.check_length(len(preamble) + len(ids), f"block {name or '(unnamed)'} with its preamble")
    cache = kvcache.new_cache()
    kvcache.forward(lm.model, torch.tensor([preamble + ids], device=lm.device), cache, logits_to_keep=1)
    P = len(preamble)
    kv = [(k[:, :, P:].contiguous(), v[:, :, P:].contiguous()) for k, v in kvcache.to_tensors(cache)]
    return Block(ids, kv, P, preamble, lm.config_hash(), _dtype_name(lm), name)


def block_from_cache(lm, cache: DynamicCache, ids: Sequence[int], start: int, name: str = "") -> Block:
    """A block of the entries [start, start + len(ids)) of an existing cache (e.g. the jointly
    computed KV of a full prefill). Refuses a cache that holds fewer entries than that on any
    layer (the model's own sliding-window cache does)."""
    ids = [int(i) for i in ids]
    kv = []
    for layer, (k, v) in enumerate(kvcache.to_tensors(cache)):
        if k.shape[2] < start + len(ids):
            raise KvprobeError(f"cache layer {layer} holds {k.shape[2]} positions, fewer than the "
                               f"{start + len(ids)} the block needs (an evicting sliding-window cache?); "
                               f"prefill into a full-length cache (kvprobe.kv.cache.new_cache)")
        kv.append((k[:, :, start : start + len(ids)].clone(), v[:, :, start : start + len(ids)].clone()))
    return Block(ids, kv, start, [], lm.config_hash(), _dtype_name(lm), name)

