"""Composing a context from text parts and blocks: re-rotate, splice, repair the seam (see
:mod:`kvprobe.composer`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvprobe.composer.blocks import Block, check_block, check_composable
from kvprobe.errors import KvprobeError, UsageError
from kvprobe.kv import cache as kvcache


@dataclass
class Timings:
    """Wall seconds spent in each step of composing (accumulated)."""

    rerotate: float = 0.0
    splice: float = 0.0
    seam: float = 0.0
    prefill: float = 0.0

    @property
    def total(self) -> float:
        return self.rerotate + self.splice + self.seam + self.prefill


class Composer:
    """Builds a composed cache part by part (see the module docstring).

    ``ids`` holds every token of the context so far; entry i of the cache is token i, at RoPE
    position i until an image block (M-RoPE) is spliced, which takes fewer positions than tokens;
    ``next_pos`` is where the next part starts. ``spans`` lists each block's [start, end) (cache
    indices) and name. ``logits`` (V,) are the next-token logits after the last text part (None
    until one is fed).
    """

    def __init__(self, lm):
        check_composable(lm)
        self.lm = lm
        self.cache = kvcache.new_cache()
        self.ids: list[int] = []
        self.spans: list[tuple[int, int, str]] = []
        self.logits: torch.Tensor | None = None
        self.next_pos = 0
        self.timings = Timings()

    def __len__(self) -> int:
        return len(self.ids)

    def copy(self) -> "Composer":
        """An independent copy (the cache is cloned)."""
        new = Composer.__new__(Composer)
        new.lm = self.lm
        new.cache = kvcache.copy(self.cache) if kvcache.n_layers(self.cache) else kvcache.new_cache()
        new.ids, new.spans = list(self.ids), list(self.spans)
        new.logits = self.logits
        new.next_pos = self.next_pos
        new.timings = Timings()
        return new

    def _room(self, n: int, what: str) -> None:
        self.lm.check_length(len(self.ids) + n, f"composed context (after {what})")

    @torch.no_grad()
    def text(self, ids: Sequence[int]) -> torch.Tensor | None:
        """Prefill ``ids`` at the next positions; returns the logits (V,) after the last one."""
        ids = [int(i) for i in ids]
        if not ids:
            return self.logits
        self._room(len(ids), "a text part")
        t0 = time.perf_counter()
        positions = torch.arange(self.next_pos, self.next_pos + len(ids), device=self.lm.device)
        out = kvcache.forward(self.lm.model, torch.tensor([ids], device=self.lm.device), self.cache, positions,
                              logits_to_keep=1)
        self.ids += ids
        self.next_pos += len(ids)
        self.logits = out.logits[0, -1]
        self.timings.prefill += time.perf_counter() - t0
        assert kvcache.seq_len(self.cache) == len(self.ids)
        return self.logits

    @torch.no_grad()
    def block(self, block: Block, seam: int = 0, rerotate: bool = True) -> None:
        """Splice ``block`` at the next positions, re-rotated (or not: the control), with the
        first ``seam`` tokens fed fresh against everything before them (an image block's from its
        stored input embeddings, at its M-RoPE positions moved)."""
        check_block(self.lm, block)
        if seam < 0:
            raise UsageError(f"seam must be >= 0, got {seam}")
        T, p, at = len(block), len(self.ids), self.next_pos
        self._room(T, f"block {block.name or '(unnamed)'}")
        s = min(seam, T)
        if s and block.rope_positions is None:
            self.text(block.ids[:s])  # the seam: fresh, against the full preceding context
        elif s:
            from kvprobe.composer.images import forward_embeds

            t0 = time.perf_counter()
            forward_embeds(self.lm, block.embeds[:s], block.rope_positions[:, :s] + (at - block.start), self.cache)
            self.ids += block.ids[:s]
            self.timings.seam += time.perf_counter() - t0
        self.logits = None
        if s < T:
            t0 = time.perf_counter()
            moved = block.kv_at(self.lm, at) if rerotate else list(block.kv)  # per layer (1, H_kv, T, D) x2
            t1 = time.perf_counter()
            if kvcache.n_layers(self.cache) == 0:
                self.cache = kvcache.from_tensors([(k[:, :, s:], v[:, :, s:]) for k, v in moved])
            else:
                for layer, (k, v) in enumerate(moved):
                    k0, v0 = kvcache.get_kv(self.cache, layer)  # (1, H_kv, p + s, D)
                    kvcache.set_kv(self.cache, layer, torch.cat([k0, k[:, :, s:]], 2), torch.cat([v0, v[:, :, s:]], 2))
            self.ids += block.ids[s:]
            self.timings.rerotate += t1 - t0
            self.timings.splice += time.perf_counter() - t1
        self.spans.append((p, p + T, block.name))
        self.next_pos = at + block.span
        assert kvcache.seq_len(self.cache) == len(self.ids)


Part = Sequence[int] | Block


def compose(lm, parts: Sequence[Part], seam: int = 0, rerotate: bool = True) -> Composer:
    """Compose a context from text parts (token id lists) and blocks, in order.

    Returns the :class:`Composer`; ``.logits`` are the next-token logits after the last text part.
    """
    c = Composer(lm)
    for part in parts:
        if isinstance(part, Block):
            c.block(part, seam, rerotate)
        else:
            c.text(part)
    return c


@torch.no_grad()
def compose_fused(lm, parts: Sequence[Part], seam: int = 0, rerotate: bool = True) -> Composer:
    """:func:`compose` in one forward pass (the serving path; same result to float rounding).

    Every block's stored entries past its seam are placed (re-rotated) at their positions in a
    full-length cache; the fresh tokens (all text parts and every block's first ``seam``
    tokens) then run in one :func:`~kvprobe.kv.cache.masked_forward` with their own positions,
    each attending by position to the spliced entries and to the fresh tokens before it, which
    is exactly what the part-by-part order gives. Their K/V are then moved into their slots.
    The last part must be text (its last token gives the logits).
    """
    check_composable(lm)
    if seam < 0:
        raise UsageError(f"seam must be >= 0, got {seam}")
    if not parts or isinstance(parts[-1], Block) or not len(parts[-1]):
        raise KvprobeError("the last part of a fused composition must be (non-empty) text: the query")
    c = Composer(lm)
    fresh_ids: list[int] = []
    fresh_pos: list[int] = []
    spliced: list[tuple[Block, int, int]] = []  # (block, position, seam)
    for part in parts:
        p = len(c.ids)
        if isinstance(part, Block):
            check_block(lm, part)
            if part.scheme != "rope":
                raise KvprobeError(f"block {part.name or '(unnamed)'} is an image block (M-RoPE); the fused path "
                                   f"places text blocks only: compose it part by part (compose)")
            s = min(seam, len(part))
            fresh_ids += part.ids[:s]
            fresh_pos += range(p, p + s)
            if s < len(part):
                spliced.append((part, p, s))
            c.ids += part.ids
            c.spans.append((p, p + len(part), part.name))
        else:
            part = [int(i) for i in part]
            fresh_ids += part
            fresh_pos += range(p, p + len(part))
            c.ids += part
    N = len(c.ids)
    c._room(0, "all parts")
    t0 = time.perf_counter()
    rotated = [(b, p, s, b.kv_at(lm, p) if rerotate else list(b.kv)) for b, p, s in spliced]
    t1 = time.perf_counter()
    dtype = next(lm.model.parameters()).dtype
    (hk, dk), (hv, dv) = lm.adapter.cache_dims
    kv = []
    for layer in range(lm.adapter.n_layers):
        k = torch.zeros((1, hk, N, dk), dtype=dtype, device=lm.device)  # fresh slots filled below
        v = torch.zeros((1, hv, N, dv), dtype=dtype, device=lm.device)
        for b, p, s, moved in rotated:
            k[:, :, p + s : p + len(b)] = moved[layer][0][:, :, s:]
            v[:, :, p + s : p + len(b)] = moved[layer][1][:, :, s:]
        kv.append((k, v))
    c.cache = kvcache.from_tensors(kv)
    t2 = time.perf_counter()
    fresh = torch.tensor(fresh_pos, device=lm.device)
    visible = torch.zeros(1, len(fresh_pos), N, dtype=torch.bool, device=lm.device)
    for b, p, s in spliced:
        visible[:, :, p + s : p + len(b)] = True  # the fresh slots are empty until filled below
    out = kvcache.masked_forward(lm, torch.tensor([fresh_ids], device=lm.device), c.cache, fresh[None],
                           key_positions=torch.arange(N, device=lm.device), visible=visible, logits_to_keep=1)
    for layer in range(kvcache.n_layers(c.cache)):
        k, v = kvcache.get_kv(c.cache, layer)  # (1, H_kv, N + S, D)
        k[:, :, fresh], v[:, :, fresh] = k[:, :, N:].clone(), v[:, :, N:].clone()  # one head (MLA): overlapping
        kvcache.set_kv(c.cache, layer, k[:, :, :N], v[:, :, :N])
    c.logits = out.logits[0, -1]
    c.timings.rerotate, c.timings.splice, c.timings.prefill = t1 - t0, t2 - t1, time.perf_counter() - t2
    return c


def context_ids(parts: Sequence[Part]) -> list[int]:
    """Every token of the composed context, in order."""
    out: list[int] = []
    for part in parts:
        out += part.ids if isinstance(part, Block) else [int(i) for i in part]
    return out


@torch.no_grad()
def oracle_logits(lm, ids: Sequence[int]) -> torch.Tensor:
    """The control: next-token logits (V,) after a full prefill of the whole context."""
    lm.check_length(len(ids))
    out = kvcache.forward(lm.model, torch.tensor([list(ids)], device=lm.device), kvcache.new_cache(), logits_to_keep=1)
    return out.logits[0, -1]

