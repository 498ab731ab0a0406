"""The front door: your model, your prompt, one field edited, the repair you choose or ``auto``.

    lm = kvprobe.load("qwen2.5-1.5b")          # or load(hf_model, tokenizer), or an nnsight LanguageModel
    ctx = kvprobe.EditableContext(lm)
    ctx.add_text("Loans are issued only if the tier is gold.\\nTier: ")
    ctx.add_field("tier", "gold")
    ctx.ask("Is the loan issued?", options=["yes", "no"])
    fixed = ctx.edit(tier="silver")            # strategy="auto": chosen per edit, and says why
    fixed.answer(), fixed.chose, fixed.reason, fixed.frac_recomputed

The context is a template case (:class:`~kvprobe.datasets.EditCase` with ``template``): text,
named fields, the question and its options, rendered as kvprobe renders every case (the chat
template where the tokenizer has one, the question as a ``## Request`` paragraph). It is
prefilled once; every edit starts from that cache and leaves it as it was. The oracle (a full
re-prefill) is one more strategy, for checking, never needed.
"""

from __future__ import annotations

import os

import pandas as pd
import torch

from kvprobe import field_policy
from kvprobe import policy as policies
from kvprobe.datasets import AlignedCase, EditCase, Skip, align, render_prompt
from kvprobe.datasets.render import resolve_form
from kvprobe.datasets.schema import value_problem
from kvprobe.datasets.spans import prompt_ids
from kvprobe.edit_state import EditState, _first_ids
from kvprobe.editor.context import EditContext, make_context
from kvprobe.editor.score import measure_strategies
from kvprobe.editor.auto import check_policies, check_policy_specs, load_policy
from kvprobe.editor.strategies import Strategy, apply, parse_strategy
from kvprobe.errors import KvprobeError, UsageError, validator_message
from kvprobe.kv import cache as kvcache
from kvprobe.kv.decode import Edited
from kvprobe.models.load import LoadedModel, load_model, wrap_model


def load(model, tokenizer=None, *, dtype: str | None = None, device: str | None = None,
         device_map: str | None = None, attn: str = "eager") -> LoadedModel:
    """A model ready for kvprobe, from any of:

    - a spec string (a bundled alias, ``toy-<family>``, a ``.gguf`` path, a local folder, a hub id);
      ``dtype`` defaults to float32 and ``device`` to cpu, ``device_map`` ("auto", ...) lets
      accelerate place it instead, ``attn`` is the attention implementation;
    - a transformers ``PreTrainedModel`` of a supported family plus its ``tokenizer``; ``dtype``
      and ``device`` None keep the model's own (``attn`` is the model's own);
    - an nnsight ``LanguageModel`` (the model it wraps, and its tokenizer unless one is given);
    - a :class:`~kvprobe.models.LoadedModel` (returned as it is).

    ``device_map`` applies to a spec string only: a model already loaded keeps its own placement.
    """
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, str):
        return load_model(model, dtype or "float32", device or "cpu", attn=attn, device_map=device_map)
    if device_map is not None:
        raise UsageError("device_map applies to a model spec string; place a model you load yourself with "
                         "from_pretrained(..., device_map=...)")
    if type(model).__module__.startswith("nnsight"):
        inner = getattr(model, "_module", None)
        return wrap_model(inner, tokenizer or getattr(model, "tokenizer", None), dtype, device)
    return wrap_model(model, tokenizer, dtype, device)


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


RESERVED_FIELDS = ("self", "strategy")  # edit(self, strategy, **change): a field cannot be called these


