"""The results tables: their file names, every column with its kind and unit, and the typed form a
table is written in. Light (pandas and numpy only): the writer and reader are
:func:`kvprobe.results.atomic_write_parquet` and :func:`kvprobe.results.read_table`; docs/outputs.md
is written from here (scripts/outputs_table.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvprobe.errors import KvprobeError

VALIDITY = "validity.parquet"
EDITS = "edits.parquet"
LOCALITY = "locality.parquet"
CONCENTRATION = "concentration.parquet"
ATTENTION = "attention.parquet"
LINEAR = "linear.parquet"
KNOCKOUT = "knockout.parquet"
COMPOSE = "compose.parquet"
TOKENS = "tokens.parquet"
TTFT = "ttft.parquet"
SERVING = "serving.parquet"  # kvprobe serve-bench: one row per request (kvprobe.serving.bench.COLUMNS)
SWEEP = "sweep.parquet"  # kvprobe sweep: one row per cell x case x measure
SWEEP_SUMMARY = "sweep_summary.parquet"  # one row per cell x measure, with 95% CIs
CALIBRATION = "calibration.parquet"  # kvprobe calibrate: one row per (field, pair, strategy)
CALIBRATION_SUMMARY = "calibration_summary.parquet"  # one row per (field, strategy)
WEIGHT_EDITS = "weight_edits.parquet"  # kvprobe weight-edit: one row per case x arm (KV repairs and a LoRA edit)
MEMORY = "memory.parquet"  # kvprobe memory: one row per question x arm (kvprobe.memory.COLUMNS)
MEMORY_CALIBRATION = "memory_calibration.parquet"  # kvprobe memory --policy-users: per element x question x strategy
TABLES_SCHEMA = 2  # the version of TABLE_SCHEMAS' columns, in every results table's parquet metadata
AGENT = "agent.parquet"  # kvprobe serve-bench --workload agent: one row per turn x arm (kvprobe.serving.agent)

# One vocabulary across the tables (version 2): ``reference`` is the decision of what a row is judged
# against (the oracle's re-prefill; a full recompute for a composed cache), ``margin`` is a decision's lead
# (its option's score minus the runner-up's, >= 0), ``option_diff`` the first option's score minus the
# second's (signed), and ``equivalence_margin`` a TOST's margin. Version 1 named them otherwise; a table
# written before (its metadata's schema below 2, or none) is read under today's names.
RENAMED_SINCE = 2  # the tables schema that first wrote RENAMED's new names
RENAMED: dict[str, dict[str, str]] = {
    EDITS: {"pred_oracle": "reference"}, CALIBRATION: {"pred_oracle": "reference"},
    WEIGHT_EDITS: {"pred_oracle": "reference"}, SERVING: {"oracle_answer": "reference"},
    COMPOSE: {"oracle_answer": "reference", "margin": "option_diff", "oracle_margin": "reference_option_diff"},
    MEMORY: {"margin": "option_diff"}, MEMORY_CALIBRATION: {"margin": "option_diff"}, AGENT: {"margin": "option_diff"}}


# -- the columns a results table must hold: what its readers (report, compare, export-topk) use ----
NUMBER, INT, FLAG, TEXT = "number", "int", "flag", "text"  # the kinds of column a table holds
_KIND = {NUMBER: "numbers", INT: "whole numbers", FLAG: "true/false flags", TEXT: "strings"}
_TYPED = {INT: "Int64", NUMBER: "Float64", FLAG: "boolean", TEXT: "string"}  # a column of missing values only


def _fits(values: pd.Series, kind: str):
    """None when every non-missing value of the column fits ``kind``, else the first that does not."""
    values = values.dropna()
    if not len(values):
        return None
    if kind == TEXT:
        ok = pd.api.types.is_string_dtype(values) or values.map(lambda v: isinstance(v, str))
    elif kind == NUMBER:
        ok = (pd.api.types.is_numeric_dtype(values) or
              values.map(lambda v: isinstance(v, (bool, int, float, np.number, np.bool_))))
    elif kind == INT:
        ok = values.map(lambda v: isinstance(v, (int, float, np.number)) and not isinstance(v, (bool, np.bool_))
                        and float(v).is_integer())
    else:
        ok = (pd.api.types.is_bool_dtype(values) or
              values.map(lambda v: isinstance(v, (bool, np.bool_)) or (isinstance(v, (int, float, np.number))
                                                                       and v in (0, 1))))
    if ok is True:
        return None
    bad = values[~ok.astype(bool)]
    if not len(bad):
        return None
    return bad.iloc[0].item() if isinstance(bad.iloc[0], np.generic) else bad.iloc[0]


@dataclass(frozen=True)
class TableSchema:
    """The kinds of a results table's columns (name -> :data:`NUMBER`: numbers or true/false;
    :data:`INT`: whole numbers; :data:`FLAG`: true/false or 0/1; :data:`TEXT`: strings; missing
    values are allowed in each): every column its writer gives it. Which columns must be there is
    the reader's to say."""

    what: str
    kinds: Mapping[str, str]

    def check(self, path: Path, df: pd.DataFrame, required: tuple[str, ...] = ()) -> None:
        missing = [c for c in required if c not in df.columns]
        if missing:
            raise KvprobeError(f"{path} is not {self.what} as kvprobe writes it (no column {', '.join(missing)}); "
                               f"rerun the command that wrote it, or move the file away")
        for col, kind in self.kinds.items():
            if col in df.columns:
                bad = _fits(df[col], kind)
                if bad is not None:
                    raise KvprobeError(f"{path} is not {self.what} as kvprobe writes it (column {col} holds "
                                       f"{bad!r}, where {_KIND[kind]} belong); rerun the command that wrote it, "
                                       f"or move the file away")

    def typed(self, df: pd.DataFrame) -> pd.DataFrame:
        """``df`` with its whole-number columns as ``Int64`` and its all-missing columns as their
        declared type (a column whose values do not fit its kind is left as it is: the reader's
        check names it)."""
        out = {}
        for col, kind in self.kinds.items():
            if col not in df.columns:
                continue
            values = df[col]
            if values.isna().all() and len(values):
                out[col] = pd.array([None] * len(values), dtype=_TYPED[kind])
            elif kind == INT and _fits(values, INT) is None and not pd.api.types.is_bool_dtype(values):
                out[col] = pd.to_numeric(values).astype("Int64")
        return df.assign(**out) if out else df


