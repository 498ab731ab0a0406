"""A fingerprinted store of precompiled blocks: one safetensors file per block.

File layout::

    tensors   k.{layer}, v.{layer}: (1, H_kv, T, D) in the model's dtype (keys after RoPE at
              the stored positions, as in kvprobe.kv.cache); image blocks also embeds: (T, d),
              their tokens' input embeddings
    metadata  {"kvprobe": JSON header}
              format          "kvprobe-block/2" (/1, written before image blocks, is read as a
                              text block)
              model           spec, family, config_hash, weights_hash, tokenizer_hash
              name, ids, preamble, dtype, n_layers, shapes (per layer [H_kv, T, D])
              scheme          the position scheme: "rope" (one position per token) or "mrope"
                              (M-RoPE: temporal, height and width)
              positions       "rope": T consecutive integers; "mrope": three rows of T
              image           "mrope" only: sha256 (over the pixel values and grid), grid_thw
              rope            per layer: the RoPE parameters the keys were rotated with
              checksum        "sha256:<hex>" over the header without it (canonical JSON) and
                              every tensor's bytes, in the order k.0, v.0, k.1, v.1, ..., embeds

:func:`load_block` refuses (``KvprobeError``, one line) a file that is not a readable
safetensors file (truncated, corrupt header), a file without a kvprobe header, one whose
checksum does not match (corrupt data), and one made for another model (config or weights
hash), another tokenizer, another dtype, other RoPE parameters or another position scheme (an
M-RoPE image block into a model with 1-D RoPE). Files are written to a
temporary name and renamed, so a crash never leaves a half-written block that looks finished.

The model's fingerprint (weights hash over every parameter) is computed once per loaded model
and memoised, as :meth:`LoadedModel.weights_hash` is.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from kvprobe.composer.blocks import Block, _dtype_name, check_block, is_mrope
from kvprobe.errors import KvprobeError
from kvprobe.identity import HASHES, ModelIdentity
from kvprobe.results import atomic_write

FORMAT = "kvprobe-block/2"
READABLE = ("kvprobe-block/1", FORMAT)  # /1: text blocks, before the scheme key
SUFFIX = ".kvblock.safetensors"
META_KEY = "kvprobe"


def identity(lm) -> ModelIdentity:
    """The model's identity, memoised on the loaded model (hashing weights and vocab takes time)."""
    memo = lm.__dict__.get("_store_identity")
    if memo is None:
        memo = lm.__dict__["_store_identity"] = ModelIdentity.of_model(lm)
    return memo


def _rope(lm) -> list[dict]:
    return [json.loads(json.dumps(lm.adapter.rope_parameters(layer), sort_keys=True, default=str))
            for layer in range(lm.adapter.n_layers)]


def _tensor_names(n_layers: int, scheme: str = "rope") -> list[str]:
    names = [name for layer in range(n_layers) for name in (f"k.{layer}", f"v.{layer}")]
    return names + ["embeds"] if scheme == "mrope" else names


