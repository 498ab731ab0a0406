"""The serving benchmark's prompts: one long static policy with one decision field, four arms.

The policy is an :class:`~kvprobe.datasets.EditCase` in the generator's structured form, rendered
by :func:`~kvprobe.datasets.render_prompt` like every other kvprobe prompt, with the field early
(``field_position="early"``: first record line, right after the rule) and the long part of the
policy, numbered clauses drawn from the domains' filler rules, after it::

    {system}
    ## Policy / {rule}
    ## Record / {field}: {value} / ...        <- the in-prefix edit changes this line
    ## Context / ...
    ## Notes / - Clause 1: ... - Clause N: ... (the bulk: --policy-tokens)
    [{erratum line}]                           <- the erratum arm only
    ## Request / {question} Answer yes or no.

Arms (:data:`ARMS`)::

    unchanged     the base value, the same prompt every request (the baseline)
    edit_unique   the field line rewritten in place with a value never seen before (a decision value
                  with a fresh timestamp: the "timestamp in the system prompt" case)
    edit_set      the field line rewritten in place with a value from a small set (the four
                  decision values of the field)
    erratum       the prefix as in `unchanged`, and the erratum line announcing the same unique
                  values as `edit_unique`, placed after the prefix and before the question

The oracle for a value is the model's greedy answer on the prompt with that value written in place,
which is the ``edit_*`` prompt for that value.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from kvprobe.datasets import EditCase, erratum_text, render_prompt
from kvprobe.datasets.domains import CONTROL_FIELDS, DOMAINS, OPTIONS
from kvprobe.datasets.spans import prompt_ids
from kvprobe.errors import KvprobeError, UsageError

ARMS = ("unchanged", "edit_unique", "edit_set", "erratum")
EDIT_ARMS = ("edit_unique", "edit_set")
MIN_POLICY_TOKENS, MAX_POLICY_TOKENS = 1000, 8000
DEFAULT_POLICY_TOKENS = 1500
UNIQUE_EPOCH = datetime(2025, 3, 1, 9, 0, 0)


@dataclass(frozen=True)
class Policy:
    """The benchmark's static policy: an EditCase whose ``old_value`` is the base value."""

    case: EditCase
    allow: tuple[str, ...]
    deny: tuple[str, ...]
    form: str
    template: str  # erratum template, with {field} and {value}

    @property
    def field(self) -> str:
        return self.case.field

    @property
    def base_value(self) -> str:
        return self.case.old_value

    @property
    def value_set(self) -> tuple[str, ...]:
        """The small set the ``edit_set`` arm draws from: every decision value of the field."""
        return self.allow + self.deny

    def text(self, tokenizer, value: str | None = None, erratum_value: str | None = None) -> str:
        """The prompt with ``value`` in the field line (default: the base value) and, when
        ``erratum_value`` is given, the erratum line announcing it."""
        erratum = erratum_text(self.field, erratum_value, self.template) if erratum_value is not None else None
        return render_prompt(self.case, tokenizer, value or self.base_value, self.form, erratum=erratum)

    def ids(self, tokenizer, value: str | None = None, erratum_value: str | None = None) -> list[int]:
        return prompt_ids(tokenizer, self.text(tokenizer, value, erratum_value), self.form)

    def arm_prompt(self, tokenizer, arm: str, value: str) -> list[int]:
        """Token ids the ``arm`` sends when the field's current value is ``value``."""
        if arm == "unchanged":
            return self.ids(tokenizer)
        if arm in EDIT_ARMS:
            return self.ids(tokenizer, value)
        if arm == "erratum":
            return self.ids(tokenizer, erratum_value=value)
        raise UsageError(f"unknown arm {arm!r}; accepted: {', '.join(ARMS)}")

    def expected(self, value: str) -> str:
        """The rule's answer for ``value`` (what a model that follows the rule says)."""
        return OPTIONS[0] if value.split(" ")[0] in self.allow else OPTIONS[1]


def check_template(template: str) -> str:
    """A literal erratum template must name {field} and {value} and format cleanly."""
    try:
        text = template.format(field="f", value="v")
    except (KeyError, IndexError, ValueError) as exc:
        raise KvprobeError(f"bad erratum template {template!r}: {exc}; use {{field}} and {{value}} only") from None
    if "{field}" not in template or "{value}" not in template or "\n" in text:
        raise KvprobeError(f"bad erratum template {template!r}: it must be one line naming {{field}} and {{value}}")
    return template


