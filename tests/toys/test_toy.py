"""Toy field-edit models: determinism, the folder round trip, the manifest, held-out evaluation,
the shipped toys, and the refusal of a toy that failed its own check.

Reduced toys (a 2-layer, hidden-32 model trained for a few steps) run in seconds under a
temporary ``KVPROBE_HOME``. The slow tests evaluate the six shipped toys against their manifests
(about 15 s each) and run the first 76 steps of toy-qwen2's recipe against its manifest's loss curve.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

from kvprobe.datasets import generate, render_prompt
from kvprobe.errors import KvprobeError
from kvprobe.models import fingerprint, toy_folder
from kvprobe.models.adapter import Adapter
from kvprobe.toys import examples as toy_data
from kvprobe.toys import evaluate as toy_eval
from kvprobe.toys import train as toy_train

SMALL_ARCH = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8}
SMALL_TRAIN = toy_train.ToyTrain(steps=4, batch_size=8, warmup=2)
FAMILIES = toy_folder.toy_families()


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


def small(family: str, seed: int = 0, save: bool = True, n_eval: int = 0) -> toy_train.ToyResult:
    return toy_train.train_toy(family, seed=seed, train=SMALL_TRAIN, arch=SMALL_ARCH, save=save, n_eval=n_eval)


def test_families_and_unknown_family():
    assert FAMILIES == ["gemma2", "gemma3", "llama", "mistral", "qwen2", "qwen3"]
    with pytest.raises(KvprobeError, match="toy-gemma2, toy-gemma3, toy-llama, toy-mistral, toy-qwen2, toy-qwen3"):
        toy_folder.toy_family("toy-gpt2")


def test_same_seed_same_weights(home):
    a, b = small("qwen2", save=False), small("qwen2", save=False)
    assert a.manifest["weights_sha256"] == b.manifest["weights_sha256"]
    assert small("qwen2", seed=1, save=False).manifest["weights_sha256"] != a.manifest["weights_sha256"]


def test_training_prompts_are_deterministic_and_mixed():
    a, b = toy_data.training_examples(400, seed=3), toy_data.training_examples(400, seed=3)
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
    assert {"config.json", "model.safetensors", "tokenizer.json", toy_folder.TOY_MANIFEST} <= {p.name
                                                                                              for p in result.paths}
    assert not [p for p in result.folder.parent.iterdir() if p.name.startswith(".")]  # no temp folders left
    model, tokenizer, note = toy_folder.load_toy_folder(result.folder)
    assert note.startswith("toy model trained on the field-edit task")
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
    texts = [e.text for e in toy_data.training_examples(3, seed=9)]
    ids = result.tokenizer(texts, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        batched = toy_eval.decision_logits(result.model, ids)
        for i, x in enumerate(ids):
            alone = result.model(torch.tensor([x])).logits[0, -1]
            torch.testing.assert_close(batched[i], alone, rtol=1e-4, atol=1e-5)


def test_manifest_and_load_model(home):
    from kvprobe.models import load_model

    result = small("mistral", seed=2, n_eval=16)
    manifest = json.loads((result.folder / toy_folder.TOY_MANIFEST).read_text())
    for key in ("seed", "data", "train", "arch", "train_wall_s", "heldout", "weights_sha256", "loss_curve"):
        assert key in manifest
    assert manifest["seed"] == 2 and manifest["train"]["steps"] == SMALL_TRAIN.steps
    assert manifest["data"]["fillers"] == list(toy_data.ToyData().fillers)
    assert set(toy_eval.METRICS) <= set(manifest["heldout"])
    assert manifest["machine"]["cpu"] and manifest["machine"]["cores"] >= 1
    # 4 steps: it fails its check, the manifest says so honestly, and kvprobe loads it only when asked
    assert manifest["heldout_failures"] == toy_eval.threshold_failures(manifest["heldout"]) != []
    with pytest.raises(KvprobeError, match="failed its own held-out check"):
        load_model(str(result.folder))
    lm = load_model(str(result.folder), allow_failed_toy=True)
    assert lm.info.source == "toy" and lm.info.family == "mistral"
    assert manifest["weights_sha256"].startswith(lm.weights_hash())
    assert lm.adapter.window == toy_folder.toy_arch("mistral")["sliding_window"] and all(lm.adapter.sliding_layers())


def test_corrupt_weights_are_refused(home):
    result = small("llama")
    manifest = json.loads((result.folder / toy_folder.TOY_MANIFEST).read_text())
    manifest["weights_sha256"] = "0" * 64
    (result.folder / toy_folder.TOY_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(KvprobeError, match="--force"):
        toy_folder.load_toy_folder(result.folder)


@pytest.mark.parametrize("damage", ["manifest", "weights"])
def test_corrupt_toy_files_are_one_line_errors(home, damage):
    result = small("qwen3")
    if damage == "manifest":
        (result.folder / toy_folder.TOY_MANIFEST).write_text("{not json")
    else:
        weights = result.folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(KvprobeError, match="retrain"):
        toy_folder.load_toy_folder(result.folder)


def failed_toy(folder, failures=("acc_new 0.967 < 0.98",)):
    manifest = json.loads((folder / toy_folder.TOY_MANIFEST).read_text())
    manifest["heldout_failures"] = list(failures)
    (folder / toy_folder.TOY_MANIFEST).write_text(json.dumps(manifest))
    return folder


def test_a_toy_that_failed_its_check_is_refused_unless_asked(home):
    from kvprobe.models import load_model

    folder = failed_toy(small("qwen2").folder)
    with pytest.raises(KvprobeError, match=r"acc_new 0.967 < 0.98.*kvprobe toy train.*--allow-failed-toy"):
        load_model(str(folder))
    lm = load_model(str(folder), allow_failed_toy=True)
    assert "FAILED acc_new 0.967 < 0.98" in lm.info.note


def test_kvprobe_run_refuses_a_toy_that_failed_its_check(home, tmp_path):
    from typer.testing import CliRunner

    from kvprobe.cli.app import app

    folder = failed_toy(small("qwen2").folder)
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", "--model", str(folder), "--n", "2", "--out", str(out)])
    assert res.exit_code != 0 and isinstance(res.exception, KvprobeError), res.output
    assert "failed its own held-out check" in str(res.exception) and "--allow-failed-toy" in str(res.exception)
    assert not out.exists()  # refused before the folder was claimed
    res = CliRunner().invoke(app, ["run", "--model", str(folder), "--n", "2", "--probes", "locality",
                                   "--strategies", "stale,oracle", "--all-cases", "--no-report", "--out", str(out),
                                   "--allow-failed-toy"])
    assert res.exit_code == 0, res.output


def test_the_shipped_toys_are_all_there_and_checked():
    for family in FAMILIES:
        manifest = toy_folder.read_manifest(toy_folder.shipped_dir(family))
        assert manifest["family"] == family and manifest["seed"] == toy_folder.TOY_SEED
        assert manifest["heldout_failures"] == [] and toy_eval.threshold_failures(manifest["heldout"]) == []
        as_json = lambda obj: json.loads(json.dumps(dataclasses.asdict(obj)))  # noqa: E731
        assert manifest["train"] == as_json(toy_train.toy_recipe(family))  # shipped = today's recipe
        assert manifest["data"] == as_json(toy_data.ToyData())


def test_evaluation_returns_every_metric(home):
    result = small("qwen2", save=False)
    metrics = toy_eval.evaluate_toy(result.model, result.tokenizer, n=24, n_unseen=8)
    assert set(toy_eval.METRICS) <= set(metrics)
    assert all(0.0 <= metrics[k] <= 1.0 for k in toy_eval.METRICS if k != "acc_long")
    assert metrics["n_long"] == 0 or 0.0 <= metrics["acc_long"] <= 1.0
    assert metrics["n_decision"] == 18 and metrics["n_control"] == 6 and metrics["n_unseen"] == 8
    assert metrics["n_added"] > 0 and metrics["n_removed"] > 0
    assert isinstance(toy_eval.threshold_failures(metrics), list)


def test_a_repeated_prompt_is_computed_once_and_answered_alike(home):
    result = small("qwen2", save=False)
    texts = [render_prompt(c, None, c.old_value, "raw") for c in generate(5, seed=3)]
    rows = []
    hook = result.model.register_forward_pre_hook(lambda mod, args, kw: rows.append(kw["input_ids"].shape[0]),
                                                  with_kwargs=True)
    try:
        alone = toy_eval.predict(result.model, result.tokenizer, texts)
        rows.clear()
        repeated = toy_eval.predict(result.model, result.tokenizer, [texts[2], *texts, texts[0], texts[2]])
    finally:
        hook.remove()
    assert sum(rows) == len(texts)
    assert repeated == [alone[2], *alone, alone[0], alone[2]]


def test_unseen_domains_use_known_words_only():
    from kvprobe.datasets import DOMAINS
    from kvprobe.models.tiny import word_tokenizer

    tok = word_tokenizer()
    seen = {v for d in DOMAINS.values() for f in d.fields for v in (f.name, *f.allow, *f.deny)}
    for case in toy_data.unseen_cases(8, seed=1, fillers=(0, 9)):
        text = render_prompt(case, None, case.new_value, "raw")
        assert tok.unk_token_id not in tok(text, add_special_tokens=False)["input_ids"]
        assert case.field not in seen and case.old_value not in seen and case.new_value not in seen


def test_toy_rows(home):
    rows = toy_folder.toy_rows()
    assert [r[0] for r in rows] == [f"toy-{f}" for f in FAMILIES]
    assert all(len(r) == 6 and r[3] == "-" and r[4] == "shipped" and r[2] == "0.8M" for r in rows)


def test_cli_train_and_eval(home, monkeypatch):
    from typer.testing import CliRunner

    from kvprobe.cli.app import app

    monkeypatch.setattr(toy_train, "train_toy", functools.partial(toy_train.train_toy, arch=SMALL_ARCH, n_eval=16))
    runner = CliRunner()
    folder = home / "models" / "toy-llama"
    out = runner.invoke(app, ["toy", "train", "--family", "llama", "--steps", "2"])
    assert out.exit_code == 0, out.output
    assert "acc_erratum" in out.output and (folder / toy_folder.TOY_MANIFEST).exists()
    assert "retrained against shipped" in out.output and "weights different from the shipped toy's" in out.output
    assert f"use it with --model {folder}" in out.output.replace("\n", "")
    out = runner.invoke(app, ["toy", "train", "--family", "llama"])
    assert out.exit_code == 0 and "already holds" in out.output
    out = runner.invoke(app, ["toy", "eval", "--folder", str(folder), "--n", "12", "--allow-failed-toy"])
    assert out.exit_code == 0, out.output
    assert "inv_control_removed" in out.output
    out = runner.invoke(app, ["toy", "train", "--family", "gpt2"])
    assert out.exit_code != 0 and isinstance(out.exception, KvprobeError)
    out = runner.invoke(app, ["toy", "eval", "--family", "llama", "--folder", str(folder)])
    assert out.exit_code != 0 and "exactly one of --family" in str(out.exception)


# -- the shipped toys ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_shipped_toy_is_what_its_manifest_says(family):
    """The shipped weights hash to the manifest's sha256 (load_model refuses otherwise), and the
    held-out evaluation, rerun here on the manifest's own held-out set, gives its figures. On
    another CPU type a float32 forward can flip a near-tie, so figures may move by up to 0.01
    (3 of the 300 decision prompts)."""
    from kvprobe.models import load_model

    lm = load_model(f"toy-{family}")
    manifest = toy_folder.read_manifest(toy_folder.shipped_dir(family))
    assert fingerprint.weights_sha256(lm.model) == manifest["weights_sha256"]
    assert lm.info.source == "toy" and "shipped with kvprobe" in lm.info.note
    h = manifest["heldout"]
    metrics = toy_eval.evaluate_toy(lm, n=h["n"], n_unseen=max(20, h["n"] // 4), fillers=tuple(h["fillers"]))
    assert toy_eval.threshold_failures(metrics) == [], metrics
    assert {k: metrics[k] for k in toy_eval.METRICS} == pytest.approx({k: h[k] for k in toy_eval.METRICS}, abs=0.01)


# The shipped toy-qwen2 was trained on a Zen 3; its manifest's loss curve (an exponential average,
# stored to 5 decimals every 25 steps) is the reference. Measured on a Zen 4 on one thread (the
# recipe's) and on two (another summation order): steps 0-75 equal the Zen 3's to the last stored
# decimal; from step 100 a loss spike amplifies float noise (2e-4 relative at 100, 25-60% by 150-175),
# so the comparison stops at 75. CURVE_ATOL is two units of the last decimal (a value sitting on a
# rounding boundary may round either way). A deliberate change moves step 75 by 30x that or more:
# final_lr_frac 0.05 -> 0.1 by 6.3e-4, weight decay 0.01 -> 0.02 by 1.0e-3, lr 1% higher by 0.17.
PREFIX_STEPS = 76
CURVE_ATOL = 2e-5


def prefix_curve(family: str, steps: int = PREFIX_STEPS, **change) -> dict[int, float]:
    recipe = dataclasses.replace(toy_train.toy_recipe(family), **change)
    result = toy_train.train_toy(family, train=recipe, save=False, n_eval=0, stop_after=steps)
    assert result.manifest["stopped_after"] == steps
    return {step: loss for step, loss in result.manifest["loss_curve"] if step % 25 == 0}


@pytest.mark.parametrize("stop_after, save", [(10, True), (0, False)])
def test_a_partial_recipe_is_never_saved_and_runs_a_step_at_least(stop_after, save):
    with pytest.raises(ValueError, match=f"got stop_after={stop_after}, save={save}"):
        toy_train.train_toy("qwen2", save=save, n_eval=0, stop_after=stop_after)


@pytest.mark.slow
def test_the_recipe_starts_as_the_shipped_toy_qwen2_did():
    """toy-qwen2's recipe (seed 0, its data, batches, initialisation, optimiser and schedule), run for
    its first 76 steps here, on the recipe's one thread and on two, gives the shipped manifest's loss
    curve within CURVE_ATOL on any CPU; a recipe changed by a little does not. (This stands for the
    full 800-step retrain, which took 3.5 minutes of the suite: its weights are bit-identical to the
    shipped toy only on the CPU type that trained it, and `kvprobe toy train --family qwen2` still
    does it, comparing with the shipped toy.)"""
    shipped = toy_folder.read_manifest(toy_folder.shipped_dir("qwen2"))
    want = {step: loss for step, loss in shipped["loss_curve"] if step < PREFIX_STEPS}
    assert sorted(want) == [0, 25, 50, 75]
    for threads in (1, 2):
        got = prefix_curve("qwen2", threads=threads)
        assert got == pytest.approx(want, abs=CURVE_ATOL, rel=0), (threads, got, want)
    changed = prefix_curve("qwen2", steps=26, lr=1.01 * shipped["train"]["lr"])  # 1% more: 0.012 at step 25
    assert changed[0] == want[0] and abs(changed[25] - want[25]) > 100 * CURVE_ATOL, changed
