"""The front door: kvprobe.load on every kind of model, EditableContext, auto, and their refusals."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvprobe
from kvprobe.datasets import generate
from kvprobe.datasets.layouts import REQUEST
from kvprobe.datasets.render import SENTINEL, render_body
from kvprobe.errors import KvprobeError, UsageError


def context_of(lm, case, **kwargs) -> kvprobe.EditableContext:
    """An EditableContext holding the same prompt as a generated (record layout) case."""
    body = render_body(case, SENTINEL, system=False).rsplit(f"\n\n{REQUEST}\n", 1)[0]
    before, after = body.split(SENTINEL)
    ctx = kvprobe.EditableContext(lm, system=case.system, **kwargs)
    ctx.add_text(before).add_field(case.field, case.old_value).add_text(after)
    return ctx.ask(case.question, case.options)


@pytest.fixture(scope="module")
def toy():
    return kvprobe.load("toy-qwen2")


@pytest.fixture(scope="module")
def cases():
    return generate(12, seed=3, controls=0.25)


def test_the_context_renders_the_generated_prompt(toy, cases):
    from kvprobe.datasets import align

    case = cases[0]
    a = align(case, toy.tokenizer)
    ctx = context_of(toy, case).prefill()
    assert ctx._ids == a.ids_old


def test_auto_keeps_field_only_when_it_moves_the_decision_and_falls_back_when_not(toy, cases):
    seen = set()
    for case in cases:
        ctx = context_of(toy, case)
        before = ctx.read().answer()
        fixed = ctx.edit(**{case.field: case.new_value})
        oracle = ctx.edit(strategy="oracle", **{case.field: case.new_value})
        field_only = ctx.edit(strategy="field_only", **{case.field: case.new_value}).answer()
        if field_only != before:
            assert fixed.chose == "field_only" and "moved the decision" in fixed.reason
            assert fixed.answer() == field_only
        else:
            assert fixed.chose == "erratum_turn" and "no policy" in fixed.reason and "kept" in fixed.reason
            erratum = ctx.edit(strategy="erratum_turn", **{case.field: case.new_value})
            assert fixed.answer() == erratum.answer()
            assert fixed.recomputed > erratum.recomputed  # the check is counted
        seen.add(fixed.chose)
        if not case.control:
            assert oracle.answer() == case.expected_new
    assert seen == {"field_only", "erratum_turn"}  # the toy moves on decisions, not on controls


def test_edits_leave_the_prefilled_cache_as_it_was(toy, cases):
    ctx = context_of(toy, cases[0])
    before = ctx.read().logits.clone()
    for strategy in ("stale", "field_only", "erratum", "erratum_turn", "cacheblend:0.3", "auto", "oracle"):
        ctx.edit(strategy=strategy, **{cases[0].field: cases[0].new_value}).logits
    assert torch.equal(ctx.read().logits, before)


def test_generate_reads_the_same_first_token_as_the_logits(toy, cases):
    state = context_of(toy, cases[0]).edit(strategy="field_only", **{cases[0].field: cases[0].new_value})
    first = toy.tokenizer.decode([int(state.logits.argmax())])
    assert state.generate(3).startswith(first.strip())


def greedy_by_hand(state, n: int) -> list[int]:
    """Greedy decoding by plain forward passes on a copy of the state's cache (no end-of-sequence
    stop): what transformers' generate must reproduce."""
    from kvprobe.kv import cache as kvcache

    cache, out = kvcache.copy(state.cache), []
    with torch.no_grad():
        logits = kvcache.forward(state.lm.model, torch.tensor([state.tail_ids]), cache).logits[0, -1]
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = kvcache.forward(state.lm.model, torch.tensor([[out[-1]]]), cache).logits[0, -1]
    return out


