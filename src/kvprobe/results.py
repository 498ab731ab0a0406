"""Results folders: ``manifest.json`` beside one parquet file per table.

File names are constants; every writer is atomic (temp file, then rename) and returns the path
it wrote, so an interrupted run never leaves a half-written table that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from kvprobe.errors import KvprobeError, UsageError
from kvprobe.schema import check_version

MANIFEST = "manifest.json"
VALIDITY = "validity.parquet"
EDITS = "edits.parquet"
LOCALITY = "locality.parquet"
CONCENTRATION = "concentration.parquet"
ATTENTION = "attention.parquet"
LINEAR = "linear.parquet"
KNOCKOUT = "knockout.parquet"
COMPOSE = "compose.parquet"
RANKING_RULE = "ranking_rule.json"
TOKENS = "tokens.parquet"
TTFT = "ttft.parquet"
SERVING = "serving.parquet"  # kvprobe serve-bench: one row per request (kvprobe.serving.bench.COLUMNS)
SERVING_MANIFEST = "serving_manifest.json"
COMPOSE_MANIFEST = "compose_manifest.json"  # kvprobe validate
REPORT = "report.html"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()


def atomic_write(path: Path | str, write) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it into place (the one
    atomic write: an interrupted writer never leaves a half-written file that looks finished)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; a results file reads like any other file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


TABLES_SCHEMA = 1  # the version of TABLE_SCHEMAS' columns, in every results table's parquet metadata


def atomic_write_parquet(df: pd.DataFrame, path: Path | str) -> Path:
    """Write a DataFrame as parquet atomically; returns the path. A results table (a file name of
    :data:`TABLE_SCHEMAS`) is written with its declared types: whole-number columns as nullable
    integers (``Int64``: a missing layer is <NA>, not a float NaN), a column of missing values only
    as its declared type, not as untyped nulls; and its parquet metadata holds ``kvprobe``:
    ``{"table", "schema" (TABLES_SCHEMA), "version"}``."""
    path = Path(path)
    schema = TABLE_SCHEMAS.get(path.name)
    if schema is None:
        return atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvprobe import __version__

    table = pa.Table.from_pandas(schema.typed(df), preserve_index=False)
    meta = {**(table.schema.metadata or {}), b"kvprobe": json.dumps(
        {"table": path.name, "schema": TABLES_SCHEMA, "version": __version__}).encode()}
    table = table.replace_schema_metadata(meta)
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def table_metadata(path: Path | str) -> dict:
    """The ``kvprobe`` entry of a parquet file's metadata ({} for a file written before it)."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta[b"kvprobe"]) if b"kvprobe" in meta else {}


def atomic_write_json(data: dict, path: Path | str) -> Path:
    """Write JSON atomically (sorted keys, indented); returns the path."""
    return atomic_write(Path(path), lambda tmp: tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str)))


# The file by which each command claims a results folder, holding the settings it ran with.
RUN_CLAIM = "config.json"
EDIT_CLAIM = "edit_config.json"
VALIDATE_CLAIM = "validate_config.json"
SWEEP_CLAIM = "sweep_config.json"
CALIBRATE_CLAIM = "calibrate_config.json"
SWEEP = "sweep.parquet"  # kvprobe sweep: one row per cell x case x measure
SWEEP_SUMMARY = "sweep_summary.parquet"  # one row per cell x measure, with 95% CIs
SWEEP_MANIFEST = "sweep_manifest.json"
CALIBRATION = "calibration.parquet"  # kvprobe calibrate: one row per (field, pair, strategy)
CALIBRATION_SUMMARY = "calibration_summary.parquet"  # one row per (field, strategy)
CLAIMS = {RUN_CLAIM: "kvprobe run", EDIT_CLAIM: "kvprobe edit", VALIDATE_CLAIM: "kvprobe validate",
          SWEEP_CLAIM: "kvprobe sweep", CALIBRATE_CLAIM: "kvprobe calibrate",
          SERVING_MANIFEST: "kvprobe serve-bench"}


