"""The batched cache-space patching engine.

Existing toolkits patch by re-running the whole forward pass per intervention. Here an
intervention is a *cache edit*: start from the old prompt's cache, swap some entries for the new
prompt's (all layers or chosen ones), and re-read the decision by feeding only the decision
token. Many patched caches go through one decode step as a batch, so a single-position sweep
over an L-token prompt costs L one-token reads, not L forward passes.

All caches here hold positions [0, D) of a prompt; the decision token (position D) is fed at
read time. A read that needs only the options' scores asks for those vocabulary columns
(``columns=``), so the LM head's projection onto the whole vocabulary is skipped.

:class:`PairCaches` are one case's two caches and decision logits, built in one pass (the prefix
before the field once, the two rests as a batch of two); :class:`PairMemo` keeps them for every
stage of a run, so a case is prefilled once however many probes read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvprobe.datasets import AlignedCase
from kvprobe.kv import cache as kvcache
from kvprobe.kv.hooks import hooks

DEFAULT_BATCH_BYTES = 768 * 2**20  # memory budget for one batch of patched caches


@dataclass(frozen=True)
class Patch:
    """Swap old-cache entries at ``positions`` for the new prompt's, on ``layers`` (None: all)."""

    positions: tuple[int, ...]
    layers: tuple[int, ...] | None = None


@dataclass
class PairCaches:
    """The old and new caches of one aligned case (positions [0, D)), the decision token, and the
    decision logits of both prompts (2, V): row 0 the old prompt's (the stale read), row 1 the new's.

    With ``resid`` (built with ``residuals=True``), every decoder layer's output residual of both
    prompts from the field on: (2, n_layers, D + 1 - field[0], hidden), position p at p - field[0]
    (what the linear probe reads, so it needs no pass of its own)."""

    a: AlignedCase
    old: DynamicCache
    new: DynamicCache
    logits: torch.Tensor | None = None
    resid: torch.Tensor | None = None

    @property
    def D(self) -> int:
        return self.a.decision_pos

    @property
    def nbytes(self) -> int:
        extra = self.resid.numel() * self.resid.element_size() if self.resid is not None else 0
        return 2 * cache_bytes(self.old) + extra

    @classmethod
    @torch.no_grad()
    def build(cls, lm, a: AlignedCase, residuals: bool = False) -> "PairCaches":
        """Prefill both prompts through the decision token in one pass: the identical prefix before
        the field once, then the two rests as one batch of two. The caches keep [0, D)."""
        D, f0 = a.decision_pos, a.field[0]
        logits, cache, resid = pair_pass(lm, a, f0, residuals=residuals)
        kvcache.truncate_(cache, D)
        return cls(a, kvcache.take_rows(cache, [0]), kvcache.take_rows(cache, [1]), logits, resid)


@torch.no_grad()
def pair_pass(lm, a: AlignedCase, start: int, prefix: DynamicCache | None = None, residuals: bool = False
              ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor | None]:
    """Both prompts through the decision token: [0, start) (identical in both; ``start`` <= the
    field) from ``prefix`` (a cache of at least ``start`` positions of either prompt) or prefilled
    once, then [start, D] as one batch of two. Returns the decision logits (2, V), the cache
    (2 rows, positions [0, D]) and, with ``residuals``, each layer's output residual of positions
    start..D: (2, n_layers, D + 1 - start, hidden)."""
    D = a.decision_pos
    assert start <= a.field[0], (start, a.field)
    ids = torch.tensor([a.ids_old[: D + 1], a.ids_new[: D + 1]])
    if prefix is None and start:
        _, prefix = kvcache.prefill(lm.model, ids[:1, :start], logits_to_keep=1)
    cache = kvcache.expand_batch(kvcache.crop(prefix, start), 2) if start else kvcache.new_cache()
    got: list[torch.Tensor | None] = [None] * lm.adapter.n_layers

    def record(i):
        def fn(_module, _inputs, out):
            got[i] = (out[0] if isinstance(out, tuple) else out).detach()
        return fn

    posts = [(layer, record(i)) for i, layer in enumerate(lm.adapter.layers(lm.model))] if residuals else []
    with hooks(post=posts):
        out = kvcache.forward(lm.model, ids[:, start:], cache, positions=torch.arange(start, D + 1), logits_to_keep=1)
    return out.logits[:, -1], cache, torch.stack(got, 1) if residuals else None


