"""``kvprobe run`` and ``kvprobe export-topk``."""

from __future__ import annotations

from pathlib import Path

import typer

from kvprobe.cli import options as opt
from kvprobe.cli.common import (console, executor_for, given_on_command_line, load_with_status, progress_bar,
                                progress_of, usable_out)
from kvprobe.errors import UsageError


def run(ctx: typer.Context,
        model: opt.Model = opt.DEFAULTS["model"], dataset: opt.Dataset = "default",
        n: int | None = typer.Option(None, min=1, show_default="sized", help="cases (generated: how many; a JSONL "
                                     "file: at most this many); by default the run sizes itself: cases are checked "
                                     "in order until each leg of the repair rule and K* can be established at "
                                     "--threshold, at most --budget"),
        budget: int = typer.Option(opt.DEFAULTS["budget"], min=1, help="a sized run's most cases"),
        threshold: opt.Threshold = opt.DEFAULTS["threshold"],
        seed: opt.Seed = 0, form: opt.Form = opt.DEFAULTS["form"], few_shot: opt.FewShot = 0,
        probes: str = typer.Option(opt.PROBES.replace(" ", ""), help="comma-separated probes to run"),
        strategies: opt.Strategies = opt.DEFAULTS["strategies"], cot: opt.Cot = "0",
        min_flip: opt.MinFlip = opt.DEFAULTS["min_flip"],
        valid_only: bool = typer.Option(True, "--valid-only/--all-cases",
                                        help="probe only cases the model gets right under both values"),
        max_controls: int | None = typer.Option(None, min=0, show_default="all", help="valid negative controls "
                                                "carried into the edits, a seeded sample"),
        compose: int = typer.Option(0, min=0, help="also run the composition gate (kvprobe validate) on this many "
                                                   "queries; 0 = skip"),
        config: Path | None = typer.Option(None, help="a YAML RunConfig; options given on the command line "
                                                      "override it"),
        out: Path | None = opt.out_option("default results/<model>"),
        report: bool = typer.Option(True, help="write report.html at the end"),
        dtype: opt.Dtype = "float32", device: opt.Device = "cpu", device_map: opt.DeviceMap = "none",
        allow_failed_toy: opt.AllowFailedToy = False, executor: opt.Executor = "serial",
        workers: opt.Workers = 2, ray_address: opt.RayAddress = None,
        gpus_per_worker: opt.GpusPerWorker = 0.0, threads_per_worker: opt.ThreadsPerWorker = 1,
        retries: opt.Retries = 2) -> None:
    """Validity, the four probes, every edit strategy and the top-K export, into one results folder.

    Every input is checked before any model work. An interrupted run resumes from where it stopped
    when run again with the same --out. Exits 1 when no decision case is valid.
    """
    from pydantic import ValidationError

    from kvprobe.config import RunConfig
    from kvprobe.pipeline import open_run, run_experiment
    from kvprobe.pipeline import run as run_pipeline

    given = {name for name in ("model", "dataset", "n", "budget", "threshold", "seed", "form", "few_shot", "probes", "strategies", "cot",
                               "min_flip", "valid_only", "max_controls", "compose", "dtype", "device",
                               "device_map")
             if given_on_command_line(ctx, name)}
    values = {"model": model, "dataset": dataset, "n": n, "budget": budget, "threshold": threshold, "seed": seed, "form": form, "few_shot": few_shot,
              "probes": opt.parse_csv(probes), "strategies": opt.parse_csv(strategies), "cot": opt.parse_ints(cot, "--cot"),
              "min_flip": min_flip, "valid_only": valid_only, "max_controls": max_controls, "compose": compose,
              "dtype": dtype, "device": device, "device_map": device_map}
    overrides = {k: v for k, v in values.items() if k in given}  # the rest: the config file's, or RunConfig's
    try:
        cfg = RunConfig.from_yaml(config, **overrides) if config else RunConfig(**overrides)
    except ValidationError as exc:
        raise UsageError.from_validation(exc, "run") from None
    opt.check_placement(cfg.dtype, cfg.device, cfg.device_map)  # a config file's values too, before any work
    opt.generated_only(cfg.dataset, few_shot=cfg.few_shot != 0)
    out = usable_out(out or Path("results") / opt.folder_name(cfg.model))
    exp = run_experiment(cfg, out)
    open_run(exp, cfg, lambda: load_with_status(cfg.model, cfg.dtype, cfg.device, allow_failed_toy=allow_failed_toy,
                                                device_map=cfg.device_map),
             executor=lambda: executor_for(ctx, executor, workers, ray_address, gpus_per_worker, threads_per_worker,
                                           retries))
    with exp.opened.executor, progress_bar() as bar:
        manifest = run_pipeline(cfg, out, progress=progress_of(bar), exp=exp)
    c = manifest["counts"]
    console.print(f"{cfg.model}: {c['valid_decision']} valid decision cases of {c.get('checked', c['aligned'])} checked "
                  f"({c['aligned']} aligned) "
                  f"({c['skipped']} skipped, {c['invalid']} invalid; {c['probed_decision']} probed); results in {out} "
                  f"({manifest['wall_s']['total']:.0f} s)")
    _print_headline(out, cfg)
    if report:
        from kvprobe.reports.html import render_report

        path = render_report([out], out / "report.html")
        console.print(f"report: {path}")


def _print_headline(out: Path, cfg) -> None:
    """The edit table of the configured strategies (the K sweep is in the report), then the answer: the
    report's headline facts, also written to summary.json."""
    import json

    import pandas as pd

    from kvprobe.cli.edit import print_summary
    from kvprobe.reports.summary import SUMMARY, write_summary
    from kvprobe.results import EDITS

    if (out / EDITS).exists():
        df = pd.read_parquet(out / EDITS)
        labels = [s.label for s in cfg.edit_strategies()]
        print_summary(df[df.strategy.isin(labels)], False, str(out), cfg.min_flip)
    summary = write_summary(out, cfg.threshold)
    console.print("[bold]The answer[/bold]")
    for sentence in json.loads(summary.read_text(encoding="utf-8"))["headline"]:
        console.print(f"- {sentence}", markup=False, highlight=False)
    console.print(f"{SUMMARY}: {summary}")


def export_topk(results_dir: Path = typer.Argument(..., help="a `kvprobe run` or `kvprobe sweep` results folder"),
                out: Path | None = typer.Option(None, show_default="RESULTS_DIR/topk.yaml", help="YAML path"),
                threshold: opt.Threshold = opt.DEFAULTS["threshold"]) -> None:
    """Write the per-model top-K YAML (K*, ranking rule, token kinds, fingerprint, the evidence per strategy)
    for serving; from a sweep folder, the fingerprint and the evidence per strategy only. It is printed too,
    unless --out names the file."""
    from kvprobe.cli.common import usable_file
    from kvprobe.editor.topk import export_topk as export

    if out is not None:
        usable_file(out)
    path = export(results_dir, out, threshold)
    console.print(f"wrote {path}")
    if out is None:  # the default place: show it; a file the user named is left to read there
        console.print(path.read_text(), markup=False, highlight=False)