def build_policy(tokenizer, policy_tokens: int = DEFAULT_POLICY_TOKENS, seed: int = 0, domain: str | None = None,
                 form: str = "auto", template: str | None = None) -> Policy:
    """The static policy, grown with clauses until the base prompt has about ``policy_tokens`` tokens."""
    from kvprobe.datasets.generate import SHORT_ERRATUM
    from kvprobe.datasets.render import resolve_form

    if not MIN_POLICY_TOKENS <= policy_tokens <= MAX_POLICY_TOKENS:
        raise UsageError(f"policy tokens must be in [{MIN_POLICY_TOKENS}, {MAX_POLICY_TOKENS}], got {policy_tokens}")
    if domain is not None and domain not in DOMAINS:
        raise UsageError(f"unknown domain {domain!r}; use one of {', '.join(DOMAINS)}")
    rng = random.Random(seed)
    spec = DOMAINS[domain or rng.choice(sorted(DOMAINS))]
    t = rng.choice(spec.templates)
    gate = rng.choice(spec.fields)
    base, other = rng.choice(gate.allow), rng.choice(gate.deny)
    pool = list(spec.fillers) + [f for name in sorted(DOMAINS) if name != spec.name for f in DOMAINS[name].fillers]
    key, values = rng.choice(spec.record)
    record = [(key, rng.choice(values)), ("timestamp", rng.choice(CONTROL_FIELDS["timestamp"]))]

    def case(n_clauses: int) -> EditCase:
        clauses = [f"Clause {i + 1}: {pool[i % len(pool)]}" for i in range(n_clauses)]
        return EditCase(case_id=f"serving-{spec.name}-s{seed}", domain=spec.name, field=gate.name,
                        old_value=base, new_value=other, control=False, system=t.system,
                        rule=t.rule.format(field=gate.name, allowed=" or ".join(gate.allow)), fillers=clauses,
                        field_position="early", context=list(spec.context[:2]), record=record, question=t.question,
                        options=list(OPTIONS), expected_old=OPTIONS[0], expected_new=OPTIONS[1],
                        template_id=t.id)

    form = resolve_form(tokenizer, form)
    template = check_template(template or SHORT_ERRATUM)
    at = lambda n: Policy(case(n), gate.allow, gate.deny, form, template)  # noqa: E731
    per_clause = len(tokenizer(f"- Clause 10: {pool[0]}\n", add_special_tokens=False)["input_ids"])
    return at(fit_clauses(lambda n: len(at(n).ids(tokenizer)), policy_tokens, per_clause))


def fit_clauses(length: Callable[[int], int], target: int, per_clause: int, tries: int = 6) -> int:
    """How many policy clauses bring a prompt to about ``target`` tokens: a first guess from the
    prompt without clauses (``length(0)``) and a clause's length, then up to ``tries`` corrections
    (clause lengths vary) until ``length(n)`` is within one clause of ``target``; the last ``n``
    measured when none is."""
    n = max(1, (target - length(0)) // max(1, per_clause))
    for _ in range(tries):
        got = length(n)
        if abs(got - target) <= per_clause:
            return n
        measured, n = n, max(1, n + round((target - got) / per_clause))
    return measured


def unique_values(policy: Policy, n: int, start: int = 0, seed: int = 0, salt: str = "") -> list[str]:
    """``n`` field values never repeated: a decision value (alternating allow and deny, seeded)
    with a fresh timestamp, e.g. ``delivered (updated 2026-07-14T03:12:55, run 3f9a1c2e)``.

    ``start`` offsets the timestamps so that values of later runs differ from earlier ones; ``salt``
    (hex, one per benchmark folder) keeps them apart from every earlier benchmark's, whose prompts a
    warm server may still hold in its cache.
    """
    rng = random.Random(f"{seed}:{start}")
    tail = f", run {salt}" if salt else ""
    # the salt moves the timestamps too, so that values differ from an earlier benchmark's early on
    offset = int(salt, 16) % (5 * 365 * 86400) if salt else 0
    out = []
    for i in range(n):
        side = policy.allow if (start + i) % 2 == 0 else policy.deny
        stamp = (UNIQUE_EPOCH + timedelta(seconds=offset + 7 * (start + i) + 1)).strftime("%Y-%m-%dT%H:%M:%S")
        out.append(f"{rng.choice(side)} (updated {stamp}{tail})")
    return out


def set_values(policy: Policy, n: int, seed: int = 0) -> list[str]:
    """``n`` values drawn (seeded) from the small set of the field's decision values."""
    rng = random.Random(seed)
    return [rng.choice(policy.value_set) for _ in range(n)]


def arm_values(policy: Policy, arm: str, n: int, start: int, seed: int, salt: str = "") -> list[str]:
    """The current field value of each of an arm's ``n`` requests (see :func:`unique_values`)."""
    if arm == "unchanged":
        return [policy.base_value] * n
    if arm in ("edit_unique", "erratum"):
        return unique_values(policy, n, start, seed, salt)
    if arm == "edit_set":
        return set_values(policy, n, seed + start)
    raise UsageError(f"unknown arm {arm!r}; accepted: {', '.join(ARMS)}")
