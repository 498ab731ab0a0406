"""Our vLLM server: start it on 127.0.0.1, wait for health, record it, stop it by its process group.

One server at a time. Its state is a JSON file (:data:`STATE_FILE` under ``$KVPROBE_HOME/serve``)
with the PID, port, URL, model and log path; a state whose process is gone (or is no longer our
launcher: PIDs are reused) is stale and is removed when read. The server runs in a session of its
own, so :func:`stop` ends the API server and its engine-core processes together.

The served model is the alias's dequantised safetensors folder (``kvprobe models fetch``), offline,
with automatic prefix caching, per-request cached-token counts, ``--block-size`` 32 (CPU default
128), a 4 GiB KV cache, and bfloat16 only where the CPU computes it natively (:func:`server_dtype`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvprobe.errors import EnvironmentProblem, UsageError
from kvprobe.hardware import native_bf16
from kvprobe.paths import home, make_dir
from kvprobe.serving import env

STATE_FILE = "server.json"
LOG_FILE = "server.log"
BLOCK_SIZE = 32
KV_CACHE_GIB = 4
START_TIMEOUT_S = 420.0  # measured start-up, 2 idle cores: 100-160 s (eager 40-60 s); far longer on a busy machine
LOG_TAIL_LINES = 12


@dataclass(frozen=True)
class ServerState:
    """A running server, as recorded in the state file."""

    pid: int
    port: int
    url: str
    model: str  # the alias, also the served model name
    folder: str
    log: str
    block_size: int
    started_at: float
    owner: str = "serve start"  # or "serve-bench": a server a benchmark started for its own use
    eager: bool = False  # started with --enforce-eager (no torch.compile): see :func:`command`
    one_process: bool = False  # the engine in the API server's process: see :func:`start`


def serve_dir() -> Path:
    return make_dir(home() / "serve")


def state_path() -> Path:
    return serve_dir() / STATE_FILE


def _alive(pid: int, exec_wait_s: float = 2.0) -> bool:
    """Whether ``pid`` is a live process running our launcher (not a zombie, not a reused PID).

    A process still inside exec shows an empty command line for a moment after ``Popen`` returns
    (the kernel sets it after closing the close-on-exec pipe ``Popen`` waits on): an empty one is
    read again for up to ``exec_wait_s`` before it counts as not ours.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    deadline = time.monotonic() + exec_wait_s
    try:
        while True:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                return False
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if cmdline or time.monotonic() >= deadline:
                return env.LAUNCHER in cmdline.decode(errors="replace")
            time.sleep(0.02)
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # gone while we looked; with no /proc, trust the signal
    except OSError:
        return True  # /proc unreadable for this process: trust the signal


def read_state(path: Path | None = None) -> ServerState | None:
    """The running server, or None; a stale or unreadable state file is removed."""
    path = path or state_path()
    try:
        data = json.loads(path.read_text())
        state = ServerState(**data)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, TypeError):
        path.unlink(missing_ok=True)
        return None
    if not _alive(state.pid):
        path.unlink(missing_ok=True)
        return None
    return state


