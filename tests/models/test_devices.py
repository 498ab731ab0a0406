"""Devices and precisions: load_model's dtype, device and device_map, and the CLI flags that pass
them (--dtype, --device, --device-map). Tiny models only; CUDA where there is one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests import cli_process
from tests.conftest import GPU_SKIP

CLI = [sys.executable, "-c", "from kvprobe.cli.app import main; main()"]


def kvprobe(*args) -> subprocess.CompletedProcess:
    """The console entry point in a process of its own (forked from a warm one, tests/cli_process.py)."""
    return cli_process.run(*args, timeout=300)


@pytest.fixture
def cli(monkeypatch, capsys):
    """The console entry point (``main``: its one-line errors and exit codes) in this process, which
    has torch imported already: (exit code, stderr). An uncaught exception fails the test."""
    from kvprobe.cli.app import main

    def call(*args) -> subprocess.CompletedProcess:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["kvprobe", *map(str, args)])
        with pytest.raises(SystemExit) as stop:
            main()
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, stop.value.code, out.out, out.err)

    return call


def error_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one error line of a failed command: its exit code, no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    return lines[0]


def decision(lm, options: list[str] | None = None) -> str:
    """A decision read through the front door: prefill a small context, read its answer (the top
    next token without ``options``)."""
    from kvprobe.api import EditableContext

    ctx = EditableContext(lm, form="raw")
    ctx.add_text("Loans are issued only if the tier is gold.\nTier: ").add_field("tier", "gold")
    ctx.ask("Is the loan issued?", options=options)
    state = ctx.read()
    assert torch.isfinite(state.logits).all()
    return state.answer()


def test_the_cli_lists_agree_with_load_model():
    from kvprobe.cli import options
    from kvprobe.models.load import DEVICE_MAPS, DTYPES

    assert options.DTYPES == tuple(DTYPES)
    assert options.DEVICE_MAPS == ("none", *DEVICE_MAPS)


def test_bfloat16_loads_in_bfloat16_and_reads_a_decision():
    from kvprobe.models import load_model

    lm = load_model("tiny-llama", dtype="bfloat16")
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    assert lm.info.dtype == "bfloat16" and lm.info.as_dict()["device_map"] is None
    assert lm.info.rope_check_error is not None  # the RoPE self-check ran, at bfloat16's tolerance
    assert decision(lm, ["yes", "no"]) in ("yes", "no")


def test_device_map_auto_on_cpu(tmp_path):
    """An in-process model is dispatched by accelerate; a folder goes through from_pretrained's
    device_map, read directly in bfloat16. Without a GPU everything lands on cpu."""
    from kvprobe.models import load_model
    from kvprobe.models.tiny import build_tiny

    lm = load_model("tiny-llama", device_map="auto")
    assert lm.info.device_map == "auto" and lm.info.device == "cpu" and lm.info.dtype == "float32"
    yes_no = ["yes", "no"]
    assert decision(lm, yes_no) == decision(load_model("tiny-llama"), yes_no)  # the same model, placed by accelerate

    model, tok = build_tiny("tiny-qwen2")
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    lm = load_model(str(tmp_path / "m"), dtype="bfloat16", device_map="auto")
    info = lm.info.as_dict()
    assert (info["source"], info["device_map"], info["dtype"]) == ("folder", "auto", "bfloat16")
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in lm.model.parameters()} == {"cuda" if torch.cuda.is_available() else "cpu"}
    assert isinstance(decision(lm), str)  # the top next token (a tokenizer saved and reloaded: no options)


def test_bad_values_are_one_line_usage_errors():
    from kvprobe.errors import UsageError
    from kvprobe.models import load_model

    for kwargs, needle in [({"dtype": "float64"}, "accepted: float32, bfloat16, float16"),
                           ({"device": "mps"}, "accepted: cpu"),
                           ({"device": f"cuda:{torch.cuda.device_count()}"}, "not available here"),
                           ({"device_map": "gpu"}, "accepted: none, auto, balanced")]:
        with pytest.raises(UsageError, match=needle):
            load_model("tiny-llama", **kwargs)


def test_cli_refuses_bad_flags_in_one_line(tmp_path, cli):
    line = error_line(kvprobe("run", "--model", "tiny-llama", "--dtype", "float64", "--out", tmp_path / "r"))
    assert "unknown --dtype 'float64'; accepted: float32, bfloat16, float16" in line
    assert "--device 'mps' is not available here; accepted: cpu" in error_line(
        cli("edit", "--model", "tiny-llama", "--device", "mps", "--out", tmp_path / "e"))
    assert "--device 'cuda:99' is not available here" in error_line(
        cli("sweep", "--model", "tiny-llama", "--device", "cuda:99", "--out", tmp_path / "s"))
    assert "unknown --device-map 'gpu'; accepted: none, auto" in error_line(
        cli("datasets", "check", "--model", "tiny-llama", "--device-map", "gpu"))
    assert "--dtype" in error_line(cli("diagnose", "x.txt", "--dtype", "fp8"))
    config = tmp_path / "c.yaml"
    config.write_text("model: tiny-llama\ndtype: float64\n")  # a config file's value is checked the same way
    assert "--dtype 'float64'" in error_line(cli("run", "--config", config, "--out", tmp_path / "r"))
    assert not any((tmp_path / d).exists() for d in "res")


def test_run_flags_override_the_config_and_reach_the_manifest(tmp_path, cli):
    config = tmp_path / "c.yaml"
    config.write_text("model: tiny-llama\ndtype: float16\ndevice_map: auto\n")
    out = tmp_path / "run"
    proc = cli("run", "--config", config, "--dtype", "bfloat16", "--n", "2", "--all-cases", "--probes",
               "locality", "--strategies", "stale,oracle", "--no-report", "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    info = manifest["model_info"]
    assert info["dtype"] == "bfloat16"  # the flag wins over the file's float16
    assert info["device_map"] == "auto"  # a flag not given leaves the file's value
    assert manifest["config"]["dtype"] == "bfloat16"


def test_cuda_loads_and_reads_a_decision():
    if not torch.cuda.is_available():
        pytest.skip(GPU_SKIP + ": loading on cuda")
    from kvprobe.models import load_model

    lm = load_model("tiny-llama", dtype="bfloat16", device="cuda")
    assert lm.device.type == "cuda" and lm.info.device == "cuda"
    assert decision(lm, ["yes", "no"]) in ("yes", "no")
    lm = load_model("tiny-llama", device_map="auto")
    assert lm.model.device.type == "cuda" and decision(lm, ["yes", "no"]) in ("yes", "no")
