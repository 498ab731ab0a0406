"""`kvprobe ARGS` as a real process, without paying torch's and transformers' imports each time.

A CLI test wants what a user gets: a separate process, its exit code, everything it writes to file
descriptors 1 and 2 (a library's C-level warnings and log lines too), its own signals, working
directory and environment. Starting ``python -c "from kvprobe.cli.app import main; main()"`` gives
all that, and spends about 4 s of every call importing torch and transformers before the command
looks at its input: over a hundred calls, the largest part of the suite's time.

So each test process keeps one *fork server* (the idea of multiprocessing's ``forkserver``): a
fresh Python that sets the environment defaults ``main`` sets, imports the model stack, kvprobe's
modules and what its reports and linear probe import (matplotlib, scikit-learn) and serve-bench's
client (openai, whose module reads OPENAI_LOG and the Azure variables when imported: no test sets
them, and kvprobe passes its client everything), and runs nothing
else (no torch thread pool exists yet, so forking is safe).
Each call forks it: the child takes the call's argv, environment and working directory, stdin from
/dev/null and stdout/stderr into files, default signal handlers, clears the caches that read the
environment, runs ``main()`` as the interpreter would (an escaping exception prints its traceback
and exits 1; atexit handlers run), and exits. :func:`run` returns a ``subprocess.CompletedProcess``
like ``subprocess.run(..., capture_output=True, text=True)``. :func:`run_script` and
:func:`run_code` run ``python SCRIPT ARGS`` and ``python -c CODE ARGS`` the same way (the docs'
benchmark commands, a process where an optional extra is missing: about 5 s of imports each).

:func:`start` returns at once, for a test that signals the process (Ctrl-C and resume). What it
does not give: a test of how fast a fresh process starts, or of what a library prints the first
time it is imported; those tests start a plain process (``tests/cli/test_conventions.py``).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVER = r'''
import json, os, runpy, signal, sys, traceback

from kvprobe.cli import app as cli_app

cli_app._quiet_third_parties()  # what main() sets before a command imports the model stack
import torch, transformers  # noqa: E401,F401
import kvprobe.pipeline, kvprobe.editor.runner, kvprobe.sweep.grid  # noqa: E401,F401
# what a run's report and linear probe import when they start (about 0.5 s a call on a Zen 4)
import kvprobe.reports.html, kvprobe.reports.figures, kvprobe.reports.sections  # noqa: E401,F401
import kvprobe.reports.sections.edits, kvprobe.reports.sections.knockout  # noqa: E401,F401
import sklearn.linear_model, sklearn.model_selection, sklearn.pipeline, sklearn.preprocessing  # noqa: E401,F401
import kvprobe.serving.agent  # noqa: F401  serve-bench's modules and the openai client: 0.6 s a call on a Zen 4
assert "kvprobe.serving.env" not in sys.modules  # it sets an environment variable when imported
from kvprobe.models.adapter import families
# torch registers each operator library with weakref.finalize(atexit=True): every child would spend
# 0.03-0.05 s at exit taking them out of a dispatcher that dies with it (9.5 CPU s in the suite's
# 280 calls, Zen 4). Children exit without it; nothing they run sees the difference.
import weakref, torch.library  # noqa: E401
for fin in list(weakref.finalize._registry):
    if (info := fin.peek()) and info[1] is torch.library._del_library:
        fin.atexit = False

reply = os.fdopen(int(sys.argv[1]), "w")
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY),
                                   (2, req["stderr"], os.O_WRONLY)):
                os.dup2(os.open(path, mode), fd)
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            families.cache_clear()  # rereads $KVPROBE_FAMILY_PATH
            try:
                if req.get("script"):  # `python SCRIPT ARGS`: its folder first on sys.path, as the interpreter sets it
                    sys.argv = [req["script"], *req["args"]]
                    sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
                    runpy.run_path(req["script"], run_name="__main__")
                elif req.get("code") is not None:  # `python -c CODE ARGS`
                    sys.argv = ["-c", *req["args"]]
                    exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__"})
                else:
                    sys.argv = ["kvprobe", *req["args"]]
                    cli_app.main()
                code = 0
            except SystemExit as exc:
                if exc.code is None or isinstance(exc.code, int):
                    code = exc.code or 0
                else:
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            try:
                import atexit
                atexit._run_exitfuncs()
            except BaseException:
                traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    pass
            os._exit(code)
    reply.write(json.dumps({"pid": pid}) + "\n"); reply.flush()
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n"); reply.flush()
'''

_server: dict = {}


def _start() -> dict:
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(w)], stdin=subprocess.PIPE, pass_fds=(w,),
                            text=True, stdout=subprocess.DEVNULL)
    os.close(w)
    server = {"proc": proc, "fd": r, "buf": b""}  # replies are read unbuffered: see _read
    atexit.register(_stop, server)
    return server


def _stop(server: dict) -> None:
    proc = server["proc"]
    os.close(server["fd"])
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _ready(server: dict, wait: float) -> bool:
    """Whether a whole reply line is at hand, waiting up to ``wait`` seconds for one."""
    deadline = time.monotonic() + wait
    while b"\n" not in server["buf"]:
        left = deadline - time.monotonic()
        if not select.select([server["fd"]], [], [], max(0.0, left))[0]:
            return False
        chunk = os.read(server["fd"], 4096)
        if not chunk:
            raise RuntimeError(f"the kvprobe fork server died (exit {server['proc'].wait()})")
        server["buf"] += chunk
    return True


def _read(server: dict, deadline: float) -> dict:
    """The next reply line. Read from the raw pipe into our own buffer: a buffered file object could
    hold a second line (a fast child's exit code) where ``select`` cannot see it."""
    if not _ready(server, deadline - time.monotonic()):
        raise TimeoutError
    line, _, server["buf"] = server["buf"].partition(b"\n")
    return json.loads(line)


class Started:
    """A ``kvprobe`` process started by :func:`start`: ``pid``, ``poll()``, ``send_signal(sig)`` and
    ``wait(timeout)``, which returns its ``subprocess.CompletedProcess``."""

    def __init__(self, args: list[str], pid: int, tmp: Path):
        self.args, self.pid, self.tmp, self.returncode = args, pid, tmp, None

    def poll(self) -> int | None:
        if self.returncode is None and _ready(_server, 0):
            self.returncode = _read(_server, time.monotonic() + 30)["code"]
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def output(self) -> tuple[str, str]:
        return (self.tmp / "stdout").read_text(), (self.tmp / "stderr").read_text()

    def wait(self, timeout: float = 600) -> subprocess.CompletedProcess:
        try:
            if self.returncode is None:
                try:
                    self.returncode = _read(_server, time.monotonic() + timeout)["code"]
                except TimeoutError:
                    os.kill(self.pid, 9)
                    _read(_server, time.monotonic() + 30)
                    raise subprocess.TimeoutExpired(self.args, timeout, *self.output()) from None
            return subprocess.CompletedProcess(self.args, self.returncode, *self.output())
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def start(*args, env: dict | None = None, cwd: str | Path | None = None, script: str | Path | None = None,
          code: str | None = None) -> Started:
    """Start ``kvprobe ARGS`` in a forked process and return at once (one at a time per test
    process: the next call waits for this one). ``env`` replaces the environment, ``cwd`` the
    working directory. With ``script`` or ``code``, the process runs ``python SCRIPT ARGS`` or
    ``python -c CODE ARGS`` instead (see :func:`run_script`)."""
    args = [str(a) for a in args]
    if not _server or _server["proc"].poll() is not None:
        _server.clear()
        _server.update(_start())
    tmp = Path(tempfile.mkdtemp(prefix="kvprobe-cli-"))
    out, err = tmp / "stdout", tmp / "stderr"
    out.touch()
    err.touch()
    request = {"args": args, "env": dict(os.environ if env is None else env), "cwd": str(cwd or os.getcwd()),
               "stdout": str(out), "stderr": str(err), "script": str(script) if script else None, "code": code}
    _server["proc"].stdin.write(json.dumps(request) + "\n")
    _server["proc"].stdin.flush()
    head = ["python", str(script)] if script else ["python", "-c", code] if code is not None else ["kvprobe"]
    return Started([*head, *args],
                   _read(_server, time.monotonic() + 60)["pid"], tmp)


def run(*args, env: dict | None = None, cwd: str | Path | None = None, timeout: float = 600
        ) -> subprocess.CompletedProcess:
    """``kvprobe ARGS`` in a forked process: exit code, stdout and stderr as text. ``env`` replaces
    the environment (as ``subprocess.run(env=...)``), ``cwd`` the working directory."""
    return start(*args, env=env, cwd=cwd).wait(timeout)


def run_script(script: str | Path, *args, env: dict | None = None, cwd: str | Path | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` in a forked process, as :func:`run` runs ``kvprobe ARGS``: the script
    runs as ``__main__`` (``runpy.run_path``) with its folder first on ``sys.path``, in a process
    that has imported the model stack already. What it cannot give: an interpreter option, or an
    environment variable read only when Python starts (``PYTHONPATH``, ``PYTHONHASHSEED`` ...): a
    caller that needs one starts a plain process. A module the fork server imported already (the
    model stack, kvprobe's run, report and probe modules) is not imported again: a script that hides
    one (``sys.modules[NAME] = None``) can hide only what the server has not imported."""
    return start(*args, env=env, cwd=cwd, script=script).wait(timeout)


def run_code(code: str, *args, env: dict | None = None, cwd: str | Path | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS`` in a forked process, as :func:`run_script` runs a script."""
    return start(*args, env=env, cwd=cwd, code=code).wait(timeout)
