"""Write docs/outputs.md: every column of every results table kvprobe writes, with its type and unit,
from the one place they are declared (kvprobe.tables.TABLE_SCHEMAS, UNITS, unit_of), and the
conventions of its JSON and YAML files. tests/unit/test_outputs.py checks the file is current and
that each command's outputs fit it.

    .venv/bin/python scripts/outputs_table.py [--out docs/outputs.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

TYPES = {"text": "string", "number": "float64", "int": "Int64 (nullable integer)", "flag": "bool"}

HEAD = """# Outputs: every column, its type and its unit

Written by `python scripts/outputs_table.py` from `kvprobe.tables.TABLE_SCHEMAS` and `unit_of`, the
one place they are declared; `tests/unit/test_outputs.py` checks this page is current and reads the
files of `run`, `validate`, `sweep` and `calibrate` against it (every column declared, of its type,
whole numbers stored as nullable integers, the schema version in the parquet metadata, no duration
in another unit than seconds).

## Conventions

- **Durations are seconds**, in every file: a column or key ending in `_s` (`wall_s`, `decide_s`,
  `to_decision_s`, `repair_s`, `ttft_s`, a calibrated field's `seconds`). Terminal tables may show
  milliseconds and say so in their column name (`repair ms`).
- **A statistic is one shape** in JSON and YAML: `{value, lo, hi, n}` (Wilson 95% or the confidence
  sequence's bounds; `k` beside it where a count is natural), as `agreement` in summary.json and
  field_policy.yaml. A parquet table flattens it into columns `x`, `x_lo`, `x_hi`, `n_x`.
- **Shares** are in [0, 1]; **logits** are raw logit differences (`m`: score(new answer) minus
  score(old answer) at the decision token); **tokens** count tokenizer tokens.
- **One vocabulary for a decision** (tables schema 2): `reference` is the decision of what a row is
  judged against (the oracle's re-prefill; a full recompute for a composed cache or a transplant);
  `margin` is a decision's lead (its option's score minus the runner-up's, never negative);
  `option_diff` is the first option's score minus the second's (signed); a TOST's margin is
  `equivalence_margin`. Schema 1 named them `pred_oracle` / `oracle_answer`, `margin` for the signed
  difference too, `oracle_margin`, and the TOST's `margin`: a table written before is read under
  today's names (`kvprobe.tables.RENAMED`).
- **Whole numbers** (layers, heads, positions, counts) are nullable integers (`Int64`): a missing
  one is `<NA>`, never a float NaN. A column of missing values only keeps its declared type.
- **Row kinds**: `edits.parquet` has `kind` (`decision`, `control`, `k_sweep`): group within one.
- Every results table's parquet metadata holds `kvprobe`: `{"table", "schema", "version"}`
  (`kvprobe.results.table_metadata(path)`); `schema` is `TABLES_SCHEMA` ({schema}).
- `--json [PATH|-]` is one option on every command that has it (docs/cli.md).
- JSON and YAML files carry their own version key: `kvprobe_summary` (summary.json, docs/summary.md),
  `kvprobe_field_policy` (field_policy.yaml, docs/calibrate.md), `schema_version` (topk.yaml),
  `kvprobe_run` / `kvprobe_validate` / ... (manifests).

## Parquet tables
"""


def render() -> str:
    from kvprobe.tables import TABLE_SCHEMAS, TABLES_SCHEMA, unit_of

    out = [HEAD.replace("{schema}", str(TABLES_SCHEMA))]
    for name, schema in TABLE_SCHEMAS.items():
        out.append(f"\n### `{name}`: {schema.what}\n\n| column | type | unit |\n|---|---|---|\n")
        for col, kind in schema.kinds.items():
            unit = unit_of(col) if kind in ("number", "int") else ""
            out.append(f"| `{col}` | {TYPES[kind]} | {unit} |\n")
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "outputs.md"))
    args = ap.parse_args()
    Path(args.out).write_text(render())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
