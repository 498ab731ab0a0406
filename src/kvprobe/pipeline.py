"""``kvprobe run``: validity, probes, the editor and the top-K export, into one results folder.

Stages, each resumable (per-case parts are kept under ``parts/``; a finished table is not
recomputed)::

    validity     prefill every case with both values; keep the valid ones
    probes       every registered probe the config names (kvprobe.probes.STAGES), in dependency
                 order: locality, attention, knockout, linear
    ranking      learn the causal ranking rule on half of the valid cases
    edits        every strategy on the valid cases; selective(K) sweeps on the held-out half
    compose      (with ``compose: N``) the composition gate on N queries, as ``kvprobe validate``
    topk         K* and the per-model YAML
"""

from __future__ import annotations

import hashlib
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvprobe.composer.gate import run_compose, summarize_compose
from kvprobe.datasets import ERRATUM, ERRATUM_TEMPLATES, Skip, align, require_answers, resolve_dataset
from kvprobe.datasets.tokens import case_tokens
from kvprobe.defaults import (DEFAULT_FORM, DEFAULT_MIN_FLIP, DEFAULT_MODEL, DEFAULT_N, DEFAULT_STRATEGIES,
                              checked_form)
from kvprobe.editor.causal_rule import fit_rule
from kvprobe.editor.rankings import RANKINGS
from kvprobe.editor.runner import edit_case
from kvprobe.editor.strategies import Strategy, parse_strategy
from kvprobe.editor.topk import export_topk, kinds_of_top
from kvprobe.errors import CheckFailed, KvprobeError
from kvprobe.models import load_model
from kvprobe.probes import STAGES, Inputs, in_order
from kvprobe.probes.engine import PairMemo
from kvprobe.probes.field_following import check_case, summarize
from kvprobe.results import (
    COMPOSE,
    EDITS,
    MANIFEST,
    RANKING_RULE,
    RUN_CLAIM,
    TOKENS,
    VALIDITY,
    CaseStore,
    atomic_write_json,
    atomic_write_parquet,
    claim_folder,
    claim_inputs,
    version_entry,
)

ALL_PROBES = tuple(STAGES)  # every registered probe, in registration order


