"""Fingerprints of a model's weights: one recipe, used by LoadedModel and the toy manifests."""

from __future__ import annotations

import hashlib

import torch


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over every tensor's name, shape, dtype and bytes, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy())  # the array's buffer itself: no copy
    return h.hexdigest()
