"""Toy field-edit models: determinism, the folder round trip, the manifest, held-out evaluation.

Reduced toys (a 2-layer, hidden-32 model trained for a few steps) run in seconds under a
temporary ``KVPROBE_HOME``. The one slow test loads (or trains, ~3 min) the real ``toy-qwen2`` from
the kvprobe cache and checks the behavioural thresholds.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from kvprobe.datasets import generate, render_prompt
from kvprobe.errors import KvprobeError
from kvprobe.models import toy
from kvprobe.models.adapter import Adapter

SMALL_ARCH = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8}
SMALL_TRAIN = toy.ToyTrain(steps=4, batch_size=8, warmup=2)
FAMILIES = ["gemma2", "gemma3", "llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(autouse=True)
def one_thread():
    """On two shared cores one torch thread is steadier than two (training sets its own anyway)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROBE_HOME", str(tmp_path / "kvprobe"))
    return tmp_path / "kvprobe"


def small(family: str, seed: int = 0, save: bool = True, n_eval: int = 0) -> toy.ToyResult:
    return toy.train_toy(family, seed=seed, train=SMALL_TRAIN, arch=SMALL_ARCH, save=save, n_eval=n_eval)


def test_families_and_unknown_family():
    assert toy.toy_families() == FAMILIES
    with pytest.raises(KvprobeError, match="toy-gemma2, toy-gemma3, toy-llama, toy-mistral, toy-qwen2, toy-qwen3"):
        toy.toy_family("toy-gpt2")


def test_same_seed_same_weights(home):
    a, b = small("qwen2", save=False), small("qwen2", save=False)
    assert a.manifest["weights_sha256"] == b.manifest["weights_sha256"]
    assert small("qwen2", seed=1, save=False).manifest["weights_sha256"] != a.manifest["weights_sha256"]


def test_training_prompts_are_deterministic_and_mixed():
    a, b = toy.training_examples(400, seed=3), toy.training_examples(400, seed=3)
    assert a == b
    kinds = {e.kind for e in a}
    assert {"decision", "erratum", "control"} <= kinds
    assert any("[STATE UPDATE]" in e.text and "has just changed" in e.text for e in a)  # the paper's template
    assert any("[STATE UPDATE]" in e.text and "->" in e.text for e in a)  # the short one
    assert {e.answer for e in a} == {"yes", "no"}


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_round_trip(home, family):
    result = small(family)
    assert result.folder == home / "models" / f"toy-{family}"
    assert {"config.json", "model.safetensors", "tokenizer.json", toy.MANIFEST} <= {p.name for p in result.paths}
    assert not [p for p in result.folder.parent.iterdir() if p.name.startswith(".")]  # no temp folders left
    model, tokenizer, note = toy.load_toy(f"toy-{family}")
    assert note.startswith("toy model trained here on the field-edit task")
    loaded, trained = Adapter.for_config(model.config), Adapter.for_config(result.model.config)
    assert loaded.window == trained.window and loaded.sliding_layers() == trained.sliding_layers()
    assert (loaded.window is not None) == (family in ("gemma2", "gemma3", "mistral"))
    case = generate(1, seed=5)[0]
    text = render_prompt(case, None, case.old_value, "raw")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == result.tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits
        want = result.model(torch.tensor([ids])).logits
    assert torch.equal(got, want)