class RunConfig(BaseModel):
    """Everything that defines a run (loadable from YAML; unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")

    model: str = DEFAULT_MODEL
    dataset: str = "default"
    n: int = Field(DEFAULT_N, ge=1)
    seed: int = 0
    form: str = DEFAULT_FORM
    few_shot: int = Field(0, ge=0)
    probes: list[str] = list(ALL_PROBES)
    strategies: list[str] = list(DEFAULT_STRATEGIES)
    ks: list[int] = [1, 2, 4, 8, 16, 32, 64, 128]
    rankings: list[str] = ["causal", "random", "attention"]
    cot: list[int] = [0]
    min_flip: float = Field(DEFAULT_MIN_FLIP, ge=0)
    holdout: float = Field(0.5, gt=0, lt=1)
    valid_only: bool = True  # False: probe every aligned decision case (e.g. a model that does not decide)
    max_controls: int | None = Field(None, ge=0)  # valid controls carried into the edits (a seeded sample); None = all
    erratum_template: str = ERRATUM  # what an erratum strategy without its own template uses
    compose: int = Field(0, ge=0)  # composition-gate queries (kvprobe validate's table); 0 = skip
    compose_seams: list[int] = [0, 1, 4]
    dtype: str = "float32"  # float32 (exact tables), bfloat16 or float16
    device: str = "cpu"  # cpu, cuda, cuda:N
    device_map: str | None = None  # "auto": spread a model larger than one device (accelerate); overrides device

    @field_validator("probes")
    @classmethod
    def _probes(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if p not in STAGES]  # read at validation time: a probe registered later counts
        if bad:
            raise ValueError(f"unknown probe(s) {bad}; accepted: {', '.join(STAGES)}")
        return v

    @field_validator("form")
    @classmethod
    def _form(cls, v: str) -> str:
        return checked_form(v)

    @field_validator("cot")
    @classmethod
    def _cot(cls, v: list[int]) -> list[int]:
        if not v or min(v) < 0:
            raise ValueError(f"cot must be a non-empty list of token budgets >= 0 (0 = no chain-of-thought), got {v}")
        return sorted(set(v))

    @field_validator("strategies")
    @classmethod
    def _strategies(cls, v: list[str]) -> list[str]:
        for s in v:
            parse_strategy(s)
        return v

    @field_validator("erratum_template")
    @classmethod
    def _erratum_template(cls, v: str) -> str:
        """A name ("paper", "short") becomes its template, the literal that topk.yaml hands to serving."""
        return ERRATUM_TEMPLATES.get(v, v)

    @field_validator("compose_seams")
    @classmethod
    def _seams(cls, v: list[int]) -> list[int]:
        if not v or min(v) < 0:
            raise ValueError(f"compose_seams must be a non-empty list of integers >= 0, got {v}")
        return sorted(set(v))

    @field_validator("rankings")
    @classmethod
    def _rankings(cls, v: list[str]) -> list[str]:
        bad = [r for r in v if r not in RANKINGS]
        if bad:
            raise ValueError(f"unknown ranking(s) {bad}; accepted: {', '.join(RANKINGS)}")
        return v

    def edit_strategies(self) -> list[Strategy]:
        """The configured strategies, typed; an erratum given without a template gets ``erratum_template``."""
        return [parse_strategy(s, template=self.erratum_template) for s in self.strategies]

    @classmethod
    def from_yaml(cls, path: Path | str, **overrides) -> "RunConfig":
        """The config in a YAML file (a mapping of RunConfig keys), with ``overrides`` (command-line
        flags) on top. A bad file is a :class:`KvprobeError` naming it; a bad override, a :class:`UsageError`."""
        from pydantic import ValidationError

        from kvprobe.errors import UsageError

        keys = ", ".join(cls.model_fields)
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise KvprobeError(f"config file not found: {path}") from None
        except IsADirectoryError:
            raise KvprobeError(f"config {path} is a folder; give a YAML file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise KvprobeError(f"config {path} cannot be read ({exc.strerror if isinstance(exc, OSError) else exc})"
                               ) from None
        except yaml.YAMLError as exc:
            raise KvprobeError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            kind = {list: "a list", str: "a single string", int: "a single number", float: "a single number",
                    bool: "a single boolean"}.get(type(data), f"a {type(data).__name__}")
            raise KvprobeError(f"{path} holds {kind}; a run config is a mapping of RunConfig keys ({keys})")
        bad = [k for k in data if not isinstance(k, str)]
        if bad:
            raise KvprobeError(f"{path}: key {bad[0]!r} is not a name; a run config is a mapping of RunConfig keys "
                               f"({keys})")
        try:
            return cls(**{**data, **overrides})
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(map(str, err["loc"]))
            if err["loc"] and err["loc"][0] in overrides:  # a flag is at fault, not the file
                raise UsageError.from_validation(exc, "run") from None
            hint = f"; accepted keys: {keys}" if err["type"] == "extra_forbidden" else ""
            raise KvprobeError(f"{path}: {loc}: {err['msg']}{hint}") from None
        except KvprobeError as exc:  # a validator's own one-line error (a bad strategy spec)
            if "strategies" in overrides:
                raise
            raise KvprobeError(f"{path}: {exc}") from None


def settled(previous: dict) -> dict | None:
    """A stored config with today's defaults filled in (so a field added since still matches);
    None when it no longer validates."""
    try:
        return RunConfig(**previous).model_dump()
    except (ValueError, TypeError):
        return None


def package_versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("kvprobe", "torch", "transformers", "pandas", "scikit-learn", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def split_holdout(case_ids: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Deterministic split by hashed case id: (ranking cases, held-out cases); both non-empty when possible."""
    keyed = sorted(case_ids, key=lambda c: hashlib.sha256(f"{seed}:{c}".encode()).hexdigest())
    n_hold = min(len(keyed) - 1, max(1, round(fraction * len(keyed)))) if len(keyed) > 1 else 0
    return sorted(keyed[n_hold:]), sorted(keyed[:n_hold])


class Stages:
    """Timing and progress of the stages of one run: each stage's wall time, and per stage the
    seconds of each case computed in this session (a case resumed from its part has none)."""

    def __init__(self, progress: Callable[[str, int], Callable[[], None]]):
        self.progress = progress
        self.wall: dict[str, float] = {}
        self.case_s: dict[str, dict[str, float]] = {}

    def run(self, name: str, fn):
        start = time.perf_counter()
        out = fn()
        self.wall[name] = round(time.perf_counter() - start, 2)
        return out


