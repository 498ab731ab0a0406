"""``kvprobe serve-bench``: the erratum against the in-prefix edit under Poisson load on a vLLM server.

For each rate (ascending) and each arm (:data:`~kvprobe.serving.prompts.ARMS`), one run: ``n``
requests at Poisson arrival times (the same times for every arm at a rate), no new request after
``max_s`` seconds, each streamed and timed. Around each run the server's ``/metrics`` is read, so
the prefix-cache counters' deltas belong to that run alone. After the run, the oracle answer
(greedy, one request at a time, outside any timed window) is fetched for every value not seen yet.
The base prompt is sent once before everything, as the warm-up a deployed static policy has had.

Output, in the results folder: ``parts/serving/<rate>-<arm>.parquet`` as each run finishes (a run
is never redone), ``serving.parquet`` (every part, one row per request; :data:`COLUMNS`) and
``serving_manifest.json``. Run the same command again to resume after a crash or an interrupt.
"""

from __future__ import annotations

import math
import re
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvprobe.datasets import ERRATUM_TEMPLATES
from kvprobe.errors import EnvironmentProblem, KvprobeError, UsageError
from kvprobe.experiment import Experiment
from kvprobe.results import SERVING, SERVING_MANIFEST, json_object, read_table, version_entry
from kvprobe.serving import measure
from kvprobe.serving.client import (Completion, ServerGone, get_json, scrape_metrics, stream_completion)
from kvprobe.serving.served import check_model, load_tokenizer, pick_served, weights_identity  # noqa: F401
from kvprobe.serving.prompts import ARMS, DEFAULT_POLICY_TOKENS, Policy, arm_values, build_policy

TABLE = "serving"
DEFAULT_RATES = "0.5,1,2,inf"
COLUMNS = ("model", "served_model", "rate", "arm", "request", "value", "prompt_tokens", "cached_tokens",
           "cached_reported", "ceiling_tokens", "hit_rate", "ttft_s", "latency_s", "send_s", "finish_s", "answer",
           "text", "reference", "rule_answer", "agree", "ok", "error", "run_sent", "run_wall_s", "run_queries",
           "run_hits", "block_size", "base_prompt_tokens")


class BenchConfig(BaseModel):
    """Everything that defines a serving benchmark (the URL does not: a resumed run may use another)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    rates: list[float] = measure.parse_rates(DEFAULT_RATES)
    n: int = Field(16, ge=1, le=10_000)  # requests per (rate, arm) run
    max_s: float = Field(60.0, gt=0)  # no new request after this many seconds of a run
    arms: list[str] = list(ARMS)
    policy_tokens: int = DEFAULT_POLICY_TOKENS
    seed: int = 0
    domain: str | None = None
    erratum_template: str = "short"  # a name in kvprobe.datasets.ERRATUM_TEMPLATES, or a literal template
    max_tokens: int = Field(4, ge=1, le=64)

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: list[str]) -> list[str]:
        return measure.check_arms(v, ARMS)  # the canonical order: the oracle of edit_unique serves erratum

    @field_validator("rates")
    @classmethod
    def _rates(cls, v: list[float]) -> list[float]:
        return measure.check_rates(v)


def resolve_template(name: str) -> str:
    """The erratum template the user configured: a name the erratum strategy knows ("paper",
    "short"), an exported top-K YAML file (its ``erratum_template``), or a literal template."""
    from kvprobe.serving.prompts import check_template

    if name in ERRATUM_TEMPLATES:
        return ERRATUM_TEMPLATES[name]
    if name.endswith((".yaml", ".yml")):
        import yaml

        try:
            cfg = yaml.safe_load(Path(name).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise KvprobeError(f"cannot read the erratum template from {name}: {exc}") from None
        if not isinstance(cfg, dict) or not cfg.get("erratum_template"):
            raise KvprobeError(f"{name} has no erratum_template; export one with `kvprobe export-topk`")
        return check_template(str(cfg["erratum_template"]))
    if "{" not in name:
        raise UsageError(f"unknown erratum template {name!r}; accepted: {', '.join(ERRATUM_TEMPLATES)}, "
                         f"a top-K YAML file, or a literal template with {{field}} and {{value}}")
    return check_template(name)


def parse_answer(text: str, options=("yes", "no")) -> str:
    """The first option word in a completion (case-insensitive), or "?" when it names none."""
    for word in re.findall(r"[a-z]+", text.lower()):
        if word in options:
            return word
    return "?"


def fire_with(send: Callable[[int], Completion], schedule: list[float], max_s: float,
              on_done: Callable[[], None] = lambda: None) -> tuple[list[Completion | None], list[float], float]:
    """Call ``send(i)`` for request ``i`` at its ``schedule`` offset, one thread each; wait for them all.

    Returns (completions, send offsets, wall seconds from the start to the last completion). A
    request not sent (past ``max_s``, or after the server went away) has completion None.
    """
    n = len(schedule)
    results: list[Completion | None] = [None] * n
    sent = [math.nan] * n
    finished = [math.nan] * n
    gone = threading.Event()
    t0 = time.perf_counter()

    def one(i: int) -> None:
        c = send(i)
        finished[i] = time.perf_counter() - t0
        results[i] = c
        if c.server_gone:
            gone.set()
        on_done()

    threads = []
    for i, offset in enumerate(schedule):
        if offset > max_s or gone.is_set():
            break
        delay = t0 + offset - time.perf_counter()
        if delay > 0 and gone.wait(delay):
            break
        sent[i] = time.perf_counter() - t0
        th = threading.Thread(target=one, args=(i,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    done = [f for f in finished if not math.isnan(f)]
    return results, sent, max(done) if done else 0.0


def served_settings(stored: dict) -> dict:
    """A serving manifest read back as its claim's settings (a manifest from before the workloads is the
    single workload's)."""
    return {"workload": stored.get("workload", "single"), "config": stored.get("config")}


