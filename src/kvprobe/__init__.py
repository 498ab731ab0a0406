"""kvprobe: probe, edit and compose a language model KV cache.

The front door (docs/api.md)::

    import kvprobe
    lm = kvprobe.load("qwen2.5-1.5b")           # a spec, a transformers model + tokenizer, or nnsight's LanguageModel
    ctx = kvprobe.EditableContext(lm)
    ...

``load``, ``EditableContext``, ``EditState``, ``diagnose_case`` and ``policy`` are imported on first use,
so ``import kvprobe`` (and the command line's help) stays fast; ``dir(kvprobe)`` lists them all the same.
"""

__version__ = "0.1.0"
__all__ = ["EditState", "EditableContext", "diagnose_case", "load", "policy"]
_API = ("EditState", "EditableContext", "diagnose_case", "load")


def __getattr__(name: str):
    import importlib

    if name in _API:
        return getattr(importlib.import_module("kvprobe.api"), name)
    if name == "policy":
        return importlib.import_module("kvprobe.policy")
    raise AttributeError(f"module 'kvprobe' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy exports too, so that tab completion lists them."""
    return sorted({*globals(), *__all__})
