"""Alignment under a real BPE tokenizer (SmolLM2's, fetched into the kvprobe cache on first use)."""

from __future__ import annotations

import pytest

from kvprobe.datasets import AlignedCase, align, generate


@pytest.fixture(scope="module")
def bpe_tok():
    from transformers import AutoTokenizer

    from kvprobe.models import fetch

    return AutoTokenizer.from_pretrained(fetch("smollm2-135m"))


@pytest.mark.parametrize("form", ["chat", "raw"])
def test_most_cases_align_under_bpe(bpe_tok, form):
    cases = generate(100, seed=0, controls=0.2, few_shot=1)
    aligned = [a for a in (align(c, bpe_tok, form) for c in cases) if isinstance(a, AlignedCase)]
    assert len(aligned) >= 80
    for a in aligned:
        lo, hi = a.field
        assert bpe_tok.decode(a.ids_old[lo:hi]).strip() == a.case.old_value
        assert bpe_tok.decode(a.ids_new[lo:hi]).strip() == a.case.new_value
        assert a.ids_old[:lo] == a.ids_new[:lo] and a.ids_old[hi:] == a.ids_new[hi:]
        assert not set(a.option_ids["yes"]) & set(a.option_ids["no"])
