"""Model specs -> :class:`LoadedModel`.

A spec is one of: a bundled alias (``kvprobe models``), ``tiny-<family>``, ``toy-<family>``, a
``.gguf`` path, a local Hugging Face folder, or a Hugging Face hub id (needs a network).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvprobe.errors import KvprobeError
from kvprobe.models import bundled
from kvprobe.models.adapter import Adapter
from kvprobe.models.fingerprint import weights_sha256
from kvprobe.models.rope import self_check
from kvprobe.models.tiny import build_tiny, tiny_names
from kvprobe.models.toy_folder import load_toy, load_toy_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROPE_TOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}  # self-check tolerance at shift 37


@dataclass
class ModelInfo:
    """Where a model came from, and its fingerprint (computed lazily; hashing weights takes time)."""

    spec: str
    family: str
    source: str  # "bundled", "tiny", "toy", "gguf", "folder", "hub"
    dtype: str
    device: str
    n_params: int
    note: str = ""
    rope_check_error: float | None = None  # max |re-rotated - recomputed| key error at load
    rope_unsupported: str | None = None  # why this model's keys cannot be re-rotated, if so
    _weights_hash: str | None = field(default=None, repr=False)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


@dataclass
class LoadedModel:
    """A model ready for kvprobe: the HF model (eval mode), its tokenizer and family adapter."""

    model: Any
    tokenizer: Any
    adapter: Adapter
    info: ModelInfo

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_positions(self) -> int | None:
        """The model's position range (None when its config does not say)."""
        return getattr(self.model.config, "max_position_embeddings", None)

    def check_length(self, n_tokens: int, what: str = "context") -> None:
        """Refuse ``n_tokens`` positions where the model has fewer (one line, the one length check)."""
        limit = self.max_positions
        if limit and n_tokens > limit:
            raise KvprobeError(f"{what} of {n_tokens} tokens is longer than the model's window of {limit} positions")

    def config_hash(self) -> str:
        cfg = self.model.config.to_dict()
        cfg.pop("transformers_version", None)
        cfg.pop("_name_or_path", None)
        return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def weights_hash(self) -> str:
        """sha256 over every parameter's name, shape, dtype and bytes (memoised)."""
        if self.info._weights_hash is None:
            self.info._weights_hash = weights_sha256(self.model)[:16]
        return self.info._weights_hash

    def fingerprint(self) -> dict:
        """Identity of the exact model: config hash, weights hash, tokenizer hash."""
        vocab = json.dumps(sorted(self.tokenizer.get_vocab().items()), ensure_ascii=True)
        tok_hash = hashlib.sha256((vocab + str(self.tokenizer.chat_template)).encode()).hexdigest()[:16]
        return {"spec": self.info.spec, "family": self.info.family, "config_hash": self.config_hash(),
                "weights_hash": self.weights_hash(), "tokenizer_hash": tok_hash}


def _finish(model, tokenizer, spec: str, source: str, dtype: str, device: str, note: str = "") -> LoadedModel:
    adapter = Adapter.for_config(model.config)
    model = model.to(device=device, dtype=DTYPES[dtype]).eval()
    n_params = sum(p.numel() for p in model.parameters())
    info = ModelInfo(spec, adapter.family.family, source, dtype, device, n_params, note)
    # The re-rotation gate: re-rotated keys must equal keys computed at the new position. A model
    # whose RoPE we cannot re-rotate still loads (probing needs no re-rotation); composing refuses.
    try:
        info.rope_check_error = self_check(model, adapter, tol=ROPE_TOL[dtype])
    except KvprobeError as exc:
        info.rope_unsupported = str(exc)
    return LoadedModel(model, tokenizer, adapter, info)


def _from_folder(path: Path | str, gguf_file: str | None = None, model_class: str | None = None,
                 attn: str = "eager"):
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    cls = getattr(transformers, model_class) if model_class else AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation=attn, **kwargs)
    if gguf_file:  # dequantised already; drop the quantiser so the model behaves as plain fp32
        model.hf_quantizer = None
    return model, tok


def load_model(spec: str, dtype: str = "float32", device: str = "cpu", progress=lambda s: None,
               attn: str = "eager", allow_failed_toy: bool = False) -> LoadedModel:
    """Load a model spec (see module docstring). Raises :class:`KvprobeError` with the accepted forms.

    ``attn`` is the attention implementation: "eager" (default; probes read attention weights and
    every path computes identically) or "sdpa" (faster on long contexts, used by benchmarks).
    A toy folder whose manifest records a held-out failure is refused unless ``allow_failed_toy``.
    """
    if attn not in ("eager", "sdpa"):
        raise KvprobeError(f"unknown attention implementation {attn!r}; accepted: eager, sdpa")
    if dtype not in DTYPES:
        raise KvprobeError(f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
        raise KvprobeError(f"device {device!r} is not available here; accepted: cpu" +
                           (", cuda" if torch.cuda.is_available() else ""))
    if spec in tiny_names():
        model, tok = build_tiny(spec)
        return _finish(model, tok, spec, "tiny", dtype, device, "random weights: for mechanics only")
    if spec.startswith("toy-"):
        model, tok, note = load_toy(spec, allow_failed=allow_failed_toy)
        return _finish(model, tok, spec, "toy", dtype, device, note)
    if spec in bundled.BUNDLED:
        b = bundled.BUNDLED[spec]
        folder = bundled.fetch(spec, progress)
        model, tok = _from_folder(folder, attn=attn)
        return _finish(model, tok, spec, "bundled", dtype, device, b.note)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise KvprobeError(f"GGUF file not found: {path}")
        model, tok = _from_folder(path.parent, gguf_file=path.name, attn=attn)
        return _finish(model, tok, spec, "gguf", dtype, device)
    if path.is_dir() and (path / "toy_manifest.json").exists():  # a toy made by `kvprobe toy train`

        model, tok, note = load_toy_folder(path, allow_failed=allow_failed_toy)
        return _finish(model, tok, spec, "toy", dtype, device, note)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise KvprobeError(f"{path} is not a Hugging Face model folder (no config.json)")
        model, tok = _from_folder(path, attn=attn)
        return _finish(model, tok, spec, "folder", dtype, device)
    looks_like_id = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    if not looks_like_id:
        raise KvprobeError(f"unknown model {spec!r}; accepted: a bundled alias ({', '.join(bundled.BUNDLED)}), "
                           f"tiny-<family>, toy-<family>, a .gguf path, a local HF folder, or a hub id org/name")
    try:
        model, tok = _from_folder(spec, attn=attn)
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvprobeError(f"could not load hub model {spec!r} (no network here?): {first}") from None
    return _finish(model, tok, spec, "hub", dtype, device)
