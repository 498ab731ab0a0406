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
