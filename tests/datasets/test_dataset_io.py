from __future__ import annotations

import json

import pytest

from kvprobe.datasets import generate, load_jsonl, save_jsonl
from kvprobe.errors import KvprobeError


def test_round_trip(tmp_path):
    cases = generate(12, seed=1, few_shot=1, controls=0.5)
    path = save_jsonl(cases, tmp_path / "sub" / "cases.jsonl")
    assert path == tmp_path / "sub" / "cases.jsonl" and [p.name for p in path.parent.iterdir()] == ["cases.jsonl"]
    assert load_jsonl(path) == cases
    first = json.loads(path.read_text().splitlines()[0])
    assert first == cases[0].model_dump(mode="json")


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "cases.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _good(case_data, **change) -> str:
    return json.dumps({**case_data, **change})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: [_good(d), _good(d, case_id="c2", options=["yes"])],
         r"cases.jsonl line 2: give two answer options, or none; got one: \['yes'\]"),
        (lambda d: [_good(d), "", _good(d, case_id="c3"), "{oops"], r"cases.jsonl line 4: not valid JSON: "),
        (lambda d: ["[1, 2]"], r"line 1: expected a JSON object, got list"),
        (lambda d: [_good(d, new_value="delivered")], r"line 1: old_value and new_value must differ"),
        (lambda d: [_good(d, colour="red")], r"line 1: field 'colour': extra inputs are not permitted"),
        (lambda d: [_good(d, record=[["a"]])], r"line 1: field 'record.0.1': field required"),
        (lambda d: [_good(d), _good(d)], r"line 2: duplicate case_id 'c1' \(first on line 1\)"),
    ],
)  # fmt: skip
def test_bad_lines_give_one_line_errors(tmp_path, case_data, make, message):
    with pytest.raises(KvprobeError, match=message) as info:
        load_jsonl(_write(tmp_path, make(case_data)))
    assert "\n" not in str(info.value)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(KvprobeError, match="empty.jsonl: no cases"):
        load_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(KvprobeError, match="missing.jsonl: no such case file"):
        load_jsonl(tmp_path / "missing.jsonl")
