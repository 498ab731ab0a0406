"""``kvprobe run``: validity, probes, the editor and the top-K export, into one results folder.

Stages, each resumable (per-case parts are kept under ``parts/``; a finished table is not
recomputed)::

    validity     prefill every case with both values; keep the valid ones
    probes       every registered probe the config names (kvprobe.probes.STAGES), in dependency
                 order (the built-in ones in kvprobe.catalog.PROBES's order)
    ranking      learn the causal ranking rule on half of the valid cases
    edits        every strategy on the valid cases; selective(K) sweeps on the held-out half
    compose      (with ``compose: N``) the composition gate on N queries, as ``kvprobe validate``
    topk         K* and the per-model YAML
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from kvprobe.composer.gate import run_compose, summarize_compose
from kvprobe.config import RunConfig, load_cases, settled
from kvprobe.datasets import Skip, align
from kvprobe.datasets.tokens import case_tokens
from kvprobe.editor.causal_rule import fit_rule
from kvprobe.editor.runner import edit_case
from kvprobe.editor.strategies import Selective
from kvprobe.editor.topk import export_topk, kinds_of_top
from kvprobe.errors import no_decision_case
from kvprobe.executor import Context, Serial
from kvprobe.experiment import Experiment
from kvprobe.models import load_model
from kvprobe.probes import STAGES, Inputs, in_order
from kvprobe.probes.engine import PairMemo, pair_memo
from kvprobe.probes.field_following import summarize, validity_row
from kvprobe.selection import Selection, prepare, split_holdout
from kvprobe.results import (
    COMPOSE,
    EDITS,
    RUN_MANIFEST,
    RANKING_RULE,
    RUN_CLAIM,
    TOKENS,
    VALIDITY,
    ResultsFolder,
    atomic_write_json,
    atomic_write_parquet,
    version_entry,
)


class Stopwatch:
    """The stopwatch and progress of one run's stages (not a registry: that is kvprobe.probes.STAGES):
    each stage's wall time, and per stage the seconds of each case computed in this session (a case
    resumed from its part has none)."""

    def __init__(self, progress: Callable[[str, int], Callable[[], None]]):
        self.progress = progress
        self.wall: dict[str, float] = {}
        self.case_s: dict[str, dict[str, float]] = {}

    def run(self, name: str, fn):
        start = time.perf_counter()
        out = fn()
        self.wall[name] = round(time.perf_counter() - start, 2)
        return out


def run_probes(cfg: RunConfig, lm, valid: list, folder: ResultsFolder, watch: Stopwatch,
               pairs: PairMemo | None = None, executor=None) -> dict[str, pd.DataFrame]:
    """Every registered probe the config names, in dependency order, into ``out``; their tables by name.

    A per-case probe keeps each finished case under ``parts/<name>/`` (an interrupted run resumes
    there) and runs its cases on ``executor`` (:mod:`kvprobe.executor`; serial by default); a probe
    across cases runs here and is not rerun once its table exists. ``pairs`` holds each case's
    caches, built once and handed to every probe (in each process that computes cases).
    """
    pairs = pairs or PairMemo(lm)
    executor = executor or Serial()
    ctx = Context(lm, pairs=pairs)
    out = folder.path
    tables: dict[str, pd.DataFrame] = {}
    stages = in_order(cfg.probes)
    last_reader = max((i for i, s in enumerate(stages) if s.residuals), default=None)  # then the streams can go
    for i, stage in enumerate(stages):
        probe = stage.build(Inputs(cfg.seed, cfg.model, tables, pairs))
        if stage.per_case:
            tick = watch.progress(stage.name, len(valid))
            table = watch.run(stage.name, lambda: executor.map(
                folder.parts(stage.name), [(a.case.case_id, a) for a in valid], _probe_case(probe), ctx, tick,
                watch.case_s.setdefault(stage.name, {})))
        elif (out / stage.table).exists():
            table = pd.read_parquet(out / stage.table)
        else:
            tick = watch.progress(stage.name, 1)
            table = watch.run(stage.name, lambda: probe.run(lm, valid))
            tick()
        tables[stage.name] = table
        if i == last_reader:
            pairs.drop_residuals()
        for file, df in {stage.table: table, **stage.derived(table)}.items():
            atomic_write_parquet(df, out / file)
    return tables


def _probe_case(probe):
    """A per-case probe's task: ``probe.run_case`` on the caches of the process that runs it."""
    return lambda ctx, a: probe.run_case(ctx.lm, a, pair_memo(ctx).get(a))