class EditableContext:
    """A prompt built from text and named fields, prefilled once, then edited field by field.

    ``model`` is anything :func:`load` takes. ``system`` is a system message (a chat template
    gets it as one), ``form`` "auto" (chat where the tokenizer has a template), "chat" or "raw".
    ``policy`` is a ``topk.yaml`` of this model (path or :class:`~kvprobe.policy.Policy`):
    ``auto`` and ``selective:K:causal`` use it.
    """

    def __init__(self, model, *, system: str | None = None, form: str = "auto", policy=None):
        self.lm = load(model)
        self.system, self.form = system, resolve_form(self.lm.tokenizer, form)
        self.policy = _policy(policy, self.lm)
        self._pieces: list[tuple[str, str]] = []  # ("text", text) or ("field", name)
        self.fields: dict[str, str] = {}
        self.question: str | None = None
        self.options: list[str] = []
        self._ids: list[int] | None = None
        self._cache = None

    # -- building ------------------------------------------------------------------------------
    def add_text(self, text: str) -> EditableContext:
        self._building()
        self._pieces.append(("text", text))
        return self

    def add_field(self, name: str, value: str) -> EditableContext:
        """A named field holding ``value``, where it sits in the text; later edits change it."""
        self._building()
        if not name.isidentifier():
            raise UsageError(f"field name {name!r} must be an identifier (letters, digits, _)")
        if name in RESERVED_FIELDS:
            raise UsageError(f"field name {name!r} is reserved ({', '.join(RESERVED_FIELDS)} are edit()'s own "
                             f"arguments, so edit({name}=...) could not name the field); choose another name")
        if name in self.fields:
            raise UsageError(f"field {name!r} is already in this context; each field occurs once")
        self._check_value(name, value)
        self.fields[name] = value
        self._pieces.append(("field", name))
        return self

    def _check_value(self, name: str, value) -> None:
        """A field's value is one line of plain text, without this tokenizer's special tokens either
        (:func:`kvprobe.datasets.schema.value_problem`)."""
        problem = value_problem(value, getattr(getattr(self, "lm", None), "tokenizer", None))
        if problem:
            raise UsageError(f"the value of field {name!r} {problem}")

    def ask(self, question: str, options: list[str] | None = None) -> EditableContext:
        """The question whose answer is the decision, and its answer options (two, or none: then
        the decision is the top next token). An erratum re-asks it."""
        self._building()
        if not isinstance(question, str) or not question.strip():
            raise UsageError(f"the question is {'empty' if isinstance(question, str) else type(question).__name__}; "
                             f"give the question whose answer is the decision as text, e.g. "
                             f"ask('Is the loan issued?', options=['yes', 'no'])")
        if options is not None and len(options) != 2:
            raise UsageError(f"give two answer options, or none; got {len(options)}")
        self.question, self.options = question, list(options or [])
        return self

    def _building(self) -> None:
        if self._ids is not None:
            raise UsageError("this context is prefilled; build a new EditableContext to change its text")

    @property
    def template(self) -> str:
        """The body as a template: text with ``{name}`` where each field sits."""
        return "".join(_escape(x) if kind == "text" else f"{{{x}}}" for kind, x in self._pieces)

    def case(self, name: str, new_value: str) -> EditCase:
        """The edit of field ``name`` to ``new_value`` as a template case (see module docstring)."""
        if not self.fields:
            raise UsageError("the context has no field; add one with add_field(name, value)")
        if self.question is None:
            raise UsageError("the context has no question; set it with ask(question, options)")
        if name not in self.fields:
            raise UsageError(f"no field {name!r} in this context; its fields: {', '.join(self.fields)}")
        if new_value == self.fields[name]:
            raise UsageError(f"the new value of {name!r} equals the old one ({new_value!r}); nothing to edit")
        self._check_value(name, new_value)
        try:
            return EditCase(case_id="context", domain="user", field=name, old_value=self.fields[name],
                            new_value=new_value, template=self.template, system=self.system,
                            values={k: v for k, v in self.fields.items() if k != name}, question=self.question,
                            options=self.options)
        except ValueError as exc:  # pydantic's ValidationError: its first message, one line
            raise UsageError(first_message(exc)) from None

    # -- the cache -----------------------------------------------------------------------------
    def prefill(self) -> EditableContext:
        """Prefill the prompt (everything before its last token) once; edits start from it."""
        with self.lm.lock:  # two threads reading a fresh context prefill it once
            return self._prefill()

    def _prefill(self) -> EditableContext:
        if self._ids is None:
            name = next(iter(self.fields), "")
            case = self.case(name, self.fields.get(name, "") + "x")  # any other value: only the old one renders
            ids = prompt_ids(self.lm.tokenizer, render_prompt(case, self.lm.tokenizer, case.old_value, self.form),
                             self.form)
            self.lm.check_length(len(ids), "the context")
            _, self._cache = kvcache.prefill(self.lm.model, torch.tensor(ids[:-1]), logits_to_keep=1)
            self._ids = ids
        return self

    def read(self) -> EditState:
        """The state of the unedited context (the decision as prefilled)."""
        self.prefill()
        edited = Edited(self._cache, [self._ids[-1]], 0, len(self._ids), ids=list(self._ids))
        ids = {o: _first_ids(self.lm, o) for o in self.options}
        return EditState(self.lm, edited, "stale", "stale", options=self.options, option_ids=ids)

    def edit(self, strategy: str | Strategy = "auto", **change: str) -> EditState:
        """Repair the cache for one field's new value (``ctx.edit(tier="silver")``) with
        ``strategy`` (a spec such as ``"erratum_turn"`` or ``"selective:8:causal"``, or a typed
        strategy; default ``auto``)."""
        if len(change) != 1:
            raise UsageError(f"edit one field at a time, e.g. edit(tier='silver'); got {len(change)} (many edits: "
                             f"ctx.edits(...), one row each)")
        (name, value), = change.items()
        if not isinstance(value, str):
            raise UsageError(f"edit() takes one new value as text, got {type(value).__name__} for {name!r}; for "
                             f"several values, ctx.edits({name}=[...]) gives one row per value")
        if not isinstance(strategy, (str, Strategy)):
            raise UsageError(f"strategy must be a spec string such as 'auto' or 'selective:8:causal' (`kvprobe "
                             f"strategies` lists them) or a Strategy object, got {type(strategy).__name__} "
                             f"{strategy!r}")
        s = parse_strategy(strategy) if isinstance(strategy, str) else strategy
        with self.lm.lock:  # the repair's forward passes (and any hooks it hangs) hold the model
            ctx = self.context(name, value)
            s.check(self.lm, ctx.a)
            edited = apply(ctx, s)
        return EditState(self.lm, edited, s.spec, edited.chose or s.spec, edited.note, self.options, ctx.a.option_ids)

    def edits(self, strategy: str | Strategy = "auto", **changes) -> pd.DataFrame:
        """Many edits from the one prefill, one row each: ``ctx.edits(tier=["silver", "bronze"],
        region="EU")`` edits each value of each field alone (the other fields as prefilled), with
        ``strategy``. Columns: ``field``, ``new_value`` and :meth:`EditState.to_dict`'s."""
        if not changes:
            raise UsageError("name at least one field and its new values, e.g. ctx.edits(tier=['silver', 'bronze'])")
        rows = []
        for name, values in changes.items():
            for value in [values] if isinstance(values, str) else list(values):
                rows.append({"field": name, "new_value": value, **self.edit(strategy, **{name: value}).to_dict()})
        return pd.DataFrame(rows)

    def context(self, name: str, value: str) -> EditContext:
        """What a strategy starts from for this edit: the model, the aligned case, the old cache."""
        self.prefill()
        a = self._aligned(name, value)
        return EditContext(self.lm, a, self._cache, ranking=learned_ranking(self.policy), policy=self.policy)

    def _aligned(self, name: str, value: str) -> AlignedCase:
        a = aligned_edit(self.lm, self.case(name, value), self.form)
        if a.ids_old != self._ids:
            raise KvprobeError("the context's tokens changed since it was prefilled; build a new EditableContext")
        return a


