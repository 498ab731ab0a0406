"""Edge knockout and head patching: invariants on tiny models of every family, and naive references."""

from __future__ import annotations

import functools

import pytest
import torch

from kvprobe.datasets import align, generate
from kvprobe.errors import KvprobeError
from kvprobe.kv import cache as kvcache
from kvprobe.kv.mask import additive_mask
from kvprobe.probes.base import RESULT_COLUMNS
from kvprobe.probes.engine import HeadSet, PairCaches, head_inputs, head_patched_reads, knockout_reads, read_batch
from kvprobe.probes.knockout import EdgeKnockout, HeadPatch, band_layers
from tests.conftest import TINY, tiny_model

ATOL = 1e-5


@functools.cache
def pair(name: str, index: int = 0) -> PairCaches:
    lm = tiny_model(name)
    return PairCaches.build(lm, align(generate(2, seed=0)[index], lm.tokenizer, "raw"))


def token_of(pc: PairCaches) -> int:
    return pc.a.ids_old[pc.D]


# -- bands -----------------------------------------------------------------------------------
def test_bands_split_depth_in_thirds():
    assert band_layers("all", 2) == (0, 1)
    assert (band_layers("early", 2), band_layers("middle", 2), band_layers("late", 2)) == ((0,), (1,), ())
    thirds = [band_layers(b, 30) for b in ("early", "middle", "late")]
    assert [len(t) for t in thirds] == [10, 10, 10] and sum(thirds, ()) == tuple(range(30))
    assert band_layers("layer1", 2) == (1,)
    for bad in ("layer2", "deep", "layerx"):
        with pytest.raises(KvprobeError, match="band"):
            band_layers(bad, 2)


# -- edge knockout ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_knocking_out_no_edges_changes_nothing(name):
    lm, pc = tiny_model(name), pair(name)
    hidden = torch.zeros(3, lm.adapter.n_layers, pc.D, dtype=torch.bool)
    got = knockout_reads(lm, pc.old, token_of(pc), pc.D, hidden)
    plain = read_batch(lm, [pc.old], token_of(pc), pc.D)
    torch.testing.assert_close(got, plain.expand(3, -1), atol=ATOL, rtol=0)
    assert kvcache.seq_len(pc.old) == pc.D  # the cache is left as it was


@pytest.mark.parametrize("name", TINY)
def test_all_layer_knockout_equals_masked_read(name):
    """A band of every layer equals read_batch with a visibility mask (the hook-free mask path)."""
    lm, pc = tiny_model(name), pair(name)
    D, L = pc.D, lm.adapter.n_layers
    sets = [tuple(range(*pc.a.field)), tuple(range(pc.a.downstream[0], pc.a.downstream[0] + 5)), (0, 7, D - 1)]
    hidden = torch.zeros(len(sets), L, D, dtype=torch.bool)
    visible = torch.ones(len(sets), 1, D, dtype=torch.bool)
    for b, positions in enumerate(sets):
        hidden[b, :, list(positions)] = True
        visible[b, 0, list(positions)] = False
    got = knockout_reads(lm, pc.old, token_of(pc), D, hidden)
    ref = read_batch(lm, [pc.old] * len(sets), token_of(pc), D, visible=visible)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", TINY)