def run_experiment(cfg: RunConfig, out: Path | str) -> Experiment:
    """``kvprobe run`` as an :class:`~kvprobe.experiment.Experiment`: its folder claimed by config.json, which a
    rerun must match (with today's defaults filled in)."""
    return Experiment("run", out, RUN_CLAIM, cfg.model_dump(), settle=settled)


def open_run(exp: Experiment, cfg: RunConfig, load, cases=None, executor=None):
    """Every check of ``kvprobe run`` and its claim (:meth:`Experiment.open`): ``cases()`` the dataset's cases
    (default: ``cfg``'s), ``load()`` the model, ``executor()`` the executor (default: serial); the selection's
    alignment (:func:`kvprobe.selection.prepare`) pre-checks every case and strategy."""
    return exp.open(load, cases=cases or (lambda: load_cases(cfg)), executor=executor,
                    prepare=lambda lm, given: prepare(cfg, lm, given))


def run(cfg: RunConfig, out: Path | str, progress=None, lm=None, cases: list | None = None, executor=None,
        exp: Experiment | None = None) -> dict:
    """Run everything ``cfg`` asks for into ``out``; returns the manifest.

    Every input is checked before ``out`` is claimed or any model work starts (:func:`open_run`), unless
    ``exp`` comes opened (the command line opens it, to load the model with its own status line); ``lm``
    and ``cases`` are the model and the dataset's cases when the caller already has them. ``executor``
    (:mod:`kvprobe.executor`: serial by default, or Ray workers) computes the per-case stages.
    """
    watch = Stopwatch(progress or (lambda name, total: (lambda: None)))
    t0 = time.perf_counter()
    if exp is None or exp.opened is None:
        exp = exp or run_experiment(cfg, out)
        load = (lambda: lm) if lm is not None else (lambda: watch.run("load", lambda: load_model(
            cfg.model, dtype=cfg.dtype, device=cfg.device, device_map=cfg.device_map)))
        open_run(exp, cfg, load, cases=(lambda: cases) if cases is not None else None)
        if executor is not None:  # the caller's: left open on a refusal, as the caller closes it
            exp.opened.executor = executor
    out, folder = exp.out, exp.folder
    lm, sel, executor = exp.opened.lm, exp.opened.prepared, exp.opened.executor
    counted = executor.describe()  # the manifest records this run's own counts
    # each case's two caches (and residual streams, for a probe stage that reads them): prefilled
    # once, at validity, for every later stage
    pairs = PairMemo(lm, residuals=any(stage.residuals for stage in in_order(cfg.probes)))
    select_cases(cfg, lm, sel, folder, watch, pairs, executor)
    tables = run_probes(cfg, lm, sel.valid, folder, watch, pairs, executor)
    rule = learn_rule(cfg, tables.get("locality", pd.DataFrame()), sel, out)
    run_edits_stage(cfg, lm, sel, rule, folder, watch, pairs, executor)
    pairs.keep(())
    compose_summary = run_compose_stage(cfg, lm, folder, watch, executor)
    manifest = write_manifest(cfg, lm, sel, compose_summary, folder, {**watch.wall, "total": time.perf_counter() - t0},
                              run_profile(watch, sel, out), executor.describe(since=counted))
    if rule is not None:
        export_topk(out, threshold=cfg.threshold)
    return manifest


