"""The serving benchmark's parts that need no vLLM: prompts, the Poisson schedule, Prometheus
parsing, hit-rate arithmetic, the state file, the benchmark loop against a stand-in server
(resume, a server that dies) and the one-line errors."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pandas as pd
import pytest

from kvprobe.datasets import ERRATUM, SHORT_ERRATUM
from kvprobe.errors import KvprobeError
from kvprobe.results import SERVING, SERVING_MANIFEST
from kvprobe.serving import measure
from kvprobe.serving.prompts import (ARMS, MAX_POLICY_TOKENS, arm_values, build_policy, set_values,
                                     unique_values)
from tests import cli_process
from tests.serving.conftest import MODEL


# -- prompts ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy(byte_tokenizer):
    return build_policy(byte_tokenizer, 1500, seed=3)


@pytest.mark.parametrize("target", [1000, 2500])
def test_policy_has_about_the_asked_length(byte_tokenizer, target):
    p = build_policy(byte_tokenizer, target, seed=1)
    assert abs(len(p.ids(byte_tokenizer)) - target) <= 80  # within about one clause


def test_policy_rejects_bad_lengths_and_domains(byte_tokenizer):
    with pytest.raises(KvprobeError, match=r"\[1000, 8000\]"):
        build_policy(byte_tokenizer, MAX_POLICY_TOKENS + 1)
    with pytest.raises(KvprobeError, match="unknown domain 'casino'.*retail_refund"):
        build_policy(byte_tokenizer, 1000, domain="casino")


def test_erratum_keeps_the_prefix_and_sits_before_the_question(byte_tokenizer, policy):
    tok = byte_tokenizer
    base = policy.text(tok)
    value = unique_values(policy, 1)[0]
    text = policy.text(tok, erratum_value=value)
    line = f"[STATE UPDATE] {policy.field} -> {value}; overrides any earlier value."
    assert line == SHORT_ERRATUM.format(field=policy.field, value=value)
    assert text.count(line) == 1
    cut = text.index(line)
    assert base[:cut] == text[:cut]  # the whole prefix (the policy, the base value) is unchanged
    assert text.index("## Request") > cut and text.rindex("Clause ") < cut
    assert f"{policy.field}: {policy.base_value}" in text[:cut]
    ids, base_ids = policy.arm_prompt(tok, "erratum", value), policy.ids(tok)
    assert measure.shared_prefix(ids, base_ids) >= 0.9 * len(base_ids)


def test_in_prefix_edit_changes_the_field_early(byte_tokenizer, policy):
    value = unique_values(policy, 1)[0]
    ids = policy.arm_prompt(byte_tokenizer, "edit_unique", value)
    text = policy.text(byte_tokenizer, value)
    assert f"{policy.field}: {value}\n" in text and "[STATE UPDATE]" not in text
    assert measure.shared_prefix(ids, policy.ids(byte_tokenizer)) < 0.15 * len(ids)
    assert policy.arm_prompt(byte_tokenizer, "unchanged", value) == policy.ids(byte_tokenizer)


def test_values_per_arm(policy):
    unique = unique_values(policy, 50) + unique_values(policy, 50, start=50)
    assert len(set(unique)) == 100
    assert {v.split(" ")[0] for v in unique} <= set(policy.value_set)
    assert {policy.expected(v) for v in unique} == {"yes", "no"}  # both decisions occur
    small = set_values(policy, 40, seed=1)
    assert set(small) <= set(policy.value_set) and len(set(small)) > 1
    assert arm_values(policy, "unchanged", 3, 0, 0) == [policy.base_value] * 3
    assert arm_values(policy, "erratum", 5, 10, 0) == arm_values(policy, "edit_unique", 5, 10, 0)
    a, b = unique_values(policy, 5, salt="3f9a1c2e"), unique_values(policy, 5, salt="0b17d4aa")
    assert not set(a) & set(b) and a[0].split("T")[0] != b[0].split("T")[0]  # apart early: the dates differ
    with pytest.raises(KvprobeError, match="unknown arm"):
        arm_values(policy, "rewrite", 1, 0, 0)


def test_erratum_template_comes_from_the_configured_place(tmp_path):
    from kvprobe.serving.bench import resolve_template

    assert resolve_template("short") == SHORT_ERRATUM and resolve_template("paper") == ERRATUM
    topk = tmp_path / "topk.yaml"
    topk.write_text("k_star: 4\nerratum_template: 'NOTE: {field} is now {value}.'\n")
    assert resolve_template(str(topk)) == "NOTE: {field} is now {value}."
    assert resolve_template("UPDATE {field}={value}") == "UPDATE {field}={value}"
    (tmp_path / "empty.yaml").write_text("k_star: 4\n")
    for bad, needle in [("nonsense", "unknown erratum template"), ("{field} only", "bad erratum template"),
                        ("{field} {value} {oops}", "bad erratum template"),
                        (str(tmp_path / "empty.yaml"), "no erratum_template")]:
        with pytest.raises(KvprobeError, match=needle):
            resolve_template(bad)


# -- load ------------------------------------------------------------------------------------------
def test_poisson_schedule():
    s = measure.poisson_schedule(2.0, 4000, seed=7)
    gaps = [b - a for a, b in zip(s, s[1:])]
    assert s[0] == 0.0 and all(g >= 0 for g in gaps)
    assert abs(sum(gaps) / len(gaps) - 0.5) < 0.03  # mean gap 1/rate
    cv = (sum((g - 0.5) ** 2 for g in gaps) / len(gaps)) ** 0.5 / 0.5
    assert 0.9 < cv < 1.1  # exponential gaps: coefficient of variation 1, not a fixed clock
    assert s == measure.poisson_schedule(2.0, 4000, seed=7) and s != measure.poisson_schedule(2.0, 4000, seed=8)
    assert measure.poisson_schedule(math.inf, 5) == [0.0] * 5
    with pytest.raises(KvprobeError):
        measure.poisson_schedule(0.0, 3)


def test_parse_rates():
    assert measure.parse_rates("2, 0.5,inf,2") == [0.5, 2.0, math.inf]
    assert measure.rate_label(math.inf) == "inf" and measure.rate_label(0.5) == "0.5"
    for bad in ("", "0", "-1", "fast", "1,,x"):
        with pytest.raises(KvprobeError, match="rate"):
            measure.parse_rates(bad)


# -- Prometheus text -------------------------------------------------------------------------------
VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2-135m"} 3000.0
vllm:prefix_cache_queries_total{engine="1",model_name="smollm2-135m"} 1000.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2-135m"} 2560.0
vllm:prefix_cache_hits_total{engine="1",model_name="smollm2-135m"} 0.0
vllm:prefix_cache_hits_created{engine="0",model_name="smollm2-135m"} 1.7e9
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0"} 1.0
vllm:num_requests_running{engine="0",model_name="a \\"quoted\\" name"} 2.0
"""


