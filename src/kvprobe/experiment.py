"""One harness behind every command that writes a results folder: its checks, its claim, its steps, its
manifest and its summary, in one order, written once.

A command is a typed config (its pydantic model: :class:`~kvprobe.config.RunConfig`,
:class:`~kvprobe.sweep.grid.SweepConfig`, ...; the claim is derived from it) and an :class:`Experiment`
over it. The sequence every command shared, eight times over, is :meth:`Experiment.open`::

    check the folder (nothing written) -> checks that need no model -> the cases (ids distinct,
    answers present) -> the executor -> the model -> align and pre-check the cases against it ->
    checks that need the model -> claim the folder (settings, model and case contents)

then :meth:`Experiment.step` for each step (a name, its resumable parts, a per-item function on the
executor, a progress line, the table collected from the parts) and :meth:`Experiment.finish` (the
manifest; ``summary.json`` where the command has a section there). A refusal anywhere before the claim
leaves nothing on disk, and an executor opened before a refused load is closed.

Typed config: the commands' configs are pydantic models, because their values come from the command
line and YAML files and need one-line validation errors (:meth:`kvprobe.errors.UsageError.from_validation`);
the harness's own records (:class:`Experiment`, :class:`Opened`, :class:`Step`) are dataclasses: they are
built by code, never parsed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvprobe.results import CaseStore, ResultsFolder, check_case_ids


def _same(stored):
    return stored


def _no_progress(label: str, total: int | None) -> Callable[[], None]:
    return lambda: None


@dataclass
class Opened:
    """What :meth:`Experiment.open` hands the steps: the model, the cases (as given), the aligned ones and the
    skipped ones (when the command aligns), what ``prepare`` returned, and the executor (serial by default)."""

    lm: Any
    executor: Any
    cases: list = field(default_factory=list)
    aligned: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    prepared: Any = None


@dataclass(frozen=True)
class Step:
    """One step of a command: ``name`` is its parts folder (``parts/<name>``, so an interrupted run resumes it)
    and, with ``collect``, its table (``<name>.parquet``, concatenated from the parts); ``label`` and ``total``
    its progress line; ``compute(store, tick)`` does the work (a per-item function mapped by the executor
    over the store, calling ``tick()`` after each item) and returns what the command reads next."""

    name: str
    label: str
    compute: Callable[[CaseStore, Callable[[], None]], Any]
    total: int | None = None
    collect: bool = True


@dataclass
class Experiment:
    """One command's run into its results folder (see the module's docstring for the order).

    ``command`` is its name (``"edit"``: refusals say ``kvprobe edit``), ``claim`` its claim file
    (:data:`kvprobe.results.CLAIMS`) and ``settings`` what it records there (derived from its config);
    ``settle`` maps a stored claim onto today's form, ``held`` names the folder in a refusal, ``dtype`` is a
    claim key off float32 (:class:`~kvprobe.results.ResultsFolder`)."""

    command: str
    out: Path
    claim: str
    settings: dict
    held: str = "run with a different configuration"
    dtype: str | None = None
    settle: Callable[[dict], dict] = _same
    folder: ResultsFolder = field(init=False)
    opened: Opened | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.folder = ResultsFolder(self.out, self.claim, self.settings, settle=self.settle, held=self.held,
                                    dtype=self.dtype)

    @property
    def name(self) -> str:
        return f"kvprobe {self.command}"

    def check(self) -> bool:
        """What the claim would refuse, without writing anything; True when resuming."""
        return self.folder.check()

    def open(self, load: Callable[[], Any], *, cases: Callable[[], list] | None = None,
             before: Iterable[Callable[[], None]] = (), executor: Callable[[], Any] | None = None,
             align: tuple[str, list, list] | None = None, prepare: Callable[[Any, list], Any] | None = None,
             checks: Iterable[Callable[[Any], None]] = (), items: Callable[[Opened], Any] | None = None,
             identity: Callable[[Any], tuple[dict, str]] | None = None) -> Opened:
        """Every check, then the claim, in the one order of the module's docstring.

        ``load()`` gives the model; ``cases()`` the dataset's cases (their ids checked, and their expected
        answers, which validity needs); ``before`` are checks that need no model (run after the
        folder's); ``executor()`` makes the executor (closed again if a later check refuses); ``align`` =
        ``(form, strategies, cot)`` aligns every case and pre-checks it against the model's window and each
        strategy (:func:`kvprobe.config.precheck_cases`); ``prepare(lm, cases)`` is a command's own alignment
        where it has one (its result is :attr:`Opened.prepared`); ``checks`` take the model; ``items(opened)``
        is what the claim fingerprints (default: the cases; a dict where keys are not case ids, whose keys are
        checked as ids are). ``identity(lm)`` = (identity, name) claims a model known otherwise than by a loaded
        model's fingerprint (the serving benchmarks: what ``load`` gave stands for the served model)."""
        self.check()
        for check in before:
            check()
        given = cases() if cases is not None else []
        check_case_ids(c.case_id for c in given)
        if cases is not None:
            from kvprobe.datasets import require_answers

            require_answers(given, self.name)
        ex = executor() if executor is not None else None
        try:
            lm = load()
            opened = Opened(lm, ex, list(given))
            if ex is None:
                from kvprobe.executor import Serial

                opened.executor = Serial()
            if align is not None:
                from kvprobe.config import precheck_cases
                from kvprobe.editor.runner import align_all

                form, strategies, cot = align
                opened.aligned, opened.skipped = align_all(lm, given, form)
                precheck_cases(lm, opened.aligned, strategies, cot, form)
            if prepare is not None:
                opened.prepared = prepare(lm, given)
            for check in checks:
                check(lm)
            claimed = items(opened) if items is not None else given
            if isinstance(claimed, dict):
                check_case_ids(claimed)
            self.folder.claim(lm, claimed, identity=identity(lm) if identity is not None else None)
        except BaseException:
            if ex is not None:
                ex.close()
            raise
        self.opened = opened
        return opened

    def step(self, step: Step, progress: Callable[[str, int | None], Callable[[], None]] = _no_progress) -> Any:
        """Run one step: its parts store, its progress line, its work; with ``collect``, its table from the
        parts. Returns what ``compute`` returned."""
        store = self.folder.parts(step.name)
        result = step.compute(store, progress(step.label, step.total))
        if step.collect:
            store.collect()
        return result

    def table(self, name: str) -> Path:
        """``<name>.parquet`` from the parts of step ``name``."""
        return self.folder.parts(name).collect()

    def finish(self, manifest: str, *, summarize: Callable[[Path], Path] | None = None, **fields) -> Path | None:
        """Write the manifest ``manifest`` (``fields`` plus the model's fingerprint, package versions and any
        part recomputed) and, with ``summarize`` (:func:`kvprobe.reports.summary.write_summary`, handed in: the
        reports room reads results folders, so it sits above this one), the folder's ``summary.json``; returns
        the summary's path."""
        self.folder.write(manifest, self.folder.manifest(self.opened.lm, **fields))
        return summarize(self.out) if summarize is not None else None
