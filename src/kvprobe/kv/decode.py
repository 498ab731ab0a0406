"""Reading a decision from a repaired cache: feed the tail, optionally reason, read the logits.

An :class:`Edited` state is what every repair returns (:mod:`kvprobe.editor.strategies`): a cache,
the tokens still to feed, and what the repair cost. :func:`decide` feeds those tokens, optionally
generates chain-of-thought tokens, and returns the decision logits; it never changes the cache's
entries. :func:`decide_many` does the same for several caches, batched; :func:`decide_ragged` reads
several :class:`Read` objects of any lengths (a repair in place fused with its read among them) as one forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvprobe.kv import cache as kvcache


@dataclass
class Edited:
    """A repaired cache plus the tokens still to feed before the decision is read.

    ``cache`` holds ``n`` entries whose RoPE positions are 0..n-1; ``tail_ids`` are fed at
    positions n.. (the last one is the decision token). ``recomputed`` counts tokens whose K/V
    the repair computed, the tail included, the decision token excluded. ``ids`` are the token ids
    the whole sequence stands for (the cache's ``n`` positions, then ``tail_ids``): the new prompt
    for a repair in place, the prompt with its erratum for an erratum; empty where a strategy
    registered outside kvprobe does not say.
    """

    cache: DynamicCache
    tail_ids: list[int]
    recomputed: float
    total: int
    wall_s: float = 0.0
    rewritten_prompt: bool = False
    note: str = ""
    setup_s: float = 0.0  # time spent building what a deployment would already hold (not a cost)
    chose: str = ""  # the repair a choosing strategy (auto) settled on, with ``note`` saying why
    ids: list[int] = field(default_factory=list)  # the tokens the cache's positions and the tail stand for


COT_CUE = "\nAnswer:"


@dataclass
class Read:
    """A decision read: ``ids`` fed at the RoPE ``positions`` after ``cache``, seeing every entry of it but
    those at ``hidden`` (the positions the fed tokens stand in for), each other by position; the decision
    is read at the last. An :class:`Edited` state's read is its tail after its cache (:meth:`of`); a repair
    in place whose positions are known up front is its recompute and its read as one read (the recomputed
    tokens at their positions, the stale entries there hidden: :func:`~kvprobe.kv.recompute.recompute_positions`'
    visibility)."""

    cache: DynamicCache
    ids: list[int]
    positions: list[int]
    hidden: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, e: Edited) -> "Read":
        n = kvcache.seq_len(e.cache)
        return cls(e.cache, list(e.tail_ids), list(range(n, n + len(e.tail_ids))))


def shape_of(e: Edited) -> tuple[int, tuple[int, ...]]:
    """What decides whether repaired states can be read as one batch: the cache's length and the tail."""
    return kvcache.seq_len(e.cache), tuple(e.tail_ids)


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
        groups.setdefault(shape_of(e), []).append(i)
    rows: list[DynamicCache | None] = [None] * len(edited)
    first: list[torch.Tensor | None] = [None] * len(edited)
    for (_, tail), idx in groups.items():
        cache = kvcache.concat([edited[i].cache for i in idx], dim="batch")  # a copy
        logits = kvcache.forward(lm.model, torch.tensor([list(tail)] * len(idx)), cache, logits_to_keep=1).logits[:, -1]
        for r, i in enumerate(idx):
            rows[i], first[i] = kvcache.take_rows(cache, [r]), logits[r]

    eos, cue = _eos_ids(lm), torch.tensor(lm.tokenizer.encode(COT_CUE, add_special_tokens=False))
    cache, key_pos = kvcache.left_pad(rows)
    pos = torch.tensor([kvcache.seq_len(c) for c in rows])  # the next token's position, per row
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
            read = kvcache.masked_forward(lm, cue.expand(len(ended), -1), kvcache.take_rows(cache, ended), q, key_pos[ended],
                                    logits_to_keep=1)
            for j, r in enumerate(ended):
                out[active[r]] = (read.logits[j, -1], lm.tokenizer.decode(generated[active[r]]))
            keep = [r for r in range(len(active)) if r not in ended]
            if not keep:
                break
            cache, key_pos, pos = kvcache.take_rows(cache, keep), key_pos[keep], pos[keep]
            active, nxt = [active[r] for r in keep], [nxt[r] for r in keep]
        logits = kvcache.masked_forward(lm, torch.tensor(nxt)[:, None], cache, pos[:, None], key_pos).logits[:, -1]
        key_pos, pos = torch.cat([key_pos, pos[:, None]], 1), pos + 1
    return out


@torch.no_grad()
def decide_batch(lm, edited: Sequence[Edited], batch_bytes: int = 768 * 2**20) -> list[torch.Tensor]:
    """The decision logits (V,) of several repaired states of one shape (cache length and tail), read
    together: the tails run as one batch per ``batch_bytes`` of caches (no CoT). The same logits as
    :func:`decide` for each, one weight read; every input cache is left as it was."""
    if not edited:
        return []
    shapes = {shape_of(e) for e in edited}
    assert len(shapes) == 1, "decide_batch reads states of one cache length and tail"
    (_, tail), = shapes
    per = max(1, batch_bytes // max(1, kvcache.nbytes(edited[0].cache)))
    out = []
    for lo in range(0, len(edited), per):
        chunk = edited[lo : lo + per]
        cache = kvcache.concat([e.cache for e in chunk], dim="batch")  # a copy
        ids = torch.tensor([list(tail)] * len(chunk))
        out += list(kvcache.forward(lm.model, ids, cache, logits_to_keep=1).logits[:, -1])
    return out


@torch.no_grad()
def decide(lm, edited: Edited, cot_tokens: int = 0) -> tuple[torch.Tensor, str]:
    """Feed the tail and read the decision logits (V,); with ``cot_tokens``, first generate up to
    that many greedy reasoning tokens, then append the answer cue and read there.

    Returns (logits, generated text). The cache is restored to its entries afterwards.
    """
    cache, n = edited.cache, kvcache.seq_len(edited.cache)
    try:
        out = kvcache.forward(lm.model, torch.tensor([edited.tail_ids]), cache, logits_to_keep=1)
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
            logits = kvcache.forward(lm.model, torch.tensor([[nxt]]), cache).logits[0, -1]
        cue = lm.tokenizer.encode(COT_CUE, add_special_tokens=False)
        logits = kvcache.forward(lm.model, torch.tensor([cue]), cache, logits_to_keep=1).logits[0, -1]
        return logits, lm.tokenizer.decode(generated)
    finally:
        kvcache.truncate_(cache, n)


@torch.no_grad()
def decide_ragged(lm, reads: Sequence[Read]) -> list[torch.Tensor]:
    """The decision logits (V,) of each of ``reads`` (caches and tails of any lengths), as one forward: the
    caches padded on the left (:func:`kvprobe.kv.cache.left_pad`, a copy: every input cache is left as it
    was), the tails too, each padding token at a position no real token reaches, each row's hidden entries
    masked. Reads of one cache object share its row: their tokens one after another, none seeing another's, so
    they cost their own tokens, not a padded row each. The same logits as reading each alone, up to float
    rounding; one pass over the weights."""
    if not reads:
        return []
    rows: dict[int, list[int]] = {}
    for j, r in enumerate(reads):
        rows.setdefault(id(r.cache), []).append(j)
    groups = list(rows.values())
    cache, key_pos = kvcache.left_pad([reads[g[0]].cache for g in groups])
    width = [sum(len(reads[j].ids) for j in g) for g in groups]
    B, S, N, K = len(groups), max(width), key_pos.shape[1], max(map(len, groups))
    ids = torch.zeros(B, S, dtype=torch.long)
    pos = torch.full((B, S), kvcache.HIDDEN_POSITION, dtype=torch.long)
    segment = torch.full((B, S), -1)  # which read of its row a token is (-1: padding)
    visible = torch.ones(B, S, N, dtype=torch.bool)
    ends = torch.zeros(B, K, dtype=torch.long)  # each read's last token (a row's last repeated to K)
    for b, g in enumerate(groups):
        start, n = S - width[b], kvcache.seq_len(reads[g[0]].cache)
        ids[b, :start] = reads[g[0]].ids[0]  # padding: a real id, at a position no real token sees
        for s, j in enumerate(g):
            r, end = reads[j], start + len(reads[j].ids)
            ids[b, start:end], pos[b, start:end] = torch.tensor(r.ids), torch.tensor(r.positions)
            segment[b, start:end] = s
            if r.hidden:
                visible[b, start:end, N - n + torch.tensor(r.hidden)] = False
            ends[b, s:] = end - 1
            start = end
    visible = torch.cat([visible, segment[:, :, None] == segment[:, None, :]], dim=2)
    logits = kvcache.masked_forward(lm, ids, cache, pos, key_pos, visible=visible, logits_to_keep=ends).logits
    out: list[torch.Tensor] = [None] * len(reads)  # type: ignore[list-item]
    for b, g in enumerate(groups):
        for s, j in enumerate(g):
            out[j] = logits[b, s]
    return out
