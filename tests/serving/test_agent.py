"""The prefix-stable prompt state and the agent workload, without vLLM: a byte tokenizer with a chat
template, the stand-in server of conftest.py, and a vLLM chat stream recorded from the real server."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from kvprobe.errors import KvprobeError, UsageError

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "calibrate-refund-clear.yaml"
POLICY = ROOT / "examples" / "policies" / "qwen2.5-1.5b-refund-clear.yaml"
AGENT_SPEC = ROOT / "examples" / "agent-refund.yaml"  # the fields first: a rerender misses from the start
AGENT_POLICY = ROOT / "examples" / "policies" / "qwen2.5-1.5b-agent-refund.yaml"
RECORDED = ROOT / "tests" / "data" / "serving" / "vllm_chat_stream.json"
START = {"tier": "bronze", "received": "2026-03-04 12:00", "request_id": "req-123456"}


def _spec():
    from kvprobe.calibrate.engine import load_spec

    return load_spec(SPEC)


# -- the prompt state -----------------------------------------------------------------------------
def test_a_note_is_the_erratum_turn_kvprobe_measured(chat_byte_tokenizer):
    """The state's note for a field is, token for token, the prompt of calibrate's ``erratum_turn``
    for that edit (so the policy measured is the policy deployed), and the cached prefix's messages
    are untouched by it."""
    from kvprobe.datasets import align
    from kvprobe.editor.strategies import ErratumTurn, _erratum_ids
    from kvprobe.serving.state import PromptState, Rendering

    tok = chat_byte_tokenizer
    spec = _spec()
    state = PromptState(spec, START, {"tier": Rendering("note", "paper")})
    before = state.messages()
    assert [m["role"] for m in before] == ["system", "user"] and "Membership tier: bronze" in before[1]["content"]
    assert state.update(tier="gold") == ["note:paper"]
    after = state.messages()
    assert after[:2] == before and len(after) == 3
    assert after[2]["content"].startswith("[STATE UPDATE] tier has just changed to gold")
    assert after[2]["content"].endswith(spec.question + " Answer yes or no.")
    # calibrate's own path: the context as calibrate builds it, aligned, its erratum_turn prompt
    from kvprobe.api import EditableContext

    ctx = EditableContext.__new__(EditableContext)  # no model: only the case it would edit
    ctx.system, ctx._pieces, ctx.fields, ctx._ids = spec.system, [], {}, None
    for kind, x in spec.pieces:
        ctx.add_text(x) if kind == "text" else ctx.add_field(x, START[x])
    ctx.ask(spec.question, spec.options)
    lm = SimpleNamespace(tokenizer=tok, check_length=lambda n, what: None)
    # (with one token per byte a case aligns only between values of one length: the timestamp)
    stamp = PromptState(spec, START, {"received": Rendering("note", "paper")})
    stamp.update(received="2026-05-05 10:00")
    a = align(ctx.case("received", "2026-05-05 10:00"), tok, "chat")
    assert stamp.ids(tok) == _erratum_ids(lm, a, ErratumTurn().text, START["received"], "turn")
    assert PromptState(spec, START).ids(tok) == a.ids_old  # no update: the old prompt itself


def test_notes_collect_every_pending_change_and_a_rerender_rewrites_the_prefix(chat_byte_tokenizer):
    from kvprobe.serving.state import PromptState, Rendering

    r = {"tier": Rendering("note", "short"), "received": Rendering("none"), "request_id": Rendering("rerender")}
    state = PromptState(_spec(), START, r)
    state.update(received="2026-05-05 10:00")
    assert state.notes() == [] and "2026-03-04 12:00" in state.messages()[1]["content"]  # not sent
    state.update(tier="gold")
    assert state.notes() == ["[STATE UPDATE] tier -> gold; overrides any earlier value."]
    state.update(tier="bronze")  # back to the prefix's value: nothing to say
    assert state.notes() == [] and len(state.messages()) == 2
    state.update(tier="basic")
    state.update(request_id="req-000001")  # rewrites the prefix with every current value
    body = state.messages()[1]["content"]
    assert state.rewrites == 1 and state.notes() == [] and len(state.messages()) == 2
    assert "req-000001" in body and "Membership tier: basic" in body and "2026-05-05 10:00" in body
    with pytest.raises(UsageError, match="no field 'colour'"):
        state.update(colour="red")
    with pytest.raises(UsageError, match="every field of the template"):
        PromptState(_spec(), {"tier": "gold"})


def test_renderings_follow_the_calibrated_policy(tmp_path):
    import yaml

    from kvprobe.serving.state import DEFAULT, renderings

    spec = _spec()
    got = renderings(spec, POLICY)
    assert got["tier"].label == "note:paper" and "erratum_turn established" in got["tier"].reason
    assert got["received"].kind == got["request_id"].kind == "none"
    assert "no pair of 83 changed" in got["received"].reason
    assert renderings(spec) == {n: DEFAULT for n in spec.fields} and DEFAULT.label == "note:paper"
    # the branches of the rendering, on the verified policy with entries replaced (a loaded FieldPolicy
    # is taken as it is): a field the policy could not establish a repair for, one it did not
    # calibrate, a neutral note
    from kvprobe.editor.strategies import parse_strategy
    from kvprobe.errors import KvprobeError
    from kvprobe.field_policy import load_any

    verified = load_any(POLICY, None, parse_strategy)

    def replaced(**changes):
        fields = {n: dict(f) for n, f in verified.fields.items() if changes.get(n, {}) is not None}
        for n, update in changes.items():
            if update is not None:
                fields[n].update(update)
        return dataclasses.replace(verified, fields=fields)

    got = renderings(spec, replaced(tier={"repair": "oracle", "verdict": "budget"},
                                    received={"repair": "erratum_turn:neutral"}, request_id=None))
    assert got["tier"].kind == "rerender" and got["received"].label == "note:neutral"
    assert got["request_id"].kind == "rerender" and "did not calibrate 'request_id'" in got["request_id"].reason
    # a field_only repair on a field that moved the decision has no deployable form: rerender
    # and so has an erratum placed inside the prompt before the question; a degenerate field needs nothing,
    # an unmeasurable one (never measured) is rerendered
    for repair in ("field_only", "erratum:short"):
        got = renderings(spec, replaced(tier={"repair": repair},
                                        request_id={"repair": "none", "verdict": "degenerate", "change_rate": None},
                                        received={"repair": "oracle", "verdict": "unmeasurable"}))
        assert got["tier"].kind == "rerender" and "moved the decision on 51 of 83" in got["tier"].reason
        assert got["request_id"].kind == "none" and "degenerate" in got["request_id"].reason
        assert got["received"].kind == "rerender"
    # the same edits made in the file are refused: its counts give other repairs
    data = yaml.safe_load(POLICY.read_text())
    data["fields"]["received"].update(repair="erratum_turn:neutral")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    refused = r"says erratum_turn:neutral \(established\), but its counts give field_only"
    with pytest.raises(KvprobeError, match=refused):
        renderings(spec, tmp_path / "p.yaml")


# -- the client ----------------------------------------------------------------------------------
def test_a_recorded_vllm_chat_stream_gives_the_decision_from_logprobs():
    """Chunks vLLM 0.32 (CPU build) streamed for kvprobe's request, replayed through the ``openai``
    client's own chunk type: the first token's top logprobs by token id, the usage with cached
    tokens, and the decision by kvprobe's rule (an option's score: its best first-token id)."""
    from openai.types.chat import ChatCompletionChunk

    from kvprobe.serving.client import Completion, decide, read_chat_stream

    rec = json.loads(RECORDED.read_text())
    first, second = (read_chat_stream([ChatCompletionChunk.model_validate(c) for c in r["chunks"]], Completion(), 0.0)
                     for r in rec["responses"])
    for c in (first, second):
        assert c.ttft_s > 0 and len(c.top_logprobs) == 20 and c.completion_tokens == 1
    assert second.cached_tokens > first.cached_tokens  # the note's request hit the cached prefix's blocks
    assert second.prompt_tokens > first.prompt_tokens
    ids = rec["option_ids"]
    answers = [decide(c.top_logprobs, ids)[0] for c in (first, second)]
    assert answers == rec["decisions"]  # bronze: no; the erratum turn to gold: yes
    assert decide({1: -0.5}, ids) == ("?", {"yes": -math.inf, "no": -math.inf})
    assert decide({ids["no"][0]: -3.0}, ids)[0] == "no"  # an option not listed scores below every listed one


# -- the workload ---------------------------------------------------------------------------------
def test_the_workload_is_turn_major_and_mostly_inert():
    from kvprobe.serving.workload import workload

    spec = _spec()
    starts, turns = workload(spec, ["tier"], sessions=20, turns=10, gating_share=0.25, seed="s")
    assert len(starts) == 20 and len(turns) == 200
    assert [t.turn for t in turns] == sorted(t.turn for t in turns)  # every session's turn 1, then turn 2 ...
    gating = [t for t in turns if t.kind == "gating"]
    assert all(t.field == "tier" for t in gating) and 0.15 < len(gating) / 200 < 0.35
    current = [dict(s) for s in starts]
    for t in turns:  # every update changes its field
        assert current[t.session][t.field] != t.value
        current[t.session][t.field] = t.value
    assert workload(spec, ["tier"], 20, 10, 0.25, "s") == (starts, turns)  # seeded


def _decide_by_latest_tier(text: str) -> str:
    """The stand-in model follows the latest tier it reads: yes for gold."""
    return "yes" if re.findall(r"\b(gold|bronze|basic)\b", text.split("Membership tier:", 1)[1])[-1] == "gold" \
        else "no"


@pytest.fixture
def agent_bench(monkeypatch, chat_byte_tokenizer, tmp_path):
    """The agent module, tokenizing with the byte tokenizer, and the qwen2.5-1.5b policy with its
    tokenizer fingerprint set to the byte tokenizer's (a policy is checked against the tokenizer), for
    examples/agent-refund.yaml."""
    import yaml

    from kvprobe.models.load import tokenizer_hash
    from kvprobe.serving import agent, bench

    monkeypatch.setattr(bench, "load_tokenizer", lambda model: chat_byte_tokenizer)
    # a folder's salt seeds its workload: fixed here, so that a run's sessions are the same every time
    monkeypatch.setattr(bench.secrets, "token_hex", lambda n: "5a17e0c1"[:2 * n])
    data = yaml.safe_load(AGENT_POLICY.read_text())
    data["model"]["tokenizer_hash"] = tokenizer_hash(chat_byte_tokenizer)
    (tmp_path / "byte_policy.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return SimpleNamespace(agent=agent, policy=str(tmp_path / "byte_policy.yaml"))


def _cfg(ab, **kw):
    base = dict(model="qwen2.5-1.5b", spec=str(AGENT_SPEC), field_policy=ab.policy, rates=[math.inf, 20.0],
                sessions=4, turns=3, gating_share=0.5, policy_tokens=1000)
    return ab.agent.AgentConfig(**{**base, **kw})


def test_agent_bench_against_a_stand_in_server(agent_bench, fake_vllm, chat_byte_tokenizer, tmp_path):
    from kvprobe.calibrate.engine import load_spec

    ab, agent = agent_bench, agent_bench.agent
    fake = fake_vllm(tokenizer=chat_byte_tokenizer, decide=_decide_by_latest_tier)
    out = tmp_path / "agent"
    df = pd.read_parquet(agent.AgentBench(_cfg(ab), fake.url, out).run())
    assert list(df.columns) == list(agent.COLUMNS) and len(df) == 2 * 3 * 4 * 3 and df["ok"].all()
    assert (df["prompt_tokens"] == df["local_tokens"]).all()  # the server's template gave kvprobe's tokens
    sums = df.groupby(["rate", "arm"])[["cached_tokens", "ceiling_tokens"]].sum()
    assert (sums["cached_tokens"] <= sums["ceiling_tokens"]).all()
    s = agent.summarize(df).set_index(["rate", "arm"])
    for rate in (20.0, math.inf):
        rerender, erratum, policy = (s.loc[(rate, a)] for a in ("rerender", "erratum", "policy"))
        # bytes: the fields sit at about a fifth of a 1,000-byte prompt, and a rerender misses from the first
        # change (all of it hits only where a turn sets a field back to the session's first value); a note is
        # a hundred bytes, and the erratum arm sends up to three, the policy arm only the gating field's
        assert rerender.hit_rate_usage < 0.5 < 0.6 < erratum.hit_rate_usage <= policy.hit_rate_usage
        assert erratum.hit_rate_usage >= 0.95 * erratum.ceiling and policy.hit_rate_usage >= 0.95 * policy.ceiling
        assert erratum.notes_share >= policy.notes_share
        for arm in (erratum, policy):  # a model that follows the latest tier: every arm agrees
            assert arm.gating_k == arm.gating_n > 0 and arm.inert_k == arm.inert_n > 0
    # the policy sends no note for an inert field: turn for turn no more notes than the erratum arm, and
    # fewer in all (a session's first change of an inert field is pending in the erratum arm). The share of
    # turns with a note can tie: where every session's first change gates, every turn carries one in both
    notes = df.pivot_table(index=["rate", "session", "turn"], columns="arm", values="notes")
    assert (notes["policy"] <= notes["erratum"]).all() and notes["policy"].sum() < notes["erratum"].sum()
    inert = df[(df["arm"] == "policy") & (df["kind"] == "inert")]
    assert set(inert["rendering"]) == {"none"} and set(df.loc[df["arm"] == "erratum", "rendering"]) == {"note:paper"}
    # the served template is saved as a calibration spec: the policy can be calibrated on exactly it
    served = load_spec(out / agent.SPEC_FILE)
    assert "Policy notes:" in served.template and "{tier}" in served.template and served.fields.keys() == \
        load_spec(AGENT_SPEC).fields.keys()
    manifest = json.loads((out / "serving_manifest.json").read_text())
    assert manifest["workload"] == "agent" and manifest["gating_fields"] == ["tier"]
    assert manifest["renderings"]["policy"]["received"]["rendering"] == "none"
    assert manifest["policy_calibrated_on"] == "unpadded"  # the policy's template digest: the spec without clauses
    assert manifest["answer_ids"]["yes"] == [ord("y") - ord("!"), ord("Y") - ord("!")]  # "yes" and "Yes", bytes
    assert 900 <= manifest["prompt_tokens"] <= 1100
    # resuming a finished run sends nothing
    before = fake.completions
    agent.AgentBench(_cfg(ab), fake.url, out).run()
    assert fake.completions == before
    with pytest.raises(KvprobeError, match="another configuration"):
        agent.AgentBench(_cfg(ab, turns=4), fake.url, out).run()


def test_a_dying_server_keeps_finished_agent_runs(agent_bench, fake_vllm, chat_byte_tokenizer, tmp_path):
    from kvprobe.serving.client import ServerGone

    ab, agent = agent_bench, agent_bench.agent
    out = tmp_path / "agent"
    # warm-up 4, rerender 12, then dies in the erratum arm of the first rate
    fake = fake_vllm(tokenizer=chat_byte_tokenizer, decide=_decide_by_latest_tier, die_after=4 + 12 + 3)
    with pytest.raises(ServerGone, match="erratum"):
        agent.AgentBench(_cfg(ab), fake.url, out).run()
    assert set(pd.read_parquet(out / "agent.parquet")["arm"]) == {"rerender"}
    fresh = fake_vllm(tokenizer=chat_byte_tokenizer, decide=_decide_by_latest_tier)
    df = pd.read_parquet(agent.AgentBench(_cfg(ab), fresh.url, out).run())
    assert len(df) == 2 * 3 * 12 and fresh.completions == 2 * 4 + 2 * 3 * 12 - 12  # the rerender run kept


def test_agent_inputs_are_checked(agent_bench, fake_vllm, chat_byte_tokenizer, tmp_path):
    ab, agent = agent_bench, agent_bench.agent
    fake = fake_vllm(tokenizer=chat_byte_tokenizer, decide=_decide_by_latest_tier)
    with pytest.raises(UsageError, match="--field-policy"):
        agent.AgentBench(_cfg(ab, field_policy=None), fake.url, tmp_path / "a")
    with pytest.raises(UsageError, match="the policy arm needs a per-field policy"):
        agent.AgentBench(_cfg(ab, field_policy=None, gating=["tier"]), fake.url, tmp_path / "b")
    with pytest.raises(UsageError, match="--gating names 'colour'"):
        agent.AgentBench(_cfg(ab, gating=["colour"]), fake.url, tmp_path / "c")
    with pytest.raises(KvprobeError, match="calibrated for qwen2.5-1.5b, not smollm2-135m"):
        agent.AgentBench(_cfg(ab, model="smollm2-135m"), fake.url, tmp_path / "d")
    with pytest.raises(KvprobeError, match="tokenizer differs"):  # the real policy: another tokenizer than this one
        agent.AgentBench(_cfg(ab, field_policy=str(AGENT_POLICY)), fake.url, tmp_path / "e")
    with pytest.raises(ValueError, match="policy tokens must be 0"):
        _cfg(ab, policy_tokens=10)
    assert _cfg(ab, arms=["policy"]).arms == ["rerender", "policy"]  # the reference always runs
