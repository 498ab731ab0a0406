"""Toy model folders: the six shipped toys, their architecture and manifests, checked loading.

A toy folder is an ordinary Hugging Face folder (config, safetensors, word-level tokenizer) with
a training manifest (:data:`TOY_MANIFEST`: recipe, held-out figures, the CPU it was trained on, and a
sha256 of the weights). ``toy-<family>`` is the folder shipped inside the package (seed 0 of the
recipe in :mod:`kvprobe.toys`), so every machine loads the same weights; a folder made by
``kvprobe toy train`` loads by its path. Loading checks the weights against the manifest and
refuses a toy whose manifest records a failed held-out check unless asked.

Architecture: :data:`TOY_ARCH` for every family, plus the family's ``toy:`` overrides in its data
file (sliding windows, Gemma's query scale), so a new family is one YAML file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError

from kvprobe.errors import KvprobeError, UsageError
from kvprobe.models.adapter import families
from kvprobe.models.fingerprint import weights_sha256
from kvprobe.models.quiet import first_line, quiet_hf
from kvprobe.models.tiny import tiny_config
from kvprobe.paths import models_dir

TOY_MANIFEST = "toy_manifest.json"
TOY_SEED = 0
# The shared architecture; each family's data file adds its own ``toy:`` overrides.
TOY_ARCH: dict[str, Any] = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


def toy_families() -> list[str]:
    """Families whose data file describes a toy."""
    return sorted(name for name, fam in families().items() if fam.toy is not None)


def toy_family(spec: str) -> str:
    """``toy-qwen3`` -> ``qwen3``; an unknown family is a :class:`KvprobeError` listing them."""
    fam = spec[4:] if spec.startswith("toy-") else spec
    if fam not in toy_families():
        known = ", ".join(f"toy-{f}" for f in toy_families())
        raise UsageError(f"unknown toy model {spec!r}; known: {known}")
    return fam


def toy_arch(family: str, arch: dict | None = None) -> dict[str, Any]:
    """The toy's config overrides: :data:`TOY_ARCH`, the family's, then ``arch`` (tests shrink it)."""
    return {**TOY_ARCH, **families()[toy_family(family)].toy, **(arch or {})}


def toy_config(family: str, vocab_size: int, arch: dict | None = None):
    """The HF config of ``toy-<family>`` (``arch`` replaces parts of it, for tests)."""
    family = toy_family(family)
    overrides = toy_arch(family, arch)
    n = overrides["num_hidden_layers"]
    if "layer_types" in overrides and len(overrides["layer_types"]) != n:  # a reduced depth: keep the pattern
        pattern = families()[family].toy["layer_types"]
        overrides["layer_types"] = [pattern[i % len(pattern)] for i in range(n)]
    return tiny_config(f"tiny-{family}", vocab_size, **overrides)


def toy_dir(family: str) -> Path:
    """Where ``kvprobe toy train`` saves a retrained toy by default (the shipped one is :func:`shipped_dir`)."""
    return models_dir() / f"toy-{toy_family(family)}"


# The six toys ship inside the package (seed 0 of the recipe, trained once and checked here), so
# ``toy-<family>`` loads the same weights on every machine. ``kvprobe toy train`` writes a retrained
# toy to $KVPROBE_HOME/models/toy-<family>/ (or --out); load that one by its folder path.
SHIPPED = Path(__file__).parent / "toys"  # data only: one folder per shipped toy


def shipped_dir(family: str) -> Path:
    """The folder of the shipped ``toy-<family>`` inside the package."""
    return SHIPPED / f"toy-{toy_family(family)}"


def read_manifest(folder: Path) -> dict | None:
    """A toy folder's manifest (None when it has none); a corrupt one is a :class:`KvprobeError`."""
    path = Path(folder) / TOY_MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KvprobeError(f"{path} is not a readable toy manifest ({type(exc).__name__}); "
                           f"retrain the toy with `kvprobe toy train --force`") from None
    if not isinstance(manifest, dict) or not {"family", "weights_sha256"} <= set(manifest):
        raise KvprobeError(f"{path} is not a toy manifest (it needs family and weights_sha256); "
                           f"retrain the toy with `kvprobe toy train --force`")
    if manifest["family"] not in toy_families():
        raise KvprobeError(f"{path} names family {manifest['family']!r}, which has no toy; known: "
                           f"{', '.join(toy_families())}; retrain the toy with `kvprobe toy train --force`")
    failures = manifest.get("heldout_failures")
    if not isinstance(manifest["weights_sha256"], str) or not (failures is None or isinstance(failures, list)):
        raise KvprobeError(f"{path} is not a toy manifest (weights_sha256 must be a string, heldout_failures a "
                           f"list); retrain the toy with `kvprobe toy train --force`")
    return manifest


