"""``kvprobe sweep``: prompt layouts x downstream lengths for one model, with a report section."""

from __future__ import annotations

import typer

from kvprobe.cli import options as opt
from kvprobe.cli.common import console, executor_for, load_with_status, progress_bar, usable_out
from kvprobe.defaults import (
    LAYOUT_NAMES,
    SWEEP_FILLER_TOKENS,
    SWEEP_LAYOUTS,
    SWEEP_STRATEGIES,
)
from kvprobe.errors import UsageError


def sweep(ctx: typer.Context, model: opt.Model = opt.DEFAULTS["model"],
          layouts: str = typer.Option(",".join(SWEEP_LAYOUTS),
                                      help=f"comma-separated prompt layouts: {', '.join(LAYOUT_NAMES)}"),
          filler_tokens: str = typer.Option(",".join(map(str, SWEEP_FILLER_TOKENS)),
                                            help="comma-separated downstream lengths: about this many tokens of "
                                                 "filler after the field (0 = none)"),
          field_styles: str = typer.Option("key", help="comma-separated field-name styles: key (order_status), "
                                                       "words (order status)"),
          rule_styles: str = typer.Option("allow", help="comma-separated rule styles: allow (the rule names the "
                                                        "allowing values), deny (it names the denying ones)"),
          n: int = typer.Option(40, min=1, help="cases screened per cell at most"),
          valid: int | None = typer.Option(None, min=1, show_default="screen all n",
                                           help="stop a cell once it has this many valid decision cases"),
          controls: float = typer.Option(0.0, min=0.0, max=1.0, help="fraction of negative-control cases"),
          seed: opt.Seed = 0, form: opt.Form = opt.DEFAULTS["form"],
          strategies: str = typer.Option(",".join(SWEEP_STRATEGIES), help="comma-separated edit strategy specs "
                                                                          "(`kvprobe strategies` lists them)"),
          min_flip: opt.MinFlip = opt.DEFAULTS["min_flip"],
          time_all: bool = typer.Option(False, "--time-all", help="run and time stale, field_only and oracle as "
                                        "strategies too, instead of reading them off the shared patch reads"),
          out: opt.Out = None,
          report: bool = typer.Option(True, help="write report.html at the end"),
          dtype: opt.Dtype = "float32", device: opt.Device = "cpu", device_map: opt.DeviceMap = "none",
          allow_failed_toy: opt.AllowFailedToy = False, executor: opt.Executor = "serial",
          workers: opt.Workers = 2, ray_address: opt.RayAddress = None,
          gpus_per_worker: opt.GpusPerWorker = 0.0, threads_per_worker: opt.ThreadsPerWorker = 1,
          retries: opt.Retries = 2) -> None:
    """Where does the model keep its conclusions, per prompt layout and distance?

    For each cell of layouts x filler lengths (x field and rule styles): validity, field-only and
    downstream patch recovery, the share of the effect by token kind, and the edit strategies'
    agreement and recovery, each with a 95% CI; a verdict per layout. Writes sweep.parquet,
    sweep_summary.parquet, sweep_manifest.json and report.html. An interrupted sweep resumes without
    redoing finished cases; a folder with other settings is refused.
    """
    from pydantic import ValidationError

    from kvprobe.sweep.grid import SweepConfig, open_sweep, run_sweep, sweep_experiment

    try:
        cfg = SweepConfig(model=model, layouts=opt.parse_csv(layouts),
                          filler_tokens=opt.parse_ints(filler_tokens, "--filler-tokens"),
                          field_styles=opt.parse_csv(field_styles), rule_styles=opt.parse_csv(rule_styles), n=n,
                          valid=valid, controls=controls, seed=seed, form=form,
                          strategies=opt.parse_csv(strategies), min_flip=min_flip, time_all=time_all, dtype=dtype,
                          device=device)
    except ValidationError as exc:
        raise UsageError.from_validation(exc, "sweep") from None
    out = usable_out(out or opt.default_out("sweep", model))
    # device_map is not a SweepConfig key: placement does not change a sweep's settings, the manifest's
    # model_info records it
    exp = sweep_experiment(cfg, out)
    open_sweep(exp, cfg, lambda: load_with_status(model, cfg.dtype, cfg.device, allow_failed_toy=allow_failed_toy,
                                                  device_map=device_map),
               executor=lambda: executor_for(ctx, executor, workers, ray_address, gpus_per_worker, threads_per_worker,
                                             retries))
    with exp.opened.executor, progress_bar() as bar:
        def progress(cell: str, total: int):
            task = bar.add_task(f"{cell} (valid cases)" if cfg.valid else cell, total=total)
            return lambda: bar.advance(task)

        manifest = run_sweep(cfg, progress=progress, exp=exp)
    print_sweep(out)
    console.print(f"{len(manifest['cells'])} cells in {manifest['wall_s']['cells']:.0f} s of measurement; "
                  f"results in {out}")
    if report:
        from kvprobe.reports.sweep import render_sweep_report

        console.print(f"report: {render_sweep_report(out)}")


def print_sweep(out) -> None:
    """Per cell, in grid order: valid cases, the headline numbers with their CIs, the verdict."""
    import json

    import pandas as pd
    from rich.table import Table

    from kvprobe.reports.sweep import HEADLINE, grid_order, headline_stats
    from kvprobe.results import SWEEP_MANIFEST, SWEEP_SUMMARY

    manifest = json.loads((out / SWEEP_MANIFEST).read_text())
    cfg = manifest["config"]
    summary = grid_order(pd.read_parquet(out / SWEEP_SUMMARY), cfg)
    table = Table(title=f"{cfg['model']}: layouts x downstream lengths")
    for title in ["cell", "valid/screened", "downstream tok", *(c[3] for c in HEADLINE), "verdict", "s"]:
        table.add_column(title)
    for cell in dict.fromkeys(summary.cell):
        rows, info = summary[summary.cell == cell], manifest["cells"][cell]
        texts = [stat.text() if stat else "-" for stat in headline_stats(rows)]
        table.add_row(cell, f"{info['valid_decision']}/{info['screened']}", f"{rows.downstream_tokens.iloc[0]:.0f}",
                      *texts, manifest["cell_verdicts"].get(cell, "-"), f"{info['wall_s']:.0f}")
    console.print(table)
    for layout in dict.fromkeys(summary.layout):
        console.print(f"{layout}: {manifest['layout_verdicts'][layout]}")
