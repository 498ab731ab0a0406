"""``kvprobe diagnose``: every strategy and auto against the oracle on one user prompt; its refusals."""

from __future__ import annotations

import json

import pytest

from kvprobe.datasets import generate
from kvprobe.datasets.layouts import REQUEST
from kvprobe.datasets.render import SENTINEL, render_body
from kvprobe.defaults import DIAGNOSE_STRATEGIES
from tests.cli.test_errors import kvprobe, one_line_error


@pytest.fixture(scope="module")
def case():
    """A generated decision case (its words are the toys' vocabulary) whose rule names the allowed
    values, so the old value also occurs in the rule."""
    return next(c for c in generate(20, seed=5) if not c.control and c.old_value in c.rule)


def template_of(case) -> str:
    body = render_body(case, SENTINEL, system=False).rsplit(f"\n\n{REQUEST}\n", 1)[0]
    return body.replace("{", "{{").replace("}", "}}").replace(SENTINEL, "{" + case.field + "}")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory, case):
    path = tmp_path_factory.mktemp("diagnose") / "prompt.txt"
    path.write_text(template_of(case) + "\n")
    return path


def test_a_template_jsonl_case_gets_every_strategy_against_the_oracle(tmp_path, case):
    line = {"case_id": "loan", "domain": case.domain, "field": case.field, "old_value": case.old_value,
            "new_value": case.new_value, "template": template_of(case), "question": case.question,
            "options": case.options, "system": case.system}
    path = tmp_path / "cases.jsonl"
    path.write_text(json.dumps(line) + "\n")
    proc = kvprobe("diagnose", f"{path}:1", "--model", "toy-qwen2", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = {r["strategy"]: r for r in out["rows"]}
    assert list(rows) == list(DIAGNOSE_STRATEGIES)
    assert rows["oracle"]["agree"] and rows["oracle"]["pred"] == rows["oracle"]["reference"] == case.expected_new
    assert rows["stale"]["pred"] == case.expected_old and not rows["stale"]["agree"]
    assert rows["auto"]["chose"] in ("field_only", "erratum_turn") and rows["auto"]["note"]
    for r in rows.values():
        assert r["error"] is None and 0 <= r["frac_recomputed"] <= 1 and r["to_decision_s"] > 0
    assert out["recommendation"][0].startswith(f"{case.new_value}: auto chose ")


def test_a_text_prompt_with_placeholders_prints_the_table(prompt_file, case):
    other = next(v for v in ("returned", "shipped", "pending", "delivered") if v not in (case.old_value, case.new_value))
    proc = kvprobe("diagnose", str(prompt_file), "--model", "toy-qwen2", "--field", case.field,
                   "--value", f"{case.field}={case.old_value}", "--new", f"{case.new_value},{other}",
                   "--question", case.question, "--options", ",".join(case.options), "--system", case.system,
                   "--strategies", "field_only,erratum_turn")
    assert proc.returncode == 0, proc.stderr
    for needle in ("field_only", "erratum_turn", "auto", "oracle", "cheapest agreeing in hindsight"):
        assert needle in proc.stdout
    # one recommendation per new value: a ranking where the edit changes the decision, else "no repair is needed"
    assert proc.stdout.count("auto chose") + proc.stdout.count("no repair is needed for the decision") == 2


@pytest.mark.parametrize(("args", "needles"), [
    (["--field", "tier", "--value", "tier=gold", "--new", "silver"], ["placeholder {{tier}}", "exactly once"]),
    (["--field", "{field}", "--value", "{field}={old}", "--new", "{old}"], ["equals the old one"]),
    (["--field", "{field}", "--value", "{field}={old}", "--new", "x", "--options", "yes"], ["bad --options"]),
    (["--field", "{field}", "--new", "x"], ["--value {field}=VALUE"]),
])
def test_bad_diagnose_input_is_one_line(prompt_file, case, args, needles):
    args = [a.format(field=case.field, old=case.old_value) for a in args]
    proc = kvprobe("diagnose", str(prompt_file), "--model", "toy-qwen2", "--question", case.question, *args)
    one_line_error(proc, *[n.format(field=case.field) for n in needles])
    assert proc.returncode == 2


def test_a_policy_of_another_model_is_refused(tmp_path, prompt_file, case):
    from kvprobe.editor.topk import export_topk
    from kvprobe.models import load_model
    from kvprobe.sweep.grid import SweepConfig, run_sweep

    cfg = SweepConfig(model="toy-llama", layouts=["record"], filler_tokens=[0], n=4,
                      strategies=["stale", "field_only", "oracle"])
    run_sweep(cfg, load_model("toy-llama"), tmp_path / "sweep")
    policy = export_topk(tmp_path / "sweep")
    proc = kvprobe("diagnose", str(prompt_file), "--model", "toy-qwen2", "--field", case.field, "--value",
                   f"{case.field}={case.old_value}", "--new", case.new_value, "--question", case.question,
                   "--policy", str(policy))
    one_line_error(proc, "topk.yaml is for model toy-llama", "not this model")
    assert proc.returncode == 3


LOAN = ("diagnose", "examples/loan.txt", "--field", "tier", "--value", "tier=gold", "--new", "silver",
        "--question", "Should the loan be issued?", "--options", "yes,no")


def test_an_edit_the_tokenizer_cannot_see_is_refused():
    """toy-qwen2's tokenizer knows neither silver nor platinum (both [UNK]): the edit changes no token
    id, so diagnose refuses it in one line instead of ranking strategies that all trivially agree."""
    args = [{"tier=gold": "tier=silver", "silver": "platinum"}.get(a, a) for a in LOAN]
    proc = kvprobe(*args, "--model", "toy-qwen2")
    assert proc.returncode == 3, proc.stderr
    one_line_error(proc, "changes no token id", "[UNK]")


def test_an_edit_that_does_not_change_the_decision_is_flagged_not_ranked():
    """On smollm2-135m gold -> silver leaves the oracle's decision where the stale cache has it: the
    recommendation says no repair is needed for the decision, and names no cheapest repair."""
    proc = kvprobe(*LOAN, "--model", "smollm2-135m", "--strategies", "field_only,erratum_turn", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    rows = {r["strategy"]: r for r in out["rows"]}
    assert rows["stale"]["pred"] == rows["oracle"]["pred"]
    assert out["recommendation"][0].startswith("silver: no repair is needed for the decision")
    assert "cheapest" not in out["recommendation"][0]
