"""``kvprobe weight-edit``: a LoRA weight edit per decision case (through peft) beside the KV repairs,
on the same cases: agreement with the oracle, time to the edited decision, setup, and contamination
of other requests served by the same weights (docs/weight-edit.md)."""

from __future__ import annotations

import math
from typing import Annotated

import typer
from rich.table import Table

from kvprobe.cli import options as opt
from kvprobe.cli.common import console, load_with_status, progress_bar, progress_of, usable_out
from kvprobe.errors import UsageError, no_case_to_judge

KV_DEFAULT = "stale,field_only,erratum,field_erratum,oracle"  # kvprobe.weight_edit.DEFAULT_KV_STRATEGIES (a test)

KvStrategies = Annotated[str, typer.Option("--strategies", help=(
    f"comma-separated KV repair specs measured beside the LoRA edit (default: {KV_DEFAULT}); grammar: "
    f"{opt.STRATEGY_GRAMMAR}"))]
LoraRank = Annotated[int, typer.Option("--lora-rank", min=1, help="rank r of the LoRA adapter on the attention "
                                                                  "projections")]
LoraAlpha = Annotated[float, typer.Option("--lora-alpha", help="LoRA alpha (the update "
                                                                                       "is scaled by alpha / r)")]
LoraTargets = Annotated[str, typer.Option("--lora-targets", help="comma-separated attention projections the "
                                                                 "adapter wraps, of q, k, v, o")]
Steps = Annotated[int, typer.Option("--steps", min=1, help="most Adam steps per edit (the fit stops earlier once "
                                                           "the stale prompt gives the oracle's decision)")]
Lr = Annotated[float, typer.Option("--lr", help="Adam's learning rate")]
EarlyStop = Annotated[bool, typer.Option("--early-stop/--no-early-stop", help="stop a fit once the edited "
                                                                              "decision is reached")]
ContaminationCases = Annotated[int, typer.Option("--contamination-cases", min=0, help=(
    "other cases (a fixed seeded sample) whose old and new prompts are read with each adapter active; the "
    "decisions that change against the base model are its contamination (0: not measured)"))]


def weight_edit(model: opt.Model = opt.DEFAULTS["model"], dataset: opt.Dataset = "default",
                strategies: KvStrategies = KV_DEFAULT, n: opt.N = opt.DEFAULTS["n"], seed: opt.Seed = 0,
                form: opt.Form = opt.DEFAULTS["form"], few_shot: opt.FewShot = 0,
                min_flip: opt.MinFlip = opt.DEFAULTS["min_flip"], lora_rank: LoraRank = 8,
                lora_alpha: LoraAlpha = 16.0, lora_targets: LoraTargets = "q,k,v,o", steps: Steps = 50,
                lr: Lr = 1e-2, early_stop: EarlyStop = True, contamination_cases: ContaminationCases = 8,
                dtype: opt.Dtype = "float32", device: opt.Device = "cpu", device_map: opt.DeviceMap = "none",
                allow_failed_toy: opt.AllowFailedToy = False, out: opt.Out = None) -> None:
    """Fit a LoRA per valid decision case so the stale prompt gives the oracle's decision, beside the KV
    repairs; writes weight_edits.parquet and prints the summary.

    Exits 1 when no decision case is valid (the model answers none correctly under both values).
    """
    from pydantic import ValidationError

    from kvprobe.config import RunConfig, load_cases
    from kvprobe.experiment import Experiment, Step
    from kvprobe.models.fingerprint import weights_sha256
    from kvprobe.results import WEIGHT_EDIT_CLAIM, WEIGHT_EDITS
    from kvprobe.weight_edit import LoraSettings, require_peft, run_weight_edits, target_modules

    try:
        cfg = RunConfig(model=model, dataset=dataset, strategies=opt.parse_csv(strategies), n=n, seed=seed, cot=[0],
                        form=form, few_shot=few_shot, min_flip=min_flip, probes=[], dtype=dtype, device=device,
                        device_map=device_map)
    except ValidationError as exc:
        raise UsageError.from_validation(exc, "weight-edit") from None
    settings = LoraSettings(rank=lora_rank, alpha=lora_alpha, lr=lr, steps=steps,
                            targets=tuple(opt.parse_csv(lora_targets)), early_stop=early_stop, seed=seed)
    opt.generated_only(dataset, few_shot=few_shot != 0)
    out = usable_out(out or opt.default_out("weight-edit", model))
    settings_claim = {"command": "weight-edit", "model": model, "dataset": dataset, "n": cfg.n, "seed": seed,
                      "strategies": cfg.strategies, "form": form, "few_shot": few_shot, "min_flip": min_flip,
                      "lora_rank": lora_rank, "lora_alpha": lora_alpha, "lora_targets": list(settings.targets),
                      "steps": steps, "lr": lr, "early_stop": early_stop, "contamination_cases": contamination_cases}
    exp = Experiment("weight-edit", out, WEIGHT_EDIT_CLAIM, settings_claim,
                     held="kvprobe weight-edit with other settings", dtype=dtype)
    strategies_ = cfg.edit_strategies()
    # a family whose projections are not linear layers: refused before the claim
    opened = exp.open(lambda: load_with_status(model, dtype, device, allow_failed_toy=allow_failed_toy,
                                               device_map=device_map),
                      before=[require_peft], cases=lambda: load_cases(cfg), align=(cfg.form, strategies_, [0]),
                      checks=[lambda lm: target_modules(lm, settings.targets)])
    lm, cases = opened.lm, opened.cases
    base_hash = lm.fingerprint()["weights_hash"]

    def weight_edits(store, tick):
        return run_weight_edits(lm, cases, strategies_, settings, contamination_cases, form, min_flip, seed,
                                model_name=model, store=store, on_case=tick)

    with progress_bar() as bar:
        df, skipped = exp.step(Step("weight_edits", f"weight-editing {len(opened.aligned)} cases (KV repairs and a "
                                    f"LoRA edit each)", weight_edits, total=len(opened.aligned), collect=False),
                               progress=progress_of(bar))
    restored = weights_sha256(lm.model)[:16] == base_hash
    if not restored:  # a bug: lora_adapter unloads in finally and checks no LoRA module is left
        raise RuntimeError(f"{model}'s weights differ from the loaded ones after the LoRA edits were unloaded")
    path = exp.table("weight_edits")
    from kvprobe.reports.summary import write_summary

    summary = exp.finish("weight_edit_manifest.json", summarize=write_summary, **exp.folder.settings,
                         weights_restored=restored, loss="cross-entropy of the oracle's answer token",
                         skipped=[{"case_id": s.case_id, "reason": s.reason} for s in skipped])
    n_valid = print_summary(df, model)
    console.print(f"wrote {path} ({WEIGHT_EDITS}) and {summary}")
    if n_valid == 0:
        raise no_case_to_judge(model, path, dataset)


