"""One schema and one unit across every output (issue 31): docs/outputs.md is current, every
numeric column has a unit, and the files `run`, `validate`, `sweep` and `calibrate` write fit it:
each parquet column declared and of its type (whole numbers as nullable integers), the schema
version in the parquet metadata, and in every JSON and YAML file durations in seconds and each
statistic as one {value, lo, hi, n} mapping."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvprobe.results import read_table, table_metadata
from kvprobe.tables import INT, NUMBER, TABLE_SCHEMAS, TABLES_SCHEMA, unit_of
from tests import cli_process

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("outputs_table", ROOT / "scripts" / "outputs_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_outputs_page_is_current_and_every_number_has_a_unit():
    assert (ROOT / "docs" / "outputs.md").read_text() == _script().render(), \
        "docs/outputs.md is stale: python scripts/outputs_table.py"
    for name, schema in TABLE_SCHEMAS.items():
        for col, kind in schema.kinds.items():
            if kind in (NUMBER, INT):
                assert unit_of(col), f"{name}: column {col} has no unit (kvprobe.tables.UNITS)"
            assert not col.endswith(("_ms", "_min")), f"{name}: {col} is a duration in another unit than seconds"


def check_json(data, where: str) -> int:
    """Every duration in seconds, every statistic one shape; returns how many keys it checked."""
    seen = 0
    if isinstance(data, dict):
        keys = set(data)
        assert not {k for k in keys if str(k).endswith("_ms") or k in ("ms", "minutes")}, (where, keys)
        if {"lo", "hi"} <= keys:
            assert {"value", "n"} <= keys, f"{where}: a statistic without value and n: {sorted(keys)}"
        for k, v in data.items():
            if str(k).endswith("_s") and not isinstance(v, dict):
                assert v is None or (isinstance(v, (int, float)) and v >= 0), (where, k, v)
            seen += 1 + check_json(v, f"{where}.{k}")
    elif isinstance(data, list):
        seen += sum(check_json(v, f"{where}[{i}]") for i, v in enumerate(data))
    return seen


def check_folder(folder: Path) -> tuple[int, int]:
    """Every table and JSON/YAML file of a results folder against the schema; (tables, keys)."""
    tables = keys = 0
    for path in sorted(folder.glob("*.parquet")):
        schema = TABLE_SCHEMAS.get(path.name)
        assert schema is not None, f"{path.name} is not in kvprobe.tables.TABLE_SCHEMAS"
        df = read_table(path)  # each column of its kind (the reader's own check)
        assert set(df.columns) <= set(schema.kinds), f"{path.name}: undeclared {set(df.columns) - set(schema.kinds)}"
        for col in df.columns:
            if schema.kinds[col] == INT:
                assert str(df[col].dtype) in ("Int64", "int64"), (path.name, col, df[col].dtype)
        assert table_metadata(path) == {"table": path.name, "schema": TABLES_SCHEMA,
                                        "version": table_metadata(path)["version"]}, path.name
        tables += 1
    for path in sorted([*folder.glob("*.json"), *folder.glob("*.yaml")]):
        text = path.read_text()
        keys += check_json(json.loads(text) if path.suffix == ".json" else yaml.safe_load(text), path.name)
    return tables, keys


@pytest.mark.parametrize("command", [
    ("run", "--model", "tiny-llama", "--n", "4", "--all-cases", "--compose", "2", "--no-report"),
    ("validate", "--model", "tiny-llama", "--n", "2", "--seams", "0,1", "--seam", "1", "--block-tokens", "20,30",
     "--blocks", "1,2", "--threshold", "0"),
    ("sweep", "--model", "toy-qwen2", "--n", "1", "--valid", "1", "--filler-tokens", "0"),
    ("calibrate", "examples/calibrate-toy.yaml", "--model", "toy-qwen2", "--max-pairs", "2"),
    ("memory", "--model", "toy-qwen2", "--n", "4", "--session-tokens", "40,60", "--seams", "0", "--policy-users", "1"),
], ids=lambda c: c[0])
def test_each_commands_files_fit_the_schema(command, tmp_path):
    out = tmp_path / "out"
    proc = cli_process.run(*command, "--out", str(out), cwd=ROOT, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]  # calibrate: no verdict within 2 pairs is exit 1
    tables, keys = check_folder(out)
    print(f"{command[0]}: {tables} tables, {keys} JSON/YAML keys checked")
    assert tables >= {"run": 8, "validate": 1, "sweep": 2, "calibrate": 2, "memory": 2}[command[0]] and keys > 10


def test_the_check_fails_on_a_file_in_another_unit(tmp_path):
    bad = {"repair": {"agreement": {"value": 1.0, "lo": 0.9, "hi": 1.0}, "repair_ms": 3.0}}
    with pytest.raises(AssertionError):
        check_json(bad, "summary.json")
    with pytest.raises(AssertionError, match="without value and n"):
        check_json({"agreement": {"lo": 0.1, "hi": 0.9, "value": 0.5}}, "x")
    df = pd.DataFrame({"case_id": ["a"], "layer": [1.5]})
    from kvprobe.results import atomic_write_parquet, KvprobeError

    atomic_write_parquet(df, tmp_path / "attention.parquet")
    with pytest.raises(KvprobeError, match="column layer holds 1.5, where whole numbers belong"):
        read_table(tmp_path / "attention.parquet")


def test_a_table_of_schema_1_is_read_under_todays_names(tmp_path):
    """Tables schema 2 renamed the reference's decision (`pred_oracle`, `oracle_answer` -> `reference`) and
    the signed option difference (`margin` -> `option_diff` where it was not a decision's lead); a table
    written before (metadata schema 1, or none) reads under today's names, a part by its table's, and a
    calibration table keeps its `margin` (a lead, the same quantity)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvprobe.results import atomic_write_parquet
    from kvprobe.tables import CALIBRATION, COMPOSE, EDITS, table_of

    def v1(df, path):  # as kvprobe wrote it under schema 1
        path.parent.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pandas(df, preserve_index=False)
        meta = {**table.schema.metadata, b"kvprobe": json.dumps({"table": path.name, "schema": 1}).encode()}
        pq.write_table(table.replace_schema_metadata(meta), path)
        return path

    edits = pd.DataFrame({"strategy": ["stale"], "pred": ["yes"], "pred_oracle": ["no"]})
    assert list(read_table(v1(edits, tmp_path / "old" / EDITS)).columns) == ["strategy", "pred", "reference"]
    bare = tmp_path / "bare" / EDITS  # written before tables carried metadata
    bare.parent.mkdir()
    edits.to_parquet(bare, index=False)
    assert "reference" in read_table(bare).columns
    compose = pd.DataFrame({"answer": ["yes"], "oracle_answer": ["yes"], "margin": [-1.5], "oracle_margin": [2.0]})
    part = v1(compose, tmp_path / "old" / "parts" / "compose" / "q1.parquet")
    assert table_of(part) == COMPOSE
    assert list(read_table(part).columns) == ["answer", "reference", "option_diff", "reference_option_diff"]
    pairs = v1(pd.DataFrame({"pred_oracle": ["no"], "margin": [0.5]}), tmp_path / "old" / "parts" / "pairs" / "tier"
               / "p1.parquet")
    assert table_of(pairs) == CALIBRATION and list(read_table(pairs).columns) == ["reference", "margin"]
    today = atomic_write_parquet(pd.DataFrame({"reference": ["no"], "margin": [0.5]}), tmp_path / "new" / CALIBRATION)
    assert list(read_table(today).columns) == ["reference", "margin"]
