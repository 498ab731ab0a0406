"""The caches a repair builds (kvprobe.editor.states): each leaves the cache it is given as it was, and they are
the one home of those states: the edit strategies and kvprobe memory's arms both build on them (issue 51)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import kvprobe
from kvprobe.editor import states
from kvprobe.kv import cache as kvcache
from tests.conftest import ids_of, tiny_model


def _tensors(cache):
    return [(k.clone(), v.clone()) for k, v in kvcache.to_tensors(cache)]


def _same(a, b, atol=0.0):
    return all(torch.allclose(k1, k2, atol=atol, rtol=0) and torch.allclose(v1, v2, atol=atol, rtol=0)
               for (k1, v1), (k2, v2) in zip(a, b))


def test_appended_is_a_prefill_of_both_and_leaves_its_base():
    lm = tiny_model("tiny-llama")
    ids = ids_of(30, lm.model.config.vocab_size, seed=3)[0].tolist()
    base = states.prefilled(lm, ids[:20])
    before = _tensors(base)
    grown = states.appended(lm, base, ids[20:])
    assert kvcache.seq_len(grown) == 30 and kvcache.seq_len(base) == 20
    assert _same(_tensors(base), before)  # the base is as it was
    assert _same(kvcache.to_tensors(grown), kvcache.to_tensors(states.prefilled(lm, ids)), atol=1e-5)


def test_recomputed_from_the_first_changed_position_on_is_a_prefill_and_leaves_its_base():
    lm = tiny_model("tiny-llama")
    old = ids_of(24, lm.model.config.vocab_size, seed=4)[0].tolist()
    new = old[:10] + [t + 1 for t in old[10:13]] + old[13:]
    base = states.prefilled(lm, old)
    before = _tensors(base)
    fixed = states.recomputed(lm, base, new, list(range(10, 24)))
    assert _same(_tensors(base), before)
    assert _same(kvcache.to_tensors(fixed), kvcache.to_tensors(states.prefilled(lm, new)), atol=1e-5)


BUILDS = ("kvcache.prefill", "kvcache.forward", "kvcache.new_cache", "recompute_positions")


def _builders(path: Path) -> dict[str, list[str]]:
    """Per function or method of a module: the cache-building calls it makes itself."""
    found: dict[str, list[str]] = {}

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                visit(child, f"{scope}.{child.name}".lstrip("."))
                continue
            if isinstance(child, ast.Call):
                f = child.func
                name = (f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                        else getattr(f, "id", ""))
                if name in BUILDS:
                    found.setdefault(scope, []).append(name)
            visit(child, scope)

    visit(ast.parse(path.read_text()), "")
    return found


def test_memory_and_the_strategies_build_no_cache_themselves():
    """memory/runner.py once re-implemented the oracle's, the erratum's and field_only's states; now it and
    editor/strategies.py call kvprobe.editor.states for every prefill, appended line and recomputation. The one
    forward left is cacheblend's check-layer pass, stopped part-way: a measurement, not a state."""
    src = Path(kvprobe.__file__).parent
    assert _builders(src / "memory" / "runner.py") == {}
    assert _builders(src / "editor" / "strategies.py") == {"CacheBlend.apply": ["kvcache.new_cache",
                                                                                "kvcache.forward"]}
