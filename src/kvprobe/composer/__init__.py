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

RoPE positions equal cache indices (blocks sit back to back with the text between them), so
plain forwards and masks by index are exact; the one exception is an image block under M-RoPE
(:mod:`kvprobe.composer.images`), whose tokens take fewer positions than tokens: every part is
placed at the composer's ``next_pos`` and the mask still goes by index. The decision logits come from the last
text part (the query). :class:`Composer` goes part by part (:func:`compose`);
:func:`compose_fused` gives the same cache and logits (to float rounding, tested) with one
forward pass over all fresh tokens, which is what the TTFT benchmark times.

**Seam repair** feeds the first ``s`` tokens of a block fresh, then splices the remaining
T - s stored entries. This is :func:`kvprobe.kv.decode.recompute_positions` of those ``s``
positions right after the splice, without copying the cache (a recomputed token attends to
everything before it and to nothing after it, and the stale entries it replaces lie after it);
``tests/composer/test_compose.py`` checks the two agree. ``s >= T`` recomputes the whole block, which
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
(taken from an evicting cache) is refused, never padded. ``tests/composer/test_compose.py`` checks
blocks longer than the window on tiny-gemma3 and tiny-mistral (window 16).

**Refusals** (``KvprobeError``, one line): a model whose RoPE cannot be re-rotated
(``lm.info.rope_unsupported``), a block from another model (config hash) or in another dtype,
a block whose KV is shorter or longer than its tokens or has the wrong number of layers, and a
composed context longer than the model's position range.

**Controls.** ``rerotate=False`` splices the keys at the positions they were computed at (the
paper's 0.18 agreement); the oracle prefills the whole context (:func:`oracle_logits`).

Tensor layout, as in :mod:`kvprobe.kv.cache`: keys, values (B=1, H_kv, T, D).
"""

from kvprobe.composer.blocks import SEAMS, Block, block_from_cache, check_block, check_composable, precompile
from kvprobe.composer.gate import COLUMNS, run_compose, summarize_compose
from kvprobe.composer.splice import Composer, compose, compose_fused, context_ids, oracle_logits

__all__ = ["COLUMNS", "SEAMS", "Block", "Composer", "block_from_cache", "check_block", "check_composable", "compose",
           "compose_fused", "context_ids", "oracle_logits", "precompile", "run_compose", "summarize_compose"]
