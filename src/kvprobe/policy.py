"""The per-model policy file ``topk.yaml``, read back: what each strategy was measured to do on this
model, K*, and the causal ranking rule, so code outside ``kvprobe run`` can choose a repair.

    policy = kvprobe.policy.load("results/qwen2.5-0.5b/topk.yaml", lm)   # refuses another model's file
    policy.cheapest()          # the cheapest strategy established at the file's threshold, or None
    policy.ranking()           # the learned causal rule, usable as an EditContext ranking

``kvprobe export-topk`` writes the file (:mod:`kvprobe.editor.topk`) from a ``kvprobe run`` folder
(K*, the rule, and the strategies measured on its held-out cases) or a ``kvprobe sweep`` folder
(the strategies only). The file's format version and name live here, so the writer and the
reader share them; so does the ranking rule's data class (:class:`RankingRule`), since applying
the rule is what a loaded policy does (learning it is :mod:`kvprobe.editor.causal_rule`).

This module imports nothing of :mod:`kvprobe.editor`: the strategies import it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import yaml
from pydantic import model_validator

from kvprobe import repair_rule
from kvprobe.errors import KvprobeError
from kvprobe.identity import HASHES, ModelIdentity, malformed
from kvprobe.schema import (CI, Count, File, Finite, Number, Seconds, Share, ShareOrNaN, Text, Threshold,
                            check_version, validate)

if TYPE_CHECKING:
    from kvprobe.datasets import AlignedCase

SCHEMA_VERSION = 4  # 2: the strategies section, a sweep folder exports too; 3: K* only where established;
#                    4: the one repair rule (both legs), and per field its kind and repair (``fields``)
READS = (2, 3, 4)  # a schema-2 K* was chosen on its point estimate; its k_star_status is absent (None)
TOPK_FILE = "topk.yaml"
KEYS = ("model", "threshold", "k_star", "erratum_template", "strategies")  # besides schema_version
EVIDENCE_KEYS = ("spec", "agreement", "agreement_ci95", "n", "control_invariance", "n_controls", "frac_recomputed",
                 "wall_s")
EXPORT = "`kvprobe export-topk <results folder>`"


# -- the causal ranking rule, as the file stores it ---------------------------------------------
def bucket(distance: int) -> int:
    """0 for distance 0, else 1 + floor(log2(distance)): 1, 2-3, 4-7, ..."""
    return 0 if distance <= 0 else 1 + int(math.log2(distance))


def position_key(a: AlignedCase, p: int) -> str:
    """``kind|after-field bucket|before-decision bucket`` of a downstream position."""
    return f"{a.kinds[p]}|{bucket(p - a.field[1])}|{bucket(a.decision_pos - 1 - p)}"


@dataclass(frozen=True)
class RankingRule:
    """Scores by position key; ``rank(a)`` orders a case's downstream positions, best first (unseen
    keys score 0; ties go to the position nearest the field). Learned by
    :func:`kvprobe.editor.causal_rule.fit_rule`."""

    scores: Mapping[str, float]
    n_cases: int

    def rank(self, a: AlignedCase) -> list[int]:
        down = range(*a.downstream)
        return sorted(down, key=lambda p: (-self.scores.get(position_key(a, p), 0.0), p))

    def __call__(self, ctx) -> list[int]:  # usable as an EditContext ranking
        return self.rank(ctx.a)

    def as_dict(self) -> dict:
        top = sorted(self.scores.items(), key=lambda kv: -kv[1])
        return {"kind": "position-key table", "key": "token_kind|log2 distance after field|log2 distance before decision",
                "n_training_cases": self.n_cases, "scores": {k: round(v, 6) for k, v in top}}


# -- the file, read back ------------------------------------------------------------------------
@dataclass(frozen=True)
class Evidence:
    """One ``strategies`` entry: how one strategy did against the oracle (full re-prefill) on this model.

    ``agreement`` is the share of valid decision cases whose decision agrees with the oracle's, with
    its Wilson 95% interval, over ``n`` cases; ``control_invariance`` the share of valid control cases
    (the value changes, the answer must not) that kept their answer, over ``n_controls`` (None without
    controls); ``frac_recomputed`` the mean share of prompt positions recomputed; ``wall_s`` and
    ``decide_s`` the mean repair time and the mean time to feed the tail and read the decision, in
    seconds (None where not measured); ``n_errors`` the cases the strategy could not repair (left out
    of everything else).
    """

    spec: str
    agreement: float | None
    agreement_ci95: tuple[float, float] | None
    n: int
    control_invariance: float | None
    n_controls: int
    frac_recomputed: float | None
    wall_s: float | None
    decide_s: float | None = None
    n_errors: int = 0

    @property
    def name(self) -> str:
        """The strategy's name: its spec up to the first ``:`` (``selective`` of ``selective:8:causal``)."""
        return self.spec.partition(":")[0]

    def describe(self) -> str:
        """One line: ``erratum_turn: agreement 0.98 [0.95, 0.99] on 180 cases, controls 12/13, recomputed 0.15``."""
        agree = "agreement n/a" if self.agreement is None else f"agreement {self.agreement:.2f}"
        if self.agreement_ci95 is not None:
            agree += f" [{self.agreement_ci95[0]:.2f}, {self.agreement_ci95[1]:.2f}]"
        controls = ("no controls" if self.control_invariance is None
                    else f"controls {round(self.control_invariance * self.n_controls)}/{self.n_controls}")
        cost = "recomputed n/a" if self.frac_recomputed is None else f"recomputed {self.frac_recomputed:.2f}"
        errors = f", {self.n_errors} not repaired" if self.n_errors else ""
        return f"{self.spec}: {agree} on {self.n} cases, {controls}, {cost}{errors}"


