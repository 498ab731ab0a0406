"""One line naming this machine's CPU kind, for the top of a test log (standard library only).

    python3 scripts/cpu.py
    CPU: Intel(R) Xeon(R) Processor, family 6 model 167, 2 cores; AVX-512 yes, AMX yes, native bfloat16 yes

The project's machines come in three kinds whose float kernels differ (an AMD EPYC without AVX-512,
Zen 3; one with it, Zen 4; an Intel Xeon with AMX): a red test log that names its CPU says which.
"""

from __future__ import annotations

import os
from pathlib import Path


def cpu_line(cpuinfo: str | None = None) -> str:
    """The line, from ``/proc/cpuinfo``'s first processor (or the text given)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "CPU: unknown (no /proc/cpuinfo)"
    fields: dict[str, str] = {}
    for line in cpuinfo.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    yes = lambda present: "yes" if present else "no"  # noqa: E731
    return (f"CPU: {fields.get('model name', 'unknown')}, family {fields.get('cpu family', '?')} "
            f"model {fields.get('model', '?')}, {os.cpu_count()} cores; AVX-512 {yes('avx512f' in flags)}, "
            f"AMX {yes('amx_tile' in flags)}, native bfloat16 {yes(bool(flags & {'avx512_bf16', 'amx_bf16'}))}")


if __name__ == "__main__":
    print(cpu_line(), flush=True)
