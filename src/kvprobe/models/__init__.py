"""The adapter layer: the only code that names Hugging Face modules or config keys."""

from kvprobe.models.adapter import Adapter, families, family_for_model_type
from kvprobe.models.bundled import BUNDLED, fetch, is_cached
from kvprobe.models.load import LoadedModel, ModelInfo, load_model
from kvprobe.models.tiny import build_tiny, tiny_names

__all__ = ["Adapter", "BUNDLED", "LoadedModel", "ModelInfo", "build_tiny", "families",
           "family_for_model_type", "fetch", "is_cached", "load_model", "tiny_names"]
