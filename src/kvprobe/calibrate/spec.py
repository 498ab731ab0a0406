"""A calibration spec (``kvprobe calibrate``'s input): a template with ``{name}`` fields, each
field's value set, the question and its two options; read strictly from YAML (:func:`load_spec`), and
the prompt it gives at a set of values (:func:`context_for`)."""

from __future__ import annotations

import hashlib
import string
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvprobe.calibrate.values import ValueSet, parse_values
from kvprobe.errors import KvprobeError


@dataclass
class CalibrationSpec:
    """A template with ``{name}`` fields, each field's value set, the question and its two options."""

    template: str
    fields: dict[str, ValueSet]
    question: str
    options: list[str]
    system: str | None = None
    path: str = "<spec>"

    @property
    def pieces(self) -> list[tuple[str, str]]:
        """("text", literal) and ("field", name) in template order."""
        out = []
        for literal, name, fmt, conv in string.Formatter().parse(self.template):
            if literal:
                out.append(("text", literal))
            if name is not None:
                out.append(("field", name))
        return out

    def digest(self) -> str:
        data = {"template": self.template, "fields": {k: v.spec for k, v in self.fields.items()},
                "question": self.question, "options": self.options, "system": self.system}
        return hashlib.sha256(yaml.safe_dump(data, sort_keys=True).encode()).hexdigest()[:16]

    def prompt_digest(self) -> str:
        """The digest of the prompt alone (template, question, options, system; not the value sets):
        what an :class:`~kvprobe.api.EditableContext` built from this spec has too
        (:func:`kvprobe.field_policy.prompt_digest`), so a field policy can be checked against a
        context it is applied to."""
        from kvprobe.field_policy import prompt_digest

        return prompt_digest(self.template, self.question, self.options, self.system)


def load_spec(path: Path | str) -> CalibrationSpec:
    """A calibration spec from YAML: ``template``, ``fields`` (name: value set), ``question``,
    ``options`` (two), optional ``system``. Every problem is one line naming the file. Values reach
    the model as typed: a key given twice, or an unquoted scalar YAML would read as a number, a
    boolean, a date or null (``10:45``, ``010``, ``yes``), is refused (:mod:`kvprobe.yamlio`), and so
    is a value that is not one line of plain text (:func:`kvprobe.datasets.schema.value_problem`)."""
    from kvprobe import yamlio
    from kvprobe.datasets.schema import template_pieces

    path = Path(path)
    if path.is_dir():
        raise KvprobeError(f"calibration spec {path} is a folder; give a YAML file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KvprobeError(f"calibration spec not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KvprobeError(f"{path} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    data = yamlio.load_text(text, str(path))
    keys = ("template", "fields", "question", "options")
    if not isinstance(data, dict) or any(k not in data for k in keys):
        missing = [k for k in keys if not isinstance(data, dict) or k not in data]
        raise KvprobeError(f"{path} is not a calibration spec (it lacks {', '.join(missing)}); keys: "
                           f"{', '.join(keys)}, system")
    extra = sorted(set(data) - {*keys, "system"})
    if extra:
        raise KvprobeError(f"{path}: unknown key {extra[0]!r}; keys: {', '.join(keys)}, system")
    template, fields, question, options = (data[k] for k in keys)
    if not isinstance(template, str) or not template.strip():
        raise KvprobeError(f"{path}: template must be non-empty text with {{name}} for each field")
    if not isinstance(fields, dict) or not fields:
        raise KvprobeError(f"{path}: fields must map each field name to its values")
    if not isinstance(question, str) or not question.strip():
        raise KvprobeError(f"{path}: question must be non-empty text")
    if not (isinstance(options, list) and len(options) == 2 and all(isinstance(o, str) and o for o in options)
            and options[0] != options[1]):
        raise KvprobeError(f"{path}: options must be a list of two different answers, got {options!r}")
    if data.get("system") is not None and not isinstance(data["system"], str):
        raise KvprobeError(f"{path}: system must be text")
    for name in fields:
        if not isinstance(name, str) or not name.isidentifier():
            raise KvprobeError(f"{path}: field name {name!r} is not a name (letters, digits, _)")
    try:
        named = [name for _, name in template_pieces(template) if name is not None]
    except ValueError as exc:
        raise KvprobeError(f"{path}: {exc}") from None
    for name in named:
        if not name.isidentifier():
            raise KvprobeError(f"{path}: template field {{{name}}} is not a name (letters, digits, _)")
    if sorted(named) != sorted(fields) or len(set(named)) != len(named):
        raise KvprobeError(f"{path}: the template's fields ({', '.join(named) or 'none'}) must be the fields "
                           f"listed ({', '.join(fields)}), each once")
    return CalibrationSpec(template, {k: parse_values(v, f"{path}: fields.{k}") for k, v in fields.items()},
                           question, list(options), data.get("system"), str(path))


def context_for(lm, spec: CalibrationSpec, values: dict[str, str], form: str = "auto"):
    """An EditableContext holding the template at ``values``."""
    from kvprobe.api import EditableContext

    ctx = EditableContext(lm, system=spec.system, form=form)
    for kind, x in spec.pieces:
        if kind == "text":
            ctx.add_text(x)
        else:
            ctx.add_field(x, values[x])
    return ctx.ask(spec.question, spec.options)
