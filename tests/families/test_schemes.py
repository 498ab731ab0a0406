"""Attention and position schemes (issue 32): per tiny model, a field edit recomputed downstream, a
block moved by 128 positions and a repaired seam against a fresh prefill (scripts/scheme_table.py,
the table of docs/architectures.md); the re-rotation made wrong on purpose fails where the scheme
is not plain RoPE; and the schemes kvprobe has no verified path for are refused in one line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers

from kvprobe.models import tiny_names
from kvprobe.models.tiny import word_tokenizer
from tests import cli_process
from tests.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("scheme_table", ROOT / "scripts" / "scheme_table.py")
scheme_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scheme_table)

NOT_PLAIN = ("tiny-stablelm", "tiny-llama3", "tiny-llama-yarn")  # partial, llama3-scaled and YaRN RoPE


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    return {name: scheme_table.checks(tiny_model(name)) for name in tiny_names()}


def test_the_new_schemes_are_tiny_models():
    names = tiny_names()
    assert {"tiny-qwen3_moe", "tiny-stablelm", "tiny-llama3", "tiny-llama-yarn", "tiny-deepseek_v3"} <= set(names)
    assert "MLA: latent 16 + rotary part 8 cached" in scheme_table.scheme(tiny_model("tiny-deepseek_v3"))
    lm = tiny_model("tiny-qwen3_moe")
    assert lm.model.config.num_experts == 4 and "mixture of experts" in scheme_table.scheme(lm)
    assert "4/16 dims rotate" in scheme_table.scheme(tiny_model("tiny-stablelm"))
    assert scheme_table.scheme(tiny_model("tiny-llama-yarn")).startswith("RoPE yarn")


@pytest.mark.parametrize("name", tiny_names())
def test_edit_moved_block_and_seam_equal_a_fresh_prefill(rows, name):
    r = rows[name]
    assert r["edit"] <= scheme_table.TOL_EDIT and r["moved"] <= scheme_table.TOL_MOVED and \
        r["seam"] <= scheme_table.TOL_SEAM, r


@pytest.mark.parametrize("name", NOT_PLAIN)
def test_plain_rope_on_a_scheme_that_is_not_plain_fails_by_a_wide_margin(rows, name):
    """Rotating every dim (partial RoPE) or ignoring the scaling (llama3, YaRN) is at least 10 times
    the tolerance off, and more than 1000 times the correct re-rotation's error: the check can fail."""
    r = rows[name]
    assert r["plain"] > 10 * scheme_table.TOL_MOVED and r["plain"] > 1000 * r["moved"], r


def test_plain_rope_is_the_rope_of_the_plain_families(rows):
    for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3_moe"):
        assert rows[name]["plain"] <= scheme_table.TOL_MOVED, rows[name]


def test_the_table_renders_every_model(rows):
    lines = scheme_table.table(list(rows.values()))
    assert len(lines) == 2 + len(tiny_names()) and all(line.count("|") == 8 for line in lines)
    doc = (ROOT / "docs" / "architectures.md").read_text()
    assert scheme_table.BEGIN in doc and scheme_table.END in doc
    for name in tiny_names():
        assert f"| {name} |" in doc, f"docs/architectures.md's table lacks {name}: run scripts/scheme_table.py --doc"


# -- refused: one line, exit 3 ---------------------------------------------------------------------------------
def _folder(path: Path, config, cls) -> Path:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        cls(config).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def unsupported(tmp_path_factory) -> dict[str, Path]:
    base, vocab = tmp_path_factory.mktemp("schemes"), len(word_tokenizer())
    small = {"vocab_size": vocab, "num_hidden_layers": 2, "max_position_embeddings": 512}
    return {
        "alibi": _folder(base / "bloom", transformers.BloomConfig(vocab_size=vocab, hidden_size=32, n_layer=2,
                                                                  n_head=4), transformers.BloomForCausalLM),
        "mla-v2": _folder(base / "deepseek-v2", transformers.DeepseekV2Config(
            **small, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16,
            q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1),
            transformers.DeepseekV2ForCausalLM),
        "dynamic": _folder(base / "dynamic", transformers.LlamaConfig(
            **small, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
            transformers.LlamaForCausalLM),
    }


@pytest.mark.parametrize("scheme, command, text", [
    ("alibi", "run", "unsupported architecture 'bloom': ALiBi position biases"),
    ("mla-v2", "run", "unsupported architecture 'deepseek_v2': multi-head latent attention (MLA) of a variant"),
    ("dynamic", "validate", "unsupported RoPE type 'dynamic'"),
])
def test_a_scheme_without_a_verified_path_is_refused_in_one_line(unsupported, tmp_path, scheme, command, text):
    out = tmp_path / "out"
    proc = cli_process.run(command, "--model", unsupported[scheme], "--n", "2", "--out", out)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith(("validity", "loading"))]
    assert proc.returncode == 3 and len(lines) == 1 and text in lines[0], (proc.returncode, proc.stderr[-2000:])
    assert not out.exists()


