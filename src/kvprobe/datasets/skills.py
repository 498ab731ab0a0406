"""Composition cases: precompilable skills and decision queries whose answer depends on them.

A **skill** is a block of text that a deployment would precompile once and splice into many
contexts. Three kinds, all built from the gated domains of :mod:`kvprobe.datasets.domains`:

- ``policy``: ``## Policy``, the domain's rule on one decision field (placed at a seeded line
  among the domain's filler rules) and filler rules up to the target length;
- ``tool``: a tool specification, ``## Tool {name}``, its input fields, a rule on when the tool
  may be called (one decision field) and filler notes;
- ``passage``: a retrieved record, ``## Record`` with the decision field's value among neutral
  record lines, then ``## Context`` lines and ``## Notes`` fillers.

Each skill's length is drawn in ``block_tokens`` (tokens of the target model's tokenizer, or
words of the word-level tokenizer when none is given) and every skill's text ends with a blank
line, so skills stack back to back.

A **query** names 1-4 skills in context order, a short lead (fresh text before the first
block) and the query text after the blocks; its expected answer follows from the decisive
skills' content:

- ``policy``/``tool`` queries: the record (``{field}: {value}``) is in the query and the rule is
  in the skill: the answer is yes iff the value is one the skill's rule allows;
- ``passage`` queries: the rule is in a policy skill and the value in a passage skill (two
  decisive blocks); the query only asks.

The other skills are distractors from other domains whose rules gate on other fields. Answers
alternate yes/no (balanced to within one). Everything is drawn from ``random.Random`` seeded by
the arguments (and, per skill, by its id), so the same arguments and tokenizer give the same set.
Words come from :func:`kvprobe.datasets.vocabulary` except the tool scaffold's ``Tool`` and
``input``, which the word-level tokenizer maps to UNK.

:func:`segments` tokenizes a set for one model: the shared preamble (BOS / chat head with the
system line), each skill, and each query's lead and query text (with the chat tail or the raw
``Answer:`` cue), each tokenized on its own so a skill's tokens are the same in every context.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from jinja2 import TemplateError

from kvprobe.datasets.domains import DOMAINS, OPTIONS, DecisionField, DomainSpec
from kvprobe.datasets.render import (
    ANSWER_CUE,
    ANSWER_WITH,
    BULLET,
    CONTEXT,
    NOTES,
    POLICY,
    RECORD,
    REQUEST,
    resolve_form,
)
from kvprobe.datasets.spans import bos_prefix
from kvprobe.datasets.words import words
from kvprobe.errors import KvprobeError, UsageError

SKILL_KINDS = ("policy", "tool", "passage")
SYSTEM = "You are an assistant. Apply the rules to the Record."
TOOL = "## Tool"
# One tool name per domain (words of the generator's vocabulary).
TOOL_NAMES = {
    "retail_refund": "refund", "airline_cancel": "booking", "deploy_guard": "deploy", "bank_withdraw": "withdraw",
    "doc_access": "access", "rx_safety": "dispense", "customs_route": "route", "oncall_route": "page",
}  # fmt: skip
MAX_BLOCK_TOKENS = 32768


@dataclass(frozen=True)
class Skill:
    skill_id: str
    kind: str  # one of SKILL_KINDS
    domain: str
    text: str  # ends with a blank line


@dataclass(frozen=True)
class ComposeQuery:
    query_id: str
    domain: str
    kind: str  # the kind of skill that decides: policy, tool or passage
    skills: tuple[str, ...]  # skill ids in context order
    decisive: tuple[str, ...]  # the skills whose content decides the answer
    lead: str  # fresh text before the first block
    query: str  # fresh text after the blocks (before the chat tail / answer cue)
    expected: str


@dataclass(frozen=True)
class ComposeSet:
    system: str
    options: tuple[str, str]
    skills: dict[str, Skill]
    queries: list[ComposeQuery]


# -- lengths ---------------------------------------------------------------------------------
def _counter(tokenizer):
    """Tokens of one line (with its newline) under ``tokenizer``, or word-level tokens."""
    if tokenizer is None:
        return lambda line: len(words(line + "\n"))
    return lambda line: len(tokenizer.encode(line + "\n", add_special_tokens=False))


def _fill(rng: random.Random, head: list[str], pool: list[str], target: int, count, fixed: list[str]) -> list[str]:
    """``head`` + filler lines drawn in shuffled rounds from ``pool`` until the text reaches
    about ``target`` tokens, with each ``fixed`` line inserted at a seeded place among them."""
    budget = target - sum(count(line) for line in head + fixed) - 1
    body: list[str] = []
    while budget > 0:
        round_ = list(pool)
        rng.shuffle(round_)
        for line in round_:
            if budget <= 0:
                break
            body.append(line)
            budget -= count(line)
    for line in fixed:
        body.insert(rng.randint(0, len(body)), line)
    return head + body


def _rule(spec: DomainSpec, template_idx: int, gate: DecisionField) -> str:
    return spec.templates[template_idx].rule.format(field=gate.name, allowed=" or ".join(gate.allow))


def _tool_rule(spec: DomainSpec, gate: DecisionField) -> str:
    return f"Allow {TOOL_NAMES[spec.name]} only if {gate.name} is {' or '.join(gate.allow)}."


# -- skills ----------------------------------------------------------------------------------
def _skill_rng(seed: int, skill_id: str) -> random.Random:
    return random.Random(f"{seed}:{skill_id}")


def policy_skill(domain: str, field: str, seed: int, target: int, tokenizer=None) -> Skill:
    spec = DOMAINS[domain]
    gate = next(f for f in spec.fields if f.name == field)
    sid = f"policy.{domain}.{field}"
    rng = _skill_rng(seed, sid)
    rule = _rule(spec, rng.randrange(len(spec.templates)), gate)
    pool = [BULLET + f for f in spec.fillers]
    lines = _fill(rng, [POLICY], pool, target, _counter(tokenizer), [rule])
    return Skill(sid, "policy", domain, "\n".join(lines) + "\n\n")


def tool_skill(domain: str, field: str, seed: int, target: int, tokenizer=None) -> Skill:
    spec = DOMAINS[domain]
    gate = next(f for f in spec.fields if f.name == field)
    sid = f"tool.{domain}.{field}"
    rng = _skill_rng(seed, sid)
    keys = [gate.name] + [key for key, _ in spec.record]
    head = [f"{TOOL} {TOOL_NAMES[domain]}", f"input: {', '.join(keys)}"]
    pool = [BULLET + f for f in spec.fillers]
    lines = _fill(rng, head, pool, target, _counter(tokenizer), [_tool_rule(spec, gate)])
    return Skill(sid, "tool", domain, "\n".join(lines) + "\n\n")


def passage_skill(domain: str, field: str, value: str, seed: int, target: int, tokenizer=None) -> Skill:
    spec = DOMAINS[domain]
    sid = f"passage.{domain}.{field}.{value}"
    rng = _skill_rng(seed, sid)
    record = [f"{key}: {rng.choice(pool)}" for key, pool in spec.record]
    record.insert(rng.randint(0, len(record)), f"{field}: {value}")
    head = [RECORD, *record, "", CONTEXT, *rng.sample(spec.context, 2), "", NOTES]
    pool = [BULLET + f for f in spec.fillers]
    lines = _fill(rng, head, pool, target, _counter(tokenizer), [])
    return Skill(sid, "passage", domain, "\n".join(lines) + "\n\n")


def _question(spec: DomainSpec, kind: str, skill_id: str, seed: int) -> str:
    if kind == "tool":
        q = f"Can {TOOL_NAMES[spec.name]} be called?"
    else:
        q = spec.templates[_skill_rng(seed, skill_id + ":q").randrange(len(spec.templates))].question
    return f"{q} {ANSWER_WITH.format(a=OPTIONS[0], b=OPTIONS[1])}"


# -- the set ---------------------------------------------------------------------------------
def check_options(n: int, block_tokens: tuple[int, int], n_blocks: tuple[int, int], kinds=SKILL_KINDS) -> None:
    """One-line usage errors for a composition set's options, before any work."""
    if n < 0:
        raise UsageError(f"n must be >= 0, got {n}")
    lo, hi = block_tokens
    if not 16 <= lo <= hi <= MAX_BLOCK_TOKENS:
        raise UsageError(f"block_tokens is a (min, max) length with 16 <= min <= max <= {MAX_BLOCK_TOKENS}, "
                         f"got {block_tokens}")
    if not 1 <= n_blocks[0] <= n_blocks[1] <= 4:
        raise UsageError(f"n_blocks is a (min, max) count with 1 <= min <= max <= 4, got {n_blocks}")
    bad = [k for k in kinds if k not in SKILL_KINDS]
    if bad or not kinds:
        raise UsageError(f"unknown skill kinds {bad or '(none given)'}; use some of {', '.join(SKILL_KINDS)}")
    if list(kinds) == ["passage"] and n_blocks[1] < 2:
        raise UsageError("passage queries need two blocks (a policy and a passage); allow n_blocks up to >= 2")


