"""Several calibration pairs' prefills as one batch (issue 54, item 2).

A pair computes two prefills before any repair: its old prompt's cache from the shared prefix on (the stale
state, which every candidate repairs) and its new prompt from the field on (the prefix oracle). Pairs drawn for
one field are independent, so :class:`PairStates` computes both for the next ``size`` drawn pairs at once: the
old prompts' suffixes right-padded to the longest and prefilled as one batch on copies of the shared prefix's
cache. A right pad changes no real token's keys or values (attention is causal), and each row's cache is cut to
its own length, so a pair's states are those of a prefill one by one up to float rounding (tests/calibrate
compares the decisions of the two paths). On the Zen 4 of docs/calibrate.md a batch of 4 costs 0.65-0.85 of the
pairs one by one (``benchmarks/suffix_batch.py``).

The reads then take one more forward for the whole batch (:func:`kvprobe.kv.decode.decide_ragged`, each pair's
reads in one row over its old cache): stale's decision token; the prefix oracle, the new prompt from the field on
over the old entries it replaces (hidden), so the oracle's prefill and its read are one read; and the candidate's
(field_only's recompute fused with its read, an erratum's turn). Without reads (``reads=False``) the oracles'
suffixes are prefilled as caches of their own, batched among the pairs whose field starts at the same token.

The stopping rule still reads the pairs one by one in draw order: the states are computed ahead, and those of
pairs past the field's verdict are never measured nor counted (:attr:`PairStates.unused` counts them). A batch
ends at the earliest pair at which the field could stop (``get``'s ``limit``: its candidate established by an
unbroken run, or its budget), so states go unused only where a stop came that no count foresaw.

A measured pair's states are also kept (:meth:`PairStates.keep`, up to :data:`KEEP_BYTES` of caches a field) while
the chain may still bring a candidate in: the candidate joining is then measured back over those pairs on their
kept states (the repair and its read only), where it used to prefill each pair's old cache and oracle again.
"""

from __future__ import annotations

import time
from itertools import islice

import torch

from kvprobe.editor.context import EditContext
from kvprobe.editor.score import timed_read
from kvprobe.editor.strategies import PrefixOracle, Stale, apply
from kvprobe.errors import KvprobeError
from kvprobe.kv import cache as kvcache
from kvprobe.kv.decode import Edited, Read, decide_ragged

DEFAULT_PAIR_BATCH = 4  # the batch of benchmarks/suffix_batch.py's largest saving per pair with few states ahead
# The caches kept a field for measuring a joining candidate back (old cache per pair, and the oracle's where it is
# a cache: batch_reads=False): 62 pairs of qwen2.5-1.5b on examples/calibrate-refund-clear.yaml hold about 430 MB
# with both in bfloat16, 860 MB in float32.
KEEP_BYTES = 1 << 30


class GivenOracle(PrefixOracle):
    """The prefix oracle's state, computed beforehand with other pairs' (its rows are the oracle's)."""

    def apply(self, ctx) -> Edited:
        return self.__dict__["edited"]


def given(edited: Edited) -> GivenOracle:
    oracle = GivenOracle()
    object.__setattr__(oracle, "edited", edited)  # not a dataclass field: the strategy's spec stays "oracle"
    return oracle


def _suffix_batch(lm, bases: list, suffixes: list[list[int]]) -> list:
    """Each base cache (one length) continued by its suffix, as one forward of the right-padded rows; each row's
    cache cut to its own length."""
    width = max(map(len, suffixes))
    ids = torch.tensor([s + [s[-1]] * (width - len(s)) for s in suffixes])
    cache = kvcache.concat(bases, dim="batch")
    kvcache.forward(lm.model, ids, cache, columns=())  # the caches only: no logits (no pass over the LM head)
    n = kvcache.seq_len(bases[0])
    return [kvcache.crop(kvcache.take_rows(cache, [r]), n + len(s)) for r, s in enumerate(suffixes)]


