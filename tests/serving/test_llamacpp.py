"""llama.cpp's own cache edited in place (kvprobe.serving.llamacpp), against the real engine: exactness
against kvprobe's repairs on smollm2-135m's weights in float32, the engine's bookkeeping, the agent
workload's policy+edit arm and state check, and one-line errors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvprobe.errors import EnvironmentProblem, KvprobeError, UsageError
from tests.conftest import real_model

MODEL = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[2]
AGENT_SPEC = ROOT / "examples" / "agent-refund.yaml"
TOL = 1e-3  # float32 weights and cache, attention in float32: 2e-5 to 3e-5 measured (docs/serving.md)


@pytest.fixture(scope="module")
def f32_gguf():
    from kvprobe.serving.llamacpp import float32_of

    return float32_of(MODEL)


@pytest.fixture(scope="module")
def exact_engine(f32_gguf):
    from kvprobe.serving.llamacpp import Engine

    with Engine(f32_gguf, n_ctx=2048, sessions=2, kv="f32", flash_attn=False) as e:
        yield e


def _aligned(n: int):
    from kvprobe.datasets.generate import generate
    from kvprobe.editor.runner import align_all

    aligned, skipped = align_all(real_model(MODEL), generate(n, seed=0))
    assert aligned and not skipped
    return aligned


@pytest.mark.slow
def test_the_engine_repair_is_kvprobes_repair_in_float32(exact_engine):
    """On the same case, llama.cpp's field_only and selective repairs of its own cache read the logits
    kvprobe's repairs read (float32 weights and cache), a no-op edit changes nothing, and the engine's
    prefix-cache recompute and every-position-from-the-field edit equal its own prefill; what the
    repair leaves (kvprobe's field_only against its oracle) is far above that tolerance."""
    from kvprobe.serving.engine_check import exactness

    df = exactness(real_model(MODEL), exact_engine, _aligned(3))
    assert df["same_decision"].all()
    effect = df["compared"].str.startswith("kvprobe field_only vs kvprobe oracle")
    assert df.loc[~effect, "max_abs_dlogit"].max() < TOL, df.to_string()
    assert df.loc[effect, "max_abs_dlogit"].max() > 100 * TOL  # the comparison can tell the repairs apart
    assert set(df["repair"]) == {"oracle", "stale", "field_only", "selective:4:attention",
                                 "every position from the field"}
    edits = df[(df["repair"] == "field_only") & (df["compared"] == "engine edit vs kvprobe")]
    assert (edits["tokens_recomputed"] > 0).all()


def test_the_engine_keeps_what_a_session_holds(f32_gguf):
    """serve reuses the longest shared prefix, read and ask leave a session as it was, an edit rewrites
    the session's ids in place, and what cannot be edited in place is refused in one line."""
    from kvprobe.serving.llamacpp import Engine, InPlaceRefused, check_ids

    with Engine(f32_gguf, n_ctx=512, sessions=2, kv="f32", flash_attn=False) as e:
        _session_bookkeeping(e, InPlaceRefused, check_ids)


def _session_bookkeeping(e, InPlaceRefused, check_ids):
    ids = e.tokenize("<|im_start|>user\nThe request id is req-1234. Approve it? Answer yes or no.<|im_end|>\n"
                     "<|im_start|>assistant\n")
    e.open(0)
    first, n = e.serve(0, ids)
    assert n == len(ids) and e.ids(0) == ids
    again, n = e.serve(0, ids)
    assert n == 1 and np.abs(again - first).max() < TOL  # only the last token, for its logits
    _, n = e.serve(0, ids[:-3] + ids[-2:])
    assert n == 2 and e.ids(0) == ids[:-3] + ids[-2:]
    e.open(0)
    e.serve(0, ids[:-1])
    assert np.abs(e.read(0, ids[-1:]) - first).max() < TOL and e.ids(0) == ids[:-1]
    said, computed = e.ask(0, ids, 3)
    assert len(said) == 3 and computed == 1 and e.ids(0) == ids[:-1]
    new = list(ids)
    new[5:7] = ids[9:11]
    assert e.edit(0, 5, new[5:7], also=[12, 14]) == 4 and e.ids(0) == new[:-1]
    assert e.edit(0, 5, ids[5:7], also=range(7, len(ids) - 1)) == len(ids) - 6  # everything from the field
    assert np.abs(e.read(0, ids[-1:]) - first).max() < TOL
    with pytest.raises(KvprobeError, match="do not fit the engine's context of 512"):
        e.serve(0, ids + ids[3:4] * 600)
    assert e.ids(0) == ids[:-1] and np.abs(e.read(0, ids[-1:]) - first).max() < TOL  # as before the refusal
    with pytest.raises(InPlaceRefused, match="another token length"):
        e.edit(0, len(ids) - 3, ids[:5])
    with pytest.raises(UsageError, match="after the field"):
        e.edit(0, 5, ids[5:7], also=[3])
    with pytest.raises(UsageError, match="no session 1 in the engine; open sessions: \\[0\\]"):
        e.serve(1, ids)
    with pytest.raises(UsageError, match="out of range"):
        e.open(7)
    with pytest.raises(KvprobeError, match="disagree on the prompt from token 2"):
        check_ids([1, 2, 3], [1, 2, 4], "the prompt")


def test_a_missing_engine_is_one_line(monkeypatch):
    from kvprobe.serving.llamacpp import llama_cpp

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    with pytest.raises(EnvironmentProblem, match="llama-cpp-python.*not installed.*pip install"):
        llama_cpp()


@pytest.fixture(scope="module")
def agent_bench(tmp_path_factory):
    """The agent workload on smollm2-135m's own GGUF, gating the tier (no policy file: the arms that
    need one are given their renderings here)."""
    from kvprobe.serving.engine_agent import EngineAgentBench, EngineAgentConfig
    from kvprobe.serving.state import Rendering

    cfg = EngineAgentConfig(model=MODEL, spec=str(AGENT_SPEC), gating=["tier"], arms=["rerender"], sessions=2,
                            turns=3, gating_share=0.3, policy_tokens=0, answer_tokens=8)
    bench = EngineAgentBench(cfg, tmp_path_factory.mktemp("engine-agent"))
    bench.rendering["policy+edit"] = {"tier": Rendering("note", "neutral"), "received": Rendering("edit", "field_only"),
                                      "request_id": Rendering("edit", "selective:2:recency")}
    yield bench
    bench.engine.close()


def test_the_policy_edit_arm_edits_the_engines_cache(agent_bench):
    """policy+edit repairs an inert field in the engine's cache: the field's tokens (and a selective
    repair's K more) recomputed, then only the decision token; the session's cache then holds the
    current value where the old one was, and the state check asks after the current value."""
    b = agent_bench
    starts, turns = b.starts()
    df = b.run_arm("policy+edit", starts, turns, None)
    assert len(df) == len(turns) and (df["fallback"] == "").all()
    inert = df[df["kind"] == "inert"]
    assert len(inert) and (inert["prefill_tokens"] == 1).all()
    assert (inert.loc[inert["field"] == "received", "edit_tokens"] > 0).all()
    assert (inert.loc[inert["field"] == "request_id", "edit_tokens"] >= 3).all()  # the id's tokens and K = 2
    assert (df.loc[df["kind"] == "gating", "notes"] > 0).all()
    values = [dict(s) for s in starts]
    for i, t in enumerate(turns):
        values[t.session][t.field] = t.value
        assert df["check_value"][i] == values[t.session]["request_id"]
    for s, v in enumerate(values):
        cached = "".join(b.engine.piece(x) for x in b.engine.ids(s))
        assert f"Request id: {v['request_id']}" in cached and f"Received: {v['received']}" in cached
        changed = [t.value for t in turns if t.session == s and t.field == "request_id"]
        if changed:
            assert f"Request id: {starts[s]['request_id']}\n" not in cached


def test_a_value_of_another_length_is_re_rendered(agent_bench):
    """A new value whose tokens are fewer cannot be written in place: the edit refuses, in one line,
    and the serve that follows recomputes from the first changed token (a re-render)."""
    from kvprobe.serving.llamacpp import InPlaceRefused
    from kvprobe.serving.state import PromptState, Rendering

    b = agent_bench
    starts, _ = b.starts()
    st = PromptState(b.spec, starts[0], {"request_id": Rendering("edit", "field_only")})
    b.engine.open(0)
    b.engine.serve(0, b._ids(st.text(b.tok), "the prompt"))
    old = st.prefix["request_id"]
    st.update(request_id="r-1")
    with pytest.raises(InPlaceRefused, match="re-render"):
        b._edit(0, st, "request_id", old, "field_only")
    ids = b._ids(st.text(b.tok), "the new prompt")
    _, computed = b.engine.serve(0, ids)
    assert 1 < computed < len(ids) and b.engine.ids(0) == ids


@pytest.mark.parametrize("args, needles", [
    (["--engine", "sglang"], ["unknown engine 'sglang'", "llama.cpp"]),
    (["--engine", "llama.cpp"], ["--engine llama.cpp runs the agent workload"]),
    (["--workload", "agent", "--spec", str(AGENT_SPEC), "--gating", "tier", "--threads", "2"],
     ["--threads applies to --engine llama.cpp"]),
    (["--workload", "agent", "--spec", str(AGENT_SPEC), "--gating", "tier", "--engine", "llama.cpp",
      "--max-s", "30"], ["--max-s applies to --engine vllm"]),
    (["--workload", "agent", "--spec", str(AGENT_SPEC), "--gating", "tier", "--engine", "llama.cpp",
      "--arms", "rerender,policy+edit"], ["policy arm needs a per-field policy"]),
    (["--workload", "agent", "--spec", str(AGENT_SPEC), "--gating", "tier", "--engine", "llama.cpp",
      "--arms", "rerender,erratum", "--state-field", "colour"], ["--state-field must name a field", "request_id"]),
])
def test_engine_cli_errors_are_one_line(tmp_path, args, needles):
    from tests.serving.test_serving_unit import kvprobe, one_line_error

    one_line_error(kvprobe("serve-bench", "--model", MODEL, "--out", str(tmp_path / "out"), *args), *needles)


def test_policy_edit_renders_the_calibrated_in_cache_repairs_as_edits():
    """On the calibrated agent template, policy+edit edits the two inert fields in place (their
    established repair is field_only) and keeps the gating field's note; the server's policy arm
    sends nothing for them, and a field the policy did not calibrate is re-rendered in both."""
    from kvprobe.calibrate.spec import load_spec
    from kvprobe.serving.workload import arm_renderings

    spec = load_spec(AGENT_SPEC)
    policy = ROOT / "examples" / "policies" / "qwen2.5-1.5b-agent-refund.yaml"
    edit = {n: r.label for n, r in arm_renderings("policy+edit", spec, policy).items()}
    served = {n: r.label for n, r in arm_renderings("policy", spec, policy).items()}
    assert edit == {"request_id": "edit:field_only", "received": "edit:field_only", "tier": "note:neutral"}
    assert served == {"request_id": "none", "received": "none", "tier": "note:neutral"}


def test_a_finished_engine_run_resumes_without_recomputing(tmp_path):
    """A second run on the same folder and inputs reads every finished arm back (the engine is never
    loaded); another configuration on that folder is refused in one line."""
    from kvprobe.serving.engine_agent import TABLE, EngineAgentBench, EngineAgentConfig

    cfg = EngineAgentConfig(model=MODEL, spec=str(AGENT_SPEC), gating=["tier"], arms=["rerender", "erratum"],
                            sessions=1, turns=2, policy_tokens=0, answer_tokens=4)
    first = EngineAgentBench(cfg, tmp_path)
    table = first.run()
    first.engine.close()
    rows = pd.read_parquet(table)
    assert sorted(set(rows["arm"])) == ["erratum", "rerender"] and len(rows) == 4
    assert (rows.loc[rows["arm"] == "erratum", "agree"].notna()).all()  # judged against the rerender arm
    again = EngineAgentBench(cfg, tmp_path)
    assert again.run() == table and again._engine is None
    pd.testing.assert_frame_equal(pd.read_parquet(table), rows)
    assert len(list((tmp_path / "parts" / TABLE).glob("*.parquet"))) == 2
    with pytest.raises(UsageError, match="another configuration"):
        EngineAgentBench(cfg.model_copy(update={"turns": 3}), tmp_path).run()
