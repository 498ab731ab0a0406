"""What defines a run, and the cases it runs on: :class:`RunConfig` (``kvprobe run``'s settings,
loadable from YAML; ``kvprobe edit`` builds one too), the dataset it names (:func:`load_cases`) and
the checks every case passes before any forward pass (:func:`precheck_cases`)."""

from __future__ import annotations

import math
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from kvprobe.datasets import ERRATUM, ERRATUM_TEMPLATES, Skip, align, resolve_dataset
from kvprobe.defaults import (DEFAULT_BUDGET, DEFAULT_FORM, DEFAULT_MIN_FLIP, DEFAULT_MODEL, DEFAULT_STRATEGIES,
                              DEFAULT_THRESHOLD, checked_form)
from kvprobe.editor.rankings import RANKINGS
from kvprobe.editor.strategies import Strategy, parse_strategy
from kvprobe.errors import KvprobeError, validator_message
from kvprobe.probes import STAGES
from kvprobe.schema import Threshold

ALL_PROBES = tuple(STAGES)  # every registered probe, in registration order


class RunConfig(BaseModel):
    """Everything that defines a run (loadable from YAML; unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")

    model: str = DEFAULT_MODEL
    dataset: str = "default"
    n: int | None = Field(None, ge=1)  # None: sized by the repair rule (see sizing()), at most `budget` cases
    budget: int = Field(DEFAULT_BUDGET, ge=1)  # a sized run's most cases (generated, or read from the JSONL)
    threshold: Threshold = DEFAULT_THRESHOLD  # what the headline, K* and topk.yaml establish at; in [0.5, 1)
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
    _typed: tuple | None = PrivateAttr(None)  # (specs, erratum_template, typed strategies): see edit_strategies

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

    def sizing(self) -> dict | None:
        """A sized run's targets (None for a run of ``n`` cases): the valid decision cases and valid
        negative controls that let each leg of the repair rule (:mod:`kvprobe.repair_rule`) and K*
        (on the held-out share of the decision cases) be established at ``threshold``, all
        succeeding. Cases are checked in order until both targets are met or ``budget`` cases are
        checked; the stop depends on validity alone, never on an edit's outcome, so every interval
        stays a fixed-sample interval."""
        if self.n is not None:
            return None
        from kvprobe.repair_rule import cases_to_establish

        need = cases_to_establish(self.threshold) or self.budget
        decision = need if not self.probes or "locality" not in self.probes else math.ceil(need / self.holdout)
        controls = need if self.max_controls is None else min(need, self.max_controls)
        return {"threshold": self.threshold, "per_leg": need, "valid_decision": decision, "valid_controls": controls,
                "budget": self.budget}

    @model_validator(mode="after")
    def _typed_strategies(self) -> "RunConfig":
        """Parse the strategy specs once, here at the edge (a bad one is a one-line error): the typed
        list is held beside the specs, which stay as given (what ``model_dump()`` and config.json hold)."""
        self._typed = self._parse_strategies()
        return self

    def _parse_strategies(self) -> tuple[tuple[str, ...], str, tuple[Strategy, ...]]:
        typed = tuple(parse_strategy(s, template=self.erratum_template) for s in self.strategies)
        return tuple(self.strategies), self.erratum_template, typed

    def edit_strategies(self) -> list[Strategy]:
        """The configured strategies, typed (parsed once, at validation); an erratum given without a
        template gets ``erratum_template``."""
        if self._typed is None or self._typed[:2] != (tuple(self.strategies), self.erratum_template):
            self._typed = self._parse_strategies()  # changed since validation: model_copy(update=...) or assignment
        return list(self._typed[2])

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
            msg = f"{loc}: " + validator_message(err)
            if err["type"] == "value_error" and repr(err.get("input")) not in msg:  # it names what is accepted only
                msg = f"{loc} is {err.get('input')!r}; accepted: " + msg.removeprefix(f"{loc}: ")
            raise KvprobeError(f"{path}: {msg}{hint}") from None
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


def load_cases(cfg: RunConfig) -> list:
    """The run's dataset: generated (``default``) or read from a JSONL file, checked line by line."""
    kwargs = {"few_shot": cfg.few_shot} if cfg.dataset == "default" else {}
    return resolve_dataset(cfg.dataset, n=cfg.n or cfg.budget, seed=cfg.seed, **kwargs)


def precheck_cases(lm, aligned: list, strategies: list[Strategy], cot: list[int], form: str) -> None:
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