class ServerRun:
    """What every serve-bench workload shares: the server (its name for the model, its metrics, its
    block size), the tokenizer, the block ceiling, the results folder's parts and its claim.

    A subclass sets ``TABLE`` and ``WORKLOAD`` and writes :meth:`manifest` (its own keys) and
    :meth:`identity` (:meth:`base_identity` plus what else its rows are computed from).
    """

    TABLE = TABLE
    WORKLOAD = "single"

    def __init__(self, cfg, url: str, out: Path, progress: Callable[[str], None] = lambda s: None,
                 advance: Callable[[], None] = lambda: None, facts: dict | None = None):
        self.cfg, self.url, self.out, self.facts = cfg, url, Path(out), facts or {}
        self.progress, self.advance = progress, advance
        self.tok = load_tokenizer(cfg.model)
        # the folder is claimed by its manifest: its workload and configuration (a resume keeps its salt)
        self.exp = Experiment("serve-bench", self.out, SERVING_MANIFEST,
                              {"workload": self.WORKLOAD, "config": cfg.model_dump()}, settle=served_settings,
                              held="serving run with another configuration")

    def connect(self) -> None:
        """Read the server: its name for the model, whether it counts prefix-cache hits, its block size."""
        self.served = pick_served(self.url, self.cfg.model)
        samples = measure.parse_prometheus(scrape_metrics(self.url))
        self.has_counters = measure.counter(samples, measure.QUERIES) is not None
        self.block_size = measure.block_size_of(samples)
        self.ceiling = measure.BlockCeiling(self.block_size or 1)
        self.store = self.exp.folder.parts(self.TABLE)
        self.salt = secrets.token_hex(4)  # a resumed folder keeps its own (see claim)

    def server_version(self) -> str | None:
        try:
            return get_json(f"{self.url}/version").get("version")
        except (OSError, ValueError):
            return None

    def base_identity(self) -> dict:
        """The weights and tokenizer of ``--model`` (by content), and the server's name for it, its
        vLLM version and its KV block size. The server is trusted to serve ``--model``."""
        from kvprobe.models.load import tokenizer_hash

        return {"weights": weights_identity(self.cfg.model), "tokenizer_hash": tokenizer_hash(self.tok),
                "served_model": self.served, "server_version": self.server_version(), "block_size": self.block_size}

    def identity(self) -> dict:
        return self.base_identity()

    def claim(self) -> None:
        """The one harness's checks and claim (:class:`~kvprobe.experiment.Experiment`): another command's folder,
        or another workload or configuration, is refused; then the server's block size is required, and what the
        rows are computed from (the served model's identity, :meth:`identity`) is recorded or, on a resume,
        checked before the manifest is rewritten (a resume reuses only runs of the same model, server,
        tokenizer and inputs)."""
        if self.exp.check():
            self.salt = json_object(self.out / SERVING_MANIFEST).get("unique_salt", self.salt)
        self.exp.open(lambda: self, before=[self._require_block_size],
                      identity=lambda run: (run.identity(), run.cfg.model))
        self.exp.folder.write(SERVING_MANIFEST, self.manifest())

    def _require_block_size(self) -> None:
        if self.block_size is None:
            raise EnvironmentProblem(f"the server at {self.url} does not say its KV block size (no "
                                     f"{measure.CACHE_INFO} in /metrics); kvprobe serve-bench needs a vLLM server")

    def manifest(self) -> dict:
        raise NotImplementedError

    def timed_run(self, send: Callable[[int], Completion], schedule: list[float], where: str):
        """One timed run (:func:`fire_with`) between two reads of ``/metrics``, so that the prefix-cache
        counters' deltas belong to it alone: (completions, send offsets, wall seconds, queries, hits).
        A server gone during it is one line (:meth:`_gone_or_fail`)."""
        before = measure.parse_prometheus(scrape_metrics(self.url))
        results, sent, wall = fire_with(send, schedule, self.cfg.max_s, self.advance)
        if any(c is not None and c.server_gone for c in results):
            self._gone_or_fail(next(c.error for c in results if c is not None and c.server_gone), where)
        try:
            after = measure.parse_prometheus(scrape_metrics(self.url))
        except ServerGone as exc:
            self._gone_or_fail(str(exc), where)
        queries, hits = measure.metrics_delta(before, after)
        return results, sent, wall, queries, hits

    def _gone_or_fail(self, error: str, where: str) -> None:
        from kvprobe.serving.server import healthy

        collected = self.collect()
        kept = f"finished runs are saved in {collected}" if collected else "no run had finished"
        what = "stopped answering" if not healthy(self.url) else "failed a request"
        raise ServerGone(f"the server at {self.url} {what} during {where} ({error}); {kept}; "
                         f"run the same command again to resume")

    def collect(self) -> Path | None:
        if not self.store.parts.exists() or not any(self.store.parts.glob("*.parquet")):
            return None
        return self.store.collect()


