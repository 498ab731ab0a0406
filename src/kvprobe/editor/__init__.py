"""The KV editor: repair a prefilled cache of the old prompt after one field changed.

Every strategy starts from the same thing a serving engine holds: the cache of the old prompt
``ids_old[:D]`` (D = the decision position; the decision token itself is fed at read time), and
returns an :class:`~kvprobe.kv.decode.Edited` state: a cache, the tokens still to feed, and what
it cost. :func:`decide` feeds those tokens and reads the decision logits.

    ctx = make_context(lm, aligned_case)            # the old prompt's cache, prefilled once
    fixed = apply(ctx, "erratum")                   # or Selective(8, "causal"), "cacheblend:0.15", ...
    logits, _ = decide(lm, fixed)                   # cot_tokens=N reasons first

Rooms: :mod:`.context` (what a strategy starts from), :mod:`.strategies` (the typed, registered
strategies and their spec grammar), :mod:`.auto` (the strategy that chooses among them per edit,
and the policy files it reads), :mod:`.rankings` (how ``selective`` picks positions),
:mod:`.causal_rule` (the ranking learned from the locality probe), :mod:`.score` (a repaired
state scored against the stale and oracle reads: the one row builder of every such table),
:mod:`.runner` (strategies over cases, tabulated against the oracle), :mod:`.topk` (the per-model
top-K export).
"""

from kvprobe.editor.context import EditContext, make_context
from kvprobe.editor.rankings import RANKINGS, attention_by_position, rank_downstream
from kvprobe.defaults import DEFAULT_STRATEGIES
from kvprobe.editor.runner import edit_case, run_edits
from kvprobe.editor.strategies import (STRATEGIES, CacheBlend, Erratum, FieldErratum, FieldOnly, Hoist, Oracle,
                                       Selective, Stale, Strategy, apply, parse_strategy, register, spec_grammar)
from kvprobe.editor.auto import Auto, check_policies, load_policy  # registers auto, after the others (I001)
from kvprobe.kv.decode import COT_CUE, Edited, decide, decide_many
from kvprobe.kv.recompute import recompute_positions

__all__ = ["COT_CUE", "DEFAULT_STRATEGIES", "RANKINGS", "STRATEGIES", "Auto", "CacheBlend", "EditContext", "Edited",
           "Erratum", "FieldErratum", "FieldOnly", "Hoist", "Oracle", "Selective", "Stale", "Strategy", "apply",
           "check_policies", "load_policy", "decide", "decide_many", "attention_by_position", "edit_case",
           "make_context", "parse_strategy", "rank_downstream", "recompute_positions", "register", "run_edits",
           "spec_grammar"]