def print_summary(df, title: str) -> int:
    """Per arm over the valid decision cases: agreement [95% CI], median time to the edited decision and
    setup (ms), contamination [95% CI] (n); returns the number of valid decision cases."""
    from kvprobe.weight_edit import summarize_weight_edits

    if df.empty:
        console.print("[yellow]no aligned cases[/yellow]")
        return 0
    dec = df[df["kind"] == "decision"]
    n_valid = int(dec.loc[dec["valid"].astype(bool), "case_id"].nunique())
    console.print(f"{n_valid} of {dec['case_id'].nunique()} decision cases valid (the model answers correctly "
                  f"under both values); summary over valid decision cases")
    if not n_valid:
        return 0
    summ = summarize_weight_edits(df)
    table = Table(title=f"weight edit vs KV repairs: {title}")
    for col in ("arm", "n", "agreement [95% CI]", "to decision ms (median)", "setup ms (median)",
                "contamination [95% CI] (n)"):  # the CI: bootstrap over edited cases
        table.add_column(col, justify="left" if col == "arm" else "right")
    for r in summ.itertuples():
        if r.contamination_basis == "measured":
            cont = (f"{r.contamination:.3f} [{r.contamination_lo:.3f}, {r.contamination_hi:.3f}] "
                    f"({r.contamination_n} cases, {r.contamination_reads} reads)" if r.contamination_n
                    else "not measured (0)")
        else:
            cont = "0 (by construction: request-local)"
        setup = "-" if math.isnan(r.setup_s) else f"{1000 * r.setup_s:.1f}"
        table.add_row(r.strategy, str(r.n), f"{r.agreement:.2f} [{r.agreement_lo:.2f}, {r.agreement_hi:.2f}]",
                      f"{1000 * r.to_decision_s:.1f}", setup, cont)
    console.print(table)
    lora = summ[summ.method == "lora"]
    for r in lora.itertuples():
        console.print(f"{r.strategy}: median {r.steps:g} step(s); the edited decision reached in {r.reached:.0%} of "
                      f"cases; contamination is the mean over cases of each adapter's share of other prompts' "
                      f"decisions changed, its 95% CI a bootstrap over the cases (every adapter reads the same "
                      f"prompts)", highlight=False)
    return n_valid