def select_cases(cfg: RunConfig, lm, sel: Selection, folder: ResultsFolder, watch: Stopwatch,
                 pairs: PairMemo | None = None, executor=None) -> Selection:
    """Check every aligned case's validity (resumable, on ``executor``), choose what is probed and
    edited; ``pairs`` keeps the caches of the chosen cases for the later stages."""
    pairs = pairs or PairMemo(lm)
    executor = executor or Serial()
    ctx = Context(lm, pairs=pairs)
    valid_only = cfg.valid_only

    def check(ctx, a) -> pd.DataFrame:
        row = validity_row(ctx.lm, a, pair_memo(ctx).get(a))
        if not (row["valid"] or (not valid_only and not row["control"])):
            pair_memo(ctx).drop(a.case.case_id)  # never probed nor edited
        return pd.DataFrame([row])

    sizing = cfg.sizing()
    tick = watch.progress("validity", len(sel.aligned))
    times = watch.case_s.setdefault("validity", {})
    if sizing is None:
        validity = watch.run("validity", lambda: executor.map(folder.parts("validity"), sel.aligned.items(), check,
                                                              ctx, tick, times))
    else:
        validity = watch.run("validity", lambda: _sized_validity(cfg, sel, folder, check, tick, times, sizing,
                                                                 executor, ctx))
    out = folder.path
    atomic_write_parquet(validity, out / VALIDITY)
    sel.validity = validity
    keep = validity.valid if cfg.valid_only else validity.valid | ~validity.control
    sel.valid_ids = sorted(validity[keep & ~validity.control].case_id) if len(validity) else []
    sel.control_ids = sorted(validity[validity.valid & validity.control].case_id) if len(validity) else []
    sel.n_valid_controls = len(sel.control_ids)
    if cfg.max_controls is not None and len(sel.control_ids) > cfg.max_controls:
        sel.control_ids = sorted(random.Random(cfg.seed).sample(sel.control_ids, cfg.max_controls))
    if not sel.valid_ids:
        raise no_decision_case(cfg.model, f" ({len(sel.aligned)} aligned cases); the probes need a model that decides "
                                          f"by the field (or set valid_only: false to probe it anyway)")
    sel.rank_ids, sel.held_ids = split_holdout(sel.valid_ids, cfg.holdout, cfg.seed)
    pairs.keep(sel.valid_ids + sel.control_ids)
    atomic_write_parquet(case_tokens(lm, sel.valid + sel.controls), out / TOKENS)
    return sel


def _sized_validity(cfg: RunConfig, sel: Selection, folder: ResultsFolder, check, tick, times: dict,
                    sizing: dict, executor, ctx: Context) -> pd.DataFrame:
    """Validity of the aligned cases in dataset order until the sized run's targets are met
    (:meth:`RunConfig.sizing`): a decision case once enough valid decision cases are found, and a
    control once enough valid controls are, is not checked. Records in ``sizing`` how many were
    checked and why the run stopped there.

    The rule is applied to the results in dataset order, as they are yielded, so an executor that
    computes cases ahead (Ray workers) checks the same cases as a serial run: a case it computed
    that the rule passes over is left out (a part on disk, counted as the executor's waste)."""
    want = {False: sizing["valid_decision"], True: sizing["valid_controls"]}
    got = {False: 0, True: 0}
    checked = []

    def wanted():  # the cases still asked for, as the executor draws them
        for key, a in sel.aligned.items():
            if all(got[c] >= want[c] for c in want):
                return
            if got[bool(a.case.control)] < want[bool(a.case.control)]:
                yield key, a

    for key, df, resumed in executor.each(folder.parts("validity"), wanted(), check, ctx, times):
        control = bool(sel.aligned[key].case.control)
        if got[control] >= want[control]:
            executor.wasted += not resumed  # drawn ahead while its side still needed cases (never serially)
            if got[not control] >= want[not control]:
                break
            continue
        checked.append(df)
        tick()
        row = df.iloc[0]
        got[control] += bool(row.valid if cfg.valid_only or control else True)
    reached = all(got[c] >= want[c] for c in want)
    sizing |= {"checked": len(checked), "valid_decision_found": got[False], "valid_controls_found": got[True],
               "stopped": "targets reached" if reached else "budget ran out"}
    if not reached:
        short = [f"{got[c]} valid {'controls' if c else 'decision cases'} of the {want[c]} needed"
                 for c in (False, True) if got[c] < want[c]]
        sizing["reason"] = (f"the budget ran out: the {len(sel.aligned)} aligned cases of the budget of {cfg.budget} "
                            f"held {' and '.join(short)}; a larger --budget (or a model that answers more cases "
                            f"right) can establish more")
    sel.sizing = sizing
    return pd.concat(checked, ignore_index=True) if checked else pd.DataFrame()