def refuse_foreign(folder: Path | str, own: str) -> None:
    """Refuse a folder that holds another command's results, or files no kvprobe command claimed
    (``own`` is the claim file of the command asking)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for name, command in CLAIMS.items():
        if name != own and (folder / name).exists():
            raise UsageError(f"{folder} holds the results of `{command}` ({name}); choose another --out")
    if not (folder / own).exists() and any(not p.name.startswith(".") for p in folder.iterdir()):
        raise UsageError(f"{folder} is not empty and holds no kvprobe results of this command; choose a new or "
                         f"empty --out")


INPUTS = "inputs.json"  # what a folder's rows were computed from: the model's and each case's fingerprint
MODEL_KEYS = ("family", "config_hash", "weights_hash", "tokenizer_hash")  # content, not the spec's path


def case_digest(case) -> str:
    """A case's content hash: every field of the case, so an edit that keeps its id changes it."""
    data = case.model_dump(mode="json") if hasattr(case, "model_dump") else vars(case)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def claim_inputs(folder: Path | str, lm, cases=()) -> None:
    """Record, or on a resume check, what the folder's rows are computed from: the model's content
    (config, weights and tokenizer hashes, whatever path or spec names it) and each case's content
    (``cases``: the cases, keyed by case id, or a dict of key -> case where ids repeat, e.g. per cell).

    A claim names settings and paths; a dataset edited in place under the same case ids, or a model
    folder replaced under the same path, would otherwise resume from rows computed from the old
    ones. So the folder is refused, in one line, when the model differs or when a case it has seen
    now has other content (the folder's rows for it may be done: kvprobe refuses rather than mix);
    new case ids are added. A folder written before this file existed is fingerprinted as it is.
    Call it after :func:`claim_folder`, once the model is loaded."""
    fp = lm.fingerprint()
    claim_identity(folder, {k: fp[k] for k in MODEL_KEYS}, fp["spec"], cases)


def claim_identity(folder: Path | str, model: dict, name: str, cases=()) -> None:
    """:func:`claim_inputs` for a model known by an identity other than a loaded model's
    fingerprint (``kvprobe serve-bench``: the served model); ``name`` names it in the refusal."""
    path = Path(folder) / INPUTS
    items = cases.items() if isinstance(cases, dict) else ((c.case_id, c) for c in cases)
    now = {"model": dict(model), "cases": {key: case_digest(c) for key, c in items}}
    if path.exists():
        try:
            stored = json.loads(path.read_text())
            then, seen = dict(stored["model"]), dict(stored["cases"])
        except (ValueError, KeyError, TypeError):
            raise KvprobeError(f"{path} is not a kvprobe inputs file; remove the folder or choose another --out"
                               ) from None
        if then != now["model"]:
            differ = sorted(k for k in set(then) | set(now["model"]) if then.get(k) != now["model"].get(k))
            raise UsageError(f"{folder} holds rows computed from another model ({', '.join(differ)} differ from "
                             f"{name}'s); choose another --out or remove it")
        changed = sorted(c for c, h in now["cases"].items() if c in seen and seen[c] != h)
        if changed:
            raise UsageError(f"{folder} holds rows computed from other contents of {len(changed)} case(s) "
                             f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}): the dataset changed "
                             f"under the same case ids; choose another --out or remove it")
        now["cases"] = {**seen, **now["cases"]}
    atomic_write_json(now, path)


def claim_folder(folder: Path | str, name: str, config: dict, settle=lambda stored: stored,
                 held: str = "run with a different configuration") -> None:
    """Record ``config`` as ``<folder>/<name>``, or, when a run already left one there, refuse the
    folder unless ``settle(stored) == config`` (so a rerun resumes only what it would have done).
    A folder with another command's claim, or with files and no claim, is refused too. Call it
    only once every input is validated: a refused command must leave no claim behind."""
    if not check_claim(folder, name, config, settle, held):
        atomic_write_json(config, Path(folder) / name)


def check_claim(folder: Path | str, name: str, config: dict, settle=lambda stored: stored,
                held: str = "run with a different configuration") -> bool:
    """What :func:`claim_folder` refuses, checked without writing anything (so a command can fail
    fast, before loading a model); True when the folder already holds this very claim."""
    path = Path(folder) / name
    refuse_foreign(folder, name)
    if path.exists():
        try:
            stored = json.loads(path.read_text())
        except ValueError:
            raise KvprobeError(f"{path} is not valid JSON; remove the folder or choose another --out") from None
        then = settle(stored)
        if then != config:
            differ = sorted(k for k in set(config) | set(then if isinstance(then, dict) else {})
                            if not isinstance(then, dict) or then.get(k) != config.get(k))
            raise UsageError(f"{folder} holds a {held} (differs in {', '.join(differ[:6]) or 'format'}); choose "
                             f"another --out or remove it")
        return True
    return False


