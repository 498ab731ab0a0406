"""``kvprobe toy``: train and evaluate the toy field-edit models (see :mod:`kvprobe.models.toy`)."""

from __future__ import annotations

import typer
from rich.table import Table

from kvprobe.cli.common import console, err_console, progress_bar

toy_app = typer.Typer(help="Toy field-edit models: a small model of each family, trained here in minutes, "
                           "that decides by the field.", no_args_is_help=True)

FAMILY_HELP = "llama, qwen2, qwen3, gemma2, gemma3 or mistral"


def metrics_table(title: str, metrics: dict) -> Table:
    """The held-out figures, one row each, with the threshold each must meet."""
    from kvprobe.models.toy import METRICS, THRESHOLDS

    table = Table(title=title)
    for col in ("metric", "value", "threshold", "what"):
        table.add_column(col)
    for key, what in METRICS.items():
        bar = THRESHOLDS.get(key)
        mark = "" if bar is None else (" ok" if metrics[key] >= bar else " [red]FAIL[/red]")
        table.add_row(key, f"{metrics[key]:.3f}{mark}", f">= {bar}" if bar else "-", what)
    counts = ", ".join(f"{k[2:]} {v}" for k, v in metrics.items() if k.startswith("n_") and k != "n")
    table.caption = f"held-out prompts: {counts}"
    return table


@toy_app.command("train")
def train(family: str = typer.Option(..., help=FAMILY_HELP),
          seed: int = typer.Option(None, help="training seed (default: the toy seed, 0)"),
          steps: int = typer.Option(None, min=1, help="optimiser steps (default: the toy recipe's)"),
          force: bool = typer.Option(False, "--force", help="retrain even when the toy is cached")) -> None:
    """Train toy-<family> on the field-edit task, save it to the cache, print held-out metrics."""
    import dataclasses

    from kvprobe.models import toy

    family = toy.toy_family(family)
    manifest = toy.read_manifest(family)
    if manifest is not None and not force:
        console.print(f"toy-{family} is already trained at {toy.toy_dir(family)} "
                      f"(seed {manifest['seed']}, {manifest['train']['steps']} steps); --force retrains it")
        console.print(metrics_table(f"toy-{family}: held-out", manifest["heldout"]))
        return
    recipe = toy.toy_recipe(family)
    if steps is not None:
        recipe = dataclasses.replace(recipe, steps=steps)
    with progress_bar() as bar:
        task = bar.add_task(f"toy-{family}", total=recipe.steps)

        def on_step(step: int, total: int, loss: float) -> None:
            bar.update(task, completed=step, description=f"toy-{family} loss {loss:.3f}")

        result = toy.train_toy(family, seed=toy.TOY_SEED if seed is None else seed, train=recipe, on_step=on_step,
                               progress=lambda msg: err_console.print(f"[dim]{msg}[/dim]"))
    m = result.manifest
    console.print(f"toy-{family} saved to {result.folder} ({m['train_wall_s']} s training, "
                  f"{m['eval_wall_s']} s evaluation, weights {m['weights_sha256'][:16]})")
    console.print(metrics_table(f"toy-{family}: held-out", m["heldout"]))
    if m["heldout_failures"]:
        err_console.print(f"[yellow]below threshold: {'; '.join(m['heldout_failures'])}[/yellow]")


@toy_app.command("eval")
def evaluate(family: str = typer.Option(..., help=FAMILY_HELP),
             n: int = typer.Option(400, min=10, help="held-out cases (a quarter are negative controls)"),
             seed: int = typer.Option(None, help="held-out seed (default: the toy evaluation seed)")) -> None:
    """Evaluate toy-<family> (trained first if it is not cached) on fresh held-out cases."""
    from kvprobe.cli.common import load_with_status
    from kvprobe.models import toy

    family = toy.toy_family(family)
    lm = load_with_status(f"toy-{family}")
    with err_console.status(f"evaluating toy-{family} on {n} held-out cases"):
        metrics = toy.evaluate_toy(lm, seed=toy.EVAL_SEED if seed is None else seed, n=n,
                                   n_unseen=max(20, n // 4))
    console.print(metrics_table(f"toy-{family}: held-out (seed {toy.EVAL_SEED if seed is None else seed})",
                                metrics))
