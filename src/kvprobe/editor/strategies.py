"""The edit strategies: typed, registered classes, and what they work on.

Every strategy starts from the cache of the old prompt ``ids_old[:D]`` (an :class:`EditContext`)
and returns an :class:`Edited` state. The strategies (the paper's, plus controls)::

    stale            the old cache as it is
    field_only       recompute the field span only (downstream notes stay stale)
    selective        the field plus K downstream positions chosen by a ranking
    cacheblend       recompute the fraction r of positions with the largest KV deviation at a
                     check layer (the CacheBlend baseline; the check-layer pass is counted)
    erratum          keep the old cache, append a correction line and re-ask
    field_erratum    field_only, then the erratum
    erratum_turn     the erratum as a new turn after the whole old prompt (the serving case)
    field_erratum_turn  field_only, then the erratum as a new turn
    hoist            the prompt rewritten with the field moved late: recompute from the field on
                     (needs a rewritten prompt: reported as such)
    oracle           full re-prefill of the new prompt
    auto             choose per edit: a measured policy, then a cheap runtime check (see Auto)

Each is a frozen dataclass registered under its spec name; its fields are the spec's arguments
in order, so ``Selective(8, "causal").spec == "selective:8:causal"`` and :func:`parse_strategy`
reads any registered spec without knowing the variants. A new strategy is one class.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import ClassVar, get_type_hints

import torch
from transformers import DynamicCache

from kvprobe.datasets import ERRATUM_TEMPLATES, Skip, align, erratum_text, render_prompt
from kvprobe.datasets.render import field_label
from kvprobe.datasets.spans import prompt_ids
from kvprobe.editor.context import EditContext
from kvprobe.editor.rankings import RANKINGS, rank_downstream
from kvprobe.errors import KvprobeError, UsageError
from kvprobe.kv import cache as kvcache
from kvprobe.kv.decode import Edited, Read
from kvprobe.kv.hooks import hooks
from kvprobe.editor.states import appended, prefilled, recomputed

# -- the registry and the spec grammar --------------------------------------------------------
class Strategy(ABC):
    """An edit strategy: a frozen dataclass whose fields are its spec arguments, in order.

    A subclass is filed under its spec name by :func:`register`, checks its fields in
    ``__post_init__`` (a ValueError for a bad one) and repairs a case in :meth:`apply`. ``k`` and
    ``ranking`` are None except for ``selective``, since every edit table row has those columns.
    """

    name: ClassVar[str]
    k: ClassVar[int | None] = None
    ranking: ClassVar[str | None] = None

    def check(self, lm, a) -> None:
        """Refuse, before any model work, a case (an AlignedCase) this strategy cannot repair on
        ``lm`` (a one-line error); the default accepts every case."""

    @abstractmethod
    def apply(self, ctx: EditContext) -> Edited:
        """Repair the old cache of ``ctx`` for the new value."""

    def fused(self, ctx: EditContext) -> tuple[Edited, Read] | None:
        """The repair and its decision read as one :class:`~kvprobe.kv.decode.Read` (read with others by
        :func:`~kvprobe.kv.decode.decide_ragged`), where the repair recomputes positions known up front; with the
        row's account of it (an Edited whose ``cache`` is None: no repaired cache is built). None: apply, then read."""
        return None

    @property
    def spec(self) -> str:
        """``name:arg1:arg2``, leaving out trailing arguments at their default (``erratum``)."""
        params = fields(self)
        args = [getattr(self, f.name) for f in params]
        while args and args[-1] == params[len(args) - 1].default:
            args.pop()
        return ":".join([self.name, *(format(a, "g") if isinstance(a, float) else str(a) for a in args)])

    @property
    def label(self) -> str:
        """The name of this strategy's rows in edit tables: its spec."""
        return self.spec

    @classmethod
    def grammar(cls) -> str:
        """``name:ARG``, an optional argument in brackets, then what the arguments accept."""
        params = fields(cls)
        args = [f":{f.metadata.get('arg', f.name.upper())}" for f in params]
        spec = cls.name + "".join(a if f.default is MISSING else f"[{a}]" for f, a in zip(params, args))
        notes = [f.metadata["note"] for f in params if f.metadata.get("note")]
        return spec + (f" ({'; '.join(notes)})" if notes else "")


STRATEGIES: dict[str, type[Strategy]] = {}  # spec name -> class, in the order the help lists them


