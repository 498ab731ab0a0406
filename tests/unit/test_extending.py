"""docs/extending.md's three examples, run as written: a probe with its report section, an edit
strategy, and a model family."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def blocks(section: str, lang: str) -> list[str]:
    """The ``lang`` code blocks under the ``## section`` heading of docs/extending.md, in order."""
    text = DOC.read_text()
    body = text.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", body, flags=re.S)


def run_as_module(name: str, code: str, **names) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(names)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(code, str(DOC), "exec"), module.__dict__)
    return module


def test_a_probe_and_its_section(tmp_path):
    from kvprobe.config import RunConfig
    from kvprobe.pipeline import run
    from kvprobe.probes import STAGES
    from kvprobe.reports.html import render_html
    from kvprobe.reports.sections import SECTIONS
    from tests.conftest import tiny_model

    probe_code, section_code = blocks("A probe", "python")
    (template,) = blocks("A probe", "html")
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "kv_drift.html").write_text(template)
    try:
        probe = run_as_module("kv_drift_probe", probe_code)
        run_as_module("kv_drift_section", section_code, TEMPLATE_DIR=str(tmp_path / "templates"))
        assert STAGES["kv_drift"] is probe.STAGE
        cfg = RunConfig(model="tiny-qwen2", n=3, valid_only=False, probes=["kv_drift"], strategies=["stale", "oracle"],
                        ks=[1], rankings=["random"])
        out = tmp_path / "run"
        run(cfg, out, lm=tiny_model("tiny-qwen2"))
        drift = __import__("pandas").read_parquet(out / "kv_drift.parquet")
        assert set(drift.metric) == {"key_drift"} and drift.layer.nunique() == 2
        assert (drift[drift.layer == 0].value == 0).all()  # layer-0 keys see only their own token
        assert (drift[drift.layer == 1].value > 0).all()  # later layers read the changed field
        assert (out / "parts" / "kv_drift").is_dir()  # resumable per case, like the built-in probes
        html = render_html([out])
        assert 'data-section="kv_drift"' in html and "key drift (relative L2)" in html
    finally:
        STAGES.pop("kv_drift", None)
        SECTIONS.pop("kv_drift", None)


def test_an_edit_strategy():
    from kvprobe import editor
    from kvprobe.datasets import align, generate
    from kvprobe.errors import KvprobeError
    from tests.conftest import tiny_model

    (code,) = blocks("An edit strategy", "python")
    try:
        module = run_as_module("field_next_strategy", code)
        assert editor.parse_strategy("field_next:4") == module.FieldNext(4)
        assert "field_next:N (N >= 0)" in editor.spec_grammar()
        with pytest.raises(KvprobeError, match="bad strategy"):
            editor.parse_strategy("field_next:-1")
        lm = tiny_model("tiny-qwen2")
        a = align(generate(1, seed=3)[0], lm.tokenizer)
        ctx = editor.make_context(lm, a)
        everything = editor.apply(ctx, f"field_next:{a.decision_pos}")  # every position from the field on
        got, _ = editor.decide(lm, everything)
        want, _ = editor.decide(lm, editor.apply(ctx, "oracle"))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        df, _ = editor.run_edits(lm, [a.case], ["field_next:2", "oracle"])
        assert set(df.strategy) == {"field_next:2", "oracle"}
    finally:
        editor.STRATEGIES.pop("field_next", None)


def test_a_model_family(tmp_path, monkeypatch):
    from kvprobe.models import families, load_model
    from kvprobe.models.tiny import tiny_names
    from tests.families.suite import EditSuite, FamilySuite

    (yaml_text,) = blocks("A model family", "yaml")
    (tmp_path / "granite.yaml").write_text(yaml_text)
    monkeypatch.setenv("KVPROBE_FAMILY_PATH", str(tmp_path))
    families.cache_clear()
    try:
        assert "tiny-granite" in tiny_names()
        lm = load_model("tiny-granite")
        assert lm.info.family == "granite" and lm.info.rope_unsupported is None and lm.info.rope_check_error < 1e-4
        suite = type("GraniteSuite", (FamilySuite, EditSuite), {"name": "tiny-granite"})()
        for name in dir(suite):
            if name.startswith("test_"):
                getattr(suite, name)()  # every invariant of the family and edit suites
        # the doc's counter-example: Helium rotates interleaved pairs, which the self-check catches
        helium = yaml_text.replace("granite", "helium").replace("Granite", "Helium")
        (tmp_path / "helium.yaml").write_text(helium)
        families.cache_clear()
        assert "self-check failed" in (load_model("tiny-helium").info.rope_unsupported or "")
    finally:
        monkeypatch.delenv("KVPROBE_FAMILY_PATH")
        families.cache_clear()


