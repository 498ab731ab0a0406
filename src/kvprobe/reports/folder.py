"""Read one results folder (parquet, JSON, YAML) for the report; never runs anything.

A folder is whatever ``kvprobe run`` or ``kvprobe validate`` wrote: ``manifest.json`` and the
probe tables, and/or ``compose.parquet`` with ``compose_manifest.json``, optionally
``tokens.parquet`` (:mod:`kvprobe.datasets.tokens`) and ``ttft.parquet`` (:data:`TTFT`), and/or
``serving.parquet`` with ``serving_manifest.json`` (``kvprobe serve-bench``), and/or
``weight_edits.parquet`` with ``weight_edit_manifest.json`` (``kvprobe weight-edit``), and/or
``memory.parquet`` with ``memory_manifest.json`` (``kvprobe memory``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml

from kvprobe.defaults import DEFAULT_THRESHOLD
from kvprobe.errors import KvprobeError
from kvprobe.editor.topk import TOPK_FILE
from kvprobe.policy import READS
from kvprobe.datasets.tokens import TOKENS
from kvprobe.results import (ATTENTION, COMPOSE, COMPOSE_MANIFEST, CONCENTRATION, EDITS, KNOCKOUT, LINEAR, LOCALITY,
                             RUN_MANIFEST, MEMORY, MEMORY_MANIFEST, RANKING_RULE, RUN_MANIFEST_KEYS, SERVING,
                             SERVING_MANIFEST, VALIDITY, WEIGHT_EDITS, json_object, read_table)
from kvprobe.schema import check_version

# Time to first token, full prefill against a composed cache: one row per (block_tokens, timed repeat),
# columns block_tokens, full_s, compose_s, speedup (= full_s / compose_s); optional: model, seam.
TTFT = "ttft.parquet"
TABLES = (VALIDITY, LOCALITY, CONCENTRATION, ATTENTION, KNOCKOUT, LINEAR, EDITS, COMPOSE, TOKENS, TTFT, SERVING,
          WEIGHT_EDITS, MEMORY)
WEIGHT_EDIT_MANIFEST = "weight_edit_manifest.json"
# The columns the report's sections and compare's summaries read unconditionally: a table with rows that
# lacks one is refused in one line naming it (read_table; the kinds of all columns are checked there too).
# The compose and serving sections say in the page which of their columns a table lacks.
NEEDS = {
    VALIDITY: ("case_id", "control", "valid"),
    EDITS: ("case_id", "strategy", "ranking", "k", "cot", "agree", "correct", "recovery", "oracle_flip", "cosine",
            "kl", "frac_recomputed", "wall_s", "control", "valid"),
    LOCALITY: ("case_id", "layer", "position", "region", "metric", "value", "k", "oracle_flip"),
    CONCENTRATION: ("case_id", "metric", "value", "n_tokens"),
    ATTENTION: ("case_id", "layer", "head", "region", "value", "n_keys"),
    KNOCKOUT: ("case_id", "layer", "head", "metric", "value", "cache", "set", "k", "band"),
    LINEAR: ("layer", "region", "value", "stream", "label", "n"),
    TOKENS: ("case_id", "position", "token", "token_new", "kind", "region"),
    WEIGHT_EDITS: ("case_id", "strategy", "method", "kind", "valid", "agree", "wall_s", "decide_s", "setup_s",
                   "contamination", "contamination_n", "contamination_basis", "error"),
    # not repair: folders written before the policy arm lack it (kvprobe.memory.summarize_memory reads it where present)
    MEMORY: ("question_id", "kind", "group", "arm", "correct", "agree", "changed", "tokens_recomputed",
             "frac_recomputed", "wall_s", "decide_s", "error"),
}
KNOWN = (RUN_MANIFEST, COMPOSE_MANIFEST, SERVING_MANIFEST, WEIGHT_EDIT_MANIFEST, MEMORY_MANIFEST, TOPK_FILE,
         RANKING_RULE) + TABLES


@dataclass
class Run:
    """One results folder, loaded."""

    folder: Path
    label: str
    manifest: dict = field(default_factory=dict)
    compose_manifest: dict = field(default_factory=dict)
    serving_manifest: dict = field(default_factory=dict)
    weight_edit_manifest: dict = field(default_factory=dict)
    memory_manifest: dict = field(default_factory=dict)
    ranking_rule: dict = field(default_factory=dict)
    topk_text: str | None = None
    topk: dict = field(default_factory=dict)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return name in self.tables and len(self.tables[name]) > 0

    def table(self, name: str) -> pd.DataFrame:
        return self.tables.get(name, pd.DataFrame())

    @property
    def config(self) -> dict:
        return self.manifest.get("config", {})

    @property
    def threshold(self) -> float:
        """What the folder's verdicts are established at: the command's own (``kvprobe run``'s config), else
        the one its topk.yaml was exported at, else the default. A command that writes its summary passes its
        threshold instead (:func:`kvprobe.reports.summary.write_summary`); a report or ``compare`` reads this."""
        if isinstance(self.config.get("threshold"), (int, float)):
            return float(self.config["threshold"])
        t = self.topk.get("threshold") if isinstance(self.topk, dict) else None
        return float(t) if isinstance(t, (int, float)) and 0 <= t <= 1 else DEFAULT_THRESHOLD

    @property
    def min_flip(self) -> float:
        return float(self.config.get("min_flip", 1.0))

    @property
    def model(self) -> str:
        return self.label


def load_run(folder: Path | str, tables: tuple[str, ...] = ()) -> Run:
    """Load every known file of a results folder, and the parquet ``tables`` some report section reads
    besides :data:`TABLES`; refuses a folder with none of them."""
    folder = Path(folder)
    if not folder.is_dir():
        raise KvprobeError(f"results folder not found: {folder}")
    present = [name for name in KNOWN + tables if (folder / name).exists()]
    if not present:
        raise KvprobeError(f"{folder} is not a kvprobe results folder (none of {RUN_MANIFEST}, {COMPOSE}, ... found); "
                           f"run `kvprobe run`, `kvprobe validate`, `kvprobe serve-bench`, `kvprobe weight-edit` or "
                           f"`kvprobe memory` first")
    run = Run(folder=folder, label="")
    if (folder / RUN_MANIFEST).exists():
        run.manifest = json_object(folder / RUN_MANIFEST, RUN_MANIFEST_KEYS, "a `kvprobe run` manifest")
        for key in ("config", "model"):
            if not isinstance(run.manifest[key], dict):
                raise KvprobeError(f"{folder / RUN_MANIFEST} is not a `kvprobe run` manifest ({key} is not an object); "
                                   f"rerun the command that wrote it, or move the file away")
    if (folder / COMPOSE_MANIFEST).exists():
        run.compose_manifest = json_object(folder / COMPOSE_MANIFEST, what="a `kvprobe validate` manifest")
    if (folder / SERVING_MANIFEST).exists():
        run.serving_manifest = json_object(folder / SERVING_MANIFEST, what="a `kvprobe serve-bench` manifest")
        if run.serving_manifest.get("workload") == "agent":
            raise KvprobeError(f"{folder} holds the agent workload of `kvprobe serve-bench`, which the report does not "
                               f"render; its table is kvprobe.serving.agent.summarize(pandas.read_parquet("
                               f"'{folder / 'agent.parquet'}')), which serve-bench printed")
    if (folder / WEIGHT_EDIT_MANIFEST).exists():
        run.weight_edit_manifest = json_object(folder / WEIGHT_EDIT_MANIFEST, what="a `kvprobe weight-edit` manifest")
    if (folder / MEMORY_MANIFEST).exists():
        run.memory_manifest = json_object(folder / MEMORY_MANIFEST, what="a `kvprobe memory` manifest")
    if (folder / RANKING_RULE).exists():
        run.ranking_rule = json_object(folder / RANKING_RULE, what="a ranking rule")
    if (folder / TOPK_FILE).exists():
        try:
            run.topk_text = (folder / TOPK_FILE).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KvprobeError(f"{folder / TOPK_FILE} cannot be read as text ({getattr(exc, 'strerror', None) or exc})"
                               ) from None
        try:
            topk = yaml.safe_load(run.topk_text)
        except yaml.YAMLError:
            topk = None
        run.topk = topk if isinstance(topk, dict) else {}  # shown verbatim; its figures only when it parses
        version = run.topk.get("schema_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > max(READS):  # a newer kvprobe's
            check_version(folder / TOPK_FILE, version, "schema_version", READS, "")
    for name in dict.fromkeys(TABLES + tables):
        if (folder / name).exists():
            run.tables[name] = read_table(folder / name, NEEDS.get(name, ()))
    run.label = _label(run)
    return run


def _label(run: Run) -> str:
    spec = run.manifest.get("config", {}).get("model") or run.manifest.get("model", {}).get("spec")
    if not spec:
        m = run.compose_manifest.get("model")
        spec = m.get("spec") if isinstance(m, dict) else m
    for other in (run.weight_edit_manifest, run.memory_manifest):
        if not spec:
            m = other.get("model")
            spec = m.get("spec") if isinstance(m, dict) else m
    if not spec:
        for name in (COMPOSE, TTFT, SERVING, WEIGHT_EDITS, MEMORY):
            df = run.tables.get(name)
            if df is not None and "model" in df and len(df):
                spec = str(df["model"].iloc[0])
                break
    return str(spec or run.folder.name)


def load_runs(folders, tables: tuple[str, ...] = ()) -> list[Run]:
    """Load several folders (and ``tables``, as :func:`load_run`); labels made unique (the folder name is
    appended to repeats)."""
    runs = [load_run(f, tables) for f in folders]
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:
        if seen[r.label] > 1:
            r.label = f"{r.label} ({r.folder.name})"
    return runs
