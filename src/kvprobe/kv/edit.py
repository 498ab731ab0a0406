"""The KV editor: repair a prefilled cache of the old prompt after one field changed.

Every strategy starts from the same thing a serving engine holds: the cache of the old prompt
``ids_old[:D]`` (D = the decision position; the decision token itself is fed at read time). It
returns an :class:`Edited` state: a cache, the tokens still to feed, and what it cost. Reading
the decision (:func:`decide`) feeds those tokens, optionally generates chain-of-thought tokens,
and returns the decision logits; it never changes the strategy's cache entries.

Strategies (the paper's, plus controls)::

    stale            the old cache as it is
    field_only       recompute the field span only (downstream notes stay stale)
    selective        the field plus K downstream positions chosen by a ranking
    cacheblend       recompute the fraction r of positions with the largest KV deviation at a
                     check layer (the CacheBlend baseline; the check-layer pass is counted)
    erratum          keep the old cache, append a correction line and re-ask
    field_erratum    field_only, then the erratum
    hoist            the prompt rewritten with the field moved late: recompute from the field on
                     (needs a rewritten prompt: reported as such)
    oracle           full re-prefill of the new prompt

A strategy is named by a spec string: ``stale``, ``field_only``, ``selective:K:RANKING``,
``cacheblend:R``, ``erratum`` (or ``erratum:short``), ``field_erratum``, ``hoist``, ``oracle``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvprobe.datasets import ERRATUM_TEMPLATES, AlignedCase, Skip, align, erratum_text, render_prompt
from kvprobe.datasets.spans import prompt_ids
from kvprobe.errors import KvprobeError
from kvprobe.kv import cache as C

RANKINGS = ("causal", "random", "attention", "recency", "aggregators")
STRATEGY_NAMES = ("stale", "field_only", "selective", "cacheblend", "erratum", "field_erratum", "hoist", "oracle")
COT_CUE = "\nAnswer:"


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy spec."""

    name: str
    k: int | None = None  # selective: downstream positions recomputed
    ranking: str | None = None  # selective: how they are chosen
    ratio: float | None = None  # cacheblend: fraction of positions recomputed
    template: str = "paper"  # erratum templates: "paper", "short" or a literal template

    @property
    def label(self) -> str:
        if self.name == "selective":
            return f"selective:{self.k}:{self.ranking}"
        if self.name == "cacheblend":
            return f"cacheblend:{self.ratio:g}"
        if self.name in ("erratum", "field_erratum") and self.template != "paper":
            return f"{self.name}:{self.template}"
        return self.name


def parse_strategy(spec: str) -> Strategy:
    """``selective:8:causal`` -> Strategy(...); a bad spec raises a one-line KvprobeError."""
    name, *args = spec.strip().split(":")
    usage = ("stale, field_only, selective:K:RANKING (RANKING in " + "/".join(RANKINGS) +
             "), cacheblend:R (0<R<=1), erratum[:paper|short], field_erratum[:paper|short], hoist, oracle")
    try:
        if name == "selective" and len(args) == 2 and args[1] in RANKINGS and int(args[0]) >= 0:
            return Strategy(name, k=int(args[0]), ranking=args[1])
        if name == "cacheblend" and len(args) == 1 and 0 < float(args[0]) <= 1:
            return Strategy(name, ratio=float(args[0]))
        if name in ("erratum", "field_erratum") and len(args) <= 1:
            return Strategy(name, template=args[0] if args else "paper")
        if name in STRATEGY_NAMES and not args and name not in ("selective", "cacheblend"):
            return Strategy(name)
    except ValueError:
        pass
    raise KvprobeError(f"bad strategy {spec!r}; accepted: {usage}")


@dataclass
class Edited:
    """A repaired cache plus the tokens still to feed before the decision is read.

    ``cache`` holds ``n`` entries whose RoPE positions are 0..n-1; ``tail_ids`` are fed at
    positions n.. (the last one is the decision token). ``recomputed`` counts tokens whose K/V
    this strategy computed, the tail included, the decision token excluded.
    """

    cache: DynamicCache
    tail_ids: list[int]
    recomputed: float
    total: int
    wall_s: float = 0.0
    rewritten_prompt: bool = False
    note: str = ""
    setup_s: float = 0.0  # time spent building what a deployment would already hold (not a cost)


@dataclass
class EditContext:
    """Everything a strategy may use for one case: the model, the aligned case, the old cache."""

    lm: object
    a: AlignedCase
    old_cache: DynamicCache  # ids_old[:D], never modified
    ranking: Callable[["EditContext"], list[int]] | None = None  # the causal ranking, if supplied
    seed: int = 0
    _attention: torch.Tensor | None = field(default=None, repr=False)

    @property
    def D(self) -> int:
        return self.a.decision_pos


