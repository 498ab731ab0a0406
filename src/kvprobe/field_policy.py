"""A per-field repair policy (``field_policy.yaml``, written by ``kvprobe calibrate``), read back
for one model: which repair each field of one template gets, and why.

    policy = kvprobe.field_policy.load_any("results/calibrate/x/field_policy.yaml", lm)
    policy.choice("tier")        # ("erratum_turn:neutral", "calibrated: ...")

``load_any`` reads either kind of policy file (this one, or a ``topk.yaml``), so ``auto``,
``EditableContext(policy=...)`` and ``kvprobe diagnose --policy`` take both. A field the policy has
not measured gets the policy's ``default`` (the oracle), said in the reason.

A policy is evidence, and a file can be edited by hand: :func:`verify` (run by every reader, and by
``kvprobe check-policy``) recomputes each verdict from the counts the file records and refuses, in
one line, whatever does not follow; :meth:`FieldPolicy.check_spec` and :meth:`FieldPolicy.check_case`
refuse applying it to another template than the one it was calibrated on.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

import yaml

from kvprobe.errors import KvprobeError

SCHEMA = 4  # 3: each agreement's k, the prompt's digest, same_id_pairs, the verdict unmeasurable; 4: the
# candidates tested as a chain (procedure: chain), each agreement's n its own pairs, "not measured"
READS = (2, 3, 4)  # a version-2 file's k are its value times n (written to 4 decimals: exact up to 200 pairs)
WRITER = "`kvprobe calibrate`"
VERDICTS = ("established", "budget", "degenerate", "unmeasurable")
DEFAULT = "oracle"  # what a field the policy did not calibrate gets: the only default kvprobe writes
TOL = 2e-4  # a recorded bound (written to 4 decimals) against the one recomputed from its counts
TOP_KEYS = ("kvprobe_field_policy", "model", "template", "threshold", "alpha_lower", "alpha_upper", "procedure",
            "candidates", "max_pairs", "method", "default", "fields")
FIELD_KEYS = ("repair", "verdict", "reason", "relevance", "pairs", "skipped_pairs", "same_id_pairs", "change_rate",
              "seconds", "strategies")
STRATEGY_KEYS = ("agreement", "spurious_flips", "n_unchanged", "flip_hi", "verdict", "frac_recomputed",
                 "to_decision_s")


def method_line(seq) -> str:
    lower = (f"lower {seq.alpha:.4g} for each of {seq.m} candidates tested as a chain (the chosen one wrongly "
             f"established with probability <= {seq.alpha_lower:g} over {seq.chain} pairs)" if seq.chain else
             f"lower {seq.alpha_lower:g} shared by {seq.m} candidates")
    return (f"confidence sequence: one-sided Clopper-Pearson bounds, alpha spent over the looks "
            f"({lower}, {seq.w0:g} of it at pair {seq.n0}; upper {seq.alpha_upper:g}, 6/(pi^2 n^2) per look)")


def prompt_digest(template: str, question: str, options, system: str | None) -> str:
    """The digest of a prompt (a ``{name}`` template, its question, options and system message): a
    calibration spec's (:meth:`~kvprobe.calibrate.engine.CalibrationSpec.prompt_digest`) and that of
    an :class:`~kvprobe.api.EditableContext` built from it are the same."""
    data = {"template": template, "question": question, "options": list(options), "system": system}
    return hashlib.sha256(yaml.safe_dump(data, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FieldPolicy:
    """A verified ``field_policy.yaml`` (:func:`verify`): its model, threshold, default, the
    template it was calibrated on (``path``, ``sha256`` of the spec, ``prompt_sha256`` of the
    prompt alone, ``fields``) and each calibrated field's entry, whose ``reason`` is recomputed from
    its counts."""

    path: Path
    model: dict
    threshold: float
    default: str
    fields: dict  # name -> {"repair", "verdict", "reason", ...}
    template: dict = dataclass_field(default_factory=dict)

    def choice(self, name: str) -> tuple[str, str]:
        """The repair for an edit of field ``name`` and why."""
        f = self.fields.get(name)
        if f is None:
            return self.default, (f"policy {self.path}: field {name!r} was not calibrated (calibrated: "
                                  f"{', '.join(self.fields)}); the policy's default")
        if f["repair"] == "none":  # degenerate (verified): the model sees no change; keep the text current
            return "field_only", f"policy {self.path}: {name}: {f['reason']}"
        return f["repair"], f"policy {self.path}: {name}: {f['verdict']}: {f['reason']}"

    def check_spec(self, spec, *also) -> None:
        """Refuse, in one line, applying this policy to the calibration spec ``spec`` (or any of
        ``also``) unless it was calibrated on it: the spec's digest and its fields."""
        specs = (spec, *also)
        want = self.template.get("sha256")
        if not any(s.digest() == want for s in specs):
            raise KvprobeError(f"{self.path} was calibrated on another template ({self.template.get('path')}, digest "
                               f"{want}; {spec.path} has {spec.digest()}): its evidence is of that template; calibrate "
                               f"this one")
        self.check_fields(spec.fields, spec.path)

    def check_fields(self, names, where) -> None:
        """Refuse, in one line, a template (``where``) whose field names are not the calibrated ones:
        the part of :meth:`check_spec` that needs no tokenizer (a padded spec is made with one)."""
        known = self.template.get("fields") or []
        if set(known) != set(names):
            raise KvprobeError(f"{self.path} was calibrated on a template whose fields are {', '.join(known)}, not "
                               f"{where}'s ({', '.join(names)}); calibrate this template")

    def check_case(self, case) -> None:
        """Refuse, in one line, applying this policy to an edit (an EditCase) of another prompt: a
        template case (an EditableContext's) must have the calibrated prompt's digest, where the file
        records one; the edited field and the case's other fields must be the template's."""
        want = self.template.get("prompt_sha256")
        if want and case.template is not None:
            got = prompt_digest(case.template, case.question, case.options, case.system)
            if got != want:
                raise KvprobeError(f"{self.path} was calibrated on another prompt ({self.template.get('path')}, prompt "
                                   f"digest {want}; this one's is {got}): its evidence is of that prompt; calibrate "
                                   f"this one (`kvprobe calibrate`)")
        names = [case.field, *(case.values or {})]
        known = self.template.get("fields") or []
        unknown = [n for n in names if n not in known]
        if unknown:
            raise KvprobeError(f"{self.path} was calibrated on a template whose fields are {', '.join(known)}; this "
                               f"prompt's field {unknown[0]!r} is not one of them: calibrate this prompt")


