"""The options that ``run``, ``edit``, ``validate`` and ``datasets`` share: one definition each, so
the commands agree on names, defaults, ranges and help. Light: nothing here imports torch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvprobe import catalog
from kvprobe.defaults import (DEFAULT_BUDGET, DEFAULT_FORM, DEFAULT_MIN_FLIP, DEFAULT_MODEL, DEFAULT_N,
                              DEFAULT_STRATEGIES, DEFAULT_THRESHOLD, FORMS, THRESHOLD_RANGE)

# The built-in strategies' grammar and probes, from the light registry (kvprobe.catalog, which
# imports no torch). A strategy registered by a plugin shows in `kvprobe strategies`.
STRATEGY_GRAMMAR = ", ".join(catalog.STRATEGY_GRAMMAR)
PROBES = ", ".join(catalog.PROBES)  # the built-in probes, in the order they run

Model = Annotated[str, typer.Option(help="model spec: a bundled alias, tiny-<family>, toy-<family>, a .gguf "
                                         "path, a local Hugging Face folder or a toy folder; see `kvprobe models`")]
Dataset = Annotated[str, typer.Option(help="'default' (generated: --n cases from --seed) or a JSONL file of cases")]
N = Annotated[int, typer.Option(min=1, help="cases (generated data: how many; a JSONL file: at most this many)")]
Seed = Annotated[int, typer.Option(help="seed of the generated data and of every random choice")]


def threshold_option(value: float | None) -> float | None:
    """--threshold of every command that establishes a repair (run, export-topk, compare, calibrate,
    memory): :data:`~kvprobe.defaults.THRESHOLD_RANGE`, checked by the one rule
    (:func:`kvprobe.stopping.rule.check_threshold`); None where a command reads it from its files."""
    from kvprobe.stopping.rule import check_threshold

    return None if value is None else check_threshold(value, "--threshold")


threshold_option.accepted = THRESHOLD_RANGE  # what the NaN check of cli.argv says is accepted

Threshold = Annotated[float, typer.Option(callback=threshold_option, help="a repair (and K*, where the command has "
                                          "one) is established when the lower bound of its agreement with the "
                                          f"oracle reaches this; {THRESHOLD_RANGE}")]


def _form(value: str) -> str:
    from kvprobe.errors import UsageError

    if value not in FORMS:
        raise UsageError(f"unknown --form {value!r}; accepted: {', '.join(FORMS)}")
    return value


Form = Annotated[str, typer.Option(callback=_form, help=f"how a case becomes a prompt: {', '.join(FORMS)} (auto = "
                                                         f"chat where the tokenizer has a template)")]
FewShot = Annotated[int, typer.Option(min=0, help="demonstrations from other domains before each generated case")]
Cot = Annotated[str, typer.Option(help="comma-separated chain-of-thought token budgets, each >= 0 (0 = none), "
                                       "e.g. 0,64")]
MinFlip = Annotated[float, typer.Option(min=0.0, help="recovery ratios (and the causal ranking rule) use only "
                                                      "cases whose oracle flip is at least this many logits")]
Strategies = Annotated[str, typer.Option(show_default=False, help=(
    f"comma-separated edit strategy specs (default: {', '.join(DEFAULT_STRATEGIES)}); grammar: {STRATEGY_GRAMMAR}; "
    f"`kvprobe strategies` lists every registered one"))]
# load_model's accepted values (kvprobe.models.load.DTYPES and DEVICE_MAPS; tests/models/test_devices.py
# checks they agree), here so that checking a flag imports no torch.
DTYPES = ("float32", "bfloat16", "float16")
DEVICE_MAPS = ("none", "auto", "balanced", "balanced_low_0", "sequential")


def _dtype(value: str) -> str:
    from kvprobe.errors import UsageError

    if value not in DTYPES:
        raise UsageError(f"unknown --dtype {value!r}; accepted: {', '.join(DTYPES)}")
    return value


def _device(value: str) -> str:
    if value != "cpu":  # only then is torch asked what is here
        from kvprobe.errors import UsageError
        from kvprobe.models.load import check_device

        try:
            check_device(value)
        except UsageError as exc:
            raise UsageError(f"--{exc}") from None
    return value


def _device_map(value: str | None) -> str | None:
    from kvprobe.errors import UsageError

    if value is not None and value not in DEVICE_MAPS:
        raise UsageError(f"unknown --device-map {value!r}; accepted: {', '.join(DEVICE_MAPS)}")
    return None if value in (None, "none") else value


def check_placement(dtype: str, device: str, device_map: str | None) -> None:
    """The checks of --dtype, --device and --device-map on values from a config file (before any work)."""
    _dtype(dtype)
    _device(device)
    _device_map(device_map)


Dtype = Annotated[str, typer.Option(callback=_dtype, help=f"precision the model is loaded and run in: "
                                                          f"{', '.join(DTYPES)} (float32 keeps the tables exact)")]
Device = Annotated[str, typer.Option(callback=_device, help="where the model runs: cpu, cuda or cuda:N (ignored with "
                                                            "--device-map)")]
DeviceMap = Annotated[str, typer.Option(callback=_device_map, help=f"spread the model over the devices here with "
                                                                   f"accelerate: {', '.join(DEVICE_MAPS)} (none: all "
                                                                   f"on --device)")]
AllowFailedToy = Annotated[bool, typer.Option("--allow-failed-toy", help="load a toy folder even though its "
                                                                          "manifest records a failed held-out check")]


def _json_dest(value: str | None) -> str | None:
    from kvprobe.errors import UsageError

    if value is not None and value != "-" and not value.endswith(".json"):
        raise UsageError(f"--json {value!r}: give a path ending in .json, or - (or --json alone) for stdout")
    return value


# --json [PATH|-] on every command that writes JSON: a path ending in .json, or stdout with "-"; a
# bare --json (at the end, or before another option) means "-" (kvprobe.cli.argv.bare_json).
# With stdout, the JSON is all a command prints there.
Json = Annotated[str | None, typer.Option("--json", callback=_json_dest, show_default=False, metavar="[PATH|-]",
                                          help="also give the result as JSON: to PATH (ending in .json), or to "
                                               "stdout with - or a bare --json (then nothing else goes there)")]


def _out_help(what: str) -> str:
    return (f"results folder ({what}); a rerun of the same command resumes there, a command with other settings "
            f"is refused")


def out_option(what: str):
    """The --out option with its default folder named, for a command whose default differs."""
    return typer.Option(None, show_default=False, help=_out_help(what))


Out = Annotated[Path | None, typer.Option(show_default=False, help=_out_help("default results/<command>/<model>"))]

# Where the cases are computed (kvprobe.executor, docs/distributed.md): run, edit, sweep, validate, calibrate.
EXECUTORS = ("serial", "ray")


def _executor(value: str) -> str:
    from kvprobe.errors import UsageError

    if value not in EXECUTORS:
        raise UsageError(f"unknown --executor {value!r}; accepted: {', '.join(EXECUTORS)}")
    return value


Executor = Annotated[str, typer.Option("--executor", callback=_executor, help="where the cases are computed: serial "
                                       "(here, one after another) or ray (Ray actors, each holding the model once; "
                                       "pip install 'kvprobe[ray]'; docs/distributed.md)")]
Workers = Annotated[int, typer.Option(min=1, help="with --executor ray: how many workers (actors)")]
RayAddress = Annotated[str | None, typer.Option(show_default="a local Ray on 127.0.0.1", help="with --executor ray: "
                                                "a running cluster, HOST:PORT, ray://HOST:PORT or auto")]
GpusPerWorker = Annotated[float, typer.Option(min=0.0, help="with --executor ray: GPUs per worker (each then "
                                                            "computes on cuda)")]
ThreadsPerWorker = Annotated[int, typer.Option(min=1, help="with --executor ray: CPUs (torch threads) per worker")]
Retries = Annotated[int, typer.Option(min=0, help="with --executor ray: times an item is sent again after its worker "
                                                  "died, and workers replaced")]
RAY_ONLY = ("workers", "ray_address", "gpus_per_worker", "threads_per_worker", "retries")


DEFAULTS = {"model": DEFAULT_MODEL, "n": DEFAULT_N, "budget": DEFAULT_BUDGET, "threshold": DEFAULT_THRESHOLD,
            "min_flip": DEFAULT_MIN_FLIP,
            "strategies": ",".join(DEFAULT_STRATEGIES), "form": DEFAULT_FORM}


def folder_name(model: str) -> str:
    """A model spec as one folder name: a path gives its last part, a hub id ``org/name`` ``org_name``."""
    name = Path(model).name if model.endswith(".gguf") or Path(model).expanduser().is_dir() else model
    return name.replace("/", "_")


def default_out(command: str, model: str) -> Path:
    """``results/<command>/<model>``."""
    return Path("results") / command / folder_name(model)


def generated_only(dataset: str | None, **given: bool) -> None:
    """Refuse, before any work, options that shape generated cases (``given``: option name -> whether
    it was given a value other than its default) when ``--dataset`` is a JSONL file, which has its own."""
    from kvprobe.errors import UsageError

    if dataset in (None, "default"):
        return
    named = ["--" + name.replace("_", "-") for name, used in given.items() if used]
    if named:
        listed = " and ".join([", ".join(named[:-1]), named[-1]] if len(named) > 1 else named)
        raise UsageError(f"{listed} {'shape' if len(named) > 1 else 'shapes'} generated cases; a JSONL dataset has "
                         f"its own (drop {'them' if len(named) > 1 else 'it'}, or use --dataset default)")


def parse_csv(value: str) -> list[str]:
    """``"stale, oracle,"`` -> ``["stale", "oracle"]``: a comma-separated option's items, stripped."""
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_ints(value: str, option: str, minimum: int | None = 0, count: int | None = None) -> list[int]:
    """``"0,64"`` -> ``[0, 64]``; a one-line usage error naming the option and what it accepts."""
    from kvprobe.errors import UsageError

    try:
        out = [int(v) for v in parse_csv(value)]
    except ValueError:
        out = []
    if (not out or (count is not None and len(out) != count)
            or (minimum is not None and min(out) < minimum)):
        need = f"{count} " if count else ""
        floor = f", each >= {minimum}" if minimum is not None else ""
        raise UsageError(f"bad {option} {value!r}; give {need}comma-separated integers{floor}")
    return out