class PairStates:
    """The old caches and prefix oracles of a field's pairs, ``size`` drawn pairs at a time (see the module).

    ``get(key, ahead, strategies)`` gives the pair ``key``'s (aligned case, old cache, oracle, reads) or None where
    it was not batched (not editable in place, or prompts that share no beginning; the calibration's first batch
    sets the shared prefix); ``ahead`` iterates the drawn pairs from ``key`` on as (key, aligned case or None), in
    draw order; ``reads`` are the stale, oracle and ``strategies`` reads (:meth:`_read`; empty with ``reads=False``)."""

    def __init__(self, lm, prefix, size: int = DEFAULT_PAIR_BATCH, reads: bool = True):
        self.lm, self.prefix, self.size, self.reads = lm, prefix, size, reads
        self.ready: dict[str, tuple] = {}
        self.computed = 0  # pairs whose states were computed in a batch
        self.used = 0  # of them, pairs measured
        self.single_s: float | None = None  # a one-token decision read alone, timed once (_read)
        self.kept: dict[str, tuple] = {}  # measured pairs' states, for a candidate measured back (keep)
        self.kept_bytes = 0
        self.reused = 0  # pairs a joining candidate was measured back on from their kept states

    @property
    def unused(self) -> int:
        """Pairs whose states were computed ahead and never measured (past a field's verdict)."""
        return self.computed - self.used

    def forget(self) -> None:
        """A field is done: the states computed ahead of its verdict are dropped (they stay counted as unused),
        and so are the kept ones."""
        self.ready.clear()
        self.release()

    def keep(self, key: str, states) -> None:
        """Keep a measured pair's states for a candidate measured back later, while :data:`KEEP_BYTES` allows
        (a pair past it is prefilled again if a candidate is measured back on it)."""
        if states is None:
            return
        size = kvcache.nbytes(states[1]) + (kvcache.nbytes(states[2].cache) if states[2].cache is not None else 0)
        if self.kept_bytes + size <= KEEP_BYTES:
            self.kept[key], self.kept_bytes = states, self.kept_bytes + size

    def reuse(self, key: str):
        """The kept states of the pair ``key`` (None where they were not kept)."""
        got = self.kept.get(key)
        self.reused += got is not None
        return got

    def release(self) -> None:
        """No candidate can be measured back any more (the last is in play, or the field is done)."""
        self.kept.clear()
        self.kept_bytes = 0

    def get(self, key: str, ahead, strategies=(), limit: int | None = None):
        """``limit``: at most this many pairs from ``key`` on (the pairs up to the earliest the field could stop at:
        none is computed past it only to go unused)."""
        if key not in self.ready:
            size = self.size if limit is None else max(1, min(self.size, limit))
            self._compute(list(islice(((k, a) for k, a in ahead if a is not None and k not in self.ready), size)),
                          strategies)
        got = self.ready.pop(key, None)
        self.used += got is not None
        return got

    def _compute(self, pairs: list, strategies=()) -> None:
        olds = [a.ids_old[: a.decision_pos] for _, a in pairs]
        seeded = bool(olds) and self.prefix.ids is None  # the calibration's first batch: it sets the shared prefix
        if seeded:
            self.prefix.seed(olds)
        n = min((self.prefix.shared(ids) for ids in olds), default=0)
        if n == 0:  # nothing to batch, or prompts that share nothing: measured one by one
            return
        lm = self.lm
        with lm.lock:
            base = self.prefix.crop_to(n)
            caches = _suffix_batch(lm, [base] * len(pairs), [ids[n:] for ids in olds])
            self.prefix.tokens_saved += n * (len(pairs) - seeded)  # a seeded prefix was prefilled for the batch
            if self.reads:  # each oracle is one of the batch's reads
                given = self._read(pairs, caches, strategies)
                oracles = [g["oracle"][0] for g in given]
            else:
                given, oracles = [{} for _ in pairs], self._oracles(pairs, caches)
        for i, (key, a) in enumerate(pairs):
            self.ready[key] = (a, caches[i], oracles[i], given[i])
        self.computed += len(pairs)

    def _oracles(self, pairs: list, caches: list) -> list[Edited]:
        """Each pair's prefix oracle as a cache of its own: the new prompts' suffixes from the field on, prefilled
        as one batch among the pairs whose field starts at the same token (their caches up to it have one length)."""
        groups: dict[int, list[int]] = {}
        for i, (_, a) in enumerate(pairs):
            groups.setdefault(a.field[0], []).append(i)
        oracles: dict[int, Edited] = {}
        for f0, rows in groups.items():
            t0 = time.perf_counter()
            fixed = _suffix_batch(self.lm, [kvcache.crop(caches[i], f0) for i in rows],
                                  [pairs[i][1].ids_new[f0: pairs[i][1].decision_pos] for i in rows])
            share = (time.perf_counter() - t0) / len(rows)
            for i, cache in zip(rows, fixed):
                a = pairs[i][1]
                D = a.decision_pos
                oracles[i] = Edited(cache, [a.ids_new[D]], D - f0, D + 1, wall_s=share, ids=a.ids_new[: D + 1])
        return [oracles[i] for i in range(len(pairs))]

    def _read(self, pairs: list, caches: list, strategies) -> list[dict]:
        """Each pair's stale, oracle and ``strategies`` reads as one forward (:func:`decide_ragged`), a pair's reads in
        one row over its old cache: the oracle fused with its read (its suffix over the old entries from the field
        on, hidden), a repair in place fused with its read, an erratum's turn over the old entries it keeps (the
        others hidden, :func:`_on`). A strategy that refuses a pair is left to the pair's measurement (its error row).

        What a read would cost alone, its row's ``decide_s`` (and a fused repair's or the oracle's ``wall_s``), is
        estimated from the forward it shared: one pass over the weights, :attr:`single_s` (a one-token read timed
        alone once, the better of two), plus its tokens at that forward's time per token past that pass. A fused
        repair is costed as deployed, its recompute (its tokens before the decision's) then its read (one token):
        two passes; so is the oracle, its prefill from the field on and its read."""
        entries = []  # (pair index, label, Edited, Read)
        for i, (_, a) in enumerate(pairs):
            ctx = EditContext(self.lm, a, caches[i])
            stale = apply(ctx, Stale())
            entries += [(i, "stale", stale, Read.of(stale)), (i, "oracle", *PrefixOracle().fused(ctx)),
                        *self._entries(i, ctx, strategies)]
        if self.single_s is None:
            self.single_s = min(timed_read(self.lm, entries[0][2])[1] for _ in range(2))
        given: list[dict] = [{} for _ in pairs]
        self._decide(entries, given)
        return given

    def _entries(self, i: int, ctx: EditContext, strategies) -> list[tuple]:
        """(i, label, Edited, Read) for each of ``strategies`` that takes the pair: its repair fused with its read
        where it can be, else applied and read over the pair's old cache (:func:`_on`)."""
        out = []
        for s in strategies:
            try:
                s.check(self.lm, ctx.a)
                fused = s.fused(ctx)
                if fused is None:
                    edited = apply(ctx, s)
                    fused = edited, _on(Read.of(edited), ctx.old_cache)
            except KvprobeError:
                continue
            out.append((i, s.label, *fused))
        return out

    def _decide(self, entries: list[tuple], given: list[dict]) -> None:
        """``entries`` read as one forward, each into ``given[i][label]`` with its estimated cost (:meth:`_read`)."""
        if not entries:
            return
        start = time.perf_counter()
        logits = decide_ragged(self.lm, [e[3] for e in entries])
        elapsed = time.perf_counter() - start
        per_token = max(0.0, elapsed - self.single_s) / sum(len(e[3].ids) for e in entries)
        for (i, label, edited, read), g in zip(entries, logits):
            if edited.cache is None:  # fused: its recompute (the tokens before the decision's), then a one-token read
                edited.wall_s = self.single_s + per_token * (len(read.ids) - 1)
                given[i][label] = (edited, (g, self.single_s + per_token, len(entries)))
            else:
                given[i][label] = (edited, (g, self.single_s + per_token * len(read.ids), len(entries)))

    def read_back(self, keys, strategy) -> None:
        """A candidate joining the chain read on the kept pairs among ``keys`` and on the pairs computed ahead (those
        without its read), ``size`` pairs a forward, into their states' reads: measuring it there reads nothing."""
        if not self.reads or self.single_s is None:
            return
        held = [*(self.kept.get(k) for k in keys), *self.ready.values()]
        held = [st for st in held if st is not None and strategy.label not in st[3]]
        with self.lm.lock:
            for lo in range(0, len(held), self.size):
                chunk = held[lo: lo + self.size]
                entries = [e for j, st in enumerate(chunk)
                           for e in self._entries(j, EditContext(self.lm, st[0], st[1]), [strategy])]
                self._decide(entries, [st[3] for st in chunk])


def _on(read: Read, old) -> Read:
    """``read`` over the pair's old cache where its own is a crop of it (an erratum's: the entries past the crop
    hidden), so that it shares the old cache's row of the forward; else as it is."""
    if read.cache is old or not kvcache.is_prefix_view(read.cache, old):
        return read
    n, D = kvcache.seq_len(read.cache), kvcache.seq_len(old)
    return Read(old, read.ids, read.positions, sorted({*read.hidden, *range(n, D)}))
