"""A per-field repair policy (``field_policy.yaml``, written by ``kvprobe calibrate``), read back
for one model: which repair each field of one template gets, and why.

    policy = kvprobe.field_policy.load_any("results/calibrate/x/field_policy.yaml", lm)
    policy.choice("tier")        # ("erratum_turn:neutral", "calibrated: ...")

``load_any`` reads either kind of policy file (this one, or a ``topk.yaml``), so ``auto``,
``EditableContext(policy=...)`` and ``kvprobe diagnose --policy`` take both. A field the policy has
not measured gets the policy's ``default`` (the oracle), said in the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvprobe.errors import KvprobeError

SCHEMA = 2  # 2: durations in seconds (to_decision_s), each statistic one {value, lo, hi, n} mapping
READS = (1, 2)  # a version-1 file differs only in what no reader here uses (its strategies' evidence)
WRITER = "`kvprobe calibrate`"


def method_line(seq) -> str:
    return (f"confidence sequence: one-sided Clopper-Pearson bounds, alpha spent over the looks "
            f"(lower {seq.alpha_lower:g} shared by {seq.m} candidates, {seq.w0:g} of it at pair {seq.n0}; upper "
            f"{seq.alpha_upper:g}, 6/(pi^2 n^2) per look)")


@dataclass(frozen=True)
class FieldPolicy:
    path: Path
    model: dict
    threshold: float
    default: str
    fields: dict  # name -> {"repair", "verdict", "reason", ...}

    def choice(self, name: str) -> tuple[str, str]:
        """The repair for an edit of field ``name`` and why."""
        f = self.fields.get(name)
        if f is None:
            return self.default, (f"policy {self.path}: field {name!r} was not calibrated (calibrated: "
                                  f"{', '.join(self.fields)}); the policy's default")
        if f["repair"] == "none":  # a degenerate field: any repair keeps the decision; keep the text current
            return "field_only", f"policy {self.path}: {name}: {f['reason']}"
        return f["repair"], f"policy {self.path}: {name}: {f['verdict']}: {f['reason']}"


def _check(path: Path, data: dict, parse) -> FieldPolicy:
    """The file's values checked (``parse``: the strategy parser, handed in by the editor, which
    this module sits below)."""
    from kvprobe.results import MODEL_KEYS

    def bad(where: str, what: str):
        raise KvprobeError(f"{path}: {where} {what}; {WRITER} writes this file") from None

    if data.get("kvprobe_field_policy") not in READS:
        bad("kvprobe_field_policy", f"is {data.get('kvprobe_field_policy')!r}, this kvprobe reads "
                                    f"{' and '.join(map(str, READS))}")
    model = data.get("model")
    if not isinstance(model, dict) or not all(isinstance(model.get(k), str) for k in MODEL_KEYS):
        bad("model", f"must hold {', '.join(MODEL_KEYS)}")
    thr = data.get("threshold")
    if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not (math.isfinite(thr) and 0 < thr < 1):
        bad("threshold", f"is {thr!r}, accepted: a number in (0, 1)")
    fields = data.get("fields")
    if not isinstance(fields, dict) or not fields:
        bad("fields", "must map each calibrated field to its repair")
    try:
        parse(str(data.get("default")))
    except KvprobeError as exc:
        bad("default", f"is not a strategy ({exc})")
    for name, f in fields.items():
        if not isinstance(f, dict) or not isinstance(f.get("repair"), str) or not isinstance(f.get("reason"), str):
            bad(f"fields.{name}", "must hold repair and reason")
        if f["repair"] != "none":
            try:
                spec = parse(f["repair"]).spec
            except KvprobeError as exc:
                bad(f"fields.{name}.repair", f"is not a strategy ({exc})")
            if spec.startswith("auto"):
                bad(f"fields.{name}.repair", "is auto; a policy names a repair")
        if f.get("verdict") not in ("established", "budget", "degenerate"):
            bad(f"fields.{name}.verdict", f"is {f.get('verdict')!r}, accepted: established, budget, degenerate")
    return FieldPolicy(path, model, float(thr), str(data["default"]), dict(fields))


def load_any(path, lm, parse):
    """A ``field_policy.yaml`` (:class:`FieldPolicy`) or a ``topk.yaml`` (:class:`kvprobe.policy.Policy`)
    for the model ``lm`` (None: no model check); another model's file is refused in one line.
    ``parse`` is :func:`kvprobe.editor.strategies.parse_strategy` (every repair the file names is
    checked with it)."""
    from kvprobe import policy as topk

    path = Path(path)
    data = None
    if path.is_file():
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            data = None  # topk.load says what is wrong with it
    if not (isinstance(data, dict) and "kvprobe_field_policy" in data):
        return topk.load(path, lm)
    policy = _check(path, data, parse)
    if lm is not None:
        from kvprobe.results import MODEL_KEYS

        fp = lm.fingerprint()
        differ = [k for k in MODEL_KEYS if policy.model.get(k) != fp[k]]
        if differ:
            raise KvprobeError(f"{path} was calibrated for {policy.model.get('spec')}, not {fp['spec']} "
                               f"({', '.join(differ)} differ); calibrate this model")
    return policy


def write(policy: dict, path: Path | str) -> Path:
    from kvprobe.results import atomic_write

    return atomic_write(Path(path), lambda tmp: tmp.write_text(yaml.safe_dump(policy, sort_keys=False, width=110)))
