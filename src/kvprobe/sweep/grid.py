"""``kvprobe sweep``: a grid of prompt layouts x downstream lengths (x any layout knob) for one model.

Each cell generates its own cases (same seed, same domains, only the layout knobs differ), aligns
them, and measures them one by one (:func:`kvprobe.sweep.measure.measure_case`) until it has
``valid`` valid decision cases or has screened ``n``. Cases go in a fixed order, so a rerun takes
the same ones. Resumable: each finished case is a part under ``parts/<cell>/``; a finished cell is
recorded in the manifest and not rerun. Outputs::

    sweep_config.json     the settings (a folder with other settings is refused)
    sweep.parquet         one row per cell x case x measure (the cell's knobs + kvprobe.sweep.measure.COLUMNS)
    sweep_summary.parquet one row per cell x measure, with 95% CIs (kvprobe.sweep.summary)
    sweep_manifest.json   model fingerprint, versions, per-cell counts and seconds, verdicts, total time
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from kvprobe.datasets import Skip, align, generate
from kvprobe.datasets.generate import MAX_FILLER_TOKENS, RULE_STYLES
from kvprobe.datasets.layouts import FIELD_STYLES, LAYOUTS
from kvprobe.defaults import (
    DEFAULT_FORM,
    DEFAULT_MIN_FLIP,
    SWEEP_FILLER_TOKENS,
    SWEEP_LAYOUTS,
    SWEEP_STRATEGIES,
    checked_form,
)
from kvprobe.editor.auto import check_policies
from kvprobe.editor.strategies import Strategy, parse_strategy
from kvprobe.errors import CheckFailed
from kvprobe.executor import Context
from kvprobe.experiment import Experiment
from kvprobe.config import precheck_cases
from kvprobe.results import (SWEEP, SWEEP_CLAIM, SWEEP_MANIFEST, SWEEP_SUMMARY, atomic_write_parquet,
                             version_entry)
from kvprobe.sweep.measure import measure_case
from kvprobe.sweep.summary import (
    CELL_KEYS,
    RULE,
    cell_verdicts,
    layout_verdicts,
    summarize,
)


class SweepConfig(BaseModel):
    """Everything that defines a sweep (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    layouts: list[str] = list(SWEEP_LAYOUTS)
    filler_tokens: list[int] = list(SWEEP_FILLER_TOKENS)
    field_styles: list[str] = ["key"]
    rule_styles: list[str] = ["allow"]
    n: int = Field(40, ge=1)  # cases screened per cell at most
    valid: int | None = Field(None, ge=1)  # stop a cell once it has this many valid decision cases
    seed: int = 0
    controls: float = Field(0.0, ge=0, le=1)
    form: str = DEFAULT_FORM
    strategies: list[str] = list(SWEEP_STRATEGIES)
    min_flip: float = Field(DEFAULT_MIN_FLIP, ge=0)
    dtype: str = "float32"
    device: str = "cpu"
    time_all: bool = False  # run (and time) stale, field_only and oracle instead of reading them off the patches
    _typed: tuple | None = PrivateAttr(None)  # (labels, typed strategies): see edit_strategies

    def settings(self) -> dict:
        """The settings a folder is claimed with (``time_all`` only when set, so older folders resume)."""
        out = self.model_dump()
        if not out["time_all"]:
            del out["time_all"]
        return out

    @field_validator("layouts", "field_styles", "rule_styles")
    @classmethod
    def _known(cls, v: list[str], info) -> list[str]:
        accepted = {"layouts": LAYOUTS, "field_styles": FIELD_STYLES, "rule_styles": RULE_STYLES}[info.field_name]
        bad = [x for x in v if x not in accepted]
        if bad or not v:
            raise ValueError(f"unknown {info.field_name} {bad or '(none given)'}; accepted: {', '.join(accepted)}")
        return list(dict.fromkeys(v))

    @field_validator("filler_tokens")
    @classmethod
    def _lengths(cls, v: list[int]) -> list[int]:
        if not v or min(v) < 0 or max(v) > MAX_FILLER_TOKENS:
            raise ValueError(f"filler_tokens must be a non-empty list of lengths in [0, {MAX_FILLER_TOKENS}], got {v}")
        return sorted(set(v))

    @field_validator("controls")
    @classmethod
    def _controls(cls, v: float, info) -> float:
        n = info.data.get("n")  # validated before controls
        if n is not None and round(n * v) >= n:
            raise ValueError(f"{v:g} makes every one of the {n} cases of a cell a negative control "
                             f"(round({n} x {v:g}) = {round(n * v)}); a sweep measures decision cases: give a smaller "
                             f"fraction")
        return v

    @field_validator("form")
    @classmethod
    def _form(cls, v: str) -> str:
        return checked_form(v)

    @model_validator(mode="after")
    def _typed_strategies(self) -> "SweepConfig":
        """Parse the strategy specs once, here at the edge: ``strategies`` becomes their labels (what
        ``model_dump()`` and sweep_config.json hold) and the typed list is held beside them."""
        typed = tuple(parse_strategy(s) for s in self.strategies)
        self.strategies = [s.label for s in typed]
        self._typed = tuple(self.strategies), typed
        return self

    def edit_strategies(self) -> list[Strategy]:
        """The sweep's strategies, typed (parsed once, at validation)."""
        if self._typed is None or self._typed[0] != tuple(self.strategies):  # changed since validation
            self._typed = tuple(self.strategies), tuple(parse_strategy(s) for s in self.strategies)
        return list(self._typed[1])

    def cells(self) -> list[dict]:
        """The grid, layout-major: one dict of knobs (and its id) per cell."""
        out = []
        for layout, tokens, style, rule in itertools.product(self.layouts, self.filler_tokens, self.field_styles,
                                                             self.rule_styles):
            out.append({"cell": f"{layout}.f{tokens}.{style}.{rule}", "layout": layout, "filler_tokens": tokens,
                        "field_style": style, "rule_style": rule})
        return out


def cell_cases(cfg: SweepConfig, cell: dict) -> list:
    """The cases of one cell, generated with the cell's knobs (ids carry the cell)."""
    cases = generate(cfg.n, seed=cfg.seed, controls=cfg.controls, layout=cell["layout"],
                     filler_tokens=cell["filler_tokens"], field_style=cell["field_style"],
                     rule_style=cell["rule_style"])
    return [c.model_copy(update={"case_id": f"{cell['cell']}.{c.case_id}"}) for c in cases]


def sweep_experiment(cfg: SweepConfig, out: Path | str) -> Experiment:
    """``kvprobe sweep`` as an :class:`~kvprobe.experiment.Experiment`, claimed by sweep_config.json."""
    return Experiment("sweep", out, SWEEP_CLAIM, cfg.settings(), held="sweep with other settings")


def prepare_cells(cfg: SweepConfig, lm) -> list[tuple[dict, list, list]]:
    """Every cell's cases aligned and pre-checked (``(cell, aligned, skipped)`` per cell), before the folder is
    claimed or any forward pass runs; a sweep where no case aligns, or an ``auto:PATH`` of another model, is
    refused here."""
    strategies, prepared = cfg.edit_strategies(), []
    for cell in cfg.cells():
        aligned, skipped = [], []
        for case in cell_cases(cfg, cell):
            a = align(case, lm.tokenizer, cfg.form)
            (skipped if isinstance(a, Skip) else aligned).append(a)
        precheck_cases(lm, aligned, strategies, [], cfg.form)  # run's: the window, each strategy against each case
        prepared.append((cell, aligned, skipped))
    if not any(aligned for _, aligned, _ in prepared):
        reasons = pd.Series([s.reason for _, _, skipped in prepared for s in skipped]).value_counts()
        raise CheckFailed(f"no case of the sweep aligns under {cfg.model}'s tokenizer (most often: "
                          f"{reasons.index[0] if len(reasons) else 'no cases'}); try another --form or layout")
    check_policies(strategies, lm)  # an auto:PATH of another model fails here, not once per case
    return prepared


def open_sweep(exp: Experiment, cfg: SweepConfig, load, executor=None):
    """Every check of ``kvprobe sweep`` and its claim (:meth:`Experiment.open`): each cell's cases, keyed
    ``cell/case_id``."""
    return exp.open(load, executor=executor, prepare=lambda lm, _: prepare_cells(cfg, lm),
                    items=lambda o: {f"{cell['cell']}/{a.case.case_id}": a.case
                                     for cell, aligned, _ in o.prepared for a in aligned})


def run_sweep(cfg: SweepConfig, lm=None, out: Path | str | None = None,
              progress: Callable[[str, int], Callable[[], None]] | None = None, executor=None,
              exp: Experiment | None = None) -> dict:
    """Every cell of ``cfg`` into ``out``; a case measured by an earlier, interrupted invocation is read
    from its part, not redone. ``executor`` (:mod:`kvprobe.executor`; serial by default) measures
    the cases; a cell that stops at ``cfg.valid`` stops at the same case either way (results are
    read in the cell's order). ``exp``, when it comes opened (:func:`open_sweep`), gives the model, the
    executor and the prepared cells. Returns the manifest."""
    if exp is None or exp.opened is None:
        exp = exp or sweep_experiment(cfg, out)
        open_sweep(exp, cfg, lambda: lm)
        if executor is not None:  # the caller's: left open on a refusal, as the caller closes it
            exp.opened.executor = executor
    lm, executor, prepared = exp.opened.lm, exp.opened.executor, exp.opened.prepared
    counted = executor.describe()  # the manifest records this sweep's own counts
    ctx, out, folder = Context(lm), exp.out, exp.folder
    progress = progress or (lambda name, total: (lambda: None))
    strategies = cfg.edit_strategies()
    frames, record = [], {}
    t_start = time.perf_counter()
    min_flip, derive = cfg.min_flip, not cfg.time_all

    def measure(ctx, a) -> pd.DataFrame:
        return measure_case(ctx.lm, a, strategies, min_flip, derive=derive)

    for cell, aligned, skipped in prepared:
        tick = progress(cell["cell"], cfg.valid or len(aligned))
        rows, n_valid, resumed = [], 0, 0
        todo = ((a.case.case_id, a) for a in aligned)
        for _, df, was_done in executor.each(folder.parts(f"cells/{cell['cell']}"), todo, measure, ctx):
            resumed += was_done
            rows.append(df)
            is_valid = bool(df.valid.iloc[0]) and not bool(df.control.iloc[0])
            n_valid += is_valid
            if cfg.valid is None or is_valid:
                tick()
            if cfg.valid is not None and n_valid >= cfg.valid:
                break
        table = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()
        if len(table):
            knobs = list(CELL_KEYS)
            table = table.assign(**{k: cell[k] for k in knobs})[knobs + [c for c in table if c not in knobs]]
        frames.append(table)
        cases = table.drop_duplicates("case_id") if len(table) else table
        record[cell["cell"]] = {
            **{k: cell[k] for k in ("layout", "filler_tokens", "field_style", "rule_style")},
            "screened": len(cases), "resumed": resumed, "aligned": len(aligned), "skipped": len(skipped),
            "valid_decision": n_valid, "reached_valid": cfg.valid is None or n_valid >= cfg.valid,
            "wall_s": round(float(cases.case_s.sum()), 1) if len(cases) else 0.0,  # summed from the parts: resume-proof
            "skip_reasons": pd.Series([s.reason.split(":")[0] for s in skipped]).value_counts().to_dict(),
        }
    rows = pd.concat([f for f in frames if len(f)], ignore_index=True)
    rows.insert(0, "model", cfg.model)
    atomic_write_parquet(rows, out / SWEEP)
    summary = summarize(rows)
    atomic_write_parquet(summary, out / SWEEP_SUMMARY)
    verdicts = cell_verdicts(summary)
    manifest = folder.manifest(
        lm, **version_entry(SWEEP_MANIFEST), config=cfg.model_dump(), cells=record,
        cell_verdicts=dict(zip(verdicts.cell, verdicts.verdict)), layout_verdicts=layout_verdicts(verdicts),
        verdict_rule=RULE, executor=executor.describe(since=counted),
        wall_s={"cells": round(sum(c["wall_s"] for c in record.values()), 1),
                "this_invocation": round(time.perf_counter() - t_start, 1)})
    folder.write(SWEEP_MANIFEST, manifest)
    return manifest
