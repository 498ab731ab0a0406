"""RoPE re-rotation: move cached keys to new positions without recomputing them.

RoPE rotates each frequency pair of a key by an angle ``pos * inv_freq``, so a key computed at
position p and re-rotated by R(Δ) equals the key computed at p + Δ: R(Δ)·R(p) = R(p + Δ). Cached
keys are stored after RoPE (and after k-norm in Qwen3 / Gemma-3, which acts before RoPE and so
needs nothing here); values are never rotated.

Conventions, matched to transformers exactly:

* **rotate_half.** Dimension i pairs with i + D_rot/2 (first half / second half of the rotary
  dims); cos/sin are ``cat(freqs, freqs)``. Not the interleaved (2i, 2i+1) GPT-J style.
* **Frequencies are the model's own.** :func:`inv_freq` calls transformers'
  ``ROPE_INIT_FUNCTIONS`` (or, for ``default``, the family's own
  ``<Family>RotaryEmbedding.compute_default_rope_parameters``) on the layer's RoPE parameters
  from :meth:`Adapter.rope_parameters`, so default, linear, llama3 and YaRN give exactly the
  model's inv_freq, and Gemma-3 gets θ = 10,000 on local (sliding) layers and 1,000,000 on global
  ones. Dynamic (length-dependent) types are refused with a ``KvprobeError``.
* **YaRN's attention factor (mscale) is not applied again.** The model multiplies cos and sin by
  it, so a cached key is ``mscale · R(p) k``; re-rotation multiplies by the unit-magnitude R(Δ)
  only, giving ``mscale · R(p + Δ) k``.
* **Partial rotary.** Only the first ``2 * len(inv_freq)`` dims rotate; the rest pass through
  unchanged. In transformers 5.24 none of the six supported families honours
  ``partial_rotary_factor``: their default RoPE ignores it (full rotation, and so does
  :func:`inv_freq`, because it asks the family's own default function), and their scaled types
  fail in the model's forward when it is < 1.

Accuracy. The rotation is computed in float64 and cast back to the keys' dtype. What remains is
the model's own float32 angle ``fl32(pos * inv_freq)`` in the fresh prefill (transformers computes
it in float32 even for a float64 model), which grows about linearly with the position. Max abs
error over all layers of keys prefilled at 0.. and re-rotated by Δ, against a fresh prefill at
Δ.. (12 random tokens, float32 models, :func:`rerotation_error`; a float32 rotation gives the same
numbers to two digits, so the model's angles dominate)::

    Δ        tiny-llama   tiny-gemma3   smollm2-135m
    37       1.5e-7       7.2e-7        7.8e-6
    256      1.1e-6       5.2e-6        2.8e-5
    1024     5.1e-6       2.9e-5        1.1e-4
    4096     1.4e-5       7.4e-5        4.4e-4
    32768    1.1e-4       7.7e-4        3.5e-3

Max |key| is 0.57 (tiny-llama), 3.1 (tiny-gemma3) and 19 (SmolLM2-135M), so the relative error
is about 4e-7 at Δ = 37 and 2e-4 at Δ = 32k. The self-check's absolute tolerance (1e-4) is
meant for its moderate shift (37), not for shifts in the thousands.

Tensor layout, as in :mod:`kvprobe.kv.cache`: keys (B, H_kv, T, D).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator

import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvprobe.errors import KvprobeError
from kvprobe.kv import cache as kvcache
from kvprobe.kv.hooks import hooks
from kvprobe.models.adapter import Adapter, Family

SELF_CHECK_SHIFT = 37  # a moderate shift: errors there are rounding, not the model's float32 angles
SELF_CHECK_LENGTH = 12  # shorter than the tiny sliding window (16)
SELF_CHECK_TOL = 1e-4  # max abs key error, float32 models
# Half precision: a rotated key element is a rounded mix of the two elements of its rotation pair, so it is
# stored to about one unit in the last place of the pair's size (bfloat16's spacing is 2^-7 of it: 0.0625 at 8
# to 16, 1.0 at 128 to 256, as qwen2.5-1.5b's layer-0 keys with their bias are, where a pair's small element
# was 0.047 off). No absolute tolerance fits every layer: in half precision each element's difference is
# divided by max(its pair's norm, 1) (:func:`pair_scale`): qwen2.5-1.5b's worst layer is at 0.0145, 1.9 units;
# the bound is 4. A frequency 0.1% off turns the fastest pair by 0.037 of its norm at +37 (1% off: 0.37).
SELF_CHECK_REL_TOL = {torch.bfloat16: 2 ** -5, torch.float16: 2 ** -8}  # four units in the last place (2^-7, 2^-10)


# -- frequencies ---------------------------------------------------------------------------
def _default_init(family: Family):
    """The family's own default-RoPE function (``<Family>RotaryEmbedding``, e.g. LlamaRotaryEmbedding)."""
    module = sys.modules[getattr(transformers, family.causal_lm_class).__module__]
    name = family.rotary_class or family.causal_lm_class.removesuffix("ForCausalLM") + "RotaryEmbedding"
    rotary = getattr(module, name)
    return rotary.compute_default_rope_parameters