def _policy(policy, lm) -> policies.Policy | field_policy.FieldPolicy | None:
    """``EditableContext(policy=...)``: the path (str or os.PathLike) of a topk.yaml or a
    field_policy.yaml is loaded for ``lm``, a loaded :class:`~kvprobe.policy.Policy` has its strategy
    specs checked, a loaded :class:`~kvprobe.field_policy.FieldPolicy` is taken; anything else is refused."""
    if policy is None:
        return None
    if isinstance(policy, (str, os.PathLike)):
        return load_policy(policy, lm)
    if isinstance(policy, policies.Policy):
        return check_policy_specs(policy)
    if isinstance(policy, field_policy.FieldPolicy):
        return policy
    raise UsageError(f"policy must be the path of a topk.yaml or field_policy.yaml (str or pathlib.Path), or a "
                     f"kvprobe.policy.Policy, not {type(policy).__name__}")


def learned_ranking(policy):
    """The policy's causal ranking rule, or None without a policy or a learned rule (then
    ``selective:K:causal`` says where a rule comes from)."""
    rule = (getattr(policy, "rule", None) or {}) if policy is not None else {}  # a field policy holds none
    return policy.ranking() if rule.get("scores") and rule.get("n_training_cases") else None


def aligned_edit(lm, case: EditCase, form: str = "auto") -> AlignedCase:
    """The case's edit aligned under ``lm``'s tokenizer, or a one-line error: the new prompt past
    the model's window, or an edit that cannot be repaired in place (its reason)."""
    new_ids = prompt_ids(lm.tokenizer, render_prompt(case, lm.tokenizer, case.new_value, form),
                         resolve_form(lm.tokenizer, form))
    lm.check_length(len(new_ids), f"the prompt with {case.field}={case.new_value!r}")
    a = align(case, lm.tokenizer, form)
    if isinstance(a, Skip):
        raise KvprobeError(f"cannot edit {case.field!r} from {case.old_value!r} to {case.new_value!r} in place: "
                           f"{a.reason}")
    return a


