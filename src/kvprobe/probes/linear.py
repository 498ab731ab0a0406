"""Linear probes: at which depth is the conclusion written into the notes, and when does it commit?

Population-level, not per case: every decision case gives two samples, its old and its new
prompt (the conclusion flips with the value). Both prompts of a case run once through the decision
token (in ``kvprobe run``, the validity pass that builds the case's caches, :class:`PairMemo`, records
every layer's residual stream too, so this probe runs no forward pass of its own) and are read out
layer by layer at three sites:

- ``field``: the mean over the field span of K, V (cache, heads flattened) and the residual;
- ``notes``: the mean over the note positions of K, V and the residual. Note positions are an
  input (case_id -> positions, e.g. the top-k downstream positions by single-position patch effect
  from :mod:`kvprobe.probes.locality`); by default the aggregator tokens (newline, punct, section)
  of the downstream span;
- ``decision``: the residual at the decision token.

Layer ``l`` means: K/V of layer l's attention, and the residual after layer l (before the final
norm). Two labels: ``value`` (the value's side: is the expected answer the first option, i.e. does
the value allow) and ``decision`` (is the model's predicted option the first one). Controls are
excluded. A standardized logistic regression is cross-validated with GroupKFold grouped by
``case.template_id``, so no template is in train and test at once; with fewer than two templates
no accuracy is reported (a ``note`` says why). A shuffled-label run of the same CV gives chance.

Summaries: ``write_depth`` is the first layer whose accuracy reaches ``threshold`` (reported for
every site/stream/label; the paper's number is site ``notes``); ``commit_depth`` is the first layer
from which a logit lens at the decision token (final norm + LM head on the residual, arg-max over
the options) agrees with the model's own decision on at least ``commit_threshold`` of the samples
at that layer and every later one. Depth rows carry the layer; the value is ``layer / n_layers``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from kvprobe.datasets import AlignedCase
from kvprobe.kv.readout import option_scores
from kvprobe.errors import KvprobeError
from kvprobe.kv import cache as kvcache
from kvprobe.probes.base import Inputs, ProbeStage, register, rows, top_notes
from kvprobe.probes.engine import PairCaches, PairMemo, pair_pass
from kvprobe.results import LINEAR

AGGREGATOR_KINDS = ("newline", "punct", "section")
SITES = ("field", "notes", "decision")
STREAMS = ("k", "v", "resid")
LABELS = ("value", "decision")


def default_notes(a: AlignedCase) -> list[int]:
    """The aggregator tokens (newline/punct/section) of the downstream span; all of it if none."""
    d0, d1 = a.downstream
    notes = [p for p in range(d0, d1) if a.kinds[p] in AGGREGATOR_KINDS]
    return notes or list(range(d0, d1))


@dataclass
class Samples:
    """Probe features of N samples: ``features[(site, stream)]`` is (N, n_layers, dim)."""

    features: dict[tuple[str, str], np.ndarray]
    labels: dict[str, np.ndarray]  # (N,) in {0, 1}
    groups: np.ndarray  # (N,) template ids
    lens: np.ndarray  # (N, n_layers) logit-lens decision == the model's decision
    case_ids: list[str]


@torch.no_grad()
def pair_features(lm, a: AlignedCase, notes: Sequence[int], pc: PairCaches | None = None
                  ) -> list[tuple[dict, int, np.ndarray]]:
    """The old and the new prompt's features, each: by (site, stream) -> (n_layers, dim), the
    predicted option index, and per layer whether the logit lens at the decision token picks it.

    Every site lies at or after the field (unless a note lies before it), where the two prompts
    start to differ: the features come from the case's :class:`PairCaches` built with residuals
    (``kvprobe run`` builds it once, at validity), else from one pass of both prompts from the first
    site on (:func:`~kvprobe.probes.engine.pair_pass`, the prefix read from ``pc`` when given).
    """
    D, (f0, f1) = a.decision_pos, a.field
    start = min(f0, *notes)
    options = a.case.options
    if pc is not None and pc.resid is not None and start == f0:
        logits, res = pc.logits, pc.resid
        kv = [(torch.cat([k0, k1]), torch.cat([v0, v1]))
              for (k0, v0), (k1, v1) in zip(kvcache.to_tensors(pc.old), kvcache.to_tensors(pc.new))]
    else:
        logits, cache, res = pair_pass(lm, a, start, pc.old if pc is not None else None, residuals=True)
        kv = kvcache.to_tensors(cache)
    # res: (2, L, D + 1 - start, hidden); kv: per layer (2, H_kv, >= D, hd); position p is index p - start
    preds = option_scores(logits.float().cpu(), a.option_ids, options).argmax(-1).tolist()
    L = lm.adapter.n_layers
    keys = torch.stack([k[:, :, start:D].transpose(1, 2).flatten(2) for k, _ in kv], 1)  # (2, L, D - start, H_kv*hd)
    vals = torch.stack([v[:, :, start:D].transpose(1, 2).flatten(2) for _, v in kv], 1)
    field, note = [p - start for p in range(f0, f1)], [p - start for p in notes]
    samples = []
    for row in range(2):
        feats = {}
        for site, pos in (("field", field), ("notes", note)):
            for stream, x in (("k", keys), ("v", vals), ("resid", res)):
                feats[(site, stream)] = x[row][:, pos].float().mean(1).cpu().numpy()  # (L, dim)
        decision = res[row][:, D - start]  # (L, hidden)
        feats[("decision", "resid")] = decision.float().cpu().numpy()
        # logit lens: final norm + LM head on the decision-token residual after each layer
        lens_logits = lm.adapter.lm_head(lm.model)(lm.adapter.final_norm(lm.model)(decision))  # (L, V)
        lens = option_scores(lens_logits.float().cpu(), a.option_ids, options).argmax(-1).numpy() == preds[row]
        assert lens.shape == (L,)
        samples.append((feats, preds[row], lens))
    return samples


def collect(lm, pairs: Sequence[AlignedCase], notes: Mapping[str, Sequence[int]] | None = None,
            memo: PairMemo | None = None) -> Samples:
    """Old and new prompt of every non-control case -> :class:`Samples`; ``memo`` (a run's
    :class:`~kvprobe.probes.engine.PairMemo`) gives each case's caches and residual streams."""
    feats: dict[tuple[str, str], list] = {}
    value, decision, groups, lens, case_ids = [], [], [], [], []
    for a in pairs:
        c = a.case
        if c.control:
            continue
        if notes is None:
            pos = default_notes(a)
        elif c.case_id not in notes:
            raise KvprobeError(f"no note positions given for case {c.case_id}; pass them for every case or none")
        else:
            pos = sorted(int(p) for p in notes[c.case_id])
            if not pos or not all(0 <= p < a.decision_pos for p in pos):
                raise KvprobeError(f"case {c.case_id}: note positions must be non-empty and in [0, {a.decision_pos})")
        both = pair_features(lm, a, pos, memo.get(a) if memo is not None else None)
        for (f, pred, ln), expected in zip(both, (c.expected_old, c.expected_new)):
            for key, x in f.items():
                feats.setdefault(key, []).append(x)
            value.append(int(expected == c.options[0]))
            decision.append(int(pred == 0))
            groups.append(c.template_id)
            lens.append(ln)
            case_ids.append(c.case_id)
    return Samples({k: np.stack(v) for k, v in feats.items()},
                   {"value": np.array(value), "decision": np.array(decision)},
                   np.array(groups), np.array(lens).reshape(len(lens), -1), case_ids)