def _layer_type(adapter: Adapter, layer: int) -> str | None:
    """The key a family with per-layer-type RoPE (Gemma-3) nests its parameters under, else None."""
    if "local_theta" not in adapter.family.rope:
        return None
    return "sliding_attention" if adapter.sliding_layers()[layer] else "full_attention"


def rope_frequencies(adapter: Adapter, layer: int, device: torch.device | str | None = None
                     ) -> tuple[torch.Tensor, float]:
    """(inv_freq (D_rot/2,), attention_factor) of layer ``layer``, as the model computes them.

    The attention factor is YaRN's mscale (1.0 for the other types); re-rotation must not use it.
    Raises ``KvprobeError`` for RoPE types that cannot be re-rotated (dynamic, longrope, ...).
    """
    params = adapter.rope_parameters(layer)  # a fresh dict; raises KvprobeError if unsupported
    view = copy.copy(adapter.config)  # shallow: the model's config is never touched
    layer_type = _layer_type(adapter, layer)
    view.rope_parameters = {layer_type: params} if layer_type else params
    kwargs = {"layer_type": layer_type} if layer_type else {}
    kind = params["rope_type"]
    init = _default_init(adapter.family) if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    freqs, attention_factor = init(view, device=device, **kwargs)
    assert freqs.ndim == 1 and 2 * freqs.numel() <= adapter.rotary_room, (freqs.shape, adapter.rotary_room)
    return freqs.to(device), float(attention_factor)


def inv_freq(adapter: Adapter, layer: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The inverse frequencies (D_rot/2,) of layer ``layer``; D_rot <= D (partial rotary)."""
    return rope_frequencies(adapter, layer, device)[0]


# -- rotation ------------------------------------------------------------------------------
def rerotate(keys: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor,
             compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Keys (B, H_kv, T, D) computed at positions p.. rotated to positions p + delta...

    ``delta`` is an int or a (T,) tensor of per-position shifts (negative moves earlier). Only
    the first 2 * len(inv_freq) dims rotate (rotate_half pairing); the rest pass through. The
    rotation has unit magnitude (no YaRN mscale). Returns a new tensor in the keys' dtype.
    """
    assert keys.ndim == 4, f"keys must be (B, H_kv, T, D), got {tuple(keys.shape)}"
    half = inv_freq.shape[-1]
    rot = 2 * half
    assert inv_freq.ndim == 1 and rot <= keys.shape[-1], (inv_freq.shape, keys.shape)
    T = keys.shape[2]
    shift = torch.as_tensor(delta, device=keys.device).to(compute_dtype)
    shift = shift.expand(T) if shift.ndim == 0 else shift  # (T,)
    assert shift.shape == (T,), f"delta must be an int or ({T},), got {tuple(shift.shape)}"
    angle = shift[:, None] * inv_freq.to(keys.device, compute_dtype)[None, :]  # (T, D_rot/2)
    cos, sin = angle.cos(), angle.sin()  # (T, D_rot/2), broadcast over (B, H_kv)
    k = keys.to(compute_dtype)
    k1, k2, rest = k[..., :half], k[..., half:rot], k[..., rot:]  # (B, H_kv, T, D_rot/2) x2, pass-through
    out = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin, rest], dim=-1)  # (B, H_kv, T, D)
    return out.to(keys.dtype)


