"""One invariant suite, subclassed per family, so the families cannot drift apart.

Invariants, not magic numbers: each test states a property that must hold exactly (or to float
tolerance) for every architecture kvprobe supports.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvprobe.kv import cache as C
from tests.conftest import ids_of, tiny_model


class FamilySuite:
    """Subclasses set ``name`` to a tiny model spec."""

    name: str = ""

    @property
    def lm(self):
        return tiny_model(self.name)

    def test_adapter_describes_model(self):
        a, m = self.lm.adapter, self.lm.model
        assert len(a.layers(m)) == a.n_layers == 2
        assert a.n_heads == 4 and a.n_kv_heads == 2
        assert a.proj(m, 0, "k").out_features == a.n_kv_heads * a.head_dim
        assert a.proj(m, 0, "q").out_features == a.n_heads * a.head_dim
        assert a.lm_head(m).out_features == len(self.lm.tokenizer)

    def test_cached_prefix_plus_suffix_equals_full_prefill(self):
        m = self.lm.model
        ids = ids_of(48, len(self.lm.tokenizer))  # longer than the tiny sliding window (16)
        full = m(ids).logits
        _, cache = C.prefill(m, ids[:, :30])
        out = C.forward(m, ids[:, 30:], cache)
        torch.testing.assert_close(out.logits, full[:, 30:], atol=1e-5, rtol=0)
        assert C.seq_len(cache) == 48  # no sliding-window eviction in our cache

    def test_token_by_token_decode_equals_full_prefill(self):
        m = self.lm.model
        ids = ids_of(24, len(self.lm.tokenizer), seed=1)
        full = m(ids).logits
        _, cache = C.prefill(m, ids[:, :1])
        for t in range(1, 24):
            out = C.forward(m, ids[:, t:t + 1], cache)
            torch.testing.assert_close(out.logits[:, 0], full[:, t], atol=1e-5, rtol=0)

    def test_cache_holds_keys_after_rope(self):
        """Layer-0 cached keys equal k_proj -> (k_norm) -> RoPE, computed by hand from hooks."""
        lm = self.lm
        m, a = lm.model, lm.adapter
        attn = a.attention(m, 0)
        seen = {}
        h1 = a.proj(m, 0, "k").register_forward_hook(lambda mod, inp, out: seen.__setitem__("k", out))
        h2 = attn.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.__setitem__("pe", kwargs["position_embeddings"]), with_kwargs=True)
        try:
            ids = ids_of(20, len(lm.tokenizer), seed=2)
            _, cache = C.prefill(m, ids, start=5)
        finally:
            h1.remove()
            h2.remove()
        k = seen["k"].view(1, 20, a.n_kv_heads, a.head_dim)
        if a.has_k_norm:
            k = getattr(attn, a.family.k_norm)(k)
        k = k.transpose(1, 2)  # (B, H_kv, T, D)
        cos, sin = seen["pe"]
        _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
        keys, _ = C.get_kv(cache, 0)
        torch.testing.assert_close(keys, k_rot, atol=1e-5, rtol=0)
        assert not torch.allclose(keys, k, atol=1e-3)  # the rotation did something

    def test_position_offset_changes_keys_not_values_at_layer0(self):
        m = self.lm.model
        ids = ids_of(10, len(self.lm.tokenizer), seed=3)
        _, c0 = C.prefill(m, ids, start=0)
        _, c1 = C.prefill(m, ids, start=7)
        k0, v0 = C.get_kv(c0, 0)
        k1, v1 = C.get_kv(c1, 0)
        torch.testing.assert_close(v0, v1, atol=1e-6, rtol=0)
        assert (k0 - k1).abs().max() > 1e-3

    def test_cache_copy_is_independent(self):
        m = self.lm.model
        _, cache = C.prefill(m, ids_of(8, len(self.lm.tokenizer)))
        dup = C.copy(cache)
        C.get_kv(dup, 0)[0].zero_()
        assert C.get_kv(cache, 0)[0].abs().sum() > 0
