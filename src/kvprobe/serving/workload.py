"""The agent workload of ``kvprobe serve-bench --workload agent`` (:mod:`kvprobe.serving.agent` runs it on a
server): the served template (a calibration spec with a long static policy text after its last field
line, :func:`padded_spec`), the sessions and their turns (:func:`workload`: each turn changes one field, a
gating one for ``gating_share`` of the turns), what each arm renders (:func:`arm_renderings`), and the
options' first tokens a chat model writes (:func:`answer_ids`). No server here: the workload is data."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from kvprobe.errors import KvprobeError, UsageError
from kvprobe.serving.prompts import fit_clauses
from kvprobe.serving.state import DEFAULT, PromptState, Rendering, renderings

# -- the served template --------------------------------------------------------------------------
def first_values(spec) -> dict[str, str]:
    """A fixed value per field (a list's first, a generator's first draw at seed 0): for lengths."""
    return {n: (vs.choices[0] if vs.choices else vs.sample(random.Random(0))) for n, vs in spec.fields.items()}


def padded_spec(spec, tokenizer, policy_tokens: int, seed: int = 0):
    """``spec`` with numbered policy clauses after its template text, grown until the prompt at the
    fields' first values has about ``policy_tokens`` tokens (0: ``spec`` as it is)."""
    from dataclasses import replace

    from kvprobe.datasets.domains import DOMAINS

    if not policy_tokens:
        return spec
    rng = random.Random(f"clauses:{seed}")
    pool = [f for name in sorted(DOMAINS) for f in DOMAINS[name].fillers]
    rng.shuffle(pool)

    def with_clauses(n: int):
        clauses = "\n".join(f"- Clause {i + 1}: {pool[i % len(pool)]}" for i in range(n))
        text = clauses.replace("{", "{{").replace("}", "}}")
        return replace(spec, template=f"{spec.template.rstrip()}\n\nPolicy notes:\n{text}\n")

    def length(n: int) -> int:
        s = with_clauses(n) if n else spec
        return len(PromptState(s, first_values(s)).ids(tokenizer))

    per_clause = max(1, len(tokenizer(f"- Clause 10: {pool[0]}\n", add_special_tokens=False)["input_ids"]))
    return with_clauses(fit_clauses(length, policy_tokens, per_clause))


def spec_yaml(spec) -> str:
    """A calibration spec as YAML that :func:`kvprobe.calibrate.engine.load_spec` reads back."""
    import yaml

    data = {**({"system": spec.system} if spec.system else {}), "template": spec.template,
            "question": spec.question, "options": list(spec.options),
            "fields": {k: list(v.choices) if v.kind == "one-of" else v.spec for k, v in spec.fields.items()}}
    return yaml.safe_dump(data, sort_keys=False, width=110, allow_unicode=True)


# -- the workload ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    session: int
    turn: int  # 1, 2, ...
    field: str
    kind: str  # gating | inert
    value: str


def agent_policy(cfg, spec, tokenizer):
    """The agent workload's field policy (``cfg.field_policy``, None without one), checked: a
    ``field_policy.yaml`` of this template (its fields) and of ``cfg.model`` (its tokenizer; its name
    too, when bundled: the served weights are not loaded here, so a local folder is trusted on them)."""
    from kvprobe.editor.strategies import parse_strategy
    from kvprobe.field_policy import FieldPolicy, load_any
    from kvprobe.models import bundled
    from kvprobe.models.load import tokenizer_hash

    if cfg.field_policy is None:
        return None
    policy = load_any(Path(cfg.field_policy), None, parse_strategy)
    if not isinstance(policy, FieldPolicy):
        raise KvprobeError(f"{cfg.field_policy} is a top-K policy (topk.yaml); the agent workload needs a "
                           f"field_policy.yaml from `kvprobe calibrate` of {cfg.spec}")
    calibrated = set(policy.fields)
    if not calibrated & set(spec.fields):
        raise KvprobeError(f"{cfg.field_policy} calibrated {', '.join(sorted(calibrated))}, none of the "
                           f"fields of {cfg.spec} ({', '.join(spec.fields)}); calibrate this template")
    stored = policy.model.get("spec")
    if (cfg.model in bundled.BUNDLED and stored != cfg.model) or \
            policy.model.get("tokenizer_hash") != tokenizer_hash(tokenizer):
        raise KvprobeError(f"{cfg.field_policy} was calibrated for {stored}, not {cfg.model} (its name "
                           f"or tokenizer differs); calibrate this model")
    return policy