def test_a_block_of_another_position_scheme_is_refused(tmp_path):
    """A block file records the RoPE parameters its keys were rotated with: one precompiled on
    tiny-llama3 does not splice into a model of another scheme (plain llama, same shapes)."""
    from kvprobe import composer
    from kvprobe.composer.store import SUFFIX, load_block, save_block
    from kvprobe.errors import KvprobeError

    src, other = tiny_model("tiny-llama3"), tiny_model("tiny-llama")
    block = composer.precompile(src, list(range(10, 30)), [4, 5, 6])
    path = save_block(block, src, tmp_path / f"b{SUFFIX}")
    with pytest.raises(KvprobeError) as err:
        load_block(path, other)
    assert "\n" not in str(err.value)


def test_mla_rerotating_the_latent_instead_of_the_rotary_part_fails(monkeypatch, rows):
    """Multi-head latent attention stores its rotated key part in the values slot: a re-rotation that
    turns the keys slot (the position-free latent), as for every other family, is far off."""
    from kvprobe.models.adapter import Adapter

    lm = tiny_model("tiny-deepseek_v3")
    assert lm.adapter.rotated_slot == 1 and rows["tiny-deepseek_v3"]["moved"] <= scheme_table.TOL_MOVED
    monkeypatch.setattr(Adapter, "rotated_slot", property(lambda self: 0))
    wrong = scheme_table._moved(lm)
    assert wrong > 10 * scheme_table.TOL_MOVED, wrong


@pytest.mark.parametrize("model", ["tiny-deepseek_v3", "tiny-qwen3_moe"])
def test_kvprobe_run_end_to_end_on_mla_and_moe(tmp_path, model):
    """Every probe and strategy runs (random weights decide nothing: --all-cases, mechanics only)."""
    out = tmp_path / "run"
    proc = cli_process.run("run", "--model", model, "--n", "4", "--all-cases", "--no-report", "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for table in ("validity", "locality", "attention", "knockout", "linear", "edits"):
        assert (out / f"{table}.parquet").exists(), table


def test_a_sliding_window_the_family_file_does_not_declare_is_refused(tmp_path):
    """Starcoder2 slides over a window; a family file of the user's that leaves `sliding:` out would
    let kvprobe's masks attend past it. Refused at load, one line, exit 3."""
    import os

    folder = _folder(tmp_path / "sc2", transformers.Starcoder2Config(
        vocab_size=len(word_tokenizer()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=16),
        transformers.Starcoder2ForCausalLM)
    fams = tmp_path / "families"
    fams.mkdir()
    text = (ROOT / "src/kvprobe/models/families/llama.yaml").read_text()
    text = text.replace("family: llama", "family: starcoder2")
    text = text.replace("model_types: [llama]", "model_types: [starcoder2]")
    text = text.replace("LlamaForCausalLM", "Starcoder2ForCausalLM").replace("LlamaConfig", "Starcoder2Config")
    text = text.replace("toy: {}", "")
    (fams / "starcoder2.yaml").write_text(text)
    out = tmp_path / "out"
    proc = cli_process.run("run", "--model", folder, "--n", "2", "--out", out,
                           env={**os.environ, "KVPROBE_FAMILY_PATH": str(fams)})
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 3 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert "sets a sliding window of 16 tokens that the family file of 'starcoder2' does not declare" in lines[0]
    assert not out.exists()


def test_the_image_block_row_equals_the_models_own_multimodal_prefill_and_placing_by_tokens_fails():
    """scripts/scheme_table.py's image block row (tiny-qwen2_vl, M-RoPE): a text field edit after
    the image, an image block moved by 128 positions and image blocks with a repaired seam, each
    against the model's own full multimodal prefill, within the same tolerances; the text after the
    image placed by token count (1-D RoPE's view) at least ten times the tolerance off."""
    r = scheme_table.image_checks(tiny_model("tiny-qwen2_vl"))
    assert r["edit"] <= scheme_table.TOL_EDIT and r["moved"] <= scheme_table.TOL_MOVED and \
        r["seam"] <= scheme_table.TOL_SEAM, r
    assert r["plain"] > 10 * scheme_table.TOL_MOVED and r["plain"] > 1000 * r["moved"], r