def learn_rule(cfg: RunConfig, locality: pd.DataFrame, sel: Selection, out: Path):
    """The causal ranking rule, learned on the ranking half only (None without a locality table)."""
    if not len(locality):
        return None
    rule = fit_rule(locality, {c: sel.aligned[c] for c in sel.rank_ids}, cfg.min_flip)
    held = [sel.aligned[c] for c in sel.held_ids]
    max_down = max((a.downstream[1] - a.downstream[0] for a in sel.valid), default=0)
    learned = rule.n_cases > 0  # an empty rule would rank by position alone: not causal
    note = None if learned else _unlearned_note(locality, sel.rank_ids, cfg.min_flip)
    atomic_write_json({"rule": {**rule.as_dict(), **({"note": note} if note else {})}, "ranking_cases": sel.rank_ids,
                       "held_out_cases": sel.held_ids, "kinds_at_top": kinds_of_top(rule, held, 8) if learned else {},
                       "max_downstream": max_down}, out / RANKING_RULE)
    return rule


def run_edits_stage(cfg: RunConfig, lm, sel: Selection, rule, folder: ResultsFolder, watch: Stopwatch,
                    pairs: PairMemo | None = None, executor=None) -> pd.DataFrame:
    """Every strategy on the valid cases (and controls), per CoT budget, on ``executor``; the K sweep
    on the held-out half. Without CoT a case starts from its old cache in ``pairs`` (kept from
    validity, in the process that checked it; another process builds it again, the same numbers)."""
    executor = executor or Serial()
    ctx = Context(lm, pairs=pairs) if pairs is not None else Context(lm)
    learned = rule is not None and rule.n_cases > 0
    base = cfg.edit_strategies()
    rankings = [r for r in cfg.rankings if r != "causal" or learned]
    held = set(sel.held_ids)
    edit_items = [(f"{a.case.case_id}.cot{c}", (a, c)) for a in sel.valid + sel.controls for c in cfg.cot]
    tick = watch.progress("edits", len(edit_items))

    def edit_one(ctx, item):
        a, cot = item
        sweep = []
        if a.case.case_id in held and cot == 0:
            n_down = a.downstream[1] - a.downstream[0]
            sweep = [Selective(k, r) for k in cfg.ks if k <= n_down for r in rankings]
        case = a if cot == 0 else align(a.case.model_copy(update={"cot": True}), ctx.lm.tokenizer, cfg.form)
        if isinstance(case, Skip):
            return pd.DataFrame()
        old_cache = pair_memo(ctx).get(a).old if cot == 0 else None
        return edit_case(ctx.lm, case, base, cot, cfg.min_flip, ranking=rule, seed=cfg.seed, model_name=cfg.model,
                         old_cache=old_cache, sweep=sweep)

    edits = watch.run("edits", lambda: executor.map(folder.parts("edits"), edit_items, edit_one, ctx, tick,
                                                    watch.case_s.setdefault("edits", {})))
    if not learned and "ranking" in edits:  # parts stored by a version that ranked with an empty rule
        edits = edits[edits.ranking.ne("causal")]
    atomic_write_parquet(edits, folder.path / EDITS)
    return edits


def run_compose_stage(cfg: RunConfig, lm, folder: ResultsFolder, watch: Stopwatch, executor=None) -> list[dict]:
    """With ``compose: N``, the composition gate on N queries (as ``kvprobe validate``); its summary rows."""
    if not cfg.compose:
        return []

    tick = watch.progress("compose", cfg.compose)
    composed = watch.run("compose", lambda: run_compose(
        lm, n=cfg.compose, seed=cfg.seed, seams=cfg.compose_seams, form=cfg.form, store_dir=folder.path / "blocks",
        model_name=cfg.model, parts=folder.parts("compose"), on_query=tick, executor=executor))
    atomic_write_parquet(composed, folder.path / COMPOSE)
    return summarize_compose(composed).to_dict("records")