@dataclass(frozen=True)
class Policy:
    """A loaded ``topk.yaml`` (see :func:`load`). ``model`` is the fingerprint the file was exported
    for; ``rule`` the stored ranking rule (None for a sweep's file); ``reason`` why there is no K*."""

    path: Path
    model: dict
    threshold: float
    k_star: int | None
    rule: dict | None
    strategies: tuple[Evidence, ...]
    erratum_template: str | None
    reason: str | None = None
    k_star_status: str | None = None
    fields: dict | None = None  # schema 4: field -> {"kind", "repair", "cases"}

    def field_repair(self, name: str) -> tuple[str, str] | None:
        """(repair, why) for field ``name`` where the file establishes one for its kind, else None."""
        entry = (self.fields or {}).get(name)
        if not entry or not entry.get("repair"):
            return None
        decides = entry["kind"] == "decides"
        leg = "agreement" if decides else "the decision kept on negative controls"
        return entry["repair"], (f"policy {self.path}: {name} is a field that {'decides' if decides else 'must not matter'}"
                                 f"; {entry['repair']} is the cheapest repair established on {leg} at {self.threshold:g}")

    def ranking(self) -> RankingRule:
        """The learned causal ranking rule (usable as an EditContext ranking, e.g. for
        ``selective:K:causal``); a one-line error when the file holds none, or one learned from no case."""
        rule = self.rule or {}
        if not isinstance(rule.get("scores"), dict) or not rule.get("n_training_cases"):
            why = rule.get("note") or self.reason or "no ranking_rule"
            raise KvprobeError(f"{self.path} has no learned causal ranking rule ({why}); export one from a "
                               f"`kvprobe run` folder with the locality probe")
        return RankingRule({str(k): float(v) for k, v in rule["scores"].items()}, int(rule["n_training_cases"]))

    def cheapest(self, threshold: float | None = None) -> Evidence | None:
        """The cheapest measured strategy established by :data:`kvprobe.repair_rule.RULE` at
        ``threshold`` (default: the file's): its agreement over ``n`` decision cases and its
        ``control_invariance`` over ``n_controls`` controls each have a Wilson 95% lower bound at or
        above it (a strategy measured without controls is never established). Candidates: every
        strategy in the file but :data:`kvprobe.repair_rule.NOT_REPAIRS` (stale and oracle, the two
        ends; hoist, a rewritten prompt; auto, a chooser).
        The least ``frac_recomputed`` wins, then the least time; None when none is established.
        """
        threshold = self.threshold if threshold is None else threshold
        evidence = {e.spec: e for e in self.strategies if repair_rule.is_repair(e.spec) and e.frac_recomputed is not None}
        pick, _ = repair_rule.choose([candidate(e) for e in evidence.values()], threshold)
        return evidence[pick.name] if pick else None

    def why_none(self, threshold: float | None = None) -> str:
        """Why :meth:`cheapest` found nothing: the strategy nearest to being established, and its weak leg."""
        threshold = self.threshold if threshold is None else threshold
        near = repair_rule.closest([candidate(e) for e in self.strategies if repair_rule.is_repair(e.spec)])
        return (f"no measured strategy is established at {threshold:g}"
                + (f"; the closest, {near.name}: {near.why_not(threshold)}" if near else ""))


