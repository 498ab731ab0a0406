"""Where a command's cases are computed: one after another in this process (``serial``, the
default), or by Ray actors on this machine or a cluster (``ray``: ``pip install 'kvprobe[ray]'``).

Every resume loop goes through an executor's :meth:`each`: items ``(key, item)`` in order, each
computed by ``fn(ctx, item)``, where ``ctx`` (:class:`Context`) holds the model of the process that
computes it (so ``fn`` must not hold a model itself: it travels to the workers). The driver alone
reads and writes the results folder: a finished part is read here and never sent out; a computed
one comes back as rows and is saved here, atomically, before it is yielded; the claim, the
manifest and the resume stay where they were. Results are yielded in the items' order, whatever
order the workers finish in, so a command that stops early (a sized sweep cell, calibrate's
sequential rule) stops exactly where a serial run stops and its tables are the serial run's.

Ray (:class:`RayExecutor`):

- each worker is an actor that loads the model once, from the driver's load arguments, and must
  show the driver's fingerprint (config, weights and tokenizer hashes) or the run stops;
- the driver asks for at most ``lookahead`` items beyond the one it yields next; items computed
  past the point where a command stops are counted (:attr:`RayExecutor.wasted`) and their parts
  kept (a resume, or a larger budget, reads them);
- a worker that dies (its process killed, its node lost) gives its unfinished items back: each
  item is sent again at most ``retries`` times, and up to ``retries`` replacement workers are
  started; with no worker left the run stops with one line, and the same command resumes;
- a cluster with no node that can hold one worker (``--gpus-per-worker`` where no GPU is), an
  address that does not answer, or workers that do not start within ``start_timeout`` seconds
  (``KVPROBE_RAY_START_S``, 600 by default: a large model takes minutes to load) is one line
  (exit 4), never a hang.
"""

from __future__ import annotations

from collections.abc import Callable

from kvprobe.errors import UsageError
from kvprobe.executor.base import EXECUTORS, Context, Executor, Serial
from kvprobe.executor.ray_workers import RayExecutor, check_address, require_ray, start_timeout_s

__all__ = ["EXECUTORS", "Context", "Executor", "RayExecutor", "Serial", "check_address", "make_executor",
           "require_ray", "start_timeout_s"]


def make_executor(executor: str = "serial", workers: int = 2, address: str | None = None, gpus_per_worker: float = 0.0,
                  threads_per_worker: int = 1, retries: int = 2, say: Callable[[str], None] = lambda message: None):
    """The executor a command's options name."""
    if executor not in EXECUTORS:
        raise UsageError(f"unknown --executor {executor!r}; accepted: {', '.join(EXECUTORS)}")
    if executor == "serial":
        return Serial()
    return RayExecutor(workers=workers, address=address, gpus_per_worker=gpus_per_worker,
                       threads_per_worker=threads_per_worker, retries=retries, say=say)