def register(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    """Class decorator: file a strategy (a frozen dataclass) under its spec name."""
    def add(cls: type[Strategy]) -> type[Strategy]:
        if name in STRATEGIES:
            raise ValueError(f"a strategy is already registered as {name!r}")
        cls.name = name
        STRATEGIES[name] = cls
        return cls
    return add


def arg(placeholder: str, note: str = "", **kwargs):
    """A strategy field, with how the grammar shows it (``K``) and what it accepts (``0<R<=1``)."""
    return field(metadata={"arg": placeholder, "note": note}, **kwargs)


def spec_grammar() -> str:
    """Every registered strategy's grammar, for error messages and help texts."""
    return ", ".join(cls.grammar() for cls in STRATEGIES.values())


def parse_strategy(spec: str, **defaults) -> Strategy:
    """``selective:8:causal`` -> ``Selective(k=8, ranking="causal")``.

    The arguments fill the class's fields in order, each converted by the field's type and
    checked by the class; the last field takes the rest of the spec (a literal erratum template
    may hold ':'). ``defaults`` fill fields the spec leaves out (the run's erratum template).
    A bad spec raises a one-line KvprobeError naming the grammar.
    """
    name, colon, rest = spec.strip().partition(":")
    cls = STRATEGIES.get(name)
    if cls is not None:
        params = fields(cls)
        args = rest.split(":", max(len(params) - 1, 0)) if colon else []
        if len(args) <= len(params):
            types = get_type_hints(cls)
            try:
                given = {f.name: types[f.name](a) for f, a in zip(params, args)}
                given |= {f.name: defaults[f.name] for f in params[len(args):] if f.name in defaults}
                return cls(**given)
            except (TypeError, ValueError):
                pass
    raise UsageError(f"bad strategy {spec!r}; accepted: {spec_grammar()}")


def apply(ctx: EditContext, strategy: Strategy | str) -> Edited:
    """Run one strategy on a case, timed. Neither the shared old-cache prefill nor a strategy's
    setup (what a deployment would already hold, e.g. hoist's rewritten prefix) is counted; the
    tail fed at decision time is timed by :func:`~kvprobe.kv.decode.decide`'s caller."""
    s = parse_strategy(strategy) if isinstance(strategy, str) else strategy
    start = time.perf_counter()
    edited = s.apply(ctx)
    edited.wall_s = time.perf_counter() - start - edited.setup_s
    return edited


# -- the strategies -------------------------------------------------------------------------
def _selected(ctx: EditContext, downstream: list[int]) -> Edited:
    f0, f1 = ctx.a.field
    positions = list(range(f0, f1)) + downstream
    cache = recomputed(ctx.lm, ctx.old_cache, ctx.a.ids_new, positions)
    return Edited(cache, [ctx.a.ids_new[ctx.D]], len(positions), ctx.D + 1, ids=ctx.a.ids_new[: ctx.D + 1])


def _selected_fused(ctx: EditContext, downstream: list[int]) -> tuple[Edited, Read]:
    """:func:`_selected`'s recompute and its read as one Read: the recomputed tokens at their positions, the
    stale entries there hidden (recompute_positions' visibility), then the decision token."""
    f0, f1 = ctx.a.field
    positions = sorted([*range(f0, f1), *downstream])
    ids = ctx.a.ids_new
    read = Read(ctx.old_cache, [ids[p] for p in positions] + [ids[ctx.D]], positions + [ctx.D], positions)
    return Edited(None, [ids[ctx.D]], len(positions), ctx.D + 1, ids=ids[: ctx.D + 1]), read


def _erratum_ids(lm, a, template: str, value_in_prompt: str, at: str = "question") -> list[int]:
    """The token ids of the prompt with the erratum line where ``at`` says (before the question, or
    a new turn after the old prompt), its length checked against the window."""
    text = render_prompt(a.case, lm.tokenizer, value_in_prompt, a.form,
                         erratum=erratum_text(field_label(a.case), a.case.new_value, template), erratum_at=at)
    ids = prompt_ids(lm.tokenizer, text, a.form)
    lm.check_length(len(ids), f"case {a.case.case_id} with its erratum")
    return ids


def _with_erratum(ctx: EditContext, template: str, base: DynamicCache, base_ids: list[int], value_in_prompt: str,
                  extra_recomputed: int, at: str = "question") -> Edited:
    """Keep the longest prefix of ``base`` the erratum prompt shares, feed the rest."""
    ids = _erratum_ids(ctx.lm, ctx.a, template, value_in_prompt, at)
    # Tokenizers can merge across the insertion point: reuse only the identical prefix.
    shared = next((i for i, (x, y) in enumerate(zip(ids, base_ids[: ctx.D])) if x != y), min(len(ids), ctx.D))
    cache = kvcache.crop(base, shared)
    tail = ids[shared:]
    return Edited(cache, tail, extra_recomputed + len(tail) - 1, len(ids), ids=ids)


@register("stale")
@dataclass(frozen=True)
class Stale(Strategy):
    """The old cache as it is."""

    def apply(self, ctx: EditContext) -> Edited:
        return Edited(ctx.old_cache, [ctx.a.ids_old[ctx.D]], 0, ctx.D + 1, ids=ctx.a.ids_old[: ctx.D + 1])


@register("field_only")
@dataclass(frozen=True)
class FieldOnly(Strategy):
    """Recompute the field span only; downstream notes stay stale."""

    def apply(self, ctx: EditContext) -> Edited:
        return _selected(ctx, [])

    def fused(self, ctx: EditContext) -> tuple[Edited, Read]:
        return _selected_fused(ctx, [])


@register("selective")
@dataclass(frozen=True)
class Selective(Strategy):
    """The field plus the first ``k`` downstream positions under a ranking."""

    k: int = arg("K")
    ranking: str = arg("RANKING", note="RANKING in " + "/".join(RANKINGS))

    def __post_init__(self):
        if self.k < 0 or self.ranking not in RANKINGS:
            raise ValueError(f"selective needs K >= 0 and a ranking in {RANKINGS}, got {self.k}, {self.ranking!r}")

    def check(self, lm, a) -> None:
        lo, hi = a.downstream
        if self.k > hi - lo:
            raise UsageError(f"{self.spec}: K={self.k} is larger than the downstream span of case "
                             f"{a.case.case_id} ({hi - lo} positions); use K <= {hi - lo}")

    def apply(self, ctx: EditContext) -> Edited:
        self.check(ctx.lm, ctx.a)
        return _selected(ctx, rank_downstream(ctx, self.ranking)[: self.k])

    def fused(self, ctx: EditContext) -> tuple[Edited, Read]:
        self.check(ctx.lm, ctx.a)
        return _selected_fused(ctx, rank_downstream(ctx, self.ranking)[: self.k])


class _StopForward(Exception):
    pass


@register("cacheblend")
@dataclass(frozen=True)
class CacheBlend(Strategy):
    """CacheBlend: pick the fraction ``ratio`` of positions by KV deviation at ``check_layer``, then
    recompute them."""

    ratio: float = arg("R", note="0<R<=1")
    check_layer: ClassVar[int] = 1

    def __post_init__(self):
        if not 0 < self.ratio <= 1:
            raise ValueError(f"cacheblend needs 0 < ratio <= 1, got {self.ratio}")

    def apply(self, ctx: EditContext) -> Edited:
        lm, D = ctx.lm, ctx.D
        layers = lm.adapter.layers(lm.model)
        check_layer = min(self.check_layer, len(layers) - 1)
        probe = kvcache.new_cache()

        def stop(module, args):
            raise _StopForward

        stops = [(layers[check_layer + 1], stop)] if check_layer + 1 < len(layers) else []
        with hooks(pre=stops), contextlib.suppress(_StopForward):
            kvcache.forward(lm.model, torch.tensor([ctx.a.ids_new[:D]]), probe)
        k_new, v_new = kvcache.get_kv(probe, check_layer)
        k_old, v_old = kvcache.get_kv(ctx.old_cache, check_layer)
        deviation = ((k_new - k_old) ** 2).sum((0, 1, 3)) + ((v_new - v_old) ** 2).sum((0, 1, 3))  # (D,)
        n = max(1, round(self.ratio * D))
        chosen = torch.argsort(deviation, descending=True, stable=True)[:n].tolist()
        cache = recomputed(lm, ctx.old_cache, ctx.a.ids_new, chosen)
        check_cost = D * (check_layer + 1) / len(layers)
        return Edited(cache, [ctx.a.ids_new[D]], n + check_cost, D + 1, ids=ctx.a.ids_new[: D + 1],
                      note=f"field recomputed: {set(range(*ctx.a.field)) <= set(chosen)}")


@register("erratum")
@dataclass(frozen=True)
class Erratum(Strategy):
    """Keep the old cache, append a correction line and re-ask.

    ``template`` is a name in :data:`~kvprobe.datasets.ERRATUM_TEMPLATES` or a literal template; a
    literal equal to a named one is kept by its name, so the paper's template prints as ``erratum``.
    """

    template: str = arg("paper|short", default="paper")
    at: ClassVar[str] = "question"  # where the line goes (kvprobe.datasets.render.ERRATUM_AT)

    def __post_init__(self):
        named = {text: name for name, text in ERRATUM_TEMPLATES.items()}
        object.__setattr__(self, "template", named.get(self.template, self.template))

    @property
    def text(self) -> str:
        """The template itself, with ``{field}`` and ``{value}``."""
        return ERRATUM_TEMPLATES.get(self.template, self.template)

    def check(self, lm, a) -> None:
        _erratum_ids(lm, a, self.text, a.case.old_value, self.at)

    def apply(self, ctx: EditContext) -> Edited:
        return _with_erratum(ctx, self.text, ctx.old_cache, ctx.a.ids_old, ctx.a.case.old_value, 0, self.at)


@register("field_erratum")
@dataclass(frozen=True)
class FieldErratum(Erratum):
    """field_only, then the erratum."""

    def check(self, lm, a) -> None:
        _erratum_ids(lm, a, self.text, a.case.new_value, self.at)

    def apply(self, ctx: EditContext) -> Edited:
        fixed = _selected(ctx, [])
        return _with_erratum(ctx, self.text, fixed.cache, ctx.a.ids_new, ctx.a.case.new_value,
                             ctx.a.field[1] - ctx.a.field[0], self.at)


@register("erratum_turn")
@dataclass(frozen=True)
class ErratumTurn(Erratum):
    """The erratum as a new user turn after the whole old prompt, asking again (the serving case:
    the cached prompt stays byte-identical and only the new turn is fed)."""

    at: ClassVar[str] = "turn"


@register("field_erratum_turn")
@dataclass(frozen=True)
class FieldErratumTurn(FieldErratum):
    """field_only, then the erratum as a new turn after the old prompt."""

    at: ClassVar[str] = "turn"


@register("hoist")
@dataclass(frozen=True)
class Hoist(Strategy):
    """The deployment keeps the field late in its prompt; an edit recomputes from the field on."""

    def check(self, lm, a) -> None:
        self._hoisted(lm, a)

    @staticmethod
    def _hoisted(lm, a):
        if not a.case.rule:
            raise KvprobeError(f"hoist rewrites a generated prompt with its field moved late; case {a.case.case_id} "
                               f"brings its own prompt, which kvprobe cannot rewrite")
        hoisted = align(a.case.model_copy(update={"field_position": "late"}), lm.tokenizer, a.form)
        if isinstance(hoisted, Skip):
            raise KvprobeError(f"hoist: the rewritten prompt of {a.case.case_id} does not align: {hoisted.reason}")
        return hoisted

    def apply(self, ctx: EditContext) -> Edited:
        hoisted = self._hoisted(ctx.lm, ctx.a)
        f0, D = hoisted.field[0], hoisted.decision_pos
        start = time.perf_counter()
        cache = prefilled(ctx.lm, hoisted.ids_old[:f0])  # the deployment's cached prefix
        return Edited(cache, hoisted.ids_new[f0 : D + 1], D - f0, D + 1, rewritten_prompt=True,
                      ids=hoisted.ids_new[: D + 1], setup_s=time.perf_counter() - start)


@register("oracle")
@dataclass(frozen=True)
class Oracle(Strategy):
    """A full re-prefill of the new prompt."""

    def apply(self, ctx: EditContext) -> Edited:
        cache = prefilled(ctx.lm, ctx.a.ids_new[: ctx.D])
        return Edited(cache, [ctx.a.ids_new[ctx.D]], ctx.D, ctx.D + 1, ids=ctx.a.ids_new[: ctx.D + 1])


@dataclass(frozen=True)
class PrefixOracle(Oracle):
    """The oracle from the prefix the old and new prompts share: the old prompt's cache up to the
    field's first token, the new prompt prefilled from there, as a serving engine's prefix cache
    gives it (the same computation as a full prefill up to float rounding: the positions before the
    field see the same tokens). Not a strategy of its own: its rows are the oracle's
    (``kvprobe calibrate --oracle prefix``, the default there)."""

    def apply(self, ctx: EditContext) -> Edited:
        f0 = ctx.a.field[0]
        assert ctx.a.ids_old[:f0] == ctx.a.ids_new[:f0], "an in-place edit leaves the tokens before the field"
        cache = appended(ctx.lm, kvcache.crop(ctx.old_cache, f0), ctx.a.ids_new[f0: ctx.D])
        return Edited(cache, [ctx.a.ids_new[ctx.D]], ctx.D - f0, ctx.D + 1, ids=ctx.a.ids_new[: ctx.D + 1])

    def fused(self, ctx: EditContext) -> tuple[Edited, Read]:
        """Its prefill and its read as one Read: the new prompt from the field on, the old entries there hidden."""
        f0, D, ids = ctx.a.field[0], ctx.D, ctx.a.ids_new
        return (Edited(None, [ids[D]], D - f0, D + 1, ids=ids[: D + 1]),
                Read(ctx.old_cache, ids[f0: D + 1], list(range(f0, D + 1)), list(range(f0, D))))
