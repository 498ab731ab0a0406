"""The block store: a round trip is exact, and files from elsewhere or damaged are refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvprobe.errors import KvprobeError
from kvprobe import composer
from kvprobe.composer import store as block_store
from kvprobe.models import build_tiny
from kvprobe.datasets.words import build_word_tokenizer
from tests.conftest import TINY, ids_of, tiny_model


def saved(tmp_path, name: str = "tiny-llama"):
    lm = tiny_model(name)
    ids = ids_of(30, len(lm.tokenizer))[0].tolist()
    block = composer.precompile(lm, ids[5:], ids[:5], name="skill")
    return lm, block, block_store.save_block(block, lm, tmp_path / f"skill{block_store.SUFFIX}")


@pytest.mark.parametrize("name", TINY)
def test_round_trip_is_exact(tmp_path, name):
    lm, block, path = saved(tmp_path, name)
    got = block_store.load_block(path, lm)
    assert (got.ids, got.start, got.preamble, got.name, got.dtype) == (block.ids, 5, block.preamble, "skill", "float32")
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(got.kv, block.kv))
    header = block_store.read_header(path)
    assert header["positions"] == list(range(5, 30)) and header["model"]["config_hash"] == lm.config_hash()
    assert len(header["rope"]) == lm.adapter.n_layers and header["checksum"].startswith("sha256:")
    q = [7, 8, 9]
    torch.testing.assert_close(composer.compose(lm, [block.preamble, got, q]).logits,
                               composer.compose(lm, [block.preamble, block, q]).logits, atol=0, rtol=0)
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write left nothing behind


def test_refuses_another_model(tmp_path):
    _, _, path = saved(tmp_path)
    with pytest.raises(KvprobeError, match=r"another model \(config\)"):
        block_store.load_block(path, tiny_model("tiny-qwen2"))
    lm = tiny_model("tiny-llama")
    other, _ = build_tiny("tiny-llama", lm.tokenizer, seed=99)  # same config, other weights
    retrained = dataclasses.replace(lm, model=other, info=dataclasses.replace(lm.info, _weights_hash=None))
    with pytest.raises(KvprobeError, match=r"another model \(weights\)"):
        block_store.load_block(path, retrained)


def test_refuses_another_tokenizer(tmp_path):
    lm, _, path = saved(tmp_path)
    words = sorted(lm.tokenizer.get_vocab())
    tok = build_word_tokenizer([w for w in words if w != "refund"] + ["zzzz"])  # same size, one word differs
    assert len(tok) == len(lm.tokenizer)
    with pytest.raises(KvprobeError, match="another tokenizer"):
        block_store.load_block(path, dataclasses.replace(lm, tokenizer=tok))


def test_refuses_truncated_file(tmp_path):
    lm, _, path = saved(tmp_path)
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 40, 4):
        path.write_bytes(data[:cut])
        with pytest.raises(KvprobeError, match="truncated or corrupt"):
            block_store.load_block(path, lm)


def test_refuses_corrupt_data_and_header(tmp_path):
    lm, _, path = saved(tmp_path)
    data = bytearray(path.read_bytes())
    flipped = bytearray(data)
    flipped[-10] ^= 0xFF  # a byte of the last tensor
    path.write_bytes(flipped)
    with pytest.raises(KvprobeError, match="checksum"):
        block_store.load_block(path, lm)
    block_store.load_block(path, lm, verify=False)  # only the checksum sees data corruption
    header_len = int.from_bytes(data[:8], "little")
    text = data[8 : 8 + header_len].decode()
    for bad in (text.replace('"kvprobe-block/2', '"kvprobe-block/9'), text.replace("{", "[", 1)):
        path.write_bytes(bytes(data[:8]) + bad.encode() + bytes(data[8 + header_len :]))
        with pytest.raises(KvprobeError, match="not a (readable )?(kvprobe )?block file"):
            block_store.load_block(path, lm)


def test_refuses_tampered_ids_and_missing_file(tmp_path):
    from safetensors.torch import load_file, save_file

    lm, _, path = saved(tmp_path)
    header = block_store.read_header(path)
    header["ids"][0] += 1  # metadata edited without the checksum
    save_file(load_file(path), path, metadata={block_store.META_KEY: json.dumps(header)})
    with pytest.raises(KvprobeError, match="checksum"):
        block_store.load_block(path, lm)
    with pytest.raises(KvprobeError, match="not found"):
        block_store.load_block(tmp_path / "nope.safetensors", lm)
    save_file({"x": torch.zeros(2)}, tmp_path / "plain.safetensors")
    with pytest.raises(KvprobeError, match="not a kvprobe block file"):
        block_store.load_block(tmp_path / "plain.safetensors", lm)
