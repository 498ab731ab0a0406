"""Image blocks under M-RoPE (Qwen2-VL): an image's KV precompiled once, spliced into contexts at
other positions, re-rotated, and its seam fed fresh (see :mod:`kvprobe.composer`).

Qwen2-VL gives every token three position ids (temporal, height, width). Text has (t, t, t); an
image that starts at s has (s, s) for its vision-start token, then (s + 1 + frame, s + 1 + row,
s + 1 + column) over its merged patch grid, then its vision-end token, and the text after it
continues from the largest of them + 1, so an image block takes fewer positions than tokens
(:attr:`Block.span`). Moving a whole image block from start s to s' shifts all three axes by the
same delta = s' - s, and M-RoPE turns every frequency by delta (each frequency reads one axis),
exactly as 1-D RoPE does; so :meth:`Block.kv_at` moves it, with the delta counted in M-RoPE
positions, never in tokens (``tests/families/test_mrope.py`` shows the token count fails).

What an image block holds: its tokens (vision start, one image token per merged patch, vision
end), their K/V from a prefill behind the preamble, their three position rows, their input
embeddings (the token embeddings with the vision tower's features in the image tokens: a seam
of s > 0 tokens is fed fresh from them, the vision tower is not run again), and the image's
identity (``sha256`` over its pixel values and grid, ``grid_thw``), which the block store keeps
in the file's header.

Every forward here passes explicit position ids: the model keeps the M-RoPE offset of the last
image prompt it saw (``rope_deltas``) and would add it to a later text forward that passes
none; :func:`_positions_kept` puts it back after each multimodal call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvprobe.composer.blocks import Block, _dtype_name, check_composable, is_mrope
from kvprobe.errors import KvprobeError, UsageError
from kvprobe.kv import cache as kvcache


@dataclass(frozen=True, eq=False)
class Image:
    """An image as the model's image processor gives it: ``pixels`` (patches, C * T * P * P) and
    ``grid`` (t, h, w) in patches."""

    pixels: torch.Tensor
    grid: tuple[int, int, int]

    @property
    def sha256(self) -> str:
        """Content hash over the pixel values (float32) and the grid."""
        h = hashlib.sha256(repr(tuple(int(x) for x in self.grid)).encode())
        h.update(self.pixels.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return "sha256:" + h.hexdigest()

    def grid_tensor(self) -> torch.Tensor:
        return torch.tensor([list(self.grid)])


def check_mrope(lm, what: str) -> None:
    """Refuse a model without M-RoPE and a vision tower (one line)."""
    if not is_mrope(lm) or getattr(lm.model.config, "image_token_id", None) is None:
        raise UsageError(f"{what} needs a model with M-RoPE and a vision tower (e.g. tiny-qwen2_vl); "
                         f"{lm.info.spec} has neither")


def _vision(lm):
    return lm.model.config.vision_config


def n_image_tokens(lm, image: Image) -> int:
    t, h, w = image.grid
    return t * h * w // _vision(lm).spatial_merge_size ** 2


def image_from_array(lm, array) -> Image:
    """An image (H, W, 3) uint8 array through the model family's own image processor (Qwen2-VL's
    PIL one), sized to whole merged patches: H and W rounded to multiples of patch x merge."""
    import numpy as np
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    check_mrope(lm, "an image")
    array = np.asarray(array)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise UsageError(f"an image must be an (H, W, 3) uint8 array, got {array.shape} {array.dtype}")
    v = _vision(lm)
    unit = v.patch_size * v.spatial_merge_size
    side = (array.shape[0] * array.shape[1]) ** 0.5
    proc = Qwen2VLImageProcessorPil(patch_size=v.patch_size, merge_size=v.spatial_merge_size,
                                    temporal_patch_size=v.temporal_patch_size, min_pixels=unit * unit,
                                    max_pixels=max(unit * unit, int(side * side) * 4))
    out = proc(images=array, return_tensors="pt")
    return Image(out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0]))


def generated_image(lm, seed: int, size: int = 32) -> Image:
    """A deterministic random (size, size, 3) image through the image processor (tests, validate)."""
    import numpy as np

    array = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return image_from_array(lm, array)


def image_ids(lm, image: Image) -> list[int]:
    """The image's tokens: vision start, one image token per merged patch, vision end."""
    cfg = lm.model.config
    return [cfg.vision_start_token_id] + [cfg.image_token_id] * n_image_tokens(lm, image) + [cfg.vision_end_token_id]


@contextmanager
def _positions_kept(lm):
    """Restore the model's stored M-RoPE offset (``rope_deltas``) after a multimodal call."""
    inner = lm.model.model
    kept = getattr(inner, "rope_deltas", None)
    try:
        yield
    finally:
        inner.rope_deltas = kept


def _type_ids(lm, ids: torch.Tensor) -> torch.Tensor:
    return (ids == lm.model.config.image_token_id).int()


