"""``kvprobe run`` and ``kvprobe export-topk``."""

from __future__ import annotations

from pathlib import Path

import typer

from kvprobe.cli.common import ALLOW_FAILED_TOY_HELP, console, load_with_status, progress_bar
from kvprobe.editor.strategies import spec_grammar


def _csv(value: str | None, cast=str) -> list | None:
    return None if value is None else [cast(v.strip()) for v in value.split(",") if v.strip()]


def run(model: str | None = typer.Option(None, help="model spec (default: the bundled default model)"),
        dataset: str | None = typer.Option(None, help="'default' (generated) or a JSONL file of cases"),
        probes: str | None = typer.Option(None, help="comma-separated: locality,attention,knockout,linear"),
        strategies: str | None = typer.Option(None, help=f"comma-separated edit strategy specs: {spec_grammar()}"),
        n: int | None = typer.Option(None, min=1, help="cases"), seed: int | None = None,
        cot: str | None = typer.Option(None, help="comma-separated CoT token budgets, e.g. 0,64"),
        valid_only: bool | None = typer.Option(None, "--valid-only/--all-cases",
                                               help="probe only cases the model gets right under both values"),
        max_controls: int | None = typer.Option(None, min=0, help="valid negative controls carried into the "
                                                                  "edits, a seeded sample (default: all)"),
        min_flip: float | None = typer.Option(None, min=0.0, help="recovery ratios and the causal ranking rule use "
                                                                 "only cases whose oracle flip is at least this "
                                                                 "many logits (default 1.0)"),
        compose: int | None = typer.Option(None, min=0, help="also run the composition gate (kvprobe validate) "
                                                            "on this many queries; 0 = skip"),
        config: Path | None = typer.Option(None, help="a YAML RunConfig; flags override it"),
        out: Path | None = typer.Option(None, help="results folder (default results/<model>)"),
        report: bool = typer.Option(True, help="write report.html at the end"),
        allow_failed_toy: bool = typer.Option(False, "--allow-failed-toy", help=ALLOW_FAILED_TOY_HELP)) -> None:
    """Validity, the four probes, every edit strategy and the top-K export, into one results folder.

    An interrupted run resumes from where it stopped when run again with the same --out.
    """
    from pydantic import ValidationError

    from kvprobe.errors import KvprobeError
    from kvprobe.pipeline import RunConfig, run as run_pipeline

    overrides = {k: v for k, v in {
        "model": model, "dataset": dataset, "probes": _csv(probes), "strategies": _csv(strategies), "n": n,
        "seed": seed, "cot": _csv(cot, int) if cot else None, "valid_only": valid_only,
        "max_controls": max_controls, "min_flip": min_flip, "compose": compose}.items() if v is not None}
    try:
        cfg = RunConfig.from_yaml(config, **overrides) if config else RunConfig(**overrides)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise KvprobeError(f"bad run option {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    except ValueError as exc:
        raise KvprobeError(f"bad run option: {exc}") from None
    out = out or Path("results") / cfg.model.replace("/", "_")
    lm = load_with_status(cfg.model, cfg.dtype, cfg.device, allow_failed_toy=allow_failed_toy)
    with progress_bar() as bar:
        tasks = {}

        def progress(stage: str, total: int):
            tasks[stage] = bar.add_task(stage, total=total)
            return lambda: bar.advance(tasks[stage])

        manifest = run_pipeline(cfg, out, progress=progress, lm=lm)
    c = manifest["counts"]
    console.print(f"{cfg.model}: {c['valid_decision']} valid decision cases of {c['aligned']} aligned "
                  f"({c['skipped']} skipped, {c['invalid']} invalid; {c['probed_decision']} probed); results in {out} "
                  f"({manifest['wall_s']['total']:.0f} s)")
    _print_headline(out, cfg)
    if report:
        from kvprobe.reports.html import render_report

        path = render_report([out], out / "report.html")
        console.print(f"report: {path}")


def _print_headline(out: Path, cfg) -> None:
    """The edit table of the configured strategies (the K sweep is in the report), then K*."""
    import pandas as pd

    from kvprobe.cli.edit import print_summary
    from kvprobe.results import EDITS

    if (out / EDITS).exists():
        df = pd.read_parquet(out / EDITS)
        labels = [s.label for s in cfg.edit_strategies()]
        print_summary(df[df.strategy.isin(labels)], False, str(out), cfg.min_flip)
    topk = out / "topk.yaml"
    if topk.exists():
        import yaml

        k = yaml.safe_load(topk.read_text())
        if k.get("k_star") is not None:
            console.print(f"K* = {k['k_star']} (agreement {k['agreement']:.2f}, 95% CI {k['agreement_ci95']}, "
                          f"n={k['n_cases']}); {topk}")
        else:
            console.print(f"K*: none. {k.get('reason')}; {topk}")


def export_topk(results_dir: Path = typer.Argument(..., help="a kvprobe run results folder"),
                out: Path | None = typer.Option(None, help="YAML path (default RESULTS_DIR/topk.yaml)"),
                threshold: float = typer.Option(0.95, help="agreement with the oracle that K* must reach")) -> None:
    """Write the per-model top-K YAML (K*, ranking rule, token kinds, fingerprint) for serving."""
    from kvprobe.editor.topk import export_topk as export

    path = export(results_dir, out, threshold)
    console.print(f"wrote {path}")
    console.print(path.read_text(), markup=False, highlight=False)
