"""``kvprobe datasets``: list, show, generate and check field-edit datasets."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from kvprobe.cli import options as opt
from kvprobe.cli.common import console, err_console, load_with_status, progress_bar, usable_file
from kvprobe.defaults import LAYOUT_NAMES
from kvprobe.errors import UsageError

datasets_app = typer.Typer(help="Field-edit datasets: list domains, show and generate cases, check a model.",
                           no_args_is_help=True)


@datasets_app.command("list")
def list_domains() -> None:
    """The generator's gated domains, their decision fields and the negative-control fields."""
    from kvprobe.datasets import CONTROL_FIELDS, DOMAINS

    table = Table(title="field-edit domains")
    for col in ("domain", "decision fields (allow | deny values)", "controls"):
        table.add_column(col)
    for name, spec in DOMAINS.items():
        fields = "\n".join(f"{f.name}: {'/'.join(f.allow)} | {'/'.join(f.deny)}" for f in spec.fields)
        table.add_row(name, fields, ", ".join(CONTROL_FIELDS))
    console.print(table)


Layout = typer.Option("record", help=f"prompt layout: {', '.join(LAYOUT_NAMES)}")
FillerTokens = typer.Option(None, min=0, show_default="2-6 filler rules around the field",
                            help="about this many tokens of filler after the field, the field first (0 = none)")
FieldStyle = typer.Option("key", help="record keys as written (key: order_status) or in words (words: order status)")
RuleStyle = typer.Option("allow", help="the rule names the allowing values (allow) or the denying ones (deny)")


@datasets_app.command("show")
def show(dataset: opt.Dataset = "default", index: int = typer.Option(0, min=0, help="which case, from 0"),
         seed: opt.Seed = 0,
         model: str | None = typer.Option(None, help="show token spans under this model's tokenizer"),
         form: opt.Form = opt.DEFAULTS["form"], layout: str = Layout, filler_tokens: int | None = FillerTokens,
         field_style: str = FieldStyle, rule_style: str = RuleStyle) -> None:
    """Print one case: its prompt with the old value, the expected answers, and token spans."""
    from kvprobe.datasets import Skip, align, render_prompt, resolve_dataset

    knobs = {"layout": layout, "filler_tokens": filler_tokens, "field_style": field_style, "rule_style": rule_style}
    opt.generated_only(dataset, layout=layout != "record", filler_tokens=filler_tokens is not None,
                       field_style=field_style != "key", rule_style=rule_style != "allow", seed=seed != 0)
    cases = resolve_dataset(dataset, n=index + 1, seed=seed, **(knobs if dataset in (None, "default") else {}))
    if index >= len(cases):
        raise UsageError(f"index {index} is out of range; the dataset has {len(cases)} cases")
    case = cases[index]
    tokenizer = load_with_status(model).tokenizer if model else None
    expected = ("no expected answers" if case.expected_old is None
                else f"expected {case.expected_old} -> {case.expected_new}")
    console.print(f"[bold]{case.case_id}[/bold]  domain={case.domain} field={case.field} "
                  f"{case.old_value!r} -> {case.new_value!r}  {expected}"
                  f"{'  (negative control)' if case.control else ''}")
    console.print(render_prompt(case, tokenizer, case.old_value, form if tokenizer else "raw"), highlight=False,
                  markup=False)
    if tokenizer is not None:
        a = align(case, tokenizer, form)
        if isinstance(a, Skip):
            console.print(f"[yellow]skipped under this tokenizer:[/yellow] {a.reason}")
        else:
            kinds = {k: a.kinds[a.downstream[0]:a.downstream[1]].count(k) for k in sorted(set(a.kinds))}
            console.print(f"tokens={len(a.ids_old)} field={a.field} downstream={a.downstream} "
                          f"decision_pos={a.decision_pos} downstream kinds={kinds}")


@datasets_app.command("generate")
def generate_cmd(out: Path = typer.Option(..., help="JSONL file to write"),
                 n: int = typer.Option(100, min=1, help="cases to write"),
                 seed: int = typer.Option(0, help="the generator's seed (the same seed, the same cases)"),
                 few_shot: int = typer.Option(0, min=0, help="solved examples (from other domains) put before "
                                                             "each case's prompt"),
                 controls: float = typer.Option(0.2, help="share of control cases (an edit of a field that "
                                                          "should not change the decision)"),
                 cot: bool = typer.Option(False, help="ask for a chain of thought before the answer"),
                 layout: str = Layout, filler_tokens: int | None = FillerTokens,
                 field_style: str = FieldStyle, rule_style: str = RuleStyle) -> None:
    """Write generated cases as JSONL (one EditCase per line; see the README for the format)."""
    from kvprobe.datasets import generate, save_jsonl

    usable_file(out)
    path = save_jsonl(generate(n, seed=seed, few_shot=few_shot, controls=controls, cot=cot, layout=layout,
                               filler_tokens=filler_tokens, field_style=field_style, rule_style=rule_style), out)
    console.print(f"wrote {n} cases to {path}")


@datasets_app.command("check")
def check(model: opt.Model = opt.DEFAULTS["model"], dataset: opt.Dataset = "default", n: opt.N = opt.DEFAULTS["n"],
          seed: opt.Seed = 0, form: opt.Form = opt.DEFAULTS["form"], few_shot: opt.FewShot = 0,
          out: Path | None = typer.Option(None, help="also write the per-case table (parquet)"),
          per_case: bool = typer.Option(True, help="print the per-case table"),
          dtype: opt.Dtype = "float32", device: opt.Device = "cpu", device_map: opt.DeviceMap = "none") -> None:
    """Prefill every case with both values: accuracy, paired flip rate, logit shift, validity."""
    from kvprobe.datasets import require_answers, resolve_dataset
    from kvprobe.probes.field_following import summarize, validity_table

    opt.generated_only(dataset, few_shot=few_shot != 0, seed=seed != 0)
    if out is not None:
        usable_file(out)
    kwargs = {"few_shot": few_shot} if dataset in (None, "default") else {}
    cases = resolve_dataset(dataset, n=n, seed=seed, **kwargs)
    require_answers(cases, "kvprobe datasets check")
    lm = load_with_status(model, dtype, device, device_map=device_map)
    with progress_bar() as bar:
        task = bar.add_task(f"checking {len(cases)} cases on {model}", total=len(cases))
        df, skipped = validity_table(lm, cases, form=form, on_case=lambda i: bar.advance(task))
    if per_case and len(df):
        table = Table(title=f"validity per case: {model}")
        for col in ("case", "field", "old -> new", "expected", "predicted", "m old", "m new", "valid"):
            table.add_column(col)
        for r in df.itertuples():
            table.add_row(r.case_id, r.field + (" (ctl)" if r.control else ""), f"{r.old_value} -> {r.new_value}",
                          f"{r.expected_old} -> {r.expected_new}", f"{r.pred_old} -> {r.pred_new}",
                          f"{r.m_old:+.2f}", f"{r.m_new:+.2f}", "yes" if r.valid else "[red]no[/red]")
        console.print(table)
    s = summarize(df) if len(df) else {"n_cases": 0, "n_valid": 0}
    table = Table(title=f"validity overall: {model} (form={form}, few_shot={few_shot})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in s.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    table.add_row("skipped (alignment)", str(len(skipped)))
    console.print(table)
    for sk in skipped[:10]:
        err_console.print(f"[dim]skipped {sk.case_id}: {sk.reason}[/dim]")
    if out is not None:
        from kvprobe.results import atomic_write_parquet

        atomic_write_parquet(df, out)
        console.print(f"wrote {out}")
