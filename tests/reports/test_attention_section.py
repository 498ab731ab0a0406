"""The attention probe's report section: added through the registries alone (probe stage + section)."""

from __future__ import annotations

import math
import re

from kvprobe.probes import STAGES
from kvprobe.probes.attention import ATTN_REGIONS
from kvprobe.reports.folder import load_run
from kvprobe.reports.html import render_html
from kvprobe.reports.sections.attention import build_attention
from kvprobe.results import ATTENTION


def test_the_attention_probe_names_its_section():
    assert STAGES["attention"].sections == ("attention",)


def test_shares_by_region_sum_to_one(tiny_results):
    d = build_attention(load_run(tiny_results))
    assert [r["region"] for r in d["rows"]] == list(ATTN_REGIONS) and d["n"] >= 1
    assert math.isclose(sum(r["share"].mean for r in d["rows"]), 1.0, abs_tol=1e-4)
    assert all(r["share"].n == d["n"] for r in d["rows"])


def test_the_page_shows_it_after_locality_and_only_with_the_table(tiny_results, variant):
    html = render_html([tiny_results])
    ids = re.findall(r'data-section="([a-z_]+)"', html)
    assert ids.index("attention") == ids.index("locality") + 1
    assert "Attention shares" in html and "attention share by region and layer" in html
    without = variant("no-attention")
    (without / ATTENTION).unlink()
    assert "attention" not in re.findall(r'data-section="([a-z_]+)"', render_html([without]))


def test_its_table_has_a_section_of_its_own_with_title_intro_and_key_counts(tiny_results):
    from kvprobe.reports.sections import SECTIONS

    html = render_html([tiny_results])
    body = html.split('<section id="attention"', 1)[1].split("</section>", 1)[0]
    assert re.search(r"<h2>\d+\. Attention shares</h2>", body)
    assert f'<p class="intro">{SECTIONS["attention"].intro[:40]}' in body.replace("&#39;", "'")
    assert "<th>region</th><th>attention share</th><th>keys per case</th>" in body
    d = build_attention(load_run(tiny_results))
    keys = re.findall(r'<td class="num">([^<]*)</td></tr>', body.split("keys per case", 1)[1])
    assert len(keys) == len(d["rows"]) and all(k != "n/a" for k in keys)  # r.keys was the dict's method
    assert [float(k) for k in keys] == [round(r["n_keys"], 1) for r in d["rows"]]
    assert keys[0] == "1.0"  # the sink is one key