def candidate(e: Evidence) -> repair_rule.Candidate:
    """A topk.yaml evidence entry as the repair rule reads it (a case it could not repair counts
    against its agreement)."""
    time_s = (e.wall_s or 0) + (e.decide_s or 0) if e.wall_s is not None else None
    agree = repair_rule.Leg.of(e.agreement, e.n)
    agree = repair_rule.Leg(agree.k, agree.n + e.n_errors)
    return repair_rule.Candidate(e.spec, agree,
                                 repair_rule.Leg.of(e.control_invariance, e.n_controls), e.frac_recomputed, time_s)


# -- the file's schema: every key and what it accepts (kvprobe.schema's types) -------------------
class ModelEntry(File):
    """``model``: the fingerprint the file was exported for (:meth:`LoadedModel.fingerprint`)."""

    spec: str | None = None
    family: str | None = None
    config_hash: Text
    weights_hash: Text
    tokenizer_hash: Text


class RuleEntry(File):
    """``ranking_rule``: :meth:`RankingRule.as_dict`, plus a ``note`` where no rule was learned."""

    kind: str | None = None
    key: str | None = None
    n_training_cases: Count
    scores: dict[str, Finite]
    note: str | None = None


class KSweepEntry(File):
    """One ``k_sweep`` row. An interval end or a recovery is null or NaN where it was not measured
    (a bootstrap of fewer than two cases)."""

    k: Count
    agreement: Share
    agreement_lo: ShareOrNaN | None = None
    agreement_hi: ShareOrNaN | None = None
    n: Count
    recovery: Number | None = None
    recovery_lo: Number | None = None
    recovery_hi: Number | None = None
    frac_recomputed: Share | None = None


class EvidenceEntry(File):
    """One ``strategies`` entry (:class:`Evidence`); every key but ``decide_s`` and ``n_errors`` is
    required, null where not measured."""

    spec: Text
    agreement: Share | None
    agreement_ci95: CI | None
    n: Count
    control_invariance: Share | None
    n_controls: Count
    frac_recomputed: Share | None
    wall_s: Seconds | None
    decide_s: Seconds | None = None
    n_errors: Count = 0


class FieldEntry(File):
    """One ``fields`` entry (schema 4): the field's kind in the run, and the repair established for it."""

    kind: Literal["decides", "must not matter", "mixed"]
    repair: str | None
    cases: Count


