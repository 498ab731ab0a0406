"""``kvprobe edit``: every edit strategy against the oracle, as a tidy table and a summary; and
``kvprobe strategies``, the strategy grammar."""

from __future__ import annotations

import math

import typer
from rich.table import Table

from kvprobe.cli import options as opt
from kvprobe.cli.common import (console, emit_json, executor_for, load_with_status, progress_bar, progress_of,
                                usable_out)
from kvprobe.errors import UsageError, no_case_to_judge


def edit(ctx: typer.Context, model: opt.Model = opt.DEFAULTS["model"], dataset: opt.Dataset = "default",
         strategies: opt.Strategies = opt.DEFAULTS["strategies"], n: opt.N = opt.DEFAULTS["n"], seed: opt.Seed = 0,
         cot: opt.Cot = "0", form: opt.Form = opt.DEFAULTS["form"], few_shot: opt.FewShot = 0,
         min_flip: opt.MinFlip = opt.DEFAULTS["min_flip"],
         all_cases: bool = typer.Option(False, "--all-cases", help="summarise invalid cases too"),
         dtype: opt.Dtype = "float32", device: opt.Device = "cpu", device_map: opt.DeviceMap = "none",
         allow_failed_toy: opt.AllowFailedToy = False,
         out: opt.Out = None, executor: opt.Executor = "serial", workers: opt.Workers = 2,
         ray_address: opt.RayAddress = None, gpus_per_worker: opt.GpusPerWorker = 0.0,
         threads_per_worker: opt.ThreadsPerWorker = 1, retries: opt.Retries = 2) -> None:
    """Run edit strategies on a model and dataset; writes edits.parquet and prints the summary.

    Exits 1 when no decision case is valid (the model answers none correctly under both values).
    """
    from pydantic import ValidationError

    from kvprobe.editor.runner import run_edits
    from kvprobe.config import RunConfig, load_cases
    from kvprobe.experiment import Experiment, Step
    from kvprobe.results import EDIT_CLAIM, EDITS

    try:
        cfg = RunConfig(model=model, dataset=dataset, strategies=opt.parse_csv(strategies), n=n, seed=seed, cot=opt.parse_ints(cot, "--cot"), form=form, few_shot=few_shot,
                        min_flip=min_flip, probes=[], dtype=dtype, device=device, device_map=device_map)
    except ValidationError as exc:
        raise UsageError.from_validation(exc, "edit") from None
    opt.generated_only(dataset, few_shot=few_shot != 0)
    out = usable_out(out or opt.default_out("edit", model))
    settings = {"command": "edit", "model": model, "dataset": dataset, "n": cfg.n, "seed": seed,
                "strategies": cfg.strategies, "cot": cfg.cot, "form": form, "few_shot": few_shot, "min_flip": min_flip}
    exp = Experiment("edit", out, EDIT_CLAIM, settings, held="kvprobe edit with other settings", dtype=dtype)
    strategies_ = cfg.edit_strategies()
    opened = exp.open(lambda: load_with_status(model, dtype, device, allow_failed_toy=allow_failed_toy,
                                               device_map=device_map),
                      cases=lambda: load_cases(cfg), align=(cfg.form, strategies_, cfg.cot),
                      executor=lambda: executor_for(ctx, executor, workers, ray_address, gpus_per_worker,
                                                    threads_per_worker, retries))
    cases, lm, ex = opened.cases, opened.lm, opened.executor

    def edits(store, tick):
        return run_edits(lm, cases, strategies_, cfg.cot, form, min_flip, model_name=model, store=store,
                         on_case=tick, executor=ex)

    with ex, progress_bar() as bar:
        df, skipped = exp.step(Step("edits", f"editing {len(cases)} cases x {len(cfg.cot)} CoT settings", edits,
                                    total=len(cases) * len(cfg.cot)), progress=progress_of(bar))
    path = out / EDITS
    exp.finish("edit_manifest.json", **exp.folder.settings, executor=ex.describe(),
               skipped=[{"case_id": s.case_id, "reason": s.reason} for s in skipped])
    n_valid = print_summary(df, all_cases, model, min_flip)
    console.print(f"wrote {path} ({EDITS})")
    if n_valid == 0:
        raise no_case_to_judge(model, path, dataset)


