"""The one shim over the transformers Cache (v5 API). Nothing else touches cache internals.

Layout of every K/V tensor handled here::

    keys, values: (B, H_kv, T, D)   # batch, kv heads, cache positions, head dim
                                    # keys are stored *after* RoPE (and after k-norm where the
                                    # family has one); values are never rotated.

We always prefill into a plain full-length ``DynamicCache()`` (no config): the model's own cache
keeps only the last window-1 positions on sliding-window layers, which breaks editing and
splicing. Attention masking still applies the window, because masks are built from the config.

transformers 5.24 renamed the forward keyword ``past_key_values`` to ``cache`` and returns
``out.cache``; :data:`CACHE_KWARG` and :func:`forward` hide that difference.
"""

from __future__ import annotations

import copy as _copy
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvprobe.errors import KvprobeError
from kvprobe.kv.mask import additive_mask


def _cache_kwarg() -> str:
    from transformers.models.llama.modeling_llama import LlamaModel

    params = inspect.signature(LlamaModel.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


CACHE_KWARG = _cache_kwarg()


def new_cache() -> DynamicCache:
    """An empty, plain, full-length cache (no sliding-window eviction)."""
    return DynamicCache()


def seq_len(cache: DynamicCache) -> int:
    return cache.get_seq_length() if len(cache.layers) else 0


def n_layers(cache: DynamicCache) -> int:
    return len(cache.layers)


def get_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of one layer, each (B, H_kv, T, D). The tensors are the cache's own."""
    lay = cache.layers[layer]
    return lay.keys, lay.values


def set_kv(cache: DynamicCache, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Replace one layer's K/V wholesale; shapes (B, H_kv, T, D) must agree."""
    assert keys.shape == values.shape[:-1] + keys.shape[-1:] and keys.ndim == 4, (keys.shape, values.shape)
    lay = cache.layers[layer]
    lay.keys, lay.values = keys, values


def from_tensors(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache holding the given per-layer (keys, values), each (B, H_kv, T, D)."""
    cache = new_cache()
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer)
    return cache


def to_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [get_kv(cache, i) for i in range(n_layers(cache))]


def nbytes(cache: DynamicCache) -> int:
    """Bytes held by a cache's keys and values."""
    return sum(k.numel() * k.element_size() * 2 for k, _ in to_tensors(cache))


def copy(cache: DynamicCache) -> DynamicCache:
    """A deep copy: edits to it never reach the original."""
    return from_tensors([(k.clone(), v.clone()) for k, v in to_tensors(cache)])


def crop(cache: DynamicCache, length: int) -> DynamicCache:
    """A new cache with positions [0, length) (views; the original is untouched)."""
    if not 0 <= length <= seq_len(cache):
        raise KvprobeError(f"cannot crop a cache of {seq_len(cache)} positions to {length}")
    return from_tensors([(k[:, :, :length], v[:, :, :length]) for k, v in to_tensors(cache)])


def is_prefix_view(cache: DynamicCache, base: DynamicCache) -> bool:
    """Whether ``cache`` is ``base``'s first entries as views of its own tensors (what :func:`crop` gives)."""
    if n_layers(cache) != n_layers(base) or seq_len(cache) > seq_len(base):
        return False
    return all(t.data_ptr() == u.data_ptr() and t.stride() == u.stride()
               for (k, v), (bk, bv) in zip(to_tensors(cache), to_tensors(base)) for t, u in ((k, bk), (v, bv)))


def select(cache: DynamicCache, positions: torch.Tensor | list[int]) -> DynamicCache:
    """A new cache holding only the given positions, in the given order."""
    idx = torch.as_tensor(positions, dtype=torch.long)
    return from_tensors([(k[:, :, idx], v[:, :, idx]) for k, v in to_tensors(cache)])


def concat(caches: list[DynamicCache], dim: str = "seq") -> DynamicCache:
    """Concatenate caches along positions (``dim="seq"``) or along the batch (``dim="batch"``)."""
    axis = {"seq": 2, "batch": 0}[dim]
    layers = zip(*(to_tensors(c) for c in caches))
    return from_tensors([(torch.cat([k for k, _ in kv], axis), torch.cat([v for _, v in kv], axis)) for kv in layers])


def expand_batch(cache: DynamicCache, batch: int) -> DynamicCache:
    """Repeat a batch-1 cache ``batch`` times (copies, so each row can be edited on its own)."""
    return from_tensors([(k.expand(batch, -1, -1, -1).clone(), v.expand(batch, -1, -1, -1).clone())
                         for k, v in to_tensors(cache)])


def take_rows(cache: DynamicCache, rows: list[int]) -> DynamicCache:
    """A new cache holding the given batch rows, in the given order (copies)."""
    idx = torch.as_tensor(rows, dtype=torch.long)
    return from_tensors([(k[idx], v[idx]) for k, v in to_tensors(cache)])


HIDDEN_POSITION = 2**30  # a key position no query reaches: the entry is masked out


def left_pad(caches: list[DynamicCache]) -> tuple[DynamicCache, torch.Tensor]:
    """Batch-1 caches of different lengths as one batch, padded on the left with zeros.

    Returns (cache, key_positions (B, N)): a padding entry gets :data:`HIDDEN_POSITION`, so
    :func:`masked_forward` with these key positions never lets a query see it; a real entry keeps
    its index in its own cache as its position.
    """
    lengths = [seq_len(c) for c in caches]
    n = max(lengths)
    layers = zip(*(to_tensors(c) for c in caches))
    pad = lambda t, length: torch.nn.functional.pad(t, (0, 0, n - length, 0))  # noqa: E731
    cache = from_tensors([(torch.cat([pad(k, m) for (k, _), m in zip(kv, lengths)]),
                           torch.cat([pad(v, m) for (_, v), m in zip(kv, lengths)])) for kv in layers])
    key_positions = torch.stack([torch.cat([torch.full((n - m,), HIDDEN_POSITION), torch.arange(m)]) for m in lengths])
    return cache, key_positions


@torch.no_grad()
def forward(model, input_ids: torch.Tensor, cache: DynamicCache | None = None,
            positions: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
            columns=None, **kwargs):
    """Run ``input_ids`` (B, T) after ``cache`` (appending to it in place); returns the HF output.

    ``positions`` (B, T) or (T,) are the RoPE positions of the new tokens; by default they
    continue the cache (``seq_len(cache) + arange(T)``). Masking follows cache *indices*, so a
    gap in positions (a composed context) is allowed. The ids and positions go to the model's input
    device (``model.device``: the first device of a model spread by a device map; a no-op on cpu).
    With ``columns`` (vocabulary ids) only those logits of the last position are computed
    (:class:`ColumnLogits`); ``columns=()`` computes none (a prefill for its cache alone).
    """
    if cache is None:
        cache = new_cache()
    device = getattr(model, "device", input_ids.device)
    input_ids = input_ids.to(device)
    if positions is not None:
        positions = positions.to(device)
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    if positions is None:
        start = seq_len(cache)
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
    if positions.ndim == 1:
        positions = positions[None].expand(input_ids.shape[0], -1)
    return _call(model, columns, input_ids=input_ids, position_ids=positions, attention_mask=attention_mask,
                 use_cache=True, **{CACHE_KWARG: cache}, **kwargs)


@dataclass
class ColumnLogits:
    """The last position's logits (B, 1, V) with only some vocabulary columns computed (the rest -inf)."""

    logits: torch.Tensor


def _call(model, columns, **inputs):
    """``model(**inputs)``; with ``columns`` (vocabulary ids), the decoder only, then the LM head on
    those columns of the last position (the final softcap applied where the model has one): a
    decision read that needs a few options' scores skips the vocabulary projection, a large share
    of a one-token read (a sixth of the 1.5B's, more on smaller models). The other columns are -inf."""
    if columns is None:
        return model(**inputs)
    inputs.pop("logits_to_keep", None)
    hidden = model.get_decoder()(**inputs).last_hidden_state[:, -1:]  # (B, 1, d), after the final norm
    head = model.get_output_embeddings()
    cols = torch.as_tensor(columns, dtype=torch.long, device=hidden.device)
    sub = torch.nn.functional.linear(hidden, head.weight[cols], None if head.bias is None else head.bias[cols])
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        sub = torch.tanh(sub / cap) * cap
    logits = sub.new_full((*sub.shape[:-1], head.weight.shape[0]), float("-inf"))
    logits[..., cols] = sub
    return ColumnLogits(logits)


def output_cache(out) -> DynamicCache:
    """The cache from a model output, under either transformers' name."""
    return getattr(out, "cache", None) or out.past_key_values


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, start: int = 0, logits_to_keep: int = 0
            ) -> tuple[torch.Tensor, DynamicCache]:
    """Prefill ``input_ids`` (T,) or (1, T) into a fresh full-length cache at positions start..

    Returns (logits (1, T, V), cache); with ``logits_to_keep=n`` only the last n positions' logits
    are computed (1 when the cache is all that is wanted: the vocabulary projection is a large
    share of a small model's prefill).
    """
    ids = input_ids if input_ids.ndim == 2 else input_ids[None]
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)
    cache = new_cache()
    out = forward(model, ids, cache, positions, logits_to_keep=logits_to_keep)
    return out.logits, cache


def deepcopy(cache: DynamicCache) -> DynamicCache:
    """Alias of :func:`copy` for readers used to ``copy.deepcopy``."""
    return copy(cache) if n_layers(cache) else _copy.deepcopy(cache)


@torch.no_grad()
def masked_forward(lm, input_ids: torch.Tensor, cache: DynamicCache, positions: torch.Tensor,
                   key_positions: torch.Tensor | None = None, visible: torch.Tensor | None = None,
                   columns=None, rope_positions: torch.Tensor | None = None, **kwargs):
    """Run new tokens against ``cache`` under an explicit visibility rule (see :mod:`kvprobe.kv.mask`).

    input_ids, positions: (B, S); key_positions: (B, N) or (N,) RoPE positions of the cache
    entries (default: their indices); visible: (B, S, N) bool, which cache entries each new token
    may attend to (default: all, subject to causality by position); (B, S, N + S): and which new
    tokens. The new tokens' K/V are appended to ``cache`` in place, at indices N..N+S-1. The tensors
    go to the model's input device (``lm.model.device``; a no-op on cpu). ``columns``: as in :func:`forward`.

    ``rope_positions``: the positions the model rotates by, where they are not ``positions``: an
    M-RoPE model's (3, B, S) ids (docs/architectures.md), whose image tokens share positions; the
    mask still orders tokens by ``positions`` and ``key_positions`` (their indices, then).
    """
    device = lm.model.device
    input_ids, positions = input_ids.to(device), positions.to(device)
    key_positions = key_positions.to(device) if key_positions is not None else None
    visible = visible.to(device) if visible is not None else None
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    B, S = input_ids.shape
    if positions.ndim == 1:
        positions = positions[None].expand(B, -1)
    N = seq_len(cache)
    if key_positions is None:
        key_positions = torch.arange(N, device=input_ids.device)
    if key_positions.ndim == 1:
        key_positions = key_positions[None].expand(B, -1)
    dtype = next(lm.model.parameters()).dtype
    masks = lm.adapter.attention_masks(
        lambda window: additive_mask(positions, key_positions, visible, window, dtype))
    rotate = positions if rope_positions is None else rope_positions.to(device)
    return _call(lm.model, columns, input_ids=input_ids, position_ids=rotate, attention_mask=masks, use_cache=True,
                 **{CACHE_KWARG: cache}, **kwargs)


def truncate_(cache: DynamicCache, length: int) -> None:
    """Drop every entry from index ``length`` on, in place (undoes appends made by a read)."""
    for layer in range(n_layers(cache)):
        k, v = get_kv(cache, layer)
        set_kv(cache, layer, k[:, :, :length], v[:, :, :length])