def table_schema(what: str, text: str = "", number: str = "", flag: str = "", whole: str = "") -> TableSchema:
    """A :class:`TableSchema` from space-separated column names per kind (``whole``: whole numbers,
    written as nullable integers)."""
    return TableSchema(what, {**dict.fromkeys(text.split(), TEXT), **dict.fromkeys(number.split(), NUMBER),
                              **dict.fromkeys(flag.split(), FLAG), **dict.fromkeys(whole.split(), INT)})


# The kind of every column each table's writer gives it (tests/unit/test_outputs.py fails on a column
# written but not declared here). What must be there is the reader's: the report's NEEDS
# (kvprobe.reports.folder), export-topk's columns (kvprobe.editor.topk).
TABLE_SCHEMAS: dict[str, TableSchema] = {
    VALIDITY: table_schema("a validity table",
                           text="case_id domain field old_value new_value expected_old expected_new pred_old pred_new",
                           number="m_old m_new logit_shift", whole="n_tokens",
                           flag="control correct_old correct_new flipped valid"),
    EDITS: table_schema("an edits table",
                        text="model case_id strategy ranking pred reference generated error note chose domain field "
                             "template_id kind",
                        number="m m_stale m_oracle oracle_flip recovery cosine kl tokens_recomputed frac_recomputed "
                               "wall_s decide_s", whole="k tokens_total cot n_tokens",
                        flag="agree correct rewritten_prompt control valid"),
    LOCALITY: table_schema("a locality table", text="model case_id probe region metric set kind",
                           number="value m_stale m_oracle oracle_flip", whole="layer head position k n_positions",
                           flag="control"),
    CONCENTRATION: table_schema("a concentration table", text="model case_id probe region metric kind",
                                number="value oracle_flip", whole="layer head position n_tokens k", flag="control"),
    ATTENTION: table_schema("an attention table", text="model case_id probe region metric",
                            number="value", whole="layer head position n_keys", flag="control"),
    KNOCKOUT: table_schema("a knockout table", text="model case_id probe region metric cache set band layers heads",
                           number="value m_stale m_oracle oracle_flip", whole="layer head position k n_positions",
                           flag="control"),
    LINEAR: table_schema("a linear-probe table", text="model case_id probe region metric stream label note",
                         number="value", whole="layer head position n n_templates n_layers"),
    TOKENS: table_schema("a tokens table", text="case_id token token_new kind region", whole="position"),
    COMPOSE: table_schema("a compose table", text="model query_id domain kind answer expected reference",
                          number="cosine kl option_diff reference_option_diff oracle_wall_s wall_s",
                          whole="n_blocks block_tokens context_tokens seam", flag="rerotate agree top1_agree"),
    TTFT: table_schema("a TTFT table", text="model", number="full_s compose_s speedup", whole="block_tokens seam"),
    SERVING: table_schema("a serve-bench table",
                          text="model served_model arm value answer text reference rule_answer error",
                          number="rate hit_rate ttft_s latency_s send_s finish_s agree run_wall_s",
                          whole="request prompt_tokens cached_tokens ceiling_tokens run_sent run_queries run_hits "
                                "block_size base_prompt_tokens", flag="cached_reported ok"),
    SWEEP: table_schema("a `kvprobe sweep` table",
                        text="model cell layout field_style rule_style case_id domain field measure name error chose",
                        number="agree m m_stale m_oracle oracle_flip recovery frac_recomputed wall_s decide_s case_s",
                        whole="filler_tokens downstream_tokens field_tokens n_tokens", flag="control valid"),
    CALIBRATION: table_schema("a calibration table",
                              text="field old_value new_value others strategy ranking pred reference generated "
                                   "error note chose skip",
                              number="m m_stale m_oracle oracle_flip recovery cosine kl tokens_recomputed "
                                     "frac_recomputed wall_s decide_s margin to_decision_s",
                              whole="k tokens_total read_batch",
                              flag="agree correct rewritten_prompt degenerate changed"),
    CALIBRATION_SUMMARY: table_schema("a calibration summary", text="field strategy verdict",
                                      number="change_rate change_lo change_hi agree agree_lo agree_hi agree_changed "
                                             "agree_changed_lo agree_changed_hi flip_rate flip_lo flip_hi "
                                             "frac_recomputed to_decision_s oracle_s oracle_prefix_share seconds",
                                      whole="pairs n skipped n_changed n_unchanged spurious_flips errors",
                                      flag="chosen"),
    WEIGHT_EDITS: table_schema("a `kvprobe weight-edit` table",
                               text="model case_id strategy ranking pred reference generated error note chose domain "
                                    "field template_id kind method contamination_basis",
                               number="m m_stale m_oracle oracle_flip recovery cosine kl tokens_recomputed "
                                      "frac_recomputed wall_s decide_s setup_s final_loss contamination",
                               whole="k tokens_total cot n_tokens steps contamination_changed contamination_n",
                               flag="agree correct rewritten_prompt control valid reached"),
    MEMORY: table_schema("a `kvprobe memory` table",
                         text="model question_id user_id kind fact group arm repair layout answer expected reference "
                              "error",
                         number="option_diff correct agree changed tokens_recomputed frac_recomputed wall_s decide_s "
                                "setup_s",
                         whole="context_tokens"),
    MEMORY_CALIBRATION: table_schema("a `kvprobe memory` policy calibration table",
                                     text="element user_id fact question_id kind strategy answer reference",
                                     number="option_diff wall_s decide_s", whole="tokens_recomputed",
                                     flag="agree changed"),
    SWEEP_SUMMARY: table_schema("a `kvprobe sweep` summary", text="cell layout field_style rule_style measure name",
                                number="downstream_tokens n_tokens agree agree_lo agree_hi recovery recovery_lo "
                                       "recovery_hi frac_recomputed validity case_s",
                                whole="filler_tokens n_cases n_valid n_decision n_valid_controls n_errors n_agree "
                                      "n_recovery"),
}

