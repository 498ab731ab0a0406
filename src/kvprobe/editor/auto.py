"""``auto``: choose the repair per edit, from evidence, and say which and why; and the policy files
it (and ``selective:K:causal``) reads. Registered with the other strategies of
:mod:`kvprobe.editor.strategies`, which imports this module last.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvprobe import field_policy
from kvprobe import policy as policies
from kvprobe.editor.context import EditContext
from kvprobe.editor.strategies import FieldOnly, Oracle, Stale, Strategy, arg, parse_strategy, register
from kvprobe.errors import KvprobeError
from kvprobe.kv.decode import Edited, decide
from kvprobe.kv.readout import option_scores
from kvprobe.repair_rule import NOT_REPAIRS_WHY, is_repair


# -- choosing per edit ----------------------------------------------------------------------------
AUTO_FALLBACK = "erratum_turn"  # without a policy: the best repair of kvprobe's design tables (docs/auto.md)
_POLICIES: dict = {}  # (path, id(model)) -> its loaded policy: the fingerprint check runs once
AUTO_CHECK_TOKENS = 2  # the check's two one-token reads (stale and field-only decisions), counted as cost


def decision_of(lm, a, edited: Edited) -> tuple[str, float]:
    """The decision a repaired state reads and its margin: the arg-max option and its score minus
    the other option's (a case without options: the top token and its lead over the runner-up)."""
    logits, _ = decide(lm, edited, 0)
    if a.case.options:
        scores = option_scores(logits, a.option_ids, a.case.options)
        top = scores.topk(2)
        return a.case.options[int(top.indices[0])], float(top.values[0] - top.values[1])
    top = logits.topk(2)
    return lm.tokenizer.decode([int(top.indices[0])]), float(top.values[0] - top.values[1])


@register("auto")
@dataclass(frozen=True)
class Auto(Strategy):
    """Choose the repair per edit, from evidence, and say which and why (``Edited.chose``, ``note``).

    1. **The measured policy** (``POLICY``, a ``topk.yaml`` of this model, or the context's
       policy): the cheapest strategy established by the one repair rule
       (:mod:`kvprobe.repair_rule`: agreement and control invariance, each with a lower bound at the
       file's threshold; :meth:`kvprobe.policy.Policy.cheapest`). If that is ``field_only``, it is
       used as it is. Without a policy the fallback is :data:`AUTO_FALLBACK`; with a policy in
       which nothing qualifies, ``oracle``.
    2. **The runtime check**, otherwise: recompute the field only and read the decision. If it
       moved off the stale decision, the model reads the field directly at the decision token and
       the field-only state is kept (the new prompt's own cache at the field, no added text).
       If it did not move, the old conclusion is held elsewhere (downstream notes) or the edit does
       not matter, and the fallback repairs it. Two one-token reads are the check's cost.
    """

    policy: str = arg("TOPK.YAML", note="TOPK.YAML a policy file of this model", default="")

    def _policy(self, lm, fallback=None):
        """The policy this strategy names (loaded once per model and file), else ``fallback``."""
        if not self.policy:
            return fallback
        key = (self.policy, id(lm))
        if key not in _POLICIES:
            _POLICIES[key] = load_policy(self.policy, lm)
        return _POLICIES[key]

    def check(self, lm, a) -> None:
        policy = self._policy(lm)
        if isinstance(policy, field_policy.FieldPolicy):
            policy.check_case(a.case)

    def apply(self, ctx: EditContext) -> Edited:
        policy = self._policy(ctx.lm, ctx.policy)
        if isinstance(policy, field_policy.FieldPolicy):  # calibrated per field: no runtime check needed
            policy.check_case(ctx.a.case)  # of the prompt it was calibrated on, or refused
            spec, why = policy.choice(ctx.a.case.field)
            chosen = parse_strategy(spec)
            return dataclasses.replace(chosen.apply(ctx), chose=chosen.spec, note=why)
        if policy is None:
            fallback, why = parse_strategy(AUTO_FALLBACK), "no policy for this model; kvprobe's default repair"
        elif (per_field := policy.field_repair(ctx.a.case.field)) is not None:  # established for this field's kind
            chosen = parse_strategy(per_field[0])
            return dataclasses.replace(chosen.apply(ctx), chose=chosen.spec, note=per_field[1])
        else:
            safe = policy.cheapest()
            fallback = parse_strategy(safe.spec) if safe else Oracle()
            why = f"policy {policy.path}: {safe.describe() if safe else policy.why_none()}"
        if isinstance(fallback, FieldOnly):
            return dataclasses.replace(fallback.apply(ctx), chose=fallback.spec, note=why)
        stale, _ = decision_of(ctx.lm, ctx.a, Stale().apply(ctx))
        fixed = FieldOnly().apply(ctx)
        moved, margin = decision_of(ctx.lm, ctx.a, fixed)
        extra = fixed.recomputed + AUTO_CHECK_TOKENS
        if moved != stale:
            return dataclasses.replace(fixed, recomputed=extra, chose="field_only",
                                       note=f"field-only moved the decision from {stale!r} to {moved!r} "
                                            f"(margin {margin:.2f}): the field is read directly")
        edited = fallback.apply(ctx)
        return dataclasses.replace(edited, recomputed=edited.recomputed + extra, chose=fallback.spec,
                                   note=f"field-only kept {stale!r} (the old conclusion is held downstream, or the edit "
                                        f"does not change it); {why}")


def load_policy(path, lm) -> policies.Policy | field_policy.FieldPolicy:
    """A policy file for ``lm``: a ``field_policy.yaml`` (:func:`kvprobe.field_policy.load_any`, every
    repair it names parsed), or a ``topk.yaml`` (:func:`kvprobe.policy.load`: types, ranges, schema
    version and model checked there) with :func:`check_policy_specs`: what every policy kvprobe
    uses goes through."""
    policy = field_policy.load_any(path, lm, parse_strategy)
    return policy if isinstance(policy, field_policy.FieldPolicy) else check_policy_specs(policy)


def check_policy_specs(policy: policies.Policy) -> policies.Policy:
    """Refuse, in one line naming the file, a policy whose ``strategies`` name a spec this kvprobe
    cannot parse (:func:`parse_strategy`); returns ``policy``."""
    for i, e in enumerate(policy.strategies):
        try:
            parse_strategy(e.spec)
        except KvprobeError as exc:
            raise KvprobeError(f"{policy.path} is not a valid topk.yaml: strategies entry {i + 1} names a strategy "
                               f"this kvprobe does not know ({exc}); {policies.EXPORT} rewrites it") from None
    for name, entry in (policy.fields or {}).items():
        try:
            if entry.get("repair"):
                parse_strategy(entry["repair"])
        except KvprobeError as exc:
            raise KvprobeError(f"{policy.path} is not a valid topk.yaml: fields.{name}.repair names a strategy this "
                               f"kvprobe does not know ({exc}); {policies.EXPORT} rewrites it") from None
        if entry.get("repair") and not is_repair(entry["repair"]):
            raise KvprobeError(f"{policy.path} is not a valid topk.yaml: fields.{name}.repair is {entry['repair']!r}, "
                               f"which is not a repair ({NOT_REPAIRS_WHY}); {policies.EXPORT} rewrites it")
    return policy


def check_policies(strategies: list[Strategy], lm) -> None:
    """Refuse, before any measurement, an ``auto`` whose policy file is missing, unreadable or of
    another model (the file, not a case, is at fault: one error, not a row per case)."""
    for s in strategies:
        if isinstance(s, Auto):
            s.check(lm, None)
