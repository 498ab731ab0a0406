"""Family adapters: the one place that knows HF module paths and config keys.

Each family is a small YAML file in ``families/``. Probes and the KV layer ask the adapter
("where are the layers", "how many kv heads", "which layers slide", "what RoPE base does layer
i use") and never spell ``self_attn.k_proj`` themselves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import yaml
from pydantic import Field

from kvprobe.catalog import FAMILY_PATH, family_files
from kvprobe.errors import KvprobeError
from kvprobe.schema import File, Text, validate

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
    mla: dict | None = None  # multi-head latent attention: the config keys of its cache (see _Mla)
    rotary_class: str | None = None  # the RoPE module's class, where it is not <Model>RotaryEmbedding


HINT = "see src/kvprobe/models/families/llama.yaml for the keys"


class _Proj(File):
    q: Text
    k: Text
    v: Text
    o: Text


class _Keys(File):
    """The config keys of the head layout (``vocab`` is informative)."""

    layers: Text
    heads: Text
    kv_heads: Text
    head_dim: Text
    hidden: Text
    vocab: Text | None = None


class _Rope(File):
    style: Text
    theta: Text
    local_theta: Text | None = None  # a second base, for the sliding layers (Gemma-3)


class _Mla(File):
    """Multi-head latent attention (DeepSeek-V2/V3): what each cache slot holds. The key slot holds
    the compressed latent (``latent``: its width's config key; one entry per position, no position
    in it) and the value slot the decoupled rotary key part (``rope_dim``), shared by every head;
    the per-head keys and values are expanded from them at every forward."""

    latent: Text
    rope_dim: Text


class _Sliding(File):
    window: Text
    enabled: Text | None = None  # a config key that turns the window on (Qwen)
    layer_types: Text | None = None


class FamilyFile(File):
    """A family YAML: every key and what it accepts (module paths and config keys are strings)."""

    family: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
    model_types: Annotated[list[Text], Field(min_length=1)]
    causal_lm_class: Text
    config_class: Text
    layers: Text
    embed: Text
    final_norm: Text
    lm_head: Text
    attention: Text
    proj: _Proj
    k_norm: Text | None
    keys: _Keys
    rope: _Rope
    sliding: _Sliding | None
    tiny: dict[str, Any]
    toy: dict[str, Any] | None = None
    mla: _Mla | None = None
    rotary_class: Text | None = None


def read_family(entry) -> Family:
    """One family file, checked against :class:`FamilyFile`; a file that is not one (unreadable, not
    UTF-8, not YAML, empty, not a mapping, a key missing, unknown or of the wrong type) is a one-line
    :class:`KvprobeError` naming it."""
    if not entry.is_file():
        raise KvprobeError(f"{entry} is not a family file (it is not a regular file); move it out of "
                           f"${FAMILY_PATH}'s folders")
    try:
        data = yaml.safe_load(entry.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc.strerror or str(exc)
        raise KvprobeError(f"{entry} cannot be read as a family file ({why}); {HINT}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise KvprobeError(f"{entry} is not a family file (not valid YAML: {where}"
                           f"{getattr(exc, 'problem', None) or exc}); {HINT}") from None
    if not isinstance(data, dict):
        got = "it is empty" if data is None else f"it holds a {type(data).__name__}, not a mapping of keys"
        raise KvprobeError(f"{entry} is not a family file ({got}); {HINT}")
    fam = validate(FamilyFile, data, entry, "family file", HINT)
    return Family(**{**fam.model_dump(exclude_unset=True), "model_types": tuple(fam.model_types)})


def _family_of(name: str, entry, builtin: bool) -> str:
    return f"the built-in family {name!r}" if builtin else f"the family {name!r} of {entry}"


@functools.cache
def families() -> dict[str, Family]:
    """All family data files, by family name: the package's, then those in ``$KVPROBE_FAMILY_PATH``
    (a user's own family without editing kvprobe; :func:`families.cache_clear` rereads them).

    Each file is checked (:func:`read_family`). A user file may add a family, not replace one: a
    family name or a model type that an earlier file already has is refused in one line naming
    both files."""
    out: dict[str, Family] = {}
    where: dict[str, tuple] = {}  # family name -> (file, builtin)
    for entry, builtin in family_files():
        fam = read_family(entry)
        if fam.family in out:
            raise KvprobeError(f"{entry} names {_family_of(fam.family, *where[fam.family])}; a family file may add "
                               f"a family, not replace one: give it another family name")
        for other in out.values():
            taken = sorted(set(fam.model_types) & set(other.model_types))
            if taken:
                raise KvprobeError(f"{entry} claims model type {taken[0]!r}, which "
                                   f"{_family_of(other.family, *where[other.family])} already reads; a model type "
                                   f"belongs to one family")
        out[fam.family] = fam
        where[fam.family] = (entry, builtin)
    return out


# Model types whose attention or position scheme kvprobe has no verified path for, and what it is:
# named in the refusal, so that a user knows it is the scheme, not a missing data file.
UNSUPPORTED_SCHEMES = {
    **dict.fromkeys(("bloom", "mpt", "falcon", "baichuan"), "ALiBi position biases, with no rotary keys to re-rotate"),
    **dict.fromkeys(("deepseek_v2", "deepseek_v32", "kimi_k2"),  # deepseek_v3's MLA is supported (its family file)
                    "multi-head latent attention (MLA) of a variant kvprobe has not verified (V2's own code, V3.2's "
                    "sparse attention, Kimi's)"),
    **dict.fromkeys(("qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text"),  # qwen2_vl's is supported
                    "M-RoPE (three-axis positions) of a variant kvprobe has not verified"),
}


def family_for_model_type(model_type: str) -> Family:
    for fam in families().values():
        if model_type in fam.model_types:
            return fam
    supported = sorted(t for f in families().values() for t in f.model_types)
    why = f": {UNSUPPORTED_SCHEMES[model_type]}, which kvprobe has no verified cache edit or re-rotation for" \
        if model_type in UNSUPPORTED_SCHEMES else ""
    raise KvprobeError(f"unsupported architecture {model_type!r}{why}; supported model types: {', '.join(supported)}")


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

    # -- the cache's two slots -------------------------------------------------------------
    @property
    def rotated_slot(self) -> int:
        """Which slot of a cache layer holds the rotated keys: 0 (keys) for every family but
        multi-head latent attention, whose keys slot holds the position-free latent and whose
        values slot the rotary key part (1)."""
        return 1 if self.family.mla else 0

    @property
    def cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, dim) of the keys slot and of the values slot, as the cache stores them."""
        if self.family.mla:
            return (1, int(getattr(self.config, self.family.mla["latent"]))), \
                (1, int(getattr(self.config, self.family.mla["rope_dim"])))
        return (self.n_kv_heads, self.head_dim), (self.n_kv_heads, self.head_dim)

    @property
    def rotary_room(self) -> int:
        """The dims of the rotated slot: at most this many rotate (partial RoPE: fewer)."""
        return self.cache_dims[self.rotated_slot][1]

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

    def check_window(self) -> None:
        """Refuse a model whose config sets a sliding window its family file does not declare: kvprobe
        builds its own attention masks from the family's window, so it would attend past the window
        the model was trained with, silently."""
        window = getattr(self.config, "sliding_window", None)
        if window and self.family.sliding is None and getattr(self.config, "use_sliding_window", True) is not False:
            raise KvprobeError(f"{self.config.model_type} sets a sliding window of {window} tokens that the family "
                               f"file of {self.family.family!r} does not declare (no sliding:), so kvprobe cannot keep "
                               f"it; add sliding: {{window: sliding_window}} to that file")

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
                               f"supported: {', '.join(ROPE_TYPES_SUPPORTED)} (dynamic scaling depends on length and "
                               f"is refused)")
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
