"""``kvprobe calibrate``: a per-field repair policy for the user's own template (docs/calibrate.md)."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.table import Table

from kvprobe.cli import options as opt
from kvprobe.cli.common import console, err_console, executor_for, load_with_status, progress_bar, usable_out


def calibrate(ctx: typer.Context, spec: Path = typer.Argument(..., help="a calibration spec (YAML: template, fields, question, options, "
                                                    "system); examples/calibrate-toy.yaml"),
              model: opt.Model = opt.DEFAULTS["model"],
              candidates: str = typer.Option("field_only,erratum_turn:neutral,erratum_turn",
                                             help="the repairs to measure, cheapest first (comma-separated specs)"),
              threshold: opt.Threshold = opt.DEFAULTS["threshold"],
              max_pairs: int = typer.Option(200, min=1, help="oracle-checked pairs per field at most"),
              oracle: str = typer.Option("prefix", help="how each pair's oracle is computed: prefix (the old "
                                                        "prompt's cache up to the field, the new prompt prefilled "
                                                        "from there: a serving engine's prefix cache) or full (a "
                                                        "full prefill of the new prompt)"),
              procedure: str = typer.Option("chain", help="how the candidates are tested: chain (the cheapest "
                                                           "first; once it is ruled out the next, measured back "
                                                           "over the pairs so far) or shared (every candidate on "
                                                           "every pair, their error shared); docs/calibrate.md"),
              seed: opt.Seed = 0, form: opt.Form = opt.DEFAULTS["form"],
              dtype: opt.Dtype = "float32", device: opt.Device = "cpu", device_map: opt.DeviceMap = "none",
              allow_failed_toy: opt.AllowFailedToy = False, out: opt.Out = None,
              executor: opt.Executor = "serial", workers: opt.Workers = 2, ray_address: opt.RayAddress = None,
              gpus_per_worker: opt.GpusPerWorker = 0.0, threads_per_worker: opt.ThreadsPerWorker = 1,
              retries: opt.Retries = 2) -> None:
    """Learn which repair each field of a template needs: per field, how often an edit changes the
    oracle's decision, each candidate's agreement and spurious flips with intervals valid under
    early stopping, and the chosen repair. Writes field_policy.yaml (read by auto, EditableContext
    and diagnose --policy), calibration.parquet and calibration_summary.parquet.

    Exits 1 when a field's verdict is not established within --max-pairs (the policy then gives
    that field the oracle).
    """
    from kvprobe import field_policy
    from kvprobe.calibrate.batch import DEFAULT_PAIR_BATCH
    from kvprobe.calibrate.engine import (CALIBRATE_MANIFEST, CALIBRATION, POLICY_FILE, SUMMARY, load_spec,
                                          calibrate as run_calibration)
    from kvprobe.editor.strategies import parse_strategy
    from kvprobe.errors import CheckFailed
    from kvprobe.experiment import Experiment
    from kvprobe.results import CALIBRATE_CLAIM, atomic_write_parquet
    from kvprobe.calibrate.engine import ORACLES, PROCEDURES, check_choice, pair_key
    from kvprobe.calibrate.stats import Sequence

    check_choice("oracle", oracle, ORACLES, "--")  # before any model is loaded
    check_choice("procedure", procedure, PROCEDURES, "--")
    specs = [parse_strategy(s).spec for s in opt.parse_csv(candidates)]
    cal_spec = load_spec(spec)
    out = usable_out(out or opt.default_out("calibrate", model))
    # --max-pairs is not a claim setting: a field's pairs are drawn in one order whatever the budget,
    # so a rerun with a larger budget continues where the last one stopped. The spec's digest is of
    # its content (its keys sorted); the draws also follow the order fields: lists them, so that
    # order is claimed as well (a reordered spec would otherwise resume on another draw sequence)
    exp = Experiment("calibrate", out, CALIBRATE_CLAIM, {
        "model": model, "spec": cal_spec.digest(), "field_order": list(cal_spec.fields), "candidates": specs,
        "threshold": threshold, "seed": seed, "form": form, "oracle": oracle, "procedure": procedure},
        held="calibration with other settings", dtype=dtype)
    note = bf16_note(dtype, device)

    def load():
        if note:
            err_console.print(note, highlight=False, markup=False, soft_wrap=True)
        return load_with_status(model, dtype, device, allow_failed_toy=allow_failed_toy, device_map=device_map)

    opened = exp.open(load, executor=lambda: executor_for(ctx, executor, workers, ray_address, gpus_per_worker,
                                                          threads_per_worker, retries))
    lm, ex, folder = opened.lm, opened.executor, exp.folder
    first_look = Sequence(threshold=threshold, m=len(specs), chain=max_pairs if procedure == "chain" else 0).n0
    first = next(iter(cal_spec.fields))
    fresh = folder.parts(f"pairs/{first}").get(pair_key(0)) is None  # a resumed first pair costs nothing
    start = time.perf_counter()
    with ex, progress_bar() as bar:
        tasks = {first: bar.add_task(f"calibrating {first}", total=max_pairs)}

        def progress(name: str, done: int, total: int):
            if name not in tasks:  # a field's bar starts with its first pair, so its time left is its own
                tasks[name] = bar.add_task(f"calibrating {name}", total=max_pairs)
            bar.update(tasks[name], completed=done)
            if done == min(DEFAULT_PAIR_BATCH, max_pairs) and name == first and fresh:  # the first batch of pairs
                each = (time.perf_counter() - start) / done  # (computed together): what the whole template will cost
                err_console.print(projection(each, len(cal_spec.fields), min(first_look, max_pairs), max_pairs, done),
                                  highlight=False, markup=False, soft_wrap=True)

        cal = run_calibration(lm, cal_spec, candidates=specs, threshold=threshold, max_pairs=max_pairs, seed=seed,
                              form=form, parts=lambda name: folder.parts(f"pairs/{name}"), progress=progress,
                              executor=ex, oracle=oracle, procedure=procedure,
                              say=lambda line: err_console.print(line, highlight=False, markup=False, soft_wrap=True))
    atomic_write_parquet(cal.rows, out / CALIBRATION)
    atomic_write_parquet(cal.summary, out / SUMMARY)
    policy_path = field_policy.write(cal.policy, out / POLICY_FILE)
    exp.finish(CALIBRATE_MANIFEST, kvprobe_calibrate=1, spec=str(spec), template=cal.policy["template"],
               settings=folder.settings, method=cal.policy["method"], prefix_tokens_saved=cal.prefix_tokens_saved,
               executor={**ex.describe(), "pairs_measured_unused": cal.wasted}, reads=cal.reads,
               pair_batch={"size": cal.pair_batch, "states_unused": cal.states_unused,
                           "states_reused": cal.states_reused, "single_read_s": cal.single_read_s},
               fields={f.name: {"pairs": f.pairs, "skipped": f.skipped, "seconds": round(f.seconds, 1),
                                "oracle_prefix_share": _share_of(cal.summary, f.name)} for f in cal.fields})
    print_table(cal, model, threshold)
    if cal.wasted:
        console.print(f"{executor}: {cal.wasted} pair(s) measured past a field's stopping point were not counted "
                      f"(the rule reads pairs in the order drawn, as a serial run; their parts are kept)",
                      highlight=False, markup=False)
    console.print(f"wrote {policy_path} (use it: --policy / EditableContext(policy=...) / auto:{policy_path})")
    open_fields = [f.name for f in cal.fields if f.verdict == "budget"]
    unmeasurable = [f.name for f in cal.fields if f.verdict == "unmeasurable"]
    if open_fields or unmeasurable:
        said = []
        if open_fields:
            said.append(f"no verdict within {max_pairs} pairs for {', '.join(open_fields)} (rerun with a larger "
                        f"--max-pairs into the same --out to continue)")
        if unmeasurable:
            said.append(f"{', '.join(unmeasurable)} could not be measured (its values tokenise to different lengths: "
                        f"give values of equal token length)")
        them = "it" if len(open_fields + unmeasurable) == 1 else "them"
        raise CheckFailed(f"{'; '.join(said)}: the policy gives {them} the oracle")


def bf16_note(dtype: str, device: str) -> str | None:
    """The one-line note for bfloat16 asked of a CPU that emulates it (None where it is native, or
    not asked for)."""
    from kvprobe.hardware import cpu_line, native_bf16

    if dtype != "bfloat16" or device != "cpu" or native_bf16():
        return None
    return (f"note: this CPU has no native bfloat16 ({cpu_line().removeprefix('CPU: ')}): torch emulates it, several "
            f"times slower than float32 here; --dtype float32 is the fast choice on it")


def projection(each: float, fields: int, settled: int, max_pairs: int, first: int = 1) -> str:
    """What the whole template will cost at the rate of its ``first`` pairs (``each`` seconds a pair): each field
    settled at its first look (``settled`` pairs: the cheapest candidate agreeing on every one), and at most at
    the budget."""
    def span(s: float) -> str:
        return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"

    took = f"the first pair took {each:.1f} s" if first == 1 else f"the first {first} pairs took {each:.1f} s a pair"
    return (f"{took} (the shared prefix's prefill included): the template's {fields} "
            f"field{'s' if fields > 1 else ''} take about {span(each * settled * fields)} if each is settled at "
            f"{settled} pairs, at most {span(each * max_pairs * fields)} at --max-pairs {max_pairs} (a field whose "
            f"cheapest candidate is ruled out takes more pairs; a candidate's own cost differs)")


def _share_of(summary, name: str):
    """The field's oracle prefix share (None where no pair was measured)."""
    got = summary.loc[summary.field == name, "oracle_prefix_share"]
    return None if got.empty or got.isna().all() else round(float(got.iloc[0]), 4)


