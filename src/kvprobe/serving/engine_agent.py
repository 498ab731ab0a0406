"""``kvprobe serve-bench --workload agent --engine llama.cpp``: the agent workload on llama.cpp, in this
process, with a fourth arm that repairs the engine's own cache in place.

The workload is :mod:`kvprobe.serving.workload`'s (the same template, sessions, turns and update
kinds as on vLLM); the engine is :class:`kvprobe.serving.llamacpp.Engine` (the bundled model's own
GGUF, llama.cpp's tokenizer checked against kvprobe's on every prompt). The arms:

    rerender     every current value written in place; the session's cache is reused up to the first
                 changed token (a per-session prefix cache): exact, the reference
    erratum      every change as an erratum turn after the cached prompt (the paper's repair)
    policy       the per-field policy as a server deploys it: a note for a gating field, nothing for
                 an inert one (:func:`kvprobe.serving.state.renderings`)
    policy+edit  the same, except that a field whose established repair is ``field_only`` or
                 ``selective`` is repaired in the engine's cache (:meth:`Engine.edit`): its tokens, and
                 the K positions of a selective repair, recomputed at their own positions; a new value
                 of another token length cannot be written in place and is re-rendered (``fallback``)

After every turn, a **state check**: a side request asks for the current value of one inert field
(``state_field``, by default ``request_id`` when the template has it) in a new user turn after the
session's prompt, and the greedy answer (``answer_tokens`` at most) is scored against the current
value. It shares the session's cached prompt and leaves it as it was (:meth:`Engine.ask`); its time
is not in the decision requests' queue.

**Timing.** The engine serves one request at a time (one llama.cpp context, one slot, as
``llama-server -np 1``), so the decisions and each request's service time (its edit, if any, and
its prefill up to the decision token's logits) do not depend on the arrival rate. Each arm runs
once; per rate, the requests' Poisson arrival offsets (``measure.poisson_schedule``, the same for
every arm) are replayed through the measured service times first-come first-served: a request
starts when it has arrived and the one before it has finished, and its TTFT is its finish minus
its arrival. Throughput is the requests over the span from the first arrival to the last finish.

Output: ``parts/engine_agent/<arm>.parquet`` as each arm finishes (an arm is never redone),
``engine_agent.parquet`` (one row per turn and arm: :data:`COLUMNS`), ``engine_agent_manifest.json``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
from pydantic import Field, field_validator

from kvprobe.errors import KvprobeError, UsageError
from kvprobe.experiment import Experiment
from kvprobe.results import ENGINE_MANIFEST as MANIFEST
from kvprobe.serving import measure
from kvprobe.serving.agent import KINDS, AgentConfig
from kvprobe.serving.llamacpp import KV_TYPES, Engine, InPlaceRefused, check_ids
from kvprobe.serving.state import PromptState
from kvprobe.serving.workload import (agent_policy, answer_ids, arm_renderings, first_values, gating_fields,
                                      padded_spec, policy_digest, policy_template, workload)

ARMS = ("rerender", "erratum", "policy", "policy+edit")
REFERENCE = "rerender"
TABLE = "engine_agent"
ENGINE = "llama.cpp"
CHECK = "What is the current {label}? Reply with the value only."
FREE_RANKINGS = ("recency", "random", "aggregators")  # rankings that need no forward pass of an HF model
BUCKETS = (("1", 1, 1), ("2-3", 2, 3), ("4-10", 4, 10), (">10", 11, 10**9))  # updates so far in a session
COLUMNS = ("model", "engine", "arm", "request", "session", "turn", "field", "kind", "rendering", "value", "notes",
           "prompt_tokens", "edit_tokens", "prefill_tokens", "recomputed_tokens", "fallback", "service_s", "answer",
           "option_diff", "reference", "agree", "check_field", "check_updates", "check_value", "check_answer",
           "state_ok", "state_stale", "check_s")


class EngineAgentConfig(AgentConfig):
    """:class:`~kvprobe.serving.agent.AgentConfig` for llama.cpp: its arms, its threads and cache type,
    and the state check."""

    arms: list[str] = list(ARMS)
    policy_tokens: int = 0
    threads: int = Field(1, ge=1, le=256)
    gpu_layers: int = Field(0, ge=-1)  # llama.cpp layers on a GPU (a CUDA build; -1: all)
    kv: str = "f16"
    state_field: str | None = None
    answer_tokens: int = Field(24, ge=1, le=256)

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: list[str]) -> list[str]:
        return measure.check_arms(v, ARMS, always=(REFERENCE,))

    @field_validator("kv")
    @classmethod
    def _kv(cls, v: str) -> str:
        if v not in KV_TYPES:
            raise ValueError(f"KV cache type must be one of {', '.join(KV_TYPES)}, got {v!r}")
        return v


def gguf_of(model: str, progress: Callable[[str], None] = lambda s: None) -> Path:
    """The GGUF file llama.cpp serves for ``model``: a bundled alias's own (fetched once)."""
    from kvprobe.models import bundled

    if model not in bundled.BUNDLED:
        raise UsageError(f"the llama.cpp engine serves a bundled model's GGUF; {model!r} is not one of "
                         f"{', '.join(bundled.BUNDLED)}")
    return bundled.gguf_file(model, progress)


