"""Ctrl-C (and SIGTERM) during `kvprobe run`: exit 130 (143), one line saying how to resume, and a
resume whose tables equal an uninterrupted run's."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import cli_process

ARGS = ["run", "--model", "toy-qwen2", "--n", "6", "--probes", "locality", "--strategies", "stale,field_only,oracle",
        "--no-report"]


def _compare():
    path = Path(__file__).parents[2] / "scripts" / "compare_runs.py"
    spec = importlib.util.spec_from_file_location("compare_runs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def interrupt_when(out: Path, stage: str, timeout: float = 300, sig: int = signal.SIGINT, extra: tuple = ()
                   ) -> subprocess.CompletedProcess:
    """Start the run (with ``extra`` arguments) into ``out`` and send ``sig`` once ``stage`` has saved
    its first case part."""
    proc = cli_process.start(*ARGS, "--out", out, *extra)
    parts = out / "parts" / stage
    deadline = time.monotonic() + timeout
    while not (parts.exists() and any(parts.glob("*.parquet"))):
        assert proc.poll() is None, f"the run ended before {stage} saved a part: {proc.output()[1][-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(sig)
    return proc.wait(timeout=120)


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    """An uninterrupted run, for the resumed ones to equal."""
    out = tmp_path_factory.mktemp("interrupt") / "full"
    proc = cli_process.run(*ARGS, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.slow
def test_sigint_in_locality_and_edits_then_resume_gives_the_same_tables(tmp_path, full):

    out = tmp_path / "resumed"
    for stage in ("locality", "edits"):
        proc = interrupt_when(out, stage)
        assert proc.returncode == 130, (stage, proc.returncode, proc.stderr[-2000:])
        last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
        assert last == "interrupted; finished work is saved: rerun the same command to resume", proc.stderr
        assert "Traceback" not in proc.stderr
        assert not (out / "manifest.json").exists()
        assert not list(out.rglob("*.tmp"))  # no half-written file left behind
    assert (out / "locality.parquet").exists() and not (out / "edits.parquet").exists()  # the rerun resumes in edits
    resumed = cli_process.run(*ARGS, "--out", out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    compare = _compare()
    lines = compare.compare(full, out, set(compare.TIMING))
    assert lines and not [ln for ln in lines if ln.startswith("DIFF")], lines


@pytest.mark.slow
def test_sigterm_is_handled_like_sigint_exit_143_and_the_resume_gives_the_same_tables(tmp_path, full):
    out = tmp_path / "terminated"
    proc = interrupt_when(out, "edits", sig=signal.SIGTERM)
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-2000:])
    last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
    assert last == "terminated (SIGTERM); finished work is saved: rerun the same command to resume", proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "manifest.json").exists()
    assert not list(out.rglob("*.tmp"))
    assert (out / "locality.parquet").exists() and list((out / "parts" / "edits").glob("*.parquet"))
    resumed = cli_process.run(*ARGS, "--out", out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    compare = _compare()
    lines = compare.compare(full, out, set(compare.TIMING))
    assert lines and not [ln for ln in lines if ln.startswith("DIFF")], lines


# One worker: what is checked is the driver's signal handling and the resume, which do not depend on
# how many workers compute (tests/executor/test_ray.py compares two workers with serial runs); each
# worker more is a process that imports torch, in each of the three runs.
RAY = ("--executor", "ray", "--workers", "1")


@pytest.mark.slow
def test_a_run_on_ray_workers_interrupted_twice_resumes_to_the_serial_tables(tmp_path, full):
    """The driver of a Ray run (issue 35) takes Ctrl-C in locality and SIGTERM in edits as a serial
    run does (Ray's own SIGTERM handler in the driver is replaced by kvprobe's): 130 and 143, one
    line each, no half-written file; the resume on Ray gives the uninterrupted serial run's tables."""
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    for stage, sig, code in (("locality", signal.SIGINT, 130), ("edits", signal.SIGTERM, 143)):
        proc = interrupt_when(out, stage, sig=sig, extra=RAY)
        assert proc.returncode == code, (stage, proc.returncode, proc.stderr[-2000:])
        last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
        assert last.endswith("finished work is saved: rerun the same command to resume"), proc.stderr
        assert "Traceback" not in proc.stderr and "SIGTERM received" not in proc.stderr, proc.stderr
        assert not list(out.rglob("*.tmp"))
    resumed = cli_process.run(*ARGS, "--out", out, *RAY)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    compare = _compare()
    lines = compare.compare(full, out, set(compare.TIMING), atol=compare.NOISE)
    assert lines and not [ln for ln in lines if ln.startswith("DIFF")], lines