def test_parse_vllm_metrics():
    samples = measure.parse_prometheus(VLLM_METRICS)
    assert measure.counter(samples, measure.QUERIES) == 4000.0  # summed over engines
    assert measure.counter(samples, "vllm:prefix_cache_hits_total") == 2560.0  # not the _created sample
    assert measure.counter(samples, "vllm:no_such_counter") is None
    assert measure.block_size_of(samples) == 32
    assert ("vllm:num_requests_running", {"engine": "0", "model_name": 'a "quoted" name'}, 2.0) in samples
    later = measure.parse_prometheus(VLLM_METRICS.replace("3000.0", "4500.0").replace("2560.0", "3968.0"))
    assert measure.metrics_delta(samples, later) == (1500.0, 1408.0)
    assert measure.metrics_delta(samples, measure.parse_prometheus("")) == (None, None)
    with pytest.raises(KvprobeError, match="restarted"):
        measure.metrics_delta(later, samples)
    with pytest.raises(KvprobeError, match="not Prometheus text"):  # prometheus_client's parser refuses junk
        measure.parse_prometheus(VLLM_METRICS + "not a sample line\n")


# -- hit-rate arithmetic ---------------------------------------------------------------------------
def test_block_ceiling():
    c = measure.BlockCeiling(32)
    a = list(range(100))
    assert c.add(a) == 0  # nothing seen yet
    assert c.add(a) == 96  # (100 - 1) // 32 = 3 blocks; never the last token
    b = a[:70] + [999] * 30
    assert c.add(b) == 64  # two whole blocks shared; the third differs at token 70
    assert c.add(a[:96]) == 64  # 96 tokens: the third block would hold the last token
    moved = [7] + a[:99]
    assert c.add(moved) == 0  # the same tokens one position later share no block
    assert measure.static_ceiling(1465, 1528, 32) == pytest.approx(1440 / 1528)
    assert measure.static_ceiling(5000, 1528, 32) == pytest.approx(1504 / 1528)  # capped at P - 1
    assert math.isnan(measure.hit_rate(10, 0)) and measure.hit_rate(30, 40) == 0.75


