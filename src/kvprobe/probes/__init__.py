"""Causal probes in cache space. Each probe module registers itself in :data:`PROBES`."""

from kvprobe.probes.base import PROBES, RESULT_COLUMNS, Probe, register
from kvprobe.probes.engine import PairCaches, Patch, patched_reads, read_batch
from kvprobe.probes import attention, knockout, linear, locality  # noqa: F401  (registers)

__all__ = ["PROBES", "RESULT_COLUMNS", "PairCaches", "Patch", "Probe", "patched_reads", "read_batch", "register"]