def generate_compose(n: int, seed: int = 0, tokenizer=None, block_tokens: tuple[int, int] = (200, 400),
                     n_blocks: tuple[int, int] = (1, 4), kinds=SKILL_KINDS) -> ComposeSet:
    """``n`` composition queries over a pool of skills (see the module docstring).

    Query kinds go round-robin over ``kinds`` and domains; ``passage`` queries need two blocks,
    so they get at least two. Skill lengths are drawn in ``block_tokens`` per skill.
    """
    block_tokens, n_blocks = tuple(block_tokens), tuple(n_blocks)
    check_options(n, block_tokens, n_blocks, kinds)
    rng = random.Random(f"compose:{seed}")
    skills: dict[str, Skill] = {}

    def target(sid: str) -> int:
        return _skill_rng(seed, sid + ":len").randint(*block_tokens)

    def get(kind: str, domain: str, field: str, value: str = "") -> str:
        sid = {"policy": f"policy.{domain}.{field}", "tool": f"tool.{domain}.{field}",
               "passage": f"passage.{domain}.{field}.{value}"}[kind]
        if sid not in skills:
            if kind == "passage":
                skills[sid] = passage_skill(domain, field, value, seed, target(sid), tokenizer)
            else:
                make = policy_skill if kind == "policy" else tool_skill
                skills[sid] = make(domain, field, seed, target(sid), tokenizer)
        return sid

    domains = list(DOMAINS)
    kinds_cycle = [k for k in SKILL_KINDS if k in kinds and (k != "passage" or n_blocks[1] >= 2)]
    answers = [OPTIONS[i % 2] for i in range(n)]
    rng.shuffle(answers)
    queries = []
    for i in range(n):
        kind = kinds_cycle[i % len(kinds_cycle)]
        domain = domains[(i // len(kinds_cycle)) % len(domains)]
        spec = DOMAINS[domain]
        gate = rng.choice(spec.fields)
        value = rng.choice(gate.allow if answers[i] == OPTIONS[0] else gate.deny)
        if kind == "passage":
            decisive = [get("policy", domain, gate.name), get("passage", domain, gate.name, value)]
        else:
            decisive = [get(kind, domain, gate.name)]
        k = rng.randint(max(n_blocks[0], len(decisive)), n_blocks[1])
        others = [(d, f.name) for d in domains if d != domain for f in DOMAINS[d].fields if f.name != gate.name]
        distractors = [get(rng.choice(("policy", "tool")), d, f) for d, f in rng.sample(others, k - len(decisive))]
        order = decisive + distractors
        rng.shuffle(order)
        if kind == "passage":  # the rule before the record, as a reader would expect
            a, b = order.index(decisive[0]), order.index(decisive[1])
            if a > b:
                order[a], order[b] = order[b], order[a]
        lead = f"{CONTEXT}\n{rng.choice(spec.context)}\n\n"
        question = _question(spec, kind, decisive[0], seed)
        if kind == "passage":
            query = f"{REQUEST}\n{question}"
        else:
            record = [f"{gate.name}: {value}"] + [f"{key}: {rng.choice(pool)}" for key, pool in spec.record]
            query = f"{RECORD}\n" + "\n".join(record) + f"\n\n{REQUEST}\n{question}"
        queries.append(ComposeQuery(f"{kind}-{domain}-s{seed}-{i:04d}", domain, kind, tuple(order), tuple(decisive),
                                    lead, query, answers[i]))
    return ComposeSet(SYSTEM, OPTIONS, skills, queries)


# -- tokens for one model ----------------------------------------------------------------------
@dataclass(frozen=True)
class QuerySegments:
    lead: list[int]
    query: list[int]  # the query text plus the chat tail (or the raw answer cue)


@dataclass(frozen=True)
class Segments:
    """A set tokenized for one model: the context is preamble + lead + skills... + query."""

    form: str
    preamble: list[int]
    skills: dict[str, list[int]]
    queries: dict[str, QuerySegments]


SENTINEL = "@@KVPROBE_COMPOSE_BODY@@"


def head_tail(tokenizer, system: str, form: str = "auto") -> tuple[str, str, str]:
    """(form, text before the user content, text after it) for the chosen prompt form.

    Chat: the template around one user turn, with ``system`` as a system turn (or atop the user
    turn for templates that reject a system role). Raw: BOS (when the tokenizer adds one) and
    the system line before, the ``Answer:`` cue after.
    """

    resolved = resolve_form(tokenizer, form)
    if resolved == "raw":
        return resolved, f"{bos_prefix(tokenizer, 'raw')}{system}\n\n", f"\n{ANSWER_CUE}"

    def apply(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)

    try:
        try:
            text = apply([{"role": "system", "content": system}, {"role": "user", "content": SENTINEL}])
        except TemplateError:
            text = apply([{"role": "user", "content": f"{system}\n\n{SENTINEL}"}])
    except TemplateError as err:
        raise KvprobeError(f"the chat template failed: {err}") from err
    if text.count(SENTINEL) != 1:
        raise KvprobeError("the chat template does not place the user content exactly once; use form 'raw'")
    head, tail = text.split(SENTINEL)
    return resolved, head, tail


def segments(data: ComposeSet, tokenizer, form: str = "auto") -> Segments:
    """Tokenize every part of ``data`` on its own (no special tokens added; the head holds BOS)."""
    resolved, head, tail = head_tail(tokenizer, data.system, form)

    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    skills = {sid: enc(s.text) for sid, s in data.skills.items()}
    queries = {q.query_id: QuerySegments(enc(q.lead), enc(q.query + tail)) for q in data.queries}
    return Segments(resolved, enc(head), skills, queries)
