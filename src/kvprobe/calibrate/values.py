"""The values a field of a template takes: a list, or a small typed generator.

A value set is written as a YAML list (``[gold, silver, bronze]``) or a string spec:

    one-of:a,b,c       one of the listed values
    int:LO:HI          an integer in [LO, HI]
    timestamp          a date and time, "2026-11-03 14:22"
    date               a date, "2026-11-03"
    id[:PREFIX]        a request id, PREFIX (default "req") and six digits: "req-804213" (digits, so
                       that every id has the same number of tokens under most tokenizers)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvprobe.errors import KvprobeError

GRAMMAR = "a list of values, one-of:a,b,c, int:LO:HI, timestamp, date, or id[:PREFIX]"


@dataclass(frozen=True)
class ValueSet:
    """What one field may hold; :meth:`sample` draws a value, :meth:`other` a different one."""

    spec: str
    kind: str
    choices: tuple[str, ...] = ()
    lo: int = 0
    hi: int = 0
    prefix: str = "req"

    def sample(self, rng: random.Random) -> str:
        if self.kind == "one-of":
            return rng.choice(self.choices)
        if self.kind == "int":
            return str(rng.randint(self.lo, self.hi))
        if self.kind in ("timestamp", "date"):
            day = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
            return day if self.kind == "date" else f"{day} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        return f"{self.prefix}-{rng.randint(0, 999_999):06d}"

    def other(self, value: str, rng: random.Random) -> str:
        """A value of the set that differs from ``value``."""
        for _ in range(1000):
            v = self.sample(rng)
            if v != value:
                return v
        raise KvprobeError(f"value set {self.spec!r} has no value other than {value!r}; give it at least two")


def parse_values(spec, where: str) -> ValueSet:
    """A value set from its YAML form (a list or a string spec); ``where`` names it in errors."""
    if isinstance(spec, list):
        from kvprobe.datasets.schema import value_problem

        for i, v in enumerate(spec):
            problem = value_problem(v)
            if problem:
                raise KvprobeError(f"{where}[{i}] {problem}")
        choices = tuple(spec)
        if len(set(choices)) < 2:
            raise KvprobeError(f"{where}: a list of values needs at least two different values, got {list(spec)}")
        return ValueSet(f"one-of:{','.join(choices)}", "one-of", choices)
    if not isinstance(spec, str) or not spec.strip():
        raise KvprobeError(f"{where}: {spec!r} is not a value set; accepted: {GRAMMAR}")
    head, _, rest = spec.strip().partition(":")
    if head == "one-of":
        return parse_values([v.strip() for v in rest.split(",") if v.strip()], where)
    if head == "int":
        parts = rest.split(":")
        try:
            lo, hi = (int(p) for p in parts)
        except ValueError:
            raise KvprobeError(f"{where}: {spec!r} is not int:LO:HI with integers LO < HI") from None
        if lo >= hi:
            raise KvprobeError(f"{where}: {spec!r} is not int:LO:HI with integers LO < HI")
        return ValueSet(spec, "int", lo=lo, hi=hi)
    if head in ("timestamp", "date") and not rest:
        return ValueSet(spec, head)
    if head == "id":
        prefix = rest or "req"
        if not prefix.replace("-", "").replace("_", "").isalnum():
            raise KvprobeError(f"{where}: id prefix {prefix!r} must be letters, digits, - or _")
        return ValueSet(spec, "id", prefix=prefix)
    raise KvprobeError(f"{where}: unknown value set {spec!r}; accepted: {GRAMMAR}")
