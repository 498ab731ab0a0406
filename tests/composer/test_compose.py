"""Composable caches: splice, re-rotation, seam repair and the refusals, on every family.

Invariants, not magic numbers: a block spliced with its jointly computed KV reproduces a full
prefill; re-rotated layer-0 keys of a moved block equal a fresh prefill's (layer 0's keys depend
only on token and position); repairing the whole block is the oracle. Blocks are longer than the
tiny sliding window (16), so Gemma-2/3 and Mistral exercise full KV + masking.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvprobe.datasets.skills import SKILL_KINDS, generate_compose, segments
from kvprobe.datasets.domains import DOMAINS
from kvprobe.errors import KvprobeError
from kvprobe.kv import cache as kvcache
from kvprobe import composer
from kvprobe.composer import gate
from kvprobe.kv.recompute import recompute_positions
from tests.conftest import TINY, ids_of, tiny_model

TOL = 1e-5
WINDOW = 16  # the tiny models' sliding window


def layout(lm, seed: int = 0):
    """(preamble, lead, block1, block2, query) random ids; both blocks longer than the window."""
    ids = ids_of(5 + 7 + 40 + 23 + 6, len(lm.tokenizer), seed)[0].tolist()
    cuts = [0, 5, 12, 52, 75, 81]
    return [ids[a:b] for a, b in zip(cuts, cuts[1:])]


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def assert_caches_close(a, b, tol: float = TOL):
    assert kvcache.seq_len(a) == kvcache.seq_len(b)
    for (ka, va), (kb, vb) in zip(kvcache.to_tensors(a), kvcache.to_tensors(b)):
        assert maxdiff(ka, kb) <= tol and maxdiff(va, vb) <= tol


# -- every family -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_joint_kv_splice_reproduces_full_recompute(name):
    lm = tiny_model(name)
    pre, lead, b1, b2, q = layout(lm)
    ids = pre + lead + b1 + b2 + q
    oracle = composer.oracle_logits(lm, ids)
    _, full = kvcache.prefill(lm.model, torch.tensor(ids))
    B1 = composer.block_from_cache(lm, full, b1, len(pre + lead))
    B2 = composer.block_from_cache(lm, full, b2, len(pre + lead + b1))
    c = composer.compose(lm, [pre + lead, B1, B2, q])
    assert c.ids == ids and kvcache.seq_len(c.cache) == len(ids)  # full KV kept on sliding layers too
    assert maxdiff(c.logits, oracle) <= TOL
    assert_caches_close(c.cache, full)


@pytest.mark.parametrize("name", TINY)
def test_joint_kv_moved_and_rerotated_reproduces_full_recompute(name):
    """Jointly computed KV taken from a prefill at other positions (+50), re-rotated back."""
    lm = tiny_model(name)
    pre, lead, b1, b2, q = layout(lm, seed=1)
    ids = pre + lead + b1 + b2 + q
    shift, p = 50, len(pre + lead)
    _, shifted = kvcache.prefill(lm.model, torch.tensor(ids), start=shift)
    B1 = composer.block_from_cache(lm, shifted, b1, p)
    B1.start = p + shift  # its entries were computed at positions p + shift ..
    c = composer.compose(lm, [pre + lead, B1, b2 + q])
    assert maxdiff(c.logits, composer.oracle_logits(lm, ids)) <= 1e-4  # float32 angles at +50


@pytest.mark.parametrize("name", TINY)
def test_rerotated_layer0_keys_of_a_moved_block_equal_fresh_prefill(name):
    lm = tiny_model(name)
    pre, lead, b1, b2, q = layout(lm)
    block = composer.precompile(lm, b1, pre)
    assert block.start == len(pre) and len(block) == len(b1)
    c = composer.compose(lm, [pre + lead + b2, block, q])  # moved by len(lead + b2)
    _, fresh = kvcache.prefill(lm.model, torch.tensor(pre + lead + b2 + b1 + q))
    lo, hi = c.spans[0][:2]
    slot = lm.adapter.rotated_slot  # the keys; the rotary key part (values slot) under MLA
    got, want = kvcache.get_kv(c.cache, 0)[slot][:, :, lo:hi], kvcache.get_kv(fresh, 0)[slot][:, :, lo:hi]
    assert maxdiff(got, want) <= TOL
    # the control keeps the stored positions: its layer-0 keys are the precompiled ones, unmoved
    control = composer.compose(lm, [pre + lead + b2, block, q], rerotate=False)
    assert torch.equal(kvcache.get_kv(control.cache, 0)[slot][:, :, lo:hi], block.kv[0][slot])
    assert maxdiff(block.kv[0][slot], want) > 100 * TOL  # so the test above can tell


@pytest.mark.parametrize("name", TINY)
def test_whole_block_seam_repair_equals_oracle(name):
    lm = tiny_model(name)
    pre, lead, b1, b2, q = layout(lm)
    ids = pre + lead + b1 + b2 + q
    B1, B2 = composer.precompile(lm, b1, pre), composer.precompile(lm, b2, pre)
    c = composer.compose(lm, [pre + lead, B1, B2, q], seam=max(len(b1), len(b2)))
    _, full = kvcache.prefill(lm.model, torch.tensor(ids))
    assert_caches_close(c.cache, full)
    assert maxdiff(c.logits, composer.oracle_logits(lm, ids)) <= TOL


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-mistral"])
def test_seam_repair_is_recompute_positions_after_the_splice(name):
    lm = tiny_model(name)
    pre, lead, b1, _, _ = layout(lm)
    block, s = composer.precompile(lm, b1, pre), 3
    repaired = composer.Composer(lm)
    repaired.text(pre + lead)
    repaired.block(block, seam=s)
    spliced = composer.Composer(lm)
    spliced.text(pre + lead)
    spliced.block(block, seam=0)
    p = len(pre + lead)
    want = recompute_positions(lm, spliced.cache, spliced.ids, list(range(p, p + s)))
    assert_caches_close(repaired.cache, want)
    assert repaired.ids == spliced.ids


@pytest.mark.parametrize("name", TINY)
def test_fused_single_pass_equals_part_by_part(name):
    lm = tiny_model(name)
    pre, lead, b1, b2, q = layout(lm, seed=2)
    blocks = [composer.precompile(lm, b1, pre), composer.precompile(lm, b2, pre)]
    parts = [pre + lead, blocks[0], q[:2], blocks[1], q[2:]]  # text between the blocks too
    for seam, rot in [(0, True), (4, True), (4, False), (100, True)]:
        a, b = composer.compose(lm, parts, seam, rot), composer.compose_fused(lm, parts, seam, rot)
        assert a.ids == b.ids and a.spans == b.spans
        assert maxdiff(a.logits, b.logits) <= TOL
        assert_caches_close(a.cache, b.cache)
    with pytest.raises(KvprobeError, match="last part"):
        composer.compose_fused(lm, parts[:-1], 0)


def test_seam_repair_moves_toward_the_oracle():
    lm = tiny_model("tiny-llama")
    pre, lead, b1, b2, q = layout(lm)
    oracle = composer.oracle_logits(lm, pre + lead + b1 + b2 + q)
    blocks = [composer.precompile(lm, b, pre) for b in (b1, b2)]
    errs = [maxdiff(composer.compose(lm, [pre + lead, *blocks, q], seam=s).logits, oracle) for s in (0, 8, 23)]
    assert errs[0] > errs[1] > errs[2]


# -- refusals -----------------------------------------------------------------------------------
def test_refuses_model_whose_rope_cannot_be_rerotated():
    lm = tiny_model("tiny-llama")
    bad = dataclasses.replace(lm, info=dataclasses.replace(lm.info, rope_unsupported="unsupported RoPE type 'dynamic'"))
    with pytest.raises(KvprobeError, match="cannot compose.*dynamic"):
        composer.Composer(bad)
    with pytest.raises(KvprobeError, match="cannot compose"):
        composer.precompile(bad, [5, 6, 7])


@pytest.mark.parametrize("name", ["tiny-gemma2", "tiny-gemma3", "tiny-mistral"])
def test_refuses_kv_from_the_models_own_evicting_cache(name):
    lm = tiny_model(name)
    ids = ids_of(40, len(lm.tokenizer))
    own = kvcache.output_cache(lm.model(ids, use_cache=True))  # the model's own cache: evicts on sliding layers
    with pytest.raises(KvprobeError, match="evicting"):
        composer.block_from_cache(lm, own, ids[0].tolist(), 0)
    short = composer.precompile(lm, ids[0].tolist())
    with pytest.raises(KvprobeError, match=r"holds K/V for 15 positions but has 40 tokens.*evicting"):
        composer.Block(short.ids, [(k[:, :, -15:], v[:, :, -15:]) for k, v in short.kv], 0, [], short.config_hash, short.dtype)


def test_refuses_block_of_another_model_and_too_long_contexts():
    llama, qwen = tiny_model("tiny-llama"), tiny_model("tiny-qwen2")
    block = composer.precompile(llama, [5, 6, 7, 8])
    with pytest.raises(KvprobeError, match="another model"):
        composer.compose(qwen, [[5], block])
    with pytest.raises(KvprobeError, match="longer than the model's window of 2048 positions"):
        composer.compose(llama, [[5] * 2046, block])
    with pytest.raises(KvprobeError, match="seam must be >= 0"):
        composer.compose(llama, [[5], block], seam=-1)


# -- the dataset ----------------------------------------------------------------------------------
def test_dataset_is_deterministic_balanced_and_decided_by_its_skills():
    from kvprobe.models.tiny import word_tokenizer

    tok = word_tokenizer()
    a = generate_compose(30, seed=3, tokenizer=tok, block_tokens=(200, 400))
    assert a == generate_compose(30, seed=3, tokenizer=tok, block_tokens=(200, 400))
    assert a != generate_compose(30, seed=4, tokenizer=tok, block_tokens=(200, 400))
    assert {q.kind for q in a.queries} == set(SKILL_KINDS)
    assert abs(sum(q.expected == "yes" for q in a.queries) - 15) <= 1
    assert {len(q.skills) for q in a.queries} <= {1, 2, 3, 4} and max(len(q.skills) for q in a.queries) > 1
    segs = segments(a, tok, "raw")
    assert all(190 <= len(ids) <= 420 for ids in segs.skills.values())
    for q in a.queries:
        assert set(q.decisive) <= set(q.skills) and len(set(q.skills)) == len(q.skills)
        rule_skill = a.skills[q.decisive[0]]
        field = next(f for f in DOMAINS[q.domain].fields if f"if {f.name} is" in rule_skill.text
                     or f"when {f.name} is" in rule_skill.text)
        holder = a.skills[q.decisive[1]].text if q.kind == "passage" else q.query
        value = next(line.split(": ")[1] for line in holder.splitlines() if line.startswith(field.name + ": "))
        assert (value in field.allow) == (q.expected == "yes")
        for other in set(q.skills) - set(q.decisive):  # distractors never gate on the same field
            assert f" {field.name} is" not in a.skills[other].text


def test_dataset_reaches_long_blocks():
    a = generate_compose(4, seed=0, block_tokens=(3000, 4000), n_blocks=(1, 2))
    from kvprobe.datasets.words import words

    assert all(2900 <= len(words(s.text)) <= 4100 for s in a.skills.values())


# -- the validation engine and the CLI gate --------------------------------------------------------
def test_run_compose_rows_and_exact_whole_block_repair():
    lm = tiny_model("tiny-gemma3")
    df = composer.run_compose(lm, n=3, seed=0, seams=[0, 4, 400], block_tokens=(20, 40), n_blocks=(1, 3))
    assert list(df.columns) == list(composer.COLUMNS)
    assert len(df) == 3 * 3 * 2 and df.query_id.nunique() == 3
    whole = df[(df.seam == 400) & df.rerotate]
    assert (whole.cosine > 1 - 1e-6).all() and whole.agree.all()  # seam >= block: the oracle
    summ = composer.summarize_compose(df)
    assert len(summ) == 6 and summ.rerotate.iloc[0]


def test_validate_cli_writes_table_and_gates(tmp_path, monkeypatch):
    from kvprobe.cli.app import app, main
    from kvprobe.cli.validate import GateFailed
    from kvprobe.results import COMPOSE

    args = ["validate", "--model", "tiny-llama", "--n", "2", "--seams", "0,1", "--seam", "1", "--block-tokens",
            "20,30", "--blocks", "1,2"]
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a"), "--threshold", "0"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "a" / COMPOSE).exists() and list((tmp_path / "a" / "blocks").glob("*.safetensors"))
    assert "PASS" in res.output
    assert json.loads((tmp_path / "a" / "compose_manifest.json").read_text())["kvprobe_validate"] == 1  # its version

    real = composer.run_compose
    monkeypatch.setattr(gate, "run_compose", lambda *a, **k: real(*a, **k).assign(agree=True))
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "all"), "--threshold", "0.5"])
    assert isinstance(res.exception, GateFailed) and "FAIL" in res.output  # 2 of 2 agree: the bound is 0.34
    assert "lower bound 0.34 is below the threshold 0.5; all 2 agreeing would need n >= 4" in str(res.exception)
    monkeypatch.setattr(gate, "run_compose", lambda *a, **k: real(*a, **k).assign(agree=False))
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b"), "--threshold", "0.5"])
    assert isinstance(res.exception, GateFailed) and "FAIL" in res.output
    monkeypatch.setattr(sys, "argv", ["kvprobe", *args, "--out", str(tmp_path / "c"), "--threshold", "0.5"])
    with pytest.raises(SystemExit) as exc:  # the console entry point exits 1
        main()
    assert exc.value.code == 1


def test_run_compose_resumes_from_parts_and_stored_blocks(tmp_path, monkeypatch):
    """A finished query is loaded, not recomputed; a missing one is redone from the stored blocks
    and gives the same figures; a stored file holding another block is refused."""
    from kvprobe.results import CaseStore

    lm = tiny_model("tiny-llama")
    kw = dict(n=3, seed=0, seams=[0, 2], block_tokens=(20, 30), n_blocks=(1, 2), store_dir=tmp_path / "blocks")
    parts = CaseStore(tmp_path, "compose")
    first = composer.run_compose(lm, parts=parts, **kw)
    assert len(list(parts.parts.glob("*.parquet"))) == 3

    def boom(*a, **k):
        raise AssertionError("recomputed")

    with monkeypatch.context() as m:  # everything is done: nothing is prefilled again
        m.setattr(gate, "precompile", boom)
        m.setattr(gate, "oracle_logits", boom)
        again = composer.run_compose(lm, parts=parts, **kw)
    pd.testing.assert_frame_equal(again, first)

    victim = first.query_id.iloc[-1]
    (parts.parts / f"{victim}.parquet").unlink()
    with monkeypatch.context() as m:  # the blocks come from the store, only the lost query reruns
        m.setattr(gate, "precompile", boom)
        redone = composer.run_compose(lm, parts=parts, **kw)
    cols = ["query_id", "seam", "rerotate", "agree", "answer", "reference"]
    pd.testing.assert_frame_equal(redone[cols], first[cols])
    assert np.allclose(redone.cosine, first.cosine, atol=1e-6)

    files = sorted((tmp_path / "blocks").glob("*.safetensors"))
    assert len(files) >= 2
    files[1].write_bytes(files[0].read_bytes())  # another skill's block under this skill's name
    with pytest.raises(KvprobeError, match="another block"):
        composer.run_compose(lm, parts=CaseStore(tmp_path / "fresh", "compose"), **kw)


def test_validate_cli_refuses_a_folder_with_other_settings(tmp_path):
    from kvprobe.cli.app import app

    args = ["validate", "--model", "tiny-llama", "--seams", "0", "--seam", "0", "--block-tokens", "20,30",
            "--blocks", "1,1", "--threshold", "0", "--out", str(tmp_path)]
    assert CliRunner().invoke(app, [*args, "--n", "1"]).exit_code == 0
    res = CliRunner().invoke(app, [*args, "--n", "2"])
    assert isinstance(res.exception, KvprobeError) and "other settings" in str(res.exception)
    assert CliRunner().invoke(app, [*args, "--n", "1"]).exit_code == 0  # same settings: resumes (all done)


# -- a real model -----------------------------------------------------------------------------------
@pytest.mark.real
@pytest.mark.slow
def test_real_model_rerotation_moves_keys_and_composes_close_to_recompute():
    """On SmolLM2 the re-rotated layer-0 keys of a moved block match an in-place prefill far better
    than the unmoved control, and composed logits stay close to full recompute. At the logit level
    SmolLM2 barely tells the two apart over short moves (cosine 0.999 either way at n=50), so the
    control comparison is made on the keys, where it is exact."""
    from tests.conftest import real_model

    lm = real_model("smollm2-135m")
    ids = lm.tokenizer("Policy: refunds are allowed within thirty days of delivery.\n" * 6)["input_ids"]
    pre, lead, block_ids, q = ids[:1], ids[1:40], ids[40:120], ids[120:140]
    block = composer.precompile(lm, block_ids, pre)
    moved = composer.compose(lm, [pre + lead, block, q])
    control = composer.compose(lm, [pre + lead, block, q], rerotate=False)
    _, fresh = kvcache.prefill(lm.model, torch.tensor(pre + lead + block_ids + q))
    lo, hi = moved.spans[0][:2]
    want = kvcache.get_kv(fresh, 0)[0][:, :, lo:hi]
    err_moved = maxdiff(kvcache.get_kv(moved.cache, 0)[0][:, :, lo:hi], want)
    err_control = maxdiff(kvcache.get_kv(control.cache, 0)[0][:, :, lo:hi], want)
    assert err_moved <= 1e-3 and err_control > 100 * err_moved, (err_moved, err_control)

    df = composer.run_compose(lm, n=3, seed=0, seams=[0, 4], block_tokens=(80, 120), n_blocks=(2, 3))
    by = df.groupby(["rerotate", "seam"]).cosine.mean()
    assert by[(True, 0)] >= 0.95 and by[(True, 4)] >= 0.95
