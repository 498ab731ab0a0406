"""The toys' training and evaluation prompts (what each part trains in: :mod:`kvprobe.toys`)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvprobe.datasets import (
    CONTROL_FIELDS,
    SHORT_ERRATUM,
    DecisionField,
    DomainSpec,
    EditCase,
    Template,
    erratum_text,
    generate,
    render_prompt,
)
from kvprobe.datasets.generate import draw_case


@dataclass(frozen=True)
class ToyData:
    """What the training stream holds (see the module docstring for what each part trains in)."""

    fillers: tuple[int, int] = (0, 6)
    controls: float = 0.25  # fraction of generator control cases
    p_erratum: float = 0.3  # decision examples with an erratum paragraph
    p_erratum_same: float = 0.25  # of those, errata that restate the field's own value
    p_short_erratum: float = 0.5  # of errata, SHORT_ERRATUM form (else the paper's template)
    p_control_erratum: float = 0.15  # control cases with an erratum on the control field
    p_remove_control: float = 0.2  # drop one control line
    p_add_control: float = 0.2  # add one absent control line


@dataclass(frozen=True)
class Example:
    """One training or evaluation prompt and the option it should answer."""

    text: str
    answer: str
    kind: str


def _answer_for(case: EditCase, value: str) -> str:
    if case.control:
        return case.expected_old
    return case.expected_old if value == case.old_value else case.expected_new


def _drop_line(text: str, key: str, value: str) -> str:
    line = f"\n{key}: {value}"
    assert text.count(line) == 1, (key, value)
    return text.replace(line, "", 1)


def with_control_line(rng: random.Random, case: EditCase) -> EditCase:
    """``case`` with one absent control field added to its record (unchanged when none is absent)."""
    present = {k for k, _ in case.record} | {case.field}
    absent = [name for name in CONTROL_FIELDS if name not in present]
    if not absent:
        return case
    name = rng.choice(absent)
    record = list(case.record)
    record.insert(rng.randint(0, len(record)), (name, rng.choice(CONTROL_FIELDS[name])))
    return case.model_copy(update={"record": record})


def without_control_line(rng: random.Random, case: EditCase) -> EditCase | None:
    """``case`` with one of its record's control lines removed (None when it has none)."""
    present = [i for i, (k, _) in enumerate(case.record) if k in CONTROL_FIELDS]
    if not present:
        return None
    drop = rng.choice(present)
    return case.model_copy(update={"record": [kv for i, kv in enumerate(case.record) if i != drop]})


def training_examples(n: int, seed: int, data: ToyData = ToyData()) -> list[Example]:
    """``n`` training prompts (raw form), deterministic in ``seed``; see the module docstring."""
    rng = random.Random(seed * 7919 + 17)
    out = []
    for case in generate(n, seed=seed, controls=data.controls, fillers=data.fillers):
        drop_field_line = False
        if rng.random() < data.p_remove_control:
            shorter = without_control_line(rng, case)
            if case.control and (shorter is None or rng.random() < 0.34):
                drop_field_line = True  # the edited control line itself goes
            elif shorter is not None:
                case = shorter
        if rng.random() < data.p_add_control:
            case = with_control_line(rng, case)
        value = rng.choice([case.old_value, case.new_value])
        answer, erratum, kind = _answer_for(case, value), None, "control" if case.control else "decision"
        template = SHORT_ERRATUM if rng.random() < data.p_short_erratum else None
        if not case.control and rng.random() < data.p_erratum:
            other = case.new_value if value == case.old_value else case.old_value
            said = value if rng.random() < data.p_erratum_same else other
            erratum, answer, kind = erratum_text(case.field, said, template), _answer_for(case, said), "erratum"
        elif case.control and rng.random() < data.p_control_erratum:
            said = rng.choice([v for v in CONTROL_FIELDS[case.field] if v != value])
            erratum, kind = erratum_text(case.field, said, template), "control_erratum"
        text = render_prompt(case, None, value, "raw", erratum=erratum)
        if drop_field_line:
            text, kind = _drop_line(text, case.field, value), "control_removed"
        out.append(Example(text, answer, kind))
    return out


# Two domains the toys never see: field names and values that are never a decision field or
# value in training (all words of the generator's vocabulary, so none is [UNK]).
UNSEEN_DOMAINS: tuple[DomainSpec, ...] = (
    DomainSpec(
        name="unseen_room",
        templates=(Template("unseen_room.t0", "You are a support assistant for a small office.",
                            "Should the request be approved?", "Approve a request only if {field} is {allowed}."),),
        fields=(DecisionField("room", ("private", "large"), ("small", "separate")),
                DecisionField("zone", ("local", "internal"), ("abroad", "manual"))),
        fillers=("Documents are stored in shared folders.", "Printing is logged by the office.",
                 "Staff wear name badges.", "The office wiki is updated on Mondays.",
                 "Replies should be short and polite.", "Logs are kept for thirty days.",
                 "Metrics are stored for a year.", "Dashboards refresh every minute.",
                 "The gate opens at six.", "Fees are listed in the price sheet."),
        context=("The user needs the file for a meeting.", "The ticket was opened this morning."),
        record=(("device", ("laptop", "tablet", "phone")),),
    ),
    DomainSpec(
        name="unseen_slot",
        templates=(Template("unseen_slot.t0", "You process requests for a software team.",
                            "Is this request allowed to go out?", "A request may go out only when {field} is {allowed}."),),
        fields=(DecisionField("slot", ("morning", "evening"), ("weekend", "nightly")),
                DecisionField("lane", ("fast", "quick"), ("four", "separate"))),
        fillers=("Release notes are written in the changelog.", "Each service has its own dashboard.",
                 "Build caches are cleared every Sunday.", "Docs live next to the code.",
                 "Alerts are grouped by service.", "Quiet hours start at ten.",
                 "Seals are checked on arrival.", "Stock is counted every evening.",
                 "Trucks queue in lane four.", "Scanners are calibrated every week."),
        context=("The request came from the release channel.", "The team wants to ship before the weekend."),
        record=(("team", ("platform", "payments", "storage")),),
    ),
)


def unseen_cases(n: int, seed: int, fillers: tuple[int, int]) -> list[EditCase]:
    """``n`` decision cases over :data:`UNSEEN_DOMAINS`, answers alternating."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        spec = UNSEEN_DOMAINS[i % len(UNSEEN_DOMAINS)]
        cases.append(draw_case(rng, spec, case_id=f"{spec.name}-s{seed}-{i:04d}", control=False,
                           allow_first=(i // len(UNSEEN_DOMAINS)) % 2 == 0, decision=spec.fields,
                           control_fields=list(CONTROL_FIELDS), fillers=fillers,
                           positions=("early", "middle", "late"), system=True, cot=False))
    return cases
