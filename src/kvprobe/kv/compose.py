"""Composable caches: precompile a block's KV once, splice it into new contexts, repair the seams.

A **block** is a run of tokens (a skill: a policy, a tool specification, a retrieved passage)
whose K/V were computed once, in isolation, behind a shared preamble (BOS, system prompt) so
that the block has its own attention sink. **Composing** builds the cache of a new context
from text parts (prefilled as usual) and blocks (spliced), in order::

    part        what happens                                          cache after it
    text        forward the tokens against the cache                  + T_text fresh entries
    block       keys re-rotated by Δ = p - block.start, values as     + s fresh entries
                they are; the first s tokens (the seam) are fed        + (T - s) spliced entries
                fresh against everything before, the rest spliced

RoPE positions always equal cache indices (blocks sit back to back with the text between
them), so plain forwards and masks by index are exact. The decision logits come from the last
text part (the query). :class:`Composer` goes part by part (:func:`compose`);
:func:`compose_fused` gives the same cache and logits (to float rounding, tested) with one
forward pass over all fresh tokens, which is what the TTFT benchmark times.

**Seam repair** feeds the first ``s`` tokens of a block fresh, then splices the remaining
T - s stored entries. This is :func:`kvprobe.kv.edit.recompute_positions` of those ``s``
positions right after the splice, without copying the cache (a recomputed token attends to
everything before it and to nothing after it, and the stale entries it replaces lie after it);
``tests/kv/test_compose.py`` checks the two agree. ``s >= T`` recomputes the whole block, which
equals a full prefill (the oracle).

**Sliding-window layers (Gemma-2/3, Mistral).** A layer with window W lets the query at
position q attend to keys at positions in (q - W, q]. Our caches never evict: every composed
cache holds one entry per position on every layer, at index = position, and every forward
builds its mask from positions (transformers' masks from the cache positions for plain
forwards, :func:`kvprobe.kv.mask.additive_mask` for masked ones). The window is applied by
masking, not by deletion. A block longer than W is therefore still exact in the sense that
matters here, namely that composing its jointly computed KV reproduces a full prefill:

1. its stored entries come from a full-length prefill behind the preamble, in which each block
   token attended through the same window rule the model always applies, so each entry is what
   the model computes for that token in that context, early tokens included;
2. global layers (Gemma) attend to every block position, so they need every entry, which only
   a full-length cache keeps;
3. seam repair and the query address entries by position. A cache that evicted (the model's own
   cache keeps only the last W - 1 positions on sliding layers) would hold fewer entries than
   tokens, its indices would no longer be positions, and a spliced block would put keys at
   the wrong positions or drop keys a later global layer must see.

So nothing after a block misses an entry it should see, and nothing sees an entry it should
not: the mask decides, not the cache length. A block whose stored KV is shorter than its tokens
(taken from an evicting cache) is refused, never padded. ``tests/kv/test_compose.py`` checks
blocks longer than the window on tiny-gemma3 and tiny-mistral (window 16).

**Refusals** (``KvprobeError``, one line): a model whose RoPE cannot be re-rotated
(``lm.info.rope_unsupported``), a block from another model (config hash) or in another dtype,
a block whose KV is shorter or longer than its tokens or has the wrong number of layers, and a
composed context longer than the model's position range.

**Controls.** ``rerotate=False`` splices the keys at the positions they were computed at (the
paper's 0.18 agreement); the oracle prefills the whole context (:func:`oracle_logits`).

Tensor layout, as in :mod:`kvprobe.kv.cache`: keys, values (B=1, H_kv, T, D).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvprobe.errors import KvprobeError
from kvprobe.kv import cache as C
from kvprobe.models import rope

SEAMS = (0, 1, 2, 4, 8, 16, 32)  # seam-repair widths the validation reports


# -- blocks -----------------------------------------------------------------------------------
@dataclass(eq=False)
class Block:
    """A precompiled block: its tokens and per-layer (keys, values), each (1, H_kv, T, D).

    The K/V were computed at RoPE positions ``start .. start + T - 1`` (behind ``preamble``,
    whose own K/V are not kept). ``config_hash`` and ``dtype`` name the model they belong to.
    """

    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    start: int
    preamble: list[int]
    config_hash: str
    dtype: str
    name: str = ""
    _rotated: dict = field(default_factory=dict, repr=False)  # delta -> rotated keys, per layer

    def __post_init__(self):
        check_block_shape(self)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def positions(self) -> list[int]:
        return list(range(self.start, self.start + len(self.ids)))

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)

    def keys_at(self, lm, position: int) -> list[torch.Tensor]:
        """Per layer: the keys (1, H_kv, T, D) moved to start at ``position`` (memoised per shift)."""
        delta = position - self.start
        if delta == 0:
            return [k for k, _ in self.kv]
        if delta not in self._rotated:
            self._rotated.clear()  # keep one shift only: blocks can be large
            self._rotated[delta] = [rope.rerotate(k, delta, rope.inv_freq(lm.adapter, layer, k.device))
                                    for layer, (k, _) in enumerate(self.kv)]
        return self._rotated[delta]


def check_block_shape(block: Block) -> None:
    """Refuse K/V that do not hold exactly one (1, H_kv, T, D) entry per block token."""
    T = len(block.ids)
    if T == 0:
        raise KvprobeError(f"block {block.name or '(unnamed)'} has no tokens")
    for layer, (k, v) in enumerate(block.kv):
        if k.ndim != 4 or v.ndim != 4 or k.shape[0] != 1 or k.shape[:3] != v.shape[:3]:
            raise KvprobeError(f"block {block.name or '(unnamed)'} layer {layer}: K/V must be (1, H_kv, T, D), "
                               f"got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[2] != T:
            why = (" (taken from an evicting sliding-window cache? precompile into a full-length cache)"
                   if k.shape[2] < T else "")
            raise KvprobeError(f"block {block.name or '(unnamed)'} layer {layer} holds K/V for {k.shape[2]} "
                               f"positions but has {T} tokens{why}; refusing to splice it")


def _dtype_name(lm) -> str:
    return str(next(lm.model.parameters()).dtype).removeprefix("torch.")


def check_composable(lm) -> None:
    """Refuse a model whose keys cannot be re-rotated (its load-time self-check failed)."""
    if lm.info.rope_unsupported:
        raise KvprobeError(f"cannot compose caches for {lm.info.spec}: {lm.info.rope_unsupported}")


def check_block(lm, block: Block) -> None:
    """Refuse a block that belongs to another model or dtype, or has the wrong shape."""
    if block.config_hash != lm.config_hash():
        raise KvprobeError(f"block {block.name or '(unnamed)'} was precompiled for another model "
                           f"(config {block.config_hash}, this model {lm.config_hash()}); precompile it again")
    if block.dtype != _dtype_name(lm):
        raise KvprobeError(f"block {block.name or '(unnamed)'} is {block.dtype} but the model is {_dtype_name(lm)}; "
                           f"precompile it again in the model's dtype")
    if len(block.kv) != lm.adapter.n_layers:
        raise KvprobeError(f"block {block.name or '(unnamed)'} has {len(block.kv)} layers, the model "
                           f"{lm.adapter.n_layers}")
    want = (lm.adapter.n_kv_heads, lm.adapter.head_dim)
    if any((k.shape[1], k.shape[3]) != want for k, _ in block.kv):
        raise KvprobeError(f"block {block.name or '(unnamed)'} K/V do not have the model's {want[0]} kv heads "
                           f"of dim {want[1]}")
    check_block_shape(block)


def _max_positions(lm) -> int | None:
    return getattr(lm.model.config, "max_position_embeddings", None)


@torch.no_grad()
def precompile(lm, ids: Sequence[int], preamble: Sequence[int] = (), name: str = "") -> Block:
    """The K/V of ``ids`` computed in isolation behind ``preamble`` (positions len(preamble)..).

    Prefills ``preamble + ids`` into a fresh full-length cache (never the model's own, which
    evicts on sliding-window layers) and keeps the block's entries, copied and contiguous.
    """
    check_composable(lm)
    ids, preamble = [int(i) for i in ids], [int(i) for i in preamble]
    if not ids:
        raise KvprobeError(f"block {name or '(unnamed)'} has no tokens")
    total = len(preamble) + len(ids)
    limit = _max_positions(lm)
    if limit and total > limit:
        raise KvprobeError(f"block {name or '(unnamed)'} needs {total} positions; the model has {limit}")
    cache = C.new_cache()
    C.forward(lm.model, torch.tensor([preamble + ids], device=lm.device), cache, logits_to_keep=1)
    P = len(preamble)
    kv = [(k[:, :, P:].contiguous(), v[:, :, P:].contiguous()) for k, v in C.to_tensors(cache)]
    return Block(ids, kv, P, preamble, lm.config_hash(), _dtype_name(lm), name)


def block_from_cache(lm, cache: DynamicCache, ids: Sequence[int], start: int, name: str = "") -> Block:
    """A block of the entries [start, start + len(ids)) of an existing cache (e.g. the jointly
    computed KV of a full prefill). Refuses a cache that holds fewer entries than that on any
    layer (the model's own sliding-window cache does)."""
    ids = [int(i) for i in ids]
    kv = []
    for layer, (k, v) in enumerate(C.to_tensors(cache)):
        if k.shape[2] < start + len(ids):
            raise KvprobeError(f"cache layer {layer} holds {k.shape[2]} positions, fewer than the "
                               f"{start + len(ids)} the block needs (an evicting sliding-window cache?); "
                               f"prefill into a full-length cache (kvprobe.kv.cache.new_cache)")
        kv.append((k[:, :, start : start + len(ids)].clone(), v[:, :, start : start + len(ids)].clone()))
    return Block(ids, kv, start, [], lm.config_hash(), _dtype_name(lm), name)


# -- composing ---------------------------------------------------------------------------------
@dataclass
class Timings:
    """Wall seconds spent in each step of composing (accumulated)."""

    rerotate: float = 0.0
    splice: float = 0.0
    seam: float = 0.0
    prefill: float = 0.0

    @property
    def total(self) -> float:
        return self.rerotate + self.splice + self.seam + self.prefill


class Composer:
    """Builds a composed cache part by part (see the module docstring).

    ``ids`` holds every token of the context so far; entry i of the cache is token i at RoPE
    position i. ``spans`` lists each block's [start, end) and name. ``logits`` (V,) are the
    next-token logits after the last text part (None until one is fed).
    """

    def __init__(self, lm):
        check_composable(lm)
        self.lm = lm
        self.cache = C.new_cache()
        self.ids: list[int] = []
        self.spans: list[tuple[int, int, str]] = []
        self.logits: torch.Tensor | None = None
        self.timings = Timings()
        self._limit = _max_positions(lm)

    def __len__(self) -> int:
        return len(self.ids)

    def copy(self) -> "Composer":
        """An independent copy (the cache is cloned)."""
        new = Composer.__new__(Composer)
        new.lm, new._limit = self.lm, self._limit
        new.cache = C.copy(self.cache) if C.n_layers(self.cache) else C.new_cache()
        new.ids, new.spans = list(self.ids), list(self.spans)
        new.logits = self.logits
        new.timings = Timings()
        return new

    def _room(self, n: int, what: str) -> None:
        if self._limit and len(self.ids) + n > self._limit:
            raise KvprobeError(f"composed context of {len(self.ids) + n} tokens (after {what}) is longer than "
                               f"the model's {self._limit} positions")

    @torch.no_grad()
    def text(self, ids: Sequence[int]) -> torch.Tensor | None:
        """Prefill ``ids`` at the next positions; returns the logits (V,) after the last one."""
        ids = [int(i) for i in ids]
        if not ids:
            return self.logits
        self._room(len(ids), "a text part")
        t0 = time.perf_counter()
        out = C.forward(self.lm.model, torch.tensor([ids], device=self.lm.device), self.cache, logits_to_keep=1)
        self.ids += ids
        self.logits = out.logits[0, -1]
        self.timings.prefill += time.perf_counter() - t0
        assert C.seq_len(self.cache) == len(self.ids)
        return self.logits

    @torch.no_grad()
    def block(self, block: Block, seam: int = 0, rerotate: bool = True) -> None:
        """Splice ``block`` at the next positions, re-rotated (or not: the control), with the
        first ``seam`` tokens fed fresh against everything before them."""
        check_block(self.lm, block)
        if seam < 0:
            raise KvprobeError(f"seam must be >= 0, got {seam}")
        T, p = len(block), len(self.ids)
        self._room(T, f"block {block.name or '(unnamed)'}")
        s = min(seam, T)
        if s:
            self.text(block.ids[:s])  # the seam: fresh, against the full preceding context
        self.logits = None
        if s < T:
            t0 = time.perf_counter()
            keys = block.keys_at(self.lm, p) if rerotate else [k for k, _ in block.kv]  # (1, H_kv, T, D)
            t1 = time.perf_counter()
            if C.n_layers(self.cache) == 0:
                self.cache = C.from_tensors([(k[:, :, s:], v[:, :, s:]) for k, (_, v) in zip(keys, block.kv)])
            else:
                for layer, (k, (_, v)) in enumerate(zip(keys, block.kv)):
                    k0, v0 = C.get_kv(self.cache, layer)  # (1, H_kv, p + s, D)
                    C.set_kv(self.cache, layer, torch.cat([k0, k[:, :, s:]], 2), torch.cat([v0, v[:, :, s:]], 2))
            self.ids += block.ids[s:]
            self.timings.rerotate += t1 - t0
            self.timings.splice += time.perf_counter() - t1
        self.spans.append((p, p + T, block.name))
        assert C.seq_len(self.cache) == len(self.ids)


Part = Sequence[int] | Block


def compose(lm, parts: Sequence[Part], seam: int = 0, rerotate: bool = True) -> Composer:
    """Compose a context from text parts (token id lists) and blocks, in order.

    Returns the :class:`Composer`; ``.logits`` are the next-token logits after the last text part.
    """
    c = Composer(lm)
    for part in parts:
        if isinstance(part, Block):
            c.block(part, seam, rerotate)
        else:
            c.text(part)
    return c


@torch.no_grad()
def compose_fused(lm, parts: Sequence[Part], seam: int = 0, rerotate: bool = True) -> Composer:
    """:func:`compose` in one forward pass (the serving path; same result to float rounding).

    Every block's stored entries past its seam are placed (re-rotated) at their positions in a
    full-length cache; the fresh tokens (all text parts and every block's first ``seam``
    tokens) then run in one :func:`~kvprobe.kv.cache.masked_forward` with their own positions,
    each attending by position to the spliced entries and to the fresh tokens before it, which
    is exactly what the part-by-part order gives. Their K/V are then moved into their slots.
    The last part must be text (its last token gives the logits).
    """
    check_composable(lm)
    if seam < 0:
        raise KvprobeError(f"seam must be >= 0, got {seam}")
    if not parts or isinstance(parts[-1], Block) or not len(parts[-1]):
        raise KvprobeError("the last part of a fused composition must be (non-empty) text: the query")
    c = Composer(lm)
    fresh_ids: list[int] = []
    fresh_pos: list[int] = []
    spliced: list[tuple[Block, int, int]] = []  # (block, position, seam)
    for part in parts:
        p = len(c.ids)
        if isinstance(part, Block):
            check_block(lm, part)
            s = min(seam, len(part))
            fresh_ids += part.ids[:s]
            fresh_pos += range(p, p + s)
            if s < len(part):
                spliced.append((part, p, s))
            c.ids += part.ids
            c.spans.append((p, p + len(part), part.name))
        else:
            part = [int(i) for i in part]
            fresh_ids += part
            fresh_pos += range(p, p + len(part))
            c.ids += part
    N = len(c.ids)
    c._room(0, "all parts")
    t0 = time.perf_counter()
    rotated = [(b, p, s, b.keys_at(lm, p) if rerotate else [k for k, _ in b.kv]) for b, p, s in spliced]
    t1 = time.perf_counter()
    dtype, shape = next(lm.model.parameters()).dtype, (1, lm.adapter.n_kv_heads, N, lm.adapter.head_dim)
    kv = []
    for layer in range(lm.adapter.n_layers):
        k = torch.zeros(shape, dtype=dtype, device=lm.device)  # (1, H_kv, N, D); fresh slots filled below
        v = torch.zeros(shape, dtype=dtype, device=lm.device)
        for b, p, s, keys in rotated:
            k[:, :, p + s : p + len(b)] = keys[layer][:, :, s:]
            v[:, :, p + s : p + len(b)] = b.kv[layer][1][:, :, s:]
        kv.append((k, v))
    c.cache = C.from_tensors(kv)
    t2 = time.perf_counter()
    fresh = torch.tensor(fresh_pos, device=lm.device)
    visible = torch.zeros(1, len(fresh_pos), N, dtype=torch.bool, device=lm.device)
    for b, p, s in spliced:
        visible[:, :, p + s : p + len(b)] = True  # the fresh slots are empty until filled below
    out = C.masked_forward(lm, torch.tensor([fresh_ids], device=lm.device), c.cache, fresh[None],
                           key_positions=torch.arange(N, device=lm.device), visible=visible, logits_to_keep=1)
    for layer in range(C.n_layers(c.cache)):
        k, v = C.get_kv(c.cache, layer)  # (1, H_kv, N + S, D)
        k[:, :, fresh], v[:, :, fresh] = k[:, :, N:], v[:, :, N:]
        C.set_kv(c.cache, layer, k[:, :, :N], v[:, :, :N])
    c.logits = out.logits[0, -1]
    c.timings.rerotate, c.timings.splice, c.timings.prefill = t1 - t0, t2 - t1, time.perf_counter() - t2
    return c


def context_ids(parts: Sequence[Part]) -> list[int]:
    """Every token of the composed context, in order."""
    out: list[int] = []
    for part in parts:
        out += part.ids if isinstance(part, Block) else [int(i) for i in part]
    return out


@torch.no_grad()
def oracle_logits(lm, ids: Sequence[int]) -> torch.Tensor:
    """The control: next-token logits (V,) after a full prefill of the whole context."""
    limit = _max_positions(lm)
    if limit and len(ids) > limit:
        raise KvprobeError(f"context of {len(ids)} tokens is longer than the model's {limit} positions")
    out = C.forward(lm.model, torch.tensor([list(ids)], device=lm.device), C.new_cache(), logits_to_keep=1)
    return out.logits[0, -1]


# -- the validation engine -----------------------------------------------------------------------
def option_token_ids(tokenizer, option: str) -> list[int]:
    """First-token ids of an option, bare and space-prefixed, lower and capitalised."""
    from kvprobe.datasets.spans import option_ids

    out: list[int] = []
    for text in dict.fromkeys((option, option.capitalize())):
        out += [i for i in option_ids(tokenizer, text) if i not in out]
    return out


def _decide(logits: torch.Tensor, options: dict[str, list[int]]) -> tuple[str, float]:
    """(arg-max option, margin first - second option) from the best first-token logit of each."""
    scores = {opt: float(logits[ids].max()) for opt, ids in options.items()}
    names = list(scores)
    return max(names, key=scores.__getitem__), scores[names[0]] - scores[names[1]]


COLUMNS = ("model", "query_id", "domain", "kind", "n_blocks", "block_tokens", "context_tokens", "seam",
           "rerotate", "agree", "top1_agree", "cosine", "kl", "answer", "oracle_answer", "expected", "margin",
           "oracle_margin", "wall_s", "oracle_wall_s")


def run_compose(lm, n: int = 50, seed: int = 0, seams: Sequence[int] = SEAMS,
                block_tokens: tuple[int, int] = (200, 400), n_blocks: tuple[int, int] = (1, 4),
                rerotate: Sequence[bool] = (True, False), form: str = "auto", store_dir=None,
                model_name: str | None = None, on_query: Callable[[], None] | None = None,
                on_precompile: Callable[[int, int], None] | None = None, parts=None):
    """Compose the composition dataset's skills and compare with full recompute.

    One row per (query, seam, rerotate): decision agreement with the oracle (over the options),
    top-1 agreement (full vocabulary), logit cosine and KL(oracle || composed). Skills are
    precompiled once each behind the shared preamble; with ``store_dir`` they go through the
    store (saved, then loaded back and verified), as a deployment would use them.
    With ``parts`` (a :class:`kvprobe.results.CaseStore`) each finished query is saved as it ends
    and skipped on a rerun, and a skill already in ``store_dir`` is loaded, not recomputed, so an
    interrupted run resumes where it stopped.
    Returns a pandas DataFrame with :data:`COLUMNS`.
    """
    import pandas as pd

    from kvprobe.datasets.compose import generate_compose, segments
    from kvprobe.metrics import compare

    check_composable(lm)
    seams = sorted({int(s) for s in seams})
    if not seams or seams[0] < 0:
        raise KvprobeError(f"seams must be integers >= 0, got {list(seams)}")
    data = generate_compose(n, seed=seed, tokenizer=lm.tokenizer, block_tokens=block_tokens, n_blocks=n_blocks)
    segs = segments(data, lm.tokenizer, form)
    options = {opt: option_token_ids(lm.tokenizer, opt) for opt in data.options}
    finished = {q.query_id for q in data.queries if parts is not None and parts.done(q.query_id)}
    todo = [q for q in data.queries if q.query_id not in finished]
    used = list(dict.fromkeys(sid for q in todo for sid in q.skills))
    blocks: dict[str, Block] = {}
    for i, sid in enumerate(used):
        blocks[sid] = _skill_block(lm, segs, sid, store_dir)
        if on_precompile:
            on_precompile(i + 1, len(used))
    frames = [parts.load(q.query_id) for q in data.queries if q.query_id in finished]
    for _ in frames:
        if on_query:
            on_query()
    for q in todo:
        rows = []
        qs = segs.queries[q.query_id]
        pieces = [qs.lead, *(blocks[s] for s in q.skills), qs.query]
        ids = segs.preamble + context_ids(pieces)
        t0 = time.perf_counter()
        oracle = oracle_logits(lm, ids)
        oracle_wall = time.perf_counter() - t0
        oracle_answer, oracle_margin = _decide(oracle, options)
        base = Composer(lm)
        base.text(segs.preamble + qs.lead)
        for rot in rerotate:
            for s in seams:
                t0 = time.perf_counter()
                c = base.copy()
                for sid in q.skills:
                    c.block(blocks[sid], s, rot)
                logits = c.text(qs.query)
                wall = time.perf_counter() - t0
                assert c.ids == ids
                answer, margin = _decide(logits, options)
                rows.append({
                    "model": model_name or lm.info.spec, "query_id": q.query_id, "domain": q.domain, "kind": q.kind,
                    "n_blocks": len(q.skills), "block_tokens": sum(len(blocks[s]) for s in q.skills),
                    "context_tokens": len(ids), "seam": s, "rerotate": bool(rot), "agree": answer == oracle_answer,
                    "top1_agree": int(logits.argmax()) == int(oracle.argmax()), **compare(logits, oracle),
                    "answer": answer, "oracle_answer": oracle_answer, "expected": q.expected, "margin": margin,
                    "oracle_margin": oracle_margin, "wall_s": wall, "oracle_wall_s": oracle_wall,
                })
        frame = pd.DataFrame(rows, columns=list(COLUMNS))
        if parts is not None:
            parts.save(q.query_id, frame)
        frames.append(frame)
        if on_query:
            on_query()
    order = {q.query_id: i for i, q in enumerate(data.queries)}
    frames = sorted(frames, key=lambda f: order[f.query_id.iloc[0]] if len(f) else -1)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(COLUMNS))


