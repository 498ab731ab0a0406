"""Suffix concentration from a real locality sweep: shares sum to 1, the top-k curve rises to 1."""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import pytest

from kvprobe.datasets import AlignedCase, align, generate
from kvprobe.probes.concentration import aggregate_concentration, concentration, topk_ks
from kvprobe.probes.locality import Locality
from tests.conftest import tiny_model


@functools.cache
def _locality() -> pd.DataFrame:
    lm = tiny_model("tiny-llama")
    pairs = [a for a in (align(c, lm.tokenizer, "raw") for c in generate(4, seed=2)) if isinstance(a, AlignedCase)]
    return Locality(ks=(1, 4), n_random=1, per_layer=False, model_name="tiny-llama").run(lm, pairs)


def test_shares_sum_to_one_and_curve_ends_at_one():
    df = concentration(_locality())
    assert (df.probe == "concentration").all() and df.case_id.nunique() == _locality().case_id.nunique()
    for _, g in df.groupby("case_id"):
        for metric in ("region_share", "kind_share"):
            assert g[g.metric == metric].value.sum() == pytest.approx(1.0)
        curve = g[g.metric == "topk_share"].sort_values("k").value.to_numpy()
        assert np.all(np.diff(curve) >= -1e-12) and curve[-1] == pytest.approx(1.0)
        share = g[g.metric == "region_share"].set_index("region").value
        assert share["sink"] + share["prefix"] < 0.01  # identical K/V before the field: batched-read noise only
        k50, k90 = (g[g.metric == m].value.iloc[0] for m in ("k50", "k90"))
        assert 1 <= k50 <= k90


def test_synthetic_sweep():
    sweep = pd.DataFrame({
        "model": "m", "case_id": "c", "metric": "effect", "set": "single", "position": range(6),
        "region": ["sink", "prefix", "field", "downstream", "downstream", "downstream"],
        "kind": ["section", "word", "field", "punct", "word", "newline"],
        "value": [0.0, 0.0, 1.0, -3.0, 0.0, 1.0], "oracle_flip": 5.0, "control": False})
    g = concentration(sweep)
    share = g[g.metric == "region_share"].set_index("region").value
    assert share["downstream"] == pytest.approx(0.8) and share["field"] == pytest.approx(0.2)
    curve = g[g.metric == "topk_share"].set_index("k").value
    assert list(curve.index) == [1, 2, 4] and curve[1] == pytest.approx(0.75) and curve[4] == 1.0
    kind = g[g.metric == "kind_mean_abs"].set_index("kind").value
    assert kind["punct"] == 3.0 and kind["word"] == 0.0
    assert topk_ks(1) == [1] and topk_ks(5) == [1, 2, 4, 8]


def test_aggregate_has_cis_and_fills_curves():
    df = concentration(_locality())
    agg = aggregate_concentration(df, min_flip=0.0)
    assert {"mean", "lo", "hi", "n"} <= set(agg.columns) and (agg.model == "tiny-llama").all()
    top = agg[agg.metric == "topk_share"].sort_values("k")
    n_cases = df[~df.control].case_id.nunique()
    assert (top.n == n_cases).all() and top["mean"].iloc[-1] == pytest.approx(1.0)
    # a guard above every flip drops every case and says so
    none = aggregate_concentration(df, min_flip=1e9)
    assert none.empty or (none.n_excluded_small_flip == n_cases).all()
