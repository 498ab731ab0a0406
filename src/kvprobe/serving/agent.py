"""``kvprobe serve-bench --workload agent``: sessions whose fields change every turn, on a vLLM server.

The template is a calibration spec (the one ``kvprobe calibrate`` measured a per-field policy on),
with a long static policy text (``policy_tokens``, numbered clauses of the domains' filler rules)
after its last field line, so that every field sits before the bulk of the prompt, as a timestamp
in a system prompt does::

    system / template: ... {request_id} ... {received} ... {tier} ... / Policy notes: - Clause 1 ... - Clause N
    / ## Request / question                                   (the served spec: agent_spec.yaml)

A session starts at values drawn from the fields' value sets; that prompt is sent once before the
timed runs (the session's cached prefix). Each of its turns changes one field: a gating field
(``gating_share`` of the turns) or an inert one (the rest); which fields gate comes from the
field policy's measured relevance (``gating``/``mixed``), or from ``gating``. Every turn is one
request per arm, rendered by :class:`~kvprobe.serving.state.PromptState`:

    rerender   every current value written in place (exact; cache-busting): the reference
    erratum    every change as an erratum turn after the cached prefix (the paper's repair)
    policy     each field as the per-field policy says (:func:`~kvprobe.serving.state.renderings`)

Per rate, sessions and turns are drawn afresh (seeded by ``seed``, the rate's index and the
folder's salt, so that a warm server holds none of them), the same for every arm; requests go
turn-major (every session's turn 1, then turn 2, ...) at Poisson offsets. The decision is the
option with the higher score among the first token's top logprobs (:func:`kvprobe.serving.client.decide`),
with the option's first tokens in the forms a chat model writes (:func:`answer_ids`); an arm agrees
when its decision equals the rerender arm's for the same session and turn.

Output: ``parts/agent/<rate>-<arm>.parquet`` as each run finishes, ``agent.parquet`` (one row per
request; :data:`COLUMNS`), ``serving_manifest.json`` and ``agent_spec.yaml`` (the served template as a
calibration spec: calibrate it to measure the policy on exactly what is served).

The workload itself (the template, the sessions and turns, each arm's renderings) is data, in
:mod:`kvprobe.serving.workload`; this module runs it on a server and summarizes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvprobe.errors import KvprobeError
from kvprobe.results import SERVING_MANIFEST, atomic_write, version_entry
from kvprobe.serving import measure
from kvprobe.serving.bench import ServerRun
from kvprobe.serving.client import Completion, decide, stream_chat
from kvprobe.serving.state import PromptState
from kvprobe.serving.workload import (Turn, agent_policy, answer_ids, arm_renderings, first_values, gating_fields,
                                      padded_spec, policy_digest, policy_template, spec_yaml, workload)

TABLE = "agent"
AGENT = "agent.parquet"
SPEC_FILE = "agent_spec.yaml"
ARMS = ("rerender", "erratum", "policy")
REFERENCE = "rerender"
KINDS = ("gating", "inert")
DEFAULT_RATES = "0.2,inf"
MIN_POLICY_TOKENS, MAX_POLICY_TOKENS = 1000, 8000
COLUMNS = ("model", "served_model", "rate", "arm", "request", "session", "turn", "field", "kind", "rendering",
           "value", "notes", "rewrites", "prompt_tokens", "local_tokens", "cached_tokens", "cached_reported",
           "ceiling_tokens", "hit_rate", "ttft_s", "latency_s", "send_s", "answer", "option_diff", "reference", "agree",
           "ok", "error", "run_sent", "run_wall_s", "run_queries", "run_hits", "block_size")


class AgentConfig(BaseModel):
    """Everything that defines an agent benchmark (the URL does not: a resumed run may use another)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    spec: str  # a calibration spec (YAML)
    field_policy: str | None = None  # its field_policy.yaml, for the policy arm and the update kinds
    rates: list[float] = measure.parse_rates(DEFAULT_RATES)
    sessions: int = Field(8, ge=1, le=1000)
    turns: int = Field(6, ge=1, le=100)
    gating_share: float = Field(0.25, ge=0, le=1)
    gating: list[str] | None = None  # fields whose updates are gating (default: the policy's relevance)
    arms: list[str] = list(ARMS)
    policy_tokens: int = 1500
    max_s: float = Field(600.0, gt=0)
    seed: int = 0

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: list[str]) -> list[str]:
        return measure.check_arms(v, ARMS, always=(REFERENCE,))  # the reference always runs, first

    @field_validator("rates")
    @classmethod
    def _rates(cls, v: list[float]) -> list[float]:
        return measure.check_rates(v)

    @field_validator("policy_tokens")
    @classmethod
    def _policy_tokens(cls, v: int) -> int:
        if v != 0 and not MIN_POLICY_TOKENS <= v <= MAX_POLICY_TOKENS:
            raise ValueError(f"policy tokens must be 0 (the template as it is) or in [{MIN_POLICY_TOKENS}, "
                             f"{MAX_POLICY_TOKENS}], got {v}")
        return v


