"""``kvprobe validate``: the correctness gate for composed caches.

Composes the composition dataset's skills (precompiled behind the shared preamble, saved to and
loaded back from the block store), for every seam width s, with and without re-rotation, and
compares each composed context with a full recompute. Exits 1 when the 95% Wilson lower bound of
decision agreement at the gated seam (with re-rotation) falls below the threshold (a one-line
:class:`GateFailed`): a point estimate on a few queries passes nothing.
"""

from __future__ import annotations

import typer
from rich.table import Table

from kvprobe.cli import options as opt
from kvprobe.cli.common import console, executor_for, load_with_status, progress_bar, progress_of, usable_out
from kvprobe.defaults import GATE_SEAM, GATE_THRESHOLD
from kvprobe.errors import CheckFailed, UsageError


class GateFailed(CheckFailed):
    """Agreement at the gated seam fell below the threshold (exit status 1)."""


def validate(ctx: typer.Context, model: opt.Model = opt.DEFAULTS["model"],
             n: int = typer.Option(50, min=1, help="decision queries"),
             seed: opt.Seed = 0,
             seams: str = typer.Option("0,1,2,4,8,16,32", help="comma-separated seam-repair widths s, each >= 0"),
             seam: int = typer.Option(GATE_SEAM, min=0, help="the gated seam width"),
             threshold: float = typer.Option(GATE_THRESHOLD, min=0.0, max=1.0,
                                             help="minimum lower bound (95% Wilson) of agreement with full "
                                                  "recompute at --seam"),
             block_tokens: str = typer.Option("200,400", help="min,max tokens per skill block"),
             blocks: str = typer.Option("1,4", help="min,max blocks per context"),
             form: opt.Form = opt.DEFAULTS["form"],
             attn: str = typer.Option("eager", help="attention implementation: eager or sdpa"),
             store: bool = typer.Option(True, help="save every block to <out>/blocks and compose from the files"),
             images: int = typer.Option(0, min=0, help="image blocks per query, after its lead (a model with M-RoPE "
                                                       "and a vision tower: tiny-qwen2_vl); generated images"),
             dtype: opt.Dtype = "float32", device: opt.Device = "cpu", device_map: opt.DeviceMap = "none",
             allow_failed_toy: opt.AllowFailedToy = False,
             out: opt.Out = None, executor: opt.Executor = "serial", workers: opt.Workers = 2,
             ray_address: opt.RayAddress = None, gpus_per_worker: opt.GpusPerWorker = 0.0,
             threads_per_worker: opt.ThreadsPerWorker = 1, retries: opt.Retries = 2) -> None:
    """Composed caches against full recompute: agreement, cosine and KL for every seam width.

    Exits 1 when the 95% lower bound of agreement at --seam (re-rotated) is below --threshold.
    """
    import time

    from kvprobe.composer.blocks import check_composable
    from kvprobe.composer.gate import run_compose, summarize_compose
    from kvprobe.datasets.skills import check_options
    from kvprobe.repair_rule import cases_to_establish, clears
    from kvprobe.composer.images import check_mrope
    from kvprobe.experiment import Experiment, Step
    from kvprobe.results import COMPOSE, COMPOSE_MANIFEST, VALIDATE_CLAIM, atomic_write_parquet, version_entry

    seam_list = sorted(set(opt.parse_ints(seams, "--seams")) | {seam})
    bt, nb = opt.parse_ints(block_tokens, "--block-tokens", count=2), opt.parse_ints(blocks, "--blocks", count=2)
    check_options(n, tuple(bt), tuple(nb))
    if attn not in ("eager", "sdpa"):
        raise UsageError(f"unknown --attn {attn!r}; accepted: eager, sdpa")
    out = usable_out(out or opt.default_out("validate", model))
    # what the per-query parts depend on; a rerun into the same --out resumes only if it matches
    config = {"model": model, "n": n, "seed": seed, "seams": seam_list, "block_tokens": bt, "n_blocks": nb,
              "form": form, "attn": attn, "store": store, **({"images": images} if images else {})}
    exp = Experiment("validate", out, VALIDATE_CLAIM, config, held="validate run with other settings", dtype=dtype)
    # its queries come from the seed, a claim setting; the model from its content
    opened = exp.open(lambda: load_with_status(model, dtype, device, attn=attn, allow_failed_toy=allow_failed_toy,
                                               device_map=device_map),
                      executor=lambda: executor_for(ctx, executor, workers, ray_address, gpus_per_worker,
                                                    threads_per_worker, retries),
                      checks=[check_composable, *([lambda lm: check_mrope(lm, "--images")] if images else [])])
    lm, ex = opened.lm, opened.executor
    start = time.perf_counter()
    with ex, progress_bar() as bar:
        pre = bar.add_task("precompiling skills" + (" and images" if images else ""), total=None)

        def compose(parts, tick):
            return run_compose(lm, n=n, seed=seed, seams=seam_list, block_tokens=tuple(bt), n_blocks=tuple(nb),
                               form=form, store_dir=out / "blocks" if store else None, model_name=model,
                               parts=parts, on_query=tick,
                               on_precompile=lambda i, total: bar.update(pre, completed=i, total=total), executor=ex,
                               images=images)

        df = exp.step(Step("compose", f"composing {n} queries x {len(seam_list)} seams x 2", compose, total=n,
                           collect=False), progress=progress_of(bar))
    path = atomic_write_parquet(df, out / COMPOSE)
    summary = summarize_compose(df)
    exp.finish(COMPOSE_MANIFEST, **version_entry(COMPOSE_MANIFEST), command="validate", n=n, seed=seed,
               seams=seam_list, gated_seam=seam, threshold=threshold, block_tokens=bt, n_blocks=nb, form=form,
               attn=attn, images=images, wall_s=time.perf_counter() - start,
               summary=summary.to_dict("records"), executor=ex.describe())
    table = Table(title=f"composed vs full recompute: {model} ({df.query_id.nunique()} queries, "
                        f"{int(df.context_tokens.median())} median context tokens)")
    for col in ("re-rotate", "seam s", "n", "agreement [95% CI]", "top-1", "cosine [95% CI]", "KL", "ms"):
        table.add_column(col, justify="right")
    for r in summary.itertuples():
        table.add_row("yes" if r.rerotate else "no", str(r.seam), str(r.n),
                      f"{r.agreement:.3f} [{r.agreement_lo:.2f}, {r.agreement_hi:.2f}]", f"{r.top1_agreement:.3f}",
                      f"{r.cosine:.4f} [{r.cosine_lo:.4f}, {r.cosine_hi:.4f}]", f"{r.kl:.4f}", f"{1000 * r.wall_s:.0f}")
    console.print(table)
    console.print(f"wrote {path}")
    gated = summary[(summary.seam == seam) & summary.rerotate].iloc[0]
    agreement, lo, hi, k = float(gated.agreement), float(gated.agreement_lo), float(gated.agreement_hi), int(gated.n)
    stated = f"agreement {agreement:.3f} [{lo:.2f}, {hi:.2f}] (n={k}) at s={seam} (re-rotated)"
    if not clears(lo, threshold):
        need = cases_to_establish(threshold)
        short = ("" if agreement < 1 else f"; all {k} agreeing would need n >= {need}" if need
                 else "; no number of queries reaches a lower bound of 1")
        console.print(f"[bold red]FAIL[/bold red]: {stated}: its lower bound is below the threshold {threshold:g}"
                      f"{short}")
        raise GateFailed(f"validate {model}: {stated} with full recompute: the lower bound {lo:.2f} is below the "
                         f"threshold {threshold:g}{short}")
    console.print(f"[bold green]PASS[/bold green]: {stated}: its lower bound >= {threshold:g}")
