"""One line naming this machine's CPU kind, for the top of a test log (before any install: the
standard library and kvprobe's own kvprobe/hardware.py, which imports nothing else).

    python3 scripts/cpu.py
    CPU: Intel(R) Xeon(R) Processor, family 6 model 167, 2 cores; AVX-512 yes, AMX yes, native bfloat16 yes
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvprobe.hardware import cpu_line  # noqa: E402

if __name__ == "__main__":
    print(cpu_line(), flush=True)