# -- the benchmark --------------------------------------------------------------------------------
class AgentBench(ServerRun):
    """One agent benchmark against one server."""

    TABLE = TABLE
    WORKLOAD = "agent"

    def __init__(self, cfg: AgentConfig, url: str, out: Path, progress: Callable[[str], None] = lambda s: None,
                 advance: Callable[[], None] = lambda: None, facts: dict | None = None):
        from kvprobe.calibrate.spec import load_spec

        super().__init__(cfg, url, out, progress, advance, facts)
        base = load_spec(cfg.spec)
        self.policy = agent_policy(cfg, base, self.tok)
        self.spec = padded_spec(base, self.tok, cfg.policy_tokens, cfg.seed)
        self.calibrated_on = policy_template(cfg.field_policy, self.spec, base)
        self.gating = gating_fields(self.spec, self.policy, cfg.gating)
        self.rendering = {arm: arm_renderings(arm, self.spec, self.policy, (base,)) for arm in cfg.arms}
        self.option_ids = answer_ids(self.tok, self.spec.options)
        if not all(self.option_ids.values()):
            raise KvprobeError(f"{cfg.spec}: an option has no non-space first token: {self.spec.options}")
        self.connect()

    # -- bookkeeping ---------------------------------------------------------------------------
    def identity(self) -> dict:
        """:meth:`base_identity`, and the served template and the field policy, by content."""
        return {**self.base_identity(), "spec": self.spec.digest(),
                "field_policy": policy_digest(self.cfg.field_policy)}

    def manifest(self) -> dict:
        state = PromptState(self.spec, first_values(self.spec))
        return {**version_entry(SERVING_MANIFEST), "command": "serve-bench", "workload": self.WORKLOAD,
                "config": self.cfg.model_dump(), "unique_salt": self.salt, "url": self.url, **self.facts,
                "served_model": self.served, "server_version": self.server_version(), "block_size": self.block_size,
                "prefix_cache_counters": self.has_counters, "served_spec": SPEC_FILE,
                "prompt_tokens": len(state.ids(self.tok)), "gating_fields": self.gating,
                "options": list(self.spec.options), "answer_ids": self.option_ids,
                "policy_calibrated_on": self.calibrated_on,
                "renderings": {arm: {n: {"rendering": r.label, "reason": r.reason} for n, r in rs.items()}
                               for arm, rs in self.rendering.items()}}

    # -- running -------------------------------------------------------------------------------
    def total(self) -> int:
        return len(self.cfg.rates) * len(self.cfg.arms) * self.cfg.sessions * self.cfg.turns

    def run(self) -> Path:
        self.claim()
        atomic_write(self.out / SPEC_FILE, lambda tmp: tmp.write_text(spec_yaml(self.spec)))
        try:
            for k, rate in enumerate(self.cfg.rates):
                starts, turns = workload(self.spec, self.gating, self.cfg.sessions, self.cfg.turns,
                                         self.cfg.gating_share, f"{self.cfg.seed}:{self.salt}:{k}")
                keys = [f"{measure.rate_label(rate)}-{arm}" for arm in self.cfg.arms]
                if all(self.store.get(key) is not None for key in keys):
                    for _ in range(len(keys) * len(turns)):
                        self.advance()
                    continue
                self.progress(f"rate {measure.rate_label(rate)}/s: warming {len(starts)} sessions' prefixes")
                self._warm(starts)
                schedule = measure.poisson_schedule(rate, len(turns), self.cfg.seed + k)
                for arm, key in zip(self.cfg.arms, keys):
                    prompts = self._prompts(arm, starts, turns)
                    done = self.store.get(key)
                    if done is not None:  # finished before: its prompts count in the ceiling, as sent
                        for i in done["request"]:
                            self.ceiling.add(prompts[int(i)][1])
                        for _ in turns:
                            self.advance()
                        continue
                    self.progress(f"rate {measure.rate_label(rate)}/s, {arm}")
                    reference = None if arm == REFERENCE else self.store.get(f"{measure.rate_label(rate)}-{REFERENCE}")
                    self.store.save(key, self.run_one(rate, arm, turns, prompts, schedule, reference))
        except BaseException:  # an interrupt, a dead server: what finished is collected, then re-raised
            self.collect()
            raise
        return self.store.collect()

    def _warm(self, starts: list[dict[str, str]]) -> None:
        """Each session's starting prompt, once (its cached prefix), outside any timed window."""
        for values in starts:
            state = PromptState(self.spec, values)
            c = stream_chat(self.url, self.served, state.messages())
            if c.error:
                self._gone_or_fail(c.error, "the warm-up requests")
            self.ceiling.add(state.ids(self.tok))

    def _prompts(self, arm: str, starts, turns: list[Turn]) -> list[tuple[list[dict], list[int], str, int, int]]:
        """Per turn (in sending order): (messages, kvprobe's token ids, rendering, notes, prefix rewrites)."""
        states = [PromptState(self.spec, values, self.rendering[arm]) for values in starts]
        out = []
        for t in turns:
            st = states[t.session]
            (label,) = st.update(**{t.field: t.value})
            out.append((st.messages(), st.ids(self.tok), label, len(st.notes()), st.rewrites))
        return out

    def run_one(self, rate: float, arm: str, turns: list[Turn], prompts, schedule: list[float],
                reference: pd.DataFrame | None) -> pd.DataFrame:
        results, sent, wall, queries, hits = self.timed_run(
            lambda i: stream_chat(self.url, self.served, prompts[i][0]), schedule,
            f"rate {measure.rate_label(rate)}/s, arm {arm}")
        n_sent = sum(c is not None for c in results)
        ceilings = [self.ceiling.add(p[1]) if c is not None else 0 for p, c in zip(prompts, results)]
        ref = {} if reference is None else {(s, t): a for s, t, a in
                                             zip(reference["session"], reference["turn"], reference["answer"])}
        rows = []
        for i, (t, (_, ids, label, notes, rewrites), c) in enumerate(zip(turns, prompts, results)):
            if c is None:
                continue
            rows.append(self._row(rate, arm, i, t, ids, label, notes, rewrites, c, ceilings[i], ref, sent[i],
                                  n_sent, wall, queries, hits))
        return pd.DataFrame(rows, columns=list(COLUMNS))

    def _row(self, rate, arm, i, t: Turn, ids, label, notes, rewrites, c: Completion, ceiling, ref, send_s, n_sent,
             wall, queries, hits) -> dict:
        ok = c.error is None
        answer, scores = decide(c.top_logprobs, self.option_ids) if ok else ("?", {})
        a, b = self.spec.options
        diff = scores.get(a, math.nan) - scores.get(b, math.nan) if ok else math.nan
        reference = answer if arm == REFERENCE else ref.get((t.session, t.turn), "?")
        prompt_tokens = c.prompt_tokens if c.prompt_tokens is not None else len(ids)
        return {
            "model": self.cfg.model, "served_model": self.served, "rate": float(rate), "arm": arm, "request": i,
            "session": t.session, "turn": t.turn, "field": t.field, "kind": t.kind, "rendering": label,
            "value": t.value, "notes": notes, "rewrites": rewrites, "prompt_tokens": int(prompt_tokens),
            "local_tokens": len(ids),
            "cached_tokens": float(c.cached_tokens) if c.cached_tokens is not None else math.nan,
            "cached_reported": c.cached_tokens is not None, "ceiling_tokens": int(ceiling),
            "hit_rate": c.cached_tokens / prompt_tokens if ok and prompt_tokens and c.cached_tokens is not None
            else math.nan,
            "ttft_s": c.ttft_s, "latency_s": c.latency_s, "send_s": send_s,
            "answer": answer, "option_diff": diff, "reference": reference,
            "agree": float(answer == reference) if ok and answer != "?" and reference != "?" else math.nan,
            "ok": ok, "error": c.error or "", "run_sent": n_sent, "run_wall_s": wall,
            "run_queries": math.nan if queries is None else float(queries),
            "run_hits": math.nan if hits is None else float(hits), "block_size": self.block_size,
        }


