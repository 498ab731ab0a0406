"""One invariant suite, subclassed per family, so the families cannot drift apart.

Invariants, not magic numbers: each test states a property that must hold exactly (or to float
tolerance) for every architecture kvprobe supports.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvprobe.kv import cache as kvcache
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
        assert a.lm_head(m).out_features == len(self.lm.tokenizer)
        assert a.proj(m, 0, "o").in_features == a.n_heads * a.head_dim  # the per-head outputs the probes split
        if a.family.mla:  # one compressed entry per position: the latent and the shared rotary key part
            (hk, latent), (hv, rope_dim) = a.cache_dims
            assert a.n_heads == 4 and hk == hv == 1
            assert a.proj(m, 0, "k").out_features == latent + rope_dim
            return
        assert a.n_heads == 4 and a.n_kv_heads == 2
        assert a.proj(m, 0, "k").out_features == a.n_kv_heads * a.head_dim
        assert a.proj(m, 0, "q").out_features == a.n_heads * a.head_dim

    def test_cached_prefix_plus_suffix_equals_full_prefill(self):
        m = self.lm.model
        ids = ids_of(48, len(self.lm.tokenizer))  # longer than the tiny sliding window (16)
        full = m(ids).logits
        _, cache = kvcache.prefill(m, ids[:, :30])
        out = kvcache.forward(m, ids[:, 30:], cache)
        torch.testing.assert_close(out.logits, full[:, 30:], atol=1e-5, rtol=0)
        assert kvcache.seq_len(cache) == 48  # no sliding-window eviction in our cache

    def test_token_by_token_decode_equals_full_prefill(self):
        m = self.lm.model
        ids = ids_of(24, len(self.lm.tokenizer), seed=1)
        full = m(ids).logits
        _, cache = kvcache.prefill(m, ids[:, :1])
        for t in range(1, 24):
            out = kvcache.forward(m, ids[:, t:t + 1], cache)
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
            _, cache = kvcache.prefill(m, ids, start=5)
        finally:
            h1.remove()
            h2.remove()
        cos, sin = seen["pe"]
        if a.family.mla:  # the latent, normed, unrotated; the rotary part in DeepSeek's interleaved pairs
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

            (_, latent), (_, rope_dim) = a.cache_dims
            c_kv, k_pe = seen["k"].split([latent, rope_dim], dim=-1)
            _, k_pe = apply_rotary_pos_emb_interleave(k_pe[:, None], k_pe[:, None], cos, sin)
            keys, values = kvcache.get_kv(cache, 0)
            torch.testing.assert_close(keys, attn.kv_a_layernorm(c_kv)[:, None], atol=1e-5, rtol=0)
            torch.testing.assert_close(values, k_pe, atol=1e-5, rtol=0)
            return
        k = seen["k"].view(1, 20, a.n_kv_heads, a.head_dim)
        if a.has_k_norm:
            k = getattr(attn, a.family.k_norm)(k)
        k = k.transpose(1, 2)  # (B, H_kv, T, D)
        rot = cos.shape[-1]  # partial RoPE (StableLM): only the first dims rotate, the rest pass through
        _, k_rot = apply_rotary_pos_emb(k[..., :rot], k[..., :rot], cos, sin)
        k_rot = torch.cat([k_rot, k[..., rot:]], dim=-1)
        keys, _ = kvcache.get_kv(cache, 0)
        torch.testing.assert_close(keys, k_rot, atol=1e-5, rtol=0)
        assert not torch.allclose(keys, k, atol=1e-3)  # the rotation did something

    def test_position_offset_changes_keys_not_values_at_layer0(self):
        m = self.lm.model
        ids = ids_of(10, len(self.lm.tokenizer), seed=3)
        _, c0 = kvcache.prefill(m, ids, start=0)
        _, c1 = kvcache.prefill(m, ids, start=7)
        slot = self.lm.adapter.rotated_slot  # the keys; the rotary key part (values slot) under MLA
        k0, k1 = kvcache.get_kv(c0, 0)[slot], kvcache.get_kv(c1, 0)[slot]
        v0, v1 = kvcache.get_kv(c0, 0)[1 - slot], kvcache.get_kv(c1, 0)[1 - slot]
        torch.testing.assert_close(v0, v1, atol=1e-6, rtol=0)
        assert (k0 - k1).abs().max() > 1e-3

    def test_cache_copy_is_independent(self):
        m = self.lm.model
        _, cache = kvcache.prefill(m, ids_of(8, len(self.lm.tokenizer)))
        dup = kvcache.copy(cache)
        kvcache.get_kv(dup, 0)[0].zero_()
        assert kvcache.get_kv(cache, 0)[0].abs().sum() > 0


class EditSuite:
    """KV-editor invariants (issue 4), mixed into each family's test class."""

    name: str = ""

    @property
    def lm(self):
        return tiny_model(self.name)

    def aligned(self, index: int = 1):
        from kvprobe.datasets import align, generate

        return align(generate(4, seed=11)[index], self.lm.tokenizer, "raw")

    def _decide(self, ctx, spec):
        from kvprobe import editor

        edited = editor.apply(ctx, spec)
        return editor.decide(self.lm, edited)[0], edited

    def test_oracle_equals_fresh_prefill_of_new_prompt(self):
        from kvprobe import editor

        a = self.aligned()
        ctx = editor.make_context(self.lm, a)
        fresh = self.lm.model(torch.tensor([a.ids_new])).logits[0, -1]
        logits, edited = self._decide(ctx, "oracle")
        torch.testing.assert_close(logits, fresh, atol=1e-5, rtol=0)
        assert edited.recomputed == a.decision_pos

    def test_selective_with_every_downstream_position_equals_oracle(self):
        from kvprobe import editor

        a = self.aligned()
        ctx = editor.make_context(self.lm, a)
        n_down = a.downstream[1] - a.downstream[0]
        oracle, _ = self._decide(ctx, "oracle")
        for ranking in ("random", "recency"):
            logits, edited = self._decide(ctx, f"selective:{n_down}:{ranking}")
            assert (logits - oracle).abs().max() <= 1e-5
        # and the cache itself equals the oracle's, entry by entry
        full = editor.recompute_positions(self.lm, ctx.old_cache, a.ids_new, list(range(a.field[0], a.decision_pos)))
        _, oracle_cache = kvcache.prefill(self.lm.model, torch.tensor(a.ids_new[: a.decision_pos]))
        for layer in range(kvcache.n_layers(full)):
            for x, y in zip(kvcache.get_kv(full, layer), kvcache.get_kv(oracle_cache, layer)):
                torch.testing.assert_close(x, y, atol=1e-5, rtol=0)

    def test_field_only_leaves_prefix_bit_identical(self):
        from kvprobe import editor

        a = self.aligned()
        ctx = editor.make_context(self.lm, a)
        edited = editor.apply(ctx, "field_only")
        f0, f1 = a.field
        for layer in range(kvcache.n_layers(edited.cache)):
            (k, v), (k0, v0) = kvcache.get_kv(edited.cache, layer), kvcache.get_kv(ctx.old_cache, layer)
            assert torch.equal(k[:, :, :f0], k0[:, :, :f0]) and torch.equal(v[:, :, :f0], v0[:, :, :f0])
            assert torch.equal(k[:, :, f1:], k0[:, :, f1:])  # downstream stays stale
        k, _ = kvcache.get_kv(edited.cache, 0)
        assert not torch.equal(k[:, :, f0:f1], kvcache.get_kv(ctx.old_cache, 0)[0][:, :, f0:f1])
        assert edited.recomputed == f1 - f0

    def test_erratum_never_modifies_an_existing_cache_entry(self):
        from kvprobe import editor

        a = self.aligned()
        ctx = editor.make_context(self.lm, a)
        before = [(k.clone(), v.clone()) for k, v in kvcache.to_tensors(ctx.old_cache)]
        for spec in ("erratum", "erratum:short"):
            edited = editor.apply(ctx, spec)
            n = kvcache.seq_len(edited.cache)
            assert 0 < n <= a.decision_pos
            editor.decide(self.lm, edited)
            for (k, v), (k0, v0) in zip(kvcache.to_tensors(edited.cache), before):
                assert torch.equal(k, k0[:, :, :n]) and torch.equal(v, v0[:, :, :n])
        for (k, v), (k0, v0) in zip(kvcache.to_tensors(ctx.old_cache), before):
            assert torch.equal(k, k0) and torch.equal(v, v0)

    def test_decide_restores_the_cache_and_cot_matches_greedy_generate(self):
        from kvprobe import editor

        a = self.aligned()
        ctx = editor.make_context(self.lm, a)
        edited = editor.apply(ctx, "oracle")
        n = kvcache.seq_len(edited.cache)
        _, text = editor.decide(self.lm, edited, cot_tokens=6)
        assert kvcache.seq_len(edited.cache) == n
        gen = self.lm.model.generate(torch.tensor([a.ids_new]), max_new_tokens=6, do_sample=False,
                                     pad_token_id=0, eos_token_id=None)
        assert text == self.lm.tokenizer.decode(gen[0, len(a.ids_new):])

    def test_batched_cot_equals_one_at_a_time(self):
        from kvprobe import editor

        a = self.aligned()
        ctx = editor.make_context(self.lm, a)
        specs = ["stale", "field_only", "oracle", "erratum", "field_erratum"]  # two cache lengths
        edited = [editor.apply(ctx, s) for s in specs]
        lengths = [kvcache.seq_len(e.cache) for e in edited]
        batched = editor.decide_many(self.lm, edited, cot_tokens=8)
        assert [kvcache.seq_len(e.cache) for e in edited] == lengths  # inputs untouched
        for e, (logits, text) in zip(edited, batched):
            want_logits, want_text = editor.decide(self.lm, e, cot_tokens=8)
            assert text == want_text
            torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)

    def test_batched_cot_row_that_ends_early_leaves_the_others_exact(self):
        from kvprobe import editor

        a = self.aligned()
        ctx = editor.make_context(self.lm, a)
        edited = [editor.apply(ctx, s) for s in ["stale", "erratum", "hoist", "oracle"]]
        cache = kvcache.copy(edited[1].cache)  # erratum's second greedy token becomes an EOS
        first = int(kvcache.forward(self.lm.model, torch.tensor([edited[1].tail_ids]), cache).logits[0, -1].argmax())
        stop = int(kvcache.forward(self.lm.model, torch.tensor([[first]]), cache).logits[0, -1].argmax())
        _, full = editor.decide(self.lm, edited[1], cot_tokens=8)
        from kvprobe.kv import decode

        eos_ids = decode._eos_ids
        decode._eos_ids = lambda lm: eos_ids(lm) | {stop}
        try:
            batched = editor.decide_many(self.lm, edited, cot_tokens=8)
            want = [editor.decide(self.lm, e, cot_tokens=8) for e in edited]
        finally:
            decode._eos_ids = eos_ids
        assert want[1][1] != full  # erratum's row did end early
        for (logits, text), (want_logits, want_text) in zip(batched, want):
            assert text == want_text
            torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)

    def test_bad_inputs_are_refused(self):
        import pytest

        from kvprobe.errors import KvprobeError
        from kvprobe import editor

        a = self.aligned()
        ctx = editor.make_context(self.lm, a)
        n_down = a.downstream[1] - a.downstream[0]
        with pytest.raises(KvprobeError, match="larger than the downstream span"):
            editor.apply(ctx, f"selective:{n_down + 1}:random")
        with pytest.raises(KvprobeError, match="bad strategy"):
            editor.parse_strategy("selective:4:telepathy")
        with pytest.raises(KvprobeError, match="longer than the model's window"):
            self.lm.check_length(self.lm.max_positions + 1)


