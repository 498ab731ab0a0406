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

The knockout probes' mechanics are here too (:mod:`kvprobe.probes.knockout` holds the probes): hooks that
hide cache entries from the decision's queries per layer (:func:`attention_knockout`) or replace head outputs
(:func:`head_patching`), and the batched reads through them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvprobe.datasets import AlignedCase
from kvprobe.errors import KvprobeError, UsageError
from kvprobe.kv import cache as kvcache
from kvprobe.kv.hooks import hooks
from kvprobe.kv.readout import option_columns

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


def pair_memo(ctx) -> PairMemo:
    """The :class:`PairMemo` of the process running a task (an executor's context: :meth:`keep` under
    ``pairs``): the run's own where it handed it in (``Context(lm, pairs=...)``), else one built there."""
    return ctx.keep("pairs", PairMemo)


# -- the knockout probes' mechanics: hooks on the attention mask and head outputs, batched reads -----
HeadSet = frozenset  # of (layer, head) pairs

ATTN_IMPLEMENTATIONS = ("eager", "kvprobe_eager", "sdpa")  # the ones that honour a 4D attention_mask


def _check_attn(lm) -> None:
    impl = getattr(lm.model.config, "_attn_implementation", None) or "eager"
    if impl not in ATTN_IMPLEMENTATIONS:
        raise KvprobeError(f"attention knockout needs an implementation that takes a 4D mask "
                           f"({', '.join(ATTN_IMPLEMENTATIONS)}); this model uses {impl!r}")


