"""The section registry is the report's one list of sections: a section registered at test time, with its
own table and template, shows in its place where a folder has that table and nowhere else."""

from __future__ import annotations

import numpy as np
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
    n = len(ALL) + 1  # numbered as shown: the tiny run's sections and the extra one
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


# --- what the page shows: the notes map folded, notes by token text, editor notes, readable figures -------------

def _section(html: str, sid: str) -> str:
    return html.split(f'<section id="{sid}"', 1)[1].split("</section>", 1)[0]


def test_notes_map_opens_one_case_and_folds_the_rest(tiny_results):
    import html as html_lib
    import re

    from kvprobe.datasets.tokens import TOKENS
    from kvprobe.reports.sections.notes import N_OPEN, token_name

    notes = _section(render_html([tiny_results]), "notes")
    folds = re.findall(r'<details class="case-fold"( open)?>', notes)
    assert len(folds) == notes.count('<div class="case"') >= 1
    assert 1 <= sum(bool(f) for f in folds) <= 2 and sum(bool(f) for f in folds) == min(N_OPEN, len(folds))
    assert all(not f for f in folds[N_OPEN:])  # the rest folded
    tokens = pd.read_parquet(tiny_results / TOKENS)
    summaries = re.findall(r"<summary>(.*?)</summary>", notes, flags=re.S)
    assert len(summaries) == len(folds)
    for summary in summaries:
        case = html_lib.unescape(re.search(r"<code>([^<]+)</code>", summary).group(1))
        assert "&rarr;" in summary and "top notes:" in summary  # the field's old -> new value, then the notes
        names = [html_lib.unescape(n) for n in re.findall(r'<span class="note-name">(.*?)</span>', summary)]
        assert names, summary
        text = dict(zip(tokens[tokens.case_id == case].position, tokens[tokens.case_id == case].token))
        for name in names:  # named by the token's text, then its position: "." (pos 116)
            pos = int(re.fullmatch(r'".*" \(pos (\d+)\)', name).group(1))
            assert name == f"{token_name(text[pos])} (pos {pos})"
    assert token_name(" .") == '"."' and token_name("\n") == '"\u21b5"' and token_name("  ") == '"\u00b7"'


def test_notes_without_token_text_are_named_by_kind_and_position(variant):
    import re

    from kvprobe.datasets.tokens import TOKENS

    folder = variant()
    (folder / TOKENS).unlink()
    notes = _section(render_html([folder]), "notes")
    names = re.findall(r'<span class="note-name">(.*?)</span>', notes)
    assert names and all(re.fullmatch(r"pos \d+ \(\w+\)", n) for n in names)


def test_strategy_notes_in_words():
    from kvprobe.reports.sections.edits import strategy_notes

    missed = pd.DataFrame({"note": ["field recomputed: False"] * 3 + ["field recomputed: True"]})
    assert strategy_notes(missed) == ["missed the field on 3 of 4 cases"]
    assert strategy_notes(pd.DataFrame({"note": ["field recomputed: True", ""]})) == []
    assert strategy_notes(pd.DataFrame({"x": [1]})) == []  # an edits table without notes
    chose = pd.DataFrame({"note": ["why a", "why b", "why c"], "chose": ["oracle", "field_only", "field_only"]})
    assert strategy_notes(chose) == ["chose field_only on 2 of 3 cases, oracle on 1 of 3 cases"]
    free = pd.DataFrame({"note": ["b", "a", "a", "c", "d", None]})
    assert strategy_notes(free) == ["a (2 of 6 cases)", "b (1 of 6 cases)", "2 other notes"]


def test_a_strategy_that_missed_the_field_says_so_beside_its_row(variant):
    import re

    from kvprobe.reports.folder import load_run
    from kvprobe.reports.sections.edits import build_edits
    from kvprobe.results import EDITS

    folder = variant()
    e = pd.read_parquet(folder / EDITS)
    e["note"] = None
    e.loc[e.strategy == "selective:4:random", "note"] = "field recomputed: False"  # as cacheblend records it
    e.loc[e.strategy == "erratum", "note"] = "a note of the editor"
    e.to_parquet(folder / EDITS, index=False)
    rows = {r["strategy"]: r for r in build_edits(load_run(folder))["rows"]}
    n = rows["selective:4:random"]["n"]
    assert rows["selective:4:random"]["notes"] == [f"missed the field on {n} of {n} cases"]
    m = rows["erratum"]["n"]
    assert rows["erratum"]["notes"] == [f"a note of the editor ({m} of {m} cases)"]
    assert rows["oracle"]["notes"] == []
    edits = _section(render_html([folder]), "edits")
    assert re.search(r'<td><code>selective:4:random</code><div class="rownote warn-note">missed the field on '
                     rf'{n} of {n} cases</div></td>', edits)
    assert "a note of the editor" in edits
    assert "&dagger; missed the field" in edits and f"selective:4:random: missed the field on {n} of {n}" in edits