def _checksum(header: dict, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "checksum"}, sort_keys=True).encode())
    for name in _tensor_names(header["n_layers"], header.get("scheme", "rope")):
        t = tensors[name].detach().cpu().contiguous()
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def save_block(block: Block, lm, path: Path | str) -> Path:
    """Write ``block`` (precompiled by ``lm``) to ``path`` atomically; returns the path."""
    from safetensors.torch import save_file

    check_block(lm, block)
    model = identity(lm)
    tensors = {}
    for layer, (k, v) in enumerate(block.kv):
        tensors[f"k.{layer}"] = k.detach().cpu().contiguous()
        tensors[f"v.{layer}"] = v.detach().cpu().contiguous()
    header = {
        "format": FORMAT, "model": model.as_dict(), "name": block.name,
        "ids": list(block.ids), "scheme": block.scheme, "positions": block.positions,
        "preamble": list(block.preamble), "dtype": block.dtype, "n_layers": len(block.kv),
        "shapes": [list(k.shape[1:]) for k, _ in block.kv], "rope": _rope(lm),
    }
    if block.scheme == "mrope":
        tensors["embeds"] = block.embeds.detach().cpu().contiguous()
        header["image"] = dict(block.image or {})
    header["checksum"] = _checksum(header, tensors)
    metadata = {META_KEY: json.dumps(header, sort_keys=True)}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def read_header(path: Path | str) -> dict:
    """The kvprobe header of a block file (no tensors read, nothing verified but the format)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise KvprobeError(f"block file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own types for truncated or corrupt files
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise KvprobeError(f"{path} is not a readable block file (truncated or corrupt): {first}") from None
    try:
        header = json.loads(meta[META_KEY])
        assert header["format"] in READABLE and header.get("scheme", "rope") in ("rope", "mrope")
    except (KeyError, ValueError, AssertionError, TypeError):
        raise KvprobeError(f"{path} is not a kvprobe block file (no valid '{META_KEY}' header of format "
                           f"{' or '.join(READABLE)})") from None
    return header


def _check_identity(path: Path, header: dict, lm) -> None:
    mine, theirs = identity(lm), header["model"]
    if header.get("scheme") == "mrope" and not is_mrope(lm):
        raise KvprobeError(f"{path} is an M-RoPE image block; {mine.spec} rotates by one position id (1-D RoPE): "
                           f"precompile the block for an M-RoPE model")
    differ = mine.differ(theirs, HASHES)
    if differ:  # named by the first of config, weights, tokenizer that differs
        key = differ[0]
        what = "another tokenizer" if key == "tokenizer_hash" else f"another model ({HASHES[key]})"
        raise KvprobeError(f"{path} was precompiled for {what}: {theirs.get('spec')} has {key} "
                           f"{theirs.get(key)}, {mine.spec} has {getattr(mine, key)}; precompile the block again "
                           f"for this model")
    if header["dtype"] != _dtype_name(lm):
        raise KvprobeError(f"{path} holds {header['dtype']} K/V but the model is {_dtype_name(lm)}; "
                           f"precompile the block again in the model's dtype")
    if header["rope"] != _rope(lm):
        raise KvprobeError(f"{path} was rotated with other RoPE parameters than this model's; precompile it again")


def load_block(path: Path | str, lm, verify: bool = True) -> Block:
    """Read a block file for ``lm``; refuses files from another model or tokenizer and truncated or
    corrupt files (see the module docstring). ``verify=False`` skips only the checksum."""
    from safetensors.torch import load_file

    path = Path(path)
    header = read_header(path)
    _check_identity(path, header, lm)
    try:
        tensors = load_file(str(path), device=str(lm.device))
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise KvprobeError(f"{path} is not a readable block file (truncated or corrupt): {first}") from None
    n, scheme = header["n_layers"], header.get("scheme", "rope")
    names = _tensor_names(n, scheme)
    if sorted(tensors) != sorted(names):
        raise KvprobeError(f"{path} is corrupt: expected tensors {names[:2]}... for {n} layers, got {len(tensors)}")
    if verify and _checksum(header, tensors) != header["checksum"]:
        raise KvprobeError(f"{path} is corrupt: its checksum does not match its contents")
    T, pos = len(header["ids"]), header["positions"]
    kv = [(tensors[f"k.{layer}"], tensors[f"v.{layer}"]) for layer in range(n)]
    common = (list(header["ids"]), kv)
    tail = (list(header["preamble"]), header["model"]["config_hash"], header["dtype"], header.get("name", ""))
    if scheme == "rope":
        if not T or pos != list(range(pos[0], pos[0] + T)):
            raise KvprobeError(f"{path} is corrupt: positions are not {T} consecutive integers")
        return Block(*common, int(pos[0]), *tail)
    try:
        rows = torch.tensor(pos, dtype=torch.long, device=lm.device)
        assert rows.shape == (3, T) and T
    except (ValueError, TypeError, AssertionError):
        raise KvprobeError(f"{path} is corrupt: M-RoPE positions are not three rows of {T}") from None
    return Block(*common, int(rows[0, 0]), *tail, rope_positions=rows, embeds=tensors["embeds"],
                 image=dict(header.get("image") or {}))
