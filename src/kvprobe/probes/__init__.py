"""Causal probes in cache space. Each probe module registers its stage in :data:`STAGES`,
which ``kvprobe run`` iterates (:func:`in_order`). The built-in ones are the modules
:data:`kvprobe.catalog.PROBES` names, imported here in that order (the run order)."""

from importlib import import_module

from kvprobe.catalog import PROBES
from kvprobe.probes.base import RESULT_COLUMNS, STAGES, Inputs, Probe, ProbeStage, in_order, register
from kvprobe.probes.engine import PairCaches, Patch, patched_reads, read_batch

for _name in PROBES:  # registers, in this order
    import_module(f"{__name__}.{_name}")
    if _name not in STAGES:
        raise ImportError(f"kvprobe.probes.{_name} registers no probe stage named {_name!r} (kvprobe.catalog.PROBES "
                          f"names each built-in probe by its module)")

__all__ = ["RESULT_COLUMNS", "STAGES", "Inputs", "PairCaches", "Patch", "Probe", "ProbeStage", "in_order",
           "patched_reads", "read_batch", "register"]