def print_table(cal, model: str, threshold: float) -> None:
    """Per field and candidate: each share as ``k/n [lo, hi]`` (the confidence sequence's
    interval), spurious flips with the upper end of theirs, cost, and the verdict; ``*`` marks the
    repair the policy gives the field."""
    def share(value, lo, hi, n) -> str:
        return "-" if not n else f"{round(value * n)}/{n} [{lo:.2f}, {hi:.2f}]"

    table = Table(title=f"per-field calibration: {model} (threshold {threshold:g}; intervals: confidence sequence)")
    for col in ("field", "relevance", "pairs", "strategy", "agrees with oracle", "on changed pairs",
                "spurious flips", "recomputed", "ms (oracle)", "verdict"):
        table.add_column(col, justify="left" if col in ("field", "strategy", "relevance", "verdict") else "right")
    for res in cal.fields:
        rel = cal.policy["fields"][res.name]["relevance"]
        for i, r in enumerate(cal.summary[cal.summary.field == res.name].itertuples()):
            flips = "-" if not r.n_unchanged else f"{r.spurious_flips}/{r.n_unchanged} (<= {r.flip_hi:.2f})"
            ms = ("-" if r.to_decision_s != r.to_decision_s
                  else f"{1000 * r.to_decision_s:.0f} ({1000 * r.oracle_s:.0f})")
            table.add_row(res.name if i == 0 else "", rel if i == 0 else "", str(res.pairs) if i == 0 else "",
                          ("* " if r.chosen else "  ") + r.strategy, share(r.agree, r.agree_lo, r.agree_hi, r.n),
                          share(r.agree_changed, r.agree_changed_lo, r.agree_changed_hi, r.n_changed), flips,
                          f"{r.frac_recomputed:.1%}" if r.frac_recomputed == r.frac_recomputed else "-", ms,
                          r.verdict)
    console.print(table)
    for res in cal.fields:
        console.print(f"{res.name}: {res.chosen} ({res.verdict}): {res.reason}", highlight=False, markup=False)


