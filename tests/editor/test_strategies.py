"""Edit strategies as typed, registered classes: the spec grammar, labels, and the run's erratum template."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvprobe.datasets import ERRATUM, SHORT_ERRATUM, align, generate
from kvprobe.errors import KvprobeError
from kvprobe.kv import cache
from kvprobe import editor
from tests.conftest import tiny_model

# the labels the edit tables carried before strategies were typed, for today's default strategies and more
LABELS = {
    "stale": "stale", "field_only": "field_only", "selective:8:attention": "selective:8:attention",
    "selective:8:random": "selective:8:random", "cacheblend:0.15": "cacheblend:0.15", "erratum": "erratum",
    "field_erratum": "field_erratum", "hoist": "hoist", "oracle": "oracle", "erratum:short": "erratum:short",
    "selective:0:causal": "selective:0:causal", "erratum:paper": "erratum", "cacheblend:0.150": "cacheblend:0.15",
}
ONE_OF_EACH = ["stale", "field_only", "selective:8:causal", "cacheblend:0.15", "erratum", "field_erratum:short",
               "erratum_turn", "field_erratum_turn:short", "hoist", "oracle", "auto:topk.yaml"]


def aligned_case():
    lm = tiny_model("tiny-llama")
    return lm, align(generate(4, seed=11)[1], lm.tokenizer, "raw")


def test_every_registered_strategy_round_trips_spec_object_spec():
    assert sorted(s.split(":")[0] for s in ONE_OF_EACH) == sorted(editor.STRATEGIES)
    for spec in ONE_OF_EACH:
        s = editor.parse_strategy(spec)
        assert type(s) is editor.STRATEGIES[s.name] and s.spec == spec and editor.parse_strategy(s.spec) == s
        assert hash(editor.parse_strategy(spec)) == hash(s)
    assert editor.Selective(8, "causal").spec == "selective:8:causal"
    assert editor.parse_strategy("erratum:NOTE: {field} is {value}.").template == "NOTE: {field} is {value}."


@pytest.mark.parametrize("spec", LABELS)
def test_labels_and_the_edit_table_columns_are_those_of_before(spec):
    s = editor.parse_strategy(spec)
    assert s.label == LABELS[spec]
    selective = spec.startswith("selective:")
    assert s.name == spec.split(":")[0]
    assert (s.k, s.ranking) == ((int(spec.split(":")[1]), spec.split(":")[2]) if selective else (None, None))


def test_strategies_are_values():
    assert editor.Erratum(ERRATUM) == editor.Erratum() == editor.parse_strategy("erratum:paper")
    assert editor.Erratum() != editor.FieldErratum() and editor.Stale() != editor.Oracle()
    assert len({editor.parse_strategy("selective:8:random"), editor.Selective(k=8, ranking="random"), editor.Hoist()}) == 2


@pytest.mark.parametrize("spec", ["selective:abc:causal", "selective:8:nope", "selective:-1:causal", "selective:8",
                                  "selective:8:causal:x", "cacheblend:0", "cacheblend:2", "cacheblend:nan",
                                  "stale:1", "oracle:", "bogus", ""])
def test_a_bad_spec_names_the_grammar_in_one_line(spec):
    with pytest.raises(KvprobeError, match="bad strategy") as err:
        editor.parse_strategy(spec)
    assert str(err.value).endswith(
        "accepted: stale, field_only, selective:K:RANKING (RANKING in causal/random/attention/recency/aggregators), "
        "cacheblend:R (0<R<=1), erratum[:paper|short], field_erratum[:paper|short], erratum_turn[:paper|short], "
        "field_erratum_turn[:paper|short], hoist, oracle, auto[:TOPK.YAML] (TOPK.YAML a policy file of this model)")


def test_a_new_strategy_is_one_class():
    @editor.register("drop_tail")
    @dataclass(frozen=True)
    class DropTail(editor.Strategy):
        """Field only, then forget the last ``n`` cache entries and feed their tokens again."""

        n: int = 1

        def __post_init__(self):
            if self.n < 1:
                raise ValueError("n >= 1")

        def apply(self, ctx):
            fixed = editor.FieldOnly().apply(ctx)
            cut = ctx.D - self.n
            return editor.Edited(cache.crop(fixed.cache, cut), ctx.a.ids_new[cut : ctx.D + 1], fixed.recomputed + self.n,
                            ctx.D + 1)

    try:
        assert "drop_tail[:N]" in editor.spec_grammar()
        assert editor.parse_strategy("drop_tail:3") == DropTail(3) and DropTail().spec == "drop_tail"
        with pytest.raises(KvprobeError, match="drop_tail"):
            editor.parse_strategy("drop_tail:0")
        lm, a = aligned_case()
        ctx = editor.make_context(lm, a)
        edited = editor.apply(ctx, "drop_tail:3")
        assert len(edited.tail_ids) == 4 and edited.recomputed == a.field[1] - a.field[0] + 3
        logits, _ = editor.decide(lm, edited)
        assert logits.shape == (lm.model.config.vocab_size,)
    finally:
        editor.STRATEGIES.pop("drop_tail")
    with pytest.raises(KvprobeError):
        editor.parse_strategy("drop_tail:3")


def test_the_runs_erratum_template_reaches_the_editor():
    """``erratum_template`` fills the template of an erratum given without one; the default keeps the labels."""
    from kvprobe.config import RunConfig

    lm, a = aligned_case()
    ctx = editor.make_context(lm, a)
    strategies = ["stale", "erratum", "field_erratum", "erratum:paper", "oracle"]
    default = RunConfig(model="tiny-llama", strategies=strategies).edit_strategies()
    assert [s.label for s in default] == ["stale", "erratum", "field_erratum", "erratum", "oracle"]
    short = RunConfig(model="tiny-llama", strategies=strategies, erratum_template="short")
    assert short.erratum_template == SHORT_ERRATUM  # the literal, which topk.yaml hands to serving
    assert [s.label for s in short.edit_strategies()] == ["stale", "erratum:short", "field_erratum:short", "erratum",
                                                          "oracle"]
    paper_tail = editor.apply(ctx, default[1]).tail_ids
    short_tail = editor.apply(ctx, short.edit_strategies()[1]).tail_ids
    assert short_tail != paper_tail and short_tail == editor.apply(ctx, "erratum:short").tail_ids
    assert "just changed" in lm.tokenizer.decode(paper_tail) and "just changed" not in lm.tokenizer.decode(short_tail)
    literal = RunConfig(model="tiny-llama", strategies=["erratum"], erratum_template="{field} overrides {value}")
    (erratum,) = literal.edit_strategies()
    assert erratum == editor.Erratum("{field} overrides {value}")
    assert editor.apply(ctx, erratum).tail_ids not in (paper_tail, short_tail)
