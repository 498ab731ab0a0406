"""Cross-checks against other toolkits (the optional ``crosscheck`` extra: nnsight, transformer_lens).

kvprobe patches in *cache space*: it edits cache entries and re-reads one token. nnsight and
TransformerLens patch *activations* in full forward passes. The two must agree to 1e-4:

- single-position K/V patch: a full forward of the old prompt in which every earlier position's
  k_proj/v_proj output is frozen to the old run's, except position p, which takes the new run's
  (freezing all of them is what makes it a cache edit: otherwise the positions after p would be
  recomputed from a changed residual stream);
- head knockout: zero one head's slice of the o_proj input at the decision token.

Toolkit facts met here (transformers 5.24, nnsight 0.8.1, transformer_lens 4.3.0):

- nnsight mis-masks a filled cache: given ``cache=`` and one new token, it builds the mask for
  the new token only (the decision logits are off by ~18 on smollm2-135m). A full-length
  ``attention_mask`` fixes it; see the test below.
- TransformerLens's ``TransformerBridge`` replaces the HF model's attention modules *in place*,
  so it gets a deep copy here. Its own KV cache path is broken with transformers 5.24: the
  decoder layers now hand the cache to attention as ``cache=``, while the bridge's attention
  (``_update_kv_cache``) still reads ``past_key_values``/``layer_past``, so the cache stays empty
  and every decode step attends to itself alone. Only the cache-free forward is compared; the
  bug itself is pinned by a test so that a fixed release shows up.
- The bridge needs a tokenizer it can reload (``name_or_path``); the in-memory word tokenizer of
  the tiny models goes through ``save_pretrained`` first.
"""

from __future__ import annotations

import copy
import functools
import operator
import warnings

import pytest
import torch

from kvprobe.datasets import align, generate
from kvprobe.kv.readout import logit_diff
from kvprobe.kv import cache as kvcache
from kvprobe.probes.engine import PairCaches, Patch, patched_reads, read_batch
from kvprobe.probes.engine import HeadSet, head_patched_reads
from kvprobe.probes.locality import targets
from tests.conftest import real_model, tiny_model

TOL = 1e-4
MODELS = ["tiny-qwen2", "tiny-gemma2", pytest.param("smollm2-135m", marks=[pytest.mark.real, pytest.mark.slow])]


def load(name: str):
    return real_model(name) if name == "smollm2-135m" else tiny_model(name)


@functools.cache
def case(name: str) -> PairCaches:
    lm = load(name)
    return PairCaches.build(lm, align(generate(2, seed=0)[0], lm.tokenizer, "raw"))


