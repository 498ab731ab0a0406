"""A prefix-stable prompt state for agents: a template with several fields, a stream of field
updates, and the chat messages that carry them to any OpenAI-compatible server (vLLM, SGLang).

The prompt is a calibration spec (:class:`~kvprobe.calibrate.engine.CalibrationSpec`: a system
message, a template with ``{name}`` fields, a question and two options), rendered exactly as
kvprobe renders it when it measures a repair (:func:`kvprobe.datasets.render_turns`)::

    messages = [system,
                user: template at the PREFIX values + "## Request" + question,   <- cached, never rewritten
                user: note lines + question]                                     <- only when a note is due

The prefix holds the values the session started with. An update changes a field's current value;
how it reaches the model is the field's :class:`Rendering`:

    note      a line after the cached prefix, in a new user turn that asks again (kvprobe's
              ``erratum_turn``; its template is the policy's: the paper's, short or neutral)
    none      nothing is sent: the decision does not read this field (measured: no calibration pair
              of the field changed the full re-prefill's decision, so the stale prompt agrees on all)
    rerender  the prefix is rewritten with every current value (exact; the server's prefix cache
              misses from the first changed token on); the notes are then empty
    edit      the prefix holds the new value, and the engine repairs its cached KV in place with
              the field's calibrated ``field_only`` or ``selective`` repair (only an engine that
              edits its own cache: :mod:`kvprobe.serving.llamacpp`; ``renderings(in_place=True)``)

A field's rendering comes from a per-field policy (``field_policy.yaml`` of ``kvprobe calibrate``,
see :func:`renderings`); without one, every field gets :data:`DEFAULT` (a note with the paper's
template, the paper's "erratum for every change"). The one line each rendering was chosen for is
kept in ``Rendering.reason``.

A server sees only messages, so the messages are what is deployed; :meth:`PromptState.ids` gives
the token ids kvprobe's own rendering makes of them (for the prefix-cache ceiling and to check that
the server's chat template agrees: the benchmark records both counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvprobe.errors import KvprobeError, UsageError

KINDS = ("note", "none", "rerender", "edit")
DEFAULT_TEMPLATE = "paper"


@dataclass(frozen=True)
class Rendering:
    """How an update of one field reaches the model: ``kind`` (one of :data:`KINDS`), the erratum
    template of a note (a name in :data:`kvprobe.datasets.ERRATUM_TEMPLATES` or a literal), and why."""

    kind: str
    template: str = DEFAULT_TEMPLATE
    reason: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UsageError(f"unknown rendering {self.kind!r}; accepted: {', '.join(KINDS)}")

    @property
    def label(self) -> str:
        """``note:paper``, ``none``, ``rerender`` or ``edit:field_only`` (a column value)."""
        return f"{self.kind}:{self.template}" if self.kind in ("note", "edit") else self.kind


DEFAULT = Rendering("note", DEFAULT_TEMPLATE, "no policy: every change as an erratum turn (the paper's repair)")


def _note_template(strategy) -> str | None:
    """The erratum template of ``erratum_turn`` (the note after the cached prompt, as a new turn),
    else None. ``erratum`` puts its line inside the prompt, before the question: not this state's note."""
    from kvprobe.editor.strategies import ErratumTurn

    return strategy.template if isinstance(strategy, ErratumTurn) else None


