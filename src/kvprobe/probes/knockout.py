"""The read circuit at the decision token: attention-edge knockout and head-output patching.

Two probes, both reading the decision token (position D) against a cache of positions [0, D):

- :class:`EdgeKnockout` ("edge_knockout") hides cache entries from the decision token, on all
  layers or on a band of layers (thirds of depth, or single layers), and reports how the decision
  moves: the top-k notes (downstream positions ranked by single-position K/V patch effect), the
  field span, and k random downstream positions (the control). It does this on the old (stale)
  cache and on the new (oracle) cache, each against its own unablated read.

  What the numbers mean. On the *old* cache the notes carry the old value's consequences; if the
  decision reads them, hiding them must move it: ``flip`` is 1 when the arg-max option differs
  from the unablated stale read, and ``dm = m - m_stale`` > 0 means it moved toward the new
  answer (m = score(new answer) - score(old answer)). This is the paper's "masking the decision
  token's attention to the stale notes flips the decision". It does not claim the decision lands
  on the *new* answer: without notes the model falls back on whatever else it reads. On the
  *new* cache the same knockout hides the fresh notes; there ``dm = m - m_oracle`` < 0 means the
  decision lost its new-value evidence. Random-k knockouts are the specificity control.

- :class:`HeadPatch` ("head_patch") patches attention-head *outputs* at the decision token: read
  from the old cache, and replace head h of layer l's slice of the o_proj input (the
  concatenated per-head outputs, (B, 1, n_heads * head_dim), head h = ``h*hd:(h+1)*hd``) with
  the value it takes when the decision token reads the new cache. One batched read gives every
  (layer, head); then the top-n heads together against random sets of n heads, and all heads.
  Recovery is ``(m - m_stale) / (m_oracle - m_stale)``. Heads are *query* heads (what o_proj
  sees), n_heads of them per layer even under GQA.

Both work through hooks on the adapter's modules, installed only inside context managers that
remove them in ``finally``: :func:`attention_knockout` (a forward pre-hook on each chosen
layer's attention module that edits its ``attention_mask`` keyword) and :func:`head_patching`
(a forward pre-hook on each chosen layer's o_proj). Reads go through
:func:`kvprobe.kv.cache.masked_forward`, so every layer receives an explicit 4D additive mask
that already carries causality and the sliding window; the knockout only adds hidden columns.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from kvprobe.datasets import AlignedCase
from kvprobe.kv.readout import logit_diff, option_columns, predicted
from kvprobe.errors import KvprobeError, UsageError
from kvprobe.probes.base import Inputs, ProbeStage, register, rows, run_each, top_notes
from kvprobe.results import KNOCKOUT
from kvprobe.probes.engine import (HeadSet, PairCaches, head_inputs, head_patched_reads, knockout_reads,
                                   single_position_effects)
from kvprobe.probes.locality import targets

BANDS = ("all", "early", "middle", "late")

# -- layer bands -----------------------------------------------------------------------------
def band_layers(band: str, n_layers: int) -> tuple[int, ...]:
    """Layers of a band: "all", a third of depth ("early", "middle", "late"), or "layer<i>".

    Layer l belongs to third ``floor(3 * l / n_layers)``; with fewer than three layers a third
    can be empty (then the band is skipped by the probe).
    """
    if band == "all":
        return tuple(range(n_layers))
    if band in ("early", "middle", "late"):
        third = ("early", "middle", "late").index(band)
        return tuple(lay for lay in range(n_layers) if 3 * lay // n_layers == third)
    if band.startswith("layer") and band[5:].isdigit() and int(band[5:]) < n_layers:
        return (int(band[5:]),)
    raise UsageError(f"unknown layer band {band!r}; accepted: all, early, middle, late, "
                     f"layer0..layer{n_layers - 1}")


def _preds(logits: torch.Tensor, a: AlignedCase) -> list[str]:
    return predicted(logits, a.option_ids, a.case.options)


# -- probes ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EdgeKnockout:
    """Block the decision token's attention to the notes, the field, or random positions.

    ``top_positions`` maps case_id -> downstream positions ranked by single-position patch effect
    (e.g. from the locality probe's sweep); cases without an entry get the sweep computed here.
    Rows: metric ``m`` (ablated), ``dm`` (m minus the unablated m of the same cache), ``flip``
    (1 when the arg-max option differs from the unablated read of that cache); extras ``cache``
    ("old" or "new"), ``set`` (none, topk, field, randomk), ``k``, ``band``, ``layers``.
    """

    name = "edge_knockout"
    ks: tuple[int, ...] = (8,)
    bands: tuple[str, ...] = BANDS
    per_layer: bool = False  # also one band per single layer
    n_random: int = 3
    caches: tuple[str, ...] = ("old", "new")
    top_positions: Mapping[str, Sequence[int]] | None = None
    seed: int = 0
    model_name: str = ""

    def run(self, lm, pairs: Sequence[AlignedCase]) -> pd.DataFrame:
        return run_each(self, lm, pairs)

    def layer_bands(self, n_layers: int) -> list[tuple[str, tuple[int, ...]]]:
        names = list(self.bands) + ([f"layer{i}" for i in range(n_layers)] if self.per_layer else [])
        return [(b, band_layers(b, n_layers)) for b in names if band_layers(b, n_layers)]

    def sets(self, a: AlignedCase, ranked: Sequence[int]) -> list[tuple[str, int | None, tuple[int, ...]]]:
        """(set name, k, hidden positions): none, field, top-k notes, random-k downstream."""
        (f0, f1), (d0, d1) = a.field, a.downstream
        down = list(range(d0, d1))
        rng = random.Random(f"{self.seed}:{a.case.case_id}")
        out = [("none", None, ()), ("field", None, tuple(range(f0, f1)))]
        for k in self.ks:
            if k > len(down):
                continue
            out.append(("topk", k, tuple(sorted(ranked[:k]))))
            out += [("randomk", k, tuple(sorted(rng.sample(down, k)))) for _ in range(self.n_random)]
        return out

    def ranked(self, lm, a: AlignedCase, pc: PairCaches, m_of) -> list[int]:
        if self.top_positions is not None and a.case.case_id in self.top_positions:
            given = [int(p) for p in self.top_positions[a.case.case_id]]
            d0, d1 = a.downstream
            if any(not d0 <= p < d1 for p in given):
                raise KvprobeError(f"top_positions for {a.case.case_id} must be downstream positions in [{d0}, {d1})")
            return given
        effects = single_position_effects(lm, pc, m_of)
        return sorted(range(*a.downstream), key=lambda p: -float(effects[p]))

    def run_case(self, lm, a: AlignedCase, pc: PairCaches | None = None) -> pd.DataFrame:
        pc = pc or PairCaches.build(lm, a)
        new_ans, old_ans = targets(a)
        m_of = lambda lg: logit_diff(lg, a.option_ids, new_ans, old_ans)  # noqa: E731
        D, L, token = pc.D, lm.adapter.n_layers, a.ids_old[pc.D]
        ranked = self.ranked(lm, a, pc, m_of)
        sets, bands = self.sets(a, ranked), self.layer_bands(L)
        if not bands:
            raise UsageError(f"no layers in bands {self.bands} for a model of {L} layers")
        plan = [(s, b) for s in sets for b in (bands if s[2] else bands[:1])]  # "none": once
        hidden = torch.zeros(len(plan), L, D, dtype=torch.bool)  # (B, L, D)
        for row, ((_, _, positions), (_, layers)) in enumerate(plan):
            if positions:
                hidden[row, torch.tensor(layers)[:, None], torch.tensor(positions)[None]] = True
        records, refs = [], {}
        for which in self.caches:
            cache = {"old": pc.old, "new": pc.new}[which]
            logits = knockout_reads(lm, cache, token, D, hidden, columns=option_columns(a.option_ids))
            ms, preds = m_of(logits).tolist(), _preds(logits, a)
            refs[which] = ms[0]  # plan[0] is "none": the unablated read
            for ((name, k, positions), (band, layers)), m, pred in zip(plan, ms, preds):
                region = {"field": "field", "none": None}.get(name, "downstream")
                for metric, value in (("m", m), ("dm", m - ms[0]), ("flip", float(pred != preds[0]))):
                    records.append({"region": region, "metric": metric, "value": value, "cache": which,
                                    "set": name, "k": k if k is not None else len(positions),
                                    "band": band if positions else None,
                                    "layers": ",".join(map(str, layers)) if positions else None})
        df = rows(self.model_name, a.case.case_id, self.name, records)
        df["m_stale"], df["m_oracle"] = refs.get("old"), refs.get("new")
        df["control"], df["n_positions"] = a.case.control, D
        return df


@dataclass(frozen=True)
class HeadPatch:
    """Rank heads by patching their output at the decision token from the new read.

    Rows per (layer, head): ``m``, ``effect`` (m - m_stale) and ``recovery``; per set (``top``:
    the n best heads by recovery, ``random``: n random heads, ``n_random`` draws, ``all``: every
    head): ``m``, ``recovery`` and ``agree`` (arg-max option equals the oracle's). ``k`` is the
    number of heads used: ``min(top_n, n_layers * n_heads)``.
    """

    name = "head_patch"
    top_n: int = 12
    n_random: int = 5
    seed: int = 0
    model_name: str = ""

    def run(self, lm, pairs: Sequence[AlignedCase]) -> pd.DataFrame:
        return run_each(self, lm, pairs)

    def run_case(self, lm, a: AlignedCase, pc: PairCaches | None = None) -> pd.DataFrame:
        pc = pc or PairCaches.build(lm, a)
        new_ans, old_ans = targets(a)
        m_of = lambda lg: logit_diff(lg, a.option_ids, new_ans, old_ans)  # noqa: E731
        D, token = pc.D, a.ids_old[pc.D]
        L, H = lm.adapter.n_layers, lm.adapter.n_heads
        cols = option_columns(a.option_ids)  # reads compute the options' logits only
        oracle_logits, source = head_inputs(lm, pc.new, token, D, cols)  # source: (L, H * hd)
        m_oracle = float(m_of(oracle_logits))
        oracle_pred = _preds(oracle_logits[None], a)[0]
        heads = [(layer, head) for layer in range(L) for head in range(H)]
        singles = [HeadSet()] + [HeadSet({lh}) for lh in heads]  # row 0: the stale read
        ms = m_of(head_patched_reads(lm, pc.old, token, D, singles, source, columns=cols)).tolist()
        m_stale, flip = ms[0], m_oracle - ms[0]
        rec = lambda m: (m - m_stale) / flip if flip else float("nan")  # noqa: E731
        records = []
        for (layer, head), m in zip(heads, ms[1:]):
            for metric, value in (("m", m), ("effect", m - m_stale), ("recovery", rec(m))):
                records.append({"layer": layer, "head": head, "metric": metric, "value": value,
                                "set": "single", "k": 1})
        k = min(self.top_n, len(heads))
        score = [(m - m_stale) * (1 if flip >= 0 else -1) for m in ms[1:]]  # toward the oracle
        top = HeadSet(h for _, h in sorted(zip(score, heads), key=lambda t: -t[0])[:k])
        rng = random.Random(f"{self.seed}:{a.case.case_id}")
        named = [("top", top), ("all", HeadSet(heads))]
        named += [("random", HeadSet(rng.sample(heads, k))) for _ in range(self.n_random)]
        logits = head_patched_reads(lm, pc.old, token, D, [s for _, s in named], source, columns=cols)
        for (name, heads_set), m, pred in zip(named, m_of(logits).tolist(), _preds(logits, a)):
            for metric, value in (("m", m), ("recovery", rec(m)), ("agree", float(pred == oracle_pred))):
                records.append({"metric": metric, "value": value, "set": name, "k": len(heads_set),
                                "heads": ";".join(f"{lay}.{h}" for lay, h in sorted(heads_set))})
        df = rows(self.model_name, a.case.case_id, self.name, records)
        df["m_stale"], df["m_oracle"], df["oracle_flip"] = m_stale, m_oracle, flip
        df["control"], df["n_positions"] = a.case.control, D
        return df


@dataclass(frozen=True)
class Knockout:
    """The run's knockout stage: attention-edge knockout, then head patching, per case."""

    edge: EdgeKnockout
    heads: HeadPatch

    def run_case(self, lm, a: AlignedCase, pc: PairCaches | None = None) -> pd.DataFrame:
        pc = pc or PairCaches.build(lm, a)
        return pd.concat([p.run_case(lm, a, pc) for p in (self.edge, self.heads)], ignore_index=True)


def _build(inputs: Inputs) -> Knockout:
    ranked = top_notes(inputs.table("locality"), k=None)  # the locality sweep's notes, where it ran
    return Knockout(EdgeKnockout(top_positions=ranked or None, seed=inputs.seed, model_name=inputs.model_name),
                    HeadPatch(seed=inputs.seed, model_name=inputs.model_name))


STAGE = register(ProbeStage("knockout", KNOCKOUT, _build, needs=("locality",), sections=("knockout",)))
