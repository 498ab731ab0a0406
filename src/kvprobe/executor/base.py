"""The executors' common ground: :class:`Context` (what a task gets in the process that runs it),
:class:`Executor` (``each``, ``map``, a context manager) and :class:`Serial`, kvprobe's default.
The package's docstring (:mod:`kvprobe.executor`) says how every command uses them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pandas as pd

EXECUTORS = ("serial", "ray")


class Context:
    """What a task gets in the process that runs it: the model (``lm``) and :meth:`keep` for per-process
    state a task reuses across items (the probes' caches of each case, a shared prefix). ``kept`` hands
    in state the driver already holds (a serial run shares its own; a Ray worker builds its own)."""

    def __init__(self, lm, **kept):
        self.lm = lm
        self.memo: dict[str, Any] = dict(kept)

    def keep(self, name: str, build: Callable[[Any], Any]):
        """``build(lm)`` the first time ``name`` is asked for in this process, the same object after."""
        if name not in self.memo:
            self.memo[name] = build(self.lm)
        return self.memo[name]


class Executor:
    """What every executor has: :meth:`each` (its own), :meth:`map` over it, and a context manager
    that calls :meth:`close` at its end."""

    name = ""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass

    def each(self, store, items: Iterable, fn: Callable, ctx: Context, times: dict | None = None) -> Iterator:
        raise NotImplementedError

    def map(self, store, items: Iterable, fn: Callable, ctx: Context, on_done: Callable[[], None] = lambda: None,
            times: dict | None = None) -> pd.DataFrame:
        """:meth:`each` over every item, ``on_done()`` after each; the frames concatenated in order."""
        frames = []
        for _, df, _ in self.each(store, items, fn, ctx, times):
            frames.append(df)
            on_done()
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


class Serial(Executor):
    """Each item computed here, in order (kvprobe's default; what every command did before)."""

    name = "serial"
    workers = 1

    def __init__(self):
        self.wasted = 0  # never: nothing is computed ahead
        self.computed = 0

    def describe(self, since: dict | None = None) -> dict:
        return {"executor": self.name, "workers": 1}

    def each(self, store, items: Iterable, fn: Callable, ctx: Context, times: dict | None = None) -> Iterator:
        """For each ``(key, item)``: yields ``(key, frame, resumed)``, the frame read from ``store``'s
        part (a :class:`kvprobe.results.CaseStore`, or None: nothing kept) or computed by
        ``fn(ctx, item)`` and saved before it is yielded; ``times`` gets each computed item's seconds."""
        for key, item in items:
            df = store.get(key) if store is not None else None
            resumed = df is not None
            if df is None:
                start = time.perf_counter()
                df = fn(ctx, item)
                self.computed += 1
                if times is not None:
                    times[key] = time.perf_counter() - start
                if store is not None:
                    store.save(key, df)
            yield key, df, resumed