# The unit of a column (or a JSON key), by kvprobe's naming rule, so that every file says it the same
# way: durations in seconds end in _s; shares are in [0, 1]; counts of tokens are tokens. Keys that
# the rule does not cover are named in UNITS. docs/outputs.md is written from these
# (scripts/outputs_table.py); tests/unit/test_outputs.py checks each command's files against them.
UNITS = {"m": "logits", "m_stale": "logits", "m_oracle": "logits", "m_old": "logits", "m_new": "logits",
         "oracle_flip": "logits", "logit_shift": "logits", "margin": "logits", "option_diff": "logits",
         "reference_option_diff": "logits", "equivalence_margin": "share (0 to 1): accuracies' difference",
         "value": "per metric (the metric column says)", "kl": "nats", "cosine": "cosine (-1 to 1)",
         "speedup": "ratio", "rate": "requests per second (inf: all at once)", "layer": "index (0-based)",
         "head": "index (0-based)", "position": "token index (0-based)", "request": "index (0-based)",
         "seam": "tokens", "k": "tokens (K)", "cot": "tokens", "n_blocks": "count", "block_size": "tokens",
         "tokens_recomputed": "tokens (fractional: a check's partial forward counted by its share of layers)",
         "validity": "share (0 to 1)", "hit_rate": "share (0 to 1)", "agree": "share (0 to 1) or true/false",
         "seconds": "seconds", "pairs": "count", "skipped": "count", "errors": "count", "spurious_flips": "count",
         "change_rate": "share (0 to 1)", "final_loss": "nats", "steps": "count (optimizer steps)",
         "contamination": "share (0 to 1)", "contamination_changed": "count", "contamination_n": "count",
         "changed": "share (0 to 1) or true/false", "oracle_prefix_share": "share (0 to 1)",
         "read_batch": "count (the decision reads that shared one batched forward; its decide_s is the batch's)",
         **dict.fromkeys(("recovery", "recovery_lo", "recovery_hi"),
                         "ratio of the oracle's flip (1: the oracle's, 0: the stale cache's; may leave [0, 1])")}


