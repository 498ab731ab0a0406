"""YAML read as a user wrote it: no key given twice, and, for the files whose values reach the model
(a calibration spec), no unquoted scalar that YAML 1.1 turns into something other than text.

PyYAML's ``safe_load`` keeps the last of two equal keys and reads ``10:45`` as the base-60 number
645, ``010`` as 8, ``0x1F`` as 31, ``yes``/``on`` as True, ``2026-03-04`` as a date and ``null``/``~``
as None (docs/calibrate.md, "Values as typed"). Both loaders here refuse, in one line that names the
file and the line, instead of guessing::

    load(text, "run.yaml")          # numbers stay numbers; a repeated key is refused
    load_text(text, "spec.yaml")    # every scalar must be text; 10:45 unquoted is refused
"""

from __future__ import annotations

import yaml
from yaml.constructor import ConstructorError

from kvprobe.errors import KvprobeError

_STR = "tag:yaml.org,2002:str"
_KINDS = {"tag:yaml.org,2002:int": "the number", "tag:yaml.org,2002:float": "the number",
          "tag:yaml.org,2002:bool": "the boolean", "tag:yaml.org,2002:null": "null",
          "tag:yaml.org,2002:timestamp": "the date"}


class _Refused(Exception):
    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line, self.message = line, message


class _UniqueKeys(yaml.SafeLoader):
    """SafeLoader that refuses a mapping holding one key twice."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    break
                if first != key_node.start_mark.line + 1:
                    raise _Refused(key_node.start_mark.line + 1,
                                   f"key {key!r} is given twice (lines {first} and {key_node.start_mark.line + 1}); "
                                   f"give each key once")
        return super().construct_mapping(node, deep=deep)


class _TextOnly(_UniqueKeys):
    """:class:`_UniqueKeys` that refuses every unquoted scalar YAML would read as anything but text."""

    def construct_scalar(self, node):
        if isinstance(node, yaml.ScalarNode) and node.tag != _STR and node.tag in _KINDS:
            line = node.start_mark.line + 1
            if not node.value:
                raise _Refused(line, "an empty value is read by YAML as null, not as text; give the text, or leave "
                                     "the key out")
            value = yaml.SafeLoader("").construct_object(node)
            shown = "" if value is None else f" {value}"
            raise _Refused(line, f"{node.value} is read by YAML as {_KINDS[node.tag]}{shown}, not as text; quote it "
                                 f"(\"{node.value}\") so that it reaches the model as typed")
        return super().construct_scalar(node)


def _load(text: str, where: str, loader):
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 (a SafeLoader subclass)
    except _Refused as exc:
        raise KvprobeError(f"{where}: line {exc.line}: {exc.message}") from None
    except ConstructorError as exc:
        raise KvprobeError(f"{where} is not valid YAML: {' '.join(str(exc).split())}") from None
    except yaml.YAMLError as exc:
        raise KvprobeError(f"{where} is not valid YAML: {str(exc).splitlines()[0]}") from None


def load(text: str, where: str):
    """``text`` as YAML (``where`` names it in errors); a key given twice is refused."""
    return _load(text, where, _UniqueKeys)


def load_text(text: str, where: str):
    """``text`` as YAML whose scalars are all text: a key given twice, or an unquoted scalar that
    YAML 1.1 reads as a number, a boolean, a date or null, is refused (quoted, it is text)."""
    return _load(text, where, _TextOnly)