def _skill_block(lm, segs, sid: str, store_dir) -> Block:
    """The skill's block: loaded from ``store_dir`` when a file is already there (verified against
    this model and tokenizer), else precompiled, and with ``store_dir`` saved and loaded back."""
    if store_dir is None:
        return precompile(lm, segs.skills[sid], segs.preamble, name=sid)
    from kvprobe.kv.store import load_block, save_block

    path = store_path(store_dir, sid)
    if path.exists():
        block = load_block(path, lm)
        if block.ids == [int(i) for i in segs.skills[sid]] and block.preamble == [int(i) for i in segs.preamble]:
            return block
        raise KvprobeError(f"{path} holds another block than skill {sid} of this dataset; "
                           f"use another --out or remove {path.parent}")
    save_block(precompile(lm, segs.skills[sid], segs.preamble, name=sid), lm, path)
    return load_block(path, lm)


def store_path(folder, name: str):
    """Where the store keeps the block ``name`` inside ``folder``."""
    from pathlib import Path

    from kvprobe.kv.store import SUFFIX

    return Path(folder) / f"{name}{SUFFIX}"


def summarize_compose(df) -> "pd.DataFrame":  # noqa: F821
    """One row per (rerotate, seam): agreement, top-1 agreement, cosine and KL with bootstrap CIs."""
    import pandas as pd

    from kvprobe.metrics import mean_ci

    rows = []
    for (rot, s), g in df.groupby(["rerotate", "seam"], sort=True):
        agree, cos, kl = mean_ci(g.agree.astype(float)), mean_ci(g.cosine), mean_ci(g.kl)
        rows.append({"rerotate": bool(rot), "seam": int(s), "n": len(g),
                     "agreement": agree[0], "agreement_lo": agree[1], "agreement_hi": agree[2],
                     "top1_agreement": float(g.top1_agree.mean()),
                     "cosine": cos[0], "cosine_lo": cos[1], "cosine_hi": cos[2],
                     "kl": kl[0], "kl_lo": kl[1], "kl_hi": kl[2], "ms": 1000 * float(g.wall_s.mean())})
    out = pd.DataFrame(rows)
    return out.sort_values(["rerotate", "seam"], ascending=[False, True]).reset_index(drop=True) if len(out) else out