def check_length(lm, n_tokens: int) -> None:
    """Refuse a context longer than the model's position range."""
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    if limit and n_tokens > limit:
        raise KvprobeError(f"context of {n_tokens} tokens is longer than the model's window of {limit} positions")


def make_context(lm, a: AlignedCase, ranking=None, seed: int = 0) -> EditContext:
    """Prefill the old prompt (everything before the decision token) once for all strategies."""
    check_length(lm, len(a.ids_old))
    _, cache = C.prefill(lm.model, torch.tensor(a.ids_old[: a.decision_pos]), logits_to_keep=1)
    return EditContext(lm, a, cache, ranking, seed)


# -- the building block: recompute a set of positions against a partly stale cache -----------
def recompute_positions(lm, cache: DynamicCache, ids: list[int], positions: list[int]) -> DynamicCache:
    """A copy of ``cache`` whose entries at ``positions`` are recomputed from ``ids``.

    Each recomputed token attends to the *stale* entries of the other positions before it and to
    the other recomputed tokens before it (CacheBlend semantics). Recomputing every position from
    the first changed one on therefore equals a fresh prefill.
    """
    work = C.copy(cache)
    if not positions:
        return work
    n = C.seq_len(work)
    sel = torch.tensor(sorted(positions))
    assert int(sel.max()) < n, "positions must lie inside the cache"
    visible = torch.ones(1, len(sel), n, dtype=torch.bool)
    visible[:, :, sel] = False  # the recomputed tokens stand in for their stale entries
    C.masked_forward(lm, torch.tensor([ids[p] for p in sel.tolist()])[None], work, sel[None], visible=visible,
                     logits_to_keep=1)
    for layer in range(C.n_layers(work)):
        k, v = C.get_kv(work, layer)  # (1, H_kv, n + S, D)
        k[:, :, sel], v[:, :, sel] = k[:, :, n:], v[:, :, n:]
        C.set_kv(work, layer, k[:, :, :n], v[:, :, :n])
    return work


# -- rankings of downstream positions -------------------------------------------------------
def decision_attention(ctx: EditContext) -> torch.Tensor:
    """The decision token's attention to each cache entry of the old prompt, mean over layers and heads (D,)."""
    if ctx._attention is None:
        out = C.forward(ctx.lm.model, torch.tensor([[ctx.a.ids_old[ctx.D]]]), ctx.old_cache, output_attentions=True)
        C.truncate_(ctx.old_cache, ctx.D)
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
        att = decision_attention(ctx)[lo:hi]
        return [lo + int(i) for i in torch.argsort(att, descending=True, stable=True)]
    if ranking == "causal":
        if ctx.ranking is None:
            raise KvprobeError("the causal ranking comes from the probes: run `kvprobe run` (or pass a ranking)")
        return list(ctx.ranking(ctx))
    raise KvprobeError(f"unknown ranking {ranking!r}; accepted: {', '.join(RANKINGS)}")


# -- strategies -----------------------------------------------------------------------------
def _stale(ctx: EditContext, s: Strategy) -> Edited:
    return Edited(ctx.old_cache, [ctx.a.ids_old[ctx.D]], 0, ctx.D + 1)


def _oracle(ctx: EditContext, s: Strategy) -> Edited:
    _, cache = C.prefill(ctx.lm.model, torch.tensor(ctx.a.ids_new[: ctx.D]), logits_to_keep=1)
    return Edited(cache, [ctx.a.ids_new[ctx.D]], ctx.D, ctx.D + 1)


def _selected(ctx: EditContext, downstream: list[int]) -> Edited:
    f0, f1 = ctx.a.field
    positions = list(range(f0, f1)) + downstream
    cache = recompute_positions(ctx.lm, ctx.old_cache, ctx.a.ids_new, positions)
    return Edited(cache, [ctx.a.ids_new[ctx.D]], len(positions), ctx.D + 1)


def _field_only(ctx: EditContext, s: Strategy) -> Edited:
    return _selected(ctx, [])


def _selective(ctx: EditContext, s: Strategy) -> Edited:
    lo, hi = ctx.a.downstream
    if s.k > hi - lo:
        raise KvprobeError(f"K={s.k} is larger than the downstream span of case {ctx.a.case.case_id} "
                           f"({hi - lo} positions); use K <= {hi - lo}")
    return _selected(ctx, rank_downstream(ctx, s.ranking)[: s.k])


class _StopForward(Exception):
    pass