class TopkFile(File):
    """A ``topk.yaml`` (schema 2 or 3; :mod:`kvprobe.editor.topk` writes it): every key it may hold."""

    schema_version: Literal[2, 3, 4]
    model: ModelEntry
    threshold: Threshold
    judged_on: str | None = None
    ranking_rule: RuleEntry | None = None
    recompute: dict[str, str] | None = None
    token_kinds_at_top: dict[str, Share] | None = None
    erratum_template: str | None
    k_sweep: list[KSweepEntry] | None = None
    k_star: Count | None
    k_star_status: Literal["established", "not established", "not reached", "no ranking"] | None = None  # schema 3
    k_candidate: Count | None = None
    agreement: Share | None = None
    agreement_ci95: CI | None = None
    n_cases: Count | None = None
    reason: str | None = None
    strategies: list[EvidenceEntry]
    fields: dict[str, FieldEntry] | None = None  # schema 4

    @model_validator(mode="after")
    def _k_star_matches_its_status(self):
        if self.k_star_status is not None and (self.k_star is not None) != (self.k_star_status == "established"):
            raise ValueError(f"k_star {self.k_star!r} with k_star_status {self.k_star_status!r} (a K* is "
                             f"a whole number exactly when its status is 'established')")
        return self


def load(path: Path | str, lm) -> Policy:
    """Read a ``topk.yaml`` for the model ``lm`` (a LoadedModel).

    Refused, in one line (:class:`~kvprobe.errors.KvprobeError`): a missing file, a file that is
    not YAML, one that is not a topk.yaml of this schema version (``kvprobe export-topk`` rewrites
    it; a newer version was written by a newer kvprobe), one whose values do not fit
    :class:`TopkFile` (a threshold outside [0.5, 1), an agreement outside [0, 1], NaN, a negative or fractional
    count, a ``k_star`` that is not a whole number, a ``ranking_rule`` that is not a mapping, ...),
    and one exported for another model. The model is compared by its config, weights and
    tokenizer hashes (``lm.fingerprint()``), not by its spec, so a model loaded from another path
    matches its own file. ``lm=None`` skips that check (for reading a file without its model).
    """
    path = Path(path)
    if not path.is_file():
        raise KvprobeError(f"policy file not found: {path}; {EXPORT} writes one")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise KvprobeError(f"{path} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise KvprobeError(f"{path} is not valid YAML ({where}{getattr(exc, 'problem', None) or exc}); "
                           f"{EXPORT} rewrites it") from None
    if not isinstance(data, dict) or "schema_version" not in data:
        raise KvprobeError(f"{path} is not a topk.yaml (no schema_version); {EXPORT} writes one")
    check_version(path, data["schema_version"], "schema_version", READS, f"{EXPORT} rewrites it")
    missing = [k for k in KEYS if k not in data]
    model = data.get("model")
    if not missing:
        missing = [f"model.{h}" for h in malformed(model, HASHES)]
    if missing:
        raise KvprobeError(f"{path} is not a topk.yaml (no {', '.join(missing)}); {EXPORT} rewrites it")
    cfg = validate(TopkFile, data, path, TOPK_FILE, f"{EXPORT} rewrites it")
    if lm is not None:
        check_model(path, model, ModelIdentity.of_model(lm))
    return Policy(path=path, model=model, threshold=cfg.threshold, k_star=cfg.k_star, rule=data.get("ranking_rule"),
                  strategies=tuple(Evidence(**e.model_dump()) for e in cfg.strategies),
                  erratum_template=cfg.erratum_template, reason=cfg.reason, k_star_status=cfg.k_star_status,
                  fields={k: v.model_dump() for k, v in (cfg.fields or {}).items()} or None)


def check_model(path: Path, stored: dict, mine: ModelIdentity) -> None:
    """Refuse a file whose model hashes differ from ``mine``, naming the weights' where they differ, else the first."""
    differ = mine.differ(stored, HASHES)
    if differ:
        h = "weights_hash" if "weights_hash" in differ else differ[0]
        raise KvprobeError(f"{path} is for model {stored.get('spec', '?')} ({HASHES[h]} {str(stored[h])[:8]}..), "
                           f"not this model ({mine.spec}, {HASHES[h]} {str(getattr(mine, h))[:8]}..); "
                           f"export one from a results folder of this model")