class _Refused(Exception):
    pass


def verify(data, path, parse) -> FieldPolicy:
    """Check a field policy against its own numbers and return it, or refuse it in one line naming
    the file (a :class:`~kvprobe.errors.KvprobeError`).

    A policy is evidence, so every verdict is recomputed: each candidate's bounds from its recorded
    counts at the recorded threshold (kvprobe's alphas, the lower one shared by the candidates),
    the field's relevance from its change rate, and the field's repair and verdict from those by the
    calibration's own rule (:func:`kvprobe.stopping.rule.decide`); a ``degenerate`` field (repair
    ``none``) must have mostly same-token-id draws, an ``unmeasurable`` one gets the oracle. A repair
    that is not a repair (``stale``, ``hoist``, ``auto``) is never accepted, and the default is the
    oracle. What it cannot see is a file whose counts were all rewritten consistently: it checks
    evidence, it is not a signature. ``parse`` is :func:`kvprobe.editor.strategies.parse_strategy`
    (handed in: the editor sits above this module)."""
    path = Path(path)
    try:
        return _verify(data, path, parse)
    except _Refused as exc:
        raise KvprobeError(f"{path}: {exc}; {WRITER} writes this file (`kvprobe check-policy` checks one)") from None


def _verify(data, path: Path, parse) -> FieldPolicy:
    from kvprobe.identity import KEYS, malformed
    from kvprobe.defaults import THRESHOLD_RANGE, is_threshold
    from kvprobe.stopping.rule import (DEGENERATE_SHARE, MIN_DRAWN, PROCEDURES, FieldResult, chain_problem, decide,
                                       is_candidate, relevance, verdict_of)
    from kvprobe.stopping.sequence import ALPHA_LOWER, ALPHA_UPPER, Sequence

    def bad(where: str, what: str):
        raise _Refused(f"{where} {what}")

    def number(x) -> bool:
        return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)

    def count(x, where: str, lo: int = 0, hi: float = math.inf) -> int:
        if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
            bad(where, f"is {x!r}, accepted: a whole number in [{lo}, {hi:g}]")
        return x

    def close(got, want: float, where: str) -> None:
        if not number(got) or abs(got - want) > TOL:
            bad(where, f"is {got!r}, but its counts give {want:.4f}")

    if not isinstance(data, dict):
        bad("the file", "is not a mapping")
    version = data.get("kvprobe_field_policy")
    if type(version) is not int or version not in READS:
        bad("kvprobe_field_policy", f"is {version!r}, this kvprobe reads {' and '.join(map(str, READS))}")
    keys = TOP_KEYS if version >= 4 else tuple(k for k in TOP_KEYS if k != "procedure")
    extra = [k for k in data if k not in keys]
    if extra:
        bad(f"key {extra[0]!r}", f"is not a field policy's; its keys: {', '.join(keys)}")
    missing = [k for k in keys if k not in data]
    if missing:
        bad(f"key {missing[0]!r}", "is missing")
    procedure = data.get("procedure", "shared")
    if procedure not in PROCEDURES:
        bad("procedure", f"is {procedure!r}, accepted: {', '.join(PROCEDURES)}")
    model = data["model"]
    if malformed(model, ("spec", *KEYS)):
        bad("model", f"must hold spec, {', '.join(KEYS)}")
    thr = data["threshold"]
    if not is_threshold(thr):
        bad("threshold", f"is {thr!r}, accepted: {THRESHOLD_RANGE}")
    for key, want in (("alpha_lower", ALPHA_LOWER), ("alpha_upper", ALPHA_UPPER)):
        if not number(data[key]) or abs(data[key] - want) > 1e-12:
            bad(key, f"is {data[key]!r}; this kvprobe's bounds spend {want:g} (a policy with other error levels is "
                     f"not one it wrote)")
    cands = data["candidates"]
    if not isinstance(cands, list) or not cands or not all(isinstance(c, str) for c in cands) \
            or len(set(cands)) != len(cands):
        bad("candidates", f"is {cands!r}, accepted: a list of distinct repair specs")
    for c in cands:
        try:
            spec = parse(c).spec
        except KvprobeError as exc:
            bad("candidates", f"names {c!r}, not a strategy ({exc})")
        if spec != c or not is_candidate(spec):
            bad("candidates", f"names {c!r}, which is not a repair a calibration measures (stale, hoist, oracle and "
                              f"auto are not)")
    max_pairs = count(data["max_pairs"], "max_pairs", 1)
    if data["default"] != DEFAULT:
        bad("default", f"is {data['default']!r}; a field the policy did not calibrate gets the oracle ({DEFAULT!r})")
    template = data["template"]
    tfields = template.get("fields") if isinstance(template, dict) else None
    if not isinstance(template, dict) or not isinstance(template.get("sha256"), str) \
            or not isinstance(tfields, list) or not tfields \
            or not all(isinstance(n, str) and n.isidentifier() for n in tfields) or len(set(tfields)) != len(tfields):
        bad("template", "must hold path, sha256 and fields (the calibrated template's distinct field names)")
    if version >= 3 and not isinstance(template.get("prompt_sha256"), str):
        bad("template.prompt_sha256", "is missing")
    fields = data["fields"]
    if not isinstance(fields, dict) or not fields:
        bad("fields", "must map each calibrated field to its repair")
    chain = procedure == "chain"
    seq = Sequence(threshold=thr, m=len(cands), chain=max_pairs if chain else 0)
    change_seq = Sequence(threshold=thr)
    checked = {}
    for name, f in fields.items():
        at = f"fields.{name}"
        if not isinstance(name, str) or name not in tfields:
            bad(f"field {name!r}", f"is not a field of the calibrated template ({', '.join(tfields)})")
        if not isinstance(f, dict):
            bad(at, "must be a mapping")
        extra = [k for k in f if k not in FIELD_KEYS]
        if extra:
            bad(f"{at}.{extra[0]}", f"is not a field entry's key; its keys: {', '.join(FIELD_KEYS)}")
        for key in ("repair", "verdict", "reason"):
            if not isinstance(f.get(key), str):
                bad(f"{at}.{key}", "must be text")
        verdict, repair = f["verdict"], f["repair"]
        if verdict not in VERDICTS:
            bad(f"{at}.verdict", f"is {verdict!r}, accepted: {', '.join(VERDICTS)}")
        if repair != "none":
            try:
                spec = parse(repair).spec
            except KvprobeError as exc:
                bad(f"{at}.repair", f"is not a strategy ({exc})")
            if spec != DEFAULT and spec not in cands:
                bad(f"{at}.repair", f"is {repair!r}: neither a calibrated candidate ({', '.join(cands)}) nor the "
                                    f"oracle")
        pairs = count(f.get("pairs"), f"{at}.pairs", 0, max_pairs)
        skipped = count(f.get("skipped_pairs"), f"{at}.skipped_pairs")
        same = count(f.get("same_id_pairs"), f"{at}.same_id_pairs", 0, skipped) if version >= 3 else None
        rate = f.get("change_rate")
        if not isinstance(rate, dict):
            bad(f"{at}.change_rate", "must hold k, n, value, lo and hi")
        changed = count(rate.get("k"), f"{at}.change_rate.k", 0, pairs)
        if rate.get("n") != pairs:
            bad(f"{at}.change_rate.n", f"is {rate.get('n')!r}, not the field's {pairs} pairs")
        if pairs:
            close(rate.get("value"), changed / pairs, f"{at}.change_rate.value")
        elif rate.get("value") is not None:
            bad(f"{at}.change_rate.value", f"is {rate.get('value')!r} with no pair measured")
        close(rate.get("lo"), change_seq.lower(changed, pairs), f"{at}.change_rate.lo")
        close(rate.get("hi"), change_seq.upper(changed, pairs), f"{at}.change_rate.hi")
        want = relevance(verdict, changed, pairs, change_seq)
        if f.get("relevance") != want:
            bad(f"{at}.relevance", f"is {f.get('relevance')!r}, but its counts give {want!r}")
        strategies = f.get("strategies")
        if not isinstance(strategies, dict) or sorted(strategies) != sorted(cands):
            bad(f"{at}.strategies", f"must hold the candidates {', '.join(cands)}")
        counts = {}
        for s in cands:
            e = strategies[s]
            sat = f"{at}.strategies.{s}"
            if not isinstance(e, dict) or [k for k in e if k not in STRATEGY_KEYS]:
                bad(sat, f"must hold {', '.join(STRATEGY_KEYS)}")
            a = e.get("agreement")
            if not isinstance(a, dict) or (a.get("n") != pairs and not chain):
                bad(f"{sat}.agreement", f"must hold k and n = the field's {pairs} pairs")
            n = count(a.get("n"), f"{sat}.agreement.n", 0, pairs) if chain else pairs
            if version >= 3:
                k = count(a.get("k"), f"{sat}.agreement.k", 0, n)
                if n:
                    close(a.get("value"), k / n, f"{sat}.agreement.value")
            else:  # version 2 wrote value (4 decimals) and n: k is the one whole number that rounds to it
                value = a.get("value")
                if pairs and (not number(value) or abs(value * pairs - round(value * pairs)) > 5e-5 * pairs + 1e-9):
                    bad(f"{sat}.agreement.value", f"is {value!r}, which is no whole count of {pairs} pairs")
                k = round(value * pairs) if pairs else 0
                if not 0 <= k <= pairs:
                    bad(f"{sat}.agreement.value", f"is {value!r}, outside [0, 1]")
            close(a.get("lo"), seq.lower(k, n), f"{sat}.agreement.lo")
            close(a.get("hi"), seq.upper(k, n), f"{sat}.agreement.hi")
            want = verdict_of(seq, k, n) if version >= 4 else seq.verdict(k, n)  # 2 and 3 wrote "open" for 0 pairs
            if e.get("verdict") != want:
                bad(f"{sat}.verdict", f"is {e.get('verdict')!r}, but {k} of {n} at {thr:g} give {want!r}")
            if chain:
                unchanged = count(e.get("n_unchanged"), f"{sat}.n_unchanged", 0, n)
            else:
                unchanged = pairs - changed
                if e.get("n_unchanged") != unchanged:
                    bad(f"{sat}.n_unchanged", f"is {e.get('n_unchanged')!r}, not the {unchanged} pairs the oracle's "
                                              f"decision did not change")
            flips = count(e.get("spurious_flips"), f"{sat}.spurious_flips", 0, min(unchanged, n - k))
            close(e.get("flip_hi"), 1 - seq.lower(unchanged - flips, unchanged) if unchanged else 1.0,
                  f"{sat}.flip_hi")
            frac = e.get("frac_recomputed")
            if not (isinstance(frac, float) and math.isnan(frac)) and not (number(frac) and 0 <= frac <= 1):
                bad(f"{sat}.frac_recomputed", f"is {frac!r}, accepted: a share in [0, 1]")
            counts[s] = [k, n]
        problem = chain_problem(counts, {s: strategies[s]["n_unchanged"] for s in cands}, seq, pairs, changed) \
            if chain else None
        if problem:
            bad(f"{at}.strategies{problem[0]}", problem[1])
        reason = f["reason"]
        drawn = pairs + skipped
        if verdict in ("degenerate", "unmeasurable"):
            if drawn < MIN_DRAWN or skipped <= DEGENERATE_SHARE * drawn:
                bad(f"{at}.verdict", f"is {verdict}, but {skipped} of {drawn} drawn pairs were skipped (it takes more "
                                     f"than half of at least {MIN_DRAWN})")
            if verdict == "degenerate":
                if same is None:
                    bad(f"{at}.verdict", "is degenerate in a version-2 file, which does not record how many skipped "
                                         "pairs had the same token ids (it also called edits that cannot be made in "
                                         "place degenerate): calibrate again")
                if same * 2 <= skipped:
                    bad(f"{at}.verdict", f"is degenerate, but only {same} of its {skipped} skipped pairs had the "
                                         f"same token ids: the field was not measured, and gets the oracle")
                want_repair = "none"
            else:
                if same is not None and same * 2 > skipped:
                    bad(f"{at}.verdict", f"is unmeasurable, but {same} of its {skipped} skipped pairs had the same "
                                         f"token ids (degenerate)")
                want_repair = DEFAULT
            if repair != want_repair:
                bad(f"{at}.repair", f"is {repair!r}; a {verdict} field's repair is {want_repair!r}")
        else:
            res = FieldResult(name, pairs=pairs, changed=changed, counts={s: list(c) for s, c in counts.items()})
            if not decide(res, seq, cands):
                if pairs < max_pairs and drawn < 2 * max_pairs + 10:
                    bad(f"{at}.verdict", f"is {verdict}, but after {pairs} of at most {max_pairs} pairs the "
                                         f"calibration goes on")
                decide(res, seq, cands, final=True)
            if (res.verdict, res.chosen) != (verdict, repair):
                bad(at, f"says {repair} ({verdict}), but its counts give {res.chosen} ({res.verdict})")
            reason = res.reason
        checked[name] = {**f, "reason": reason}
    return FieldPolicy(path, model, float(thr), DEFAULT, checked, dict(template))


