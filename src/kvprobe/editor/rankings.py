"""Rankings of a case's downstream positions, most important first: which K positions
``selective:K:RANKING`` recomputes besides the field."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch

from kvprobe.errors import KvprobeError, UsageError
from kvprobe.kv import cache as kvcache

if TYPE_CHECKING:
    from kvprobe.editor.context import EditContext

RANKINGS = ("causal", "random", "attention", "recency", "aggregators")


def attention_by_position(ctx: EditContext) -> torch.Tensor:
    """The decision token's attention to each cache entry of the old prompt, mean over layers and heads (D,)."""
    if ctx._attention is None:
        out = kvcache.forward(ctx.lm.model, torch.tensor([[ctx.a.ids_old[ctx.D]]]), ctx.old_cache, output_attentions=True)
        kvcache.truncate_(ctx.old_cache, ctx.D)
        if not out.attentions or out.attentions[0] is None:
            raise KvprobeError("the attention ranking needs attention weights; load the model with attn='eager'")
        ctx._attention = torch.stack([att[0, :, -1, : ctx.D] for att in out.attentions]).mean((0, 1))
    return ctx._attention


def rank_downstream(ctx: EditContext, ranking: str) -> list[int]:
    """Downstream positions, most important first, under a ranking rule."""
    lo, hi = ctx.a.downstream
    pos = list(range(lo, hi))
    if ranking == "random":
        rng = random.Random(f"{ctx.seed}:{ctx.a.case.case_id}")
        rng.shuffle(pos)
        return pos
    if ranking == "recency":
        return pos[::-1]
    if ranking == "aggregators":  # punctuation, newlines and section marks first, nearest the field first
        agg = [p for p in pos if ctx.a.kinds[p] in ("newline", "punct", "section")]
        return agg + [p for p in pos if p not in set(agg)]
    if ranking == "attention":
        att = attention_by_position(ctx)[lo:hi]
        return [lo + int(i) for i in torch.argsort(att, descending=True, stable=True)]
    if ranking == "causal":
        if ctx.ranking is None:
            raise KvprobeError("the causal ranking is learned by `kvprobe run`: give its topk.yaml (--policy, or "
                               "EditableContext(policy=...)), or pass a ranking")
        return list(ctx.ranking(ctx))
    raise UsageError(f"unknown ranking {ranking!r}; accepted: {', '.join(RANKINGS)}")