def _rows(arm, rate, n, prompt, cached, ceiling, ttft, agree, queries, hits, wall):
    return [{"rate": rate, "arm": arm, "ok": True, "prompt_tokens": prompt, "cached_tokens": float(cached),
             "reference": "yes" if arm == "edit_unique" else ("yes", "no", "?")[i % 3],
             "cached_reported": True, "ceiling_tokens": ceiling, "ttft_s": ttft[i % len(ttft)],
             "agree": float(agree[i % len(agree)]), "run_queries": queries, "run_hits": hits, "run_wall_s": wall}
            for i in range(n)]


def test_summary_and_ratios():
    df = pd.DataFrame(_rows("erratum", 1.0, 10, 1000, 900, 960, [0.1, 0.2], [1, 1, 1, 0], 10000.0, 9000.0, 10.0)
                      + _rows("edit_unique", 1.0, 10, 1000, 32, 32, [1.0, 2.0], [1], 10000.0, 2000.0, 20.0))
    s = measure.summarize(df).set_index("arm")
    e, x = s.loc["erratum"], s.loc["edit_unique"]
    assert e.hit_rate_metrics == pytest.approx(0.9) and e.hit_rate_usage == pytest.approx(0.9) and e.hit_rates_agree
    assert x.hit_rate_metrics == pytest.approx(0.2) and x.hit_rate_usage == pytest.approx(0.032)
    assert not x.hit_rates_agree  # the two measures must agree, and here they do not
    assert e.ceiling == pytest.approx(0.96)
    assert e.ttft_p50 == pytest.approx(0.15) and e.ttft_p90 == pytest.approx(0.2)
    assert e.throughput == pytest.approx(1.0) and x.throughput == pytest.approx(0.5)
    assert e.agreement == pytest.approx(0.8) and x.agreement == 1.0
    assert e.distinct_references == 2 and x.distinct_references == 1  # "?" (no option named) is not an answer
    r = measure.ratios(measure.summarize(df)).iloc[0]
    assert r.ttft_p90_ratio == pytest.approx(10.0) and r.throughput_ratio == pytest.approx(2.0)
    assert math.isnan(measure.percentile([], 90)) and measure.percentile([1, float("nan"), 3], 50) == 2.0


def test_usage_hit_rate_is_unknown_when_the_server_does_not_report_it():
    rows = _rows("erratum", 1.0, 4, 100, 0, 64, [0.1], [1], 400.0, 256.0, 2.0)
    df = pd.DataFrame(rows).assign(cached_tokens=float("nan"), cached_reported=False)
    s = measure.summarize(df).iloc[0]
    assert math.isnan(s.hit_rate_usage) and s.hit_rates_agree is None and s.hit_rate_metrics == 0.64


def test_parse_answer():
    from kvprobe.serving.bench import parse_answer

    assert parse_answer(" Yes, it should.") == "yes" and parse_answer("\nNo.") == "no"
    assert parse_answer("I think not") == "?" and parse_answer("") == "?"


