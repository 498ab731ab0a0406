"""Attention shares of the decision token sum to 1 per layer and head."""

from __future__ import annotations

import pytest

from kvprobe.datasets import AlignedCase, align, generate
from kvprobe.probes.attention import ATTN_REGIONS, Attention
from tests.conftest import tiny_model


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-gemma2"])
def test_attention_shares_sum_to_one(name):
    lm = tiny_model(name)
    pairs = [a for a in (align(c, lm.tokenizer, "raw") for c in generate(3, seed=1)) if isinstance(a, AlignedCase)]
    df = Attention().run(lm, pairs)
    assert set(df.region) == set(ATTN_REGIONS) and (df.metric == "attn_share").all()
    per_head = df[df["head"].notna()]
    assert len(per_head) == len(pairs) * lm.adapter.n_layers * lm.adapter.n_heads * len(ATTN_REGIONS)
    sums = per_head.groupby(["case_id", "layer", "head"]).value.sum()
    assert sums.to_numpy() == pytest.approx(1.0, abs=1e-4)
    per_layer = df[df["head"].isna() & df.layer.notna()].groupby(["case_id", "layer"]).value.sum()
    assert per_layer.to_numpy() == pytest.approx(1.0, abs=1e-4)
    overall = df[df.layer.isna()].groupby("case_id").value.sum()
    assert overall.to_numpy() == pytest.approx(1.0, abs=1e-4)
    assert (df[df.region == "sink"].n_keys == 1).all() and (df[df.region == "decision"].n_keys == 1).all()