def gating_fields(spec, policy, gating: list[str] | None) -> list[str]:
    """The fields whose updates are gating: ``gating`` as given, else those the field policy measured
    as moving the decision (relevance ``gating`` or ``mixed``)."""
    names = list(spec.fields)
    if gating is not None:
        bad = [g for g in gating if g not in names]
        if bad:
            raise UsageError(f"--gating names {bad[0]!r}, not a field of {spec.path}; its fields: {', '.join(names)}")
        return list(gating)
    if policy is None:
        raise UsageError("say which fields gate the decision: give --field-policy (their measured relevance) or "
                         "--gating FIELD[,FIELD]")
    return [n for n in names if (policy.fields.get(n) or {}).get("relevance") in ("gating", "mixed")]


def workload(spec, gating: list[str], sessions: int, turns: int, gating_share: float, seed) \
        -> tuple[list[dict[str, str]], list[Turn]]:
    """(each session's starting values, the turns in sending order: turn-major)."""
    rng = random.Random(f"agent:{seed}")
    inert = [n for n in spec.fields if n not in gating]
    starts = [{n: vs.sample(rng) for n, vs in spec.fields.items()} for _ in range(sessions)]
    current = [dict(s) for s in starts]
    out = []
    for t in range(1, turns + 1):
        for s in range(sessions):
            gate = bool(gating) and (not inert or rng.random() < gating_share)
            name = rng.choice(gating if gate else inert)
            value = spec.fields[name].other(current[s][name], rng)
            current[s][name] = value
            out.append(Turn(s, t, name, "gating" if gate else "inert", value))
    return starts, out


def arm_renderings(arm: str, spec, policy, calibrated=()) -> dict[str, Rendering]:
    """Each field's rendering in ``arm``; the policy arms' from ``policy``, which must be of ``spec``
    or of one of ``calibrated`` (the unpadded spec). ``policy+edit`` (an engine that edits its own
    cache) repairs a field whose established repair is field_only or selective in place."""
    if arm == "rerender":
        return {n: Rendering("rerender", reason="the reference: every value in place") for n in spec.fields}
    if arm == "erratum":
        return {n: DEFAULT for n in spec.fields}
    if policy is None:
        raise UsageError("the policy arm needs a per-field policy: give --field-policy FIELD_POLICY.YAML "
                         "(from `kvprobe calibrate`), or leave the arm out")
    return renderings(spec, policy, calibrated=calibrated, in_place=arm == "policy+edit")


def answer_ids(tokenizer, options: list[str]) -> dict[str, list[int]]:
    """Each option's first-token ids as a chat model writes the answer: the option as given and
    capitalised, bare and after a space (``yes``, `` yes``, ``Yes``, `` Yes``). A chat model's greedy
    answer is often the capitalised form; the lower-case ids alone (kvprobe's rule on logits, which
    calibrate used) can leave the decision to a tie between two unlikely tokens."""
    from kvprobe.datasets.spans import option_ids

    return {o: list(dict.fromkeys(option_ids(tokenizer, o) + option_ids(tokenizer, o[:1].upper() + o[1:])))
            for o in options}


def policy_digest(policy_path: str | None) -> str | None:
    """A field policy file's content hash (16 hex digits) for a results folder's claim; None without one."""
    import hashlib

    return hashlib.sha256(Path(policy_path).read_bytes()).hexdigest()[:16] if policy_path else None


def policy_template(policy_path: str | None, served, base) -> str | None:
    """What the field policy was calibrated on: ``served`` (this very template), ``unpadded`` (the
    spec without the policy clauses), or ``other``; None without a policy."""
    import yaml

    if policy_path is None:
        return None
    digest = str(((yaml.safe_load(Path(policy_path).read_text()) or {}).get("template") or {}).get("sha256"))
    return "served" if digest == served.digest() else "unpadded" if digest == base.digest() else "other"
