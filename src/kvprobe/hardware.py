"""What this machine's CPU can do, where it changes results or speed: the instruction sets that
pick torch's kernels, and whether bfloat16 runs natively or is emulated (about 10x slower here)."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; the platform's name and no flags elsewhere."""
    name, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not flags:
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return name, flags


def machine() -> dict:
    """The CPU's name, architecture, core count and the instruction sets in :data:`ISA_FLAGS`."""
    name, flags = cpu()
    return {"cpu": name, "arch": platform.machine(), "cores": os.cpu_count(),
            "isa": [f for f in ISA_FLAGS if f in flags]}


def native_bf16() -> bool:
    """Whether the CPU computes bfloat16 natively (otherwise torch emulates it, far slower)."""
    return bool(set(BF16_FLAGS) & cpu()[1])