def plain(doc: str) -> str:
    """A docstring's Sphinx markup as plain text: ``x`` and :role:`x` (or :role:`~a.b.x`) become x."""
    import re

    doc = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0)
                 else m.group(1), doc)
    return re.sub(r"``([^`]+)``", r"\1", doc)


def strategies(as_json: opt.Json = None) -> None:
    """Every registered edit strategy's spec grammar, and the default set."""
    from kvprobe.defaults import DEFAULT_STRATEGIES
    from kvprobe.editor.strategies import STRATEGIES

    emit_json({"strategies": [{"spec": cls.grammar(), "what": plain(" ".join((cls.__doc__ or "").split()))}
                              for cls in STRATEGIES.values()], "default": list(DEFAULT_STRATEGIES)}, as_json)
    if as_json == "-":
        return
    table = Table(title="edit strategies (give them as comma-separated specs to --strategies)")
    for col in ("spec", "what it does"):
        table.add_column(col)
    for cls in STRATEGIES.values():
        table.add_row(cls.grammar(), plain(" ".join((cls.__doc__ or "").split())))
    console.print(table)
    console.print(f"default: {','.join(DEFAULT_STRATEGIES)}", highlight=False, markup=False)


def print_summary(df, all_cases: bool, title: str, min_flip: float) -> int:
    """Agreement, recovery and cost per strategy and CoT budget, over the valid decision cases
    (every case with ``all_cases``); ``min_flip`` is the run's recovery threshold, for the note
    when no case reaches it. Returns the number of valid decision cases."""
    from kvprobe.metrics import stay_valid, summarize_edits, valid_case_ids

    if df.empty:
        console.print("[yellow]no aligned cases[/yellow]")
        return 0
    dec = df[~df.control]
    valid_ids = valid_case_ids(dec)
    sel = df if all_cases else dec[dec.case_id.isin(valid_ids)]
    console.print(f"{len(valid_ids)} of {dec.case_id.nunique()} decision cases valid (the model answers correctly "
                  f"under both values); "
                  f"summary over {'all' if all_cases else 'valid decision'} cases")
    if sel.empty:
        console.print("[yellow]no valid decision cases to summarise[/yellow]")
        return len(valid_ids)
    summ = summarize_edits(sel[sel.error.isna()])
    table = Table(title=f"edit strategies: {title}")
    for col in ("strategy", "CoT", "n", "agreement [95% CI]", "recovery [95% CI] (n)", "|oracle flip|",
                "cosine", "KL", "recomputed", "repair ms", "to decision ms"):
        table.add_column(col, justify="right" if col not in ("strategy",) else "left")
    for r in summ.itertuples():
        rec = (f"{r.recovery:+.2f} [{r.recovery_lo:+.2f}, {r.recovery_hi:+.2f}] ({r.n_recovery})" if r.n_recovery
               else "- (0)")
        agree = f"{r.agreement:.2f} [{r.agreement_lo:.2f}, {r.agreement_hi:.2f}]"
        to_decision = "-" if math.isnan(r.to_decision_s) else f"{1000 * r.to_decision_s:.0f}"
        table.add_row(r.strategy, str(r.cot), str(r.n), agree, rec, f"{r.median_oracle_flip:.2f}", f"{r.cosine:.3f}",
                      f"{r.kl:.3f}", f"{r.frac_recomputed:.1%}", f"{1000 * r.wall_s:.0f}", to_decision)
    console.print(table)
    for cot in sorted(summ[summ.n_recovery == 0].cot.unique()):
        console.print(f"with cot={cot}: no recovery ratio, since no case's |oracle flip| reaches min_flip={min_flip:g}")
    for v in stay_valid(sel[~sel.control]):
        console.print(f"with cot={v['cot']}: {v['valid']} of {v['n']} cases stay valid (stale still old, oracle new "
                      f"after reasoning); agreement is with the oracle at that budget")
    return len(valid_ids)
