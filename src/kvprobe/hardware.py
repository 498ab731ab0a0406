"""What this machine's CPU can do, where it changes results or speed: the instruction sets that
pick torch's kernels, and whether bfloat16 runs natively or is emulated (about 10x slower here)."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; the platform's name and no flags elsewhere."""
    fields = _cpuinfo()
    return fields.get("model name") or platform.processor() or platform.machine(), set(fields.get("flags", "").split())


def cpu_line() -> str:
    """One line naming the CPU kind, for a test log: the project's machines are an AMD EPYC without
    AVX-512 (Zen 3, family 25 model 1), one with it (Zen 4) or an Intel Xeon with AMX, and their
    float kernels differ, so a red log must say which it ran on."""
    fields, (name, flags) = _cpuinfo(), cpu()
    yes = lambda present: "yes" if present else "no"  # noqa: E731
    return (f"CPU: {name}, family {fields.get('cpu family', '?')} model {fields.get('model', '?')}, "
            f"{os.cpu_count()} cores; AVX-512 {yes('avx512f' in flags)}, AMX {yes('amx_tile' in flags)}, "
            f"native bfloat16 {yes(native_bf16())}")


def machine() -> dict:
    """The CPU's name, architecture, core count and the instruction sets in :data:`ISA_FLAGS`."""
    name, flags = cpu()
    return {"cpu": name, "arch": platform.machine(), "cores": os.cpu_count(),
            "isa": [f for f in ISA_FLAGS if f in flags]}


def native_bf16() -> bool:
    """Whether the CPU computes bfloat16 natively (otherwise torch emulates it, far slower)."""
    return bool(set(BF16_FLAGS) & cpu()[1])
