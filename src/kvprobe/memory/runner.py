"""``kvprobe memory``'s measurement: per question of the memory set (:mod:`kvprobe.datasets.memory`),
one tidy row per arm. A user's states (caches) are built once and each of the user's questions is
read on them (the cache is left as it was by :func:`~kvprobe.kv.decode.decide`).

Arms, by ``group``::

    qa          early             full prefill, profile before the trajectory (current profile)
                late              full prefill, profile after the trajectory (current profile)
    edit        stale             the late cache as it is (no repair: the control)
                oracle            the edited profile re-rendered, full prefill (the reference)
                erratum           the late cache + the correction line (paper template), then the question
                neutral           the late cache + a line that says nothing (:data:`~kvprobe.datasets.memory.NEUTRAL`)
                                  where the erratum goes: the control for the erratum (its ``changed``
                                  is the model's answer bias under any appended line)
                field_only        the late cache with the edited value's tokens recomputed against it
                                  (:func:`~kvprobe.kv.recompute.recompute_positions`), the rest stale
                policy            with a per-field policy (:mod:`kvprobe.memory.policy`): the row of
                                  the repair it chose for the user's edited fact (``repair``)
    transplant  transplant_full   full prefill of preamble + the next session + profile
                transplant_seamS  the profile precompiled once behind the preamble (a block), spliced
                                  after preamble + next session with re-rotation
                                  (:func:`~kvprobe.composer.compose`), its first S tokens fed fresh

Per row: the arm's decision (arg-max of the options' first-token logits, :func:`_decide`) and ``option_diff``,
``expected`` (the current profile's answer; after the edit for the edit arms; empty for negative
questions), ``correct``, ``reference`` (the oracle's answer for edit arms, ``transplant_full``'s for
transplant arms) and ``agree`` with it, ``changed`` (edit arms: the answer differs from ``late``,
the pre-edit decision; on negative questions that is the control), and cost: ``tokens_recomputed``
(tokens whose K/V this arm computed to build its state, plus the question's), ``wall_s`` (building
the state, shared by the user's questions: a cache a deployment already holds counts 0),
``decide_s`` (reading the question) and ``setup_s`` (transplant arms: precompiling the profile
block, once per user, not a per-request cost).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from kvprobe.composer import compose, precompile
from kvprobe.composer.gate import _decide, option_token_ids
from kvprobe.datasets.memory import MemorySet, generate_memory
from kvprobe.datasets.memory_tokens import MemorySegments, segments
from kvprobe.editor import states
from kvprobe.executor import Context, Serial
from kvprobe.kv.decode import Edited, decide
from kvprobe.metrics import mean_ci, proportion, tost_paired

GROUPS = ("qa", "edit", "transplant")
DEFAULT_SEAMS = (0, 4)
DEFAULT_MARGIN = 0.05
COLUMNS = ("model", "question_id", "user_id", "kind", "fact", "group", "arm", "repair", "layout", "answer",
           "option_diff", "expected", "correct", "reference", "agree", "changed", "context_tokens", "tokens_recomputed",
           "frac_recomputed", "wall_s", "decide_s", "setup_s", "error")


@dataclass
class State:
    """A cache standing for a context, and what building it cost."""

    cache: object | None  # a DynamicCache; None when the arm cannot be built (``error`` says why)
    context_tokens: int
    recomputed: int
    wall_s: float
    setup_s: float = float("nan")
    error: str = ""


def seam_arm(seam: int) -> str:
    return f"transplant_seam{seam}"


def arms(seams: Sequence[int] = DEFAULT_SEAMS, policy: bool = False) -> list[tuple[str, str]]:
    """(group, arm) in table order (``policy``: with the per-field policy arm)."""
    return [("qa", "early"), ("qa", "late"), ("edit", "stale"), ("edit", "oracle"), ("edit", "erratum"),
            ("edit", "neutral"), ("edit", "field_only"), *([("edit", "policy")] if policy else []),
            ("transplant", "transplant_full"), *(("transplant", seam_arm(s)) for s in seams)]


# Each state is the editor's (kvprobe.editor.states), built on a user's context rather than a case's prompt.
@torch.no_grad()
def prefill_state(lm, ids: list[int]) -> State:
    """A full prefill of ``ids`` into a fresh full-length cache (the oracle's state)."""
    lm.check_length(len(ids))
    t0 = time.perf_counter()
    cache = states.prefilled(lm, ids)
    return State(cache, len(ids), len(ids), time.perf_counter() - t0)


@torch.no_grad()
def erratum_state(lm, late: State, erratum: list[int]) -> State:
    """The late (stale) cache with the correction (or the neutral) line prefilled on top of it (the late
    cache is left as it was)."""
    t0 = time.perf_counter()
    cache = states.appended(lm, late.cache, erratum)
    return State(cache, late.context_tokens + len(erratum), len(erratum), time.perf_counter() - t0)


def field_only_state(lm, late: State, new_ids: list[int], span: tuple[int, int], old_ids: list[int]) -> State:
    """The late cache with the edited value's positions recomputed from ``new_ids`` (the rest stale)."""
    if len(new_ids) != len(old_ids):
        return State(None, len(new_ids), 0, float("nan"), error=f"the new value takes {len(new_ids) - len(old_ids):+d} "
                                                               f"token(s): field-only replaces tokens one for one")
    t0 = time.perf_counter()
    cache = states.recomputed(lm, late.cache, new_ids, list(range(*span)))
    return State(cache, len(new_ids), span[1] - span[0], time.perf_counter() - t0)


def transplant_state(lm, head: list[int], block, seam: int, setup_s: float) -> State:
    """The profile block spliced after ``head`` (preamble + next session), re-rotated, ``seam`` fresh."""
    t0 = time.perf_counter()
    c = compose(lm, [head, block], seam=seam)
    return State(c.cache, len(c.ids), len(head) + min(seam, len(block)), time.perf_counter() - t0, setup_s)


def user_states(lm, data: MemorySet, segs: MemorySegments, user_id: str, seams: Sequence[int]) -> dict[str, State]:
    """Every arm's state for one user (built once; the user's questions are read on them)."""
    u = segs.users[user_id]
    early, _ = segs.context(user_id, "early")
    late_ids, (p0, _) = segs.context(user_id, "late")
    new_ids, _ = segs.context(user_id, "late", edited=True)
    states = {"early": prefill_state(lm, early), "late": prefill_state(lm, late_ids)}
    late = states["late"]
    states["stale"] = State(late.cache, late.context_tokens, 0, 0.0)
    states["oracle"] = prefill_state(lm, new_ids)
    states["erratum"] = erratum_state(lm, late, u.erratum)
    states["neutral"] = erratum_state(lm, late, segs.neutral)
    s0, s1 = u.profile_new.spans[data.users[user_id].edit_key]
    states["field_only"] = field_only_state(lm, late, new_ids, (p0 + s0, p0 + s1), late_ids)
    head = segs.preamble + u.next_session
    states["transplant_full"] = prefill_state(lm, head + u.profile.ids)
    t0 = time.perf_counter()
    block = precompile(lm, u.profile.ids, segs.preamble, name=f"profile:{user_id}")
    setup_s = time.perf_counter() - t0
    for s in seams:
        states[seam_arm(s)] = transplant_state(lm, head, block, s, setup_s)
    return states


def read_question(lm, st: State, tail: list[int], options: dict[str, list[int]]) -> tuple[str, float, float]:
    """The decision (answer, option_diff: the first option's score minus the second's) of the question ``tail``
    read on ``st``'s cache, and the read's seconds
    (the cache is left as it was)."""
    t0 = time.perf_counter()
    logits, _ = decide(lm, Edited(st.cache, list(tail), 0, st.context_tokens + len(tail)))
    answer, diff = _decide(logits, options)
    return answer, diff, time.perf_counter() - t0


def question_rows(lm, data: MemorySet, segs: MemorySegments, states: dict[str, State], question_id: str,
                  options: dict[str, list[int]], seams: Sequence[int], model_name: str = "",
                  policy: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per arm for one question, read on its user's ``states``. With ``policy`` (fact key ->
    ``field_only``, ``erratum`` or ``oracle``: :mod:`kvprobe.memory.policy`), the ``policy`` arm is the
    row of the repair chosen for the user's edited fact (the same state and read: nothing recomputed;
    ``repair`` names it; a fact the policy lacks, or a repair that cannot be made for this edit, gets
    the oracle)."""
    q = next(x for x in data.questions if x.question_id == question_id)
    tail = segs.questions[q.question_id]
    rows = {}
    for group, arm in arms(seams, policy is not None):
        if arm == "policy":
            chosen = policy.get(data.users[q.user_id].edit_key, "oracle")
            if rows[chosen]["error"]:  # the chosen repair cannot be made here (field-only, another length)
                chosen = "oracle"  # what a deployment of the policy does then: a full re-prefill
            rows[arm] = {**rows[chosen], "arm": arm, "repair": chosen}
            continue
        st = states[arm]
        row = {"model": model_name, "question_id": q.question_id, "user_id": q.user_id, "kind": q.kind,
               "fact": q.fact, "group": group, "arm": arm, "repair": None,
               "layout": "early" if arm == "early" else "late",
               "expected": q.expected_new if group == "edit" else q.expected_old,
               "context_tokens": st.context_tokens + len(tail), "setup_s": st.setup_s, "error": st.error or None}
        if st.cache is None:
            rows[arm] = {**row, "answer": "", "option_diff": float("nan"), "tokens_recomputed": float("nan"),
                         "wall_s": float("nan"), "decide_s": float("nan")}
            continue
        answer, diff, decide_s = read_question(lm, st, tail, options)
        rows[arm] = {**row, "answer": answer, "option_diff": diff, "tokens_recomputed": st.recomputed + len(tail),
                     "wall_s": st.wall_s, "decide_s": decide_s}
    ref = {"edit": rows["oracle"]["answer"], "transplant": rows["transplant_full"]["answer"]}
    for r in rows.values():
        r["frac_recomputed"] = r["tokens_recomputed"] / r["context_tokens"]
        r["correct"] = (float(r["answer"] == r["expected"]) if r["expected"] and r["answer"] else float("nan"))
        r["reference"] = ref.get(r["group"], "")
        r["agree"] = float(r["answer"] == r["reference"]) if r["reference"] and r["answer"] else float("nan")
        r["changed"] = (float(r["answer"] != rows["late"]["answer"]) if r["group"] == "edit" and r["answer"]
                        else float("nan"))
    return pd.DataFrame(list(rows.values()), columns=list(COLUMNS))


def run_memory(lm, n: int, seed: int = 0, form: str = "auto", sessions: int = 3,
               session_tokens: tuple[int, int] = (120, 200), questions_per_user: int = 4,
               seams: Sequence[int] = DEFAULT_SEAMS, model_name: str = "", store=None,
               on_question: Callable[[], None] = lambda: None, executor=None, data: MemorySet | None = None,
               policy: dict[str, str] | None = None) -> pd.DataFrame:
    """Every arm on ``n`` questions of the memory set (finished questions kept in ``store``, a
    :class:`~kvprobe.results.CaseStore`, for resume), through ``executor`` (serial by default).
    The states of the user of the question at hand are kept per process (one user at a time).
    ``policy`` (fact key -> repair, :func:`kvprobe.memory.policy.calibrate_policy`) adds its arm."""
    data = data or generate_memory(n, seed, lm.tokenizer, sessions, session_tokens, questions_per_user)
    segs = segments(data, lm.tokenizer, form)
    options = {o: option_token_ids(lm.tokenizer, o) for o in data.options}
    seams = sorted({int(s) for s in seams})

    def one(ctx, q):
        ctx.keep("memory.warm", lambda lm: prefill_state(lm, segs.preamble))  # the first forward is slow: untimed
        held = ctx.memo.get("memory.user")
        if held is None or held[0] != q.user_id:
            ctx.memo.pop("memory.user", None)  # one user's caches at a time
            ctx.memo["memory.user"] = (q.user_id, user_states(ctx.lm, data, segs, q.user_id, seams))
        return question_rows(ctx.lm, data, segs, ctx.memo["memory.user"][1], q.question_id, options, seams,
                             model_name, policy)

    executor = executor or Serial()
    return executor.map(store, [(q.question_id, q) for q in data.questions], one, Context(lm), on_question)


# -- the summary -----------------------------------------------------------------------------------
def summarize_memory(df: pd.DataFrame, margin: float = DEFAULT_MARGIN) -> pd.DataFrame:
    """One row per arm: accuracy against the expected answers (Wilson 95% CI, n: questions the profile
    decides), agreement with the group's reference (edit: oracle; transplant: full recompute), the
    share of negative questions whose decision the edit changed (edit arms), mean recomputed tokens
    and fraction, and mean state-build and question-read seconds."""
    rows = []
    for (group, arm), g in df.groupby(["group", "arm"], sort=False):
        ok = g[g["error"].isna()]
        acc = proportion(ok["correct"])
        agree = proportion(ok["agree"])
        neg = proportion(ok.loc[ok["kind"] == "negative", "changed"])
        flip = proportion(ok.loc[ok["kind"] == "edited", "changed"])
        rows.append({"group": group, "arm": arm, "n_questions": len(g), "n_errors": len(g) - len(ok),
                     "accuracy": acc[0], "accuracy_lo": acc[1], "accuracy_hi": acc[2], "accuracy_n": acc[3],
                     "agreement": agree[0], "agreement_lo": agree[1], "agreement_hi": agree[2], "agreement_n": agree[3],
                     "edited_changed": flip[0], "edited_changed_n": flip[3],
                     "negative_changed": neg[0], "negative_changed_lo": neg[1], "negative_changed_hi": neg[2],
                     "negative_changed_n": neg[3],
                     "tokens_recomputed": mean_ci(ok["tokens_recomputed"])[0],
                     "frac_recomputed": mean_ci(ok["frac_recomputed"])[0],
                     "wall_s": mean_ci(ok["wall_s"])[0], "decide_s": mean_ci(ok["decide_s"])[0],
                     "repairs": ", ".join(f"{k} {v}" for k, v in ok["repair"].value_counts().items())
                     if "repair" in ok else ""})
    return pd.DataFrame(rows)


def paired(df: pd.DataFrame, arm_a: str, arm_b: str, column: str = "correct") -> tuple[pd.Series, pd.Series]:
    """``column`` of two arms, aligned by question (questions missing on either side dropped)."""
    a = df[df["arm"] == arm_a].set_index("question_id")[column]
    b = df[df["arm"] == arm_b].set_index("question_id")[column]
    both = a.index.intersection(b.index)
    return a.loc[both].astype(float), b.loc[both].astype(float)


def equivalence(df: pd.DataFrame, margin: float = DEFAULT_MARGIN, alpha: float = 0.05) -> pd.DataFrame:
    """TOST (:func:`kvprobe.metrics.tost_paired`) of accuracy, paired by question: each transplant
    seam against ``transplant_full``, and ``late`` against ``early`` (the placement's cost)."""
    pairs = [(arm, "transplant_full") for arm in df["arm"].unique() if str(arm).startswith("transplant_seam")]
    rows = []
    for a, b in [*pairs, ("late", "early")]:
        x, y = paired(df[df["error"].isna()], a, b)
        t = tost_paired(x, y, margin, alpha)
        rows.append({"arm": a, "against": b, "value": t["diff"], **t})  # value: the house's name for a statistic
    return pd.DataFrame(rows)