# -- the state file ----------------------------------------------------------------------------
@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROBE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _fake_launcher(tmp_path, body: str) -> subprocess.Popen:
    """A process whose command line names the launcher, in a session of its own, like the server."""
    from kvprobe.serving import env

    script = tmp_path / env.LAUNCHER
    script.write_text(body)
    return subprocess.Popen([sys.executable, str(script)], start_new_session=True)


def test_a_launcher_just_started_counts_as_alive(tmp_path, monkeypatch):
    """Popen can return while the kernel has not yet set the child's command line (0 to 2 starts in 300 on a
    2-core Zen 4; CI failed on it): an empty one is read again, not taken for a stale PID. An empty one that stays
    empty (a kernel thread on a reused PID) is not ours."""
    from pathlib import Path

    from kvprobe.serving import server

    proc = _fake_launcher(tmp_path, "import time; time.sleep(60)\n")
    read_bytes, reads = Path.read_bytes, []
    while not read_bytes(Path(f"/proc/{proc.pid}/cmdline")):  # past its own exec: only the blanks below are empty
        time.sleep(0.01)

    def in_exec(path, blank=1):  # the first ``blank`` reads of the command line as during exec
        got = read_bytes(path)
        if path.name == "cmdline":
            reads.append(got)
            return b"" if len(reads) <= blank else got
        return got

    try:
        monkeypatch.setattr(Path, "read_bytes", in_exec)
        assert server._alive(proc.pid) and len(reads) == 2
        reads.clear()
        monkeypatch.setattr(Path, "read_bytes", lambda path: in_exec(path, blank=10**9))
        assert not server._alive(proc.pid, exec_wait_s=0.1) and len(reads) > 1
    finally:
        proc.kill()
        proc.wait()


