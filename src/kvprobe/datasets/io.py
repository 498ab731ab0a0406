"""JSONL case files: one ``EditCase.model_dump(mode="json")`` per line.

Loading is all or nothing: the first bad line raises one ``KvprobeError`` naming the file, the
line number and the problem.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from kvprobe.datasets.generate import generate
from kvprobe.datasets.schema import EditCase
from kvprobe.errors import KvprobeError
from kvprobe.results import atomic_write


def save_jsonl(cases: Iterable[EditCase], path: str | Path) -> Path:
    """Write ``cases`` to ``path`` atomically (a temporary file, then a rename); return the path."""
    text = "".join(json.dumps(case.model_dump(mode="json"), ensure_ascii=False) + "\n" for case in cases)
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    msg = first["msg"].removeprefix("Value error, ")
    msg = msg[:1].lower() + msg[1:]
    loc = ".".join(str(part) for part in first["loc"])
    return f"field '{loc}': {msg}" if loc else msg


def load_jsonl(path: str | Path) -> list[EditCase]:
    """Read and validate every case in ``path``; blank lines are ignored, duplicate ids refused."""
    path = Path(path)
    if not path.is_file():
        raise KvprobeError(f"{path}: no such case file")
    cases: list[EditCase] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as err:
                raise KvprobeError(f"{path} line {number}: not valid JSON: {err.msg} (column {err.colno})") from None
            if not isinstance(data, dict):
                raise KvprobeError(f"{path} line {number}: expected a JSON object, got {type(data).__name__}")
            try:
                case = EditCase.model_validate(data)
            except ValidationError as err:
                raise KvprobeError(f"{path} line {number}: {_first_error(err)}") from None
            if case.case_id in seen:
                raise KvprobeError(
                    f"{path} line {number}: duplicate case_id {case.case_id!r} (first on line {seen[case.case_id]})"
                )
            seen[case.case_id] = number
            cases.append(case)
    if not cases:
        raise KvprobeError(f"{path}: no cases (the file is empty)")
    return cases


def resolve_dataset(spec: str | None, n: int | None = None, seed: int = 0, **generate_kwargs) -> list:
    """Cases from a dataset spec: ``None``/``"default"`` generates ``n`` cases (default 40) with
    ``seed``; anything else is a JSONL path (its first ``n`` cases when ``n`` is given)."""

    if spec in (None, "default"):
        return generate(n or 40, seed=seed, **generate_kwargs)
    cases = load_jsonl(spec)
    return cases[:n] if n else cases
