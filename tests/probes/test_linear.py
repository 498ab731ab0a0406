"""Linear probes: grouped CV never leaks a template; separable features decode; the probe runs end to end."""

from __future__ import annotations

import numpy as np
import pytest

from kvprobe.datasets import AlignedCase, align, generate
from kvprobe.errors import KvprobeError
from kvprobe.probes.linear import Linear, default_notes, first_at, grouped_splits, layer_accuracies
from tests.conftest import tiny_model


def test_grouped_splits_never_share_a_group():
    groups = np.repeat([f"t{i}" for i in range(7)], [3, 1, 4, 2, 5, 2, 3])
    splits = grouped_splits(groups, n_splits=5)
    assert len(splits) == 5
    seen = []
    for train, test in splits:
        assert not set(groups[train]) & set(groups[test])
        seen += list(test)
    assert sorted(seen) == list(range(len(groups)))  # every sample tested exactly once


def test_grouped_splits_refuse_one_group():
    with pytest.raises(KvprobeError, match="at least 2 templates"):
        grouped_splits(["t0"] * 6)


def test_separable_layer_decodes_and_shuffled_is_chance():
    rng = np.random.default_rng(0)
    n, layers, dim = 80, 3, 6
    y = np.tile([0, 1], n // 2)
    groups = np.repeat([f"t{i}" for i in range(8)], n // 8)
    X = rng.normal(size=(n, layers, dim))
    X[:, 2, 0] += 6.0 * (2 * y - 1)  # layer 2 separates the classes with a wide margin
    recs = layer_accuracies({("notes", "k"): X}, {"value": y}, groups, n_splits=4, threshold=0.95)
    acc = {r["layer"]: r["value"] for r in recs if r["metric"] == "acc"}
    shuf = {r["layer"]: r["value"] for r in recs if r["metric"] == "acc_shuffled"}
    assert acc[2] == 1.0
    assert acc[0] < 0.8 and acc[1] < 0.8
    assert shuf[2] < 0.8
    (depth,) = [r for r in recs if r["metric"] == "write_depth"]
    assert depth["layer"] == 2 and depth["value"] == pytest.approx(2 / 3)


def test_one_template_is_reported_not_leaked():
    X = np.random.default_rng(0).normal(size=(10, 2, 3))
    recs = layer_accuracies({("field", "v"): X}, {"value": np.tile([0, 1], 5)}, np.array(["t"] * 10))
    assert all(np.isnan(r["value"]) for r in recs)
    assert all("2 templates" in r["note"] for r in recs)


def test_first_at_stay():
    assert first_at([0.2, 0.95, 0.5, 0.92, 1.0], 0.9) == 1
    assert first_at([0.2, 0.95, 0.5, 0.92, 1.0], 0.9, stay=True) == 3
    assert first_at([0.1, float("nan")], 0.9) is None


def _cases(lm, n=12):
    out = [align(c, lm.tokenizer, "raw") for c in generate(n, seed=3)]
    return [a for a in out if isinstance(a, AlignedCase)]


def test_linear_end_to_end_tiny():
    lm = tiny_model("tiny-qwen2")
    pairs = _cases(lm)
    df = Linear(n_splits=3).run(lm, pairs)
    L = lm.adapter.n_layers
    assert set(df.metric) == {"acc", "acc_std", "acc_shuffled", "logit_lens_agree", "write_depth", "commit_depth"}
    assert set(df.region) == {"field", "notes", "decision"}
    assert df.case_id.isna().all() and (df.probe == "linear").all()
    acc = df[df.metric == "acc"]
    assert len(acc) == L * 7 * 2  # (field, notes) x (k, v, resid) + decision resid, two labels, per layer
    lens = df[df.metric == "logit_lens_agree"].sort_values("layer")
    assert lens.value.iloc[-1] == 1.0  # the lens at the last layer is the model itself
    commit = df[df.metric == "commit_depth"].iloc[0]
    assert commit.layer is not None and 0 <= commit.layer < L


def test_notes_must_cover_every_case():
    lm = tiny_model("tiny-qwen2")
    pairs = [a for a in _cases(lm) if not a.case.control][:2]
    with pytest.raises(KvprobeError, match="no note positions"):
        Linear(notes={pairs[0].case.case_id: default_notes(pairs[0])}).run(lm, pairs)