def test_state_file_roundtrip_and_stale_states(home, tmp_path):
    from kvprobe.serving import server

    proc = _fake_launcher(tmp_path, "import time, subprocess, sys\n"
                                    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                                    "time.sleep(600)\n")
    try:
        state = server.ServerState(pid=proc.pid, port=1234, url="http://127.0.0.1:1234", model=MODEL, folder="/m",
                                   log="/l", block_size=32, started_at=time.time())
        server.write_state(state)
        assert server.read_state() == state
        time.sleep(0.5)  # let the grandchild start: stop must end the whole group
        stopped = server.stop()
        assert stopped == state and not server.state_path().exists()
        assert proc.wait(timeout=30) is not None and not server._group_alive(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # a PID that is not our launcher (reused, or never was) is stale: removed on read
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        server.write_state(server.ServerState(other.pid, 1, "u", MODEL, "f", "l", 32, 0.0))
        assert server.read_state() is None and not server.state_path().exists()
    finally:
        other.kill()
        other.wait()
    server.state_path().write_text("{not json")
    assert server.read_state() is None and not server.state_path().exists()
    with pytest.raises(KvprobeError, match="no kvprobe vLLM server is running"):
        server.stop()


def _ready_venv(home, launcher_body: str):
    """A stand-in vLLM environment: the marker, our Python, and a launcher of the test's choosing."""
    from kvprobe.serving import env

    venv = env.venv_dir()
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    env.launcher_of().write_text(launcher_body)
    (venv / env.READY_MARKER).write_text(json.dumps({"spec": env.VLLM_SPEC, "vllm_version": "test"}))
    return venv


def test_start_refuses_without_setup_and_when_running(home, tmp_path, monkeypatch):
    from kvprobe.serving import server

    with pytest.raises(KvprobeError, match="not set up.*kvprobe serve setup"):
        server.start(MODEL)
    _ready_venv(home, "raise SystemExit(0)\n")
    proc = _fake_launcher(tmp_path, "import time; time.sleep(600)\n")
    try:
        server.write_state(server.ServerState(proc.pid, 4321, "http://127.0.0.1:4321", MODEL, "f", "l", 32, 0.0))
        with pytest.raises(KvprobeError, match="already running.*127.0.0.1:4321.*kvprobe serve stop"):
            server.start(MODEL)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_failed_start_shows_the_log_tail(home, monkeypatch):
    from kvprobe.serving import server

    _ready_venv(home, "import sys\nprint('loading the model')\n"
                      "print('ValueError: No supported config format found in /m', file=sys.stderr)\nsys.exit(3)\n")
    monkeypatch.setattr(server, "_model_folder", lambda alias, progress: home / "m")
    with pytest.raises(KvprobeError) as info:
        server.start(MODEL, owner="pytest")
    msg = str(info.value)
    assert "exited with code 3" in msg and "No supported config format" in msg and "\n" not in msg
    assert server.read_state() is None and not server.state_path().exists()


@pytest.mark.parametrize("eager, one_process", [(False, False), (True, False), (False, True)])
def test_the_server_command_and_environment(home, monkeypatch, tmp_path, eager, one_process):
    """--enforce-eager exactly when asked, and vLLM's engine in one process (its multiprocessing off)
    exactly when asked; the server's processes may write their bytecode (the environment is
    installed without it) whatever the caller's PYTHONDONTWRITEBYTECODE."""
    from kvprobe.serving import server

    seen = tmp_path / "seen.json"
    _ready_venv(home, "import json, os, sys\n"
                      "got = [sys.argv[1:], os.environ.get('PYTHONDONTWRITEBYTECODE'),\n"
                      "       os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING')]\n"
                      f"json.dump(got, open({str(seen)!r}, 'w'))\n"
                      "sys.exit(3)\n")
    monkeypatch.setattr(server, "_model_folder", lambda alias, progress: home / "m")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with pytest.raises(KvprobeError, match="exited with code 3"):
        server.start(MODEL, owner="pytest", eager=eager, one_process=one_process)
    argv, no_bytecode, multiprocessing = json.loads(seen.read_text())
    assert argv[:2] == ["serve", str(home / "m")] and ("--enforce-eager" in argv) == eager
    assert no_bytecode is None and multiprocessing == ("0" if one_process else None)


def test_setup_installs_with_uv_without_bytecode_and_with_pips_indexes(tmp_path, monkeypatch):
    """uv installs (no bytecode: it compiles none unless asked), told pip's indexes, find-links and
    constraints, choosing among indexes as pip does; its cache lies in KVPROBE_HOME."""
    from kvprobe.serving import env

    monkeypatch.setenv("KVPROBE_HOME", str(tmp_path / "home"))
    ran = []
    monkeypatch.setattr(env, "_run", lambda cmd, log, what, progress, extra_env=None: ran.append((cmd, extra_env)))
    monkeypatch.setattr(env, "_pip_config", lambda: "global.find-links='/opt/wheels'\n:env:.cert='/c.pem'\n")
    monkeypatch.setattr(env.subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=0, stdout="0.32.0+cpu"))
    env.setup(tmp_path / "venv")
    install, variables = next((cmd, e) for cmd, e in ran if "install" in cmd)
    assert install[1:5] == ["pip", "install", "--python", str(tmp_path / "venv" / "bin" / "python")]
    assert install[-1] == env.VLLM_SPEC and not any("compile" in part for part in install)
    line = " ".join(install)
    assert " --index-strategy unsafe-best-match " in line and " --find-links /opt/wheels " in line
    assert " --cache-dir " + str(tmp_path / "home" / env.UV_CACHE) + " " in line
    assert variables == {"SSL_CERT_FILE": "/c.pem"}
    assert (tmp_path / "venv" / env.READY_MARKER).exists()