def first_message(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        return validator_message(first)
    return str(exc).splitlines()[0]


DIAGNOSE_COLUMNS = ["new_value", "strategy", "chose", "pred", "reference", "agree", "margin", "tokens_recomputed",
                    "frac_recomputed", "wall_s", "decide_s", "to_decision_s", "note", "error"]


def diagnose_case(lm, case: EditCase, new_values: list[str], strategies: list[str | Strategy], form: str = "auto",
                  policy=None, start=lambda total: (lambda: None)) -> pd.DataFrame:
    """Every strategy (``auto`` among them) for each new value of the case's field, against the
    oracle: the decision each reads, whether it agrees, its margin, cost and time. One row per
    new value x strategy (see :data:`DIAGNOSE_COLUMNS`: the names of
    :data:`kvprobe.editor.score.ROW_COLUMNS`, ``wall_s`` the repair's seconds, plus ``new_value``,
    ``margin`` and ``to_decision_s`` = wall_s + decide_s; ``chose`` is what ran, the strategy
    itself unless it chose); a strategy that cannot run on this prompt (hoist on a template) is a
    row with its error. The old prompt is prefilled once; the rows come from
    :func:`kvprobe.editor.score.measure_strategies`.

    Every input is checked first (each new value, its prompt against the window, each strategy's
    policy file); then ``start(total)`` is called and what it returns after each row."""
    parsed = [parse_strategy(s) if isinstance(s, str) else s for s in strategies]
    edits = []
    for value in new_values:
        if value == case.old_value:
            raise UsageError(f"the new value {value!r} of field '{case.field}' equals the old one; nothing to edit")
        a = aligned_edit(lm, case.model_copy(update={"new_value": value}), form)
        if a.ids_old == a.ids_new:
            unk = getattr(lm.tokenizer, "unk_token", None)
            raise KvprobeError(f"the edit of {case.field!r} from {case.old_value!r} to {value!r} changes no token "
                               f"id under {lm.info.spec}'s tokenizer (the two values tokenise alike"
                               + (f", e.g. both to {unk}" if unk else "") + "): there is nothing the model can "
                               "see to repair; give values its tokenizer tells apart")
        edits.append((value, a))
    check_policies(parsed, lm)
    on_step = start(len(edits) * len({s.label for s in parsed}))
    old_cache, frames = None, []
    with lm.lock:  # every forward pass and repair below holds the model (LoadedModel.lock)
        for value, a in edits:
            if old_cache is None:
                old_cache = make_context(lm, a).old_cache
            ctx = EditContext(lm, a, old_cache, ranking=learned_ranking(policy), policy=policy)
            rows = measure_strategies(lm, a, parsed, ctx=ctx, on_row=on_step).set_index("strategy", drop=False)
            frames.append(rows.loc[[s.label for s in parsed]].assign(new_value=value))
    if not frames:
        return pd.DataFrame(columns=DIAGNOSE_COLUMNS)
    rows = pd.concat(frames, ignore_index=True)
    ran = rows.error.isna()
    rows.loc[ran, "chose"] = [chose or s for chose, s in zip(rows.chose[ran], rows.strategy[ran])]
    rows.loc[ran, "note"] = [note or None for note in rows.note[ran]]
    rows["to_decision_s"] = rows.wall_s + rows.decide_s
    return rows.reindex(columns=DIAGNOSE_COLUMNS)


def recommendation(rows: pd.DataFrame) -> list[str]:
    """Per new value: what ``auto`` chose and whether it agreed, and (in hindsight, with the oracle
    known) the cheapest strategy that agreed."""
    lines = []
    for value, g in rows.groupby("new_value", sort=False):
        ok = g[g.agree.eq(True) & ~g.strategy.isin(["oracle", "stale"])]
        auto = g[g.strategy.str.startswith("auto")]
        head = f"{value}: "
        stale = g[g.strategy.eq("stale")]
        if len(stale) and stale.iloc[0].pred == stale.iloc[0].reference:
            lines.append(head + f"no repair is needed for the decision: the stale cache already gives the oracle's "
                                f"{stale.iloc[0].reference!r} (this edit does not change it); field_only keeps "
                                f"the cached text current at the least cost, so no strategy is ranked")
            continue
        if len(auto) and isinstance(auto.iloc[0].chose, str):
            r = auto.iloc[0]
            head += (f"auto chose {r.chose} ({'agrees' if r.agree else 'DISAGREES'} with the oracle, "
                     f"{r.frac_recomputed:.1%} recomputed) because {r.note}; ")
        cheapest = ok.sort_values(["frac_recomputed", "to_decision_s"]).iloc[0].strategy if len(ok) else None
        lines.append(head + (f"cheapest agreeing in hindsight: {cheapest}" if cheapest
                             else "no repair short of the oracle agrees"))
    return lines
