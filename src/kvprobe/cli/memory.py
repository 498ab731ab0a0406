"""``kvprobe memory``: user memory on the generated long-conversation set, placed early or late, a fact
edited (oracle, erratum, field-only), and the profile transplanted (precompiled once, re-rotated and
spliced) against a full recompute, with a TOST for the accuracy difference (docs/memory.md)."""

from __future__ import annotations

import math
from typing import Annotated

import typer
from rich.table import Table

from kvprobe.cli import options as opt
from kvprobe.cli.common import console, load_with_status, progress_bar, progress_of, usable_out
from kvprobe.errors import UsageError

Sessions = Annotated[int, typer.Option(help="dialogue sessions in each user's trajectory (1-32)")]
SessionTokens = Annotated[str, typer.Option("--session-tokens", help=(
    "MIN,MAX tokens of each session (drawn per session, in the model's tokens; 32 <= MIN <= MAX <= 8192)"))]
PerUser = Annotated[int, typer.Option("--questions-per-user", help=(
    "questions per user (3-12): on the edited fact, on another fact, negative (the profile does not decide), "
    "in turn"))]
Seams = Annotated[str, typer.Option(help="comma-separated seam widths (tokens of the profile block fed fresh) of "
                                         "the transplant arms, each >= 0")]
Margin = Annotated[float, typer.Option(help="TOST equivalence margin for an accuracy difference, in (0, 1)")]
Alpha = Annotated[float, typer.Option(help="TOST level: equivalent when the (1 - 2 alpha) interval lies inside "
                                           "(-margin, margin); in (0, 0.5)")]
MemN = Annotated[int, typer.Option("--n", min=1, help="questions (users: n / questions-per-user, rounded up)")]
PolicyUsers = Annotated[int, typer.Option("--policy-users", help=(
    "calibration users (apart from the evaluation's) for the per-field policy arm: each edited on every profile "
    "fact, a fact's calibration stopping at its verdict; 0: no policy arm"))]


def _pair(value: str, option: str) -> tuple[int, int]:
    try:
        lo, hi = (int(p) for p in opt.parse_csv(value))
    except ValueError:  # not numbers, or not two of them
        raise UsageError(f"{option} takes MIN,MAX whole numbers, got {value!r}") from None
    return lo, hi


def _seams(value: str) -> list[int]:
    try:
        seams = sorted({int(s) for s in opt.parse_csv(value)})
    except ValueError:
        raise UsageError(f"--seams takes comma-separated whole numbers >= 0, got {value!r}") from None
    if not seams or seams[0] < 0:
        raise UsageError(f"--seams takes comma-separated whole numbers >= 0, got {value!r}")
    return seams


def memory(model: opt.Model = opt.DEFAULTS["model"], n: MemN = 40, seed: opt.Seed = 0,
           form: opt.Form = opt.DEFAULTS["form"], sessions: Sessions = 3, session_tokens: SessionTokens = "120,200",
           questions_per_user: PerUser = 4, seams: Seams = "0,4", policy_users: PolicyUsers = 0,
           threshold: opt.Threshold = opt.DEFAULTS["threshold"], margin: Margin = 0.05, alpha: Alpha = 0.05,
           dtype: opt.Dtype = "float32", device: opt.Device = "cpu", device_map: opt.DeviceMap = "none",
           allow_failed_toy: opt.AllowFailedToy = False, out: opt.Out = None) -> None:
    """QA accuracy with the user profile early vs late, a profile fact edited (oracle, erratum, field-only, and
    with --policy-users the per-field policy calibrated on other users), and the profile transplanted vs full
    recompute with a TOST; writes memory.parquet and prints the summary.

    Exits 2 for a bad option (before anything is loaded or claimed).
    """
    from kvprobe.datasets.memory import check_options, generate_memory
    from kvprobe.memory import arms, run_memory
    from kvprobe.experiment import Experiment, Step
    from kvprobe.results import MEMORY, MEMORY_CLAIM, MEMORY_MANIFEST

    span, seam_list = _pair(session_tokens, "--session-tokens"), _seams(seams)
    check_options(n, sessions, span, questions_per_user)
    if not 0 < margin < 1:
        raise UsageError(f"--margin must be in (0, 1), got {margin}")
    if not 0 < alpha < 0.5:
        raise UsageError(f"--alpha must be in (0, 0.5), got {alpha}")
    if not 0 <= policy_users <= 10_000:
        raise UsageError(f"--policy-users must be a whole number in 0..10000 (0: no policy arm), got {policy_users}")
    out = usable_out(out or opt.default_out("memory", model))
    settings = {"command": "memory", "model": model, "n": n, "seed": seed, "form": form, "sessions": sessions,
                "session_tokens": list(span), "questions_per_user": questions_per_user, "seams": seam_list,
                "arms": [a for _, a in arms(seam_list, policy_users > 0)]}  # other arms' folder: refused
    if policy_users:  # the policy arm's rows depend on its calibration
        settings.update(policy_users=policy_users, threshold=threshold)
    exp = Experiment("memory", out, MEMORY_CLAIM, settings, held="kvprobe memory with other settings", dtype=dtype)
    opened = exp.open(lambda: load_with_status(model, dtype, device, allow_failed_toy=allow_failed_toy,
                                               device_map=device_map),
                      prepare=lambda lm, _: generate_memory(n, seed, lm.tokenizer, sessions, span, questions_per_user),
                      items=lambda o: {q.question_id: _Item(q, o.prepared.users[q.user_id])
                                       for q in o.prepared.questions})
    lm, data, policy = opened.lm, opened.prepared, None
    if policy_users:
        policy = _calibrate(lm, exp, policy_users, seed, form, sessions, span, threshold, model)

    def answers(store, tick):
        return run_memory(lm, n, seed, form, sessions, span, questions_per_user, seam_list, model_name=model,
                          store=store, on_question=tick, data=data, policy=policy.repairs if policy else None)

    with progress_bar() as bar:
        df = exp.step(Step("memory", f"memory: {len(data.questions)} questions of {len(data.users)} users", answers,
                           total=n), progress=progress_of(bar))
    path = out / MEMORY
    from kvprobe.memory import equivalence, summarize_memory
    from kvprobe.reports.summary import write_summary

    summ, tost = summarize_memory(df), equivalence(df, margin, alpha)
    # summary.json's memory fact, and the report's section, read the folder
    summary = exp.finish(MEMORY_MANIFEST, summarize=write_summary, **exp.folder.settings,
                         equivalence_margin=margin, alpha=alpha, n_users=len(data.users),
                         tost_test="interval inclusion: the (1 - 2 alpha) Tango score interval for paired proportions",
                         policy=policy.describe() if policy else None,
                         summary=summ.to_dict(orient="records"), equivalence=tost.to_dict(orient="records"))
    print_summary(summ, tost, model)
    console.print(f"wrote {path} ({MEMORY}) and {summary}")