LLAMA = Path(__file__).resolve().parents[2] / "src" / "kvprobe" / "models" / "families" / "llama.yaml"


def _mine(**changes) -> str:
    """llama.yaml as a user family ``mine`` (its own model type), with lines replaced: key -> new line."""
    lines = LLAMA.read_text().replace("family: llama", "family: mine").replace("model_types: [llama]",
                                                                               "model_types: [mine]").splitlines()
    for key, line in changes.items():
        lines = [line if ln.startswith(f"{key}:") else ln for ln in lines]
    return "\n".join(lines) + "\n"


BAD_FAMILY_FILES = {  # name -> (what to put at x.yaml: bytes, text or None for a folder; what the error says)
    "not UTF-8": (b"family: x\n\xff\xfe\n", "cannot be read as a family file (not UTF-8 text)"),
    "a folder": (None, "is not a family file (it is not a regular file)"),
    "empty": ("", "is not a family file (it is empty)"),
    "a list": ("- family\n- llama\n", "is not a family file (it holds a list, not a mapping of keys)"),
    "not YAML": ("family: [x\n", "is not a family file (not valid YAML"),
    "a key missing": (_mine().replace("lm_head: lm_head\n", ""), "is not a valid family file: has no lm_head"),
    "an unknown key": (_mine() + "rope_style: rotate_half\n", "has an unknown key 'rope_style'"),
    "a path not a string": (_mine(layers="layers: 5"), "layers is 5; accepted: a non-empty string"),
    "proj missing k": (_mine(proj="proj: {q: q_proj, v: v_proj, o: o_proj}"), "proj has no k"),
    "no model types": (_mine(model_types="model_types: []"), "model_types is []"),
    "a built-in family": (LLAMA.read_text(), "names the built-in family 'llama'; a family file may add a family, "
                                             "not replace one"),
    "a built-in model type": (_mine(model_types="model_types: [mine, qwen2]"),
                              "claims model type 'qwen2', which the built-in family 'qwen2' already reads"),
}


@pytest.mark.parametrize("name", list(BAD_FAMILY_FILES))
def test_a_bad_family_file_is_one_line_naming_it(tmp_path, monkeypatch, name):
    from kvprobe.errors import KvprobeError
    from kvprobe.models import families

    content, needle = BAD_FAMILY_FILES[name]
    path = tmp_path / "x.yaml"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    monkeypatch.setenv("KVPROBE_FAMILY_PATH", str(tmp_path))
    families.cache_clear()
    try:
        with pytest.raises(KvprobeError) as exc:
            families()
        assert str(exc.value).startswith(str(path)) and needle in str(exc.value) and "\n" not in str(exc.value)
    finally:
        monkeypatch.delenv("KVPROBE_FAMILY_PATH")
        families.cache_clear()
    assert families()["llama"].model_types == ("llama",)  # the built-in family is as it was


def test_a_user_family_file_is_read_once_and_keeps_its_optional_keys_absent(tmp_path, monkeypatch):
    from kvprobe.models import families

    (tmp_path / "mine.yaml").write_text(_mine())
    monkeypatch.setenv("KVPROBE_FAMILY_PATH", f"{tmp_path}:{tmp_path}")  # a folder named twice is read once
    families.cache_clear()
    try:
        mine = families()["mine"]
        assert mine.model_types == ("mine",) and mine.rope == {"style": "rotate_half",
                                                               "theta": "rope_parameters.rope_theta"}
        assert families()["gemma3"].rope["local_theta"] and "enabled" not in families()["mistral"].sliding
    finally:
        monkeypatch.delenv("KVPROBE_FAMILY_PATH")
        families.cache_clear()


# -- each example added inside kvprobe touches only the files docs/extending.md names ----------------
SRC = Path(__file__).resolve().parents[2] / "src" / "kvprobe"


