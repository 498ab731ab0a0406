"""``kvprobe edit``: every edit strategy against the oracle, as a tidy table and a summary."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.table import Table

from kvprobe.cli.common import ALLOW_FAILED_TOY_HELP, console, load_with_status, progress_bar
from kvprobe.editor.strategies import spec_grammar


def edit(model: str = typer.Option(..., help="model spec, see `kvprobe models`"),
         dataset: str = typer.Option("default", help="'default' (generated) or a JSONL file of cases"),
         strategies: str = typer.Option(",".join(__import__("kvprobe.editor.runner").editor.runner.DEFAULT_STRATEGIES),
                                        help=f"comma-separated strategy specs: {spec_grammar()}"),
         n: int = typer.Option(40, min=1, help="cases"), seed: int = 0,
         cot: str = typer.Option("0", help="comma-separated CoT token budgets (0 = no chain-of-thought)"),
         form: str = typer.Option("auto", help="chat, raw or auto"),
         few_shot: int = typer.Option(0, min=0),
         min_flip: float = typer.Option(1.0, help="cases whose oracle flip is smaller get no recovery ratio"),
         all_cases: bool = typer.Option(False, "--all-cases", help="summarise invalid cases too"),
         allow_failed_toy: bool = typer.Option(False, "--allow-failed-toy", help=ALLOW_FAILED_TOY_HELP),
         out: Path = typer.Option(Path("results/edit"), help="results folder (resumable)")) -> None:
    """Run edit strategies on a model and dataset; writes edits.parquet and prints the summary."""
    from kvprobe.datasets import resolve_dataset
    from kvprobe.editor.runner import run_edits
    from kvprobe.errors import KvprobeError
    from kvprobe.editor.strategies import parse_strategy
    from kvprobe.results import EDITS, CaseStore, atomic_write_json

    specs = [s for s in strategies.split(",") if s.strip()]
    for s in specs:
        parse_strategy(s)  # fail fast, before loading a model
    try:
        cots = sorted({int(c) for c in cot.split(",")})
    except ValueError:
        raise KvprobeError(f"bad --cot {cot!r}; give comma-separated token budgets such as 0,64") from None
    cases = resolve_dataset(dataset, n=n, seed=seed, **({"few_shot": few_shot} if dataset == "default" else {}))
    lm = load_with_status(model, allow_failed_toy=allow_failed_toy)
    store = CaseStore(out, "edits")
    with progress_bar() as bar:
        task = bar.add_task(f"editing {len(cases)} cases x {len(cots)} CoT settings", total=len(cases) * len(cots))
        df, skipped = run_edits(lm, cases, specs, cots, form, min_flip, model_name=model, store=store,
                                on_case=lambda: bar.advance(task))
    path = store.collect()
    atomic_write_json({"command": "edit", "model": lm.fingerprint(), "dataset": dataset, "n": n, "seed": seed,
                       "strategies": specs, "cot": cots, "form": form, "min_flip": min_flip,
                       "skipped": [{"case_id": s.case_id, "reason": s.reason} for s in skipped]},
                      out / "edit_manifest.json")
    print_summary(df, all_cases, model, min_flip)
    console.print(f"wrote {path} ({EDITS})")


def print_summary(df, all_cases: bool, title: str, min_flip: float) -> None:
    """Agreement, recovery and cost per strategy and CoT budget, over the valid decision cases
    (every case with ``all_cases``); ``min_flip`` is the run's recovery threshold, for the note
    when no case reaches it."""
    from kvprobe.metrics import stay_valid, summarize_edits, valid_case_ids

    if df.empty:
        console.print("[yellow]no aligned cases[/yellow]")
        return
    dec = df[~df.control]
    valid_ids = valid_case_ids(dec)
    sel = df if all_cases else dec[dec.case_id.isin(valid_ids)]
    console.print(f"{len(valid_ids)} of {dec.case_id.nunique()} decision cases valid (the model answers correctly "
                  f"under both values); "
                  f"summary over {'all' if all_cases else 'valid decision'} cases")
    if sel.empty:
        console.print("[yellow]no valid decision cases to summarise[/yellow]")
        return
    summ = summarize_edits(sel[sel.error.isna()])
    table = Table(title=f"edit strategies: {title}")
    for col in ("strategy", "CoT", "n", "agreement [95% CI]", "recovery [95% CI] (n)", "|oracle flip|",
                "cosine", "KL", "recomputed", "repair ms", "to decision ms"):
        table.add_column(col, justify="right" if col not in ("strategy",) else "left")
    for r in summ.itertuples():
        rec = (f"{r.recovery:+.2f} [{r.recovery_lo:+.2f}, {r.recovery_hi:+.2f}] ({r.n_recovery})" if r.n_recovery
               else "- (0)")
        agree = f"{r.agreement:.2f} [{r.agreement_lo:.2f}, {r.agreement_hi:.2f}]"
        to_decision = "-" if math.isnan(r.to_decision_ms) else f"{r.to_decision_ms:.0f}"
        table.add_row(r.strategy, str(r.cot), str(r.n), agree, rec, f"{r.median_oracle_flip:.2f}", f"{r.cosine:.3f}",
                      f"{r.kl:.3f}", f"{r.frac_recomputed:.1%}", f"{r.wall_ms:.0f}", to_decision)
    console.print(table)
    for cot in sorted(summ[summ.n_recovery == 0].cot.unique()):
        console.print(f"with cot={cot}: no recovery ratio, since no case's |oracle flip| reaches min_flip={min_flip:g}")
    for v in stay_valid(sel[~sel.control]):
        console.print(f"with cot={v['cot']}: {v['valid']} of {v['n']} cases stay valid (stale still old, oracle new "
                      f"after reasoning); agreement is with the oracle at that budget")