def _rows(points):
    return [{"strategy": s, "cot": 0, "frac": x, "agreement": Stat(y, max(0.0, y - 0.1), min(1.0, y + 0.05), 30)}
            for s, x, y in points]


CROWDED = [("stale", 0.0, 0.0), ("field_only", 0.008, 0.94), ("selective:8:attention", 0.07, 0.94),
           ("selective:8:random", 0.07, 0.94), ("selective:8:causal", 0.071, 0.96), ("cacheblend:0.15", 0.645, 0.0),
           ("erratum", 0.277, 0.97), ("field_erratum", 0.284, 1.0), ("hoist", 0.307, 1.0), ("oracle", 0.992, 1.0),
           ("auto", 0.03, 0.97), ("selective:16:causal", 0.134, 1.0)]


def _sweep():
    rows = []
    for ranking in ("attention", "causal", "random"):
        for k, frac in ((1, 0.016), (2, 0.024), (4, 0.039), (8, 0.071), (16, 0.134), (32, 0.258)):
            a = 0.94 if k < 16 else 1.0
            rows.append({"ranking": ranking, "k": k, "agreement": a, "agreement_lo": a - 0.2, "agreement_hi": 1.0,
                         "n": 16, "frac_recomputed": frac})
    return pd.DataFrame(rows)


def _boxes(fig):
    renderer = fig.canvas.get_renderer()
    return renderer, lambda artist: artist.get_window_extent(renderer)


def _overlaps(a, b) -> bool:
    return min(a.x1, b.x1) > max(a.x0, b.x0) and min(a.y1, b.y1) > max(a.y0, b.y0)


@pytest.mark.parametrize("points", [CROWDED, CROWDED[:4], [(f"s{i}", 0.1, 0.5) for i in range(6)]])
def test_frontier_labels_overlap_nothing_and_the_legend_is_outside(points):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kvprobe.reports.sections.edits import frontier_figure

    rows = _rows(points)
    fig = frontier_figure(rows, _sweep(), {"cacheblend:0.15"})
    FigureCanvasAgg(fig).draw()
    _, box = _boxes(fig)
    ax = fig.axes[0]
    labels = [t for t in ax.texts if t.get_text()]
    assert sorted(t.get_text() for t in labels) == sorted(s + (" \u2020" if s == "cacheblend:0.15" else "")
                                                           for s, _, _ in points)
    boxes = [box(t) for t in labels]
    for i, a in enumerate(boxes):
        assert all(not _overlaps(a, b) for b in boxes[i + 1:]), labels[i].get_text()
        inside = box(ax)
        assert inside.x0 - 1 <= a.x0 and a.x1 <= inside.x1 + 1 and inside.y0 - 1 <= a.y0 and a.y1 <= inside.y1 + 1
        for r in rows:  # no label covers a point
            x, y = ax.transData.transform((100 * r["frac"], r["agreement"].mean))
            assert not (a.x0 < x < a.x1 and a.y0 < y < a.y1), (labels[i].get_text(), r["strategy"])
    assert fig.legends and all(not _overlaps(box(fig.legends[0]), box(a)) for a in fig.axes)
    held_out = [ln for ln in fig.axes[1].lines if ln.get_label().startswith("selective:K:")]
    assert len(held_out) == 3  # told apart by marker and line style, not colour alone
    assert len({ln.get_marker() for ln in held_out}) == 3 and len({str(ln.get_linestyle()) for ln in held_out}) == 3


