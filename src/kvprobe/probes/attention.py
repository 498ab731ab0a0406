"""Attention shares: where does the decision token look?

The old prompt's cache (positions [0, D)) is prefilled, then the decision token is read with
``output_attentions=True`` (eager attention). Its attention weights, (H, D + 1) per layer, are
summed over the keys of each region (:func:`kvprobe.probes.base.region_of`): ``sink`` (position
0), ``prefix`` (the rest before the field), ``field``, ``downstream`` and ``decision`` (the token
attending to itself). The five shares sum to 1 for every layer and head.

Rows: metric ``attn_share`` per (layer, head, region); per layer the mean over heads
(``head`` None); and the mean over layers and heads (``layer`` and ``head`` None). ``n_keys``
says how many keys each region holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from transformers import DynamicCache

from kvprobe.datasets import AlignedCase
from kvprobe.errors import KvprobeError
from kvprobe.kv import cache as kvcache
from kvprobe.probes.base import Inputs, ProbeStage, region_of, register, rows, run_each
from kvprobe.probes.engine import PairCaches
from kvprobe.results import ATTENTION

ATTN_REGIONS = ("sink", "prefix", "field", "downstream", "decision")


@torch.no_grad()
def decision_attention(lm, a: AlignedCase, cache: DynamicCache | None = None) -> torch.Tensor:
    """The decision token's attention over the old prompt, (n_layers, H, D + 1); ``cache``: the old
    prompt's cache of [0, D) when one is at hand (left as it was), else it is prefilled here."""
    D = a.decision_pos
    ids = torch.tensor(a.ids_old, device=lm.device)
    if cache is None:
        _, cache = kvcache.prefill(lm.model, ids[:D], logits_to_keep=1)
    try:
        out = kvcache.forward(lm.model, ids[D:D + 1][None], cache, output_attentions=True)
    finally:
        kvcache.truncate_(cache, D)
    if not out.attentions or out.attentions[0] is None:
        raise KvprobeError("the model returned no attention weights; load it with attn_implementation='eager'")
    att = torch.stack([w[0, :, -1] for w in out.attentions])  # (L, H, D + 1)
    assert att.shape[-1] == D + 1, att.shape
    return att.float().cpu()


def region_shares(a: AlignedCase, att: torch.Tensor) -> dict[str, torch.Tensor]:
    """(L, H, D + 1) weights -> region -> (L, H) summed weight, over :data:`ATTN_REGIONS`."""
    where = [region_of(a, p) for p in range(att.shape[-1])]
    out = {}
    for region in ATTN_REGIONS:
        idx = torch.tensor([p for p, r in enumerate(where) if r == region], dtype=torch.long)
        out[region] = att[..., idx].sum(-1)
    return out


@dataclass(frozen=True)
class Attention:
    """The decision token's attention share by region, per layer and head (old prompt)."""

    name = "attention"
    per_head: bool = True
    model_name: str = ""

    def run(self, lm, pairs: Sequence[AlignedCase]) -> pd.DataFrame:
        return run_each(self, lm, pairs)

    def run_case(self, lm, a: AlignedCase, pc: PairCaches | None = None) -> pd.DataFrame:
        att = decision_attention(lm, a, pc.old if pc is not None else None)
        shares = region_shares(a, att)
        counts = {r: sum(region_of(a, p) == r for p in range(att.shape[-1])) for r in ATTN_REGIONS}
        L, H = att.shape[:2]
        records = []
        for region, s in shares.items():  # s: (L, H)
            base = {"region": region, "metric": "attn_share", "n_keys": counts[region]}
            if self.per_head:
                records += [{**base, "layer": layer, "head": head, "value": float(s[layer, head])}
                            for layer in range(L) for head in range(H)]
            records += [{**base, "layer": layer, "value": float(s[layer].mean())} for layer in range(L)]
            records.append({**base, "value": float(s.mean())})
        df = rows(self.model_name, a.case.case_id, self.name, records)
        df["control"] = a.case.control
        return df


def _build(inputs: Inputs) -> Attention:
    return Attention(model_name=inputs.model_name)


STAGE = register(ProbeStage("attention", ATTENTION, _build, sections=("attention",)))
