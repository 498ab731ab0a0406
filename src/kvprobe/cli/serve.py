"""``kvprobe serve setup|start|stop|status`` and ``kvprobe serve-bench``: the erratum on a real vLLM server."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.table import Table

from kvprobe.cli import options as opt
from kvprobe.cli.common import console, err_console, progress_bar, usable_out
from kvprobe.errors import EnvironmentProblem, UsageError

serve_app = typer.Typer(help="A vLLM server (CPU build, in its own environment) for the serving benchmark.",
                        no_args_is_help=True)


@serve_app.command("setup")
def setup() -> None:
    """Create the vLLM environment under KVPROBE_HOME (once, with uv; about 45 s and 3.4 GB)."""
    import time

    from kvprobe.serving import env

    start = time.perf_counter()
    with err_console.status("checking the vLLM environment") as status:
        def step(name: str) -> None:
            console.print(f"[dim]{time.perf_counter() - start:6.1f} s[/dim] {name}")
            status.update(name)

        venv, did = env.setup(progress=lambda line: status.update(line), step=step)
    if did:
        console.print(f"vLLM ({env.vllm_version(venv)}) ready in {venv} ({time.perf_counter() - start:.0f} s)")
    else:
        console.print(f"vLLM ({env.vllm_version(venv)}) is already set up in {venv}")


@serve_app.command("start")
def start(model: str = typer.Option(..., help="a bundled alias, see `kvprobe models`"),
          timeout: float = typer.Option(420.0, min=10, help="seconds to wait for the server's health"),
          eager: bool = typer.Option(False, "--eager", help="vLLM's --enforce-eager: no torch.compile at start-up "
                                     "(40-60 s instead of 100-160 s for SmolLM2 on 2 cores; serves slower)"),
          one_process: bool = typer.Option(
              False, "--one-process", help="vLLM's engine in the server's own process "
              "(VLLM_ENABLE_V1_MULTIPROCESSING=0): no engine-core and worker processes spinning on a core; on 2 "
              "cores it started and served a full prefill 1.6-1.8x faster, a cached prompt's first token came later "
              "(benchmarks/vllm_one_process.py)")) -> None:
    """Start the vLLM OpenAI server for MODEL on 127.0.0.1 (a free port) and wait until it is healthy."""
    import time

    from kvprobe.serving import server

    t0 = time.perf_counter()
    with err_console.status(f"starting vLLM for {model}") as status:
        state = server.start(model, timeout_s=timeout, progress=lambda msg: status.update(msg), eager=eager,
                             one_process=one_process)
    console.print(f"vLLM serving {model} at {state.url} (pid {state.pid}, block size {state.block_size}"
                  f"{', eager' if state.eager else ''}{', one process' if state.one_process else ''}, "
                  f"ready in {time.perf_counter() - t0:.0f} s); log {state.log}; stop it with `kvprobe serve stop`")


@serve_app.command("stop")
def stop() -> None:
    """Stop the server `kvprobe serve start` started (its whole process group)."""
    from kvprobe.serving import server

    state = server.stop()
    console.print(f"stopped the vLLM server for {state.model} (pid {state.pid}, {state.url})")


@serve_app.command("status")
def status() -> None:
    """Say whether the environment is set up and whether a server is running."""
    from kvprobe.serving import env, server

    console.print(f"environment: {'ready, vLLM ' + str(env.vllm_version()) if env.is_ready() else 'not set up'} "
                  f"({env.venv_dir()})")
    state = server.read_state()
    console.print("server: none running" if state is None else
                  f"server: {state.model} at {state.url}, pid {state.pid}, started by `kvprobe {state.owner}`")


def _fmt(x, digits: int = 2, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if x is None or not math.isfinite(float(x)) else f"{float(x) * scale:.{digits}f}{unit}"


def print_summary(summary, ratios, title: str) -> None:
    from kvprobe.serving.measure import rate_label

    table = Table(title=title)
    for col in ("rate /s", "arm", "ok/n", "hit rate (metrics)", "hit rate (usage)", "agree", "ceiling",
                "TTFT p50", "p90", "p99", "req/s", "decision agreement"):
        table.add_column(col, justify="right", no_wrap=col == "arm")
    for r in summary.itertuples():
        agree = {True: "yes", False: "[red]NO[/red]", None: "n/a"}[r.hit_rates_agree]
        table.add_row(rate_label(r.rate), r.arm, f"{r.ok}/{r.n}", _fmt(r.hit_rate_metrics, 1, 100, "%"),
                      _fmt(r.hit_rate_usage, 1, 100, "%"), agree, _fmt(r.ceiling, 1, 100, "%"),
                      _fmt(r.ttft_p50, 0, 1000, " ms"), _fmt(r.ttft_p90, 0, 1000, " ms"),
                      _fmt(r.ttft_p99, 0, 1000, " ms"), _fmt(r.throughput, 2),
                      f"{_fmt(r.agreement, 2)} (n={r.n_agreement})")
    console.print(table)
    above = [f"{rate_label(r.rate)}/{r.arm}" for r in summary.itertuples() if r.hit_rate_usage > r.ceiling + 0.01]
    if above:
        console.print(f"[yellow]note:[/yellow] hit rate above the ceiling in {', '.join(above)}: the server held "
                      f"these prompts from before this benchmark")
    stuck = sorted({r.arm for r in summary.itertuples() if r.arm != "unchanged" and r.distinct_references == 1})
    if stuck:
        console.print(f"[yellow]note:[/yellow] the oracle gave one answer for every value in the runs of "
                      f"{', '.join(stuck)}: there, decision agreement cannot tell a right answer from a stuck one")
    if len(ratios):
        t = Table(title="erratum against the in-prefix edit (unique values)")
        for col in ("rate /s", "TTFT p50 edit/erratum", "TTFT p90 edit/erratum", "throughput erratum/edit",
                    "hit rate erratum", "hit rate edit"):
            t.add_column(col, justify="right")
        for r in ratios.itertuples():
            t.add_row(rate_label(r.rate), _fmt(r.ttft_p50_ratio, 1, unit="x"), _fmt(r.ttft_p90_ratio, 1, unit="x"),
                      _fmt(r.throughput_ratio, 1, unit="x"), _fmt(r.hit_rate_erratum, 1, 100, "%"),
                      _fmt(r.hit_rate_edit, 1, 100, "%"))
        console.print(t)


AGENT_ONLY = ("spec", "field_policy", "sessions", "turns", "gating_share", "gating")
SINGLE_ONLY = ("n", "domain", "erratum_template")
ENGINES = ("vllm", "llama.cpp")


def engine_bench(cfg, out: Path | None) -> None:
    """``serve-bench --workload agent --engine llama.cpp``: the four arms on llama.cpp, in this process."""
    import time

    from kvprobe.results import ENGINE_MANIFEST, read_table, refuse_foreign
    from kvprobe.serving import engine_agent as ea
    from kvprobe.serving.llamacpp import llama_cpp
    from kvprobe.serving.measure import rate_label

    llama_cpp()  # installed? (one line if not)
    out = usable_out(out or Path("results") / f"agent-llamacpp-{Path(cfg.model).name}")
    refuse_foreign(out, ENGINE_MANIFEST)
    t0 = time.perf_counter()
    run = ea.EngineAgentBench(cfg, out, progress=err_console.print)  # every input checked, the GGUF fetched
    with progress_bar() as bar:
        task = bar.add_task("serve-bench (llama.cpp)", total=run.total())
        run.progress, run.advance = (lambda msg: bar.update(task, description=msg)), (lambda: bar.advance(task))
        path = run.run()
    df = read_table(path)
    summary = ea.summarize(df, cfg.rates, cfg.seed)
    table = Table(title=f"serve-bench --workload agent --engine llama.cpp {cfg.model}: {int(df.prompt_tokens.mean())} "
                        f"prompt tokens on average ({time.perf_counter() - t0:.0f} s)")
    for col in ("rate /s", "arm", "n", "TTFT p50", "p90", "req/s", "recomputed/update", "fallbacks",
                "gating: agree [95% CI]", "inert: agree [95% CI]", f"state ({run.check_field}) [95% CI]"):
        table.add_column(col, justify="right", no_wrap=col == "arm")

    def share(r, name: str) -> str:
        k, n = getattr(r, f"{name}_k"), getattr(r, f"{name}_n")
        return f"{k}/{n} [{_fmt(getattr(r, f'{name}_lo'), 2)}, {_fmt(getattr(r, f'{name}_hi'), 2)}]" if n \
            else "n/a (n=0)"

    for r in summary.itertuples():
        ref = r.arm == ea.REFERENCE
        table.add_row(rate_label(r.rate), r.arm, str(r.n), _fmt(r.ttft_p50_s, 0, 1000, " ms"),
                      _fmt(r.ttft_p90_s, 0, 1000, " ms"), _fmt(r.req_per_s, 2), _fmt(r.recomputed_per_update, 1),
                      str(r.fallbacks), "reference" if ref else share(r, "gating"),
                      "reference" if ref else share(r, "inert"), share(r, "state"))
    console.print(table)
    for column, what in (("turn", "updates so far in the session"), ("check_updates", f"updates of {run.check_field}")):
        t = Table(title=f"by {what}")
        for col in ("arm", "updates", "agree with rerender [95% CI]", f"state ({run.check_field}) [95% CI]"):
            t.add_column(col, justify="right")
        for r in ea.by_updates(df, column).itertuples():
            t.add_row(r.arm, r.updates, share(r, "agree"), share(r, "state"))
        console.print(t)
    console.print("one llama.cpp slot: each request's service time measured once, queued first come first served "
                  "at each rate's Poisson arrivals; state: the check's answer holds the field's current value "
                  "(checks after at least one update of it)")
    console.print(f"wrote {path}")


def print_agent_summary(summary, title: str) -> None:
    from kvprobe.serving.measure import rate_label

    table = Table(title=title)
    for col in ("rate /s", "arm", "ok/n", "hit rate", "ceiling", "TTFT p50", "p90", "req/s", "notes", "ties",
                "gating: agree [95% CI]", "inert: agree [95% CI]"):
        table.add_column(col, justify="right", no_wrap=col == "arm")

    def agree(r, kind: str) -> str:
        k, n = getattr(r, f"{kind}_k"), getattr(r, f"{kind}_n")
        if not n:
            return "n/a (n=0)"
        return f"{k}/{n} [{_fmt(getattr(r, f'{kind}_lo'), 2)}, {_fmt(getattr(r, f'{kind}_hi'), 2)}]"

    for r in summary.itertuples():
        ref = r.arm == "rerender"
        table.add_row(rate_label(r.rate), r.arm, f"{r.ok}/{r.n}", _fmt(r.hit_rate_metrics, 1, 100, "%"),
                      _fmt(r.ceiling, 1, 100, "%"), _fmt(r.ttft_p50, 0, 1000, " ms"), _fmt(r.ttft_p90, 0, 1000, " ms"),
                      _fmt(r.throughput, 2), _fmt(r.notes_share, 0, 100, "%"), str(r.ties),
                      "reference" if ref else agree(r, "gating"), "reference" if ref else agree(r, "inert"))
    console.print(table)
    bad = [f"{rate_label(r.rate)}/{r.arm}" for r in summary.itertuples() if r.hit_rates_agree is False]
    if bad:
        console.print(f"[yellow]note:[/yellow] /metrics and usage hit rates differ in {', '.join(bad)}")


def serve_bench(model: str = typer.Option(..., help="bundled alias (or local HF folder) the server serves"),
                url: str | None = typer.Option(None, help="an OpenAI-compatible vLLM server; default: kvprobe's "
                                                          "running server, or one started (and stopped) for this run"),
                out: Path | None = typer.Option(None, help="results folder (default results/serving-MODEL, "
                                                           "results/agent-MODEL for the agent workload)"),
                workload: str = typer.Option("single", help="single: one decision field, four arms; agent: "
                                                            "sessions whose fields change every turn"),
                rates: str | None = typer.Option(None, help="Poisson arrival rates per second; inf = saturation "
                                                            "[single: 0.5,1,2,inf; agent: 0.2,inf]"),
                n: int | None = typer.Option(None, min=1, help="single: requests per (rate, arm) run [16]"),
                max_s: float | None = typer.Option(None, min=1, help="per run: no new request after this many "
                                                                     "seconds [single: 60; agent: 600]"),
                arms: str | None = typer.Option(None, help="arms to run [single: unchanged,edit_unique,edit_set,"
                                                           "erratum; agent: rerender,erratum,policy; "
                                                           "llama.cpp: and policy+edit]"),
                policy_tokens: int = typer.Option(1500, help="length of the static policy prompt (1000-8000; "
                                                             "agent: 0 serves the template as it is)"),
                domain: str | None = typer.Option(None, help="single: the policy's domain (default: seeded choice)"),
                erratum_template: str | None = typer.Option(None, help="single: paper, short [default], a top-K "
                                                                       "YAML file or a literal template"),
                spec: Path | None = typer.Option(None, help="agent: the template, a calibration spec (YAML)"),
                field_policy: Path | None = typer.Option(None, help="agent: its field_policy.yaml from `kvprobe "
                                                                    "calibrate` (the policy arm; the gating fields)"),
                sessions: int | None = typer.Option(None, min=1, help="agent: sessions per rate [8]"),
                turns: int | None = typer.Option(None, min=1, help="agent: turns per session, one field update "
                                                                   "each [6]"),
                gating_share: float | None = typer.Option(None, min=0, max=1, help="agent: share of turns that "
                                                                                   "update a gating field [0.25]"),
                gating: str | None = typer.Option(None, help="agent: the gating fields (default: those the field "
                                                             "policy measured as moving the decision)"),
                eager: bool = typer.Option(False, "--eager", help="start the run's own server in vLLM's eager mode "
                                                                  "(see `kvprobe serve start --eager`)"),
                one_process: bool = typer.Option(False, "--one-process", help="start the run's own server with "
                                                 "its engine in one process (see `kvprobe serve start --one-process`)"),
                engine: str = typer.Option("vllm", help="vllm (a server), or llama.cpp: the agent workload in this "
                                                        "process, with the policy+edit arm (docs/serving.md)"),
                threads: int = typer.Option(1, min=1, help="llama.cpp: threads for the model"),
                gpu_layers: int = typer.Option(0, min=-1, help="llama.cpp: layers on a GPU (a CUDA build of "
                                                               "llama-cpp-python; -1: all)"),
                state_field: str | None = typer.Option(None, help="llama.cpp: the inert field the state check asks "
                                                                  "for [request_id, else the first inert field]"),
                seed: int = 0) -> None:
    """Erratum against in-prefix edit under Poisson load: prefix-cache hit rate, TTFT, throughput and
    decision agreement, into RESULTS/serving.parquet (the agent workload: RESULTS/agent.parquet;
    resumable: run it again after a crash)."""
    import time

    from pydantic import ValidationError

    from kvprobe.results import SERVING_MANIFEST, refuse_foreign
    from kvprobe.serving import agent, bench, server
    from kvprobe.serving.client import ServerGone, normalize_url, served_models
    from kvprobe.serving.measure import parse_rates

    given = {k: v for k, v in locals().items() if k in AGENT_ONLY + SINGLE_ONLY and v is not None}
    if workload not in ("single", "agent"):
        raise UsageError(f"unknown workload {workload!r}; accepted: single, agent")
    if engine not in ENGINES:
        raise UsageError(f"unknown engine {engine!r}; accepted: {', '.join(ENGINES)}")
    engine_only = [k for k, v in (("state-field", state_field is not None), ("threads", threads != 1),
                                  ("gpu-layers", gpu_layers != 0)) if v]
    if engine == "vllm" and engine_only:
        raise UsageError(f"--{engine_only[0]} applies to --engine llama.cpp")
    foreign = [k for k in (SINGLE_ONLY if workload == "agent" else AGENT_ONLY) if k in given]
    if foreign:
        raise UsageError(f"--{foreign[0].replace('_', '-')} does not apply to the {workload} workload; "
                         f"{'agent' if workload == 'single' else 'single'} only")
    try:
        if workload == "agent":
            if spec is None:
                raise UsageError("the agent workload needs --spec TEMPLATE.yaml (a calibration spec, e.g. "
                                 "examples/agent-refund.yaml)")
            from kvprobe.serving import engine_agent

            on_engine = engine == "llama.cpp"
            config, default_arms = (engine_agent.EngineAgentConfig, engine_agent.ARMS) if on_engine \
                else (agent.AgentConfig, agent.ARMS)
            cfg = config(model=model, spec=str(spec), field_policy=str(field_policy) if field_policy else None,
                         rates=parse_rates(rates or agent.DEFAULT_RATES), sessions=sessions or 8, turns=turns or 6,
                         gating_share=0.25 if gating_share is None else gating_share,
                         gating=opt.parse_csv(gating) if gating else None,
                         arms=opt.parse_csv(arms) if arms else list(default_arms), policy_tokens=policy_tokens,
                         max_s=max_s or 600.0, seed=seed,
                         **(dict(threads=threads, state_field=state_field, gpu_layers=gpu_layers) if on_engine
                            else {}))
            from kvprobe.calibrate.spec import load_spec

            base = load_spec(spec)  # a bad template fails before any server starts
            if field_policy is not None:  # and so does a policy that is not evidence, or not of this template
                from kvprobe.editor.strategies import parse_strategy
                from kvprobe.field_policy import FieldPolicy, load_any

                policy = load_any(field_policy, None, parse_strategy)
                if isinstance(policy, FieldPolicy):
                    policy.check_fields(base.fields, spec)
        else:
            cfg = bench.BenchConfig(model=model, rates=parse_rates(rates or bench.DEFAULT_RATES), n=n or 16,
                                    max_s=max_s or 60.0, arms=opt.parse_csv(arms) if arms else list(bench.ARMS),
                                    policy_tokens=policy_tokens, seed=seed, domain=domain,
                                    erratum_template=erratum_template or "short")
            bench.resolve_template(cfg.erratum_template)  # a bad template fails before any server starts
    except ValidationError as exc:
        raise UsageError.from_validation(exc, "serve-bench") from None
    if engine == "llama.cpp":
        if workload != "agent" or url is not None or eager or one_process:
            raise UsageError("--engine llama.cpp runs the agent workload in this process: give --workload agent, "
                             "and no --url, --eager or --one-process")
        if max_s is not None:
            raise UsageError("--max-s applies to --engine vllm; llama.cpp serves every request of a run (its "
                             "queueing is replayed from the measured service times)")
        return engine_bench(cfg, out)
    bench.check_model(model)  # so does an unknown model
    prefix = "agent" if workload == "agent" else "serving"
    out = usable_out(out or Path("results") / f"{prefix}-{Path(model).name}")
    refuse_foreign(out, SERVING_MANIFEST)  # before a server starts: another command's folder is refused
    own = None
    mode = "--eager" if eager else "--one-process" if one_process else None
    if mode and (url is not None or server.read_state() is not None):
        raise UsageError(f"{mode} applies to a server serve-bench starts for the run; this run uses "
                         f"{'--url' if url is not None else 'the running kvprobe server'} (a server's mode is "
                         f"set when it starts: `kvprobe serve start {mode}`)")
    if url is not None:
        url = normalize_url(url)
        served_models(url)  # reachable?
    else:
        running = server.read_state()
        if running is not None and running.model != model:
            raise EnvironmentProblem(f"kvprobe's running server serves {running.model}, not {model}; "
                                     f"run `kvprobe serve stop` first, or pass --url")
        if running is not None:
            url = running.url
        else:
            from kvprobe.serving import env

            env.require_ready()
            t0 = time.perf_counter()
            with err_console.status(f"starting vLLM for {model} (for this run only)") as status:
                own = server.start(model, owner="serve-bench", progress=lambda msg: status.update(msg), eager=eager,
                                   one_process=one_process)
            url = own.url
            err_console.print(f"vLLM ready at {url} in {time.perf_counter() - t0:.0f} s (stopped after the run)")
    t0 = time.perf_counter()
    try:
        with progress_bar() as bar:
            task = bar.add_task("serve-bench", total=None)
            kw = dict(progress=lambda msg: bar.update(task, description=msg), advance=lambda: bar.advance(task),
                      facts={"own_server": own is not None,
                             **({"eager": own.eager, "one_process": own.one_process} if own else {})})
            run = agent.AgentBench(cfg, url, out, **kw) if workload == "agent" else bench.Bench(cfg, url, out, **kw)
            bar.update(task, total=run.total())
            path = run.run()
    except ServerGone as exc:
        if own is not None:
            raise ServerGone(f"{exc}; server log {own.log}: {server.log_tail(own.log, 6)}") from None
        raise
    finally:
        if own is not None:
            server.stop(own)
    wall = time.perf_counter() - t0
    if workload == "agent":
        from kvprobe.results import read_table

        summary = agent.summarize(read_table(path))
        print_agent_summary(summary, f"serve-bench --workload agent {model}: {int(summary.prompt_tokens.mean())} "
                                     f"prompt tokens on average, block size {run.block_size} ({wall:.0f} s)")
        console.print("agreement: with the rerender arm's decision for the same session and turn; ties: requests "
                      "whose two options scored the same (the first option is taken)")
        if run.calibrated_on in ("unpadded", "other"):
            what = "the template without the policy clauses" if run.calibrated_on == "unpadded" else "another template"
            console.print(f"[yellow]note:[/yellow] the field policy was calibrated on {what}; calibrate "
                          f"{out / agent.SPEC_FILE} to measure it on exactly what was served")
    else:
        summary, ratios = bench.summarize_folder(out)
        print_summary(summary, ratios, f"serve-bench {model}: {int(summary.prompt_tokens.mean())} prompt tokens, "
                                       f"block size {run.block_size} ({wall:.0f} s)")
    console.print(f"wrote {path}")