def test_knocking_out_every_entry_equals_reading_the_token_alone(name):
    """Seeing only itself at every layer, the decision token reads as if the cache were empty."""
    lm, pc = tiny_model(name), pair(name)
    hidden = torch.ones(1, lm.adapter.n_layers, pc.D, dtype=torch.bool)
    got = knockout_reads(lm, pc.old, token_of(pc), pc.D, hidden)
    alone = kvcache.forward(lm.model, torch.tensor([[token_of(pc)]]), kvcache.new_cache(), torch.tensor([pc.D])).logits[:, -1]
    torch.testing.assert_close(got, alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", TINY)
def test_batched_knockouts_equal_one_at_a_time(name):
    lm, pc = tiny_model(name), pair(name)
    L, D = lm.adapter.n_layers, pc.D
    g = torch.Generator().manual_seed(0)
    hidden = torch.rand(4, L, D, generator=g) < 0.3
    together = knockout_reads(lm, pc.old, token_of(pc), D, hidden)
    for b in range(4):
        alone = knockout_reads(lm, pc.old, token_of(pc), D, hidden[b : b + 1])
        torch.testing.assert_close(together[b : b + 1], alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_per_layer_band_equals_a_manual_layer_loop(name):
    """Hiding entries at layer 1 only equals running the decoder layers by hand with per-layer masks."""
    lm, pc = tiny_model(name), pair(name)
    m, ad, D = lm.model, lm.adapter, pc.D
    positions = list(range(*pc.a.field)) + list(range(pc.a.downstream[0], pc.a.downstream[0] + 6))
    hidden = torch.zeros(1, ad.n_layers, D, dtype=torch.bool)
    hidden[0, 1, positions] = True
    got = knockout_reads(lm, pc.old, token_of(pc), D, hidden)

    cache = kvcache.copy(pc.old)
    pos = torch.tensor([[D]])
    x = ad.embed(m)(torch.tensor([[token_of(pc)]]))
    pe = m.model.rotary_emb(x, pos)  # a test may name the module: this is the naive reference
    with torch.no_grad():
        for layer, block in enumerate(ad.layers(m)):
            visible = ~hidden[:, layer][:, None]  # (1, 1, D)
            mask = additive_mask(pos, torch.arange(D)[None], visible, None, x.dtype)
            x = block(x, attention_mask=mask, position_embeddings=pe, position_ids=pos,
                      use_cache=True, **{kvcache.CACHE_KWARG: cache})
            x = x[0] if isinstance(x, tuple) else x
        ref = ad.lm_head(m)(ad.final_norm(m)(x))[:, -1]
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    plain = knockout_reads(lm, pc.old, token_of(pc), D, torch.zeros_like(hidden))
    assert (got - plain).abs().max() > 1e-4  # the knockout did something


def test_knockout_hooks_are_removed_even_on_error():
    lm, pc = tiny_model("tiny-qwen2"), pair("tiny-qwen2")
    from kvprobe.probes.engine import attention_knockout, head_patching

    hidden = torch.ones(1, lm.adapter.n_layers, pc.D, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="boom"):
        with attention_knockout(lm, hidden), head_patching(lm, [HeadSet({(0, 0)})], None):
            raise RuntimeError("boom")
    with pytest.raises(AssertionError):  # wrong cache length
        knockout_reads(lm, pc.old, token_of(pc), pc.D, torch.ones(1, lm.adapter.n_layers, pc.D + 1, dtype=torch.bool))
    for layer in range(lm.adapter.n_layers):
        assert not lm.adapter.attention(lm.model, layer)._forward_pre_hooks
        assert not lm.adapter.proj(lm.model, layer, "o")._forward_pre_hooks


def test_knockout_also_edits_the_mask_the_model_builds_itself():
    """Under eager attention the model's own 4D mask is edited the same way as our explicit one."""
    lm, pc = tiny_model("tiny-gemma2"), pair("tiny-gemma2")
    from kvprobe.probes.engine import attention_knockout

    hidden = torch.zeros(1, lm.adapter.n_layers, pc.D, dtype=torch.bool)
    hidden[0, 1, list(range(pc.D - 10, pc.D))] = True
    with attention_knockout(lm, hidden):
        own = kvcache.forward(lm.model, torch.tensor([[token_of(pc)]]), kvcache.copy(pc.old)).logits[:, -1]
    torch.testing.assert_close(own, knockout_reads(lm, pc.old, token_of(pc), pc.D, hidden), atol=ATOL, rtol=0)


# -- head patching ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_patching_no_heads_changes_nothing(name):
    lm, pc = tiny_model(name), pair(name)
    _, source = head_inputs(lm, pc.new, token_of(pc), pc.D)
    got = head_patched_reads(lm, pc.old, token_of(pc), pc.D, [HeadSet(), HeadSet()], source)
    torch.testing.assert_close(got, read_batch(lm, [pc.old], token_of(pc), pc.D).expand(2, -1), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", TINY)
def test_patching_every_head_from_the_new_read_gives_the_new_read(name):
    """The decision token's residual stream differs between the reads only through attention, so
    patching every head of every layer turns the stale read into the oracle read exactly."""
    lm, pc = tiny_model(name), pair(name)
    ad = lm.adapter
    new_logits, source = head_inputs(lm, pc.new, token_of(pc), pc.D)
    every = HeadSet((lay, h) for lay in range(ad.n_layers) for h in range(ad.n_heads))
    for cache in (pc.old, pc.new):  # from the stale cache, and the identity on the new one
        got = head_patched_reads(lm, cache, token_of(pc), pc.D, [every], source)
        torch.testing.assert_close(got[0], new_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("zero", [False, True], ids=["patch", "knockout"])
def test_head_patch_equals_a_hand_spliced_read(name, zero):
    """One batch of single-head patches equals, head by head, a batch-1 read whose o_proj OUTPUT is
    corrected by hand: out += W_o[:, slice] @ (replacement - current)[slice]."""
    lm, pc = tiny_model(name), pair(name)
    ad, D, tok = lm.adapter, pc.D, token_of(pc)
    hd = ad.head_dim
    _, source = head_inputs(lm, pc.new, tok, D)
    if zero:
        source_used = None
        source = torch.zeros_like(source)
    else:
        source_used = source
    heads = [(0, 0), (0, ad.n_heads - 1), (ad.n_layers - 1, 1)]
    got = head_patched_reads(lm, pc.old, tok, D, [HeadSet({lh}) for lh in heads], source_used)
    for b, (layer, head) in enumerate(heads):
        o = ad.proj(lm.model, layer, "o")
        sl = slice(head * hd, (head + 1) * hd)

        def splice(module, args, out, layer=layer, sl=sl):
            delta = source[layer, sl] - args[0][:, -1, sl]  # (B, hd)
            out = out.clone()
            out[:, -1] += delta @ module.weight[:, sl].T
            return out

        handle = o.register_forward_hook(splice)
        try:
            ref = read_batch(lm, [pc.old], tok, D)
        finally:
            handle.remove()
        torch.testing.assert_close(got[b : b + 1], ref, atol=ATOL, rtol=0)


def test_head_patching_refuses_unknown_heads():
    lm, pc = tiny_model("tiny-llama"), pair("tiny-llama")
    with pytest.raises(KvprobeError, match="query heads"):
        head_patched_reads(lm, pc.old, token_of(pc), pc.D, [HeadSet({(0, lm.adapter.n_heads)})], None)


# -- the probes ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-gemma3"])
def test_edge_knockout_probe_rows(name):
    lm, pc = tiny_model(name), pair(name)
    a = pc.a
    given = list(range(a.downstream[1] - 1, a.downstream[1] - 9, -1))  # a made-up ranking
    df = EdgeKnockout(ks=(4,), n_random=2, top_positions={a.case.case_id: given}, model_name=name).run(lm, [a])
    assert list(df.columns[: len(RESULT_COLUMNS)]) == RESULT_COLUMNS
    assert set(df.metric) == {"m", "dm", "flip"} and set(df.cache) == {"old", "new"}
    none = df[df.set == "none"]
    assert (none[none.metric != "m"].value == 0).all()
    assert set(df[df.set != "none"].band) == {"all", "early", "middle"}  # 2 layers: "late" is empty
    topk = df[(df.set == "topk") & (df.band == "all") & (df.cache == "old") & (df.metric == "m")]
    assert len(topk) == 1
    hidden = torch.zeros(1, lm.adapter.n_layers, pc.D, dtype=torch.bool)
    hidden[0, :, sorted(given[:4])] = True
    from kvprobe.kv.readout import logit_diff
    from kvprobe.probes.locality import targets

    m = logit_diff(knockout_reads(lm, pc.old, token_of(pc), pc.D, hidden), a.option_ids, *targets(a))
    assert abs(float(m[0]) - topk.value.iloc[0]) < ATOL
    assert len(df[(df.set == "randomk") & (df.metric == "flip")]) == 2 * 3 * 2  # draws x bands x caches
    with pytest.raises(KvprobeError, match="downstream"):
        EdgeKnockout(top_positions={a.case.case_id: [0]}).run(lm, [a])


def test_edge_knockout_computes_the_ranking_when_not_given():
    lm, pc = tiny_model("tiny-mistral"), pair("tiny-mistral")
    df = EdgeKnockout(ks=(2,), n_random=1, bands=("all",), caches=("old",)).run(lm, [pc.a])
    assert set(df.set) == {"none", "field", "topk", "randomk"} and set(df.cache) == {"old"}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma2"])
def test_head_patch_probe_rows(name):
    lm, pc = tiny_model(name), pair(name)
    df = HeadPatch(n_random=2, model_name=name).run(lm, [pc.a])
    assert list(df.columns[: len(RESULT_COLUMNS)]) == RESULT_COLUMNS
    n_heads = lm.adapter.n_layers * lm.adapter.n_heads
    singles = df[(df.set == "single") & (df.metric == "recovery")]
    assert len(singles) == n_heads and set(zip(singles["layer"], singles["head"])) == {
        (lay, h) for lay in range(lm.adapter.n_layers) for h in range(lm.adapter.n_heads)}
    sets = df[df.set != "single"]
    assert set(sets.k) == {min(12, n_heads)}  # top-12 capped at the number of heads
    all_rec = sets[(sets.set == "all") & (sets.metric == "recovery")].value.iloc[0]
    if abs(df.oracle_flip.iloc[0]) > 1e-3:
        assert abs(all_rec - 1) < 1e-3
    assert (sets[(sets.set == "all") & (sets.metric == "agree")].value == 1).all()
