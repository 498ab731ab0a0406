"""The Ray executor (``--executor ray``): the workers are Ray actors that each hold the model once;
see :mod:`kvprobe.executor` for the rules it keeps (order, lookahead, faults, refusals)."""

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
from kvprobe.executor.base import Context, Executor

ENV_FORWARDED = ("HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # and every KVPROBE_* variable
INFLIGHT = 2  # tasks queued on one worker at a time: it never waits for the driver between two


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
        from kvprobe.identity import ModelIdentity

        return {"model": ModelIdentity.of_model(self.ctx.lm).content(), "node": socket.gethostname(),
                "pid": os.getpid()}

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
        self._model = None  # the driver's ModelIdentity, which every worker must load
        self._started_ray = False
        self._nodes: list[dict] = []

    def describe(self, since: dict | None = None) -> dict:
        """What the manifest records of how the items were computed: the counts since ``since`` (an
        earlier ``describe()``), so that a command given an executor that served others before it
        records its own."""
        counts = {"computed": self.computed, "wasted": self.wasted, "resent": self.resent, "workers_lost": self.lost}
        if since:
            counts = {k: v - since.get(k, 0) for k, v in counts.items()}
        return {"executor": self.name, "workers": self.workers, "threads_per_worker": self.threads,
                "gpus_per_worker": self.gpus, "address": self.address or "local", "retries": self.retries, **counts}

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
            self._kill(actors)
            raise EnvironmentProblem(
                f"{len(waiting)} of {n} Ray worker(s) did not start within {self.start_timeout:g} s (each needs "
                f"{self.threads} CPU(s) and {self.gpus:g} GPU(s) free, and must load {self._load_args['spec']}); "
                f"ask for fewer --workers or free the cluster")
        for a, ref in zip(actors, refs):
            try:
                info = self._ray.get(ref)
            except self._ray.exceptions.RayTaskError as exc:
                self._kill(actors)
                raise _cause(exc) from None
            differ = sorted(self._model.differ(info["model"]))
            if differ:
                self._kill(actors)
                raise KvprobeError(f"a Ray worker on {info['node']} loaded other weights for "
                                   f"{self._load_args['spec']} ({', '.join(differ)} differ from this machine's); "
                                   f"every node must hold the same model files")
            self._nodes.append({"node": info["node"], "pid": info["pid"]})
        return actors

    def _start(self, lm) -> None:
        from kvprobe.identity import ModelIdentity

        args = getattr(lm.info, "_load_args", None)
        if args is None:
            raise UsageError("--executor ray needs a model loaded by spec (kvprobe.load or load_model): a model "
                             "built in this process cannot be loaded again by the workers")
        model = ModelIdentity.of_model(lm)
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
    def _kill(self, actors) -> None:
        for a in actors:
            try:
                self._ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def close_workers(self) -> None:
        self._kill(self._actors)
        self._actors, self._nodes = [], []

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
