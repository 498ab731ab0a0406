"""The one way kvprobe hooks a model: registered for a ``with`` block, removed in ``finally``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

Hook = tuple[torch.nn.Module, Callable]


@contextmanager
def hooks(pre: Iterable[Hook] = (), post: Iterable[Hook] = (), with_kwargs: bool = False) -> Iterator[None]:
    """Forward pre-hooks ``pre`` and forward hooks ``post`` ((module, function) pairs) for the
    body of the block; every handle is removed when it ends, also on an exception. With
    ``with_kwargs`` the pre-hooks receive and may return the keyword arguments too."""
    handles = []
    try:
        for module, fn in pre:
            handles.append(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))
        for module, fn in post:
            handles.append(module.register_forward_hook(fn))
        yield
    finally:
        for handle in handles:
            handle.remove()