def test_pips_settings_become_uvs_flags_each_from_where_pip_reads_it():
    from kvprobe.serving.env import pip_settings

    listed = "\n".join([":env:.find-links='/opt/wheels'", ":env:.default-timeout='180'",
                        "global.find-links='/elsewhere'", "global.cert='/etc/ssl/certs/ca.crt'",
                        "global.extra-index-url='file:///a/simple file:///b/simple'",
                        "global.index-url='https://mirror/simple'", "install.index-url='https://inner/simple'",
                        "global.constraint='/etc/xdg/pip/constraints.txt'", "global.no-cache-dir='true'",
                        "user.find-links='/never'", "not a setting"])
    flags, variables = pip_settings(listed)
    assert flags == ["--index-url", "https://inner/simple", "--extra-index-url", "file:///a/simple",
                     "--extra-index-url", "file:///b/simple", "--find-links", "/opt/wheels",
                     "--constraint", "/etc/xdg/pip/constraints.txt"]
    assert variables == {"SSL_CERT_FILE": "/etc/ssl/certs/ca.crt", "UV_HTTP_TIMEOUT": "180"}
    assert pip_settings("") == ([], {})
    assert pip_settings("global.no-index='true'") == (["--no-index"], {})


def test_unhealthy_start_times_out_and_leaves_nothing(home, monkeypatch, tmp_path):
    from kvprobe.serving import server

    pidfile = tmp_path / "child.pid"
    _ready_venv(home, "import subprocess, sys, time\n"
                      f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      f"open({str(pidfile)!r}, 'w').write(str(c.pid))\nprint('still compiling')\ntime.sleep(600)\n")
    monkeypatch.setattr(server, "_model_folder", lambda alias, progress: home / "m")
    with pytest.raises(KvprobeError, match="not healthy after 3 s.*still compiling"):
        server.start(MODEL, owner="pytest", timeout_s=3)
    child = int(pidfile.read_text())
    time.sleep(0.2)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z"
    assert server.read_state() is None


# -- the benchmark loop against a stand-in server --------------------------------------------------
def _cfg(bench, **kw):
    base = dict(model=MODEL, rates=[math.inf, 20.0], n=6, max_s=30, policy_tokens=3000)  # bytes: the field at ~140
    return bench.BenchConfig(**{**base, **kw})


def test_bench_against_a_stand_in_server(byte_bench, fake_vllm, tmp_path):
    fake = fake_vllm()
    out = tmp_path / "run"
    path = byte_bench.Bench(_cfg(byte_bench), fake.url, out).run()
    df = pd.read_parquet(path)
    assert list(df.columns) == list(byte_bench.COLUMNS) and len(df) == 2 * len(ARMS) * 6
    assert df["ok"].all()
    # the ceiling bounds every run's cached tokens (summed: at saturation the server's order is not the send order)
    sums = df.groupby(["rate", "arm"])[["cached_tokens", "ceiling_tokens"]].sum()
    assert (sums["cached_tokens"] <= sums["ceiling_tokens"]).all()
    s = measure.summarize(df).set_index(["rate", "arm"])
    assert s["hit_rates_agree"].all()  # one run at a time: the counters' deltas are the run's own
    for rate in (20.0, math.inf):
        erratum, edit = s.loc[(rate, "erratum")], s.loc[(rate, "edit_unique")]
        assert erratum.hit_rate_usage >= 0.95 * erratum.ceiling and erratum.hit_rate_usage > 0.9
        assert edit.hit_rate_usage < 0.1 and edit.ceiling < 0.1
        assert s.loc[(rate, "unchanged"), "hit_rate_usage"] == pytest.approx(992 / 1000, abs=0.03)
    # the edit prompt with the value in place is the oracle's prompt: the same answer
    assert df[df["arm"].isin(["edit_unique", "edit_set"])]["agree"].eq(1.0).all()
    manifest = json.loads((out / SERVING_MANIFEST).read_text())
    assert manifest["block_size"] == 32 and manifest["policy"]["erratum_ceiling"] > 0.9
    assert manifest["kvprobe_serve_bench"] == 1  # its version: a newer kvprobe's manifest is refused on resume
    # a second benchmark on the same warm server: its unique values are unique still
    again = measure.summarize(pd.read_parquet(byte_bench.Bench(_cfg(byte_bench), fake.url, tmp_path / "again").run()))
    again = again.set_index("arm")
    assert (again.loc["edit_unique", "hit_rate_usage"] < 0.1).all()
    # at most a block past the ceiling: the first request per decision word shares "-> delivered (updated 20"
    assert (again.loc["erratum", "hit_rate_usage"] <= again.loc["erratum", "ceiling"] + 32 / 3000).all()
    # resuming a finished run sends nothing but the warm-up
    before = fake.completions
    byte_bench.Bench(_cfg(byte_bench), fake.url, out).run()
    assert fake.completions == before + 1
    with pytest.raises(KvprobeError, match="another configuration"):
        byte_bench.Bench(_cfg(byte_bench, n=7), fake.url, out).run()


