"""The KV editor: repair a prefilled cache of the old prompt after one field changed.

Every strategy starts from the same thing a serving engine holds: the cache of the old prompt
``ids_old[:D]`` (D = the decision position; the decision token itself is fed at read time). It
returns an :class:`Edited` state: a cache, the tokens still to feed, and what it cost. Reading
the decision (:func:`decide`) feeds those tokens, optionally generates chain-of-thought tokens,
and returns the decision logits; it never changes the strategy's cache entries.

The strategies are typed classes in :mod:`kvprobe.kv.strategies` and the rankings of ``selective``
are in :mod:`kvprobe.kv.rankings` (both re-exported here). A strategy is named by a
spec string: ``stale``, ``field_only``, ``selective:K:RANKING``, ``cacheblend:R``, ``erratum`` (or
``erratum:short``), ``field_erratum``, ``hoist``, ``oracle``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from kvprobe.kv import cache as C
from kvprobe.kv.rankings import RANKINGS, decision_attention, rank_downstream
from kvprobe.kv.strategies import (STRATEGIES, CacheBlend, Edited, EditContext, Erratum, FieldErratum, FieldOnly,
                                   Hoist, Oracle, Selective, Stale, Strategy, apply, check_length, make_context,
                                   parse_strategy, recompute_positions, register, spec_grammar)

__all__ = ["COT_CUE", "RANKINGS", "STRATEGIES", "CacheBlend", "EditContext", "Edited", "Erratum", "FieldErratum",
           "FieldOnly", "Hoist", "Oracle", "Selective", "Stale", "Strategy", "apply", "check_length", "decide",
           "decide_many", "decision_attention", "make_context", "parse_strategy", "rank_downstream",
           "recompute_positions", "register", "spec_grammar"]

COT_CUE = "\nAnswer:"


def _eos_ids(lm) -> set[int]:
    gen = getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)
    return ({lm.tokenizer.eos_token_id} | set(gen if isinstance(gen, list) else [gen])) - {None}


@torch.no_grad()
def decide_many(lm, edited: Sequence[Edited], cot_tokens: int = 0) -> list[tuple[torch.Tensor, str]]:
    """:func:`decide` for several repaired caches at once: the same results, but with
    ``cot_tokens`` the greedy reasoning of every cache runs as one batch, so a decode step reads
    the weights once for all of them (decoding on a CPU is bound by weight reads).

    Caches of one length and tail feed their tail together; then all rows are padded on the left
    to one length and decode together, each at its own RoPE positions, with the padding masked
    (:func:`kvprobe.kv.cache.left_pad`). A row that ends (EOS or the budget) reads its answer cue
    at once and leaves the batch. Every input cache is left as it was.
    """
    if not cot_tokens:
        return [decide(lm, e, 0) for e in edited]
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(edited):
        groups.setdefault((C.seq_len(e.cache), tuple(e.tail_ids)), []).append(i)
    rows: list[DynamicCache | None] = [None] * len(edited)
    first: list[torch.Tensor | None] = [None] * len(edited)
    for (_, tail), idx in groups.items():
        cache = C.concat([edited[i].cache for i in idx], dim="batch")  # a copy
        logits = C.forward(lm.model, torch.tensor([list(tail)] * len(idx)), cache, logits_to_keep=1).logits[:, -1]
        for r, i in enumerate(idx):
            rows[i], first[i] = C.take_rows(cache, [r]), logits[r]

    eos, cue = _eos_ids(lm), torch.tensor(lm.tokenizer.encode(COT_CUE, add_special_tokens=False))
    cache, key_pos = C.left_pad(rows)
    pos = torch.tensor([C.seq_len(c) for c in rows])  # the next token's position, per row
    active = list(range(len(edited)))  # batch row -> index into ``edited``
    generated: list[list[int]] = [[] for _ in edited]
    out: list[tuple[torch.Tensor, str] | None] = [None] * len(edited)
    logits = torch.stack(first)
    for step in range(cot_tokens + 1):
        nxt = logits.argmax(-1).tolist()
        ended = [r for r, t in enumerate(nxt) if step == cot_tokens or t in eos]
        for r, i in enumerate(active):
            if r not in ended:
                generated[i].append(nxt[r])
        if ended:  # read the answer after the cue, on a copy of those rows
            q = pos[ended, None] + torch.arange(len(cue))
            read = C.masked_forward(lm, cue.expand(len(ended), -1), C.take_rows(cache, ended), q, key_pos[ended],
                                    logits_to_keep=1)
            for j, r in enumerate(ended):
                out[active[r]] = (read.logits[j, -1], lm.tokenizer.decode(generated[active[r]]))
            keep = [r for r in range(len(active)) if r not in ended]
            if not keep:
                break
            cache, key_pos, pos = C.take_rows(cache, keep), key_pos[keep], pos[keep]
            active, nxt = [active[r] for r in keep], [nxt[r] for r in keep]
        logits = C.masked_forward(lm, torch.tensor(nxt)[:, None], cache, pos[:, None], key_pos).logits[:, -1]
        key_pos, pos = torch.cat([key_pos, pos[:, None]], 1), pos + 1
    return out


@torch.no_grad()
def decide(lm, edited: Edited, cot_tokens: int = 0) -> tuple[torch.Tensor, str]:
    """Feed the tail and read the decision logits (V,); with ``cot_tokens``, first generate up to
    that many greedy reasoning tokens, then append the answer cue and read there.

    Returns (logits, generated text). The cache is restored to its entries afterwards.
    """
    cache, n = edited.cache, C.seq_len(edited.cache)
    try:
        out = C.forward(lm.model, torch.tensor([edited.tail_ids]), cache, logits_to_keep=1)
        logits = out.logits[0, -1]
        if not cot_tokens:
            return logits, ""
        generated: list[int] = []
        eos = _eos_ids(lm)
        for _ in range(cot_tokens):
            nxt = int(logits.argmax())
            if nxt in eos:
                break
            generated.append(nxt)
            logits = C.forward(lm.model, torch.tensor([[nxt]]), cache).logits[0, -1]
        cue = lm.tokenizer.encode(COT_CUE, add_special_tokens=False)
        logits = C.forward(lm.model, torch.tensor([cue]), cache, logits_to_keep=1).logits[0, -1]
        return logits, lm.tokenizer.decode(generated)
    finally:
        C.truncate_(cache, n)