class EngineAgentBench:
    """One agent benchmark on one llama.cpp engine."""

    def __init__(self, cfg: EngineAgentConfig, out: Path, progress: Callable[[str], None] = lambda s: None,
                 advance: Callable[[], None] = lambda: None, engine: Engine | None = None):
        from kvprobe.calibrate.spec import load_spec
        from kvprobe.serving.served import load_tokenizer

        self.cfg, self.out, self.progress, self.advance = cfg, Path(out), progress, advance
        base = load_spec(cfg.spec)
        if cfg.state_field is not None and cfg.state_field not in base.fields:  # before any model file is read
            raise UsageError(f"--state-field must name a field of {cfg.spec} ({', '.join(base.fields)}), got "
                             f"{cfg.state_field!r}")
        if cfg.field_policy is None and {"policy", "policy+edit"} & set(cfg.arms):
            arm_renderings("policy", base, None)  # the one-line refusal: the policy arms need a policy
        self.tok = load_tokenizer(cfg.model)
        self.policy = agent_policy(cfg, base, self.tok)
        self.spec = padded_spec(base, self.tok, cfg.policy_tokens, cfg.seed)
        self.calibrated_on = policy_template(cfg.field_policy, self.spec, base)
        self.gating = gating_fields(self.spec, self.policy, cfg.gating)
        self.rendering = {arm: arm_renderings(arm, self.spec, self.policy, (base,)) for arm in cfg.arms}
        self._check_rankings()
        inert = [n for n in self.spec.fields if n not in self.gating]
        self.check_field = cfg.state_field or ("request_id" if "request_id" in inert else (inert or [None])[0])
        if self.check_field is None or self.check_field not in self.spec.fields:
            raise UsageError(f"--state-field must name a field of {cfg.spec} ({', '.join(self.spec.fields)}), got "
                             f"{self.check_field!r}")
        self.option_ids = answer_ids(self.tok, self.spec.options)
        if not all(self.option_ids.values()):
            raise KvprobeError(f"{cfg.spec}: an option has no non-space first token: {self.spec.options}")
        # the folder is claimed by its manifest (its configuration), through the one harness
        self.exp = Experiment("serve-bench --engine llama.cpp", self.out, MANIFEST, {"config": cfg.model_dump()},
                              settle=lambda stored: {"config": stored.get("config")},
                              held="engine run with another configuration")
        self.store = self.exp.folder.parts(TABLE)
        self.gguf = gguf_of(cfg.model, progress)
        self._engine = engine

    def _check_rankings(self) -> None:
        from kvprobe.editor.strategies import Selective, parse_strategy

        for arm, rs in self.rendering.items():
            for name, r in rs.items():
                if r.kind == "edit":
                    s = parse_strategy(r.template)
                    if isinstance(s, Selective) and s.ranking not in FREE_RANKINGS:
                        raise UsageError(f"the policy repairs {name!r} with {r.template}, whose {s.ranking} ranking "
                                         f"needs kvprobe's own model pass; the engine arm takes field_only or a "
                                         f"selective ranking of {', '.join(FREE_RANKINGS)}")

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            prompt = len(PromptState(self.spec, first_values(self.spec)).ids(self.tok))
            per = 2 * prompt + 64 * len(self.spec.fields) + self.cfg.answer_tokens  # the notes, the side request
            self.progress(f"llama.cpp: loading {self.gguf.name} ({self.cfg.sessions} sessions x {per} tokens)")
            self._engine = Engine(self.gguf, n_ctx=per * (self.cfg.sessions + 1), sessions=self.cfg.sessions,
                                  threads=self.cfg.threads, kv=self.cfg.kv, gpu_layers=self.cfg.gpu_layers)
        return self._engine

    def starts(self):
        return workload(self.spec, self.gating, self.cfg.sessions, self.cfg.turns, self.cfg.gating_share,
                        f"{self.cfg.seed}")

    # -- bookkeeping ---------------------------------------------------------------------------
    def identity(self) -> dict:
        """What the rows are computed from: the GGUF (its sha256, verified when it was assembled), the
        tokenizer, the engine's version, the served template and the field policy, by content."""
        from importlib.metadata import version

        from kvprobe.models import bundled
        from kvprobe.models.load import tokenizer_hash

        policy = policy_digest(self.cfg.field_policy)
        return {"gguf_sha256": bundled.BUNDLED[self.cfg.model].sha256, "tokenizer_hash": tokenizer_hash(self.tok),
                "engine": f"{ENGINE} (llama-cpp-python {version('llama-cpp-python')})", "spec": self.spec.digest(),
                "field_policy": policy}

    def manifest(self) -> dict:
        from kvprobe.hardware import cpu_line

        return {"command": "serve-bench", "workload": "agent", "engine": ENGINE, "config": self.cfg.model_dump(),
                "cpu": cpu_line(),
                "gguf": str(self.gguf), "gating_fields": self.gating, "state_field": self.check_field,
                "options": list(self.spec.options), "answer_ids": self.option_ids,
                "policy_calibrated_on": self.calibrated_on,
                "renderings": {arm: {n: {"rendering": r.label, "reason": r.reason} for n, r in rs.items()}
                               for arm, rs in self.rendering.items()}}

    def claim(self) -> None:
        """The one harness's checks and claim: another command's folder or another configuration is refused;
        what the rows are computed from (:meth:`identity`) is recorded or, on a resume, checked before the
        manifest is rewritten."""
        self.exp.open(lambda: self, identity=lambda run: (run.identity(), run.cfg.model))
        self.exp.folder.write(MANIFEST, self.manifest())

    def total(self) -> int:
        return len(self.cfg.arms) * self.cfg.sessions * self.cfg.turns

    # -- running -------------------------------------------------------------------------------
    def run(self) -> Path:
        self.claim()
        starts, turns = self.starts()
        try:
            for arm in self.cfg.arms:
                if self.store.get(arm) is not None:
                    for _ in turns:
                        self.advance()
                    continue
                self.progress(f"llama.cpp, arm {arm}: {len(turns)} turns of {len(starts)} sessions")
                reference = None if arm == REFERENCE else self.store.get(REFERENCE)
                self.store.save(arm, self.run_arm(arm, starts, turns, reference))
        finally:
            if self.store.parts.exists() and any(self.store.parts.glob("*.parquet")):
                self.store.collect()
        return self.out / f"{TABLE}.parquet"

    def _ids(self, text: str, what: str) -> list[int]:
        """The engine's token ids of ``text``, held against kvprobe's (the spans index both)."""
        from kvprobe.datasets.spans import prompt_ids

        ids = self.engine.tokenize(text)
        check_ids(ids, prompt_ids(self.tok, text, "chat"), what)
        return ids

    def _check_text(self, st: PromptState) -> str:
        ask = CHECK.format(label=self.check_field.replace("_", " "))
        return self.tok.apply_chat_template(st.messages() + [{"role": "user", "content": ask}], tokenize=False,
                                            add_generation_prompt=True)

    def _edit(self, s: int, st: PromptState, name: str, old: str, repair: str) -> int:
        """Repair session ``s``'s cache for ``name`` (now in ``st``'s prefix) from ``old``, in place."""
        from kvprobe.datasets import Skip, align
        from kvprobe.editor.context import EditContext
        from kvprobe.editor.rankings import rank_downstream
        from kvprobe.editor.strategies import Selective, parse_strategy

        a = align(st.edit_case(name, old), self.tok, "chat")
        if isinstance(a, Skip):
            raise InPlaceRefused(f"{name} from {old!r} to {st.prefix[name]!r}: {a.reason}; re-rendered")
        f0, f1 = a.field
        held = self.engine.ids(s)
        if held[:f1] != a.ids_old[:f1]:
            raise KvprobeError(f"session {s}'s cached prompt is not the one kvprobe aligned for {name!r} (they differ "
                               f"before token {f1})")
        strategy = parse_strategy(repair)
        also = rank_downstream(EditContext(None, a, None), strategy.ranking)[: strategy.k] \
            if isinstance(strategy, Selective) else []
        return self.engine.edit(s, f0, a.ids_new[f0:f1], also)

    def _decide(self, logits: np.ndarray) -> tuple[str, float]:
        """(the option scored higher, the first one on a tie; first minus second option score)."""
        import torch

        from kvprobe.kv.readout import option_scores

        a, b = self.spec.options
        sa, sb = option_scores(torch.from_numpy(logits), self.option_ids, [a, b]).tolist()
        return (a if sa >= sb else b), sa - sb

    def run_arm(self, arm: str, starts, turns, reference: pd.DataFrame | None) -> pd.DataFrame:
        e, rend = self.engine, self.rendering[arm]
        states = [PromptState(self.spec, values, rend) for values in starts]
        for s, st in enumerate(states):  # each session's starting prompt: its cached prefix (untimed)
            e.open(s)
            e.serve(s, self._ids(st.text(self.tok), f"session {s}'s prompt"))
        self.progress(f"llama.cpp, arm {arm}: {len(turns)} turns of {len(states)} sessions")
        ref = {} if reference is None else {(s, t): x for s, t, x in
                                             zip(reference["session"], reference["turn"], reference["answer"])}
        updates = [0] * len(states)
        history: list[list[str]] = [[st.values[self.check_field]] for st in states]
        rows = []
        for i, t in enumerate(turns):
            st, r = states[t.session], rend[t.field]
            old = st.prefix[t.field]
            (label,) = st.update(**{t.field: t.value})
            if t.field == self.check_field:
                updates[t.session] += 1
                history[t.session].append(t.value)
            ids = self._ids(st.text(self.tok), f"session {t.session}'s turn {t.turn}")
            fallback, edit_tokens = "", 0
            start = time.perf_counter()
            if r.kind == "edit":
                try:
                    edit_tokens = self._edit(t.session, st, t.field, old, r.template)
                except InPlaceRefused as exc:
                    fallback = str(exc)
            logits, prefill_tokens = e.serve(t.session, ids)
            service = time.perf_counter() - start
            answer, diff = self._decide(logits)
            said, check_s = self._state_check(t.session, st)
            current = st.values[self.check_field]
            ref_answer = answer if arm == REFERENCE else ref.get((t.session, t.turn), "?")
            rows.append({
                "model": self.cfg.model, "engine": ENGINE, "arm": arm, "request": i, "session": t.session,
                "turn": t.turn, "field": t.field, "kind": t.kind, "rendering": label, "value": t.value,
                "notes": len(st.notes()), "prompt_tokens": len(ids), "edit_tokens": edit_tokens,
                "prefill_tokens": prefill_tokens, "recomputed_tokens": edit_tokens + prefill_tokens,
                "fallback": fallback, "service_s": service, "answer": answer, "option_diff": diff,
                "reference": ref_answer, "agree": float(answer == ref_answer) if ref_answer != "?" else math.nan,
                "check_field": self.check_field, "check_updates": updates[t.session], "check_value": current,
                "check_answer": said, "state_ok": current in said,
                "state_stale": any(v in said for v in history[t.session][:-1] if v != current), "check_s": check_s})
            self.advance()
        return pd.DataFrame(rows, columns=list(COLUMNS))

    def _state_check(self, s: int, st: PromptState) -> tuple[str, float]:
        ids = self._ids(self._check_text(st), f"session {s}'s state check")
        start = time.perf_counter()
        tokens, _ = self.engine.ask(s, ids, self.cfg.answer_tokens)
        return "".join(self.engine.piece(x) for x in tokens).strip(), time.perf_counter() - start