def test_a_dying_server_leaves_finished_runs_and_resumes(byte_bench, fake_vllm, tmp_path):
    from kvprobe.serving.client import ServerGone

    out = tmp_path / "run"
    # warm-up 1 + base oracle, then unchanged (6 + 0 oracles), edit_unique (6 + 6 oracles): dies in edit_set
    fake = fake_vllm(die_after=1 + 6 + 12 + 3)
    with pytest.raises(ServerGone) as info:
        byte_bench.Bench(_cfg(byte_bench), fake.url, out).run()
    msg = str(info.value)
    assert "stopped answering" in msg and "edit_set" in msg and "run the same command again" in msg
    done = pd.read_parquet(out / SERVING)
    assert set(done["arm"]) == {"unchanged", "edit_unique"} and len(done) == 12
    fresh = fake_vllm()
    byte_bench.Bench(_cfg(byte_bench), fresh.url, out).run()  # another URL: fine, the config is the same
    df = pd.read_parquet(out / SERVING)
    assert len(df) == 2 * len(ARMS) * 6
    assert fresh.completions < 1 + 2 * len(ARMS) * 6 + 12 + 4  # the two finished runs were not redone


def test_a_resume_against_another_served_setup_is_refused(byte_bench, fake_vllm, tmp_path):
    """A serve-bench folder records what its rows came from (the weights and tokenizer of --model,
    the server's name for it, its vLLM version and KV block size): resuming it against a server with
    another block size is refused in one line, and the finished runs stay as they were (main eac58e9
    compared the settings only, and would have mixed the two servers' rows)."""
    out = tmp_path / "run"
    with pytest.raises(KvprobeError):
        byte_bench.Bench(_cfg(byte_bench), fake_vllm(die_after=1 + 6 + 12 + 3).url, out).run()
    done = sorted(p.name for p in (out / "parts").rglob("*.parquet"))
    inputs = json.loads((out / "inputs.json").read_text())
    assert inputs["model"]["block_size"] == 32 and inputs["model"]["weights"].startswith("gguf:")
    with pytest.raises(KvprobeError, match=r"another model \(block_size differ"):
        byte_bench.Bench(_cfg(byte_bench), fake_vllm(block=16).url, out).run()
    assert sorted(p.name for p in (out / "parts").rglob("*.parquet")) == done


def test_fire_respects_the_time_bound(fake_vllm):
    from kvprobe.serving.bench import fire_with
    from kvprobe.serving.client import stream_completion

    fake = fake_vllm()
    results, sent, wall = fire_with(lambda i: stream_completion(fake.url, MODEL, [1, 2, 3], max_tokens=2),
                                    [0.0, 0.05, 0.1, 5.0, 6.0], max_s=1.0)
    assert [r is not None for r in results] == [True, True, True, False, False]
    assert sent[1] >= 0.05 and all(math.isnan(s) for s in sent[3:]) and 0 < wall < 5


