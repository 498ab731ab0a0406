"""The section registry is the report's one list of sections: a section registered at test time, with its
own table and template, shows in its place where a folder has that table and nowhere else."""

from __future__ import annotations

import pandas as pd
import pytest
from jinja2 import ChoiceLoader, FileSystemLoader

from kvprobe.reports import html as report_html
from kvprobe.reports.html import render_html
from kvprobe.reports.sections import SECTIONS, Section, in_order, register
from kvprobe.reports.stats import Stat
from tests.reports.test_render import ALL, columns, sections

EXTRA = "extra.parquet"


def _build_extra(run) -> dict | None:
    table = run.table(EXTRA)
    return None if table.empty else {"value": Stat.of(table["value"])}


@pytest.fixture
def extra_section(tmp_path, monkeypatch):
    """A throw-away section between serving and the run facts, reading ``extra.parquet`` (a table the
    loader does not know) and drawn by a template in a folder of its own, added to the page's loader."""
    folder = tmp_path / "extra-templates"
    (folder / "sections").mkdir(parents=True)
    (folder / "sections" / "extra.html").write_text(
        '{% from "macros.html" import stat %}\n<p class="extra">mean value {{ stat(d.value) }}</p>\n')
    page_env = report_html._env

    def env():
        env = page_env()
        env.loader = ChoiceLoader([env.loader, FileSystemLoader(folder)])
        return env

    monkeypatch.setattr(report_html, "_env", env)
    section = register(Section(id="extra", title="Extra", needs=EXTRA, intro="A section registered by a test.",
                               order=85, build=_build_extra, template="sections/extra.html", tables=(EXTRA,)))
    yield section
    del SECTIONS[section.id]


def _extra_table(folder):
    pd.DataFrame({"value": [0.25, 0.5, 0.75] * 4}).to_parquet(folder / EXTRA, index=False)


def test_a_registered_section_shows_where_its_table_is(extra_section, variant, tmp_path):
    with_extra, plain = variant("with-extra"), variant("plain")
    _extra_table(with_extra)
    html = render_html([with_extra])
    assert sections(html) == ALL[:-1] + ["extra", "facts"]
    n = len(SECTIONS)
    assert f"<h2>{n - 1}. Extra</h2>" in html and f"<h2>{n}. Run facts</h2>" in html
    body = html.split('<section id="extra"', 1)[1].split("</section>", 1)[0]
    assert '<p class="intro">A section registered by a test.</p>' in body
    assert '<p class="extra">mean value <span class="stat' in body and "n=12" in body
    assert sections(render_html([plain])) == ALL
    both = render_html([plain, with_extra])
    assert sections(both) == ALL[:-1] + ["extra", "facts"]
    assert columns(both, "extra") == ["tiny-qwen2 (plain)", "tiny-qwen2 (with-extra)"]
    body = both.split('<section id="extra"', 1)[1].split("</section>", 1)[0]
    assert body.count("Not in this folder (no extra.parquet)") == 1 and body.count('class="extra"') == 1
    # its table alone makes a results folder
    alone = tmp_path / "extra-only"
    alone.mkdir()
    _extra_table(alone)
    assert sections(render_html([alone])) == ["extra"]


def test_every_section_has_its_template():
    env = report_html._env()
    for section in in_order():
        assert env.get_template(section.template).name == section.template


def test_a_section_id_or_order_is_registered_once():
    notes = SECTIONS["notes"]
    with pytest.raises(ValueError, match="registered twice"):
        register(notes)
    with pytest.raises(ValueError, match="has the order 10 of 'notes'"):
        register(Section(id="other", title="Other", needs="-", intro="", order=notes.order, build=_build_extra,
                         template="sections/notes.html"))
    assert "other" not in SECTIONS
