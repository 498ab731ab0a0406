"""``kvprobe diagnose``: one prompt, one field, one or more new values: every repair and ``auto``
against the oracle, with agreement, margin, cost and time, and a recommendation."""

from __future__ import annotations

import json
import math
import string
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvprobe.cli import options as opt
from kvprobe.cli.common import console, emit_json, load_with_status, progress_bar
from kvprobe.defaults import DIAGNOSE_STRATEGIES
from kvprobe.errors import KvprobeError, UsageError

Prompt = Annotated[Path, typer.Argument(show_default=False, help=(
    "the prompt: a text file whose body has {name} placeholders (the field and any fixed values), or a JSONL "
    "case file, optionally with :LINE (default: its first case)"))]


def _pair(item: str) -> tuple[str, str]:
    name, eq, value = item.partition("=")
    if not eq or not name.strip():
        raise UsageError(f"bad --value {item!r}; give NAME=VALUE, e.g. --value tier=gold")
    return name.strip(), value


def _jsonl_case(prompt: Path):
    from kvprobe.datasets import load_jsonl

    path, _, line = str(prompt).rpartition(":") if str(prompt).rpartition(":")[2].isdigit() else (str(prompt), "", "")
    cases = load_jsonl(path)
    index = int(line) - 1 if line else 0
    if not 0 <= index < len(cases):
        raise UsageError(f"{path} has {len(cases)} cases; give :LINE between 1 and {len(cases)}")
    return cases[index]


def _template_case(prompt: Path, field: str | None, values: list[str], question: str | None,
                   options: list[str], system: str | None, new: list[str]):
    from pydantic import ValidationError

    from kvprobe.api import first_message
    from kvprobe.datasets import EditCase

    if prompt.is_dir():
        raise KvprobeError(f"{prompt} is a folder; give a prompt file: a text file with {{name}} placeholders or a "
                           f"JSONL case file")
    if not prompt.is_file():
        raise KvprobeError(f"{prompt}: no such prompt file; give a text file with {{name}} placeholders or a JSONL "
                           f"file")
    try:
        text = prompt.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvprobeError(f"{prompt}: cannot read the prompt as UTF-8 text ({exc})") from None
    try:
        names = [n for _, n, _, _ in string.Formatter().parse(text) if n is not None]
    except ValueError as exc:
        raise UsageError(f"{prompt}: not a template ({exc}); write {{name}} for a field, {{{{ and }}}} for braces") from None
    if field is None:
        raise UsageError(f"give --field NAME, the placeholder to edit; {prompt} has: {', '.join(names) or 'none'}")
    given: dict[str, str] = {}
    for name, value in map(_pair, values):
        if name in given:
            raise UsageError(f"--value {name}= is given twice ({given[name]!r} and {value!r}); give each "
                             f"placeholder's value once")
        given[name] = value
    if field not in given:
        raise UsageError(f"give the current value of the field: --value {field}=VALUE")
    if question is None:
        raise UsageError("give --question, the question whose answer is the decision (an erratum re-asks it)")
    body = text.rstrip("\n")
    if given[field] in new:
        raise UsageError(f"the new value {given[field]!r} of field '{field}' equals the old one; nothing to edit")
    try:
        return EditCase(case_id=prompt.stem or "prompt", domain="user", field=field, old_value=given.pop(field),
                        new_value=new[0], template=body, values=given, question=question, options=options,
                        system=system)
    except ValidationError as exc:
        raise UsageError(f"{prompt}: {first_message(exc)}") from None


