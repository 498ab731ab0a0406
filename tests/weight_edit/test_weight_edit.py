"""kvprobe weight-edit: a LoRA edit per decision case (peft) beside the KV repairs. Mechanics on a toy
and a tiny model (the adapter flips the target's decision; the base weights come back bit for bit;
contamination counts what changed), resume and claim, the command end to end, and its bad inputs."""

from __future__ import annotations

import functools
import json
import sys

import jsonschema
import pandas as pd
import pytest
import torch

from kvprobe.config import RunConfig, load_cases
from kvprobe.editor.runner import align_all
from kvprobe.editor.strategies import parse_strategy
from kvprobe.errors import EnvironmentProblem, UsageError
from kvprobe.executor import Serial
from kvprobe.models.fingerprint import weights_sha256
from kvprobe.reports.summary import schema as summary_schema
from kvprobe.results import CaseStore
from kvprobe.weight_edit import (LoraSettings, decisions, fit, lora_adapter, require_peft, run_weight_edits,
                                 weight_edit_case)
from kvprobe.weight_edit.lora import answer_token, prompt_logits
from kvprobe.weight_edit.runner import prompts
from tests import cli_process
from tests.cli.test_conventions import error_line, kvprobe, snapshot
from tests.conftest import tiny_model

FAST = LoraSettings(rank=4, steps=20)


@functools.cache
def toy():
    return tiny_model("toy-qwen2")


@functools.cache
def toy_cases(n: int = 8):
    lm = toy()
    aligned, _ = align_all(lm, load_cases(RunConfig(n=n, probes=[])), "auto")
    return aligned


def state(lm) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in lm.model.state_dict().items()}


def valid_decision_case():
    """The first generated case toy-qwen2 answers correctly under both values (stale old, oracle new)."""
    lm = toy()
    for a in toy_cases():
        if a.case.control:
            continue
        old = decisions(lm, prompts(a))
        if old == [a.case.expected_old, a.case.expected_new]:
            return a
    pytest.fail("toy-qwen2 answers none of 8 generated cases under both values")


def test_the_adapter_flips_the_target_decision_and_the_weights_come_back_bit_for_bit():
    lm, a = toy(), valid_decision_case()
    before, grad = state(lm), {n: p.requires_grad for n, p in lm.model.named_parameters()}
    modules = {n: type(m) for n, m in lm.model.named_modules()}
    df = weight_edit_case(lm, a, [parse_strategy("stale"), parse_strategy("erratum")], FAST, model_name="toy-qwen2")
    rows = df.set_index("strategy")
    assert list(rows.index) == ["stale", "erratum", "lora:r4"]
    assert not rows.loc["stale", "agree"]  # the stale prompt gives the old answer ...
    lora = rows.loc["lora:r4"]
    assert lora["agree"] and lora["reached"] and lora["pred"] == a.case.expected_new  # ... the adapter the new one
    assert 1 <= lora["steps"] <= FAST.steps and lora["method"] == "lora" and lora["setup_s"] > 0
    assert rows.loc["erratum", "contamination_basis"] == "by construction" and rows.loc["erratum", "contamination"] == 0
    after = state(lm)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert {n: type(m) for n, m in lm.model.named_modules()} == modules
    assert {n: p.requires_grad for n, p in lm.model.named_parameters()} == grad
    assert weights_sha256(lm.model)[:16] == lm.fingerprint()["weights_hash"]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_a_tiny_model_is_restored_even_when_the_fit_fails_midway(name):
    lm = tiny_model(name)
    before = state(lm)
    ids = list(range(5, 17))
    base = prompt_logits(lm, ids).detach()
    with pytest.raises(RuntimeError, match="midway"):
        with lora_adapter(lm, LoraSettings(rank=2, steps=3, lr=0.5)) as (wrapped, _):
            opt = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.5)
            for _ in range(3):  # B starts at zero: a few steps move the logits
                loss = prompt_logits(lm, ids).logsumexp(-1) - prompt_logits(lm, ids)[7]
                opt.zero_grad()
                loss.backward()
                opt.step()
            assert not torch.allclose(prompt_logits(lm, ids).detach(), base)  # the adapter acts
            raise RuntimeError("midway")
    after = state(lm)
    assert all(torch.equal(before[k], after[k]) for k in before) and before.keys() == after.keys()
    assert torch.equal(prompt_logits(lm, ids).detach(), base)


def test_contamination_counts_the_other_decisions_that_changed():
    """Recounted by hand with the same seeded adapter: the target's own old prompt is among the others,
    so at least that decision changes; base decisions given equal to the adapted ones count 0, and
    two of them flipped count 2."""
    lm, a = toy(), valid_decision_case()
    others = [a, *[o for o in toy_cases() if o.case.case_id != a.case.case_id][:2]]
    other_prompts = [p for o in others for p in prompts(o)]
    base = decisions(lm, other_prompts)
    target = a.case.expected_new
    oracle = prompt_logits(lm, a.ids_new[: a.decision_pos + 1]).detach()
    with lora_adapter(lm, FAST) as (wrapped, _):
        f = fit(lm, wrapped, a.ids_old[: a.decision_pos + 1], a.option_ids, a.case.options, target,
                answer_token(oracle, a.option_ids, target), FAST)
        adapted = decisions(lm, other_prompts)
    assert f.reached and adapted[0] == target != base[0]
    expected = sum(x != y for x, y in zip(base, adapted))

    def lora_row(base_decisions):
        df = weight_edit_case(lm, a, [], FAST, others, base_decisions)
        return df[df.method == "lora"].iloc[0]

    row = lora_row(None)
    assert (row.contamination_changed, row.contamination_n) == (expected, 6) and row.contamination == expected / 6
    assert lora_row(adapted).contamination_changed == 0
    flipped = [next(o for o in a.case.options if o != d) if i in (1, 4) else d for i, d in enumerate(adapted)]
    assert lora_row(flipped).contamination_changed == 2


