"""File schemas: the value types of the files kvprobe reads back, and their one-line refusals.

A file kvprobe reads (a ``topk.yaml``, a family YAML, a manifest) is checked against a pydantic
model (``extra="forbid"``) built from the types here before any of it is used. A file that does
not fit is a :class:`~kvprobe.errors.KvprobeError` (exit 3) naming the file, the field and what is
accepted, e.g. ``topk.yaml is not a valid topk.yaml: threshold is -1; accepted: a number in [0.5,
1)``. The types refuse what YAML or JSON would let through: NaN and infinities, ``true`` for a
count, ``"ten"`` or ``5.0`` for a count, a string where a mapping belongs.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationError

from kvprobe.defaults import THRESHOLD_RANGE, is_threshold
from kvprobe.errors import KvprobeError, validator_message

__all__ = ["CI", "Count", "File", "Finite", "Number", "Seconds", "Share", "ShareOrNaN", "Text", "Threshold",
           "check_version", "describe", "validate"]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _share(v: Any) -> float:
    if not _is_number(v) or not 0 <= v <= 1:  # NaN fails both comparisons
        raise ValueError("a number from 0 to 1")
    return float(v)


def _threshold(v: Any) -> float:
    if not is_threshold(v):
        raise ValueError(THRESHOLD_RANGE)
    return float(v)


def _count(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError("a whole number, 0 or more")
    return v


def _seconds(v: Any) -> float:
    if not _is_number(v) or not 0 <= v < math.inf:
        raise ValueError("a finite number of seconds, 0 or more")
    return float(v)


def _finite(v: Any) -> float:
    if not _is_number(v) or not math.isfinite(v):
        raise ValueError("a finite number")
    return float(v)


def _text(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError("a non-empty string")
    return v


def _number(v: Any) -> float:
    if not _is_number(v):
        raise ValueError("a number (.nan where not measured)")
    return float(v)


def _share_or_nan(v: Any) -> float:
    if not _is_number(v) or not (0 <= v <= 1 or math.isnan(v)):
        raise ValueError("a number from 0 to 1 (.nan where not measured)")
    return float(v)


def _ci(v: Any) -> tuple[float, float]:
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(x) and 0 <= x <= 1 for x in v)
            and v[0] <= v[1]):
        raise ValueError("a list of two numbers from 0 to 1, the lower first")
    return float(v[0]), float(v[1])


Share = Annotated[float, PlainValidator(_share)]  # a proportion: finite, in [0, 1]
Threshold = Annotated[float, PlainValidator(_threshold)]  # a repair threshold: in [0.5, 1) (kvprobe.defaults)
Count = Annotated[int, PlainValidator(_count)]  # a whole number >= 0 (not a bool, not 5.0)
Seconds = Annotated[float, PlainValidator(_seconds)]  # finite, >= 0
Finite = Annotated[float, PlainValidator(_finite)]  # any finite number
Number = Annotated[float, PlainValidator(_number)]  # any number, NaN included (not measured)
ShareOrNaN = Annotated[float, PlainValidator(_share_or_nan)]  # in [0, 1], or NaN (not measured)
Text = Annotated[str, PlainValidator(_text)]  # a non-empty string
CI = Annotated[tuple[float, float], PlainValidator(_ci)]  # [lo, hi] in [0, 1], lo <= hi


class File(BaseModel):
    """Base of a file's schema: unknown keys are refused, the loaded value is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_KINDS = {"model_type": "a mapping (key: value)", "dict_type": "a mapping (key: value)",
          "model_attributes_type": "a mapping (key: value)", "list_type": "a list", "tuple_type": "a list",
          "string_type": "a string", "bool_type": "true or false"}


def _where(loc: tuple) -> str:
    """``('strategies', 2, 'agreement')`` -> ``strategies entry 3, agreement``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f" entry {part + 1}"
        else:
            out += (", " if out and out[-1].isdigit() else "." if out else "") + str(part)
    return out


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(exc: ValidationError) -> str:
    """The first problem of ``exc`` in words: where, what it holds, what is accepted. Missing keys of
    the same mapping are named together."""
    errors = exc.errors()
    first = errors[0]
    loc = tuple(first["loc"])
    if not loc:  # a check across keys: its message says it all
        return validator_message(first)
    if first["type"] == "missing":
        missing = [e["loc"][-1] for e in errors if e["type"] == "missing" and tuple(e["loc"][:-1]) == loc[:-1]]
        where = _where(loc[:-1])
        return f"{where + ' ' if where else ''}has no {', '.join(map(str, missing))}"
    if first["type"] == "extra_forbidden":
        where = _where(loc[:-1])
        return f"{where + ' ' if where else ''}has an unknown key {loc[-1]!r}"
    if first["type"] == "literal_error":
        accepted = f"one of {first['ctx']['expected']}"
    elif first["type"] in _KINDS:
        accepted = _KINDS[first["type"]]
    else:
        accepted = validator_message(first)
    return f"{_where(loc) or 'the file'} is {_shown(first['input'])}; accepted: {accepted}"


def validate(schema: type[BaseModel], data: Any, path, what: str, hint: str) -> Any:
    """``schema.model_validate(data)``, or a one-line :class:`KvprobeError`:
    ``<path> is not a valid <what>: <describe>; <hint>``."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise KvprobeError(f"{path} is not a valid {what}: {describe(exc)}; {hint}") from None


def check_version(path, version: Any, key: str, reads: tuple[int, ...], hint: str) -> int:
    """``version`` (the value of ``key`` in the file at ``path``) if this kvprobe reads it; else a one-line
    :class:`KvprobeError`: a version above ``reads`` was written by a newer kvprobe, one below by an
    older one (``hint`` says how to rewrite it), and anything else is not a version."""
    if isinstance(version, int) and not isinstance(version, bool) and version in reads:
        return version
    names = list(map(str, reads))
    accepted = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    if isinstance(version, int) and not isinstance(version, bool) and version > max(reads):
        raise KvprobeError(f"{path} was written by a newer kvprobe ({key} {version}; this kvprobe reads {accepted}); "
                           f"upgrade kvprobe to read it")
    if isinstance(version, int) and not isinstance(version, bool) and version >= 1:
        raise KvprobeError(f"{path} has {key} {version}, this kvprobe reads {accepted}; {hint}")
    raise KvprobeError(f"{path} has {key} {_shown(version)}, not a version this kvprobe reads ({accepted}); {hint}")
