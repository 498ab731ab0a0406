"""Checks of a model file or folder before transformers reads it: a GGUF that is whole, a Hugging
Face folder with a config it knows, weights and a tokenizer; each refusal one line naming the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from kvprobe.errors import KvprobeError
from kvprobe.models.quiet import first_line


def check_gguf(path: Path) -> None:
    """Refuse, in one line, a file that is not a whole GGUF (bad magic, a cut-off header, tensors that
    run past the end of the file) before transformers reads it."""
    try:
        from transformers.integrations.gguf.reader import GgufHeader
    except ImportError:  # pragma: no cover - another transformers layout: let the loader judge
        return
    what = f"{path} is not a readable GGUF file"
    try:
        size = path.stat().st_size
        if size == 0:
            raise KvprobeError(f"{what} (it is empty)")
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise KvprobeError(f"{what} (it does not start with the GGUF magic bytes)")
        header = GgufHeader.from_file(str(path))
    except KvprobeError:
        raise
    except (OSError, ValueError, KeyError, IndexError, OverflowError, MemoryError, struct.error) as exc:
        cut = isinstance(exc, struct.error) or "buffer" in str(exc)
        raise KvprobeError(f"{what} ({'truncated or corrupt: ' if cut else ''}{first_line(exc)})") from None
    end = max((header.data_start + t.offset + t.nbytes for t in header.tensors), default=header.data_start)
    if end > size:
        raise KvprobeError(f"{what} (truncated: {size} bytes, but its tensors need {end}); download it again")


WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.pt", "*.pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model")


def check_hf_folder(path: Path) -> None:
    """Refuse, in one line, a folder that cannot be a Hugging Face causal LM: no or invalid config.json
    (not JSON, not an object, no or an unknown model_type), no weights, no tokenizer."""
    from transformers import CONFIG_MAPPING

    config = path / "config.json"
    if not config.is_file():
        raise KvprobeError(f"{path} is not a Hugging Face model folder (no config.json)")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KvprobeError(f"{config} is not valid JSON ({first_line(exc)}); a model folder's config.json is "
                           f"a JSON object with a model_type") from None
    if not isinstance(data, dict):
        raise KvprobeError(f"{config} holds a JSON {type(data).__name__}, not an object; a model folder's "
                           f"config.json is a JSON object with a model_type")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise KvprobeError(f"{config} has no model_type; a model folder's config.json names its architecture, "
                           f"e.g. \"model_type\": \"llama\"")
    if model_type not in CONFIG_MAPPING:
        raise KvprobeError(f"{config} names model_type {model_type!r}, which transformers does not know")
    if not any(next(path.glob(g), None) for g in WEIGHT_GLOBS):
        raise KvprobeError(f"{path} has no weights (no model.safetensors, pytorch_model.bin or a shard index)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise KvprobeError(f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
