"""Tiny random models of every family, built from config with a fixed seed.

Hidden 64, 2 layers, 4 query heads and 2 kv heads (so GQA is exercised), eager attention, and
the word-level tokenizer over the dataset generator's vocabulary. They are for exact mechanics
tests: they decide nothing.
"""

from __future__ import annotations

import functools

import torch
import transformers

from kvprobe.datasets import vocabulary
from kvprobe.datasets.words import build_word_tokenizer
from kvprobe.errors import UsageError
from kvprobe.models.adapter import families

TINY_SEED = 1234

# Extra variants beyond "tiny-<family>": name -> (family, config overrides).
TINY_VARIANTS: dict[str, tuple[str, dict]] = {
    "tiny-llama3": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    # YaRN: NTK-by-parts frequencies and an attention factor (mscale) on cos and sin, which a
    # re-rotation must not apply again (kvprobe.models.rope)
    "tiny-llama-yarn": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 256}}),
}


def tiny_names() -> list[str]:
    return [f"tiny-{f}" for f in families()] + list(TINY_VARIANTS)


@functools.cache
def word_tokenizer():
    """The shared word-level tokenizer of tiny and toy models (generator vocabulary)."""
    return build_word_tokenizer(vocabulary())


def tiny_config(name: str, vocab_size: int, **overrides):
    """The HF config of a tiny model; ``overrides`` replace family defaults (toys use this)."""
    if name in TINY_VARIANTS:
        fam_name, extra = TINY_VARIANTS[name]
    elif name.startswith("tiny-") and name[5:] in families():
        fam_name, extra = name[5:], {}
    else:
        raise UsageError(f"unknown tiny model {name!r}; known: {', '.join(tiny_names())}")
    fam = families()[fam_name]
    kwargs = {**fam.tiny, **extra, **overrides}
    ids = {"vocab_size": vocab_size, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}
    if "text_config" in kwargs:  # a multimodal model: the decoder's settings nest under text_config
        kwargs["text_config"] = {**kwargs["text_config"], **ids}
        kwargs = {k: (vocab_size + v if k.endswith("_token_id") and isinstance(v, int) and v < 0 else v)
                  for k, v in kwargs.items()}  # the image tokens: the vocabulary's last ids (-1, -2, ...)
        kwargs["tie_word_embeddings"] = False
    else:
        kwargs.update(ids, tie_word_embeddings=False)
    config = getattr(transformers, fam.config_class)(**kwargs)
    config._attn_implementation = "eager"
    return config


def build_tiny(name: str, tokenizer=None, seed: int = TINY_SEED, **overrides):
    """(model, tokenizer) for a tiny random model, identical for the same name and seed."""
    tokenizer = tokenizer or word_tokenizer()
    config = tiny_config(name, len(tokenizer), **overrides)
    fam = families()[name[5:] if name[5:] in families() else TINY_VARIANTS[name][0]]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = getattr(transformers, fam.causal_lm_class)(config)
    return model.to(torch.float32).eval(), tokenizer
