"""Causal probes in cache space. Each probe module registers its stage in :data:`STAGES`,
which ``kvprobe run`` iterates (:func:`in_order`)."""

from kvprobe.probes import locality, attention, knockout, linear  # noqa: F401, I001  (registers, in this order)
from kvprobe.probes.base import RESULT_COLUMNS, STAGES, Inputs, Probe, ProbeStage, in_order, register
from kvprobe.probes.engine import PairCaches, Patch, patched_reads, read_batch

__all__ = ["RESULT_COLUMNS", "STAGES", "Inputs", "PairCaches", "Patch", "Probe", "ProbeStage", "in_order",
           "patched_reads", "read_batch", "register"]
