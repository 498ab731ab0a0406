"""kvprobe: probe, edit and compose a language model KV cache."""
__version__ = "0.1.0"