# -- the summary ----------------------------------------------------------------------------------
def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (rate, arm): the serving figures of :func:`kvprobe.serving.measure.summarize` and
    the decision agreement with the rerender arm, per update kind, with Wilson 95% intervals."""
    from kvprobe.intervals import wilson

    if df.empty:
        return pd.DataFrame()
    base = measure.summarize(df.assign(reference="?")).drop(columns=["agreement", "n_agreement",
                                                                         "distinct_references"])
    extra = []
    for (rate, arm), g in df.groupby(["rate", "arm"], sort=True):
        row = {"rate": float(rate), "arm": arm, "notes_share": float((g["notes"] > 0).mean()),
               "rewrites": int(g.groupby("session")["rewrites"].max().sum()),
               "decided": int((g["answer"] != "?").sum()), "ties": int((g["option_diff"] == 0).sum())}
        for kind in KINDS:
            agree = g.loc[(g["kind"] == kind), "agree"].dropna()
            k, n = int(agree.sum()), len(agree)
            lo, hi = wilson(k, n) if n else (math.nan, math.nan)
            row.update({f"{kind}_k": k, f"{kind}_n": n, f"{kind}_lo": lo, f"{kind}_hi": hi})
        extra.append(row)
    return base.merge(pd.DataFrame(extra), on=["rate", "arm"])
