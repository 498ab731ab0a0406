"""Which model a serving benchmark talks about: a spec kvprobe knows, the identity of its weights (a
bundled file's hash, or the spec), its tokenizer (for prompt lengths), and the name the server
serves it under.
"""

from __future__ import annotations

from pathlib import Path

from kvprobe.errors import EnvironmentProblem, UsageError
from kvprobe.serving.client import served_models


def check_model(model: str) -> None:
    """A one-line error unless ``model`` is a bundled alias or a local Hugging Face folder (fetches nothing)."""
    from kvprobe.models import bundled

    if model not in bundled.BUNDLED and not (Path(model).expanduser() / "config.json").exists():
        raise UsageError(f"unknown model {model!r}; accepted: a bundled alias ({', '.join(bundled.BUNDLED)}) "
                         f"or a local Hugging Face folder")


def weights_identity(model: str) -> str:
    """What the served weights are: a bundled alias's GGUF checksum, or a sha256 over a local
    folder's config and weight files (their bytes)."""
    import hashlib

    from kvprobe.models import bundled

    if model in bundled.BUNDLED:
        return f"gguf:{bundled.BUNDLED[model].sha256[:16]}"
    folder = Path(model).expanduser()
    h = hashlib.sha256()
    for f in sorted([folder / "config.json", *folder.glob("*.safetensors"), *folder.glob("*.bin")]):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return f"files:{h.hexdigest()[:16]}"


def load_tokenizer(model: str):
    """The tokenizer of a bundled alias (its tokenizer fetched once if needed, no weights) or of a
    local Hugging Face folder."""
    from transformers import AutoTokenizer

    from kvprobe.models import bundled

    check_model(model)
    folder = bundled.fetch_tokenizer(model) if model in bundled.BUNDLED else Path(model).expanduser()
    return AutoTokenizer.from_pretrained(folder)


def pick_served(url: str, model: str) -> str:
    """The server's name for ``model``: the alias itself, or the only model it serves."""
    names = served_models(url)
    if model in names or Path(model).name in names:
        return model if model in names else Path(model).name
    if len(names) == 1:
        return names[0]
    raise EnvironmentProblem(f"the server at {url} serves {names or 'no model'}, not {model!r}; "
                             f"start it with --served-model-name {model}")