def _range(length: int, start: int, end: int | None) -> tuple[int, int]:
    end = length if end is None else end
    if not 0 <= start <= end <= length:
        raise KvprobeError(f"cannot re-rotate positions [{start}, {end}) of a cache of {length} positions")
    return start, end


def rotated(adapter: Adapter, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The slot of a cache layer's (keys, values) that holds rotated keys: the keys, or, under
    multi-head latent attention, the values slot's rotary key part (:attr:`Adapter.rotated_slot`)."""
    return kv[adapter.rotated_slot]


def rerotate_kv(adapter: Adapter, layer: int, kv: tuple[torch.Tensor, torch.Tensor], delta: int | torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (keys, values) (B, H, T, D) moved by ``delta``: the rotated slot turned (a new
    tensor), the other one the input's own tensor."""
    out = list(kv)
    slot = adapter.rotated_slot
    out[slot] = rerotate(kv[slot], delta, inv_freq(adapter, layer, kv[slot].device))
    return out[0], out[1]


def rerotate_cache_layer(cache, adapter: Adapter, layer: int, delta: int | torch.Tensor,
                         start: int = 0, end: int | None = None) -> torch.Tensor:
    """The new rotated slot (B, H, T, D) of one cache layer (its keys; the rotary key part under
    multi-head latent attention) with positions [start, end) shifted by ``delta``.

    ``delta`` is an int or an (end - start,) tensor. The cache is not modified.
    """
    keys = rotated(adapter, kvcache.get_kv(cache, layer))  # (B, H, T, D)
    start, end = _range(keys.shape[2], start, end)
    out = keys.clone()
    out[:, :, start:end] = rerotate(keys[:, :, start:end], delta, inv_freq(adapter, layer, keys.device))
    return out


def rerotate_cache(cache, adapter: Adapter, delta: int | torch.Tensor, start: int = 0, end: int | None = None):
    """A new cache whose keys at positions [start, end) of every layer are shifted by ``delta``.

    The rotated slot is a new tensor; the other (values; the latent under multi-head latent
    attention, which holds no position) is the input cache's own tensor, shared, not copied. The
    input cache is not modified.
    """
    layers = []
    for layer in range(kvcache.n_layers(cache)):
        kv = list(kvcache.get_kv(cache, layer))
        kv[adapter.rotated_slot] = rerotate_cache_layer(cache, adapter, layer, delta, start, end)
        layers.append(tuple(kv))
    return kvcache.from_tensors(layers)


# -- self-check ----------------------------------------------------------------------------
@contextlib.contextmanager
def _pinned_layer_inputs(layers: torch.nn.ModuleList, inputs: list[torch.Tensor], replay: bool) -> Iterator[None]:
    """Record every decoder layer's input hidden states into ``inputs``, or replay them from it.

    With RoPE alone the hidden states are invariant to a global position shift in exact arithmetic
    (attention sees only relative positions), but the model's float32 angles at large positions
    perturb them. Replaying one run's inputs in a second run makes every layer's keys depend on the
    positions only through that layer's RoPE, so the check measures re-rotation and nothing else.
    """
    def hook_for(i: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]  # (B, T, hidden)
            if not replay:
                inputs.append(hidden.detach().clone())
                return None
            assert inputs[i].shape == hidden.shape, (inputs[i].shape, hidden.shape)
            if args:
                return (inputs[i], *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": inputs[i]}
        return hook

    with hooks(pre=[(layer, hook_for(i)) for i, layer in enumerate(layers)], with_kwargs=True):
        yield


@torch.no_grad()
def rerotation_error(model, adapter: Adapter, shift: int = SELF_CHECK_SHIFT, length: int = SELF_CHECK_LENGTH,
                     vocab_size: int | None = None, seed: int = 0,
                     compute_dtype: torch.dtype = torch.float64, relative: bool = False) -> list[float]:
    """Per layer: max abs difference between keys prefilled at 0.. and re-rotated by ``shift``,
    and keys prefilled at ``shift``.. (random ids; every layer's input in the second run pinned to
    the first run's, so no layer's comparison carries rounding from the layers below it).
    ``relative``: each element's difference divided by :func:`pair_scale` first (half precision).
    """
    vocab_size = vocab_size or adapter.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab_size, (1, length), generator=gen).to(device)  # (1, T)
    layers = adapter.layers(model)
    inputs: list[torch.Tensor] = []
    with _pinned_layer_inputs(layers, inputs, replay=False):
        _, at_zero = kvcache.prefill(model, ids, start=0)
    with _pinned_layer_inputs(layers, inputs, replay=True):
        _, at_shift = kvcache.prefill(model, ids, start=shift)
    errors = []
    for layer in range(adapter.n_layers):
        keys = rotated(adapter, kvcache.get_kv(at_zero, layer))  # (1, H_kv, T, D)
        want = rotated(adapter, kvcache.get_kv(at_shift, layer))  # (1, H_kv, T, D)
        got = rerotate(keys, shift, inv_freq(adapter, layer, keys.device), compute_dtype)
        diff = (got.double() - want.double()).abs()
        errors.append((diff / pair_scale(want, inv_freq(adapter, layer).shape[-1]) if relative else diff).max().item())
    return errors


def pair_scale(keys: torch.Tensor, half: int) -> torch.Tensor:
    """Per element of ``keys`` (..., D), rotate_half layout: max(norm of its rotation pair (i, i + half), 1);
    for a dimension that does not rotate, max(|element|, 1)."""
    k = keys.double()
    rot = 2 * half
    norm = (k[..., :half] ** 2 + k[..., half:rot] ** 2).sqrt()
    return torch.cat([norm, norm, k[..., rot:].abs()], dim=-1).clamp(min=1.0)


def self_check(lm_model, adapter: Adapter, tokenizer=None, shift: int = SELF_CHECK_SHIFT,
               tol: float | None = None) -> float:
    """The model-level gate: re-rotated keys of every layer equal a fresh prefill's at +shift.

    Returns the max error over layers; raises ``KvprobeError`` naming the family, the worst layer
    and its error when it exceeds ``tol``, or when the RoPE type cannot be re-rotated. The error is
    absolute for a float32 model (``tol`` defaults to :data:`SELF_CHECK_TOL`) and relative per
    element for half precision (:data:`SELF_CHECK_REL_TOL`, by the model's dtype).
    """
    vocab = min(adapter.config.vocab_size, len(tokenizer)) if tokenizer is not None else None
    dtype = next(lm_model.parameters()).dtype
    relative = dtype in SELF_CHECK_REL_TOL
    tol = tol if tol is not None else SELF_CHECK_REL_TOL[dtype] if relative else SELF_CHECK_TOL
    errors = rerotation_error(lm_model, adapter, shift=shift, vocab_size=vocab, relative=relative)
    worst = max(range(len(errors)), key=errors.__getitem__)
    if not errors[worst] <= tol:  # also catches NaN
        what = "relative to its rotation pair's norm " if relative else ""
        raise KvprobeError(f"RoPE re-rotation self-check failed for family {adapter.family.family}: layer {worst} "
                           f"keys differ from a fresh prefill at +{shift} by {errors[worst]:.3g} {what}"
                           f"(tolerance {tol:g})")
    return errors[worst]