def test_generate_is_transformers_generate_on_the_repaired_cache():
    """Greedy ``generate`` on each repair equals decoding its cache by hand; a repair that
    recomputes every downstream token generates what the oracle generates, token for token;
    sampling options and stopping criteria are transformers' own; the state is left as it was.
    (Token for token holds on every CPU kind: the smallest top-2 logit gap over these 12 greedy
    steps is 3.3e-3, stale's, against the 1e-4 two CPU kinds' kernels move a logit.)"""
    from transformers import StoppingCriteria, StoppingCriteriaList

    lm = kvprobe.load("tiny-llama")
    ctx = kvprobe.EditableContext(lm, form="raw")
    ctx.add_text("Policy: loans are issued only if the tier is gold.\nRecord: tier ").add_field("tier", "gold")
    ctx.add_text(". The applicant has been a customer for years.").ask("Is the loan issued?", ["yes", "no"])
    a = ctx.context("tier", "silver").a
    downstream = a.decision_pos - a.field[1]
    states = {s: ctx.edit(s, tier="silver") for s in ("stale", "field_only", "erratum_turn", "oracle",
                                                       f"selective:{downstream}:recency")}
    for name, state in states.items():
        assert len(state.ids) == len(state.tail_ids) + state.cache.get_seq_length(), name
        before = state.logits.clone()
        ids = state.generate(12, return_ids=True)
        assert ids == greedy_by_hand(state, 12)[: len(ids)] and len(ids) == 12, name  # tiny-llama ends nowhere
        assert torch.equal(state.logits, before) and state.generate(12, return_ids=True) == ids, name
    oracle = states["oracle"]
    greedy = oracle.generate(12, return_ids=True)
    assert states[f"selective:{downstream}:recency"].generate(12, return_ids=True) == greedy
    assert states["oracle"].ids == a.ids_new and states["stale"].ids == a.ids_old
    assert states["erratum_turn"].ids[-len(states["erratum_turn"].tail_ids):] == states["erratum_turn"].tail_ids
    torch.manual_seed(0)
    drawn = oracle.generate(12, return_ids=True, do_sample=True, temperature=5.0)
    torch.manual_seed(0)
    assert oracle.generate(12, return_ids=True, do_sample=True, temperature=5.0) == drawn != greedy
    assert oracle.generate(12, return_ids=True, do_sample=True, top_k=1) == greedy

    class AfterFour(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= len(oracle.ids) + 4)

    assert oracle.generate(12, return_ids=True, stopping_criteria=StoppingCriteriaList([AfterFour()])) == \
        oracle.generate(4, return_ids=True)