# -- hooks -----------------------------------------------------------------------------------
def _hide(mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``mask`` (B|1, 1, S, K) with the cache columns in ``hidden`` (B, N), N <= K, disallowed."""
    B, N = hidden.shape
    assert mask.ndim == 4 and mask.shape[-1] >= N, (mask.shape, hidden.shape)
    cols = torch.zeros(B, mask.shape[-1], dtype=torch.bool, device=mask.device)
    cols[:, :N] = hidden
    cols = cols[:, None, None, :]  # (B, 1, 1, K)
    mask = mask.expand(B, *mask.shape[1:])
    if mask.dtype == torch.bool:  # True = may attend
        return mask & ~cols
    return mask.masked_fill(cols, torch.finfo(mask.dtype).min)


@contextmanager
def attention_knockout(lm, hidden: torch.Tensor) -> Iterator[None]:
    """Hide cache entries from every query of the next forward passes, per layer and batch row.

    ``hidden`` (B, L, N) bool: ``hidden[b, l, j]`` hides cache entry j from row b's queries at
    layer l. The forward must pass an explicit 4D mask (use :func:`knockout_reads`, or
    :func:`kvprobe.kv.cache.masked_forward`); a missing mask is refused, never guessed.
    """
    _check_attn(lm)
    assert hidden.ndim == 3 and hidden.shape[1] == lm.adapter.n_layers, hidden.shape

    def make(h: torch.Tensor):
        def hook(module, args, kwargs):
            mask = kwargs.get("attention_mask")
            if mask is None or isinstance(mask, dict):
                raise KvprobeError("attention knockout needs an explicit 4D attention_mask per layer; "
                                   "read through knockout_reads or masked_forward")
            return args, {**kwargs, "attention_mask": _hide(mask, h)}
        return hook

    with hooks(pre=[(lm.adapter.attention(lm.model, layer), make(hidden[:, layer]))
                    for layer in range(hidden.shape[1]) if hidden[:, layer].any()], with_kwargs=True):
        yield


@contextmanager
def head_patching(lm, patches: Sequence[HeadSet], source: torch.Tensor | None) -> Iterator[None]:
    """Replace head outputs at the last query position of the next forward passes.

    ``patches[b]`` is the set of (layer, head) pairs patched in batch row b. ``source``
    (L, n_heads * head_dim) holds the replacement o_proj inputs (e.g. :func:`head_inputs` of the
    new read); None zeroes the heads (head knockout).
    """
    ad = lm.adapter
    L, H, hd = ad.n_layers, ad.n_heads, ad.head_dim
    B = len(patches)
    sel = torch.zeros(L, B, H, dtype=torch.bool)  # which heads each row patches, per layer
    for b, heads in enumerate(patches):
        for layer, head in heads:
            if not (0 <= layer < L and 0 <= head < H):
                raise UsageError(f"no head ({layer}, {head}) in a model of {L} layers x {H} query heads")
            sel[layer, b, head] = True
    if source is not None:
        assert source.shape == (L, H * hd), (source.shape, (L, H * hd))

    def make(layer: int):
        def hook(module, args):
            x = args[0]  # (B, S, H * hd)
            assert x.shape[0] == B and x.shape[-1] == H * hd, (x.shape, B, H * hd)
            xv = x.reshape(B, x.shape[1], H, hd).clone()  # (B, S, H, hd)
            rep = (torch.zeros(H, hd, dtype=x.dtype, device=x.device) if source is None
                   else source[layer].reshape(H, hd).to(x))  # (H, hd)
            s = sel[layer].to(x.device)[..., None]  # (B, H, 1)
            xv[:, -1] = torch.where(s, rep[None], xv[:, -1])
            return (xv.reshape(x.shape), *args[1:])
        return hook

    with hooks(pre=[(ad.proj(lm.model, layer, "o"), make(layer)) for layer in range(L) if sel[layer].any()]):
        yield


@contextmanager
def recording_head_inputs(lm, store: dict[int, torch.Tensor]) -> Iterator[None]:
    """Record every layer's o_proj input at the last query position into ``store[layer]`` (B, H*hd)."""

    def make(layer: int):
        def hook(module, args):
            store[layer] = args[0][:, -1].detach().clone()
        return hook

    with hooks(pre=[(lm.adapter.proj(lm.model, layer, "o"), make(layer)) for layer in range(lm.adapter.n_layers)]):
        yield


# -- batched reads ---------------------------------------------------------------------------
def _chunks(cache: DynamicCache, n: int, batch_bytes: int) -> Iterator[tuple[int, int]]:
    per = max(1, batch_bytes // max(1, cache_bytes(cache)))
    for start in range(0, n, per):
        yield start, min(n, start + per)


def _read(lm, cache: DynamicCache, token: int, position: int, B: int, columns: Sequence[int] | None = None
          ) -> torch.Tensor:
    """Decision logits (B, V): ``token`` at ``position`` over B copies of a batch-1 ``cache``
    (only ``columns`` computed when given)."""
    batch = kvcache.concat([cache] * B, dim="batch")
    ids, pos = torch.full((B, 1), token), torch.full((B, 1), position)
    return kvcache.masked_forward(lm, ids, batch, pos, columns=columns).logits[:, -1]


@torch.no_grad()
def knockout_reads(lm, cache: DynamicCache, token: int, position: int, hidden: torch.Tensor,
                   batch_bytes: int = DEFAULT_BATCH_BYTES, columns: Sequence[int] | None = None) -> torch.Tensor:
    """Decision logits (B, V), row b read with the edges ``hidden[b]`` (L, N) removed.

    ``cache`` holds one prompt's positions [0, N) (batch 1) and is left untouched. With ``columns``
    only those vocabulary ids are computed (the rest are -inf).
    """
    assert hidden.ndim == 3 and hidden.shape[2] == kvcache.seq_len(cache), (hidden.shape, kvcache.seq_len(cache))
    out = []
    for lo, hi in _chunks(cache, hidden.shape[0], batch_bytes):
        with attention_knockout(lm, hidden[lo:hi]):
            out.append(_read(lm, cache, token, position, hi - lo, columns))
    return torch.cat(out)


@torch.no_grad()
def head_inputs(lm, cache: DynamicCache, token: int, position: int, columns: Sequence[int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (V,), o_proj inputs (L, n_heads * head_dim)) of one plain read of ``token``."""
    store: dict[int, torch.Tensor] = {}
    with recording_head_inputs(lm, store):
        logits = _read(lm, cache, token, position, 1, columns)[0]
    return logits, torch.stack([store[layer][0] for layer in range(lm.adapter.n_layers)])


@torch.no_grad()
def head_patched_reads(lm, cache: DynamicCache, token: int, position: int, patches: Sequence[HeadSet],
                       source: torch.Tensor | None, batch_bytes: int = DEFAULT_BATCH_BYTES,
                       columns: Sequence[int] | None = None) -> torch.Tensor:
    """Decision logits (len(patches), V) with each row's heads patched from ``source`` (None: zeroed);
    with ``columns`` only those vocabulary ids are computed."""
    out = []
    for lo, hi in _chunks(cache, len(patches), batch_bytes):
        with head_patching(lm, patches[lo:hi], source):
            out.append(_read(lm, cache, token, position, hi - lo, columns))
    return torch.cat(out)


def single_position_effects(lm, pc: PairCaches, m_of) -> torch.Tensor:
    """(D,) change of m when one old-cache position takes the new prompt's K/V (all layers)."""
    ms = m_of(patched_reads(lm, pc, [Patch(()), *(Patch((p,)) for p in range(pc.D))],
                            columns=option_columns(pc.a.option_ids)))
    return ms[1:] - ms[0]