def test_locality_legend_leaves_the_layer_zero_point_in_view():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kvprobe.reports.sections.locality import locality_figure

    st = lambda m: Stat(m, m - 0.05, m + 0.05, 30)  # noqa: E731
    curves = {"topk": [(k, st(0.2)) for k in (1, 4, 8)], "randomk": [(k, st(0.05 * k)) for k in (1, 4, 8)]}
    layers = {"field": [(0, st(0.77)), (1, st(0.0)), (2, st(0.0))], "downstream": [(0, st(0.0)), (1, st(0.1))]}
    fig = locality_figure(curves, [("field", st(0.77)), ("downstream", st(0.24))], layers, True)
    FigureCanvasAgg(fig).draw()
    _, box = _boxes(fig)
    assert len(fig.legends) == 1 and not any(a.get_legend() for a in fig.axes)
    assert all(not _overlaps(box(fig.legends[0]), box(a)) for a in fig.axes)
    assert any(len(c.get_paths()) for c in fig.axes[1].collections)  # the CI bands (fill_between)


def test_text_on_a_colour_is_white_or_black_by_luminance():
    import matplotlib

    from kvprobe.reports.figures import contrast, ink, luminance

    assert ink("#67001f") == "white" and ink("#053061") == "white"  # RdBu's dark ends
    assert ink("#f7f7f7") == "black" and ink("#fddbc7") == "black"
    assert luminance("white") == pytest.approx(1.0) and luminance("black") == 0.0
    cmap = matplotlib.colormaps["RdBu_r"]
    assert min(contrast(ink(cmap(v)), cmap(v)) for v in np.linspace(0, 1, 101)) >= 4.5


def test_head_heatmap_text_reads_and_outlines_only_the_heads_that_qualify():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.patches import Rectangle

    from kvprobe.reports.figures import contrast
    from kvprobe.reports.sections.knockout import HEAD_MIN, TOP_HEADS, carriers, head_figure

    means = np.array([[0.01, 0.0, 0.0, 0.68], [0.02, 0.04, 0.01, -0.6], [0.3, 0.15, 0.02, 0.0], [0, 0.02, 0, 0.09]])
    stats = {(i, j): Stat(means[i, j], means[i, j] - 0.05, means[i, j] + 0.05, 32) for i in range(4) for j in range(4)}
    stats[(2, 1)] = Stat(0.15, -0.01, 0.3, 32)  # large enough, but its CI reaches 0
    marked, claim = carriers(stats, "recovery")
    assert marked == [(0, 3), (2, 0)]  # strongest first; >= HEAD_MIN with the CI above 0
    assert f"\u2265 {HEAD_MIN:g}" in claim and "95% CI above 0" in claim
    fig = head_figure(stats, "recovery", marked, claim)
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    mesh = ax.collections[0]
    values = [t for t in ax.texts if t.get_text()]
    assert len(values) == 16
    for t in values:
        cell = mesh.cmap(mesh.norm(float(t.get_text())))
        assert contrast(t.get_color(), cell) >= 4.5, t.get_text()
    colour = {t.get_text(): t.get_color() for t in values}
    assert colour["0.68"] == "white" and colour["0.01"] == "black"
    outlines = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
    assert sorted((int(p.get_y()), int(p.get_x())) for p in outlines) == sorted(marked)
    assert "2 of 16 heads outlined" in ax.get_title()
    many = {(0, j): Stat(0.5, 0.4, 0.6, 32) for j in range(TOP_HEADS + 3)}
    assert len(carriers(many, "recovery")[0]) == TOP_HEADS
    assert carriers({(0, 0): Stat(0.02, 0.01, 0.03, 32)}, "effect")[0] == [(0, 0)]  # raw effect: the CI alone


def test_the_page_says_what_the_heatmap_outlines(tiny_results):
    knock = _section(render_html([tiny_results]), "knockout")
    assert "Outlined:" in knock or "No head is outlined" in knock
    assert "95% CI above 0" in knock


def test_shares_get_wilson_intervals_and_means_the_bootstrap():
    share = Stat.share
    assert share([1, 0, 1, 1]) == Stat.wilson(0.75, 4)
    assert share([1.0] * 15).lo < 1.0  # 15 of 15 is not [1, 1]
    assert share([0.5, 1.0, 0.0]) == Stat.of([0.5, 1.0, 0.0])


def test_drawing_leaves_matplotlib_settings_as_they_were(tiny_results):
    import matplotlib

    before = dict(matplotlib.rcParams)
    render_html([tiny_results])
    assert dict(matplotlib.rcParams) == before
