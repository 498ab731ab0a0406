"""The serving benchmark on the real engine: vLLM's CPU build serving SmolLM2-135M.

Time budget (stated, and enforced by the timeout below): setting up the environment 1.5-4 minutes
the first time (pip without bytecode, 3.4 GB; seconds once done), server start-up in vLLM's eager
mode with its engine in one process (no torch.compile, no engine-core process: nothing here times
the serving) 20-60 s idle and up to 7 minutes on a busy
machine (the start's own limit), 12 requests per arm at saturation plus their oracles
1-3 minutes, stop under 30 s: 20 minutes in all at most. Skipped only where pip says the CPU build
has no release for this platform or Python. The server is stopped whatever happens, and the test
checks that none of its processes is left.
"""

from __future__ import annotations

import math
import time

import pandas as pd
import pytest

from kvprobe.serving import env, server
from kvprobe.serving import measure

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.vllm]
MODEL = "smollm2-135m"
BUDGET_S = 20 * 60


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """kvprobe's vLLM server for SmolLM2-135M (its state and log in a temporary folder, so a server
    the user started is neither seen nor touched), stopped after the module."""
    try:
        env.setup()
    except env.SetupUnavailable as exc:
        pytest.skip(f"vLLM's CPU build cannot be installed here: {exc}")
    serve_dir = tmp_path_factory.mktemp("serve")
    mp = pytest.MonkeyPatch()
    mp.setattr(server, "serve_dir", lambda: serve_dir)
    t0 = time.monotonic()
    # no torch.compile, and the engine in one process (on 2 cores: 18 s to start against 28 s, the
    # benchmark 33 s against 55 s): this test checks cache hits and decisions, and times no serving
    state = server.start(MODEL, owner="pytest", eager=True, one_process=True)
    started_s = time.monotonic() - t0
    try:
        yield state, started_s
    finally:
        server.stop(state)
        mp.undo()
        assert not server._group_alive(state.pid), "a vLLM process outlived `stop`"


@pytest.mark.timeout(BUDGET_S)
def test_erratum_keeps_the_prefix_cache_and_the_edit_does_not(vllm_server, tmp_path):
    from kvprobe.serving.bench import Bench, BenchConfig

    state, started_s = vllm_server
    assert server.healthy(state.url) and server.read_state(server.state_path()) == state and state.one_process
    cfg = BenchConfig(model=MODEL, rates=[math.inf], n=12, max_s=60, policy_tokens=1500)
    t0 = time.monotonic()
    path = Bench(cfg, state.url, tmp_path).run()
    bench_s = time.monotonic() - t0
    df = pd.read_parquet(path)
    s = measure.summarize(df).set_index("arm")
    print(f"\nstart-up {started_s:.0f} s, benchmark {bench_s:.0f} s\n{s.round(3).to_string()}")
    assert df["ok"].all() and len(df) == 4 * 12
    assert df["cached_reported"].all()  # --enable-prompt-tokens-details reached the server
    for arm, r in s.iterrows():  # the two measures of the hit rate agree
        assert r.hit_rates_agree, (arm, r.hit_rate_metrics, r.hit_rate_usage)
    erratum, edit = s.loc["erratum"], s.loc["edit_unique"]
    assert erratum.hit_rate_metrics > 0.8 and erratum.hit_rate_metrics >= 0.9 * erratum.ceiling
    assert edit.hit_rate_metrics < 0.1 and erratum.hit_rate_metrics > 8 * edit.hit_rate_metrics
    assert s.loc["unchanged"].hit_rate_metrics > 0.9
    assert (s.hit_rate_usage <= s.ceiling + 1e-9).all()  # the ceiling bounds each arm (sums: order-free)
    assert erratum.ttft_p50 < edit.ttft_p50  # a cached prefix is faster to the first token



@pytest.mark.timeout(BUDGET_S)
def test_the_prompt_state_on_vllm(vllm_server, tmp_path):
    """The prompt state's messages on the real engine: the server's chat template gives kvprobe's
    token ids, a note after the cached prefix hits its blocks, the decision comes from the logprobs;
    then the agent workload end to end (its rerender and erratum arms: SmolLM2 has no field policy)."""
    from kvprobe.calibrate.engine import load_spec
    from kvprobe.datasets.spans import option_ids
    from kvprobe.serving import agent, client
    from kvprobe.serving.bench import load_tokenizer
    from kvprobe.serving.state import PromptState

    state, _ = vllm_server
    tok = load_tokenizer(MODEL)
    spec = load_spec("examples/calibrate-refund-clear.yaml")
    ps = PromptState(spec, {"tier": "bronze", "received": "2026-01-02 03:04", "request_id": "req-271828"})
    first = client.stream_chat(state.url, MODEL, ps.messages())
    ps.update(tier="gold")
    second = client.stream_chat(state.url, MODEL, ps.messages())
    assert first.error is None and second.error is None, (first.error, second.error)
    ids = {o: option_ids(tok, o) for o in spec.options}
    assert second.prompt_tokens == len(ps.ids(tok)) and first.prompt_tokens < second.prompt_tokens
    shared = measure.shared_prefix(PromptState(spec, ps.prefix).ids(tok), ps.ids(tok))
    assert second.cached_tokens == state.block_size * (shared // state.block_size)  # every full block of the prefix
    assert len(second.top_logprobs) == client.TOP_LOGPROBS and client.decide(second.top_logprobs, ids)[0] != "?"

    cfg = agent.AgentConfig(model=MODEL, spec="examples/calibrate-refund-clear.yaml", gating=["tier"],
                            arms=["rerender", "erratum"], rates=[math.inf], sessions=3, turns=2, policy_tokens=1000)
    df = pd.read_parquet(agent.AgentBench(cfg, state.url, tmp_path / "agent").run())
    s = agent.summarize(df).set_index("arm")
    print(f"\n{s.round(3).to_string()}")
    assert df["ok"].all() and len(df) == 2 * 3 * 2 and (df["prompt_tokens"] == df["local_tokens"]).all()
    assert (s.hit_rates_agree == True).all()  # noqa: E712
    assert (s.hit_rate_usage <= s.ceiling + 1e-9).all()  # the ceiling bounds each arm
    # a rerender misses from the first changed field on, unless a turn sets a field back to the session's first
    # value (then its prompt is the warm one: one request in six is a sixth of the arm)
    assert s.loc["erratum", "hit_rate_metrics"] > 0.8 > 0.5 > s.loc["rerender", "hit_rate_metrics"]