def write_state(state: ServerState, path: Path | None = None) -> Path:
    from kvprobe.results import atomic_write_json

    return atomic_write_json(asdict(state), path or state_path())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path | str, n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` non-empty lines of a log, joined with " | " (for one-line errors)."""
    try:
        lines = [ln.strip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-n:]) or "(empty log)"


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def server_dtype() -> str:
    """bfloat16 (vLLM's CPU default) where the CPU computes it natively, else float32: emulated
    bfloat16 made a 1,500-token prefill at saturation outlast the 300 s request timeout here."""
    return "bfloat16" if native_bf16() else "float32"


def command(alias: str, folder: Path, port: int, block_size: int = BLOCK_SIZE, venv: Path | None = None,
            eager: bool = False) -> list[str]:
    """The server's command line (the launcher is vLLM's `vllm` command).

    ``eager`` adds vLLM's ``--enforce-eager``: no torch.compile of the model at start-up. vLLM 0.32's
    CPU build compiles at every start (its compile cache fails to load: "'function' object has no
    attribute 'finalize_loading'" in the log), which is most of a 100-160 s start of SmolLM2-135M on
    2 cores; eager, the start takes 40-60 s. The compiled model serves faster, so a benchmark whose
    times matter runs compiled (the default); the tests, which check cache hits and decisions, run eager.
    """
    return [str(env.python_of(venv)), str(env.launcher_of(venv)), "serve", str(folder),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", alias,
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size", str(block_size),
            "--dtype", server_dtype(), "--generation-config", "vllm", "--uvicorn-log-level", "warning",
            *(["--enforce-eager"] if eager else [])]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: SIGTERM the launcher when the process that started it dies (even by SIGKILL)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _model_folder(alias: str, progress: Callable[[str], None]) -> Path:
    from kvprobe.models import bundled

    if alias not in bundled.BUNDLED:
        raise UsageError(f"unknown bundled alias {alias!r}; known: {', '.join(bundled.BUNDLED)}")
    return bundled.fetch(alias, progress)


def start(alias: str, *, owner: str = "serve start", block_size: int = BLOCK_SIZE, kv_cache_gib: int = KV_CACHE_GIB,
          timeout_s: float = START_TIMEOUT_S, progress: Callable[[str], None] = lambda s: None,
          venv: Path | None = None, eager: bool = False, one_process: bool = False) -> ServerState:
    """Start the server for ``alias`` and wait until /health answers; returns its recorded state.
    ``eager``: vLLM's eager mode, see :func:`command`.

    ``one_process``: vLLM's engine runs in the API server's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    instead of an engine-core process and a worker process that wait for each other's messages by
    spinning on a core (vLLM's shared-memory queue polls for a second after each message). On 2 cores
    (Zen 4, SmolLM2-135M, eager; ``benchmarks/vllm_one_process.py``, medians of two runs an arm) it
    started in 17.6 s against 28.0 s, served the uncached arm at 0.63 requests/s against 0.35 and used
    1.3 times less of the machine's CPU; a cached prompt's time to the first token grew, 0.44 s against
    0.13 s (the HTTP server and the engine share one interpreter). Without it vLLM's CPU platform uses
    its multiprocess executor, which pins its OpenMP threads to cores (vLLM's reason for not offering one
    process there); only 2 cores were measured, so one process stays an option, not the default.

    A server that a command starts for its own use (``owner`` other than "serve start") is tied to
    that command's process: it gets SIGTERM if the command dies. Raises a one-line error, with the
    tail of the server's log, when the server exits or stays unhealthy past ``timeout_s``.
    """
    venv = env.require_ready(venv)
    running = read_state()
    if running is not None:
        raise EnvironmentProblem(f"a kvprobe vLLM server is already running ({running.model} at {running.url}, "
                                 f"pid {running.pid}, started by `kvprobe {running.owner}`); "
                                 f"use it with --url {running.url}, or run `kvprobe serve stop` first")
    folder = _model_folder(alias, progress)
    port = free_port()
    log = serve_dir() / LOG_FILE
    cmd = command(alias, folder, port, block_size, venv, eager)
    extra = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if one_process
                                                                else {})}
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env.clean_env(extra), cwd=serve_dir(), start_new_session=True,
                                preexec_fn=None if owner == "serve start" else _die_with_parent)
    state = ServerState(pid=proc.pid, port=port, url=f"http://127.0.0.1:{port}", model=alias, folder=str(folder),
                        log=str(log), block_size=block_size, started_at=time.time(), owner=owner, eager=eager,
                        one_process=one_process)
    write_state(state)
    try:
        _wait_healthy(proc, state, timeout_s, progress)
    except BaseException:
        _kill_group(proc.pid)
        proc.wait()
        state_path().unlink(missing_ok=True)
        raise
    return state


def _wait_healthy(proc: subprocess.Popen, state: ServerState, timeout_s: float,
                  progress: Callable[[str], None]) -> None:
    t0 = time.monotonic()
    while True:
        elapsed = time.monotonic() - t0
        if proc.poll() is not None:
            raise EnvironmentProblem(f"the vLLM server for {state.model} exited with code {proc.returncode} during "
                                     f"start-up after {elapsed:.0f} s; log {state.log}: {log_tail(state.log)}")
        if healthy(state.url):
            return
        if elapsed > timeout_s:
            raise EnvironmentProblem(f"the vLLM server for {state.model} was not healthy after {timeout_s:.0f} s "
                                     f"and was stopped; log {state.log}: {log_tail(state.log)}")
        progress(f"waiting for the vLLM server ({elapsed:.0f} s; start-up takes 40-160 s)")
        time.sleep(1.0)


def _kill_group(pid: int, grace_s: float = 20.0) -> None:
    """SIGTERM the process group led by ``pid``, then SIGKILL what is left after ``grace_s``."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(pid):
            return
        time.sleep(0.25)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    for _ in range(40):
        if not _group_alive(pid):
            return
        time.sleep(0.25)


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in the group (reaping our own child if it is one)."""
    try:
        os.waitpid(pgid, os.WNOHANG)
    except ChildProcessError:
        pass
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False


def stop(state: ServerState | None = None) -> ServerState:
    """Stop the recorded server (or ``state``) and remove the state file; returns what was stopped."""
    state = state or read_state()
    if state is None:
        raise EnvironmentProblem("no kvprobe vLLM server is running; start one with "
                                 "`kvprobe serve start --model ALIAS`")
    _kill_group(state.pid)
    path = state_path()
    try:
        if json.loads(path.read_text()).get("pid") == state.pid:
            path.unlink()
    except (OSError, json.JSONDecodeError):
        pass
    return state
