"""RoPE re-rotation: re-rotated keys equal keys computed at the new positions, for every family."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from kvprobe.errors import KvprobeError
from kvprobe.kv import cache as kvcache
from kvprobe.models import Adapter, build_tiny, tiny_names
from kvprobe.models import rope
from kvprobe.datasets.words import build_word_tokenizer

TOL = 1e-5  # float32 keys at small shifts agree to ~1e-6
T = 12  # tokens; shorter than the tiny sliding window (16)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "original_max_position_embeddings": 64}
VARIANTS = {  # name -> (tiny model, config overrides)
    **{name: (name, {}) for name in tiny_names()},
    "tiny-llama-yarn": ("tiny-llama", {"rope_parameters": YARN}),
    "tiny-llama-linear": ("tiny-llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                             "factor": 4.0}}),
    # transformers 5.24's Llama accepts partial_rotary_factor but rotates every dim anyway
    "tiny-llama-partial": ("tiny-llama", {"partial_rotary_factor": 0.5}),
    "tiny-gemma3-global-first": ("tiny-gemma3", {"layer_types": ["full_attention", "sliding_attention"]}),
}


@functools.cache
def tokenizer():
    return build_word_tokenizer([f"w{i}" for i in range(50)])


@functools.cache
def tiny_variant(variant: str):
    name, overrides = VARIANTS[variant]
    model, _ = build_tiny(name, tokenizer(), **overrides)
    return model, Adapter.for_config(model.config)


def random_ids(seed: int = 0, length: int = T) -> torch.Tensor:
    return torch.randint(4, len(tokenizer()), (1, length), generator=torch.Generator().manual_seed(seed))


def keys(model, ids, positions, layer: int = 0) -> torch.Tensor:
    """Layer keys (1, H_kv, T, D) of a fresh prefill of ``ids`` at ``positions`` (T,): the slot that
    holds rotated keys (the rotary key part under multi-head latent attention)."""
    cache = kvcache.new_cache()
    kvcache.forward(model, ids, cache, positions=torch.as_tensor(positions))
    return rope.rotated(Adapter.for_config(model.config), kvcache.get_kv(cache, layer))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# -- every family ----------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rerotated_layer0_keys_equal_fresh_prefill(variant):
    model, adapter = tiny_variant(variant)
    ids = random_ids()
    for start, shift in [(0, 37), (5, 300), (60, -50)]:  # negative: move a block earlier
        got = rope.rerotate(keys(model, ids, torch.arange(start, start + T)), shift, rope.inv_freq(adapter, 0))
        want = keys(model, ids, torch.arange(start + shift, start + shift + T))
        assert max_err(got, want) <= TOL, (variant, start, shift)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_self_check_passes(variant):
    model, adapter = tiny_variant(variant)
    err = rope.self_check(model, adapter, tokenizer())
    assert 0 <= err <= TOL
    assert len(rope.rerotation_error(model, adapter)) == adapter.n_layers  # every layer compared


def test_per_position_shifts():
    model, adapter = tiny_variant("tiny-qwen3")  # k-norm before RoPE
    ids = random_ids(1)
    delta = torch.tensor([10] * 6 + [-3] * 6)  # two blocks moved by different amounts
    got = rope.rerotate(keys(model, ids, torch.arange(20, 20 + T)), delta, rope.inv_freq(adapter, 0))
    want = keys(model, ids, torch.arange(20, 20 + T) + delta)
    assert max_err(got, want) <= TOL


def test_shift_composes_and_zero_is_identity():
    _, adapter = tiny_variant("tiny-llama3")
    k = torch.randn(2, 2, T, adapter.head_dim, generator=torch.Generator().manual_seed(0))
    f = rope.inv_freq(adapter, 0)
    assert torch.equal(rope.rerotate(k, 0, f), k)
    assert max_err(rope.rerotate(rope.rerotate(k, 1000, f), -400, f), rope.rerotate(k, 600, f)) <= 1e-6


# -- Gemma-3: two bases ----------------------------------------------------------------------
def test_gemma3_local_and_global_layers_use_their_own_base():
    _, adapter = tiny_variant("tiny-gemma3")
    assert adapter.sliding_layers() == [True, False]
    assert adapter.rope_parameters(0)["rope_theta"] == 10_000 and adapter.rope_parameters(1)["rope_theta"] == 1_000_000
    assert not torch.equal(rope.inv_freq(adapter, 0), rope.inv_freq(adapter, 1))


@pytest.mark.parametrize("variant", ["tiny-gemma3", "tiny-gemma3-global-first"])
def test_gemma3_one_base_for_all_layers_gives_wrong_keys(variant):
    model, adapter = tiny_variant(variant)  # layer 0 local, or layer 0 global
    ids = random_ids(2)
    moved = keys(model, ids, torch.arange(T))
    want = keys(model, ids, torch.arange(37, 37 + T))
    assert max_err(rope.rerotate(moved, 37, rope.inv_freq(adapter, 0)), want) <= TOL
    assert max_err(rope.rerotate(moved, 37, rope.inv_freq(adapter, 1)), want) > 1e-2  # the other layer's base


# -- YaRN: the attention factor is not applied again -----------------------------------------
def test_yarn_rotation_has_unit_magnitude():
    model, adapter = tiny_variant("tiny-llama-yarn")
    freqs, attention_factor = rope.rope_frequencies(adapter, 0)
    assert attention_factor > 1.3  # 0.1 ln(32) + 1: the model scales cos/sin by it
    ids = random_ids(3)
    cached = keys(model, ids, torch.arange(T))
    moved = rope.rerotate(cached, 37, freqs)
    want = keys(model, ids, torch.arange(37, 37 + T))
    assert max_err(moved, want) <= TOL
    assert torch.allclose(moved.norm(dim=-1), cached.norm(dim=-1), rtol=1e-6)
    assert max_err(moved * attention_factor, want) > 1e-2  # scaling again would be wrong


# -- partial rotary (function level: none of the six families honours it in 5.24) ------------
def test_partial_rotary_matches_transformers_and_passes_the_rest_through():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb  # a partial-rotary reference

    head_dim, rot = 16, 8
    freqs = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))  # (rot/2,)
    k = torch.randn(1, 2, T, head_dim, generator=torch.Generator().manual_seed(4))

    def at(positions):  # HF: cos/sin = cat(freqs, freqs) over the rotary dims only
        emb = torch.cat([positions[:, None].float() * freqs] * 2, dim=-1)[None]  # (1, T, rot)
        return apply_rotary_pos_emb(k, k, emb.cos(), emb.sin())[1]

    moved = rope.rerotate(at(torch.arange(T)), 37, freqs)
    assert max_err(moved, at(torch.arange(37, 37 + T))) <= TOL
    assert torch.equal(moved[..., rot:], k[..., rot:])


# -- cache helpers ---------------------------------------------------------------------------
def test_rerotate_cache_shifts_a_range_and_leaves_the_input_alone():
    model, adapter = tiny_variant("tiny-gemma3")
    ids = random_ids(5)
    _, cache = kvcache.prefill(model, ids)
    before = [(k.clone(), v.clone()) for k, v in kvcache.to_tensors(cache)]
    out = rope.rerotate_cache(cache, adapter, 40, start=4, end=9)
    layers = zip(before, kvcache.to_tensors(cache), kvcache.to_tensors(out))
    for layer, ((k0, v0), (k, v), (k1, v1)) in enumerate(layers):
        assert torch.equal(k, k0) and torch.equal(v, v0)  # input untouched
        assert torch.equal(v1, v0)  # values never rotate
        assert torch.equal(k1[:, :, :4], k0[:, :, :4]) and torch.equal(k1[:, :, 9:], k0[:, :, 9:])
        expect = rope.rerotate(k0[:, :, 4:9], 40, rope.inv_freq(adapter, layer))
        assert torch.equal(k1[:, :, 4:9], expect)
        assert torch.equal(rope.rerotate_cache_layer(cache, adapter, layer, 40, 4, 9), k1)
    with pytest.raises(KvprobeError, match="cannot re-rotate"):
        rope.rerotate_cache(cache, adapter, 1, start=5, end=T + 1)


# -- refusals --------------------------------------------------------------------------------
def test_dynamic_rope_is_refused():
    model, _ = build_tiny("tiny-llama", tokenizer(), rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    adapter = Adapter.for_config(model.config)
    for call in (lambda: rope.inv_freq(adapter, 0), lambda: rope.self_check(model, adapter),
                 lambda: rope.rerotate_cache(kvcache.prefill(model, random_ids())[1], adapter, 3)):
        with pytest.raises(KvprobeError, match=r"'dynamic'.*supported: default, linear, llama3, yarn"):
            call()


def test_self_check_fails_loudly_on_wrong_frequencies(monkeypatch):
    model, adapter = tiny_variant("tiny-mistral")
    true_inv_freq = rope.inv_freq
    monkeypatch.setattr(rope, "inv_freq", lambda a, layer, device=None: true_inv_freq(a, layer, device) * 1.01)
    with pytest.raises(KvprobeError, match=r"family mistral: layer \d keys differ"):
        rope.self_check(model, adapter)


def test_half_precision_is_checked_relative_to_each_keys_size(monkeypatch):
    """bfloat16 stores a rotated key element to one unit in the last place of its rotation pair's size
    (0.0625 at 8-16, 1.0 at 128-256): qwen2.5-1.5b's bfloat16 keys (up to 354 in layer 0) once failed a
    0.05 absolute bound on this check by such rounding. The relative check passes a correct model in
    bfloat16 and still refuses frequencies off by 1%."""
    model, adapter = tiny_variant("tiny-mistral")
    model = copy.deepcopy(model).to(torch.bfloat16)  # tiny_variant's model is shared by the tests of a worker
    err = rope.self_check(model, adapter)
    assert 0 <= err <= rope.SELF_CHECK_REL_TOL[torch.bfloat16]
    absolute = max(rope.rerotation_error(model, adapter))
    assert absolute > 0  # bfloat16 rounding is there; the relative figure is what is bounded
    true_inv_freq = rope.inv_freq
    monkeypatch.setattr(rope, "inv_freq", lambda a, layer, device=None: true_inv_freq(a, layer, device) * 1.01)
    with pytest.raises(KvprobeError, match=r"family mistral: layer \d keys differ .* relative to its rotation pair"):
        rope.self_check(model, adapter)