def _per_case(store: CaseStore, items, fn, tick, times: dict[str, float] | None = None) -> pd.DataFrame:
    """``fn`` over the items whose part is not in ``store`` yet (the others are loaded), each part
    saved as it is done; ``times`` gets the seconds of each computed one."""
    frames = []
    for key, item in items:
        if store.done(key):
            frames.append(store.load(key))
        else:
            start = time.perf_counter()
            df = fn(item)
            if times is not None:
                times[key] = time.perf_counter() - start
            store.save(key, df)
            frames.append(df)
        tick()
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def run_probes(cfg: RunConfig, lm, valid: list, out: Path, stages: Stages, pairs: PairMemo | None = None
               ) -> dict[str, pd.DataFrame]:
    """Every registered probe the config names, in dependency order, into ``out``; their tables by name.

    A per-case probe keeps each finished case under ``parts/<name>/`` (an interrupted run resumes
    there); a probe across cases is not rerun once its table exists. ``pairs`` holds each case's
    caches, built once and handed to every probe.
    """
    pairs = pairs or PairMemo(lm)
    tables: dict[str, pd.DataFrame] = {}
    for stage in in_order(cfg.probes):
        probe = stage.build(Inputs(cfg.seed, cfg.model, tables, pairs))
        if stage.per_case:
            tick = stages.progress(stage.name, len(valid))
            table = stages.run(stage.name, lambda: _per_case(
                CaseStore(out, stage.name), [(a.case.case_id, a) for a in valid],
                lambda a: probe.run_case(lm, a, pairs.get(a)), tick, stages.case_s.setdefault(stage.name, {})))
        elif (out / stage.table).exists():
            table = pd.read_parquet(out / stage.table)
        else:
            tick = stages.progress(stage.name, 1)
            table = stages.run(stage.name, lambda: probe.run(lm, valid))
            tick()
        tables[stage.name] = table
        if stage.name == "linear":
            pairs.drop_residuals()
        for file, df in {stage.table: table, **stage.derived(table)}.items():
            atomic_write_parquet(df, out / file)
    return tables


@dataclass
class Selection:
    """The run's cases: generated or loaded, aligned, checked for validity, and split."""

    cases: list
    aligned: dict  # case_id -> AlignedCase
    skipped: list  # Skip, one per case that does not align
    validity: pd.DataFrame = field(default_factory=pd.DataFrame)
    valid_ids: list[str] = field(default_factory=list)  # the decision cases probed and edited
    control_ids: list[str] = field(default_factory=list)  # the valid controls edited (a seeded sample)
    n_valid_controls: int = 0
    rank_ids: list[str] = field(default_factory=list)  # learn the causal ranking rule on these
    held_ids: list[str] = field(default_factory=list)  # and judge it (the K sweep) on these

    @property
    def valid(self) -> list:
        return [self.aligned[c] for c in self.valid_ids]

    @property
    def controls(self) -> list:
        return [self.aligned[c] for c in self.control_ids]


def run(cfg: RunConfig, out: Path | str, progress=None, lm=None, cases: list | None = None) -> dict:
    """Run everything ``cfg`` asks for into ``out``; returns the manifest.

    Every input is checked before ``out`` is claimed or any model work starts (:func:`prepare`);
    ``cases`` are the dataset's cases when the caller already resolved them.
    """
    out = Path(out)
    stages = Stages(progress or (lambda name, total: (lambda: None)))
    t0 = time.perf_counter()

    cases = cases if cases is not None else load_cases(cfg)
    require_answers(cases, "kvprobe run")
    lm = lm or stages.run("load", lambda: load_model(cfg.model, dtype=cfg.dtype, device=cfg.device,
                                                     device_map=cfg.device_map))
    sel = prepare(cfg, lm, cases)
    out.mkdir(parents=True, exist_ok=True)
    claim_folder(out, RUN_CLAIM, cfg.model_dump(), settle=settled)
    claim_inputs(out, lm, cases)
    # each case's two caches (and residual streams, for the linear probe): prefilled once, at
    # validity, for every later stage
    pairs = PairMemo(lm, residuals="linear" in cfg.probes)
    select_cases(cfg, lm, sel, out, stages, pairs)
    tables = run_probes(cfg, lm, sel.valid, out, stages, pairs)
    rule = learn_rule(cfg, tables.get("locality", pd.DataFrame()), sel, out)
    run_edits_stage(cfg, lm, sel, rule, out, stages, pairs)
    pairs.keep(())
    compose_summary = run_compose_stage(cfg, lm, out, stages)
    manifest = write_manifest(cfg, lm, sel, compose_summary, out, {**stages.wall, "total": time.perf_counter() - t0},
                              run_profile(stages, sel, out))
    if rule is not None:
        export_topk(out)
    return manifest


