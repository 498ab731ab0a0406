"""``kvprobe toy``: train and evaluate the toy field-edit models (see :mod:`kvprobe.toys` and
:mod:`kvprobe.models.toy_folder`)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from kvprobe.catalog import toy_family_names
from kvprobe.cli import options as opt
from kvprobe.cli.common import console, err_console, load_with_status, progress_bar, say, usable_out
from kvprobe.errors import UsageError

toy_app = typer.Typer(help="Toy field-edit models: a small model of each family that decides by the field, "
                           "shipped with kvprobe and reproducible from its recipe in minutes.", no_args_is_help=True)

_TOYS = toy_family_names()  # every family file with a toy: key, read without torch
FAMILY_HELP = ", ".join(_TOYS[:-1]) + " or " + _TOYS[-1] if len(_TOYS) > 1 else "".join(_TOYS)


def metrics_table(title: str, metrics: dict) -> Table:
    """The held-out figures, one row each, with the threshold each must meet."""
    from kvprobe.toys.evaluate import METRICS, THRESHOLDS

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


def comparison_table(title: str, retrained: dict, shipped: dict) -> Table:
    """A retrained toy's held-out figures beside the shipped toy's."""
    from kvprobe.toys.evaluate import compare_heldout

    table = Table(title=title)
    for col in ("metric", "retrained", "shipped", "difference"):
        table.add_column(col)
    for key, mine, theirs, diff in compare_heldout(retrained, shipped):
        table.add_row(key, f"{mine:.3f}", f"{theirs:.3f}", f"{diff:+.3f}")
    return table


@toy_app.command("train")
def train(family: str = typer.Option(..., help=FAMILY_HELP),
          seed: int = typer.Option(None, help="training seed (default: the toy seed, 0)"),
          steps: int = typer.Option(None, min=1, help="optimiser steps (default: the toy recipe's)"),
          out: Path = typer.Option(None, help="folder to save it to (default $KVPROBE_HOME/models/toy-<family>)"),
          force: bool = typer.Option(False, "--force", help="retrain even when that folder holds a toy"),
          heldout: int = typer.Option(400, "--heldout", min=10,
                                      help="held-out cases evaluated after training (the shipped toys': 400)")) -> None:
    """Reproduce toy-<family> from its recipe, save it, and compare its held-out figures with the shipped toy's.

    The shipped toy-<family> is not replaced: load the retrained one with --model <folder>.
    """
    import dataclasses

    from kvprobe.models import toy_folder
    from kvprobe.paths import writable
    from kvprobe.toys import train as toy_train

    family = toy_folder.toy_family(family)
    folder = usable_out(out) if out is not None else toy_folder.toy_dir(family)
    manifest = toy_folder.read_manifest(folder)
    if manifest is not None and not force:
        ignored = [name for name, value in (("--seed", seed), ("--steps", steps),
                                            ("--heldout", None if heldout == 400 else heldout)) if value is not None]
        if ignored:
            given = " and ".join(ignored)
            raise UsageError(f"{folder} already holds toy-{manifest['family']}, so {given} would be ignored; add "
                             f"--force to retrain it with {given}, or give another --out")
        console.print(f"{folder} already holds toy-{manifest['family']} (seed {manifest['seed']}, "
                      f"{manifest['train']['steps']} steps); --force retrains it")
        console.print(metrics_table(f"{folder}: held-out", manifest["heldout"]))
        return
    writable(folder)  # a home (or --out) that cannot be written: one line now, not after minutes of training
    recipe = toy_train.toy_recipe(family)
    if steps is not None:
        recipe = dataclasses.replace(recipe, steps=steps)
    say(f"toy-{family}", f"training {recipe.steps} steps of {recipe.batch_size} prompts on {recipe.threads} "
                         f"thread(s), then a held-out evaluation (about 2-3 minutes on 2 cores)")
    with progress_bar() as bar:
        task = bar.add_task(f"toy-{family}", total=recipe.steps)

        def on_step(step: int, total: int, loss: float) -> None:
            bar.update(task, completed=step, description=f"toy-{family} loss {loss:.3f}")
            if not err_console.is_terminal and (step % 200 == 0 or step == total):
                say(f"toy-{family}", f"step {step}/{total}, loss {loss:.3f}")

        result = toy_train.train_toy(family, seed=toy_folder.TOY_SEED if seed is None else seed, train=recipe,
                                     on_step=on_step, out=folder, n_eval=heldout,
                                     progress=lambda msg: say(f"toy-{family}", msg))
    m = result.manifest
    console.print(f"toy-{family} saved to {result.folder} ({m['train_wall_s']} s training, "
                  f"{m['eval_wall_s']} s evaluation, weights {m['weights_sha256'][:16]})")
    console.print(metrics_table(f"toy-{family}: held-out", m["heldout"]))
    shipped = toy_folder.read_manifest(toy_folder.shipped_dir(family))
    if shipped is not None and m["heldout"].get("acc_old") is not None:
        console.print(comparison_table(f"toy-{family}: retrained against shipped", m["heldout"], shipped["heldout"]))
        same = "identical to" if m["weights_sha256"] == shipped["weights_sha256"] else "different from"
        console.print(f"weights {same} the shipped toy's (trained on {shipped.get('machine', {}).get('cpu', '?')}; "
                      f"this machine: {m['machine']['cpu']})", soft_wrap=True)
    console.print(f"use it with --model {result.folder}")
    if m["heldout_failures"]:
        err_console.print(f"[yellow]below threshold: {'; '.join(m['heldout_failures'])}; kvprobe refuses this toy "
                          f"unless --allow-failed-toy is given[/yellow]", soft_wrap=True)


@toy_app.command("eval")
def evaluate(family: str = typer.Option(None, help=FAMILY_HELP + " (the shipped toy)"),
             folder: Path = typer.Option(None, help="a toy folder made by `kvprobe toy train`, instead of --family"),
             n: int = typer.Option(400, min=10, help="held-out cases (a quarter are negative controls)"),
             seed: int = typer.Option(None, help="held-out seed (default: the toy evaluation seed)"),
             dtype: opt.Dtype = "float32",
             allow_failed_toy: opt.AllowFailedToy = False) -> None:
    """Evaluate a toy (the shipped toy-<family>, or --folder) on fresh held-out cases."""
    from kvprobe.models.toy_folder import toy_family
    from kvprobe.toys.evaluate import EVAL_SEED, evaluate_toy

    if (family is None) == (folder is None):
        raise UsageError("give exactly one of --family (the shipped toy) and --folder (a retrained toy)")
    spec = f"toy-{toy_family(family)}" if family else str(folder)
    # --dtype only: the held-out batches (kvprobe.toys.evaluate) are built on cpu, where a toy runs
    lm = load_with_status(spec, dtype, allow_failed_toy=allow_failed_toy)
    seed = EVAL_SEED if seed is None else seed
    with err_console.status(f"evaluating {spec} on {n} held-out cases"):
        metrics = evaluate_toy(lm, seed=seed, n=n, n_unseen=max(20, n // 4))
    console.print(metrics_table(f"{spec}: held-out (seed {seed})", metrics))