def renderings(spec, policy=None, default: Rendering = DEFAULT, calibrated=(), in_place: bool = False
               ) -> dict[str, Rendering]:
    """Each field of ``spec`` -> its :class:`Rendering`, from a ``field_policy.yaml`` (a path or a
    loaded :class:`~kvprobe.field_policy.FieldPolicy`; None: ``default`` for every field).

    A server cannot edit a cached prompt in place, so a repair that edits the cache (``field_only``,
    ``selective``) is deployed as ``none`` only where the calibration shows the stale prompt keeps the
    decision: the field is ``inert`` (no pair of it changed the re-prefill's decision, so the stale
    prompt agreed on every pair the repair was established on); so is a ``degenerate`` field (its
    values have the same token ids: the model sees no change). ``erratum_turn`` is a note with its
    template. Anything else (``oracle``, a field not calibrated, a repair a server cannot do) is
    ``rerender``.

    ``in_place``: for an engine that edits its own cache (:mod:`kvprobe.serving.llamacpp`), a field
    whose established repair is ``field_only`` or ``selective`` is ``edit`` (its ``template`` the
    repair's spec), whatever the field's relevance: the calibration established that very repair.
    """
    from kvprobe import field_policy
    from kvprobe.editor.strategies import FieldOnly, Selective, parse_strategy

    if policy is None:
        return {name: default for name in spec.fields}
    if not isinstance(policy, field_policy.FieldPolicy):
        loaded = field_policy.load_any(Path(policy), None, parse_strategy)
        if not isinstance(loaded, field_policy.FieldPolicy):
            raise KvprobeError(f"{policy} is a top-K policy (topk.yaml); the prompt state needs a per-field policy: "
                               f"a field_policy.yaml from `kvprobe calibrate` of this template")
        policy = loaded
    policy.check_spec(spec, *calibrated)
    out = {}
    for name in spec.fields:
        f = policy.fields.get(name)
        if f is None:
            out[name] = Rendering("rerender", reason=f"{policy.path} did not calibrate {name!r} (it calibrated "
                                                     f"{', '.join(policy.fields)}): rewrite the prefix")
            continue
        repair = str(f["repair"])
        if repair == "none":  # verified as degenerate (mostly same-token-id draws); anything else was not measured
            degenerate = f.get("verdict") == "degenerate"
            out[name] = Rendering("none" if degenerate else "rerender",
                                  reason=f"{name}: {f.get('reason')} " + ("(degenerate: nothing the model sees changes)"
                                                                          if degenerate else "(not measured: rewrite the "
                                                                                             "prefix)"))
            continue
        note = None if repair == policy.default else _note_template(parse_strategy(repair))
        if in_place and repair != policy.default and isinstance(parse_strategy(repair), (FieldOnly, Selective)):
            out[name] = Rendering("edit", repair, f"{name}: {repair} {f.get('verdict')} ({f.get('reason')}): "
                                                  f"repaired in the engine's cache")
            continue
        if note is not None:
            out[name] = Rendering("note", note, f"{name}: {repair} {f.get('verdict')} ({f.get('reason')})")
            continue
        rate = f.get("change_rate") or {}
        k, n = rate.get("k"), rate.get("n")
        if (repair != policy.default and f.get("relevance") == "inert" and isinstance(k, int) and isinstance(n, int)
                and n > 0 and k == 0):
            out[name] = Rendering("none", reason=f"{name}: {repair} {f.get('verdict')}, and no pair of {n} changed "
                                                 f"the re-prefill's decision (relevance inert): the stale prompt "
                                                 f"keeps it; no note")
            continue
        moved = f", and the field moved the decision on {k} of {n} pairs" if isinstance(k, int) and n else ""
        out[name] = Rendering("rerender", reason=f"{name}: {repair} ({f.get('verdict')}) is not a note a server can "
                                                 f"append{moved}: rewrite the prefix")
    return out


def _check_values(values: dict, what: str) -> None:
    """Refuse (one line) a value that is not one line of plain text: a line break or a chat
    template's special token in a value would open a new turn or section of the prompt the server
    renders (:func:`kvprobe.datasets.schema.value_problem`); None or a number is not text either."""
    from kvprobe.datasets.schema import value_problem

    for name, value in values.items():
        problem = value_problem(value)
        if problem:
            raise UsageError(f"the {what} of {name} {problem}")