class ProbeSuite:
    """Probe-engine invariants (issue 5), mixed into each family's test class."""

    name: str = ""

    @property
    def lm(self):
        return tiny_model(self.name)

    def test_patch_nothing_is_stale_and_everything_is_oracle(self):
        from kvprobe.datasets import align, generate
        from kvprobe.probes.engine import PairCaches, Patch, patched_reads

        a = align(generate(4, seed=11)[2], self.lm.tokenizer, "raw")
        pc = PairCaches.build(self.lm, a)
        stale = self.lm.model(torch.tensor([a.ids_old])).logits[0, -1]
        oracle = self.lm.model(torch.tensor([a.ids_new])).logits[0, -1]
        logits = patched_reads(self.lm, pc, [Patch(()), Patch(tuple(range(a.decision_pos)))])
        torch.testing.assert_close(logits[0], stale, atol=1e-4, rtol=0)
        torch.testing.assert_close(logits[1], oracle, atol=1e-4, rtol=0)

    def test_locality_recovery_ends_and_sweep_equals_naive(self):
        from kvprobe.datasets import align, generate
        from kvprobe.kv.readout import logit_diff
        from kvprobe.probes.engine import PairCaches
        from kvprobe.probes.locality import Locality, targets

        a = align(generate(4, seed=11)[2], self.lm.tokenizer, "raw")
        df = Locality(ks=(1, 4), n_random=1, per_layer=False).run_case(self.lm, a)
        m = df[df.metric == "m"].set_index("set").value  # (recovery = m rescaled; the flip can be ~0 here)
        assert abs(m["none"] - df.m_stale.iloc[0]) < 1e-4 and abs(m["all"] - df.m_oracle.iloc[0]) < 1e-4
        # the batched sweep equals rebuilding each patched cache separately and reading once
        pc = PairCaches.build(self.lm, a)
        new_ans, old_ans = targets(a)
        effects = df[df.metric == "effect"].set_index("position").value
        m_stale = df.m_stale.iloc[0]
        for p in {0, a.field[0], a.downstream[0], a.decision_pos - 1}:
            cache = kvcache.copy(pc.old)
            for layer in range(kvcache.n_layers(cache)):
                (k, v), (k1, v1) = kvcache.get_kv(cache, layer), kvcache.get_kv(pc.new, layer)
                k[:, :, p], v[:, :, p] = k1[:, :, p], v1[:, :, p]
            logits = kvcache.forward(self.lm.model, torch.tensor([[a.ids_old[-1]]]), cache).logits[0, -1]
            naive = float(logit_diff(logits, a.option_ids, new_ans, old_ans)) - m_stale
            assert abs(naive - effects[p]) < 1e-4, (p, naive, effects[p])