def unit_of(column: str) -> str:
    """The unit of ``column`` (see :data:`UNITS`)."""
    if column in UNITS:
        return UNITS[column]
    if column.endswith("_s"):
        return "seconds"
    if column.startswith(("frac_", "agree", "recovery", "correct", "flip_")) or column.endswith(("_lo", "_hi")):
        return "share (0 to 1)"
    if column.endswith("_tokens") or column in ("n_tokens", "tokens_total", "n_keys", "n_positions"):
        return "tokens"
    if column.startswith("n_") or column in ("n", "run_sent", "run_queries", "run_hits"):
        return "count"
    return ""


def read_table(path: Path, required: tuple[str, ...] = ()) -> pd.DataFrame:
    """A parquet table that, when it has rows, holds the ``required`` columns (what the caller reads
    unconditionally) and whose columns are of the kinds :data:`TABLE_SCHEMAS` gives for its file
    name. A file that is not a parquet table, lacks a required column, or holds a column of the
    wrong kind (text where numbers belong) is a one-line :class:`KvprobeError` naming the file and
    the column."""
    try:
        df = pd.read_parquet(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # pyarrow's errors are ValueError/OSError
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        first = re.sub(r"^Could not open Parquet input source '[^']*': ", "", first)
        if "magic bytes not found" in first:
            first = "no parquet magic bytes: corrupted, or not a parquet file"
        raise KvprobeError(f"{path} is not a readable parquet table ({first}); rerun the command that wrote it, "
                           f"or move the file away") from None
    df = today_names(df, path)
    if len(df):  # a table of no rows (no case finished) has nothing to check
        TABLE_SCHEMAS.get(Path(path).name, TableSchema("a results table", {})).check(path, df, required)
    return df


# Part folders (``parts/<name>/...``) whose name is not their table's
PART_TABLES = {"pairs": CALIBRATION, "cells": SWEEP}


def table_of(path: Path | str) -> str:
    """The table file a results file belongs to: its own name, or for a part
    (``<folder>/parts/<name>/.../<key>.parquet``) its table's (``<name>.parquet``, or :data:`PART_TABLES`)."""
    path = Path(path)
    if "parts" in path.parts[:-1]:
        i = len(path.parts) - 1 - path.parts[::-1].index("parts")
        if i + 2 < len(path.parts):
            name = path.parts[i + 1]
            return PART_TABLES.get(name, f"{name}.parquet")
    return path.name


def today_names(df: pd.DataFrame, path: Path | str) -> pd.DataFrame:
    """``df``, read from ``path``, under today's column names (:data:`RENAMED`): a table written under an
    older schema (its metadata's ``schema`` below :data:`RENAMED_SINCE`, or no metadata) has its columns
    renamed; later tables are returned as they are. A part is named by its table (:func:`table_of`)."""
    renamed = RENAMED.get(table_of(path), {})
    old = {a: b for a, b in renamed.items() if a in df.columns and b not in df.columns}
    if not old or table_metadata(path).get("schema", 1) >= RENAMED_SINCE:
        return df
    return df.rename(columns=old)


def table_metadata(path: Path | str) -> dict:
    """The ``kvprobe`` entry of a parquet file's metadata ({} for a file written before it)."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta[b"kvprobe"]) if b"kvprobe" in meta else {}