def test_a_resume_recomputes_nothing(tmp_path):
    lm = toy()
    cases = load_cases(RunConfig(n=3, probes=[]))
    store, first = CaseStore(tmp_path, "weight_edits"), Serial()
    df1, _ = run_weight_edits(lm, cases, ["stale", "oracle"], FAST, 2, store=store, executor=first)
    again = Serial()
    df2, _ = run_weight_edits(lm, cases, ["stale", "oracle"], FAST, 2, store=store, executor=again)
    assert first.computed == 3 and again.computed == 0
    same = [df.astype(object).where(df.notna(), None).reset_index(drop=True) for df in (df1, df2)]
    pd.testing.assert_frame_equal(*same, check_dtype=False)


def test_bad_settings_and_a_missing_peft_are_one_line(monkeypatch):
    for kwargs, text in (({"rank": 0}, "--lora-rank 0"), ({"steps": 0}, "--steps 0"), ({"lr": 0.0}, "--lr 0"),
                         ({"targets": ("q", "gate")}, "--lora-targets q,gate")):
        with pytest.raises(UsageError, match=text):
            LoraSettings(**kwargs)
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(EnvironmentProblem, match=r"kvprobe\[weight-edit\]"):
        require_peft()


# -- the command ----------------------------------------------------------------------------------

def test_weight_edit_end_to_end_resumes_and_refuses_other_settings(tmp_path):
    out = tmp_path / "W"
    args = ("weight-edit", "--model", "toy-qwen2", "--n", "4", "--steps", "20", "--contamination-cases", "2",
            "--strategies", "stale,erratum,oracle", "--out", out)
    proc = kvprobe(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "weight-editing 4 cases" in proc.stderr
    for needle in ("agreement [95% CI]", "to decision ms (median)", "setup ms (median)", "contamination [95% CI] (n)",
                   "lora:r8", "by construction"):
        assert needle in proc.stdout, needle
    df = pd.read_parquet(out / "weight_edits.parquet")
    assert set(df.strategy) == {"stale", "erratum", "oracle", "lora:r8"}
    lora = df[df.method == "lora"]
    assert len(lora) >= 1 and (lora.contamination_n == 4).all() and lora.valid.all()
    manifest = json.loads((out / "weight_edit_manifest.json").read_text())
    assert manifest["weights_restored"] is True and manifest["lora_rank"] == 8
    summary = json.loads((out / "summary.json").read_text())  # the weight_edit fact, on the schema
    jsonschema.validate(summary, summary_schema())
    arms = {a["arm"]: a for a in summary["weight_edit"]["arms"]}
    assert arms["lora:r8"]["contamination"]["n"] == len(lora)
    assert arms["lora:r8"]["contamination_reads"] == 4 * len(lora)
    assert arms["erratum"]["contamination"] is None and arms["erratum"]["contamination_basis"] == "by construction"
    assert summary["headline"] == [summary["weight_edit"]["sentence"]] and "lora:r8 agrees" in summary["headline"][0]
    assert kvprobe("report", out).returncode == 0
    page = (out / "report.html").read_text()
    assert "Weight edit" in page and "0 (by construction)" in page and "lora:r8" in page
    parts = {p.name: p.stat().st_mtime_ns for p in (out / "parts").rglob("*.parquet")}
    again = kvprobe(*args)
    assert again.returncode == 0 and {p.name: p.stat().st_mtime_ns for p in (out / "parts").rglob("*.parquet")} == parts
    before = snapshot(out)
    line = error_line(kvprobe(*[a if a != "20" else "21" for a in args]), 2)
    assert "kvprobe weight-edit with other settings" in line and "steps" in line
    line = error_line(kvprobe(*[a if a != "toy-qwen2" else "toy-llama" for a in args]), 2)
    assert "model" in line
    assert snapshot(out) == before
    assert "kvprobe weight-edit" in error_line(kvprobe("edit", "--model", "toy-qwen2", "--n", "2", "--out", out), 2)


@pytest.mark.parametrize("extra, code, text", [
    (["--lora-rank", "0"], 2, "--lora-rank"), (["--steps", "0"], 2, "--steps"), (["--lr", "0"], 2, "--lr 0"),
    (["--lora-targets", "q,mlp"], 2, "q, k, v, o"), (["--contamination-cases", "-1"], 2, "--contamination-cases")])
def test_bad_options_are_refused_before_any_work(tmp_path, extra, code, text):
    out = tmp_path / "W"
    line = error_line(kvprobe("weight-edit", "--model", "toy-qwen2", "--n", "2", "--out", out, *extra), code)
    assert text in line and not out.exists()


def test_peft_not_installed_is_one_line(tmp_path):
    """A process where ``import peft`` fails, as it does without the extra."""
    code = "import sys; assert 'peft' not in sys.modules; sys.modules['peft'] = None\n" \
           "from kvprobe.cli.app import main; main()"
    proc = cli_process.run_code(code, "weight-edit", "--model", "toy-qwen2", "--n", "2", "--out", tmp_path / "out")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 4 and len(lines) == 1 and "pip install 'kvprobe[weight-edit]'" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
