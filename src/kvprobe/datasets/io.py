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
from kvprobe.datasets.render import check_text
from kvprobe.datasets.schema import EditCase
from kvprobe.errors import KvprobeError, validator_message
from kvprobe.results import atomic_write, check_case_ids


def save_jsonl(cases: Iterable[EditCase], path: str | Path) -> Path:
    """Write ``cases`` to ``path`` atomically (a temporary file, then a rename); return the path."""
    text = "".join(json.dumps(case.model_dump(mode="json"), ensure_ascii=False) + "\n" for case in cases)
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    msg = validator_message(first)
    msg = msg[:1].lower() + msg[1:]
    loc = ".".join(str(part) for part in first["loc"])
    return f"field '{loc}': {msg}" if loc else msg


def load_jsonl(path: str | Path) -> list[EditCase]:
    """Read and validate every case in ``path``; blank lines are ignored, duplicate ids refused."""
    path = Path(path)
    if path.is_dir():
        raise KvprobeError(f"{path} is a folder; give a JSONL file of cases (one JSON object per line)")
    if not path.is_file():
        raise KvprobeError(f"{path}: no such case file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise KvprobeError(f"{path}: cannot read the case file ({exc.strerror or exc})") from None
    try:
        lines = raw.decode("utf-8").split("\n")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise KvprobeError(f"{path} line {line}: not UTF-8 text (byte {raw[exc.start]:#04x}); a case file is "
                           f"UTF-8 JSONL") from None
    cases: list[EditCase] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
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
        try:
            check_text(case)
        except KvprobeError as err:
            raise KvprobeError(f"{path} line {number}: {err}") from None
        seen[case.case_id] = number
        cases.append(case)
    if not cases:
        raise KvprobeError(f"{path}: no cases (the file is empty)")
    try:
        check_case_ids(c.case_id for c in cases)
    except KvprobeError as err:
        raise KvprobeError(f"{path}: {err}") from None
    return cases


def require_answers(cases: Iterable[EditCase], what: str) -> None:
    """Refuse, before any model work, cases without expected answers where ``what`` (a command or
    stage, e.g. ``"kvprobe edit"``) measures validity: it compares the model's answers with them."""
    for case in cases:
        if case.expected_old is None or case.expected_new is None:
            raise KvprobeError(f"case {case.case_id} has no expected answers (expected_old, expected_new); {what} "
                               f"measures validity and needs them")


def resolve_dataset(spec: str | None, n: int | None = None, seed: int = 0, **generate_kwargs) -> list:
    """Cases from a dataset spec: ``None``/``"default"`` generates ``n`` cases (default 40) with
    ``seed``; anything else is a JSONL path (its first ``n`` cases when ``n`` is given)."""

    if spec in (None, "default"):
        return generate(n or 40, seed=seed, **generate_kwargs)
    cases = load_jsonl(spec)
    return cases[:n] if n else cases
