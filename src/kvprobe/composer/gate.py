"""The composition gate: composed contexts against a full recompute, per seam width, with and
without re-rotation, on the composition dataset (``kvprobe validate``, ``kvprobe run --compose``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import torch

from kvprobe.composer.blocks import SEAMS, Block, check_composable, precompile
from kvprobe.composer.splice import Composer, context_ids, oracle_logits
from kvprobe.composer.store import SUFFIX, load_block, save_block
from kvprobe.datasets.skills import generate_compose, segments
from kvprobe.datasets.spans import option_ids
from kvprobe.errors import KvprobeError, UsageError
from kvprobe.executor import Context, Serial
from kvprobe.kv.readout import option_scores
from kvprobe.metrics import compare, mean_ci, proportion


def option_token_ids(tokenizer, option: str) -> list[int]:
    """First-token ids of an option, bare and space-prefixed, lower and capitalised."""
    out: list[int] = []
    for text in dict.fromkeys((option, option.capitalize())):
        out += [i for i in option_ids(tokenizer, text) if i not in out]
    return out


def _decide(logits: torch.Tensor, options: dict[str, list[int]]) -> tuple[str, float]:
    """(arg-max option, option_diff: the first option's score minus the second's) from the best first-token logit
    of each."""
    names = list(options)
    scores = option_scores(logits, options, names).tolist()
    return names[max(range(len(names)), key=scores.__getitem__)], scores[0] - scores[1]


COLUMNS = ("model", "query_id", "domain", "kind", "n_blocks", "block_tokens", "context_tokens", "seam",
           "rerotate", "agree", "top1_agree", "cosine", "kl", "answer", "reference", "expected", "option_diff",
           "reference_option_diff", "wall_s", "oracle_wall_s")


def run_compose(lm, n: int = 50, seed: int = 0, seams: Sequence[int] = SEAMS,
                block_tokens: tuple[int, int] = (200, 400), n_blocks: tuple[int, int] = (1, 4),
                rerotate: Sequence[bool] = (True, False), form: str = "auto", store_dir=None,
                model_name: str | None = None, on_query: Callable[[], None] | None = None,
                on_precompile: Callable[[int, int], None] | None = None, parts=None, executor=None, images: int = 0):
    """Compose the composition dataset's skills and compare with full recompute.

    One row per (query, seam, rerotate): decision agreement with the oracle (over the options),
    top-1 agreement (full vocabulary), logit cosine and KL(oracle || composed). Skills are
    precompiled once each behind the shared preamble; with ``store_dir`` they go through the
    store (saved, then loaded back and verified), as a deployment would use them.
    With ``parts`` (a :class:`kvprobe.results.CaseStore`) each finished query is saved as it ends
    and skipped on a rerun, and a skill already in ``store_dir`` is loaded, not recomputed, so an
    interrupted run resumes where it stopped. ``executor`` (:mod:`kvprobe.executor`; serial by
    default) composes the queries: the blocks are precompiled here, once, and travel to its workers.
    ``images`` (M-RoPE models with a vision tower only: tiny-qwen2_vl) puts that many image blocks
    in every query, right after its lead: a pool of twice as many generated images
    (:func:`kvprobe.composer.images.generated_image`, seeded from ``seed``) is precompiled behind
    the preamble like the skills (and stored), query i takes images i, i + 1, ... of the pool, and
    the oracle is the model's own full multimodal prefill with their pixel values.
    Returns a pandas DataFrame with :data:`COLUMNS`.
    """
    check_composable(lm)
    seams = sorted({int(s) for s in seams})
    if not seams or seams[0] < 0:
        raise UsageError(f"seams must be integers >= 0, got {list(seams)}")
    if images < 0:
        raise UsageError(f"images must be >= 0, got {images}")
    pool = []  # the generated images, when the queries hold image blocks
    if images:
        from kvprobe.composer import images as imaging

        imaging.check_mrope(lm, "--images")
        pool = [imaging.generated_image(lm, seed * 1009 + k) for k in range(2 * images)]
    data = generate_compose(n, seed=seed, tokenizer=lm.tokenizer, block_tokens=block_tokens, n_blocks=n_blocks)
    segs = segments(data, lm.tokenizer, form)
    options = {opt: option_token_ids(lm.tokenizer, opt) for opt in data.options}
    finished = {q.query_id: df for q in data.queries
                if parts is not None and (df := parts.get(q.query_id)) is not None}
    todo = [q for q in data.queries if q.query_id not in finished]
    used = list(dict.fromkeys(sid for q in todo for sid in q.skills))
    blocks: dict[str, Block] = {}
    for i, sid in enumerate(used):
        blocks[sid] = _skill_block(lm, segs, sid, store_dir)
        if on_precompile:
            on_precompile(i + 1, len(used) + len(pool))
    shown = {q.query_id: [pool[(i + j) % len(pool)] for j in range(images)] for i, q in enumerate(data.queries)}
    for i, image in enumerate(pool if todo else []):
        blocks[image.sha256] = _image_block(lm, image, segs.preamble, store_dir)
        if on_precompile:
            on_precompile(len(used) + i + 1, len(used) + len(pool))
    frames = list(finished.values())
    for _ in frames:
        if on_query:
            on_query()

    def compose_query(ctx, q) -> pd.DataFrame:
        lm = ctx.lm
        rows = []
        qs = segs.queries[q.query_id]
        pictures = shown[q.query_id]
        placed = [*(im.sha256 for im in pictures), *q.skills]  # the blocks, in order: images, then skills
        pieces = [qs.lead, *(blocks[b] for b in placed), qs.query]
        ids = segs.preamble + context_ids(pieces)
        t0 = time.perf_counter()
        if pictures:
            from kvprobe.composer.images import multimodal_oracle_logits

            oracle = multimodal_oracle_logits(lm, ids, pictures)
        else:
            oracle = oracle_logits(lm, ids)
        oracle_wall = time.perf_counter() - t0
        reference, reference_diff = _decide(oracle, options)
        base = Composer(lm)
        base.text(segs.preamble + qs.lead)
        for rot in rerotate:
            for s in seams:
                t0 = time.perf_counter()
                c = base.copy()
                for b in placed:
                    c.block(blocks[b], s, rot)
                logits = c.text(qs.query)
                wall = time.perf_counter() - t0
                assert c.ids == ids
                answer, diff = _decide(logits, options)
                rows.append({
                    "model": model_name or lm.info.spec, "query_id": q.query_id, "domain": q.domain, "kind": q.kind,
                    "n_blocks": len(placed), "block_tokens": sum(len(blocks[b]) for b in placed),
                    "context_tokens": len(ids), "seam": s, "rerotate": bool(rot), "agree": answer == reference,
                    "top1_agree": int(logits.argmax()) == int(oracle.argmax()), **compare(logits, oracle),
                    "answer": answer, "reference": reference, "expected": q.expected, "option_diff": diff,
                    "reference_option_diff": reference_diff, "wall_s": wall, "oracle_wall_s": oracle_wall,
                })
        return pd.DataFrame(rows, columns=list(COLUMNS))

    frames.append((executor or Serial()).map(parts, [(q.query_id, q) for q in todo], compose_query, Context(lm),
                                             on_query or (lambda: None)))  # parts: each query saved as it ends
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=list(COLUMNS))
    df = pd.concat(frames, ignore_index=True)
    order = {q.query_id: i for i, q in enumerate(data.queries)}  # the queries' order, resumed or not
    return df.iloc[df.query_id.map(order).argsort(kind="stable")].reset_index(drop=True)


def _skill_block(lm, segs, sid: str, store_dir) -> Block:
    """The skill's block: loaded from ``store_dir`` when a file is already there (verified against
    this model and tokenizer), else precompiled, and with ``store_dir`` saved and loaded back."""
    if store_dir is None:
        return precompile(lm, segs.skills[sid], segs.preamble, name=sid)

    path = store_path(store_dir, sid)
    if path.exists():
        block = load_block(path, lm)
        if block.ids == [int(i) for i in segs.skills[sid]] and block.preamble == [int(i) for i in segs.preamble]:
            return block
        raise KvprobeError(f"{path} holds another block than skill {sid} of this dataset; "
                           f"use another --out or remove {path.parent}")
    save_block(precompile(lm, segs.skills[sid], segs.preamble, name=sid), lm, path)
    return load_block(path, lm)


def _image_block(lm, image, preamble, store_dir) -> Block:
    """The image's block, as :func:`_skill_block` does a skill's: loaded from ``store_dir`` when a
    file of that image (its sha256) is there, else precompiled (and saved and loaded back)."""
    from kvprobe.composer.images import precompile_image

    name = f"image-{image.sha256[7:19]}"
    if store_dir is None:
        return precompile_image(lm, image, preamble, name=name)
    path = store_path(store_dir, name)
    if path.exists():
        block = load_block(path, lm)
        if (block.image or {}).get("sha256") == image.sha256 and block.preamble == [int(i) for i in preamble]:
            return block
        raise KvprobeError(f"{path} holds another block than image {image.sha256}; use another --out or remove "
                           f"{path.parent}")
    save_block(precompile_image(lm, image, preamble, name=name), lm, path)
    return load_block(path, lm)


def store_path(folder, name: str):
    """Where the store keeps the block ``name`` inside ``folder``."""

    return Path(folder) / f"{name}{SUFFIX}"


def summarize_compose(df) -> "pd.DataFrame":  # noqa: F821
    """One row per (rerotate, seam): agreement (Wilson CI), top-1 agreement, cosine and KL (bootstrap CIs)."""
    import pandas as pd


    rows = []
    for (rot, s), g in df.groupby(["rerotate", "seam"], sort=True):
        agree, cos, kl = proportion(g.agree.astype(float)), mean_ci(g.cosine), mean_ci(g.kl)
        rows.append({"rerotate": bool(rot), "seam": int(s), "n": len(g),
                     "agreement": agree[0], "agreement_lo": agree[1], "agreement_hi": agree[2],
                     "top1_agreement": float(g.top1_agree.mean()),
                     "cosine": cos[0], "cosine_lo": cos[1], "cosine_hi": cos[2],
                     "kl": kl[0], "kl_lo": kl[1], "kl_hi": kl[2], "wall_s": float(g.wall_s.mean())})
    out = pd.DataFrame(rows)
    return out.sort_values(["rerotate", "seam"], ascending=[False, True]).reset_index(drop=True) if len(out) else out