def grouped_splits(groups: Sequence, n_splits: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    """GroupKFold (train, test) index pairs: every group lies wholly in train or in test.

    ``n_splits`` is capped at the number of groups; fewer than two groups raises (there is no
    split that does not leak a template).
    """
    from sklearn.model_selection import GroupKFold

    groups = np.asarray(groups)
    n_groups = len(np.unique(groups))
    if n_groups < 2:
        raise KvprobeError(f"grouped CV needs at least 2 templates, got {n_groups}")
    cv = GroupKFold(n_splits=min(n_splits, n_groups))
    return list(cv.split(np.zeros(len(groups)), groups=groups))


def cv_accuracy(X: np.ndarray, y: np.ndarray, splits: list[tuple[np.ndarray, np.ndarray]], C: float = 0.1
                ) -> tuple[float, float]:
    """(mean, std) over folds of held-out accuracy of a standardized logistic regression.

    A fold whose training labels hold one class predicts that class.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    accs = []
    for train, test in splits:
        if len(np.unique(y[train])) < 2:
            pred = np.full(len(test), y[train][0])
        else:
            clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=C))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # convergence chatter on separable data
                clf.fit(X[train], y[train])
            pred = clf.predict(X[test])
        accs.append(float((pred == y[test]).mean()))
    return float(np.mean(accs)), float(np.std(accs))


def first_at(values: Sequence[float], threshold: float, stay: bool = False) -> int | None:
    """The first index whose value is >= threshold (and, with ``stay``, every later one too)."""
    ok = [v >= threshold for v in values]  # NaN compares False
    for i in range(len(ok)):
        if ok[i] and (not stay or all(ok[i:])):
            return i
    return None


def layer_accuracies(features: dict[tuple[str, str], np.ndarray], labels: dict[str, np.ndarray], groups: np.ndarray,
                     n_splits: int = 5, C: float = 0.1, threshold: float = 0.9, seed: int = 0) -> list[dict]:
    """The classifier part on ready features: records of acc/acc_std/acc_shuffled per layer and
    write_depth, for every (site, stream) in ``features`` ((N, n_layers, dim)) and every label."""
    try:
        splits = grouped_splits(groups, n_splits)
        note = None
    except KvprobeError as err:
        splits, note = None, str(err)
    rng = np.random.default_rng(seed)
    records = []
    for label, y in labels.items():
        y = np.asarray(y)
        single = len(np.unique(y)) < 2
        y_shuf = rng.permutation(y)
        for (site, stream), X in features.items():
            n_layers = X.shape[1]
            base = {"region": site, "stream": stream, "label": label, "n": len(y)}
            why = note or ("labels hold a single class" if single else None)
            accs = []
            for layer in range(n_layers):
                if why:
                    acc = std = shuf = float("nan")
                else:
                    acc, std = cv_accuracy(X[:, layer], y, splits, C)
                    shuf, _ = cv_accuracy(X[:, layer], y_shuf, splits, C)
                accs.append(acc)
                for metric, value in (("acc", acc), ("acc_std", std), ("acc_shuffled", shuf)):
                    records.append({**base, "layer": layer, "metric": metric, "value": value, "note": why})
            depth = first_at(accs, threshold)
            records.append({**base, "layer": depth, "metric": "write_depth",
                            "value": float("nan") if depth is None else depth / n_layers, "note": why})
    return records


@dataclass(frozen=True)
class Linear:
    """Linear decodability of the value and the decision, per site/stream/layer, and the logit lens."""

    name = "linear"
    notes: Mapping[str, Sequence[int]] | None = None  # case_id -> note positions; None: aggregator tokens
    memo: PairMemo | None = None  # a run's PairMemo: each case's caches and residual streams, built once
    n_splits: int = 5
    C: float = 0.1
    threshold: float = 0.9  # write depth: first layer with CV accuracy >= threshold
    commit_threshold: float = 0.9  # commit depth: logit-lens agreement >= this from there on
    seed: int = 0
    model_name: str = ""

    def run(self, lm, pairs: Sequence[AlignedCase]) -> pd.DataFrame:
        s = collect(lm, pairs, self.notes, self.memo)
        if not s.case_ids:
            raise KvprobeError("the linear probe needs decision (non-control) cases; got none")
        L = lm.adapter.n_layers
        records = layer_accuracies(s.features, s.labels, s.groups, self.n_splits, self.C, self.threshold, self.seed)
        agree = s.lens.mean(0)  # (L,)
        lens = {"region": "decision", "stream": "resid", "label": "decision", "n": len(s.case_ids), "note": None}
        records += [{**lens, "layer": layer, "metric": "logit_lens_agree", "value": float(agree[layer])}
                    for layer in range(L)]
        depth = first_at(agree.tolist(), self.commit_threshold, stay=True)
        records.append({**lens, "layer": depth, "metric": "commit_depth",
                        "value": float("nan") if depth is None else depth / L})
        df = rows(self.model_name, None, self.name, records)
        df["n_templates"], df["n_layers"] = len(np.unique(s.groups)), L
        return df


def _build(inputs: Inputs) -> Linear:
    notes = {c: p[:8] for c, p in top_notes(inputs.table("locality"), k=None).items()}
    return Linear(model_name=inputs.model_name, notes=notes or None, memo=inputs.pairs)


STAGE = register(ProbeStage("linear", LINEAR, _build, per_case=False, needs=("locality",), sections=("linear",),
                            residuals=True))
