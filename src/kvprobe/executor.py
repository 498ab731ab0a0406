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

import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd

from kvprobe.errors import EnvironmentProblem, KvprobeError, UsageError

EXECUTORS = ("serial", "ray")
ENV_FORWARDED = ("HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # and every KVPROBE_* variable
INFLIGHT = 2  # tasks queued on one worker at a time: it never waits for the driver between two


class Context:
    """What a task gets in the process that runs it: the model (``lm``), that process's
    :class:`~kvprobe.probes.engine.PairMemo` (each case's caches, built once per process) and
    :meth:`keep` for other per-process state a task reuses across items (a shared prefix)."""

    def __init__(self, lm, pairs=None):
        self.lm = lm
        self._pairs = pairs
        self.memo: dict[str, Any] = {}

    @property
    def pairs(self):
        if self._pairs is None:
            from kvprobe.probes.engine import PairMemo

            self._pairs = PairMemo(self.lm)
        return self._pairs

    def keep(self, name: str, build: Callable[[Any], Any]):
        """``build(lm)`` the first time ``name`` is asked for in this process, the same object after."""
        if name not in self.memo:
            self.memo[name] = build(self.lm)
        return self.memo[name]


class Executor:
    """What every executor has: :meth:`each` (its own), :meth:`map` over it, and a context manager
    that calls :meth:`close` at its end."""

    name = ""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass

    def each(self, store, items: Iterable, fn: Callable, ctx: Context, times: dict | None = None) -> Iterator:
        raise NotImplementedError

    def map(self, store, items: Iterable, fn: Callable, ctx: Context, on_done: Callable[[], None] = lambda: None,
            times: dict | None = None) -> pd.DataFrame:
        """:meth:`each` over every item, ``on_done()`` after each; the frames concatenated in order."""
        frames = []
        for _, df, _ in self.each(store, items, fn, ctx, times):
            frames.append(df)
            on_done()
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


class Serial(Executor):
    """Each item computed here, in order (kvprobe's default; what every command did before)."""

    name = "serial"
    workers = 1

    def __init__(self):
        self.wasted = 0  # never: nothing is computed ahead
        self.computed = 0

    def describe(self) -> dict:
        return {"executor": self.name, "workers": 1}

    def each(self, store, items: Iterable, fn: Callable, ctx: Context, times: dict | None = None) -> Iterator:
        """For each ``(key, item)``: yields ``(key, frame, resumed)``, the frame read from ``store``'s
        part (a :class:`kvprobe.results.CaseStore`, or None: nothing kept) or computed by
        ``fn(ctx, item)`` and saved before it is yielded; ``times`` gets each computed item's seconds."""
        for key, item in items:
            df = store.get(key) if store is not None else None
            resumed = df is not None
            if df is None:
                start = time.perf_counter()
                df = fn(ctx, item)
                self.computed += 1
                if times is not None:
                    times[key] = time.perf_counter() - start
                if store is not None:
                    store.save(key, df)
            yield key, df, resumed


START_TIMEOUT_S = 600.0  # workers that have not loaded the model by then: one line, never a hang


def start_timeout_s() -> float:
    """Seconds the workers have to start and load the model: ``KVPROBE_RAY_START_S`` or 600."""
    raw = os.environ.get("KVPROBE_RAY_START_S")
    if raw is None:
        return START_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"KVPROBE_RAY_START_S={raw!r}: give the seconds the Ray workers have to start, a number > 0")
    return value


def require_ray():
    """The ``ray`` module, or one line saying how to install it (exit 4)."""
    try:
        import ray
    except ImportError:
        raise EnvironmentProblem("--executor ray needs Ray, which is not installed here; install it with "
                                 "pip install 'kvprobe[ray]' (or choose --executor serial)") from None
    return ray


def check_address(address: str, timeout: float = 5.0) -> None:
    """Refuse, within ``timeout`` seconds, a ``host:port`` (or ``ray://host:port``) nothing listens on."""
    if address == "auto":
        return
    where = address.removeprefix("ray://")
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--ray-address {address!r}: give HOST:PORT (a cluster's GCS, e.g. 10.0.0.5:6379), "
                         f"ray://HOST:PORT (Ray Client) or auto (the cluster `ray start` began on this machine)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise EnvironmentProblem(f"no Ray cluster answers at --ray-address {address} ({exc.strerror or exc}); "
                                 f"start one with `ray start --head` there, or leave --ray-address out to start a "
                                 f"local one") from None


@dataclass
class _Entry:
    key: str
    item: Any
    df: pd.DataFrame | None = None
    resumed: bool = False
    tries: int = 0
    flying: bool = False