def test_generate_stops_at_a_stop_string():
    """``stop_strings`` (transformers needs the tokenizer for them, which generate passes) on a real
    tokenizer (transformers' stop-string matcher cannot index the toys' and tiny models' own)."""
    lm = kvprobe.load("smollm2-135m")
    ctx = kvprobe.EditableContext(lm).add_text("The tier is ").add_field("tier", "gold")
    state = ctx.ask("Name three colours.").edit("oracle", tier="silver")
    text = state.generate(10)
    stop = text.strip().split()[1]
    cut = state.generate(10, stop_strings=[stop])
    assert len(text.split()) > 2 and cut.endswith(stop) and text.startswith(cut) and len(cut) < len(text)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_user_loaded_model_and_nnsight_give_the_spec_paths_logits(cases, attn):
    """A model by spec, and its folder loaded by transformers and wrapped by nnsight (both its
    classes), under the same attention implementation: the same decision logits for every repair.
    The shipped toy-llama (a LlamaForCausalLM, as SmolLM2-135M is) shows it through the same code
    paths; this test ran on SmolLM2 until session 37, at 11 s a case against under 1 s
    (docs/testing.md). A spec loaded with eager attention runs kvprobe's grouped eager attention,
    kvprobe.models.attention, while a model the user loaded keeps transformers' own: the same
    arithmetic in another order, 2.9e-6 apart on the toy (sdpa 3.8e-6; Zen 4), so both paths are
    held to 2e-5 (a 0.1% change to one weight matrix of the user's model moves them by 1e-4; on
    SmolLM2 the paths were 1.8e-5 apart and held to 5e-5). nnsight with the real SmolLM2 stays in
    tests/probes/test_crosscheck.py (a KV patch against nnsight's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvprobe.models import toy_folder

    nnsight = pytest.importorskip("nnsight")
    case = next(c for c in cases if not c.control)
    folder = toy_folder.shipped_dir("llama")
    by_spec = kvprobe.load("toy-llama", attn=attn)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = nnsight.LanguageModel(model, tokenizer=tokenizer)  # nnsight 0.8: deprecated for TransformersModel
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nnsight's current class warns nothing
        current = nnsight.TransformersModel(model, tokenizer=tokenizer)
    ref = {s: context_of(by_spec, case).edit(strategy=s, **{case.field: case.new_value}).logits
           for s in ("stale", "field_only", "erratum_turn", "oracle")}
    for lm in (kvprobe.load(model, tokenizer), kvprobe.load(wrapped), kvprobe.load(current)):
        for s, logits in ref.items():
            got = context_of(lm, case).edit(strategy=s, **{case.field: case.new_value}).logits
            assert (got - logits).abs().max().item() <= 2e-5, (s, (got - logits).abs().max().item())


def test_unsupported_models_are_refused_in_one_line():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(KvprobeError, match=r"^unsupported model class GPT2LMHeadModel: .*supported model types"):
        kvprobe.load(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)), object())
    with pytest.raises(UsageError, match=r"^unsupported model class dict; accepted: "):
        kvprobe.load({"not": "a model"})


def test_an_empty_model_spec_is_refused_in_kvprobes_words():
    with pytest.raises(UsageError, match=r"^the model spec is empty; give a bundled alias, tiny-<family>, "
                                         r"toy-<family>, a \.gguf path, a local Hugging Face folder or a toy folder"):
        kvprobe.load("")


def test_an_empty_question_is_refused_in_kvprobes_words(toy):
    ctx = kvprobe.EditableContext(toy).add_text("Tier: ").add_field("tier", "gold")
    for question in ("", "  "):
        with pytest.raises(UsageError, match=r"^the question is empty; give the question whose answer is the "
                                             r"decision as text"):
            ctx.ask(question, options=["yes", "no"])


def test_a_strategy_that_is_neither_a_spec_nor_a_strategy_is_refused_in_one_line(toy, cases):
    case = cases[0]
    with pytest.raises(UsageError, match=r"^strategy must be a spec string such as 'auto' .* got int 123$"):
        context_of(toy, case).edit(strategy=123, **{case.field: case.new_value})


@pytest.mark.parametrize(("change", "message"), [
    ({"tier": "silver"}, r"^no field 'tier' in this context; its fields: "),
    ({}, r"^edit one field at a time"),
])
def test_bad_edits_are_refused_in_one_line(toy, cases, change, message):
    with pytest.raises(KvprobeError, match=message):
        context_of(toy, cases[0]).edit(**change)


def test_a_new_value_equal_to_the_old_is_refused(toy, cases):
    case = cases[0]
    with pytest.raises(UsageError, match=rf"^the new value of '{case.field}' equals the old one"):
        context_of(toy, case).edit(**{case.field: case.old_value})


def test_an_edit_past_the_window_is_refused(toy, cases):
    case = next(c for c in cases if not c.control)
    ctx = context_of(toy, case).prefill()
    window = toy.max_positions
    long_value = " ".join(["shipped"] * (window + 1))
    with pytest.raises(KvprobeError, match=rf"^the prompt with {case.field}=.* tokens is longer than the model's "
                                           rf"window of {window} positions"):
        ctx.edit(**{case.field: long_value})


def policy_of(*evidence, fields=None) -> "kvprobe.policy.Policy":
    """A policy from (spec, agreement, n, cost[, kept, n_controls]) entries (every control kept, as many
    controls as decision cases, unless given)."""
    from kvprobe.policy import Evidence, Policy

    entries = tuple(Evidence(spec, agreement, None, n, *(rest or (1.0, n)), cost, None)
                    for spec, agreement, n, cost, *rest in evidence)
    return Policy(path="measured.yaml", model={}, threshold=0.95, k_star=None, rule=None, strategies=entries,
                  erratum_template=None, fields=fields)


def test_auto_takes_a_policys_field_only_as_it_is(toy, cases):
    case = next(c for c in cases if c.control)  # field-only does not move a control: no check would keep it
    ctx = context_of(toy, case, policy=policy_of(("field_only", 1.0, 80, 0.01), ("erratum_turn", 1.0, 80, 0.2)))
    fixed = ctx.edit(**{case.field: case.new_value})
    plain = ctx.edit(strategy="field_only", **{case.field: case.new_value})
    assert fixed.chose == "field_only" and fixed.reason.startswith("policy measured.yaml: field_only: agreement 1.00")
    assert fixed.recomputed == plain.recomputed  # no check ran
    assert torch.allclose(fixed.logits, plain.logits)


def test_auto_falls_back_to_the_oracle_when_nothing_measured_qualifies(toy, cases):
    case = next(c for c in cases if c.control)
    # 19 of 19 reaches a lower bound of 0.83; erratum_turn agrees on 80 of 80 but flips 40 of 80 controls
    too_few = policy_of(("field_only", 1.0, 19, 0.01), ("erratum_turn", 1.0, 80, 0.2, 0.5, 80))
    fixed = context_of(toy, case, policy=too_few).edit(**{case.field: case.new_value})
    assert fixed.chose == "oracle" and "no measured strategy is established at 0.95" in fixed.reason


def test_auto_repairs_a_field_by_the_repair_established_for_its_kind(toy, cases):
    """topk.yaml's ``fields``: a field whose edits were negative controls gets the repair established on
    keeping the decision (field_only), with no runtime check, even where no single repair is established."""
    case = next(c for c in cases if c.control)
    fields = {case.field: {"kind": "must not matter", "repair": "field_only", "cases": 80}}
    policy = policy_of(("field_only", 0.1, 80, 0.01), ("erratum_turn", 1.0, 80, 0.2, 0.5, 80), fields=fields)
    assert policy.cheapest() is None
    fixed = context_of(toy, case, policy=policy).edit(**{case.field: case.new_value})
    plain = context_of(toy, case).edit(strategy="field_only", **{case.field: case.new_value})
    assert fixed.chose == "field_only" and "must not matter" in fixed.reason
    assert fixed.recomputed == plain.recomputed  # no check ran


def test_two_threads_on_one_context_get_what_a_sequential_run_gets(toy, cases):
    """One context, several strategies (cacheblend hangs forward hooks on the shared model while it
    repairs), two threads: main eac58e9 raised in 4 of 4 trials (a `_StopForward`, a size mismatch)
    and once returned logits off by 0.172 with no error. The model's lock makes every trial's
    logits equal the sequential run's, bit for bit."""
    import threading

    case = cases[0]
    strategies = ["cacheblend:0.15", "erratum_turn", "selective:4:random", "field_only", "oracle"]
    ctx = context_of(toy, case)
    want = {s: ctx.edit(strategy=s, **{case.field: case.new_value}).logits for s in strategies}
    for trial in range(20):
        got, errors = {}, []

        def work(specs):
            try:
                for s in specs:
                    got[s] = context.edit(strategy=s, **{case.field: case.new_value}).logits
            except Exception as exc:  # noqa: BLE001 - the test reports it
                errors.append(repr(exc))

        context = context_of(toy, case) if trial % 2 else ctx  # a fresh context: its prefill races too
        threads = [threading.Thread(target=work, args=(strategies[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, (trial, errors)
        for s in strategies:
            assert torch.equal(got[s], want[s]), (trial, s, float((got[s] - want[s]).abs().max()))


def test_a_policy_path_is_loaded_and_a_bad_one_refused_in_one_line(toy, cases, tmp_path):
    """EditableContext(policy=...) takes a pathlib.Path like a str; a file naming an unknown strategy, or a
    policy that is neither, is one line."""
    import yaml

    case = next(c for c in cases if c.control)
    cfg = {"schema_version": 3, "model": toy.fingerprint(), "threshold": 0.95, "erratum_template": None,
           "k_star": None, "k_star_status": "no ranking", "reason": "a sweep measures no causal ranking",
           "strategies": [{"spec": "field_only", "agreement": 1.0, "agreement_ci95": [0.95, 1.0], "n": 80,
                           "control_invariance": 1.0, "n_controls": 80, "frac_recomputed": 0.01, "wall_s": None}]}
    path = tmp_path / "topk.yaml"
    path.write_text(yaml.safe_dump(cfg))
    fixed = context_of(toy, case, policy=path).edit(**{case.field: case.new_value})
    assert fixed.chose == "field_only" and fixed.reason.startswith(f"policy {path}: field_only")
    cfg["strategies"][0]["spec"] = "telepathy"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(KvprobeError, match=f"^{path} is not a valid topk.yaml: strategies entry 1 names a strategy"):
        kvprobe.EditableContext(toy, policy=path)
    with pytest.raises(UsageError, match="policy must be the path of a topk.yaml .* not int"):
        kvprobe.EditableContext(toy, policy=123)


def test_the_api_in_a_notebook(toy, cases):
    """Tab completion lists the lazy exports; an EditState prints in one short line and as a small
    HTML table, and turns into a dict or a one-row DataFrame; a batch of 20 edits shares the one
    prefill and comes back as one DataFrame, each row equal to its own edit() (generate on a
    repaired cache: test_generate_is_transformers_generate_on_the_repaired_cache)."""
    import pandas as pd

    assert {"load", "EditableContext", "EditState", "diagnose_case", "policy"} <= set(dir(kvprobe))
    case = next(c for c in cases if not c.control)
    ctx = context_of(toy, case)
    state = ctx.edit("erratum_turn", **{case.field: case.new_value})
    text = repr(state)
    assert text.startswith("EditState(strategy='erratum_turn', answer=") and len(text) < 200 and "\n" not in text
    d = state.to_dict()
    assert d["answer"] == state.answer() and d["score_yes"] == pytest.approx(state.scores()["yes"])
    assert d["recomputed"] == state.recomputed and d["repair_s"] == state.repair_s
    assert list(state.to_frame().columns) == list(d) and "<table>" in state._repr_html_()
    assert state.tail_ids and type(state.cache).__name__ == "DynamicCache"
    width = len(toy.tokenizer(case.old_value, add_special_tokens=False).input_ids)
    pool = [v for c in generate(300, seed=3) for v in (c.old_value, c.new_value)]
    values = [v for v in dict.fromkeys([case.new_value, *pool]) if v != case.old_value
              and len(toy.tokenizer(v, add_special_tokens=False).input_ids) == width][:20]  # a batch of 20 edits
    table = ctx.edits("erratum_turn", **{case.field: values})
    assert isinstance(table, pd.DataFrame) and list(table["new_value"]) == values and len(table) == 20
    assert list(table.columns[:2]) == ["field", "new_value"] and set(d) <= set(table.columns)
    for row in table.itertuples():
        alone = ctx.edit("erratum_turn", **{case.field: row.new_value})
        assert row.answer == alone.answer() and row.score_yes == pytest.approx(alone.scores()["yes"], abs=1e-4)
    with pytest.raises(UsageError, match=r"ctx\.edits\(" + case.field):
        ctx.edit(**{case.field: values})


@pytest.mark.parametrize("name", ["strategy", "self"])
def test_field_names_that_edit_cannot_take_are_refused(toy, name):
    with pytest.raises(UsageError, match=rf"^field name '{name}' is reserved"):
        kvprobe.EditableContext(toy).add_field(name, "x")
