"""The CPU line a test log starts and ends with names the kind of machine it ran on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvprobe import hardware

ZEN3 = {"model name": "AMD EPYC 7B13", "cpu family": "25", "model": "1", "flags": "fpu sse2 avx avx2 fma"}
XEON = {"model name": "Intel(R) Xeon(R) Processor", "cpu family": "6", "model": "143",
        "flags": "avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile"}


def test_each_kind_is_told_apart(monkeypatch):
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ZEN3)
    assert hardware.cpu_line() == (f"CPU: AMD EPYC 7B13, family 25 model 1, {os.cpu_count()} cores; AVX-512 no, "
                                   "AMX no, native bfloat16 no")
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: XEON)
    assert "family 6 model 143" in hardware.cpu_line()
    assert hardware.cpu_line().endswith("AVX-512 yes, AMX yes, native bfloat16 yes")


def test_the_script_runs_before_any_install():
    """scripts/cpu.py, as .ci/run calls it: the system python3, no kvprobe installed, one line."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "cpu.py"
    proc = subprocess.run([sys.executable, "-S", "-I", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("CPU: ") and len(proc.stdout.splitlines()) == 1, proc
