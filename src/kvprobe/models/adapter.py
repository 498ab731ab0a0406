"""Family adapters: the one place that knows HF module paths and config keys.

Each family is a small YAML file in ``families/``. Probes and the KV layer ask the adapter
("where are the layers", "how many kv heads", "which layers slide", "what RoPE base does layer
i use") and never spell ``self_attn.k_proj`` themselves.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

from kvprobe.errors import KvprobeError

ROPE_TYPES_SUPPORTED = ("default", "linear", "llama3", "yarn")


def _get(obj: Any, dotted: str) -> Any:
    """Read ``a.b.c`` through attributes or dict keys; ``None`` when any part is missing."""
    for part in dotted.split("."):
        if obj is None:
            return None
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
    return obj


@dataclass(frozen=True)
class Family:
    """A family's data file, as loaded."""

    family: str
    model_types: tuple[str, ...]
    causal_lm_class: str
    config_class: str
    layers: str
    embed: str
    final_norm: str
    lm_head: str
    attention: str
    proj: dict
    k_norm: str | None
    keys: dict
    rope: dict
    sliding: dict | None
    tiny: dict
    toy: dict | None = None  # the toy model's config overrides (absent: no toy for this family)


FAMILY_PATH = "KVPROBE_FAMILY_PATH"  # more folders of family files, separated like PATH


def _family_files() -> list:
    packaged = resources.files("kvprobe.models") / "families"  # read as a folder, not imported as a package
    files = sorted((e for e in packaged.iterdir() if e.name.endswith(".yaml")), key=lambda e: e.name)
    for folder in filter(None, os.environ.get(FAMILY_PATH, "").split(os.pathsep)):
        files += sorted(Path(folder).glob("*.yaml"))
    return files


@functools.cache
def families() -> dict[str, Family]:
    """All family data files, by family name: the package's, then those in ``$KVPROBE_FAMILY_PATH``
    (a user's own family without editing kvprobe; :func:`families.cache_clear` rereads them)."""
    out = {}
    for entry in _family_files():
        try:
            data = yaml.safe_load(entry.read_text())
            data["model_types"] = tuple(data["model_types"])
            out[data["family"]] = Family(**data)
        except (yaml.YAMLError, TypeError, KeyError) as exc:
            raise KvprobeError(f"{entry} is not a family file ({type(exc).__name__}: {exc}); "
                               f"see src/kvprobe/models/families/llama.yaml for the keys") from None
    return out


def family_for_model_type(model_type: str) -> Family:
    for fam in families().values():
        if model_type in fam.model_types:
            return fam
    supported = sorted(t for f in families().values() for t in f.model_types)
    raise KvprobeError(f"unsupported architecture {model_type!r}; supported model types: {', '.join(supported)}")


@dataclass(frozen=True)
class Adapter:
    """A family bound to one model's config: head layout, RoPE and sliding-window facts."""

    family: Family
    config: Any  # the decoder's PretrainedConfig

    @classmethod
    def for_config(cls, config: Any) -> "Adapter":
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        return cls(family_for_model_type(text.model_type), text)

    # -- head layout ---------------------------------------------------------------------
    def _key(self, name: str) -> Any:
        return getattr(self.config, self.family.keys[name], None)

    @property
    def n_layers(self) -> int:
        return int(self._key("layers"))

    @property
    def n_heads(self) -> int:
        return int(self._key("heads"))

    @property
    def n_kv_heads(self) -> int:
        kv = self._key("kv_heads")
        n = int(kv) if kv is not None else self.n_heads
        assert self.n_heads % n == 0, "query heads must be a multiple of kv heads (GQA)"
        return n

    @property
    def head_dim(self) -> int:
        hd = self._key("head_dim")
        return int(hd) if hd else int(self._key("hidden")) // self.n_heads

    @property
    def hidden(self) -> int:
        return int(self._key("hidden"))

    # -- modules -------------------------------------------------------------------------
    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        return _get(model, self.family.layers)

    def attention(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        return getattr(self.layers(model)[layer], self.family.attention)

    def proj(self, model: torch.nn.Module, layer: int, which: str) -> torch.nn.Module:
        """One of the attention projections: ``which`` in q, k, v, o."""
        return getattr(self.attention(model, layer), self.family.proj[which])

    def embed(self, model: torch.nn.Module) -> torch.nn.Module:
        return _get(model, self.family.embed)

    def final_norm(self, model: torch.nn.Module) -> torch.nn.Module:
        return _get(model, self.family.final_norm)

    def lm_head(self, model: torch.nn.Module) -> torch.nn.Module:
        return _get(model, self.family.lm_head)

    # -- sliding window ------------------------------------------------------------------
    @property
    def window(self) -> int | None:
        """The sliding window in tokens, or None when no layer slides."""
        sl = self.family.sliding
        if not sl:
            return None
        if "enabled" in sl and not getattr(self.config, sl["enabled"], False):
            return None
        w = getattr(self.config, sl["window"], None)
        return int(w) if w else None

    def sliding_layers(self) -> list[bool]:
        """Per layer: does it attend through a sliding window?"""
        if self.window is None:
            return [False] * self.n_layers
        types = getattr(self.config, self.family.sliding.get("layer_types", "") or "", None)
        if types:
            return [t == "sliding_attention" for t in types[: self.n_layers]]
        return [True] * self.n_layers

    # -- RoPE ----------------------------------------------------------------------------
    def rope_parameters(self, layer: int) -> dict:
        """The rotary parameters layer ``layer`` uses (theta, type, scaling), as a plain dict."""
        params = getattr(self.config, "rope_parameters", None) or {}
        if "local_theta" in self.family.rope:  # two bases: per layer type
            kind = "sliding_attention" if self.sliding_layers()[layer] else "full_attention"
            params = params.get(kind, params)
        params = dict(params)
        params.setdefault("rope_type", "default")
        params.setdefault("partial_rotary_factor", getattr(self.config, "partial_rotary_factor", 1.0) or 1.0)
        if params["rope_type"] not in ROPE_TYPES_SUPPORTED:
            raise KvprobeError(f"unsupported RoPE type {params['rope_type']!r} in {self.family.family}; "
                               f"supported: {', '.join(ROPE_TYPES_SUPPORTED)} (dynamic scaling depends on length and is refused)")
        return params

    def attention_masks(self, build) -> dict | "torch.Tensor":
        """What this model's forward takes as ``attention_mask`` for a custom mask.

        ``build(window)`` returns a 4D additive mask for a window (None: full attention). Models
        with per-layer types take a dict by layer type; the others take one tensor (with the
        window applied when every layer slides, as in Mistral).
        """
        if getattr(self.config, "layer_types", None):
            kinds = set(self.config.layer_types[: self.n_layers])
            return {kind: build(self.window if kind == "sliding_attention" else None) for kind in kinds}
        return build(self.window)

    @property
    def has_k_norm(self) -> bool:
        return self.family.k_norm is not None
