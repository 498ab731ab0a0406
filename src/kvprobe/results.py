"""Results folders: ``manifest.json`` beside one parquet file per table.

File names are constants; every writer is atomic (temp file, then rename) and returns the path
it wrote, so an interrupted run never leaves a half-written table that looks finished. What each
table holds (its columns, their types and units) is in :mod:`kvprobe.tables`; its names are
re-exported here, where the commands have always found them.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import pandas as pd

from kvprobe.errors import KvprobeError, UsageError
from kvprobe.files import atomic_write, atomic_write_json, json_text  # noqa: F401  (results' writers, re-exported)
from kvprobe.identity import ModelIdentity
from kvprobe.schema import check_version
from kvprobe.tables import (ATTENTION, CALIBRATION, CALIBRATION_SUMMARY, COMPOSE, CONCENTRATION, EDITS, FLAG,  # noqa: F401
                            INT, KNOCKOUT, LINEAR, LOCALITY, MEMORY, MEMORY_CALIBRATION, NUMBER, SERVING, SWEEP,
                            SWEEP_SUMMARY, TABLE_SCHEMAS, TABLES_SCHEMA, TEXT, TOKENS, TTFT, UNITS, VALIDITY,
                            WEIGHT_EDITS, TableSchema, read_table, table_metadata, table_schema, unit_of)

RUN_MANIFEST = "manifest.json"
RANKING_RULE = "ranking_rule.json"
SERVING_MANIFEST = "serving_manifest.json"
ENGINE_MANIFEST = "engine_agent_manifest.json"  # kvprobe serve-bench --engine llama.cpp
COMPOSE_MANIFEST = "compose_manifest.json"  # kvprobe validate
REPORT = "report.html"


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

    table = pa.Table.from_pandas(schema.typed(df), preserve_index=False)
    meta = {**(table.schema.metadata or {}), b"kvprobe": json.dumps(
        {"table": path.name, "schema": TABLES_SCHEMA, "version": installed_version("kvprobe")}).encode()}
    table = table.replace_schema_metadata(meta)
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))


# The file by which each command claims a results folder, holding the settings it ran with.
RUN_CLAIM = "config.json"
EDIT_CLAIM = "edit_config.json"
VALIDATE_CLAIM = "validate_config.json"
SWEEP_CLAIM = "sweep_config.json"
CALIBRATE_CLAIM = "calibrate_config.json"
WEIGHT_EDIT_CLAIM = "weight_edit_config.json"
MEMORY_CLAIM = "memory_config.json"
MEMORY_MANIFEST = "memory_manifest.json"
SWEEP_MANIFEST = "sweep_manifest.json"
# The serving benchmarks claim a folder by their manifest (written at the start: the claim's settings plus
# what the run found, e.g. the unique values' salt), read back through each bench's ``settle``.
MANIFEST_CLAIMS = (SERVING_MANIFEST, ENGINE_MANIFEST)
CLAIMS = {RUN_CLAIM: "kvprobe run", EDIT_CLAIM: "kvprobe edit", VALIDATE_CLAIM: "kvprobe validate",
          SWEEP_CLAIM: "kvprobe sweep", CALIBRATE_CLAIM: "kvprobe calibrate",
          SERVING_MANIFEST: "kvprobe serve-bench", ENGINE_MANIFEST: "kvprobe serve-bench --engine llama.cpp",
          WEIGHT_EDIT_CLAIM: "kvprobe weight-edit", MEMORY_CLAIM: "kvprobe memory"}


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
    model = ModelIdentity.of_model(lm)
    claim_identity(folder, model.content(), model.spec, cases)


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
        if name in MANIFEST_CLAIMS:  # the claim is the manifest itself: an object, and no newer kvprobe's
            stored = json_object(path, what=f"a `{CLAIMS[name]}` manifest")
        else:
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
VERSIONS = {RUN_MANIFEST: ("kvprobe_run", 1), SWEEP_MANIFEST: ("kvprobe_sweep", 1),
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


def installed_version(pkg: str) -> str | None:
    """A distribution's version from its installed metadata (None where it is not installed).
    kvprobe's own is read this way too, not from ``kvprobe.__version__``: importing the package
    from here would close a loop through its lazy API (kvprobe -> api -> datasets.io -> results)."""
    import importlib.metadata as md

    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def package_versions() -> dict:
    return {"python": platform.python_version(),
            **{pkg: installed_version(pkg) for pkg in ("kvprobe", "torch", "transformers", "pandas", "scikit-learn",
                                                       "numpy")}}


RUN_MANIFEST_KEYS = ("kvprobe_run", "config", "model")  # what `kvprobe run` writes and the report reads



class CaseStore:
    """Per-part results of one table, so an interrupted run resumes without redoing finished work.

    Each finished part (a case, a query, a benchmark run) is one parquet file
    ``<folder>/parts/<table>/<part_name(key)>.parquet``, written atomically; the resume loop every
    command uses is an executor's ``each``/``map`` over a store (:mod:`kvprobe.executor`: a finished
    part is read, the others are computed and saved as each ends); :meth:`collect` concatenates the
    parts into ``<folder>/<table>.parquet``. Only the folder's claim (:class:`ResultsFolder`) makes a part
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

    def holds(self, key: str) -> bool:
        """Whether ``key`` has a part (readable or not: :meth:`get` says)."""
        return self._path(key).exists()

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
        df = Serial().map(folder.parts("edits"), items, fn, Context(lm), on_done=tick)  # kvprobe.executor
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

    def claim(self, lm=None, cases=(), identity: tuple[dict, str] | None = None) -> None:
        """Claim the folder for these settings and, with ``lm``, for this model's and these cases'
        contents (:func:`claim_inputs`): a resume reuses parts only computed from the same ones. A model
        known by another identity than a loaded model's (a served model, an engine's GGUF) is given as
        ``identity`` = (its identity, its name) instead (:func:`claim_identity`)."""
        self.path.mkdir(parents=True, exist_ok=True)
        claim_folder(self.path, self.claim_file, self.settings, self.settle, self.held)
        if identity is not None:
            claim_identity(self.path, identity[0], identity[1], cases)
        elif lm is not None:
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