def load_cases(cfg: RunConfig) -> list:
    """The run's dataset: generated (``default``) or read from a JSONL file, checked line by line."""
    kwargs = {"few_shot": cfg.few_shot} if cfg.dataset == "default" else {}
    return resolve_dataset(cfg.dataset, n=cfg.n, seed=cfg.seed, **kwargs)


def prepare(cfg: RunConfig, lm, cases: list) -> Selection:
    """Align every case and check, before any model work, what would otherwise fail late: every
    case's length (with its chain-of-thought budget) against the model's window, and every
    configured strategy against every case (a selective K against its downstream span, an
    erratum prompt's length)."""
    sel = Selection(cases, {}, [])
    for case in cases:
        a = align(case, lm.tokenizer, cfg.form)
        if isinstance(a, Skip):
            sel.skipped.append(a)
        else:
            sel.aligned[case.case_id] = a
    check_cases(lm, list(sel.aligned.values()), cfg.edit_strategies(), cfg.cot, cfg.form)
    return sel


def check_cases(lm, aligned: list, strategies: list[Strategy], cot: list[int], form: str) -> None:
    """One-line errors, before any forward pass, for a case over the window or a strategy that cannot repair it."""
    longest = max(cot, default=0)
    for a in aligned:
        lm.check_length(max(len(a.ids_old), len(a.ids_new)), f"case {a.case.case_id}")
        with_cot = align(a.case.model_copy(update={"cot": True}), lm.tokenizer, form) if longest else None
        if with_cot is not None and not isinstance(with_cot, Skip):
            lm.check_length(len(with_cot.ids_new) + longest,
                            f"case {a.case.case_id} with a chain-of-thought budget of {longest} tokens")
        for s in strategies:
            s.check(lm, a)


def select_cases(cfg: RunConfig, lm, sel: Selection, out: Path, stages: Stages, pairs: PairMemo | None = None
                 ) -> Selection:
    """Check every aligned case's validity (resumable), choose what is probed and edited; ``pairs``
    keeps the caches of the chosen cases for the later stages."""
    pairs = pairs or PairMemo(lm)

    def check(a) -> pd.DataFrame:
        row = check_case(lm, a, pairs.get(a))
        if not (row["valid"] or (not cfg.valid_only and not row["control"])):
            pairs.drop(a.case.case_id)  # never probed nor edited
        return pd.DataFrame([row])

    tick = stages.progress("validity", len(sel.aligned))
    validity = stages.run("validity", lambda: _per_case(CaseStore(out, "validity"), sel.aligned.items(), check, tick,
                                                        stages.case_s.setdefault("validity", {})))
    atomic_write_parquet(validity, out / VALIDITY)
    sel.validity = validity
    keep = validity.valid if cfg.valid_only else validity.valid | ~validity.control
    sel.valid_ids = sorted(validity[keep & ~validity.control].case_id) if len(validity) else []
    sel.control_ids = sorted(validity[validity.valid & validity.control].case_id) if len(validity) else []
    sel.n_valid_controls = len(sel.control_ids)
    if cfg.max_controls is not None and len(sel.control_ids) > cfg.max_controls:
        sel.control_ids = sorted(random.Random(cfg.seed).sample(sel.control_ids, cfg.max_controls))
    if not sel.valid_ids:
        raise CheckFailed(f"{cfg.model} answered no decision case correctly under both values "
                          f"({len(sel.aligned)} aligned cases); the probes need a model that decides by the field "
                          f"(or set valid_only: false to probe it anyway)")
    sel.rank_ids, sel.held_ids = split_holdout(sel.valid_ids, cfg.holdout, cfg.seed)
    pairs.keep(sel.valid_ids + sel.control_ids)
    atomic_write_parquet(case_tokens(lm, sel.valid + sel.controls), out / TOKENS)
    return sel


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