def _note(manifest: dict, where: str) -> str:
    h = manifest.get("heldout", {})
    if "acc_old" not in h:
        return f"toy model {where} on the field-edit task"
    acc = min(h["acc_old"], h["acc_new"])
    return f"toy model {where} on the field-edit task; held-out acc {acc:.2f}, erratum {h['acc_erratum']:.2f}"


def load_toy_folder(folder: Path | str, *, allow_failed: bool = False):
    """(model, tokenizer, note) from a toy folder, checked against its manifest.

    Refused in one line: a folder without a readable manifest, weights whose hash differs from
    the manifest's, and (unless ``allow_failed``) a toy whose manifest records a held-out failure.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        raise KvprobeError(f"{folder} has no {TOY_MANIFEST}; a toy folder is made by `kvprobe toy train`")
    family = toy_family(manifest["family"])
    failures = manifest.get("heldout_failures") or []
    if failures and not allow_failed:
        raise KvprobeError(f"{folder} failed its own held-out check ({'; '.join(failures)}); retrain it with "
                           f"`kvprobe toy train --family {family} --seed N --force`, use the shipped toy-{family}, "
                           f"or pass --allow-failed-toy to use it anyway")
    cls = getattr(transformers, families()[family].causal_lm_class)
    try:
        with quiet_hf():
            model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
            # Not AutoTokenizer: for model type qwen2 it swaps in Qwen2Tokenizer, whose own pre-tokenizer
            # splits words differently from the word-level tokenizer the toy was trained with.
            tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
        raise KvprobeError(f"{folder} does not load as a toy model ({first_line(exc)}); "
                           f"retrain it with `kvprobe toy train --family {family} --force`") from None
    if weights_sha256(model) != manifest["weights_sha256"]:
        raise KvprobeError(f"{folder} does not match its {TOY_MANIFEST} (weights hash differs); "
                           f"retrain it with `kvprobe toy train --family {family} --force`")
    where = "shipped with kvprobe, trained" if folder.resolve().parent == SHIPPED.resolve() else "trained"
    return model, tokenizer, _note(manifest, where) + (f"; FAILED {'; '.join(failures)}" if failures else "")


def load_toy(spec: str, *, allow_failed: bool = False):
    """(model, tokenizer, note) for the shipped ``toy-<family>``, checked against its manifest."""
    folder = shipped_dir(spec)
    if not (folder / TOY_MANIFEST).exists():
        raise KvprobeError(f"the shipped {spec} is missing from the package ({folder}); reinstall kvprobe, or "
                           f"train one with `kvprobe toy train --family {toy_family(spec)}` and pass its folder")
    return load_toy_folder(folder, allow_failed=allow_failed)


def toy_rows() -> list[tuple[str, ...]]:
    """Rows (name, family, params, download, cached, notes) for ``kvprobe models``."""
    rows = []
    for family in toy_families():
        manifest = read_manifest(shipped_dir(family))
        if manifest is None:
            rows.append((f"toy-{family}", family, "-", "-", "missing", "the shipped toy is missing; reinstall kvprobe"))
            continue
        rows.append((f"toy-{family}", family, f"{manifest['n_params'] / 1e6:.1f}M", "-", "shipped",
                     _note(manifest, "shipped with kvprobe, trained")))
    return rows