def _in_package(example: str) -> dict[str, str]:
    """The example as built-in code: file (relative to src/kvprobe) -> its new text. These are the
    files the doc names for it; nothing else changes."""
    if example == "probe":
        probe_code, section_code = blocks("A probe", "python")
        (template,) = blocks("A probe", "html")
        catalog = (SRC / "catalog.py").read_text()
        old = 'PROBES = ("locality", "attention", "knockout", "linear")'
        assert old in catalog
        section_code = section_code.replace('template="kv_drift.html"', 'template="sections/kv_drift.html"')
        return {"probes/kv_drift.py": probe_code, "catalog.py": catalog.replace(old, old[:-1] + ', "kv_drift")'),
                "reports/sections/kv_drift.py": section_code.replace(" template_dir=TEMPLATE_DIR,", ""),
                "reports/templates/sections/kv_drift.html": template}
    if example == "strategy":
        (code,) = blocks("An edit strategy", "python")
        code = code.replace("from kvprobe import editor\n", "").replace("editor.", "")  # inside kvprobe.editor
        code = "\n".join(ln for ln in code.splitlines() if not ln.startswith(("from ", "import ")))
        catalog = (SRC / "catalog.py").read_text()
        old = '"auto[:TOPK.YAML] (TOPK.YAML a policy file of this model)")'
        assert old in catalog
        return {"editor/strategies.py": (SRC / "editor" / "strategies.py").read_text() + "\n\n" + code,
                "catalog.py": catalog.replace(old, '"field_next:N (N >= 0)", ' + old)}  # auto registers last
    (yaml_text,) = blocks("A model family", "yaml")
    return {"models/families/granite.yaml": yaml_text}


CHECKS = {  # what knows the new thing once only those files changed (run in a fresh interpreter)
    "probe": """
from kvprobe import catalog, config
from kvprobe.cli import options
from kvprobe.probes import STAGES, in_order
from kvprobe.reports.sections import SECTIONS
from kvprobe.pipeline import Stopwatch, run_profile
assert list(STAGES)[-1] == "kv_drift" and in_order(["kv_drift", "locality"])[-1].name == "kv_drift"
assert "kv_drift" in config.ALL_PROBES and "kv_drift" in config.RunConfig().probes  # run's default: every probe
assert options.PROBES.endswith(", kv_drift")  # kvprobe run --probes's default and help
assert SECTIONS["kv_drift"].needs == "kv_drift.parquet"
import pandas as pd, tempfile, pathlib, types
out = pathlib.Path(tempfile.mkdtemp())
pd.DataFrame({"strategy": ["oracle"], "cot": [0], "case_id": ["c"], "wall_s": [0.5]}).to_parquet(out / "edits.parquet")
watch = Stopwatch(lambda name, total: lambda: None)
watch.wall = {"validity": 1.0, "locality": 1.0, "kv_drift": 2.0, "edits": 1.0}
profile = run_profile(watch, types.SimpleNamespace(valid_ids=["c"]), out)
assert profile["per_valid_case"]["kv_drift"] == 4.0, profile  # profiled like every registered probe
""",
    "strategy": """
from kvprobe import editor
from kvprobe.cli import options
assert editor.parse_strategy("field_next:4").n == 4
assert options.STRATEGY_GRAMMAR == editor.spec_grammar() and "field_next:N (N >= 0)" in options.STRATEGY_GRAMMAR
""",
    "family": """
from kvprobe.models import families, load_model
from kvprobe.models.tiny import tiny_names
assert "granite" in families() and "tiny-granite" in tiny_names()
assert load_model("tiny-granite").info.family == "granite"
""",
}


@pytest.mark.parametrize("example", ["probe", "strategy", "family"])
def test_adding_an_example_inside_kvprobe_touches_only_the_files_the_doc_names(tmp_path, example):
    import shutil
    import subprocess

    files = _in_package(example)
    doc = " ".join(DOC.read_text().split())
    for rel in files:
        assert f"src/kvprobe/{rel.replace('kv_drift', '<name>')}" in doc, rel
    counts = {"probe": "four files", "strategy": "two files", "family": "one file"}
    assert f"is {counts[example]}" in doc, counts[example]
    copy = tmp_path / "kvprobe"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__", "toys"))
    for rel, text in files.items():
        (copy / rel).write_text(text)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    env.pop("KVPROBE_FAMILY_PATH", None)
    code = f"import kvprobe; assert kvprobe.__file__.startswith({str(tmp_path)!r})\n" + CHECKS[example]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