class Bench(ServerRun):
    """The single-field benchmark against one server: the policy, the oracle answers and the ceiling state."""

    def __init__(self, cfg: BenchConfig, url: str, out: Path, progress: Callable[[str], None] = lambda s: None,
                 advance: Callable[[], None] = lambda: None, facts: dict | None = None):
        super().__init__(cfg, url, out, progress, advance, facts)
        self.policy: Policy = build_policy(self.tok, cfg.policy_tokens, cfg.seed, cfg.domain,
                                           template=resolve_template(cfg.erratum_template))
        self.connect()
        self.base_ids = self.policy.ids(self.tok)
        self.oracle: dict[str, str] = {}

    # -- bookkeeping ---------------------------------------------------------------------------
    def manifest(self) -> dict:
        p = self.policy
        e_ids = p.ids(self.tok, erratum_value=p.value_set[-1])
        shared = measure.shared_prefix(self.base_ids, e_ids)
        block = self.block_size or 0
        return {**version_entry(SERVING_MANIFEST), "command": "serve-bench", "config": self.cfg.model_dump(),
                "unique_salt": self.salt, "url": self.url, **self.facts,
                "served_model": self.served, "server_version": self.server_version(), "block_size": self.block_size,
                "prefix_cache_counters": self.has_counters,
                "policy": {"domain": p.case.domain, "field": p.field, "base_value": p.base_value,
                           "value_set": list(p.value_set), "form": p.form, "erratum_template": p.template,
                           "base_prompt_tokens": len(self.base_ids), "erratum_prompt_tokens": len(e_ids),
                           "erratum_shared_tokens": shared,
                           "erratum_ceiling": measure.static_ceiling(shared, len(e_ids), block) if block else None,
                           "example_erratum": p.text(self.tok, erratum_value=p.value_set[-1])[-400:]}}

    def _replay(self) -> None:
        """Feed finished runs' prompts (and their oracles) into the ceiling and the oracle table."""
        for df in self.store.finished():
            for arm, value, oracle in zip(df["arm"], df["value"], df["reference"]):
                self.ceiling.add(self.policy.arm_prompt(self.tok, arm, value))
                if value not in self.oracle:
                    self.ceiling.add(self.policy.ids(self.tok, value))
                    self.oracle[value] = oracle

    def _oracle_for(self, values: list[str]) -> None:
        """Greedy answers on the prompt with each new value written in place, one at a time."""
        for value in dict.fromkeys(values):
            if value in self.oracle:
                continue
            ids = self.policy.ids(self.tok, value)
            c = stream_completion(self.url, self.served, ids, self.cfg.max_tokens)
            if c.error:
                self._gone_or_fail(c.error, "the oracle")
            self.ceiling.add(ids)
            self.oracle[value] = parse_answer(c.text, self.policy.case.options)

    # -- the benchmark -------------------------------------------------------------------------
    def total(self) -> int:
        """Requests the benchmark sends in its timed runs (the progress bar's total)."""
        return len(self.cfg.rates) * len(self.cfg.arms) * self.cfg.n

    def run(self) -> Path:
        self.claim()
        self._replay()
        self.progress("warming the static prefix (the base prompt, greedy: also its oracle)")
        self._warm()
        try:
            for k, rate in enumerate(self.cfg.rates):
                schedule = measure.poisson_schedule(rate, self.cfg.n, self.cfg.seed + k)
                for arm in self.cfg.arms:
                    key = f"{measure.rate_label(rate)}-{arm}"
                    if self.store.get(key) is not None:
                        for _ in range(self.cfg.n):  # finished before: count it on the progress bar
                            self.advance()
                        continue
                    self.progress(f"rate {measure.rate_label(rate)}/s, {arm}")
                    self.store.save(key, self.run_one(rate, k, arm, schedule))
        except BaseException:  # an interrupt, a dead server: what finished is collected, then re-raised
            self.collect()
            raise
        return self.store.collect()

    def _warm(self) -> None:
        """Send the base prompt once (a deployed static policy is warm); its answer is the base oracle."""
        c = stream_completion(self.url, self.served, self.base_ids, self.cfg.max_tokens)
        if c.error:
            self._gone_or_fail(c.error, "the warm-up request")
        self.ceiling.add(self.base_ids)
        self.oracle.setdefault(self.policy.base_value, parse_answer(c.text, self.policy.case.options))

    def run_one(self, rate: float, k: int, arm: str, schedule: list[float]) -> pd.DataFrame:
        cfg, p = self.cfg, self.policy
        values = arm_values(p, arm, cfg.n, start=k * cfg.n, seed=cfg.seed, salt=self.salt)
        prompts = [p.arm_prompt(self.tok, arm, v) for v in values]
        results, sent, wall, queries, hits = self.timed_run(
            lambda i: stream_completion(self.url, self.served, prompts[i], cfg.max_tokens), schedule,
            f"rate {measure.rate_label(rate)}/s, arm {arm}")
        n_sent = sum(c is not None for c in results)
        ceilings = [self.ceiling.add(ids) if c is not None else 0 for ids, c in zip(prompts, results)]
        self._oracle_for([v for v, c in zip(values, results) if c is not None])
        rows = []
        for i, (value, ids, c) in enumerate(zip(values, prompts, results)):
            if c is None:
                continue
            ok = c.error is None
            prompt_tokens = c.prompt_tokens if c.prompt_tokens is not None else len(ids)
            answer = parse_answer(c.text, p.case.options) if ok else "?"
            oracle = self.oracle.get(value, "?")
            rows.append({
                "model": cfg.model, "served_model": self.served, "rate": float(rate), "arm": arm, "request": i,
                "value": value, "prompt_tokens": int(prompt_tokens),
                "cached_tokens": float(c.cached_tokens) if c.cached_tokens is not None else math.nan,
                "cached_reported": c.cached_tokens is not None, "ceiling_tokens": int(ceilings[i]),
                "hit_rate": c.cached_tokens / prompt_tokens if ok and prompt_tokens and c.cached_tokens is not None
                else math.nan,
                "ttft_s": c.ttft_s, "latency_s": c.latency_s, "send_s": sent[i],
                "finish_s": sent[i] + c.latency_s if ok else math.nan, "answer": answer, "text": c.text,
                "reference": oracle, "rule_answer": p.expected(value),
                "agree": float(answer == oracle) if ok and oracle != "?" else math.nan, "ok": ok,
                "error": c.error or "", "run_sent": n_sent, "run_wall_s": wall,
                "run_queries": math.nan if queries is None else float(queries),
                "run_hits": math.nan if hits is None else float(hits), "block_size": self.block_size,
                "base_prompt_tokens": len(self.base_ids),
            })
        return pd.DataFrame(rows, columns=list(COLUMNS))


def summarize_folder(out: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-run summary, erratum-vs-edit ratios) of a results folder's serving.parquet."""
    df = read_table(Path(out) / SERVING)  # a table of tables schema 1 under today's names
    summary = measure.summarize(df)
    return summary, measure.ratios(summary)