def run_edits_stage(cfg: RunConfig, lm, sel: Selection, rule, out: Path, stages: Stages,
                    pairs: PairMemo | None = None) -> pd.DataFrame:
    """Every strategy on the valid cases (and controls), per CoT budget; the K sweep on the held-out half.
    Without CoT a case starts from its old cache in ``pairs`` (kept from validity)."""
    learned = rule is not None and rule.n_cases > 0
    base = cfg.edit_strategies()
    rankings = [r for r in cfg.rankings if r != "causal" or learned]
    held = set(sel.held_ids)
    edit_items = [(f"{a.case.case_id}.cot{c}", (a, c)) for a in sel.valid + sel.controls for c in cfg.cot]
    tick = stages.progress("edits", len(edit_items))

    def edit_one(item):
        a, cot = item
        sweep = []
        if a.case.case_id in held and cot == 0:
            n_down = a.downstream[1] - a.downstream[0]
            sweep = [parse_strategy(f"selective:{k}:{r}") for k in cfg.ks if k <= n_down for r in rankings]
        case = a if cot == 0 else align(a.case.model_copy(update={"cot": True}), lm.tokenizer, cfg.form)
        if isinstance(case, Skip):
            return pd.DataFrame()
        old_cache = pairs.get(a).old if pairs is not None and cot == 0 else None
        return edit_case(lm, case, base, cot, cfg.min_flip, ranking=rule, seed=cfg.seed, model_name=cfg.model,
                         old_cache=old_cache, sweep=sweep)

    edits = stages.run("edits", lambda: _per_case(CaseStore(out, "edits"), edit_items, edit_one, tick,
                                                  stages.case_s.setdefault("edits", {})))
    if not learned and "ranking" in edits:  # parts stored by a version that ranked with an empty rule
        edits = edits[edits.ranking.ne("causal")]
    atomic_write_parquet(edits, out / EDITS)
    return edits


def run_compose_stage(cfg: RunConfig, lm, out: Path, stages: Stages) -> list[dict]:
    """With ``compose: N``, the composition gate on N queries (as ``kvprobe validate``); its summary rows."""
    if not cfg.compose:
        return []

    tick = stages.progress("compose", cfg.compose)
    composed = stages.run("compose", lambda: run_compose(
        lm, n=cfg.compose, seed=cfg.seed, seams=cfg.compose_seams, form=cfg.form, store_dir=out / "blocks",
        model_name=cfg.model, parts=CaseStore(out, "compose"), on_query=tick))
    atomic_write_parquet(composed, out / COMPOSE)
    return summarize_compose(composed).to_dict("records")


PROFILED = ("validity", "locality", "attention", "knockout", "linear", "edits", "compose")


def run_profile(stages: Stages, sel: Selection, out: Path) -> dict:
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
    per = {st: round(stages.wall[st] / n / prefill_s, 3) for st in PROFILED if st in stages.wall}
    return {"prefill_s": round(prefill_s, 4), "valid_cases": n, "per_valid_case": per,
            "total_per_valid_case": round(sum(per.values()), 3),
            "cases": {st: {key: round(sec / prefill_s, 3) for key, sec in times.items()}
                      for st, times in stages.case_s.items() if times}}


def write_manifest(cfg: RunConfig, lm, sel: Selection, compose_summary: list[dict], out: Path,
                   wall_s: dict[str, float], profile: dict | None = None) -> dict:
    """manifest.json: config, model fingerprint, versions, counts and skip reasons, wall time per
    stage, and the run's cost in prefill-equivalents (:func:`run_profile`)."""
    validity = sel.validity
    manifest = {
        **version_entry(MANIFEST), "config": cfg.model_dump(), "model": lm.fingerprint(),
        "model_info": lm.info.as_dict(),
        "n_layers": lm.adapter.n_layers, "n_heads": lm.adapter.n_heads, "n_kv_heads": lm.adapter.n_kv_heads,
        "versions": package_versions(), "seed": cfg.seed,
        "counts": {"cases": len(sel.cases), "aligned": len(sel.aligned), "probed_decision": len(sel.valid_ids),
                   "valid_decision": int((validity.valid & ~validity.control).sum()),
                   "valid_control": sel.n_valid_controls, "edited_controls": len(sel.control_ids),
                   "ranking_cases": len(sel.rank_ids), "held_out_cases": len(sel.held_ids),
                   "skipped": len(sel.skipped), "invalid": int((~validity.valid).sum())},
        "skipped": [{"case_id": s.case_id, "reason": s.reason} for s in sel.skipped],
        "invalid_reasons": _invalid_reasons(validity),
        "validity": summarize(validity) if len(validity) else {},
        "compose": compose_summary,
        "tables": sorted(p.name for p in out.glob("*.parquet")),
        "wall_s": {k: round(v, 2) for k, v in wall_s.items()},
        "prefill_equivalents": profile or {},
    }
    atomic_write_json(manifest, out / MANIFEST)
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
