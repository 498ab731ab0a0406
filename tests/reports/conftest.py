"""One tiny-model results folder per test session, and helpers to derive variants of it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

PROBES = ["locality", "attention", "knockout", "linear"]


def make_results(out: Path) -> Path:
    """``kvprobe run --model tiny-qwen2 --n 4 --all-cases`` (a few strategies and Ks, to stay small),
    plus tokens.parquet where the pipeline does not write it yet."""
    from kvprobe.datasets import Skip, align, resolve_dataset
    from kvprobe.config import RunConfig
    from kvprobe.pipeline import run
    from kvprobe.datasets.tokens import TOKENS, case_tokens
    from tests.conftest import tiny_model

    cfg = RunConfig(model="tiny-qwen2", n=4, valid_only=False, probes=PROBES,
                    strategies=["stale", "field_only", "selective:4:random", "erratum", "oracle"], ks=[1, 4],
                    rankings=["causal", "random"])
    lm = tiny_model(cfg.model)
    run(cfg, out, lm=lm)
    if not (out / TOKENS).exists():
        cases = resolve_dataset(cfg.dataset, n=cfg.n, seed=cfg.seed, few_shot=cfg.few_shot)
        aligned = [a for a in (align(c, lm.tokenizer, cfg.form) for c in cases) if not isinstance(a, Skip)]
        case_tokens(lm, aligned).to_parquet(out / TOKENS, index=False)
    shutil.rmtree(out / "parts", ignore_errors=True)
    return out


@pytest.fixture(scope="session")
def tiny_results(tmp_path_factory) -> Path:
    """A finished results folder of tiny-qwen2 (read-only: copy it with ``variant`` to change it)."""
    return make_results(tmp_path_factory.mktemp("tiny-run") / "tiny-qwen2")


@pytest.fixture
def variant(tiny_results, tmp_path):
    """``variant(name)``: a fresh copy of the session's results folder to modify."""
    def copy(name: str = "copy") -> Path:
        dst = tmp_path / name
        shutil.copytree(tiny_results, dst)
        return dst
    return copy