def positions_of(pc: PairCaches) -> list[int]:
    (f0, _), (d0, _) = pc.a.field, pc.a.downstream
    return [f0, d0, (d0 + pc.D) // 2, pc.D - 1]


# -- nnsight ---------------------------------------------------------------------------------
def nnsight_model(lm):
    pytest.importorskip("nnsight")
    return _nnsight_model(lm.info.spec)


@functools.cache
def _nnsight_model(name: str):
    import nnsight

    lm = load(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LanguageModel's deprecation notice (0.8)
        return nnsight.LanguageModel(copy.deepcopy(lm.model), tokenizer=lm.tokenizer)


def envoy_proj(nm, lm, layer: int, which: str):
    """The nnsight envoy of one attention projection, found through the family adapter's paths."""
    fam = lm.adapter.family
    return getattr(getattr(operator.attrgetter(fam.layers)(nm)[layer], fam.attention), fam.proj[which])


def nnsight_kv(nm, lm, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_proj output, v_proj output), each (1, T, H_kv * hd), of a full forward."""
    saved = []  # nnsight re-runs the traced block's source: no comprehensions inside it
    with torch.no_grad(), nm.trace(ids):
        for i in range(lm.adapter.n_layers):
            saved.append((envoy_proj(nm, lm, i, "k").output.save(), envoy_proj(nm, lm, i, "v").output.save()))
    return [(k.detach().clone(), v.detach().clone()) for k, v in saved]


def nnsight_patched_logits(nm, lm, ids, old_kv, new_kv, p: int) -> torch.Tensor:
    """Decision logits (V,) of a full forward of the old prompt, K/V frozen to old except p (new)."""
    D = ids.shape[1] - 1
    with torch.no_grad(), nm.trace(ids):
        for layer, ((k0, v0), (k1, v1)) in enumerate(zip(old_kv, new_kv)):
            for which, old, new in (("k", k0, k1), ("v", v0, v1)):
                frozen = old[:, :D].clone()
                frozen[:, p] = new[:, p]
                envoy_proj(nm, lm, layer, which).output[:, :D] = frozen
        out = nm.output.save()
    return out.logits[0, -1].detach()


@pytest.mark.parametrize("name", MODELS)
def test_single_position_kv_patch_matches_nnsight(name):
    lm, pc = load(name), case(name)
    nm = nnsight_model(lm)
    a, D = pc.a, pc.D
    m_of = lambda lg: logit_diff(lg, a.option_ids, *targets(a))  # noqa: E731
    ids_old, ids_new = torch.tensor([a.ids_old[: D + 1]]), torch.tensor([a.ids_new[: D + 1]])
    old_kv, new_kv = nnsight_kv(nm, lm, ids_old), nnsight_kv(nm, lm, ids_new)
    ps = positions_of(pc)
    ours = patched_reads(lm, pc, [Patch(())] + [Patch((p,)) for p in ps])  # (1 + len(ps), V)
    theirs = torch.stack([nnsight_patched_logits(nm, lm, ids_old, old_kv, old_kv, 0)]
                         + [nnsight_patched_logits(nm, lm, ids_old, old_kv, new_kv, p) for p in ps])
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    effects_ours, effects_theirs = m_of(ours[1:]) - m_of(ours[0]), m_of(theirs[1:]) - m_of(theirs[0])
    torch.testing.assert_close(effects_ours, effects_theirs, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_head_knockout_matches_nnsight(name):
    lm, pc = load(name), case(name)
    nm = nnsight_model(lm)
    a, D, hd = pc.a, pc.D, lm.adapter.head_dim
    layer, head = lm.adapter.n_layers // 2, 1
    with torch.no_grad(), nm.trace(torch.tensor([a.ids_old[: D + 1]])):
        envoy_proj(nm, lm, layer, "o").input[:, -1, head * hd : (head + 1) * hd] = 0
        out = nm.output.save()
    theirs = out.logits[:, -1].detach()
    ours = head_patched_reads(lm, pc.old, a.ids_old[D], D, [HeadSet({(layer, head)})], None)
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    assert (ours - read_batch(lm, [pc.old], a.ids_old[D], D)).abs().max() > 1e-4  # it did knock something out


@pytest.mark.parametrize("name", MODELS)
def test_nnsight_needs_a_full_length_mask_over_a_filled_cache(name):
    lm, pc = load(name), case(name)
    nm = nnsight_model(lm)
    D, tok = pc.D, pc.a.ids_old[pc.D]
    ours = read_batch(lm, [pc.old], tok, D)
    with torch.no_grad(), nm.trace(torch.tensor([[tok]]), position_ids=torch.tensor([[D]]), use_cache=True,
                                   attention_mask=torch.ones(1, D + 1, dtype=torch.long),
                                   **{kvcache.CACHE_KWARG: kvcache.copy(pc.old)}):
        out = nm.output.save()
    torch.testing.assert_close(ours, out.logits[:, -1].detach(), atol=TOL, rtol=0)


# -- TransformerLens -------------------------------------------------------------------------
def bridge_of(lm, tmp_path):
    tl = pytest.importorskip("transformer_lens.model_bridge")
    from transformers import AutoTokenizer

    lm.tokenizer.save_pretrained(tmp_path)  # the bridge reloads the tokenizer by name_or_path
    tok = AutoTokenizer.from_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # boot replaces attention modules in place: never hand it the session's shared model
        return tl.TransformerBridge.boot_transformers(lm.info.spec, hf_model=copy.deepcopy(lm.model),
                                                      tokenizer=tok, device="cpu")


@pytest.mark.parametrize("name", MODELS)
def test_transformer_bridge_forward_matches_hf(name, tmp_path):
    lm, pc = load(name), case(name)
    br = bridge_of(lm, tmp_path)
    ids = torch.tensor([pc.a.ids_old[: pc.D + 1]])
    with torch.no_grad():
        theirs = br(ids, return_type="logits", prepend_bos=False)
        ours = lm.model(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, atol=TOL, rtol=0)
    # and the stale decision read through kvprobe's cache equals the bridge's cache-free forward
    torch.testing.assert_close(read_batch(lm, [pc.old], pc.a.ids_old[pc.D], pc.D), theirs[:, -1], atol=TOL, rtol=0)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_transformer_bridge_kv_cache_stays_empty_on_transformers_5_24(tmp_path):
    """Pins TransformerLens 4.3's cache bug: the cache keyword was renamed to ``cache`` in
    transformers 5.24 and the bridge still reads ``past_key_values``, so its cache stays empty
    and a cached decode step sees only itself. When this test fails, the bug is fixed."""
    lm = tiny_model("tiny-qwen2")
    if kvcache.CACHE_KWARG != "cache":
        pytest.skip("transformers still names the attention cache keyword past_key_values")
    br = bridge_of(lm, tmp_path)
    from transformers import DynamicCache

    ids = torch.randint(4, len(lm.tokenizer), (1, 10), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with torch.no_grad():
        _, cache = br(ids[:, :9], return_type="logits_and_cache", past_key_values=cache, prepend_bos=False)
        step, _ = br(ids[:, 9:], return_type="logits_and_cache", past_key_values=cache, prepend_bos=False)
        alone = lm.model(input_ids=ids[:, 9:], position_ids=torch.tensor([[9]])).logits
        full = lm.model(input_ids=ids).logits
    assert kvcache.seq_len(cache) == 0
    torch.testing.assert_close(step[:, -1], alone[:, -1], atol=TOL, rtol=0)  # it attended to itself alone
    assert (step[:, -1] - full[:, -1]).abs().max() > 1e-3