def _cacheblend(ctx: EditContext, s: Strategy, check_layer: int = 1) -> Edited:
    """CacheBlend: pick positions by KV deviation at ``check_layer``, then recompute them."""
    lm, D = ctx.lm, ctx.D
    layers = lm.adapter.layers(lm.model)
    check_layer = min(check_layer, len(layers) - 1)
    probe = C.new_cache()

    def stop(module, args):
        raise _StopForward

    handle = layers[check_layer + 1].register_forward_pre_hook(stop) if check_layer + 1 < len(layers) else None
    try:
        C.forward(lm.model, torch.tensor([ctx.a.ids_new[:D]]), probe)
    except _StopForward:
        pass
    finally:
        if handle is not None:
            handle.remove()
    k_new, v_new = C.get_kv(probe, check_layer)
    k_old, v_old = C.get_kv(ctx.old_cache, check_layer)
    deviation = ((k_new - k_old) ** 2).sum((0, 1, 3)) + ((v_new - v_old) ** 2).sum((0, 1, 3))  # (D,)
    n = max(1, round(s.ratio * D))
    chosen = torch.argsort(deviation, descending=True, stable=True)[:n].tolist()
    cache = recompute_positions(lm, ctx.old_cache, ctx.a.ids_new, chosen)
    check_cost = D * (check_layer + 1) / len(layers)
    return Edited(cache, [ctx.a.ids_new[D]], n + check_cost, D + 1,
                  note=f"field recomputed: {set(range(*ctx.a.field)) <= set(chosen)}")


def _template(s: Strategy) -> str:
    return ERRATUM_TEMPLATES.get(s.template, s.template)


def _with_erratum(ctx: EditContext, s: Strategy, base: DynamicCache, base_ids: list[int], value_in_prompt: str,
                  extra_recomputed: int) -> Edited:
    """Keep the longest prefix of ``base`` the erratum prompt shares, feed the rest."""
    a = ctx.a
    text = render_prompt(a.case, ctx.lm.tokenizer, value_in_prompt, a.form,
                         erratum=erratum_text(a.case.field, a.case.new_value, _template(s)))
    ids = prompt_ids(ctx.lm.tokenizer, text, a.form)
    check_length(ctx.lm, len(ids))
    # Tokenizers can merge across the insertion point: reuse only the identical prefix.
    shared = next((i for i, (x, y) in enumerate(zip(ids, base_ids[: ctx.D])) if x != y), min(len(ids), ctx.D))
    cache = C.crop(base, shared)
    tail = ids[shared:]
    return Edited(cache, tail, extra_recomputed + len(tail) - 1, len(ids))


def _erratum(ctx: EditContext, s: Strategy) -> Edited:
    return _with_erratum(ctx, s, ctx.old_cache, ctx.a.ids_old, ctx.a.case.old_value, 0)


def _field_erratum(ctx: EditContext, s: Strategy) -> Edited:
    fixed = _selected(ctx, [])
    return _with_erratum(ctx, s, fixed.cache, ctx.a.ids_new, ctx.a.case.new_value, ctx.a.field[1] - ctx.a.field[0])


def _hoist(ctx: EditContext, s: Strategy) -> Edited:
    """The deployment keeps the field late in its prompt; an edit recomputes from the field on."""
    hoisted = align(ctx.a.case.model_copy(update={"field_position": "late"}), ctx.lm.tokenizer, ctx.a.form)
    if isinstance(hoisted, Skip):
        raise KvprobeError(f"hoist: the rewritten prompt of {ctx.a.case.case_id} does not align: {hoisted.reason}")
    f0, D = hoisted.field[0], hoisted.decision_pos
    start = time.perf_counter()
    # the deployment's cached prefix
    _, cache = C.prefill(ctx.lm.model, torch.tensor(hoisted.ids_old[:f0]), logits_to_keep=1)
    return Edited(cache, hoisted.ids_new[f0 : D + 1], D - f0, D + 1, rewritten_prompt=True,
                  setup_s=time.perf_counter() - start)


STRATEGIES: dict[str, Callable[[EditContext, Strategy], Edited]] = {
    "stale": _stale, "field_only": _field_only, "selective": _selective, "cacheblend": _cacheblend,
    "erratum": _erratum, "field_erratum": _field_erratum, "hoist": _hoist, "oracle": _oracle,
}


def apply(ctx: EditContext, strategy: Strategy | str) -> Edited:
    """Run one strategy on a case, timed. Neither the shared old-cache prefill nor a strategy's
    setup (what a deployment would already hold, e.g. hoist's rewritten prefix) is counted; the
    tail fed at decision time is timed by :func:`decide`'s caller."""
    s = parse_strategy(strategy) if isinstance(strategy, str) else strategy
    start = time.perf_counter()
    edited = STRATEGIES[s.name](ctx, s)
    edited.wall_s = time.perf_counter() - start - edited.setup_s
    return edited


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
