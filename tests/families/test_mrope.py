"""M-RoPE with an image block (issue 32), on tiny-qwen2_vl with its vision tower and an image made here
(random patches): an image block's keys move by its shift in M-RoPE positions, not in tokens; its
jointly computed KV, moved and re-rotated, reproduces a fresh prefill of the whole multimodal prompt.

Qwen2-VL's positions (docs/architectures.md): text (t, t, t); an image starting at s has (s, s + row,
s + column) over its merged grid, and the text after it continues from its largest position + 1. So
the 16 tokens of an 8 x 8-patch image (merged 2 x 2) take 4 positions, and the token index and the
position of what follows an image differ by 12.
"""

from __future__ import annotations

import torch

from kvprobe.kv import cache as kvcache
from kvprobe.models import rope
from tests.conftest import tiny_model

GRID = torch.tensor([[1, 8, 8]])  # (t, h, w) in patches: 64 patches, 16 tokens after the 2 x 2 merge
TOL_KEYS, TOL_LOGITS = 1e-5, 1e-4


def _setup():
    lm = tiny_model("tiny-qwen2_vl")
    cfg = lm.model.config
    gen = torch.Generator().manual_seed(0)
    image, other = torch.randn(64, 96, generator=gen), torch.randn(64, 96, generator=gen)  # (patches, C*T*P*P)
    lead = torch.randint(4, 600, (7,), generator=gen).tolist()
    query = torch.randint(4, 600, (5,), generator=gen).tolist()
    block = [cfg.vision_start_token_id] + [cfg.image_token_id] * 16 + [cfg.vision_end_token_id]
    return lm, image, other, lead, query, block


def _positions(lm, ids: list[int], n_images: int) -> torch.Tensor:
    """(3, 1, T) M-RoPE position ids, as the model computes them for a prompt with images."""
    t = torch.tensor([ids])
    return lm.model.model.get_rope_index(t, mm_token_type_ids=(t == lm.model.config.image_token_id).int(),
                                         image_grid_thw=GRID.repeat(n_images, 1))[0]


@torch.no_grad()
def _prefill(lm, ids, pixels, positions, n_images):
    out = lm.model(input_ids=torch.tensor([ids]), pixel_values=pixels, image_grid_thw=GRID.repeat(n_images, 1),
                   position_ids=positions, use_cache=True)
    return out.logits[0, -1], out.past_key_values


def _max(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_an_image_blocks_keys_move_by_its_shift_in_mrope_positions_not_in_tokens():
    """The image block after a text lead, and the same block after another image and that lead: its
    layer-0 keys (which depend on the token's own input and position only) re-rotated by the
    M-RoPE shift (6) equal the second prompt's; by the token shift (18), as 1-D RoPE over token
    indices would move them, they are far off."""
    lm, image, other, lead, query, block = _setup()
    a_ids, b_ids = lead + block + query, block + lead + block + query
    a_pos, b_pos = _positions(lm, a_ids, 1), _positions(lm, b_ids, 2)
    _, a_cache = _prefill(lm, a_ids, image, a_pos, 1)
    _, b_cache = _prefill(lm, b_ids, torch.cat([other, image]), b_pos, 2)
    a0, b0 = len(lead), len(block) + len(lead)  # where the moved block starts, in tokens
    shift_pos = int(b_pos[0, 0, b0] - a_pos[0, 0, a0])
    shift_tokens = b0 - a0
    assert (shift_pos, shift_tokens) == (6, 18)
    got = kvcache.get_kv(a_cache, 0)[0][:, :, a0:a0 + len(block)]
    want = kvcache.get_kv(b_cache, 0)[0][:, :, b0:b0 + len(block)]
    inv = rope.inv_freq(lm.adapter, 0)
    assert _max(rope.rerotate(got, shift_pos, inv), want) <= TOL_KEYS
    assert _max(rope.rerotate(got, shift_tokens, inv), want) > 1000 * TOL_KEYS  # the wrong shift: the check can fail


def test_joint_image_kv_moved_and_rerotated_reproduces_a_fresh_prefill():
    """The image block's KV from a prefill 128 positions later (all three axes), re-rotated back and
    spliced between a fresh lead and a fresh query, gives the fresh prefill's decision logits."""
    lm, image, _, lead, query, block = _setup()
    ids = lead + block + query
    pos = _positions(lm, ids, 1)
    fresh, _ = _prefill(lm, ids, image, pos, 1)
    _, shifted = _prefill(lm, ids, image, pos + 128, 1)
    lo, hi = len(lead), len(lead) + len(block)
    _, cache = _prefill(lm, lead, None, pos[:, :, :lo], 0)
    for moved, expect_close in ((True, True), (False, False)):
        c = kvcache.copy(cache)
        for layer in range(lm.adapter.n_layers):
            k, v = kvcache.get_kv(shifted, layer)
            k, v = k[:, :, lo:hi], v[:, :, lo:hi]
            if moved:
                k, v = rope.rerotate_kv(lm.adapter, layer, (k, v), -128)
            k0, v0 = kvcache.get_kv(c, layer)
            kvcache.set_kv(c, layer, torch.cat([k0, k], 2), torch.cat([v0, v], 2))
        with torch.no_grad():
            out = lm.model(input_ids=torch.tensor([query]), position_ids=pos[:, :, hi:], cache=c, use_cache=True)
        err = _max(out.logits[0, -1], fresh)
        assert (err <= TOL_LOGITS) == expect_close, (moved, err)  # not re-rotated: far off


def test_text_prompts_on_the_multimodal_model_run_through_kvprobe():
    """Text alone has (t, t, t) positions, 1-D RoPE's: kvprobe's text paths (the family suites) run
    on tiny-qwen2_vl as on any decoder; its RoPE self-check passed at load."""
    lm = tiny_model("tiny-qwen2_vl")
    assert lm.info.rope_unsupported is None and lm.info.rope_check_error <= 1e-4
    assert lm.adapter.family.family == "qwen2_vl" and lm.max_positions == 2048


def test_a_text_field_edit_downstream_of_an_image_recomputed_equals_the_oracle():
    """A field after the image changes (one token): recomputing the field and everything after it
    on the old multimodal cache, each token rotated by its M-RoPE position, gives the fresh prefill
    of the new prompt (the oracle); rotated by its token index instead (1-D RoPE), it does not."""
    from kvprobe.kv.recompute import recompute_positions

    lm, image, _, lead, query, block = _setup()
    old_ids = lead + block + [41, 42, 43] + query
    new_ids = lead + block + [41, 77, 43] + query
    field = len(lead) + len(block) + 1
    pos = _positions(lm, old_ids, 1)
    assert torch.equal(pos, _positions(lm, new_ids, 1))
    oracle, _ = _prefill(lm, new_ids, image, pos, 1)
    D = len(new_ids) - 1  # the decision token: read on top of the repaired cache [0, D)
    _, old = _prefill(lm, old_ids[:D], image, pos[:, :, :D], 1)
    for rope_positions, expect_close in ((pos[:, :, :D], True), (None, False)):
        repaired = recompute_positions(lm, old, new_ids, list(range(field, D)), rope_positions=rope_positions)
        with torch.no_grad():
            out = lm.model(input_ids=torch.tensor([new_ids[D:]]), position_ids=pos[:, :, D:], cache=repaired,
                           use_cache=True)
        err = _max(out.logits[0, -1], oracle)
        assert (err <= TOL_LOGITS) == expect_close, (rope_positions is not None, err)