def test_a_completion_sends_its_token_ids_as_the_prompt(fake_vllm):
    """The ids go in the request body's ``prompt`` as the JSON list given (they travel in the openai
    client's ``extra_body``, past its per-id transform), with the request's other fields."""
    from kvprobe.serving.client import stream_completion

    fake = fake_vllm()
    ids = [7, 0, 151643, 3, 3]
    got = stream_completion(fake.url, MODEL, ids, max_tokens=2)
    assert got.error is None and got.prompt_tokens == len(ids)
    (body,) = fake.bodies
    assert body["prompt"] == ids and body["model"] == MODEL and body["max_tokens"] == 2 and body["stream"] is True
    assert body["temperature"] == 0.0 and body["stream_options"] == {"include_usage": True}


# -- one-line errors --------------------------------------------------------------------------------
def kvprobe(*args, home=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"KVPROBE_HOME": str(home)} if home else {})}
    return cli_process.run(*args, env=env, timeout=300)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


AGENT_SPEC = str(Path(__file__).resolve().parents[2] / "examples" / "agent-refund.yaml")


@pytest.mark.parametrize("args, needles", [
    (["serve-bench", "--model", "llama-9000", "--url", "http://127.0.0.1:9"], ["unknown model", "smollm2-135m"]),
    (["serve-bench", "--model", MODEL, "--url", "http://127.0.0.1:9"], ["cannot reach", "127.0.0.1:9"]),
    (["serve-bench", "--model", MODEL, "--rates", "1,fast"], ["bad rate 'fast'"]),
    (["serve-bench", "--model", MODEL, "--arms", "erratum,rewrite"], ["unknown arm", "edit_unique"]),
    (["serve-bench", "--model", MODEL], ["not set up", "kvprobe serve setup"]),
    (["serve-bench", "--model", MODEL, "--workload", "agent"], ["needs --spec"]),
    (["serve-bench", "--model", MODEL, "--workload", "agent", "--spec", AGENT_SPEC, "--n", "3"],
     ["--n does not apply to the agent workload"]),
    (["serve-bench", "--model", MODEL, "--spec", AGENT_SPEC],
     ["--spec does not apply to the single workload"]),
    (["serve-bench", "--model", MODEL, "--workload", "agent", "--spec", AGENT_SPEC, "--arms",
      "rerender,psychic"], ["unknown arm", "policy"]),
    (["serve", "start", "--model", "llama-9000"], ["not set up"]),
    (["serve", "stop"], ["no kvprobe vLLM server is running"]),
    (["serve-bench", "--model", MODEL, "--url", "http://127.0.0.1:9", "--eager"],
     ["--eager applies to a server serve-bench starts", "--url"]),
    (["serve-bench", "--model", MODEL, "--url", "http://127.0.0.1:9", "--one-process"],
     ["--one-process applies to a server serve-bench starts", "--url", "serve start --one-process"]),
])
def test_cli_errors_are_one_line(tmp_path, args, needles):
    one_line_error(kvprobe(*args, home=tmp_path / "home"), *needles)


def test_start_with_unknown_alias_after_setup(home):
    from kvprobe.serving import server

    _ready_venv(home, "raise SystemExit(0)\n")
    with pytest.raises(KvprobeError, match="unknown bundled alias 'llama-9000'; known: smollm2-135m"):
        server.start("llama-9000")


def test_cli_serve_bench_prints_the_summary(byte_bench, fake_vllm, tmp_path):
    from typer.testing import CliRunner

    from kvprobe.cli.app import app

    fake = fake_vllm()
    out = tmp_path / "cli"
    res = CliRunner().invoke(app, ["serve-bench", "--model", MODEL, "--url", fake.url, "--out", str(out),
                                   "--rates", "inf", "--n", "4", "--policy-tokens", "1000"])
    assert res.exit_code == 0, res.output
    assert "erratum against the in-prefix edit" in res.output and "edit_unique" in res.output
    assert len(pd.read_parquet(out / SERVING)) == 4 * len(ARMS)


def test_the_server_runs_bfloat16_only_where_the_cpu_computes_it(monkeypatch):
    from kvprobe.serving import server as srv

    for native, dtype in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(srv, "native_bf16", lambda: native)
        cmd = srv.command("smollm2-135m", Path("/models/x"), 8000)
        assert cmd[cmd.index("--dtype") + 1] == dtype