def check_policy(policy: Path = typer.Argument(..., help="a field_policy.yaml (from `kvprobe calibrate`)"),
                 spec: Path = typer.Option(None, help="the calibration spec it is to be applied to: the policy must "
                                                      "have been calibrated on it")) -> None:
    """Check a field policy before deploying it: every verdict is recomputed from the counts the file
    records (the bounds at its threshold, the field's relevance, the repair by the calibration's rule),
    and with --spec the template it was calibrated on must be that spec. Exits 3, in one line, on the
    first thing that does not hold; 0 with a line per field when all do. What it checks is evidence,
    not a signature: a file whose counts were all rewritten consistently is not caught."""
    from kvprobe import yamlio
    from kvprobe.calibrate.spec import load_spec
    from kvprobe.editor.strategies import parse_strategy
    from kvprobe.errors import KvprobeError
    from kvprobe.field_policy import verify

    if not policy.is_file():
        raise KvprobeError(f"field policy not found: {policy}" if not policy.exists() else
                           f"field policy {policy} is not a file")
    try:
        text = policy.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KvprobeError(f"{policy} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    checked = verify(yamlio.load(text, str(policy)), policy, parse_strategy)
    if spec is not None:
        checked.check_spec(load_spec(spec))
    m = checked.model
    console.print(f"{policy}: verified, for {m['spec']} ({m['family']}; weights {m['weights_hash']}), template "
                  f"{checked.template.get('path')} (digest {checked.template.get('sha256')})"
                  + (f", which is {spec}" if spec is not None else ""), highlight=False, markup=False)
    for name, f in checked.fields.items():
        console.print(f"{name}: {f['repair']} ({f['verdict']}, {f['relevance']}, {f['pairs']} pairs): {f['reason']}",
                      highlight=False, markup=False)
