"""Reads of any lengths as one forward (kvprobe.kv.decode.decide_ragged, issue 54): each read's decision equals
reading it alone, a repair in place fused with its read equals the repaired cache read, and no cache changes."""

from __future__ import annotations

import pytest
import torch

from kvprobe.editor import states
from kvprobe.kv import cache as kvcache
from kvprobe.kv.decode import Edited, Read, decide, decide_ragged
from tests.conftest import ids_of, tiny_model


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma2", "tiny-gemma3", "tiny-qwen2_vl", "tiny-deepseek_v3"])
def test_ragged_reads_are_each_read_alone_and_a_fused_recompute_is_the_repaired_read(model):
    """Caches of 9, 14 and 20 tokens; tails of 1, 3 and 6 tokens; two reads that recompute positions (one of them
    three apart) with the decision token; two prefix oracles (a new suffix fed over the entries it replaces, hidden);
    the reads of each cache in one row: each logit vector within 1e-4 of its read alone (float32), the fused
    ones of reading the cache :func:`states.recomputed` builds. A sliding window (16 tokens in tiny-gemma2 and
    tiny-gemma3), a softcap (gemma2), M-RoPE (qwen2_vl) and a single latent head (deepseek_v3's MLA) included."""
    lm = tiny_model(model)
    vocab = lm.model.get_input_embeddings().num_embeddings
    ids = [ids_of(n, vocab, seed=n)[0].tolist() for n in (9, 14, 20)]
    caches = [states.prefilled(lm, x) for x in ids]
    before = [[(k.clone(), v.clone()) for k, v in kvcache.to_tensors(c)] for c in caches]
    tails = [ids_of(t, vocab, seed=100 + t)[0].tolist() for t in (1, 3, 6)]
    reads, want = [], []
    for c, x in zip(caches, ids):
        for tail in tails:
            e = Edited(c, tail, len(tail) - 1, len(x) + len(tail))
            reads.append(Read.of(e))
            want.append(decide(lm, e)[0])
    for c, x, positions in ((caches[1], ids[1], [5, 6, 7]), (caches[2], ids[2], [4, 9, 12, 13])):
        new = list(x)
        for p in positions:
            new[p] = (new[p] + 7) % vocab
        decision = tails[0][0]
        reads.append(Read(c, [new[p] for p in positions] + [decision], positions + [len(x)], positions))
        want.append(decide(lm, Edited(states.recomputed(lm, c, new, positions), [decision], 0, len(x) + 1))[0])
    for c, x, f0 in ((caches[0], ids[0], 3), (caches[2], ids[2], 11)):  # a prefix oracle: the entries from f0 hidden
        new = [(t + 3) % vocab if p >= f0 else t for p, t in enumerate(x)] + [tails[0][0]]
        reads.append(Read(c, new[f0:], list(range(f0, len(new))), list(range(f0, len(x)))))
        want.append(decide(lm, Edited(kvcache.crop(c, f0), new[f0:], 0, len(new)))[0])
    rows = []
    forward = kvcache.masked_forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvcache, "masked_forward",
                   lambda lm, ids, *a, **k: rows.append(ids.shape[0]) or forward(lm, ids, *a, **k))
        got = decide_ragged(lm, reads)
    assert rows == [3]  # the reads of one cache share its row
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want))
    assert worst < 1e-4, worst
    assert decide_ragged(lm, []) == []
    for c, b in zip(caches, before):  # every input cache as it was
        assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kvcache.to_tensors(c), b))