# -- the summary ----------------------------------------------------------------------------------
def fifo(arrivals: list[float], service: list[float]) -> tuple[list[float], float]:
    """One server, first come first served: (each request's TTFT, the span from the first arrival
    to the last finish). ``arrivals`` ascending, as ``measure.poisson_schedule`` gives them."""
    free, ttft = -math.inf, []
    for a, s in zip(arrivals, service):
        finish = max(a, free) + s
        ttft.append(finish - a)
        free = finish
    return ttft, (free - arrivals[0]) if arrivals else 0.0


def summarize(df: pd.DataFrame, rates: list[float], seed: int = 0) -> pd.DataFrame:
    """One row per (rate, arm): TTFT p50/p90 and throughput from the FIFO replay, tokens recomputed per
    update, in-place fallbacks, decision agreement with rerender per update kind and state correctness
    (checks after at least one update of the field), each with its Wilson 95% interval."""
    from kvprobe.intervals import wilson

    out = []
    for k, rate in enumerate(rates):
        for arm, g in _arms(df):
            arrivals = measure.poisson_schedule(rate, len(g), seed + k)
            ttft, span = fifo(arrivals, list(g["service_s"]))
            row = {"rate": float(rate), "arm": arm, "n": len(g), "ttft_p50_s": measure.percentile(ttft, 50),
                   "ttft_p90_s": measure.percentile(ttft, 90), "req_per_s": len(g) / span if span > 0 else math.nan,
                   "service_mean_s": float(g["service_s"].mean()),
                   "recomputed_per_update": float(g["recomputed_tokens"].mean()),
                   "edit_tokens_per_update": float(g["edit_tokens"].mean()),
                   "fallbacks": int((g["fallback"] != "").sum()), "notes_share": float((g["notes"] > 0).mean())}
            for kind in KINDS:
                agree = g.loc[g["kind"] == kind, "agree"].dropna()
                row.update(_share(f"{kind}", int(agree.sum()), len(agree), wilson))
            checked = g[g["check_updates"] > 0]
            row.update(_share("state", int(checked["state_ok"].sum()), len(checked), wilson))
            row["state_stale"] = int(checked["state_stale"].sum())
            out.append(row)
    return pd.DataFrame(out)