def diagnose(prompt: Prompt, model: opt.Model = opt.DEFAULTS["model"],
             field: str = typer.Option(None, help="the field (placeholder) to edit; a JSONL case names its own"),
             new: str = typer.Option(None, help="comma-separated new values of the field (a JSONL case: default its "
                                                 "new_value)"),
             value: list[str] = typer.Option([], "--value", help="NAME=VALUE: the current value of a placeholder of "
                                                                 "a text prompt (the field's and every fixed one)"),
             question: str = typer.Option(None, help="a text prompt's question (the decision is its answer)"),
             options: str = typer.Option("", help="comma-separated answer options, two (default: the top token)"),
             system: str = typer.Option(None, help="a system message for a text prompt"),
             strategies: str = typer.Option(",".join(DIAGNOSE_STRATEGIES), help="comma-separated strategy specs "
                                            "(`kvprobe strategies`); stale, auto and oracle are always added"),
             policy: Path = typer.Option(None, help="a topk.yaml of this model (from `kvprobe export-topk`): auto "
                                                    "and selective:K:causal use it"),
             form: opt.Form = opt.DEFAULTS["form"],
             as_json: opt.Json = None,
             dtype: opt.Dtype = "float32", device: opt.Device = "cpu", device_map: opt.DeviceMap = "none",
             allow_failed_toy: opt.AllowFailedToy = False) -> None:
    """Diagnose one edit on your prompt: every strategy and auto against the oracle (agreement,
    margin, recomputed share, time to the decision) and the recommendation."""
    new_values = opt.parse_csv(new or "")
    option_list = opt.parse_csv(options)
    if option_list and len(option_list) != 2:
        raise UsageError(f"bad --options {options!r}; give two comma-separated answer options, or none")
    if str(prompt).endswith(".jsonl") or ".jsonl:" in str(prompt):
        for name, given, held in (("--question", question is not None, "question"),
                                  ("--system", system is not None, "system message"),
                                  ("--value", bool(value), "field values")):
            if given:
                raise UsageError(f"{name} is for a text prompt; a JSONL case holds its own {held} (edit the case, "
                                 f"or give a text prompt with {{name}} placeholders)")
        case = _jsonl_case(prompt)
        if option_list:
            case = case.model_copy(update={"options": option_list})
        new_values = new_values or [case.new_value]
    else:
        if not new_values:
            raise UsageError("give --new, the new value(s) of the field, comma-separated")
        case = _template_case(prompt, field, value, question, option_list, system, new_values)
    if field is not None and field != case.field:
        raise UsageError(f"--field {field!r} is not the field of this case ({case.field!r})")
    specs = opt.parse_csv(strategies)
    specs += [s for s in ("stale", "auto", "oracle") if not any(x.split(":")[0] == s for x in specs)]
    from kvprobe.api import diagnose_case, recommendation
    from kvprobe.editor.strategies import parse_strategy

    for s in specs:
        parse_strategy(s)  # a bad spec fails before the model loads
    lm = load_with_status(model, dtype, device, allow_failed_toy=allow_failed_toy, device_map=device_map)
    loaded = None
    if policy is not None:
        from kvprobe.editor.auto import load_policy

        loaded = load_policy(policy, lm)
        if hasattr(loaded, "check_case"):  # a field policy: of this prompt, or refused before any work
            loaded.check_case(case)
    with progress_bar() as bar:
        def start(total: int):
            task = bar.add_task(f"diagnosing {len(new_values)} value(s) x {len(specs)} strategies", total=total)
            return lambda: bar.advance(task)

        rows = diagnose_case(lm, case, new_values, specs, form, loaded, start=start)
    advice = recommendation(rows)
    if as_json:
        records = json.loads(rows.to_json(orient="records"))
        emit_json({"model": model, "case_id": case.case_id, "field": case.field, "old_value": case.old_value,
                   "rows": records, "recommendation": advice}, as_json)
        if as_json == "-":
            return
    _print(rows, f"{model}: {case.field} = {case.old_value!r} -> …")
    for line in advice:
        console.print(line, highlight=False, markup=False)


def _print(rows, title: str) -> None:
    table = Table(title=title)
    for col in ("new value", "strategy", "ran", "decision", "oracle", "agrees", "margin", "recomputed", "repair ms",
                "to decision ms"):
        table.add_column(col, justify="left" if col in ("new value", "strategy", "ran", "decision", "oracle")
                         else "right")
    for r in rows.itertuples():
        if isinstance(r.error, str):
            table.add_row(r.new_value, r.strategy, "-", "error", r.reference, "-", "-", "-", "-", r.error[:60])
            continue
        ms = lambda s: "-" if math.isnan(s) else f"{1000 * s:.0f}"  # noqa: E731
        table.add_row(r.new_value, r.strategy, r.chose, repr(r.pred), repr(r.reference),
                      "yes" if r.agree else "NO", f"{r.margin:.2f}",
                      f"{r.frac_recomputed:.1%} ({r.tokens_recomputed:.0f})", ms(r.wall_s), ms(r.to_decision_s))
    console.print(table)