@dataclass
class PromptState:
    """One session's prompt: the cached prefix values, the current values and the notes due.

    ``spec`` is a calibration spec (a path or a loaded one); ``values`` every field's starting value;
    ``rendering`` each field's :class:`Rendering`, or a ``field_policy.yaml`` to take them from (see
    :func:`renderings`; a field not given gets :data:`DEFAULT`)::

        state = PromptState("examples/calibrate-refund-clear.yaml", values, "field_policy.yaml")
        state.update(received="2026-03-04 12:05")   # inert: no note, the server's cached prefix stays
        state.update(tier="gold")                   # gating: an erratum turn after the cached prefix
        client.chat.completions.create(model=name, messages=state.messages(), ...)
    """

    spec: object
    values: dict[str, str]
    rendering: dict[str, Rendering] | str | Path | object = field(default_factory=dict)
    prefix: dict[str, str] = field(init=False)
    rewrites: int = field(init=False, default=0)  # how often an update rewrote the prefix

    def __post_init__(self):
        from kvprobe.calibrate.spec import CalibrationSpec, load_spec

        if not isinstance(self.spec, CalibrationSpec):
            self.spec = load_spec(self.spec)
        names = list(self.spec.fields)
        missing = [n for n in names if n not in self.values]
        extra = [n for n in self.values if n not in names]
        if missing or extra:
            raise UsageError(f"the starting values must name every field of the template once ({', '.join(names)}); "
                             f"{'missing ' + ', '.join(missing) if missing else 'unknown ' + ', '.join(extra)}")
        _check_values(self.values, "starting value")
        self.values = {n: self.values[n] for n in names}
        if not isinstance(self.rendering, dict):  # a policy file, or a loaded FieldPolicy
            self.rendering = renderings(self.spec, self.rendering)
        self.rendering = {n: self.rendering.get(n, DEFAULT) for n in names}
        self.prefix = dict(self.values)

    def update(self, **changes: str) -> list[str]:
        """Set fields to new values; returns each changed field's rendering label. A ``rerender``
        field rewrites the prefix with every current value (its notes go with it)."""
        unknown = [n for n in changes if n not in self.values]
        if unknown:
            raise UsageError(f"no field {unknown[0]!r} in the template; its fields: {', '.join(self.values)}")
        _check_values(changes, "new value")
        self.values.update(changes)
        for n in changes:
            if self.rendering[n].kind == "edit":  # the engine's cache is edited: its prefix holds the new value
                self.prefix[n] = changes[n]
        if any(self.rendering[n].kind == "rerender" for n in changes):
            self.prefix = dict(self.values)
            self.rewrites += 1
        return [self.rendering[n].label for n in changes]

    def notes(self) -> list[str]:
        """The note lines due: one per field whose current value differs from the prefix's and whose
        rendering is a note, in template order."""
        return self._notes(self._case())

    def _notes(self, case) -> list[str]:
        from kvprobe.datasets import ERRATUM_TEMPLATES, erratum_text
        from kvprobe.datasets.layouts import label

        style = case.field_style  # the field's name as kvprobe's erratum strategies write it
        return [erratum_text(label(n, style), v, ERRATUM_TEMPLATES.get(self.rendering[n].template,
                                                                       self.rendering[n].template))
                for n, v in self.values.items() if v != self.prefix[n] and self.rendering[n].kind == "note"]

    def _case(self):
        from kvprobe.datasets import EditCase

        first = next(iter(self.prefix))
        return EditCase(case_id="prompt-state", domain="user", field=first, old_value=self.prefix[first],
                        new_value=self.prefix[first] + "x", template=self.spec.template, system=self.spec.system,
                        values={k: v for k, v in self.prefix.items() if k != first}, question=self.spec.question,
                        options=list(self.spec.options))

    def edit_case(self, name: str, old: str):
        """The ``EditCase`` of an in-place edit of field ``name`` from ``old`` to its prefix value, the
        other fields at theirs: kvprobe's alignment of it gives the field's token span in the prompt."""
        from kvprobe.datasets import EditCase

        return EditCase(case_id=f"prompt-state:{name}", domain="user", field=name, old_value=old,
                        new_value=self.prefix[name], template=self.spec.template, system=self.spec.system,
                        values={k: v for k, v in self.prefix.items() if k != name}, question=self.spec.question,
                        options=list(self.spec.options))

    def messages(self) -> list[dict[str, str]]:
        """The chat messages for the current state (the prefix's messages first, byte-identical from
        request to request until a ``rerender`` update rewrites it)."""
        from kvprobe.datasets.render import render_turns

        case = self._case()
        notes = self._notes(case)
        turns = render_turns(case, case.old_value, erratum="\n".join(notes) or None, erratum_at="turn")
        head = [{"role": "system", "content": self.spec.system}] if self.spec.system else []
        return head + [{"role": role, "content": text} for role, text in turns]

    def text(self, tokenizer) -> str:
        """:meth:`messages` rendered by ``tokenizer``'s chat template, as kvprobe renders its chat form."""
        from kvprobe.datasets import render_prompt

        case = self._case()
        notes = self._notes(case)
        return render_prompt(case, tokenizer, case.old_value, "chat", erratum="\n".join(notes) or None,
                             erratum_at="turn")

    def ids(self, tokenizer) -> list[int]:
        """The token ids of :meth:`messages` as kvprobe renders them (its chat form, as measured)."""
        from kvprobe.datasets.spans import prompt_ids

        return prompt_ids(tokenizer, self.text(tokenizer), "chat")
