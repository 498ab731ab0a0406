"""The sweep report of a real `kvprobe sweep` on a toy: the verdict per layout leads the page, the
figures are inline SVG, every cell has its row, the same folder gives the same bytes, a grid of
several styles gets one panel each, and a folder that holds no sweep is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from markupsafe import escape

from kvprobe.errors import KvprobeError
from kvprobe.reports.sweep import render_sweep_report
from tests import cli_process

ARGS = ["sweep", "--model", "toy-qwen2", "--layouts", "record,lines", "--filler-tokens", "0,40", "--n", "10",
        "--no-report"]


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    """A finished 2 layouts x 2 lengths sweep of toy-qwen2 (about 10 s)."""
    out = tmp_path_factory.mktemp("sweep-report") / "toy"
    proc = cli_process.run(*ARGS, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (out / "report.html").exists()
    return out


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / "sweep_manifest.json").read_text())


def test_the_page_leads_with_each_layouts_verdict(swept):
    path = render_sweep_report(swept)
    assert path == swept / "report.html"
    html = path.read_text(encoding="utf-8")
    manifest = manifest_of(swept)
    answer = html[html.index('<section id="answer">'):html.index('<section id="figures">')]
    assert set(manifest["layout_verdicts"]) == {"record", "lines"}
    for layout, verdict in manifest["layout_verdicts"].items():
        assert f'data-layout="{layout}" data-verdict="{verdict}"' in answer
        assert "field-only patch recovery" in answer
    assert str(escape(manifest["verdict_rule"])) in answer
    assert "Erratum placement." in answer  # erratum and erratum_turn both ran
    figures = html[html.index('<section id="figures">'):html.index('<section id="cells">')]
    assert figures.count("<svg ") >= 2 and 'id="fig-field-only"' in figures and 'id="fig-erratum"' in figures
    table = html[html.index('<table id="cell-table">'):]
    for cell, verdict in manifest["cell_verdicts"].items():
        assert f'<tr data-cell="{cell}"><td><code>{cell}</code></td>' in table
    assert "<code>erratum_turn</code>" in table and "punct" in table
    facts = html[html.index('<section id="facts">'):]
    assert manifest["model"]["weights_hash"] in facts and f"{manifest['wall_s']['cells']:.1f} s" in facts


def test_the_same_folder_gives_the_same_bytes(swept):
    first = render_sweep_report(swept).read_bytes()
    second = render_sweep_report(swept).read_bytes()
    assert first == second
    assert str(swept.parent).encode() not in first  # nothing that depends on where the folder lies
    assert [p.name for p in swept.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_several_styles_get_a_panel_and_columns_each(swept, tmp_path):
    folder = tmp_path / "styled"
    shutil.copytree(swept, folder)
    summary = pd.read_parquet(folder / "sweep_summary.parquet")
    words = summary.assign(field_style="words", cell=summary.cell.str.replace(".key.", ".words.", regex=False))
    pd.concat([summary, words], ignore_index=True).to_parquet(folder / "sweep_summary.parquet", index=False)
    manifest = manifest_of(folder)
    manifest["cells"] |= {c.replace(".key.", ".words."): {**v, "field_style": "words"}
                          for c, v in manifest["cells"].items()}
    manifest["config"]["field_styles"] = ["key", "words"]
    (folder / "sweep_manifest.json").write_text(json.dumps(manifest))
    html = render_sweep_report(folder).read_text(encoding="utf-8")
    figures = html[html.index('<section id="figures">'):html.index('<section id="cells">')]
    assert "field key, rule allow" in figures and "field words, rule allow" in figures
    assert "<th rowspan=\"2\">field style</th>" in html
    assert all(f'data-cell="{c}"' in html for c in manifest["cells"])


def test_a_folder_without_a_sweep_manifest_is_refused(tmp_path):
    folder = tmp_path / "not-a-sweep"
    folder.mkdir()
    (folder / "sweep_summary.parquet").write_bytes(b"")
    with pytest.raises(KvprobeError) as err:
        render_sweep_report(folder)
    message = str(err.value)
    assert "\n" not in message and str(folder) in message and "sweep_manifest.json" in message
    assert not (folder / "report.html").exists()
    with pytest.raises(KvprobeError, match="is not a folder"):
        render_sweep_report(tmp_path / "missing")