cache_bytes = kvcache.nbytes  # bytes of one cache (kept under this name for the probes)


@torch.no_grad()
def read_batch(lm, caches: list[DynamicCache], token: int, position: int, visible: torch.Tensor | None = None,
               columns: Sequence[int] | None = None) -> torch.Tensor:
    """Decision logits (B, V) for a batch of same-length caches, each fed ``token`` at ``position``.

    ``visible`` (B, 1, N) hides cache entries from the decision token (edge knockout). With
    ``columns`` only those vocabulary ids are computed (e.g. :func:`~kvprobe.kv.readout.option_columns`;
    the rest are -inf).
    """
    batch = kvcache.concat(caches, dim="batch")
    B = len(caches)
    ids = torch.full((B, 1), token)
    pos = torch.full((B, 1), position)
    if visible is None:
        out = kvcache.forward(lm.model, ids, batch, pos, columns=columns)
    else:
        out = kvcache.masked_forward(lm, ids, batch, pos, visible=visible, columns=columns)
    return out.logits[:, -1]


@torch.no_grad()
def patched_reads(lm, pc: PairCaches, patches: Sequence[Patch], batch_bytes: int = DEFAULT_BATCH_BYTES,
                  columns: Sequence[int] | None = None) -> torch.Tensor:
    """Decision logits (len(patches), V): one read per patched copy of the old cache, batched.
    With ``columns`` only those vocabulary ids are computed (the rest are -inf)."""
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
        out.append(kvcache.forward(lm.model, ids, batch, torch.full((B, 1), pc.D), columns=columns).logits[:, -1])
    return torch.cat(out)


DEFAULT_MEMO_BYTES = 4 * 2**30  # caches a run keeps between its stages; beyond it, cases are prefilled again


class PairMemo:
    """Each case's :class:`PairCaches`, built once and shared by every stage of a run (validity, the
    probes, the edits' old cache) instead of prefilled again by each. Holds at most ``max_bytes``;
    a case beyond that, or one dropped, is built again when asked for (the same computation, so
    the same numbers). ``residuals``: build with the residual streams (for the linear probe)."""

    def __init__(self, lm, max_bytes: int = DEFAULT_MEMO_BYTES, residuals: bool = False):
        self.lm, self.max_bytes, self.residuals = lm, max_bytes, residuals
        self._pairs: dict[str, PairCaches] = {}
        self._bytes = 0

    def get(self, a: AlignedCase) -> PairCaches:
        pc = self._pairs.get(a.case.case_id)
        if pc is None or pc.a.ids_old != a.ids_old or pc.a.ids_new != a.ids_new:
            pc = PairCaches.build(self.lm, a, residuals=self.residuals)
            if self._bytes + pc.nbytes <= self.max_bytes:
                self._pairs[a.case.case_id], self._bytes = pc, self._bytes + pc.nbytes
        return pc

    def drop(self, case_id: str) -> None:
        """Let one case's caches go."""
        pc = self._pairs.pop(case_id, None)
        if pc is not None:
            self._bytes -= pc.nbytes

    def keep(self, case_ids) -> None:
        """Drop every case not in ``case_ids`` (the ones later stages still need)."""
        for cid in set(self._pairs) - set(case_ids):
            self._bytes -= self._pairs.pop(cid).nbytes

    def drop_residuals(self) -> None:
        """Let the residual streams go (after the linear probe read them); later builds skip them."""
        self.residuals = False
        for pc in self._pairs.values():
            self._bytes -= pc.nbytes
            pc.resid = None
            self._bytes += pc.nbytes