def load_any(path, lm, parse):
    """A ``field_policy.yaml`` (:class:`FieldPolicy`) or a ``topk.yaml`` (:class:`kvprobe.policy.Policy`)
    for the model ``lm`` (None: no model check); another model's file is refused in one line.
    ``parse`` is :func:`kvprobe.editor.strategies.parse_strategy` (every repair the file names is
    checked with it)."""
    from kvprobe import policy as policies

    from kvprobe import yamlio

    path = Path(path)
    data = None
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            text = None  # policies.load says what is wrong with it
        try:
            data = yaml.safe_load(text) if text is not None else None
        except yaml.YAMLError:
            data = None
        if isinstance(data, dict) and "kvprobe_field_policy" in data:
            data = yamlio.load(text, str(path))  # a key given twice is refused
    if not (isinstance(data, dict) and "kvprobe_field_policy" in data):
        return policies.load(path, lm)
    policy = verify(data, path, parse)
    if lm is not None:
        from kvprobe.identity import ModelIdentity

        mine = ModelIdentity.of_model(lm)
        differ = mine.differ(policy.model)
        if differ:
            raise KvprobeError(f"{path} was calibrated for {policy.model.get('spec')}, not {mine.spec} "
                               f"({', '.join(differ)} differ); calibrate this model")
    return policy


def write(policy: dict, path: Path | str) -> Path:
    from kvprobe.results import atomic_write

    return atomic_write(Path(path), lambda tmp: tmp.write_text(yaml.safe_dump(policy, sort_keys=False, width=110)))