def by_updates(df: pd.DataFrame, column: str = "turn") -> pd.DataFrame:
    """Per arm and bucket of updates so far (``turn``: the session's updates, 1, 2-3, 4-10, >10;
    ``check_updates``: the checked field's own): decision agreement with rerender and state
    correctness (checks after at least one update of the field), with Wilson 95% intervals."""
    from kvprobe.intervals import wilson

    out = []
    for arm, g in _arms(df):
        for label, lo, hi in BUCKETS:
            b = g[(g[column] >= lo) & (g[column] <= hi)]
            if b.empty:
                continue
            agree = b["agree"].dropna()
            checked = b[b["check_updates"] > 0]
            out.append({"arm": arm, "updates": label, **_share("agree", int(agree.sum()), len(agree), wilson),
                        **_share("state", int(checked["state_ok"].sum()), len(checked), wilson)})
    return pd.DataFrame(out)


def _arms(df: pd.DataFrame):
    """(arm, its rows in sending order), the arms in :data:`ARMS` order."""
    for arm in [a for a in ARMS if a in set(df["arm"])]:
        yield arm, df[df["arm"] == arm].sort_values("request")


def _share(name: str, k: int, n: int, wilson) -> dict:
    lo, hi = wilson(k, n) if n else (math.nan, math.nan)
    return {f"{name}_k": k, f"{name}_n": n, f"{name}_lo": lo, f"{name}_hi": hi}