_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")


def part_name(key: str) -> str:
    """A file name for a part key (a case id): every character outside ``[A-Za-z0-9._-]``, a leading
    dot and ``%`` itself percent-encoded, so no key holds a path separator or escapes its folder, and
    two keys never share a name; a long key keeps a readable head and a hash."""
    name = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in key)
    if name.startswith("."):
        name = "%2E" + name[1:]
    if len(name) > 180:
        name = name[:100] + "~" + hashlib.sha256(key.encode()).hexdigest()
    return name


def check_case_ids(case_ids) -> None:
    """Refuse two cases whose ids are the same, or whose part files would be the same on a
    case-insensitive file system (``Refund-1`` and ``refund-1``)."""
    seen: dict[str, str] = {}
    for cid in case_ids:
        key = part_name(cid).lower()
        if key in seen:
            raise KvprobeError(f"case ids {seen[key]!r} and {cid!r} collide (the same id, or the same apart from "
                               f"case); give every case a distinct case_id")
        seen[key] = cid


# -- reading a results folder: one line naming the file when it is not what a command wrote --
# Each manifest's version key and the newest version this kvprobe writes (and reads, with the older ones).
# A manifest from a newer kvprobe is refused, not half-read; a serving or compose manifest written
# before it had a version key is version 1.
VERSIONS = {MANIFEST: ("kvprobe_run", 1), SWEEP_MANIFEST: ("kvprobe_sweep", 1),
            SERVING_MANIFEST: ("kvprobe_serve_bench", 1), COMPOSE_MANIFEST: ("kvprobe_validate", 1)}


def version_entry(name: str) -> dict:
    """``{version key: this kvprobe's version}`` for the manifest file ``name``, for its writer."""
    key, version = VERSIONS[name]
    return {key: version}


def json_object(path: Path, keys: tuple[str, ...] = (), what: str = "a JSON object") -> dict:
    """A JSON object file; not JSON, not an object, or without one of ``keys`` is a one-line
    :class:`KvprobeError` naming the file and ``what`` it should be. A manifest (:data:`VERSIONS`)
    whose version key is above this kvprobe's (written by a newer kvprobe), or not a version, is
    refused the same way."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise KvprobeError(f"{path} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    except json.JSONDecodeError as exc:
        raise KvprobeError(f"{path} is not valid JSON: {exc}") from None
    missing = [k for k in keys if k not in data] if isinstance(data, dict) else list(keys)
    if not isinstance(data, dict) or missing:
        got = f"it lacks {', '.join(missing)}" if isinstance(data, dict) else f"it holds a {type(data).__name__}"
        raise KvprobeError(f"{path} is not {what} ({got}); rerun the command that wrote it, or move the file away")
    if path.name in VERSIONS and VERSIONS[path.name][0] in data:
        key, newest = VERSIONS[path.name]
        check_version(path, data[key], key, tuple(range(1, newest + 1)),
                      "rerun the command that wrote it, or move the file away")
    return data


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
    if len(df):  # a table of no rows (no case finished) has nothing to check
        TABLE_SCHEMAS.get(Path(path).name, TableSchema("a results table", {})).check(path, df, required)
    return df


def package_versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("kvprobe", "torch", "transformers", "pandas", "scikit-learn", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


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
    :data:`FLAG`: true/false or 0/1; :data:`TEXT`: strings; missing values are allowed in each):
    every column a reader may use. Which columns must be there is the reader's to say."""

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