class _Worker:
    """A Ray actor's body: loads the model once and computes items with it."""

    def __init__(self, load_args: dict, threads: int, env: dict):
        os.environ.update(env)
        import torch

        torch.set_num_threads(threads)
        self.error = None
        try:
            from kvprobe.models import load_model

            self.ctx = Context(load_model(**load_args))
        except Exception as exc:  # reported by ready(), where the driver waits for it
            self.error = exc

    def ready(self) -> dict:
        if self.error is not None:
            raise self.error
        from kvprobe.results import MODEL_KEYS

        fp = self.ctx.lm.fingerprint()
        return {"model": {k: fp[k] for k in MODEL_KEYS}, "node": socket.gethostname(), "pid": os.getpid()}

    def run(self, fn, items: list) -> list[tuple[pd.DataFrame, float]]:
        out = []
        for item in items:
            start = time.perf_counter()
            df = fn(self.ctx, item)
            out.append((df, time.perf_counter() - start))
        return out


class RayExecutor(Executor):
    """Items computed by ``workers`` Ray actors, each holding the model once (see the module docstring).

    ``address``: a running cluster (``HOST:PORT``, ``ray://HOST:PORT`` or ``auto``); None starts a
    local Ray on 127.0.0.1 for this command and stops it at :meth:`close`. ``threads_per_worker``
    is each actor's CPUs (and its torch threads), ``gpus_per_worker`` its GPUs: a worker given GPUs
    loads the model on ``cuda`` (Ray sets its ``CUDA_VISIBLE_DEVICES``) where the driver's is on the
    cpu, so the driver can run on a node without one. Use it as a context manager, or call
    :meth:`close`.
    """

    name = "ray"

    def __init__(self, workers: int = 2, address: str | None = None, gpus_per_worker: float = 0.0,
                 threads_per_worker: int = 1, retries: int = 2, lookahead: int | None = None, chunk: int = 1,
                 start_timeout: float | None = None, say: Callable[[str], None] = lambda message: None):
        if workers < 1:
            raise UsageError(f"--workers must be at least 1, got {workers}")
        if threads_per_worker < 1:
            raise UsageError(f"--threads-per-worker must be at least 1, got {threads_per_worker}")
        if gpus_per_worker < 0:
            raise UsageError(f"--gpus-per-worker must be 0 or more, got {gpus_per_worker:g}")
        if retries < 0 or chunk < 1:
            raise UsageError(f"retries must be >= 0 and chunk >= 1, got {retries} and {chunk}")
        self._ray = require_ray()
        if address is not None:
            check_address(address)
        self.workers, self.address = workers, address
        self.gpus, self.threads, self.retries, self.chunk = gpus_per_worker, threads_per_worker, retries, chunk
        self.lookahead = lookahead if lookahead is not None else INFLIGHT * chunk * workers
        self.start_timeout = start_timeout if start_timeout is not None else start_timeout_s()
        self.say = say  # one line on starting the workers and on losing one
        self.wasted = 0  # items computed past the point where a command stopped reading
        self.computed = 0  # items computed by the workers
        self.resent = 0  # items sent again after their worker was lost
        self.lost = 0  # workers lost (and replaced while retries allowed)
        self._actors: list = []
        self._load_args: dict | None = None
        self._model: dict | None = None
        self._started_ray = False
        self._nodes: list[dict] = []

    def describe(self) -> dict:
        """What the manifest records of how the items were computed."""
        return {"executor": self.name, "workers": self.workers, "threads_per_worker": self.threads,
                "gpus_per_worker": self.gpus, "address": self.address or "local", "retries": self.retries,
                "computed": self.computed, "wasted": self.wasted, "resent": self.resent, "workers_lost": self.lost}

    @property
    def actors(self) -> list:
        """The live worker actors (a test kills one)."""
        return list(self._actors)

    # -- starting ---------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Start (or reach) Ray and check the cluster can hold one worker, before any model is loaded
        or folder claimed: a command refused here leaves nothing behind. The workers start later,
        once there is something to compute."""
        self._connect()
        self._check_room()

    def _connect(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR,
                 "configure_logging": True}
        # Ray's core worker installs its own SIGTERM handler in this process (it logs a stack and
        # exits 15): kvprobe's (finished work kept, exit 143) and Ctrl-C's are put back after.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.address is not None:
                ray.init(address=self.address, **quiet)
            else:
                cpus = max(os.cpu_count() or 1, self.workers * self.threads)
                ray.init(num_cpus=cpus, _node_ip_address="127.0.0.1", object_store_memory=256 * 2**20, **quiet)
                self._started_ray = True
        except (ConnectionError, RuntimeError, TimeoutError, ValueError) as exc:
            where = self.address or "this machine"
            raise EnvironmentProblem(f"Ray could not start or connect at {where}: {str(exc).splitlines()[0]}"
                                     ) from None
        finally:
            if threading.current_thread() is threading.main_thread():
                for sig, handler in handlers.items():
                    if handler is not None:
                        signal.signal(sig, handler)

    def _check_room(self) -> None:
        """Refuse at once a request no node of the cluster can hold (one worker's CPUs and GPUs)."""
        nodes = [n.get("Resources", {}) for n in self._ray.nodes() if n.get("Alive")]
        if any(r.get("CPU", 0) >= self.threads and r.get("GPU", 0) >= self.gpus for r in nodes):
            return
        most_cpu = max((r.get("CPU", 0) for r in nodes), default=0)
        most_gpu = max((r.get("GPU", 0) for r in nodes), default=0)
        raise EnvironmentProblem(
            f"no node of the Ray cluster ({len(nodes)} node(s); at most {most_cpu:g} CPUs and {most_gpu:g} GPUs on "
            f"one) can hold a worker of {self.threads} CPU(s) and {self.gpus:g} GPU(s); lower --threads-per-worker "
            f"or --gpus-per-worker, or add a node that has them")

    def _spawn(self, n: int) -> list:
        env = {k: v for k, v in os.environ.items() if k.startswith("KVPROBE_") or k in ENV_FORWARDED}
        cls = self._ray.remote(_Worker).options(num_cpus=self.threads, num_gpus=self.gpus, max_restarts=0,
                                                runtime_env={"env_vars": env} if env else None)
        actors = [cls.remote(self._load_args, self.threads, env) for _ in range(n)]
        refs = [a.ready.remote() for a in actors]
        ready, waiting = self._ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout)
        if waiting:
            for a in actors:
                self._ray.kill(a)
            raise EnvironmentProblem(
                f"{len(waiting)} of {n} Ray worker(s) did not start within {self.start_timeout:g} s (each needs "
                f"{self.threads} CPU(s) and {self.gpus:g} GPU(s) free, and must load {self._load_args['spec']}); "
                f"ask for fewer --workers or free the cluster")
        for a, ref in zip(actors, refs):
            try:
                info = self._ray.get(ref)
            except self._ray.exceptions.RayTaskError as exc:
                for b in actors:
                    self._ray.kill(b)
                raise _cause(exc) from None
            if info["model"] != self._model:
                differ = sorted(k for k in self._model if info["model"].get(k) != self._model[k])
                for b in actors:
                    self._ray.kill(b)
                raise KvprobeError(f"a Ray worker on {info['node']} loaded other weights for "
                                   f"{self._load_args['spec']} ({', '.join(differ)} differ from this machine's); "
                                   f"every node must hold the same model files")
            self._nodes.append({"node": info["node"], "pid": info["pid"]})
        return actors

    def _start(self, lm) -> None:
        from kvprobe.results import MODEL_KEYS

        args = getattr(lm.info, "_load_args", None)
        if args is None:
            raise UsageError("--executor ray needs a model loaded by spec (kvprobe.load or load_model): a model "
                             "built in this process cannot be loaded again by the workers")
        fp = lm.fingerprint()
        model = {k: fp[k] for k in MODEL_KEYS}
        if self.gpus and args.get("device", "cpu") == "cpu" and not args.get("device_map"):
            args = {**args, "device": "cuda"}  # a worker given GPUs computes on them; the driver stays where it is
        if self._actors and (args, model) == (self._load_args, self._model):
            return
        self.close_workers()
        self._load_args, self._model = args, model
        start = time.perf_counter()
        self._connect()
        self._check_room()
        self._actors = self._spawn(self.workers)
        nodes = len({n["node"] for n in self._nodes})
        self.say(f"ray: {self.workers} worker(s) on {nodes} node(s), each holding {args['spec']} "
                 f"({self.threads} thread(s){f', {self.gpus:g} GPU(s)' if self.gpus else ''}), ready in "
                 f"{time.perf_counter() - start:.1f} s")

    # -- computing --------------------------------------------------------------------------------------------
    def each(self, store, items: Iterable, fn: Callable, ctx: Context, times: dict | None = None) -> Iterator:
        """:meth:`Serial.each`, computed by the workers (see the module docstring)."""
        ray = self._ray
        fn_ref = None  # the task, put once into the object store when the first item needs computing
        source = iter(items)
        window: deque[_Entry] = deque()
        flying: dict = {}  # ObjectRef -> (actor, entries)
        load: dict = {}  # tasks queued per live actor
        exhausted = False
        try:
            while True:
                while not exhausted and len(window) <= self.lookahead:  # the next item, and lookahead more
                    try:
                        key, item = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    df = store.get(key) if store is not None else None
                    window.append(_Entry(key, item, df, resumed=df is not None))
                while window and window[0].df is not None:
                    e = window.popleft()
                    yield e.key, e.df, e.resumed
                if not window and exhausted:
                    return
                todo = [e for e in window if e.df is None and not e.flying]
                if todo and fn_ref is None:  # workers start only when something is left to compute
                    self._start(ctx.lm)
                    fn_ref = ray.put(fn)
                for actor in list(self._actors):
                    while todo and load.get(id(actor), 0) < INFLIGHT:
                        batch, todo = todo[:self.chunk], todo[self.chunk:]
                        for e in batch:
                            e.flying = True
                        flying[actor.run.remote(fn_ref, [e.item for e in batch])] = (actor, batch)
                        load[id(actor)] = load.get(id(actor), 0) + 1
                if not flying:
                    continue
                ready, _ = ray.wait(list(flying), num_returns=1, timeout=1.0)
                for ref in ready:
                    actor, batch = flying.pop(ref)
                    load[id(actor)] = load.get(id(actor), 1) - 1
                    try:
                        results = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        raise _cause(exc) from None
                    except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError):
                        self._lose(actor, batch, load)
                        continue
                    for e, (df, seconds) in zip(batch, results):
                        if store is not None:
                            store.save(e.key, df)
                        if times is not None:
                            times[e.key] = seconds
                        e.df, e.flying = df, False
                        self.computed += 1
        finally:  # a caller that stopped reading: what was computed or asked for past that point is waste
            self.wasted += sum(e.df is not None and not e.resumed for e in window)
            for ref, (_, batch) in flying.items():
                self.wasted += len(batch)
                try:
                    ray.cancel(ref)  # a queued task does not run; a running one finishes, unread
                except Exception:  # noqa: BLE001 - its worker is gone, or the task is done
                    pass

    def _lose(self, actor, batch: list[_Entry], load: dict) -> None:
        """A worker died: its items go back to the queue (each at most ``retries`` more times), and a
        replacement is started while ``retries`` allows; none left is one line (exit 4)."""
        if actor in self._actors:
            self._actors.remove(actor)
            self.lost += 1
            self._ray.kill(actor)
            replace = self.lost <= self.retries
            self.say(f"ray: a worker was lost; its {len(batch)} item(s) go to another worker"
                     + ("; starting a replacement" if replace else f" (no replacement: --retries {self.retries})"))
            if replace:
                self._actors += self._spawn(1)
                load[id(self._actors[-1])] = 0
        for e in batch:
            e.flying = False
            e.tries += 1
            self.resent += 1
            if e.tries > self.retries:
                raise EnvironmentProblem(f"{e.key} was lost with its Ray worker {e.tries} times (at most "
                                         f"--retries {self.retries}); finished work is saved: rerun the same command "
                                         f"to resume")
        if not self._actors:
            raise EnvironmentProblem(f"every Ray worker was lost ({self.lost} lost, {min(self.lost, self.retries)} "
                                     f"replaced, --retries {self.retries}); finished work is saved: rerun the same "
                                     f"command to resume")

    # -- stopping ---------------------------------------------------------------------------------------------
    def close_workers(self) -> None:
        for a in self._actors:
            try:
                self._ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors = []

    def close(self) -> None:
        """Stop the workers, and the local Ray this executor started."""
        self.close_workers()
        if self._started_ray and self._ray.is_initialized():
            self._ray.shutdown()
        self._started_ray = False


def _cause(exc) -> BaseException:
    """The exception a task raised on a worker (a KvprobeError stays one line with its exit code)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def make_executor(executor: str = "serial", workers: int = 2, address: str | None = None, gpus_per_worker: float = 0.0,
                  threads_per_worker: int = 1, retries: int = 2, say: Callable[[str], None] = lambda message: None):
    """The executor a command's options name."""
    if executor not in EXECUTORS:
        raise UsageError(f"unknown --executor {executor!r}; accepted: {', '.join(EXECUTORS)}")
    if executor == "serial":
        return Serial()
    return RayExecutor(workers=workers, address=address, gpus_per_worker=gpus_per_worker,
                       threads_per_worker=threads_per_worker, retries=retries, say=say)
