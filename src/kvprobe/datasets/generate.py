"""A seeded, deterministic generator of field-edit cases over the paper's gated domains.

Cases go round-robin over the domains. Edits flip yes->no and no->yes equally often, and
controls hold yes and no equally often, within each domain and overall (to within one case). All
randomness comes from one ``random.Random(seed)``: the same arguments give the same list.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from kvprobe.datasets.domains import CONTROL_FIELDS, DOMAINS, OPTIONS, DecisionField, DomainSpec
from kvprobe.datasets.layouts import FIELD_STYLES, LAYOUT_WORDS, LAYOUTS, label
from kvprobe.datasets.render import SCAFFOLD, render_body
from kvprobe.datasets.schema import POSITIONS, Demo, EditCase
from kvprobe.datasets.words import words
from kvprobe.errors import UsageError

ERRATUM = (
    "[STATE UPDATE] {field} has just changed to {value}; this overrides any earlier value. Apply the current value."
)
SHORT_ERRATUM = "[STATE UPDATE] {field} -> {value}; overrides any earlier value."
# A neutral wording: the value changed, decide with the current record; no "overrides", no
# "apply", which may invite a flip where the field does not matter (kvprobe calibrate measures it).
NEUTRAL_ERRATUM = "Note: {field} is now {value}. Decide with the current record."
ERRATUM_TEMPLATES = {"paper": ERRATUM, "short": SHORT_ERRATUM, "neutral": NEUTRAL_ERRATUM}  # names a spec may use
# rule_style "deny": the rule names the values that deny instead of those that allow.
DENY_RULE = "Answer {no} if {field} is {denied}; otherwise answer {yes}."
RULE_STYLES = ("allow", "deny")
MAX_FILLER_TOKENS = 4096


def erratum_text(field: str, value: str, template: str | None = None) -> str:
    """The state-update line announcing ``field`` = ``value`` (the paper's template by default)."""
    return (template or ERRATUM).format(field=field, value=value)


def _answer(spec: DecisionField, value: str) -> str:
    return OPTIONS[0] if value in spec.allow else OPTIONS[1]


def draw_case(
    rng: random.Random,
    spec: DomainSpec,
    *,
    case_id: str,
    control: bool,
    allow_first: bool,
    decision: Sequence[DecisionField],
    control_fields: Sequence[str],
    fillers: tuple[int, int],
    positions: Sequence[str],
    system: bool,
    cot: bool,
    layout: str = "record",
    field_style: str = "key",
    rule_style: str = "allow",
    filler_tokens: int | None = None,
) -> EditCase:
    """One case of ``spec``; ``allow_first``: the old (or, for a control, the fixed) value allows.

    With ``filler_tokens``, the field comes first (``field_position`` "early") and filler sentences
    of about that many word-level tokens follow it (see :func:`downstream_fillers`).
    """
    template = rng.choice(spec.templates)
    gate = rng.choice(decision)
    first, second = (gate.allow, gate.deny) if allow_first else (gate.deny, gate.allow)
    if control:
        field = rng.choice(control_fields)
        old, new = rng.sample(CONTROL_FIELDS[field], 2)
        record = [(gate.name, rng.choice(first))]
        expected_old = expected_new = _answer(gate, record[0][1])
    else:
        field = gate.name
        old, new = rng.choice(first), rng.choice(second)
        record = []
        expected_old, expected_new = _answer(gate, old), _answer(gate, new)
    others = [name for name in CONTROL_FIELDS if name != field]
    record += [(name, rng.choice(CONTROL_FIELDS[name])) for name in rng.sample(others, rng.randint(1, 2))]
    key, pool = rng.choice(spec.record)
    record.append((key, rng.choice(pool)))
    rng.shuffle(record)
    name = label(gate.name, field_style)
    if rule_style == "deny":
        rule = DENY_RULE.format(no=OPTIONS[1], yes=OPTIONS[0], field=name, denied=" or ".join(gate.deny))
    else:
        rule = template.rule.format(field=name, allowed=" or ".join(gate.allow))
    if filler_tokens is None:
        chosen, position = rng.sample(spec.fillers, rng.randint(*fillers)), rng.choice(positions)
    else:
        chosen, position = downstream_fillers(rng, spec, filler_tokens), "early"
    return EditCase(
        case_id=case_id,
        domain=spec.name,
        field=field,
        old_value=old,
        new_value=new,
        control=control,
        system=template.system if system else None,
        rule=rule,
        fillers=chosen,
        field_position=position,
        context=rng.sample(spec.context, rng.randint(1, 2)),
        record=record,
        question=template.question,
        options=list(OPTIONS),
        expected_old=expected_old,
        expected_new=expected_new,
        template_id=template.id,
        cot=cot,
        layout=layout,
        field_style=field_style,
    )


def downstream_fillers(rng: random.Random, spec: DomainSpec, tokens: int) -> list[str]:
    """Filler sentences of about ``tokens`` word-level tokens (0: none): the domain's own in a seeded
    order, then the other domains' (every filler is neutral to every decision), round after round."""
    others = [f for name, other in DOMAINS.items() if name != spec.name for f in other.fillers]
    out: list[str] = []
    budget = tokens
    while budget > 0:
        pool = rng.sample(spec.fillers, len(spec.fillers)) + rng.sample(others, len(others))
        for line in pool:
            if budget <= 0:
                break
            out.append(line)
            budget -= len(words(line))
    return out


def _check_args(
    n: int, domains: Sequence[str], fields: Sequence[str] | None, controls: float,
    fillers: tuple[int, int], positions: Sequence[str], few_shot: int,
    layout: str = "record", field_style: str = "key", rule_style: str = "allow", filler_tokens: int | None = None,
) -> None:  # fmt: skip
    if n < 0:
        raise UsageError(f"n must be >= 0, got {n}")
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown or not domains:
        raise UsageError(f"unknown domains {unknown or '(none given)'}; use some of {', '.join(DOMAINS)}")
    if fields is not None:
        known = [f.name for d in domains for f in DOMAINS[d].fields] + list(CONTROL_FIELDS)
        unknown = [f for f in fields if f not in known]
        if unknown:
            accepted = ", ".join(dict.fromkeys(known))
            raise UsageError(f"unknown fields {unknown} for these domains; use some of {accepted}")
    if not 0.0 <= controls <= 1.0:
        raise UsageError(f"controls is a fraction in [0, 1], got {controls}")
    most = min(len(DOMAINS[d].fillers) for d in domains)
    if len(fillers) != 2 or not 0 <= fillers[0] <= fillers[1] <= most:
        raise UsageError(f"fillers is a (min, max) count with 0 <= min <= max <= {most}, got {fillers}")
    bad = [p for p in positions if p not in POSITIONS]
    if bad or not positions:
        raise UsageError(f"unknown field positions {bad or '(none given)'}; use some of {', '.join(POSITIONS)}")
    if few_shot < 0:
        raise UsageError(f"few_shot must be >= 0, got {few_shot}")
    for what, value, accepted in (("layout", layout, LAYOUTS), ("field style", field_style, FIELD_STYLES),
                                  ("rule style", rule_style, RULE_STYLES)):
        if value not in accepted:
            raise UsageError(f"unknown {what} {value!r}; use one of {', '.join(accepted)}")
    if filler_tokens is not None and not 0 <= filler_tokens <= MAX_FILLER_TOKENS:
        raise UsageError(f"filler tokens must be between 0 and {MAX_FILLER_TOKENS}, got {filler_tokens}")


def generate(
    n: int,
    seed: int = 0,
    domains: Sequence[str] | None = None,
    fields: Sequence[str] | None = None,
    controls: float = 0.2,
    fillers: tuple[int, int] = (2, 6),
    positions: Sequence[str] = POSITIONS,
    few_shot: int = 0,
    cot: bool = False,
    system: bool = True,
    layout: str = "record",
    field_style: str = "key",
    rule_style: str = "allow",
    filler_tokens: int | None = None,
) -> list[EditCase]:
    """``n`` cases, a fraction ``controls`` of them negative controls (rounded).

    ``layout``, ``field_style``, ``rule_style`` (the rule names the allowing or the denying values)
    and ``filler_tokens`` (about that much filler after the field, the field first) are the
    layout knobs (:mod:`kvprobe.datasets.layouts`); the defaults give today's record cases.

    ``fields`` limits which fields are edited (decision fields and/or control fields); a control
    case still gates on one of its domain's decision fields, held fixed in ``record``.
    ``fillers`` is the (min, max) number of filler rules; ``few_shot`` demos come from other domains.
    """
    names = list(domains) if domains is not None else list(DOMAINS)
    fillers = tuple(fillers)  # type: ignore[assignment]
    _check_args(n, names, fields, controls, fillers, positions, few_shot, layout, field_style, rule_style,
                filler_tokens)
    rng = random.Random(seed)
    n_control = round(n * controls)
    flags = [True] * n_control + [False] * (n - n_control)
    rng.shuffle(flags)

    control_fields = [f for f in CONTROL_FIELDS if fields is None or f in fields]
    if n_control and not control_fields:
        accepted = ", ".join(CONTROL_FIELDS)
        raise UsageError(f"controls={controls} needs a control field in fields; use some of {accepted}")
    decision = {d: [f for f in DOMAINS[d].fields if fields is None or f.name in fields] for d in names}
    usable = [d for d in names if decision[d]] if n_control < n else names
    if not usable:
        raise UsageError(f"no decision field of {', '.join(names)} is among fields {list(fields or [])}")

    slots = [(usable[i % len(usable)], control) for i, control in enumerate(flags)]
    # Alternate the answer along the cases sorted by (control, domain): balanced within each
    # domain and overall, to within one case.
    allow_first = [False] * n
    seen = {True: 0, False: 0}
    for i in sorted(range(n), key=lambda i: (slots[i][1], usable.index(slots[i][0]), i)):
        allow_first[i] = seen[slots[i][1]] % 2 == 0
        seen[slots[i][1]] += 1

    common = {"fillers": fillers, "positions": positions, "system": system, "layout": layout,
              "field_style": field_style, "rule_style": rule_style, "filler_tokens": filler_tokens}
    cases = []
    for i, (name, control) in enumerate(slots):
        spec = DOMAINS[name]
        case = draw_case(
            rng, spec, case_id=f"{name}-s{seed}-{i:04d}", control=control, allow_first=allow_first[i],
            decision=decision[spec.name] or spec.fields, control_fields=control_fields, cot=cot, **common,
        )  # fmt: skip
        if few_shot:
            case = case.model_copy(update={"few_shot": _demos(rng, spec.name, few_shot, common)})
        cases.append(case)
    return cases


def _demos(rng: random.Random, domain: str, k: int, common: dict) -> list[Demo]:
    """``k`` solved non-control examples from domains other than ``domain``, answers alternating."""
    others = [d for d in DOMAINS if d != domain]
    demos = []
    for j in range(k):
        spec = DOMAINS[rng.choice(others)]
        case = draw_case(
            rng, spec, case_id="demo", control=False, allow_first=j % 2 == 0, decision=spec.fields,
            control_fields=list(CONTROL_FIELDS), cot=False, **{**common, "system": False},
        )  # fmt: skip
        demos.append(Demo(body=render_body(case, case.old_value, system=False), answer=case.expected_old))
    return demos


def vocabulary(layouts: bool = False) -> list[str]:
    """Every token the generator, the renderer (raw form, record layout) and the errata can emit;
    sorted. Tiny and toy models are built on it. ``layouts``: also the other layouts' words and
    the field names in words (a toy maps these to ``[UNK]``)."""
    texts: list[str] = ["\n", *SCAFFOLD, *OPTIONS, ERRATUM, SHORT_ERRATUM]
    if layouts:
        texts += [*LAYOUT_WORDS, DENY_RULE, *DOMAINS]  # tool_spec names its tool after the domain
    for name, pool in CONTROL_FIELDS.items():
        texts += [name, *pool]
    for spec in DOMAINS.values():
        texts += [*spec.fillers, *spec.context]
        for template in spec.templates:
            texts += [template.system, template.question]
            texts += [template.rule.format(field=f.name, allowed=" or ".join(f.allow)) for f in spec.fields]
        for f in spec.fields:
            texts += [f.name, *f.allow, *f.deny]
        for key, pool in spec.record:
            texts += [key, *pool]
    texts = [re.sub(r"\{\w+\}", " ", text) for text in texts]  # drop format placeholders
    if layouts:  # keys in words, capitalised where a line starts with them
        keys = [w for text in texts for w in words(text) if "_" in w]
        texts += [label(k, "words") for k in keys] + [label(k, "words").capitalize() for k in keys]
        texts += [t.capitalize() for t in texts if t[:1].islower()]  # "The item is ..." and keys leading a line
    return sorted({w for text in texts for w in words(text)})
