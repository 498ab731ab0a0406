"""``kvprobe sweep``: prompt layouts x downstream lengths for one model, with a report section."""

from __future__ import annotations

import typer

from kvprobe.cli import options as opt
from kvprobe.cli.common import console, load_with_status, progress_bar, usable_out
from kvprobe.defaults import LAYOUT_NAMES, SWEEP_FILLER_TOKENS, SWEEP_LAYOUTS, SWEEP_STRATEGIES
from kvprobe.errors import UsageError


def sweep(model: opt.Model = opt.DEFAULTS["model"],
          layouts: str = typer.Option(",".join(SWEEP_LAYOUTS), help=f"comma-separated prompt layouts: {', '.join(LAYOUT_NAMES)}"),
          filler_tokens: str = typer.Option(",".join(map(str, SWEEP_FILLER_TOKENS)), help="comma-separated downstream lengths: about this many "
                                                              "tokens of filler after the field (0 = none)"),
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
          out: opt.Out = None,
          report: bool = typer.Option(True, help="write report.html at the end"),
          allow_failed_toy: opt.AllowFailedToy = False) -> None:
    """Where does the model keep its conclusions, per prompt layout and distance?

    For each cell of layouts x filler lengths (x field and rule styles): validity, field-only and
    downstream patch recovery, the share of the effect by token kind, and the edit strategies'
    agreement and recovery, each with a 95% CI; a verdict per layout. Writes sweep.parquet,
    sweep_summary.parquet, sweep_manifest.json and report.html. An interrupted sweep resumes without
    redoing finished cases; a folder with other settings is refused.
    """
    from pydantic import ValidationError

    from kvprobe.results import check_claim
    from kvprobe.sweep.grid import SWEEP_CLAIM, SweepConfig, run_sweep

    try:
        cfg = SweepConfig(model=model, layouts=opt.parse_csv(layouts),
                          filler_tokens=opt.parse_ints(filler_tokens, "--filler-tokens"),
                          field_styles=opt.parse_csv(field_styles), rule_styles=opt.parse_csv(rule_styles), n=n,
                          valid=valid, controls=controls, seed=seed, form=form,
                          strategies=opt.parse_csv(strategies), min_flip=min_flip)
    except ValidationError as exc:
        raise UsageError.from_validation(exc, "sweep") from None
    out = usable_out(out or opt.default_out("sweep", model))
    check_claim(out, SWEEP_CLAIM, cfg.model_dump(), held="sweep with other settings")  # before loading the model
    lm = load_with_status(model, cfg.dtype, cfg.device, allow_failed_toy=allow_failed_toy)
    with progress_bar() as bar:
        def progress(cell: str, total: int):
            task = bar.add_task(f"{cell} (valid cases)" if cfg.valid else cell, total=total)
            return lambda: bar.advance(task)

        manifest = run_sweep(cfg, lm, out, progress=progress)
    print_sweep(out)
    console.print(f"{len(manifest['cells'])} cells in {manifest['wall_s']['cells']:.0f} s of measurement; "
                  f"results in {out}")
    if report:
        from kvprobe.reports.sweep import render_sweep_report

        console.print(f"report: {render_sweep_report(out)}")


def print_sweep(out) -> None:
    """Per cell: valid cases, field-only and downstream recovery, erratum agreement, the verdict."""
    import json

    import pandas as pd
    from rich.table import Table

    from kvprobe.reports.stats import Stat
    from kvprobe.results import SWEEP_MANIFEST, SWEEP_SUMMARY

    summary = pd.read_parquet(out / SWEEP_SUMMARY)
    manifest = json.loads((out / SWEEP_MANIFEST).read_text())
    table = Table(title=f"{manifest['config']['model']}: layouts x downstream lengths")
    cols = [("patch", "field", "recovery", "field-only rec."), ("patch", "downstream", "recovery", "downstream rec."),
            ("strategy", "erratum", "agree", "erratum agr."), ("strategy", "erratum_turn", "agree", "erratum (turn)"),
            ("strategy", "field_erratum", "agree", "field_erratum agr."),
            ("strategy", "cacheblend:0.15", "agree", "cacheblend agr.")]
    for title in ["cell", "valid/screened", "downstream tok", *(c[3] for c in cols), "verdict", "s"]:
        table.add_column(title)
    cfg = manifest["config"]
    order = lambda kv: (cfg["layouts"].index(kv[1]["layout"]), kv[1]["filler_tokens"],  # noqa: E731
                        cfg["field_styles"].index(kv[1]["field_style"]), cfg["rule_styles"].index(kv[1]["rule_style"]))
    for cell, info in sorted(manifest["cells"].items(), key=order):
        rows = summary[summary.cell == cell]
        texts = []
        for measure, name, what, _ in cols:
            hit = rows[(rows.measure == measure) & (rows.name == name)]
            if not len(hit):
                texts.append("-")
                continue
            r = hit.iloc[0]
            if what == "agree":
                texts.append(Stat(r.agree, r.agree_lo, r.agree_hi, int(r.n_agree)).text())
            else:
                texts.append(Stat(r.recovery, r.recovery_lo, r.recovery_hi, int(r.n_recovery)).text())
        down = rows.downstream_tokens.iloc[0] if len(rows) else float("nan")
        table.add_row(cell, f"{info['valid_decision']}/{info['screened']}", f"{down:.0f}", *texts,
                      manifest["cell_verdicts"].get(cell, "-"), f"{info['wall_s']:.0f}")
    console.print(table)
    for layout, verdict in sorted(manifest["layout_verdicts"].items(), key=lambda kv: cfg["layouts"].index(kv[0])):
        console.print(f"{layout}: {verdict}")