def _calibrate(lm, exp, users: int, seed: int, form: str, sessions: int, span, threshold: float, title: str):
    """The per-field policy, calibrated on ``users`` calibration users (kept for resume), printed."""
    from kvprobe.datasets.memory import calibration_memory
    from kvprobe.experiment import Step
    from kvprobe.memory.policy import calibrate_policy
    from kvprobe.results import MEMORY_CALIBRATION

    data = calibration_memory(users, seed, lm.tokenizer, sessions, span)

    def calibrate(store, tick):
        return calibrate_policy(lm, users, seed, form, sessions, span, threshold, store=store, data=data,
                                on_element=lambda fact, done: tick())

    with progress_bar() as bar:
        policy = exp.step(Step(MEMORY_CALIBRATION.removesuffix(".parquet"), f"policy: calibrating on {users} users "
                               f"({len(data.users)} edits at most)", calibrate, total=len(data.users)),
                          progress=progress_of(bar))
    print_policy(policy, title)
    return policy


def print_policy(policy, title: str) -> None:
    """Per profile fact: the repair chosen, each candidate's agreement with its interval, and why."""
    table = Table(title=f"per-field policy: {title} (threshold {policy.threshold:g}; elements = edits of the fact; "
                        f"intervals: confidence sequence)")
    for col in ("fact", "elements", "changed", "field_only", "erratum", "repair", "why"):
        table.add_column(col, justify="right" if col in ("elements", "changed") else "left")
    for f in policy.describe()["fields"].items():
        name, d = f
        cells = [f"{s['k']}/{s['n']} [{s['lo']:.2f}, {s['hi']:.2f}]" for s in d["strategies"].values()]
        table.add_row(name, str(d["elements"]), str(d["changed"]), *cells, d["repair"], d["reason"])
    console.print(table)


class _Item:
    """What a question's rows are computed from (its content fingerprint): the question and its user."""

    def __init__(self, question, user):
        self.question, self.user = question, user


def _ci(p: float, lo: float, hi: float, k: int) -> str:
    return "-" if not k or math.isnan(p) else f"{p:.2f} [{lo:.2f}, {hi:.2f}] ({k})"


def print_summary(summ, tost, title: str) -> None:
    """Per arm: accuracy, agreement with its reference, the negatives the edit moved, cost; then the TOSTs."""
    table = Table(title=f"memory: {title}")
    for col in ("group", "arm", "accuracy [95% CI] (n)", "agreement [95% CI] (n)", "negatives changed (n)",
                "recomputed tokens (frac)", "state ms", "read ms"):
        table.add_column(col, justify="left" if col in ("group", "arm") else "right")
    for r in summ.itertuples():
        arm = f"{r.arm} ({r.repairs})" if getattr(r, "repairs", "") else r.arm  # the policy's repairs
        table.add_row(r.group, arm, _ci(r.accuracy, r.accuracy_lo, r.accuracy_hi, r.accuracy_n),
                      _ci(r.agreement, r.agreement_lo, r.agreement_hi, r.agreement_n),
                      _ci(r.negative_changed, r.negative_changed_lo, r.negative_changed_hi, r.negative_changed_n),
                      f"{r.tokens_recomputed:.0f} ({r.frac_recomputed:.2f})", f"{1000 * r.wall_s:.1f}",
                      f"{1000 * r.decide_s:.1f}")
    console.print(table)
    eq = Table(title="accuracy difference, paired by question: TOST")
    for col in ("arm - against", "n", "discordant (+/-)", "difference", "interval", "margin", "equivalent"):
        eq.add_column(col, justify="left" if col == "arm - against" else "right")
    for r in tost.itertuples():
        eq.add_row(f"{r.arm} - {r.against}", str(r.n), f"{r.only_a}/{r.only_b}", f"{r.diff:+.3f}",
                   f"{r.confidence:.0%} [{r.lo:+.3f}, {r.hi:+.3f}]", f"±{r.equivalence_margin:g}",
                   "yes" if r.equivalent else "no")
    console.print(eq)
