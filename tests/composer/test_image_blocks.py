"""Image blocks (issue 32): an image's KV precompiled under M-RoPE, stored with its content hash and
position scheme, spliced through the composer at other positions and against the model's own full
multimodal prefill (tiny-qwen2_vl with its vision tower, images made here through its image
processor)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from kvprobe import composer
from kvprobe.composer import images
from kvprobe.composer import store as block_store
from kvprobe.errors import KvprobeError, UsageError
from kvprobe.kv import cache as kvcache
from tests.conftest import tiny_model

TOL = 1e-4  # tests/composer/test_compose.py's tolerance for moved blocks
SHIFT = 128
_spec = importlib.util.spec_from_file_location("scheme_table", Path(__file__).resolve().parents[2] / "scripts" /
                                               "scheme_table.py")
scheme_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scheme_table)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 600, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _max(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture(scope="module")
def lm():
    return tiny_model("tiny-qwen2_vl")


def test_an_image_goes_through_the_models_image_processor_and_is_named_by_its_content(lm):
    im = images.generated_image(lm, 0)
    assert im.grid == (1, 8, 8) and tuple(im.pixels.shape) == (64, 96)  # 32 x 32 px, 4-px patches, 2 frames
    assert images.n_image_tokens(lm, im) == 16 and len(images.image_ids(lm, im)) == 18
    assert im.sha256 == images.generated_image(lm, 0).sha256 != images.generated_image(lm, 1).sha256
    with pytest.raises(UsageError, match=r"\(H, W, 3\) uint8"):
        images.image_from_array(lm, np.zeros((8, 8), dtype=np.uint8))
    with pytest.raises(UsageError, match="needs a model with M-RoPE and a vision tower"):
        images.generated_image(tiny_model("tiny-qwen2"), 0)


def test_an_image_block_takes_fewer_positions_than_tokens_and_the_text_after_it_continues_there(lm):
    pre = _ids(3, 0)
    block = images.precompile_image(lm, images.generated_image(lm, 0), pre)
    assert (block.scheme, block.start, len(block), block.span) == ("mrope", 3, 18, 6)
    assert block.rope_positions[:, 0].tolist() == [3, 3, 3] and block.image["grid_thw"] == [1, 8, 8]
    c = composer.compose(lm, [pre + _ids(10, 1), block, _ids(4, 2)])
    assert (len(c.ids), c.next_pos) == (3 + 10 + 18 + 4, 3 + 10 + 6 + 4)


def test_an_image_block_in_the_context_it_was_precompiled_in_equals_the_full_prefill(lm):
    pre, q = _ids(3, 0), _ids(5, 2)
    im = images.generated_image(lm, 0)
    block = images.precompile_image(lm, im, pre)
    c = composer.compose(lm, [pre, block, q])
    assert _max(c.logits, images.multimodal_oracle_logits(lm, composer.context_ids([pre, block, q]), [im])) <= 1e-5


def test_an_image_block_moved_by_128_positions_and_rerotated_equals_the_full_prefill(lm):
    """Re-rotated by its M-RoPE shift: the fresh prefill's logits; not re-rotated, or with the text
    after it placed by token count (1-D RoPE's view of the prompt), far off: the check can fail."""
    pre, lead, q = _ids(3, 0), _ids(40, 1), _ids(5, 2)
    im = images.generated_image(lm, 0)
    block, ids = scheme_table.shifted_image_block(lm, pre, lead, im, q, SHIFT)
    oracle = images.multimodal_oracle_logits(lm, ids, [im])
    assert _max(composer.compose(lm, [pre + lead, block, q]).logits, oracle) <= TOL
    assert _max(composer.compose(lm, [pre + lead, block, q], rerotate=False).logits, oracle) > 10 * TOL
    by_tokens = dataclasses.replace(block, rope_positions=None, embeds=None, image=None, _rotated={})
    assert _max(composer.compose(lm, [pre + lead, by_tokens, q]).logits, oracle) > 10 * TOL


def test_image_and_text_blocks_with_the_whole_block_as_seam_equal_the_full_prefill(lm):
    """Two images precompiled alone and a text block between them, behind a lead: with the seam
    over every block (fed fresh, image tokens from their stored embeddings), the full prefill."""
    pre, lead, skill, q = _ids(3, 0), _ids(30, 1), _ids(20, 3), _ids(5, 2)
    a, b = images.generated_image(lm, 0), images.generated_image(lm, 1)
    parts = [pre + lead, images.precompile_image(lm, a, pre), composer.precompile(lm, skill, pre),
             images.precompile_image(lm, b, pre), q]
    oracle = images.multimodal_oracle_logits(lm, composer.context_ids(parts), [a, b])
    assert _max(composer.compose(lm, parts, seam=len(skill)).logits, oracle) <= 1e-5  # >= every block
    partial = composer.compose(lm, parts, seam=4)
    assert partial.timings.seam > 0 and len(partial.ids) == len(composer.context_ids(parts))


def test_the_store_keeps_an_image_blocks_content_hash_and_scheme_and_refuses_a_1d_model(lm, tmp_path):
    pre, q = _ids(3, 0), _ids(5, 2)
    im = images.generated_image(lm, 0)
    block = images.precompile_image(lm, im, pre, name="photo")
    path = block_store.save_block(block, lm, tmp_path / f"photo{block_store.SUFFIX}")
    header = block_store.read_header(path)
    assert (header["format"], header["scheme"]) == ("kvprobe-block/2", "mrope")
    assert header["image"] == {"sha256": im.sha256, "grid_thw": [1, 8, 8]}
    assert header["positions"] == block.rope_positions.tolist()
    got = block_store.load_block(path, lm)
    assert torch.equal(got.rope_positions, block.rope_positions) and torch.equal(got.embeds, block.embeds)
    assert all(torch.equal(x, y) and torch.equal(u, w) for (x, u), (y, w) in zip(got.kv, block.kv))
    assert torch.equal(composer.compose(lm, [pre, got, q], seam=2).logits,
                       composer.compose(lm, [pre, block, q], seam=2).logits)
    with pytest.raises(KvprobeError, match=r"M-RoPE image block; tiny-qwen2 rotates by one position id"):
        block_store.load_block(path, tiny_model("tiny-qwen2"))
    text = block_store.save_block(composer.precompile(lm, q, pre), lm, tmp_path / f"text{block_store.SUFFIX}")
    assert block_store.read_header(text)["scheme"] == "rope"  # text blocks of the same model: one id each


def test_refusals_name_the_scheme(lm):
    pre, q = _ids(3, 0), _ids(5, 2)
    block = images.precompile_image(lm, images.generated_image(lm, 0), pre)
    with pytest.raises(KvprobeError, match="is an M-RoPE image block; tiny-llama rotates by one position id"):
        composer.compose(tiny_model("tiny-llama"), [pre, block, q])
    with pytest.raises(KvprobeError, match="image block .M-RoPE.; the fused path places text blocks only"):
        composer.compose_fused(lm, [pre, block, q])
    with pytest.raises(UsageError, match="needs a model with M-RoPE and a vision tower"):
        images.precompile_image(tiny_model("tiny-llama"), images.Image(torch.zeros(64, 96), (1, 8, 8)), pre)
    with pytest.raises(KvprobeError, match=r"M-RoPE positions must be \(3, 18\)"):
        dataclasses.replace(block, rope_positions=block.rope_positions[:, 1:], _rotated={})


def test_a_text_forward_after_an_image_prompt_is_not_shifted_by_the_models_stored_offset(lm):
    """The model keeps the M-RoPE offset of the last image prompt (rope_deltas) and adds it to a
    later forward that passes no positions; kvprobe's image calls put it back, so the text paths
    (which rely on the default positions) read the same logits before and after."""
    ids = _ids(20, 5)
    before = composer.oracle_logits(lm, ids)
    stored = lm.model.model.rope_deltas  # None, or a text forward's 0 where another test ran one without positions
    im = images.generated_image(lm, 0)
    images.multimodal_oracle_logits(lm, _ids(3, 0) + images.image_ids(lm, im) + _ids(5, 2), [im])
    images.precompile_image(lm, im, _ids(3, 0))
    assert lm.model.model.rope_deltas is stored  # what was there before the image calls, not the image's offset
    _, cache = kvcache.prefill(lm.model, torch.tensor(ids[:-1]))
    out = kvcache.forward(lm.model, torch.tensor([ids[-1:]]), cache)
    assert torch.equal(composer.oracle_logits(lm, ids), before)
    assert _max(out.logits[0, -1], before) <= 1e-5


def test_validate_with_image_blocks_composes_them_resumes_and_refuses_a_model_without_mrope(tmp_path, monkeypatch):
    """``kvprobe validate --images 1`` on tiny-qwen2_vl: every query holds an image block (18 tokens
    that take 6 positions) and its skills; with the seam over every block, the composed context is
    the model's own multimodal prefill (top-1 and cosine 1); with no seam it is not (tiny random
    weights: only mechanics are claimed). A rerun resumes from the parts and the stored blocks (the
    image files carry scheme and content hash); a model without M-RoPE is refused in one line."""
    import pandas as pd
    from typer.testing import CliRunner

    from kvprobe.cli.app import app
    from kvprobe.composer import gate
    from kvprobe.results import COMPOSE

    out = tmp_path / "v"
    args = ["validate", "--model", "tiny-qwen2_vl", "--n", "4", "--images", "1", "--seams", "0,64", "--seam", "64",
            "--block-tokens", "20,30", "--blocks", "1,2", "--threshold", "0", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    df = pd.read_parquet(out / COMPOSE)
    full = df[df.seam == 64]  # longer than every block (skills run past --block-tokens' 30 by a few)
    assert len(full) == 8 and full.top1_agree.all() and (full.cosine > 1 - 1e-6).all() and full.agree.all()
    assert (df[(df.seam == 0) & df.rerotate].cosine < 1 - 1e-4).all()
    stored = [block_store.read_header(p) for p in sorted((out / "blocks").glob(f"image-*{block_store.SUFFIX}"))]
    assert len(stored) == 2 and all(h["scheme"] == "mrope" and h["image"]["grid_thw"] == [1, 8, 8] for h in stored)
    assert json_manifest(out)["images"] == 1

    def boom(*a, **k):
        raise AssertionError("recomputed")

    monkeypatch.setattr(images, "precompile_image", boom)
    monkeypatch.setattr(images, "multimodal_oracle_logits", boom)
    monkeypatch.setattr(gate, "precompile", boom)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    pd.testing.assert_frame_equal(pd.read_parquet(out / COMPOSE).drop(columns=["wall_s", "oracle_wall_s"]),
                                  df.drop(columns=["wall_s", "oracle_wall_s"]))
    res = CliRunner().invoke(app, [*args[:2], "tiny-llama", *args[3:-1], str(tmp_path / "llama")])
    assert isinstance(res.exception, UsageError)  # exit 2 through the entry point (scripts/bad_inputs.py)
    assert "--images needs a model with M-RoPE and a vision tower" in str(res.exception)
    assert not (tmp_path / "llama" / COMPOSE).exists()


def json_manifest(out):
    import json

    return json.loads((out / "compose_manifest.json").read_text())