def mrope_positions(lm, ids: Sequence[int], images: Sequence[Image]) -> torch.Tensor:
    """(3, T) M-RoPE positions of a prompt with ``images`` (in order), by the model's own rule."""
    t = torch.tensor([list(ids)], device=lm.device)
    grids = torch.cat([im.grid_tensor() for im in images]).to(lm.device) if images else None
    with _positions_kept(lm):
        pos, _ = lm.model.model.get_rope_index(t, image_grid_thw=grids, mm_token_type_ids=_type_ids(lm, t))
    return pos[:, 0]


@torch.no_grad()
def input_embeds(lm, ids: Sequence[int], images: Sequence[Image]) -> torch.Tensor:
    """(T, d) decoder input embeddings: the token embeddings, the vision tower's features in the
    image tokens (in order)."""
    t = torch.tensor([list(ids)], device=lm.device)
    emb = lm.model.get_input_embeddings()(t)  # (1, T, d)
    if images:
        feats = lm.model.model.get_image_features(torch.cat([im.pixels for im in images]).to(lm.device),
                                                  torch.cat([im.grid_tensor() for im in images]).to(lm.device))
        feats = torch.cat(list(feats.pooler_output)).to(emb.dtype)  # (image tokens, d)
        mask = (t == lm.model.config.image_token_id)[..., None].expand_as(emb)
        if int(mask[..., 0].sum()) != feats.shape[0]:
            raise KvprobeError(f"the prompt has {int(mask[..., 0].sum())} image tokens, its images "
                               f"{feats.shape[0]} features")
        emb = emb.masked_scatter(mask, feats)
    return emb[0]


@torch.no_grad()
def forward_embeds(lm, embeds: torch.Tensor, positions: torch.Tensor, cache, logits_to_keep: int = 1):
    """Run (T, d) input embeddings at (3, T) M-RoPE positions after ``cache`` (appended in place)."""
    with _positions_kept(lm):
        return lm.model(inputs_embeds=embeds[None], position_ids=positions[:, None].to(lm.device), use_cache=True,
                        logits_to_keep=logits_to_keep, **{kvcache.CACHE_KWARG: cache})


@torch.no_grad()
def precompile_image(lm, image: Image, preamble: Sequence[int] = (), name: str = "") -> Block:
    """The image's KV computed in isolation behind ``preamble`` (text, positions 0..P-1), as an
    image block (see the module docstring)."""
    check_composable(lm)
    check_mrope(lm, "an image block")
    preamble = [int(i) for i in preamble]
    ids = image_ids(lm, image)
    full = preamble + ids
    lm.check_length(len(full), f"image block {name or '(unnamed)'} with its preamble")
    pos = mrope_positions(lm, full, [image])  # (3, P + T)
    emb = input_embeds(lm, full, [image])  # (P + T, d)
    cache = kvcache.new_cache()
    forward_embeds(lm, emb, pos, cache)
    P = len(preamble)
    kv = [(k[:, :, P:].contiguous(), v[:, :, P:].contiguous()) for k, v in kvcache.to_tensors(cache)]
    return Block(ids, kv, P, preamble, lm.config_hash(), _dtype_name(lm), name or f"image-{image.sha256[7:19]}",
                 rope_positions=pos[:, P:].clone(), embeds=emb[P:].clone(),
                 image={"sha256": image.sha256, "grid_thw": list(image.grid)})


@torch.no_grad()
def multimodal_oracle_logits(lm, ids: Sequence[int], images: Sequence[Image]) -> torch.Tensor:
    """The control for contexts with image blocks: next-token logits (V,) after the model's own
    full prefill of ``ids`` with its pixel values (the vision tower run, its positions computed by
    the model from the token ids and grids, nothing of kvprobe's)."""
    lm.check_length(len(ids))
    t = torch.tensor([list(ids)], device=lm.device)
    kwargs = {}
    if images:
        kwargs = {"pixel_values": torch.cat([im.pixels for im in images]).to(lm.device),
                  "image_grid_thw": torch.cat([im.grid_tensor() for im in images]).to(lm.device),
                  "mm_token_type_ids": _type_ids(lm, t)}
    with _positions_kept(lm):
        lm.model.model.rope_deltas = None  # computed afresh from this prompt
        out = lm.model(input_ids=t, use_cache=True, logits_to_keep=1, **{kvcache.CACHE_KWARG: kvcache.new_cache()},
                       **kwargs)
    return out.logits[0, -1]


def image_block_from_cache(lm, cache, ids: Sequence[int], index: int, positions: torch.Tensor,
                           embeds: torch.Tensor, image: Image, name: str = "") -> Block:
    """An image block of the entries [index, index + len(ids)) of an existing cache (e.g. the
    jointly computed KV of a full multimodal prefill): ``positions`` (3, T) are the M-RoPE
    positions they were computed at, ``embeds`` (T, d) their input embeddings."""
    from kvprobe.composer.blocks import block_from_cache

    check_mrope(lm, "an image block")
    plain = block_from_cache(lm, cache, ids, index, name)
    return Block(plain.ids, plain.kv, int(positions[0, 0]), [], plain.config_hash, plain.dtype,
                 name or f"image-{image.sha256[7:19]}", rope_positions=positions.clone(), embeds=embeds.clone(),
                 image={"sha256": image.sha256, "grid_thw": list(image.grid)})
