"""``kvprobe validate``: the correctness gate for composed caches.

Composes the composition dataset's skills (precompiled behind the shared preamble, saved to and
loaded back from the block store), for every seam width s, with and without re-rotation, and
compares each composed context with a full recompute. Exits 1 when decision agreement at the
gated seam (with re-rotation) falls below the threshold (a one-line :class:`GateFailed`).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from kvprobe.cli.common import ALLOW_FAILED_TOY_HELP, console, load_with_status, progress_bar
from kvprobe.errors import KvprobeError


class GateFailed(KvprobeError):
    """Agreement at the gated seam fell below the threshold (exit status 1)."""

    exit_code = 1


def _ints(value: str, what: str, count: int | None = None) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or (count is not None and len(out) != count):
        raise KvprobeError(f"bad {what} {value!r}; give {count or 'some'} comma-separated integers")
    return out


def validate(model: str = typer.Option(..., help="model spec, see `kvprobe models`"),
             n: int = typer.Option(50, min=1, help="decision queries"), seed: int = 0,
             seams: str = typer.Option("0,1,2,4,8,16,32", help="comma-separated seam-repair widths s"),
             seam: int = typer.Option(4, min=0, help="the gated seam width"),
             threshold: float = typer.Option(0.9, min=0.0, max=1.0,
                                             help="minimum agreement with full recompute at --seam"),
             block_tokens: str = typer.Option("200,400", help="min,max tokens per skill block"),
             blocks: str = typer.Option("1,4", help="min,max blocks per context"),
             form: str = typer.Option("auto", help="chat, raw or auto"),
             attn: str = typer.Option("eager", help="attention implementation: eager or sdpa"),
             store: bool = typer.Option(True, help="save every block to <out>/blocks and compose from the files"),
             allow_failed_toy: bool = typer.Option(False, "--allow-failed-toy", help=ALLOW_FAILED_TOY_HELP),
             out: Path = typer.Option(Path("results/validate"), help="results folder")) -> None:
    """Composed caches against full recompute: agreement, cosine and KL for every seam width."""
    import time

    from kvprobe.composer.gate import run_compose, summarize_compose
    from kvprobe.results import COMPOSE, CaseStore, atomic_write_json, atomic_write_parquet, claim_folder

    seam_list = sorted(set(_ints(seams, "--seams")) | {seam})
    bt, nb = _ints(block_tokens, "--block-tokens", 2), _ints(blocks, "--blocks", 2)
    # what the per-query parts depend on; a rerun into the same --out resumes only if it matches
    config = {"model": model, "n": n, "seed": seed, "seams": seam_list, "block_tokens": bt, "n_blocks": nb,
              "form": form, "attn": attn, "store": store}
    out.mkdir(parents=True, exist_ok=True)
    claim_folder(out, "validate_config.json", config, held="validate run with other settings")
    lm = load_with_status(model, attn=attn, allow_failed_toy=allow_failed_toy)
    start = time.perf_counter()
    with progress_bar() as bar:
        pre = bar.add_task("precompiling skills", total=None)
        task = bar.add_task(f"composing {n} queries x {len(seam_list)} seams x 2", total=n)
        df = run_compose(lm, n=n, seed=seed, seams=seam_list, block_tokens=tuple(bt), n_blocks=tuple(nb),
                         form=form, store_dir=out / "blocks" if store else None, model_name=model,
                         parts=CaseStore(out, "compose"), on_query=lambda: bar.advance(task),
                         on_precompile=lambda i, total: bar.update(pre, completed=i, total=total))
    path = atomic_write_parquet(df, out / COMPOSE)
    summary = summarize_compose(df)
    atomic_write_json({"command": "validate", "model": lm.fingerprint(), "n": n, "seed": seed, "seams": seam_list,
                       "gated_seam": seam, "threshold": threshold, "block_tokens": bt, "n_blocks": nb,
                       "form": form, "attn": attn, "wall_s": time.perf_counter() - start,
                       "summary": summary.to_dict("records")}, out / "compose_manifest.json")
    table = Table(title=f"composed vs full recompute: {model} ({df.query_id.nunique()} queries, "
                        f"{int(df.context_tokens.median())} median context tokens)")
    for col in ("re-rotate", "seam s", "n", "agreement [95% CI]", "top-1", "cosine [95% CI]", "KL", "ms"):
        table.add_column(col, justify="right")
    for r in summary.itertuples():
        table.add_row("yes" if r.rerotate else "no", str(r.seam), str(r.n),
                      f"{r.agreement:.3f} [{r.agreement_lo:.2f}, {r.agreement_hi:.2f}]", f"{r.top1_agreement:.3f}",
                      f"{r.cosine:.4f} [{r.cosine_lo:.4f}, {r.cosine_hi:.4f}]", f"{r.kl:.4f}", f"{r.ms:.0f}")
    console.print(table)
    console.print(f"wrote {path}")
    gated = summary[(summary.seam == seam) & summary.rerotate]
    agreement = float(gated.agreement.iloc[0])
    if not agreement >= threshold:
        console.print(f"[bold red]FAIL[/bold red]: agreement {agreement:.3f} at s={seam} (re-rotated) is below "
                      f"the threshold {threshold:g}")
        # a KvprobeError, not typer.Exit: kvprobe.cli.app.main runs typer in non-standalone mode,
        # which returns (and so drops) an Exit's code
        raise GateFailed(f"validate {model}: agreement {agreement:.3f} with full recompute at s={seam} "
                         f"is below the threshold {threshold:g}")
    console.print(f"[bold green]PASS[/bold green]: agreement {agreement:.3f} at s={seam} (re-rotated) >= {threshold:g}")