def test_right_padded_batch_matches_unpadded_prefill(home):
    result = small("gemma3", save=False)
    texts = [e.text for e in toy.training_examples(3, seed=9)]
    ids = result.tokenizer(texts, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        batched = toy.decision_logits(result.model, ids)
        for i, x in enumerate(ids):
            alone = result.model(torch.tensor([x])).logits[0, -1]
            torch.testing.assert_close(batched[i], alone, rtol=1e-4, atol=1e-5)


def test_manifest_and_load_model(home):
    from kvprobe.models import load_model

    result = small("mistral", seed=2, n_eval=16)
    manifest = json.loads((result.folder / toy.MANIFEST).read_text())
    for key in ("seed", "data", "train", "arch", "train_wall_s", "heldout", "weights_sha256", "loss_curve"):
        assert key in manifest
    assert manifest["seed"] == 2 and manifest["train"]["steps"] == SMALL_TRAIN.steps
    assert manifest["data"]["fillers"] == list(toy.ToyData().fillers)
    assert set(toy.METRICS) <= set(manifest["heldout"])
    lm = load_model("toy-mistral")
    assert lm.info.source == "toy" and lm.info.family == "mistral"
    assert manifest["weights_sha256"].startswith(lm.weights_hash())
    assert lm.adapter.window == toy.WINDOW and all(lm.adapter.sliding_layers())


def test_corrupt_weights_are_refused(home):
    result = small("llama")
    manifest = json.loads((result.folder / toy.MANIFEST).read_text())
    manifest["weights_sha256"] = "0" * 64
    (result.folder / toy.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(KvprobeError, match="--force"):
        toy.load_toy("toy-llama")


def test_load_trains_on_first_use(home, monkeypatch):
    monkeypatch.setattr(toy, "train_toy", functools.partial(toy.train_toy, train=SMALL_TRAIN, arch=SMALL_ARCH, n_eval=0))
    said = []
    model, _, _ = toy.load_toy("toy-qwen3", progress=said.append)
    assert (home / "models" / "toy-qwen3" / toy.MANIFEST).exists()
    assert any("first use" in s for s in said)
    assert model.config.hidden_size == SMALL_ARCH["hidden_size"]


def test_evaluation_returns_every_metric(home):
    result = small("qwen2", save=False)
    metrics = toy.evaluate_toy(result.model, result.tokenizer, n=24, n_unseen=8)
    assert set(toy.METRICS) <= set(metrics)
    assert all(0.0 <= metrics[k] <= 1.0 for k in toy.METRICS if k != "acc_long")
    assert metrics["n_long"] == 0 or 0.0 <= metrics["acc_long"] <= 1.0
    assert metrics["n_decision"] == 18 and metrics["n_control"] == 6 and metrics["n_unseen"] == 8
    assert metrics["n_added"] > 0 and metrics["n_removed"] > 0
    assert isinstance(toy.threshold_failures(metrics), list)


def test_unseen_domains_use_known_words_only():
    from kvprobe.datasets import DOMAINS
    from kvprobe.models.tiny import word_tokenizer

    tok = word_tokenizer()
    seen = {v for d in DOMAINS.values() for f in d.fields for v in (f.name, *f.allow, *f.deny)}
    for case in toy.unseen_cases(8, seed=1, fillers=(0, 9)):
        text = render_prompt(case, None, case.new_value, "raw")
        assert tok.unk_token_id not in tok(text, add_special_tokens=False)["input_ids"]
        assert case.field not in seen and case.old_value not in seen and case.new_value not in seen


def test_toy_rows(home):
    rows = toy.toy_rows()
    assert [r[0] for r in rows] == [f"toy-{f}" for f in FAMILIES]
    assert all(len(r) == 6 and r[3] == "-" and r[4].startswith("no") for r in rows)
    small("gemma2")
    assert dict((r[0], r[4]) for r in toy.toy_rows())["toy-gemma2"] == "yes"


def test_cli_train_and_eval(home, monkeypatch):
    from typer.testing import CliRunner

    from kvprobe.cli.app import app

    monkeypatch.setattr(toy, "train_toy", functools.partial(toy.train_toy, arch=SMALL_ARCH, n_eval=16))
    runner = CliRunner()
    out = runner.invoke(app, ["toy", "train", "--family", "llama", "--steps", "2"])
    assert out.exit_code == 0, out.output
    assert "acc_erratum" in out.output and (home / "models" / "toy-llama" / toy.MANIFEST).exists()
    out = runner.invoke(app, ["toy", "train", "--family", "llama"])
    assert out.exit_code == 0 and "already trained" in out.output
    out = runner.invoke(app, ["toy", "eval", "--family", "llama", "--n", "12"])
    assert out.exit_code == 0, out.output
    assert "inv_control_removed" in out.output
    out = runner.invoke(app, ["toy", "train", "--family", "gpt2"])
    assert out.exit_code != 0 and isinstance(out.exception, KvprobeError)


# -- the real toy ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def toy_qwen2():
    from kvprobe.models import load_model

    return load_model("toy-qwen2")  # trains into the kvprobe cache on first use (~3 min)


@pytest.mark.slow
def test_toy_qwen2_decides_by_the_field(toy_qwen2):
    metrics = toy.evaluate_toy(toy_qwen2)  # the held-out set of the manifest, on the reloaded folder
    assert toy.threshold_failures(metrics) == [], metrics
    heldout = toy.read_manifest("qwen2")["heldout"]
    assert {k: metrics[k] for k in toy.METRICS} == pytest.approx({k: heldout[k] for k in toy.METRICS}, abs=0.01)