def run_profile(watch: Stopwatch, sel: Selection, out: Path) -> dict:
    """What the run cost, in prefill-equivalents: each stage's time over one full prefill of a
    prompt, measured in the same run (the oracle's repair: a prefill of the new prompt's [0, D),
    median over the valid cases). ``per_valid_case``: stage time / valid decision cases / that;
    ``cases``: per stage, each case computed in this session (a resumed case has no time)."""
    edits = pd.read_parquet(out / EDITS) if (out / EDITS).exists() else pd.DataFrame()
    if edits.empty or "wall_s" not in edits:
        return {}
    oracle = edits[(edits.strategy == "oracle") & (edits.cot == 0) & edits.case_id.isin(sel.valid_ids)].wall_s
    prefill_s = float(oracle.median()) if len(oracle) else float("nan")
    n = len(sel.valid_ids)
    if not n or not prefill_s > 0:
        return {}
    profiled = ("validity", *STAGES, "edits", "compose")  # every registered probe, in registration order
    per = {st: round(watch.wall[st] / n / prefill_s, 3) for st in profiled if st in watch.wall}
    return {"prefill_s": round(prefill_s, 4), "valid_cases": n, "per_valid_case": per,
            "total_per_valid_case": round(sum(per.values()), 3),
            "cases": {st: {key: round(sec / prefill_s, 3) for key, sec in times.items()}
                      for st, times in watch.case_s.items() if times}}


def write_manifest(cfg: RunConfig, lm, sel: Selection, compose_summary: list[dict], folder: ResultsFolder,
                   wall_s: dict[str, float], profile: dict | None = None, executor: dict | None = None) -> dict:
    """manifest.json: config, model fingerprint, versions, counts and skip reasons, wall time per
    stage, the run's cost in prefill-equivalents (:func:`run_profile`) and how its cases were
    computed (``executor``: :meth:`kvprobe.executor.Serial.describe`; not part of the claim)."""
    validity = sel.validity
    counts = {"cases": len(sel.cases), "aligned": len(sel.aligned), "checked": len(validity),
              "probed_decision": len(sel.valid_ids),
              "valid_decision": int((validity.valid & ~validity.control).sum()),
              "valid_control": sel.n_valid_controls, "edited_controls": len(sel.control_ids),
              "ranking_cases": len(sel.rank_ids), "held_out_cases": len(sel.held_ids),
              "skipped": len(sel.skipped), "invalid": int((~validity.valid).sum())}
    manifest = folder.manifest(
        lm, **version_entry(RUN_MANIFEST), config=cfg.model_dump(), n_layers=lm.adapter.n_layers,
        n_heads=lm.adapter.n_heads, n_kv_heads=lm.adapter.n_kv_heads, seed=cfg.seed, counts=counts,
        skipped=[{"case_id": s.case_id, "reason": s.reason} for s in sel.skipped],
        invalid_reasons=_invalid_reasons(validity), validity=summarize(validity) if len(validity) else {},
        compose=compose_summary, sizing=sel.sizing, tables=sorted(p.name for p in folder.path.glob("*.parquet")),
        wall_s={k: round(v, 2) for k, v in wall_s.items()}, prefill_equivalents=profile or {},
        executor=executor or {"executor": "serial", "workers": 1})
    folder.write(RUN_MANIFEST, manifest)
    return manifest


def _unlearned_note(locality: pd.DataFrame, rank_ids: list[str], min_flip: float) -> str:
    """Why the causal ranking rule has no training case, and what to change."""
    flips = locality[locality.case_id.isin(rank_ids)].oracle_flip.abs()
    largest = f"; the largest is {flips.max():.2f}" if len(flips) else ""
    return (f"no causal ranking rule: none of the {len(rank_ids)} ranking cases has an oracle flip of at least "
            f"min_flip={min_flip:g} logits{largest}. A run with a lower --min-flip (into a new folder) learns from "
            f"smaller flips")


def _invalid_reasons(validity: pd.DataFrame) -> dict:
    if validity.empty:
        return {}
    bad = validity[~validity.valid]
    words = {(False, True): "wrong under the old value", (True, False): "wrong under the new value",
             (False, False): "wrong under both values", (True, True): "no decision"}
    reasons = [words[(bool(o), bool(n))] for o, n in zip(bad.correct_old, bad.correct_new)]
    return pd.Series(reasons, dtype=object).value_counts().to_dict()