# The kinds of the columns each table's writer gives it (a column of missing values only, or of mixed
# kinds, is left out). What must be there is the reader's: the report's NEEDS (kvprobe.reports.folder),
# export-topk's columns (kvprobe.editor.topk).
TABLE_SCHEMAS: dict[str, TableSchema] = {
    VALIDITY: table_schema("a validity table",
                           text="case_id domain field old_value new_value expected_old expected_new pred_old pred_new",
                           number="m_old m_new logit_shift", whole="n_tokens",
                           flag="control correct_old correct_new flipped valid"),
    EDITS: table_schema("an edits table",
                        text="model case_id strategy ranking pred pred_oracle generated error note chose domain field "
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
    COMPOSE: table_schema("a compose table", text="model query_id domain kind answer expected oracle_answer",
                          number="cosine kl margin oracle_margin oracle_wall_s wall_s",
                          whole="n_blocks block_tokens context_tokens seam", flag="rerotate agree top1_agree"),
    TTFT: table_schema("a TTFT table", text="model", number="full_s compose_s speedup", whole="block_tokens seam"),
    SERVING: table_schema("a serve-bench table",
                          text="model served_model arm value answer text oracle_answer rule_answer error",
                          number="rate hit_rate ttft_s latency_s send_s finish_s agree run_wall_s",
                          whole="request prompt_tokens cached_tokens ceiling_tokens run_sent run_queries run_hits "
                                "block_size base_prompt_tokens", flag="cached_reported ok"),
    SWEEP: table_schema("a `kvprobe sweep` table",
                        text="model cell layout field_style rule_style case_id domain field measure name error chose",
                        number="agree m m_stale m_oracle oracle_flip recovery frac_recomputed wall_s decide_s case_s",
                        whole="filler_tokens downstream_tokens field_tokens n_tokens", flag="control valid"),
    CALIBRATION: table_schema("a calibration table",
                              text="field old_value new_value others strategy ranking pred pred_oracle generated "
                                   "error note chose skip",
                              number="m m_stale m_oracle oracle_flip recovery cosine kl tokens_recomputed "
                                     "frac_recomputed wall_s decide_s margin to_decision_s",
                              whole="k tokens_total", flag="agree correct rewritten_prompt degenerate changed"),
    CALIBRATION_SUMMARY: table_schema("a calibration summary", text="field strategy verdict",
                                      number="change_rate change_lo change_hi agree agree_lo agree_hi agree_changed "
                                             "agree_changed_lo agree_changed_hi flip_rate flip_lo flip_hi "
                                             "frac_recomputed to_decision_s oracle_s seconds",
                                      whole="pairs skipped n_changed n_unchanged spurious_flips errors",
                                      flag="chosen"),
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
         "oracle_flip": "logits", "logit_shift": "logits", "margin": "logits", "oracle_margin": "logits",
         "value": "per metric (the metric column says)", "kl": "nats", "cosine": "cosine (-1 to 1)",
         "speedup": "ratio", "rate": "requests per second (inf: all at once)", "layer": "index (0-based)",
         "head": "index (0-based)", "position": "token index (0-based)", "request": "index (0-based)",
         "seam": "tokens", "k": "tokens (K)", "cot": "tokens", "n_blocks": "count", "block_size": "tokens",
         "tokens_recomputed": "tokens (fractional: a check's partial forward counted by its share of layers)",
         "validity": "share (0 to 1)", "hit_rate": "share (0 to 1)", "agree": "share (0 to 1) or true/false",
         "seconds": "seconds", "pairs": "count", "skipped": "count", "errors": "count", "spurious_flips": "count",
         "change_rate": "share (0 to 1)",
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


RUN_MANIFEST_KEYS = ("kvprobe_run", "config", "model")  # what `kvprobe run` writes and the report reads



class CaseStore:
    """Per-part results of one table, so an interrupted run resumes without redoing finished work.

    Each finished part (a case, a query, a benchmark run) is one parquet file
    ``<folder>/parts/<table>/<part_name(key)>.parquet``, written atomically; :meth:`each` and
    :meth:`map` are the resume loop every command uses (a finished part is read, the others are
    computed and saved as each ends); :meth:`collect` concatenates the parts into
    ``<folder>/<table>.parquet``. Only the folder's claim (:class:`ResultsFolder`) makes a part
    reusable: it was computed from the same settings, model and case contents.
    """

    def __init__(self, folder: Path | str, table: str):
        self.folder = Path(folder)
        self.table = table
        self.parts = self.folder / "parts" / table
        self.recomputed: list[str] = []  # keys whose part could not be read, so they were computed again

    def _path(self, key: str) -> Path:
        return self.parts / f"{part_name(key)}.parquet"

    def save(self, key: str, df: pd.DataFrame) -> Path:
        return atomic_write_parquet(df, self._path(key))

    def get(self, key: str) -> pd.DataFrame | None:
        """The finished part of ``key``, or None when there is none. A part that cannot be read (cut
        short by a full disk, overwritten by something else) is none too: it is recorded in
        :attr:`recomputed` and computed again, which is safe because the claim holds."""
        path = self._path(key)
        if not path.exists():
            return None
        try:
            return read_table(path)
        except KvprobeError:
            self.recomputed.append(key)
            return None

    def each(self, items, fn, times: dict[str, float] | None = None):
        """For each ``(key, item)``: yields ``(key, frame, resumed)``, the frame read from its part
        or computed by ``fn(item)`` and saved before it is yielded (a caller may stop early);
        ``times`` gets the seconds of each one computed."""
        for key, item in items:
            df = self.get(key)
            resumed = df is not None
            if df is None:
                start = time.perf_counter()
                df = fn(item)
                if times is not None:
                    times[key] = time.perf_counter() - start
                self.save(key, df)
            yield key, df, resumed

    def map(self, items, fn, on_done=lambda: None, times: dict[str, float] | None = None) -> pd.DataFrame:
        """:meth:`each` over every item, ``on_done()`` after each; the frames concatenated."""
        frames = []
        for _, df, _ in self.each(items, fn, times):
            frames.append(df)
            on_done()
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def finished(self):
        """Every finished, readable part's frame, in file-name order."""
        for f in sorted(self.parts.glob("*.parquet")) if self.parts.exists() else []:
            try:
                yield read_table(f)
            except KvprobeError:
                continue  # recomputed when its key comes up

    def collect(self) -> Path:
        """Concatenate every finished part (sorted by key) into the table file; returns its path."""
        frames = [f for f in self.finished() if len(f)]
        df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        return atomic_write_parquet(df, self.folder / f"{self.table}.parquet")


class ResultsFolder:
    """One command's results folder: the one place its claim, its resume loop and the skeleton of
    its manifest live (``kvprobe run``, ``edit``, ``sweep`` and ``validate`` build on it).

    ``claim`` is the command's claim file (:data:`CLAIMS`) and ``settings`` what it records there;
    ``settle`` maps a stored claim onto today's form (defaults added since), ``held`` names the
    folder in the refusal. ``dtype``, when given, is a claim key only off float32, so folders written
    before ``--dtype`` existed still resume.

        folder = ResultsFolder(out, EDIT_CLAIM, settings, dtype=dtype)
        folder.check()                      # before loading anything: writes nothing
        folder.claim(lm, cases)             # once every input is valid: settings, model and cases
        df = folder.parts("edits").map(items, fn, on_done=tick)
        folder.write(name, folder.manifest(lm, **fields))
    """

    def __init__(self, path: Path | str, claim: str, settings: dict, *, settle=lambda stored: stored,
                 held: str = "run with a different configuration", dtype: str | None = None):
        self.path = Path(path)
        self.claim_file = claim
        self.settings = dict(settings)
        if dtype is not None and dtype != "float32":
            self.settings["dtype"] = dtype
        self.settle, self.held = settle, held
        self._stores: dict[str, CaseStore] = {}

    def check(self) -> bool:
        """What :meth:`claim` would refuse, without writing anything; True when resuming."""
        return check_claim(self.path, self.claim_file, self.settings, self.settle, self.held)

    def claim(self, lm=None, cases=()) -> None:
        """Claim the folder for these settings and, with ``lm``, for this model's and these cases'
        contents (:func:`claim_inputs`): a resume reuses parts only computed from the same ones."""
        self.path.mkdir(parents=True, exist_ok=True)
        claim_folder(self.path, self.claim_file, self.settings, self.settle, self.held)
        if lm is not None:
            claim_inputs(self.path, lm, cases)

    def parts(self, table: str) -> CaseStore:
        if table not in self._stores:
            self._stores[table] = CaseStore(self.path, table)
        return self._stores[table]

    @property
    def recomputed(self) -> list[str]:
        """``table/key`` of every part that could not be read and was computed again."""
        return [f"{t}/{k}" for t, s in self._stores.items() for k in s.recomputed]

    def manifest(self, lm, **fields) -> dict:
        """A manifest: ``fields`` plus what every command records (the model's fingerprint and
        facts, package versions, and any part that had to be recomputed)."""
        out = {**fields, "model": lm.fingerprint(), "model_info": lm.info.as_dict(), "versions": package_versions()}
        if self.recomputed:
            out["recomputed_parts"] = self.recomputed
        return out

    def write(self, name: str, data: dict) -> Path:
        return atomic_write_json(data, self.path / name)
