"""A GGUF's header is parsed once per fetch: transformers reads the file for the config, the
tokenizer and the weights, and inside ``bundled._one_header_parse`` those reads share one reader
(parsed over a plain array, not a ``np.memmap``, whose slices are slow), and the tensor name map,
which transformers asks for once per submodule, is built once.
(That the folder it writes is byte for byte the one of three parses: benchmarks/gguf_dequant.py,
1.8x faster on gemma3-270m; the bundled real-model tests fetch through it.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from kvprobe.models import bundled


def tiny_gguf(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_transformers_reads_through_one_reader_per_file_inside_the_block(tmp_path, monkeypatch):
    a, b = tiny_gguf(tmp_path / "a.gguf"), tiny_gguf(tmp_path / "b.gguf")
    parsed = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parsed.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    first = load_gguf_checkpoint(str(a))
    load_gguf_checkpoint(str(a))
    assert len(parsed) == 2  # outside the block, each read parses the file again
    parsed.clear()
    with bundled._one_header_parse():
        for _ in range(3):  # config, tokenizer, weights
            assert load_gguf_checkpoint(str(a))["config"] == first["config"]
        assert gguf.GGUFReader(str(tmp_path / "." / "a.gguf")) is gguf.GGUFReader(str(a))
        load_gguf_checkpoint(str(b))
    assert parsed == [str(a), str(b)]
    assert gguf.GGUFReader is Counting  # put back


def test_inside_the_block_the_reader_parses_a_plain_array_over_the_map_and_reads_the_same(tmp_path):
    from gguf import gguf_reader

    path = str(tiny_gguf(tmp_path / "a.gguf"))
    outside = gguf.GGUFReader(path)
    with bundled._one_header_parse():
        inside = gguf.GGUFReader(path)
        assert gguf_reader.np is np  # numpy is put back once the header is parsed
    assert isinstance(outside.data, np.memmap) and type(inside.data) is np.ndarray and not inside.data.flags.writeable
    assert np.array_equal(inside.data, outside.data)
    assert list(inside.fields) == list(outside.fields)
    for name, field in outside.fields.items():
        assert [p.tobytes() for p in inside.fields[name].parts] == [p.tobytes() for p in field.parts], name
    assert [(t.name, t.data.tobytes()) for t in inside.tensors] == [(t.name, t.data.tobytes()) for t in outside.tensors]


def test_the_tensor_name_map_is_built_once_per_architecture_and_depth_inside_the_block():
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map
    from transformers.models.llama import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    outside = get_gguf_hf_weights_map(model, TensorProcessor())
    built = []
    original = gguf.get_tensor_name_map

    def counting(arch, n_blocks):
        built.append((arch, n_blocks))
        return original(arch, n_blocks)

    gguf.get_tensor_name_map = counting
    try:
        with bundled._one_header_parse():
            assert get_gguf_hf_weights_map(model, TensorProcessor()) == outside  # the same names
            get_gguf_hf_weights_map(model, TensorProcessor())
        assert len(built) == 1, built  # once, for every submodule and both calls (outside: once a submodule)
        assert gguf.get_tensor_name_map is counting  # put back
    finally:
        gguf.get_tensor_name_map = original


def test_the_reader_is_put_back_when_the_block_fails(tmp_path):
    original, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="dequantising failed"):
        with bundled._one_header_parse():
            assert gguf.GGUFReader is not original and gguf.get_tensor_name_map is not original_map
            raise RuntimeError("dequantising failed")
    assert gguf.GGUFReader is original and gguf.get_tensor_name_map is original_map
