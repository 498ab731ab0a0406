"""The built-in extension points, light: what the help texts list, importable without torch
(``kvprobe --help`` loads no model stack; tests/cli/test_conventions.py checks both).

The full registries are built from here, not copied: :mod:`kvprobe.probes` imports the modules
:data:`PROBES` names (so this tuple is the run order), and :func:`kvprobe.models.families` reads
the files :func:`family_files` lists. Only the built-in strategies' grammar is a copy
(:data:`STRATEGY_GRAMMAR`), because the strategy classes that define it import torch; a test fails
until it equals :func:`kvprobe.editor.spec_grammar` on the built-in registry.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# The built-in probes, in the order they run: each is the module kvprobe.probes.<name>, which
# registers the ProbeStage of that name (kvprobe.probes refuses one that does not).
PROBES = ("locality", "attention", "knockout", "linear")

# The built-in strategies' grammar, each as kvprobe.editor.strategies.<class>.grammar() gives it
# (tests/cli/test_conventions.py checks they agree). A strategy registered by a plugin shows in
# `kvprobe strategies`.
STRATEGY_GRAMMAR = ("stale", "field_only",
                    "selective:K:RANKING (RANKING in causal/random/attention/recency/aggregators)",
                    "cacheblend:R (0<R<=1)", "erratum[:paper|short]", "field_erratum[:paper|short]",
                    "erratum_turn[:paper|short]", "field_erratum_turn[:paper|short]", "hoist", "oracle",
                    "auto[:TOPK.YAML] (TOPK.YAML a policy file of this model)")

FAMILY_PATH = "KVPROBE_FAMILY_PATH"  # more folders of family files, separated like PATH
FAMILY_DIR = Path(__file__).resolve().parent / "models" / "families"  # read as a folder, not imported


def family_files() -> list[tuple[Path, bool]]:
    """The package's family files, then each folder's in ``$KVPROBE_FAMILY_PATH`` (``(path, builtin)``)."""
    files = [(p, True) for p in sorted(FAMILY_DIR.glob("*.yaml"))]
    seen = set()
    for folder in (Path(f) for f in os.environ.get(FAMILY_PATH, "").split(os.pathsep) if f):
        if folder.resolve() not in seen:  # a folder named twice is read once
            seen.add(folder.resolve())
            files += [(f, False) for f in sorted(folder.glob("*.yaml"))]
    return files


def toy_family_names() -> list[str]:
    """The families whose file has a ``toy:`` key, sorted (as kvprobe.models.toy_folder.toy_families
    gives them), read from the files' top-level lines without loading or checking them: for help
    texts. A file that cannot be read is left out here; loading the families reports it."""
    names = set()
    for path, _ in family_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        family = re.search(r"^family:\s*([\w.-]+)\s*(#.*)?$", text, flags=re.M)
        if family and re.search(r"^toy:", text, flags=re.M):
            names.add(family.group(1))
    return sorted(names)
