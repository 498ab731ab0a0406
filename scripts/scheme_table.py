"""Per attention and position scheme: three repairs against a fresh prefill, and one made wrong on purpose.

    .venv/bin/python scripts/scheme_table.py [--doc docs/architectures.md]

For every tiny model (each family's data file and the variants: kvprobe.models.tiny_names), the
largest absolute difference of the decision logits (whole vocabulary) against a fresh prefill of
the same prompt, for

- **edit**: a field edit recomputed downstream (``selective:N:recency`` over every downstream
  position of a generated case) against the oracle's full prefill of the new prompt;
- **moved**: a block whose jointly computed KV was taken from a prefill 128 positions later,
  re-rotated back by -128 and spliced, against the full prefill of the whole prompt;
- **seam**: two blocks precompiled on their own, spliced behind a lead and repaired over the
  whole of each block (the seam), against the full prefill;
- **plain RoPE**: *moved*, re-rotated with plain RoPE instead of the model's own (every head dim
  rotated, base theta, no scaling): the re-rotation made wrong on purpose. It equals *moved* where
  the model's RoPE is plain, and must be far off where it is not (partial, llama3, YaRN).

The **image block** row (tiny-qwen2_vl with its vision tower, M-RoPE, images generated and put
through the model's image processor) compares with the model's own full multimodal prefill (pixel
values in, its positions computed by the model): *edit* is a text field after the image recomputed
with every token at its M-RoPE position; *moved* and *seam* as above with image blocks spliced
through the composer (the seam's image tokens fed from the block's stored input embeddings); the
wrong-on-purpose column places the text after the image by token count, as 1-D RoPE would (an
image takes fewer positions than tokens).

Prints the table and, with ``--doc``, writes it between the markers of that page.
tests/families/test_schemes.py asserts every *edit*, *moved* and *seam* within the tolerance the
family tests use, and every non-plain scheme's *plain RoPE* far outside it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHIFT = 128  # positions a block is moved by
TOL_EDIT, TOL_MOVED, TOL_SEAM = 1e-5, 1e-4, 1e-5  # tests/families and tests/composer/test_compose.py's tolerances
BEGIN, END = "<!-- scheme table: begin -->", "<!-- scheme table: end -->"


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def scheme(lm) -> str:
    """The model's position scheme in words: rotary dims, RoPE type, per-layer bases, MoE."""
    from kvprobe.models import rope

    a = lm.adapter
    params = a.rope_parameters(0)
    rot = 2 * rope.inv_freq(a, 0).numel()
    room = a.rotary_room
    parts = [f"RoPE {params['rope_type']}", f"{rot}/{room} dims rotate" if rot < room else "all dims"]
    if "local_theta" in a.family.rope:
        parts.append("two bases")
    if a.window:
        parts.append(f"window {a.window}")
    if a.family.mla:
        (_, latent), (_, rope_dim) = a.cache_dims
        parts.append(f"MLA: latent {latent} + rotary part {rope_dim} cached")
    if any(getattr(a.config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        parts.append("mixture of experts")
    return ", ".join(parts)


@contextlib.contextmanager
def plain_rope(lm):
    """Re-rotation with plain RoPE: 1/theta^(2i/D) over every head dim, no scaling (wrong on purpose
    wherever the model's RoPE is partial or scaled)."""
    from kvprobe.models import rope

    real = rope.inv_freq

    def plain(adapter, layer, device=None):
        theta = float(adapter.rope_parameters(layer)["rope_theta"])
        d = adapter.rotary_room  # every dim of the rotated slot (a head's key; MLA's rotary part)
        return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)

    rope.inv_freq = plain
    try:
        yield
    finally:
        rope.inv_freq = real


def _layout(lm, seed: int = 0) -> list[list[int]]:
    """(preamble, lead, block1, block2, query) random ids, blocks longer than the tiny window (16)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, len(lm.tokenizer), (81,), generator=gen).tolist()
    cuts = [0, 5, 12, 52, 75, 81]
    return [ids[a:b] for a, b in zip(cuts, cuts[1:])]


def _moved(lm) -> float:
    from kvprobe import composer
    from kvprobe.kv import cache as kvcache

    pre, lead, b1, b2, q = _layout(lm, seed=1)
    ids = pre + lead + b1 + b2 + q
    p = len(pre + lead)
    _, shifted = kvcache.prefill(lm.model, torch.tensor(ids), start=SHIFT)
    block = composer.block_from_cache(lm, shifted, b1, p)
    block.start = p + SHIFT  # its entries were computed at positions p + SHIFT ..
    c = composer.compose(lm, [pre + lead, block, b2 + q])
    return _maxdiff(c.logits, composer.oracle_logits(lm, ids))


@torch.no_grad()  # never torch.set_grad_enabled(False): tests call this, and a training test may follow
def checks(lm) -> dict:
    """The four numbers of one model (see the module docstring)."""
    from kvprobe import composer, editor
    from kvprobe.datasets import align, generate

    a = align(generate(4, seed=11)[1], lm.tokenizer, "raw")
    ctx = editor.make_context(lm, a)
    oracle = editor.decide(lm, editor.apply(ctx, "oracle"))[0]
    n_down = a.downstream[1] - a.downstream[0]
    edit = _maxdiff(editor.decide(lm, editor.apply(ctx, f"selective:{n_down}:recency"))[0], oracle)
    moved = _moved(lm)
    with plain_rope(lm):
        wrong = _moved(lm)
    pre, lead, b1, b2, q = _layout(lm)
    ids = pre + lead + b1 + b2 + q
    blocks = composer.precompile(lm, b1, pre), composer.precompile(lm, b2, pre)
    c = composer.compose(lm, [pre + lead, *blocks, q], seam=max(len(b1), len(b2)))
    seam = _maxdiff(c.logits, composer.oracle_logits(lm, ids))
    return {"model": lm.info.spec, "family": lm.info.family, "scheme": scheme(lm), "edit": edit, "moved": moved,
            "seam": seam, "plain": wrong}


def _image_layout(lm):
    from kvprobe.composer import images

    pre, lead, b1, _, q = _layout(lm, seed=2)
    return pre, lead, q, images.generated_image(lm, 0), images.generated_image(lm, 1)


def shifted_image_block(lm, pre, lead, im, q, shift: int = SHIFT):
    """(the image block of ``pre + lead + image + q`` taken from a joint prefill ``shift`` positions
    later on all three axes, the prompt's ids): tests/composer/test_image_blocks.py moves it too."""
    from kvprobe.composer import images
    from kvprobe.kv import cache as kvcache

    bids = images.image_ids(lm, im)
    ids = pre + lead + bids + q
    pos, emb = images.mrope_positions(lm, ids, [im]), images.input_embeds(lm, ids, [im])
    cache = kvcache.new_cache()
    images.forward_embeds(lm, emb, pos + shift, cache)
    lo, hi = len(pre + lead), len(pre + lead) + len(bids)
    return images.image_block_from_cache(lm, cache, bids, lo, pos[:, lo:hi] + shift, emb[lo:hi], im), ids


def _image_moved(lm, by_tokens: bool = False) -> float:
    """An image block's jointly computed KV from a prefill SHIFT positions later (all three axes),
    re-rotated back and spliced; ``by_tokens``: the text after it placed by token count."""
    import dataclasses

    from kvprobe import composer
    from kvprobe.composer import images

    pre, lead, q, im, _ = _image_layout(lm)
    block, ids = shifted_image_block(lm, pre, lead, im, q)
    if by_tokens:
        block = dataclasses.replace(block, rope_positions=None, embeds=None, image=None, _rotated={})
    c = composer.compose(lm, [pre + lead, block, q])
    return _maxdiff(c.logits, images.multimodal_oracle_logits(lm, ids, [im]))


@torch.no_grad()
def image_checks(lm) -> dict:
    """The four numbers of the image block row (see the module docstring)."""
    from kvprobe import composer
    from kvprobe.composer import images
    from kvprobe.kv import cache as kvcache
    from kvprobe.kv.recompute import recompute_positions

    pre, lead, q, im, other = _image_layout(lm)
    bids = images.image_ids(lm, im)
    old, new = pre + lead + bids + [41, 42, 43] + q, pre + lead + bids + [41, 77, 43] + q
    pos = images.mrope_positions(lm, new, [im])
    D, field = len(new) - 1, len(pre + lead + bids) + 1
    cache = kvcache.new_cache()
    images.forward_embeds(lm, images.input_embeds(lm, old[:D], [im]), pos[:, :D], cache)
    repaired = recompute_positions(lm, cache, new, list(range(field, D)), rope_positions=pos[:, None, :D])
    out = lm.model(input_ids=torch.tensor([new[D:]]), position_ids=pos[:, None, D:], use_cache=True,
                   **{kvcache.CACHE_KWARG: repaired})
    edit = _maxdiff(out.logits[0, -1], images.multimodal_oracle_logits(lm, new, [im]))
    parts = [pre + lead, images.precompile_image(lm, im, pre), composer.precompile(lm, lead[:20], pre),
             images.precompile_image(lm, other, pre), q]
    seam = composer.compose(lm, parts, seam=max(len(p) for p in parts[1:-1]))
    seam = _maxdiff(seam.logits, images.multimodal_oracle_logits(lm, composer.context_ids(parts), [im, other]))
    return {"model": f"{lm.info.spec} (image block)", "family": lm.info.family,
            "scheme": "M-RoPE (3 axes), an image of 16 tokens taking 4 positions", "edit": edit,
            "moved": _image_moved(lm), "seam": seam, "plain": _image_moved(lm, by_tokens=True)}


def table(rows: list[dict]) -> list[str]:
    out = [f"| model | family | scheme | edit | moved by {SHIFT} | seam | moved, plain RoPE or (image) placed by "
           f"tokens: wrong on purpose |",
           "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['family']} | {r['scheme']} | {r['edit']:.1e} | {r['moved']:.1e} | "
                   f"{r['seam']:.1e} | {r['plain']:.1e} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", type=Path, help="a page with the table's markers, to write it into")
    args = ap.parse_args()
    from kvprobe.hardware import cpu_line
    from kvprobe.models import load_model, tiny_names

    rows = [checks(load_model(name)) for name in tiny_names()] + [image_checks(load_model("tiny-qwen2_vl"))]
    lines = table(rows)
    print(cpu_line())
    print("\n".join(lines))
    if args.doc:
        text = args.doc.read_text()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        args.doc.write_text(f"{head}{BEGIN}\n{chr(10).join(lines)}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
